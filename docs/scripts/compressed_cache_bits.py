"""What the bits add to the compressed cache, on SmolLM2-135M: perplexity read through the cache of the compressed
cache alone, with its keys and values in 8 bits and in 4 bits at the same tokens, and the configuration
``headkit compress --kv-budget 1/8`` plans at 1,024 tokens (the compressed cache in 4 bits, 3.2 times the tokens).

    PYTHONPATH=src python docs/scripts/compressed_cache_bits.py results.json

Two held-out windows of 1,024 tokens (the standard library's source, seed 0): the first 768 prefilled, the last 256
fed 16 at a time through the cache (headkit.evaluation.continuation_perplexity); bytes are bfloat16 at 1,024 tokens.
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch

import headkit
from headkit.evaluation.quality import continuation_perplexity
from headkit.recipes.cache_budget import cache_plan
from headkit.runs.models import CAUSAL_LM, load_model, smollm2_gguf_path
from headkit.runs.text import held_out_by_length, load_text
from headkit.surgery import CompressedCacheConfig, QuantizedKVConfig, bytes_per_token

CONTEXT, SCORED, CHUNK = 1024, 256, 16


def main(out: str) -> None:
    torch.set_num_threads(2)
    loaded = load_model(smollm2_gguf_path(), kind=CAUSAL_LM)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    windows = held_out_by_length(tokenizer, load_text(None), (CONTEXT,), 2, 0)[CONTEXT]
    # 1/8 of the bfloat16 bytes at 1,024 tokens: 4 sinks + 61 window + 63 chosen = 128 tokens stored per head
    alone = CompressedCacheConfig(window=62, sinks=4, budget=63, observation=32)
    plan = cache_plan(model.config, 1 / 8, CONTEXT)
    rows = {
        "original": [],
        "compressed (1/8, 128 tokens)": [alone],
        "compressed + int8 (same tokens)": [alone, QuantizedKVConfig(bits=8)],
        "compressed + int4 (same tokens)": [alone, QuantizedKVConfig(bits=4)],
        "plan 1/8: " + plan.reason: list(plan.configs),
    }
    full = bytes_per_token(model.config, context=CONTEXT)
    results = {}
    for name, configs in rows.items():
        started = time.perf_counter()
        converted = copy.deepcopy(model)
        if configs:
            headkit.apply_(converted, configs)
        with torch.no_grad():
            perplexity = continuation_perplexity(converted, windows, scored=SCORED, chunk=CHUNK)
        fraction = bytes_per_token(model.config, configs, context=CONTEXT) / full
        seconds = time.perf_counter() - started
        results[name] = {
            "perplexity": perplexity,
            "fraction": fraction,
            "seconds": seconds,
            "configs": [{"config": type(c).__name__} | c.record() for c in configs],
        }
        print(
            f"{name}: perplexity {perplexity:.4f}, {fraction:.4f} of the bf16 bytes, {seconds:.0f} s",
            flush=True,
        )
    with open(out, "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
