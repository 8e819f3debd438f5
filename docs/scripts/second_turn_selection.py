"""Why the compressed cache loses the second turn, on SmolLM2-135M: the same kept tokens chosen three ways.

    PYTHONPATH=src python docs/scripts/second_turn_selection.py results.json [LENGTH] [PROMPTS] [BITS]

A second turn (headkit.evaluation.retrieval.second_turn_passkeys) prefills a passkey prompt without its last 512
tokens, then feeds those (other text, then the question) through the cache. Rows, each on the same prompts:

* the original (every token kept);
* the compressed cache at 1/8 of the bfloat16 bytes at 8,192 tokens — W 256, S 4, B 765 in bfloat16 (BITS 16, the
  default), or in 4 bits B 3,017 (BITS 4: ``headkit compress --kv-budget 1/8``'s plan before it kept the window in bfloat16 and 8 retrieval heads) —, its B keys chosen
  by the first turn's last 32 queries (SnapKV: what ``CompressedCacheConfig`` does);
* the same cache, its B keys chosen by how much the model needs them to repeat the first turn (KVzip, Kim et al.
  2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv:2505.23416, §3.2: the
  original reads the first turn, "Repeat the previous text exactly:" and the first turn again, and each key of
  the first turn scores the most attention any query of the repetition gives it, over the query heads of its
  group; the full sequence is the softmax's support).

The KVzip scores come from a registered attention function on a second copy of the original (transformers'
``AttentionInterface``) and are handed to the compressed cache through its selection, the piece that scores keys
when a prompt is prefilled (headkit.layers.kept_exact); the cache keeps the same number of tokens either way.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headkit.bench.retrieval import ANSWER_TOKENS, beyond_window_trials
from headkit.evaluation.retrieval import passkey_answer, prose_sentences, second_turn_passkeys
from headkit.runs.models import CAUSAL_LM, load_model, smollm2_gguf_path
from headkit.runs.text import load_text
from headkit.surgery import CompressedCacheConfig, QuantizedKVConfig
from headkit.surgery.apply import apply_
from headkit.surgery.linearize import linearized_modules

GAP, WINDOW, REPEAT = 512, 256, "\n\nRepeat the previous text exactly:\n"
# 1/8 of the bfloat16 bytes at 8,192 tokens: 1,024 tokens per head in bfloat16, 3,276 in 4 bits
CACHES = {
    16: [CompressedCacheConfig(window=WINDOW, sinks=4, budget=765)],
    4: [CompressedCacheConfig(window=WINDOW, sinks=4, budget=3017), QuantizedKVConfig(bits=4)],
}
SCORES: dict[int, torch.Tensor] = {}  # layer → [1, Hkv, C] of the last reconstruction
FIRST_TURN = [0]  # C: the first turn's length in the reconstruction's sequence


def reconstruction_probe(
    module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """sdpa's output, and each first-turn key's largest attention from the repetition's queries (KVzip)."""
    out = sdpa_attention_forward(module, query, key, *args, **kwargs)
    first, total = FIRST_TURN[0], query.shape[2]
    kv_heads = key.shape[1]
    groups = query.shape[1] // kv_heads
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    logits = (
        query[:, :, first:].float() @ key.float().repeat_interleave(groups, 1).transpose(-1, -2)
    ) * scale
    future = torch.arange(total)[None] > torch.arange(first, total)[:, None]
    weights = logits.masked_fill(future, float("-inf")).softmax(-1)[..., :first]  # [1, H, T − C, C]
    SCORES[module.layer_idx] = weights.amax(2).view(1, kv_heads, groups, first).amax(2)
    return out


class ReconstructionScores:
    """A compressed layer's selection that hands the prompt's keys the scores of the last reconstruction."""

    name, observation = "question", 32

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def key_scores(self, queries, keys, new_mask, scale, prefill, past=None):  # noqa: ANN001, ANN201 (the selection's call)
        if not prefill:  # a later token fills empty slots only, as the question's choice does
            return keys.new_zeros(*keys.shape[:3], dtype=torch.float32)
        return SCORES[self.layer]


def main(out: str, length: int = 2048, prompts: int = 12, bits: int = 16) -> None:
    torch.set_num_threads(1)
    loaded = load_model(smollm2_gguf_path(), kind=CAUSAL_LM)
    original, tokenizer = loaded.model.eval(), loaded.tokenizer
    sentences = prose_sentences(load_text(None), seed=0)
    _, turns = beyond_window_trials(tokenizer, sentences, (length,), prompts, WINDOW, GAP, 0)
    question = copy.deepcopy(original)
    apply_(question, CACHES[bits])
    reconstruction = copy.deepcopy(question)
    for module in linearized_modules(reconstruction):
        module.kept.selection = ReconstructionScores(module.layer_idx)
    AttentionInterface.register("kvzip_reconstruction", reconstruction_probe)
    scorer = copy.deepcopy(original)
    scorer.set_attn_implementation("kvzip_reconstruction")
    repeat = tokenizer(REPEAT, return_tensors="pt").input_ids[0]

    def reconstructed(trial: Any) -> str:
        ids = torch.tensor(trial.input_ids)
        first = ids[: len(ids) - GAP]
        FIRST_TURN[0] = len(first)
        scorer(input_ids=torch.cat([first, repeat, first])[None], use_cache=False)
        return second_turn_passkeys(
            reconstruction, tokenizer, [trial], gap=GAP, max_new_tokens=ANSWER_TOKENS
        )[0]

    rows = {}
    with torch.no_grad():
        for name, answer in (
            ("original", lambda: second_turn_passkeys(original, tokenizer, turns, gap=GAP, max_new_tokens=ANSWER_TOKENS)),
            ("compressed, keys chosen by the first turn's last queries (SnapKV)",
             lambda: second_turn_passkeys(question, tokenizer, turns, gap=GAP, max_new_tokens=ANSWER_TOKENS)),
            ("compressed, keys chosen by reconstructing the first turn (KVzip)",
             lambda: [reconstructed(trial) for trial in turns]),
        ):  # fmt: skip
            started = time.perf_counter()
            answers = answer()
            correct = sum(
                passkey_answer(text) == trial.key for trial, text in zip(turns, answers, strict=True)
            )
            rows[name] = {"correct": correct, "trials": len(turns), "seconds": time.perf_counter() - started}
            print(f"{name}: {correct}/{len(turns)} ({rows[name]['seconds']:.0f} s)", flush=True)
    results = {
        "length": length,
        "gap": GAP,
        "cache": [config.record() for config in CACHES[bits]],
        "rows": rows,
    }
    with open(out, "w") as handle:
        json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], *(int(arg) for arg in sys.argv[2:]))
