"""The eager decoding step of SmolLM2-135M with the compressed cache (W 256, B 939, 8 retrieval heads), alone or
stored in 8/4 bits: the prompt's seconds and each step's milliseconds after it (model(...) with the cache, as
generate runs it). Arguments: context, bits (16: not quantized), steps. One thread.

    PYTHONPATH=src python docs/scripts/quantized_eager_step.py 8192 8 4
"""

from __future__ import annotations

import sys
import time

import torch

import headkit
from headkit.compat import cache_keyword, output_cache
from headkit.runs.models import load_model, smollm2_gguf_path
from headkit.runs.text import load_text
from headkit.surgery import CompressedCacheConfig, QuantizedKVConfig

RETRIEVAL_HEADS = ((2, 0), (5, 1), (9, 2), (13, 0), (17, 1), (21, 2), (25, 0), (28, 1))


def compressed_smollm2(bits: int, context: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """SmolLM2 in float32 with the compressed cache (in `bits`; 16: not quantized) and the first `context` tokens
    of the held-out text [1, context]."""
    loaded = load_model(smollm2_gguf_path(), dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    configs: list = [CompressedCacheConfig(window=256, budget=939, retrieval_heads=RETRIEVAL_HEADS)]
    if bits < 16:
        configs.append(QuantizedKVConfig(bits=bits))
    headkit.apply_(model, configs)
    text = "\n".join(document.text for document in load_text(None).held_out)
    return model, tokenizer(text, return_tensors="pt").input_ids[:, :context]


def main(context: int, bits: int, steps: int) -> None:
    torch.set_num_threads(1)
    model, ids = compressed_smollm2(bits, context)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        print(f"prompt of {ids.shape[1]} tokens: {time.perf_counter() - start:.1f} s")
        cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(token, use_cache=True, **cache_keyword(cache))
            times.append(1000 * (time.perf_counter() - start))
            cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
    print(
        f"{'int' + str(bits) if bits < 16 else 'not quantized'}: steps {', '.join(f'{t:.1f}' for t in times)} ms"
    )


if __name__ == "__main__":
    main(*(int(argument) for argument in sys.argv[1:4]))
