"""Why a linearized model breaks beyond its training length, measured layer by layer (docs/linearize.md,
"Beyond the training length").

For a few of SmolLM2-135M-Instruct's layers, Hedgehog feature maps are trained by attention transfer (MSE to the
original layer's softmax output, from the original's own queries, keys and values) on 1,024-token windows, then
the hybrid's relative error is measured by position on 4,096-token held-out windows — once with the feature maps
reading the rotated queries and keys (LoLCATs), once with the slow rotary pairs (wavelength > 1,024 tokens)
rotated back (``LinearizeConfig.feature_wavelength``). About 4 minutes on one core:

    python docs/scripts/feature_extrapolation.py --layers 4,7,12,20 --steps 60
"""

import argparse
import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headkit.layers.feature_maps import build_feature_map
from headkit.ops.hybrid import hybrid_attention
from headkit.ops.rotary import unrotate_pairs
from headkit.runs.models import CAUSAL_LM, load_model, smollm2_gguf_path
from headkit.runs.text import lm_windows, load_text

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--layers", default="4,7,12,20")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--train-length", type=int, default=1024)
parser.add_argument("--window", type=int, default=256)
arguments = parser.parse_args()
layers = [int(x) for x in arguments.layers.split(",")]
torch.manual_seed(0)

loaded = load_model(smollm2_gguf_path(), kind=CAUSAL_LM)
model, tokenizer = loaded.model.eval(), loaded.tokenizer
corpus = load_text(None)
train = lm_windows(
    tokenizer, corpus, length=arguments.train_length, train_windows=8, held_out_windows=1
).train
test = lm_windows(tokenizer, corpus, length=4096, train_windows=1, held_out_windows=2).held_out

captured: dict[int, tuple] = {}


def record(module, query, key, value, mask, **options):
    output, weights = sdpa_attention_forward(module, query, key, value, mask, **options)
    if module.layer_idx in layers:
        captured[module.layer_idx] = (query.detach(), key.detach(), value.detach(), output.detach())
    return output, weights


AttentionInterface.register("headkit_record", record)
model.set_attn_implementation("headkit_record")


def capture(ids: torch.Tensor) -> dict[int, tuple]:
    captured.clear()
    with torch.no_grad():
        model(ids)
    return dict(captured)


training = [capture(torch.stack([w["input_ids"] for w in train[i : i + 4]])) for i in (0, 4)]
testing = [capture(ids[None]) for ids in test]
inverse_frequencies = model.model.rotary_emb.inv_freq.float()
slow = 2 * math.pi / inverse_frequencies > arguments.train_length
print(f"rotary pairs slower than {arguments.train_length} tokens: {int(slow.sum())} of {len(slow)}")


def tables(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(length).float()[:, None] * inverse_frequencies[None]
    angles = torch.cat((angles, angles), -1)[None]
    return angles.cos(), angles.sin()


def hybrid(maps, query, key, value, rotated_back: bool) -> torch.Tensor:
    feature_map_q, feature_map_k, log_balance = maps
    if rotated_back:
        cos, sin = tables(query.shape[2])
        query_in, key_in = (unrotate_pairs(x, cos, sin, slow) for x in (query, key))
    else:
        query_in, key_in = query, key
    out, _ = hybrid_attention(
        query, key, value, feature_map_q(query_in), feature_map_k(key_in), log_balance.exp(),
        window=arguments.window, scale=query.shape[-1] ** -0.5, chunk_size=64,
    )  # fmt: skip
    return out.transpose(1, 2)


buckets = [(768, 1024), (1792, 2048), (3840, 4096)]
for layer in layers:
    for rotated_back in (False, True):
        torch.manual_seed(0)
        query, key = training[0][layer][:2]
        maps = (
            build_feature_map("hedgehog", query.shape[1], query.shape[-1]),
            build_feature_map("hedgehog", key.shape[1], key.shape[-1]),
            torch.nn.Parameter(torch.zeros(query.shape[1])),
        )
        optimizer = torch.optim.Adam([*maps[0].parameters(), *maps[1].parameters(), maps[2]], lr=1e-2)
        for step in range(arguments.steps):
            query, key, value, target = training[step % 2][layer]
            loss = torch.nn.functional.mse_loss(hybrid(maps, query, key, value, rotated_back), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        errors = []
        with torch.no_grad():
            for low, high in buckets:
                error = 0.0
                for calls in testing:
                    query, key, value, target = calls[layer]
                    difference = hybrid(maps, query, key, value, rotated_back) - target
                    error += (
                        difference[:, low:high].pow(2).sum().item() / target[:, low:high].pow(2).sum().item()
                    )
                errors.append(error / len(testing))
        name = "slow pairs rotated back" if rotated_back else "every pair rotated"
        print(
            f"layer {layer:2d} {name:24s} relative error "
            + "  ".join(
                f"[{low},{high}) {error:.3f}" for (low, high), error in zip(buckets, errors, strict=True)
            )
        )
