"""What quantized storage changes on a short chat, on SmolLM2-135M: a 13-token sequence (the prompt "The capital
of France is" and the 8 tokens the original continues it with) read one token at a time through each cache,
against the same converted model reading it whole (no cache: nothing quantized).

    PYTHONPATH=src python docs/scripts/short_prompt_error.py

Prints, per cache, the largest difference of any logit at any of the 9 positions read through the cache. 4-bit
storage alone keeps its newest 128 tokens in full precision (KIVI's residual), so none of these 13 is quantized;
the compressed cache in 8 or 4 bits stores every token quantized (docs/compressed-cache.md), unless its window is
kept in full precision (``full_precision_window``), which holds all 13.
"""

from __future__ import annotations

import copy

import torch

from headkit.compat import cache_keyword, output_cache
from headkit.runs.models import CAUSAL_LM, load_model, smollm2_gguf_path
from headkit.surgery import CompressedCacheConfig, QuantizedKVConfig
from headkit.surgery.apply import apply_

PROMPT, NEW_TOKENS = "The capital of France is", 8
COMPRESSED = CompressedCacheConfig(
    window=256, sinks=4, budget=560
)  # --kv-budget 1/8 at 2,048 tokens, in 4 bits


def stepwise_logits(model: torch.nn.Module, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The logits of positions prompt − 1 … end, the prompt prefilled and each later token fed alone."""
    out = model(ids[:, :prompt], use_cache=True)
    cache, logits = output_cache(out), [out.logits[:, -1]]
    for position in range(prompt, ids.shape[1]):
        out = model(ids[:, position : position + 1], **cache_keyword(cache), use_cache=True)
        cache = output_cache(out)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model(smollm2_gguf_path(), kind=CAUSAL_LM)
    original, tokenizer = loaded.model.eval(), loaded.tokenizer
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ids = original.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        print(f"sequence: {tokenizer.decode(ids[0])!r}")
        for name, configs in (
            ("original", []),
            ("compressed cache", [COMPRESSED]),
            ("4-bit storage (residual 128)", [QuantizedKVConfig(bits=4)]),
            ("compressed cache in 8 bits", [COMPRESSED, QuantizedKVConfig(bits=8)]),
            ("compressed cache in 4 bits", [COMPRESSED, QuantizedKVConfig(bits=4)]),
            (
                "compressed cache in 4 bits, window in full precision",
                [COMPRESSED, QuantizedKVConfig(bits=4, full_precision_window=True)],
            ),
        ):
            model = copy.deepcopy(original)
            if configs:
                apply_(model, configs)
            whole = model(ids).logits[:, prompt.shape[1] - 1 :]
            error = (stepwise_logits(model, ids, prompt.shape[1]) - whole).abs().max().item()
            continued = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            print(
                f"{name}: largest logit difference {error:.3g}; continues {tokenizer.decode(continued[0, prompt.shape[1] :])!r}"
            )


if __name__ == "__main__":
    main()
