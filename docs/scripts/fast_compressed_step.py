"""The fast path's decoding step (headkit.FastDecoder) of SmolLM2-135M with the compressed cache (W 256, B 939,
8 retrieval heads), not quantized or stored in 8/4 bits, its buffers sized for 8,192 tokens (a step reads its whole
buffers, so its time is that after a prompt of that length): the median of a second generation's steps after a
1,500-token prompt repeated per row. Arguments: bits (16: not quantized), batch, threads.

    PYTHONPATH=src python docs/scripts/fast_compressed_step.py 8 1 1
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from quantized_eager_step import compressed_smollm2  # this folder is the script's first import path

from headkit.runtime.fast import FastDecoder


def main(bits: int, batch: int, threads: int) -> None:
    torch.set_num_threads(threads)
    model, ids = compressed_smollm2(bits, 1500)
    ids = ids.expand(batch, -1).contiguous()
    decoder = FastDecoder(model)
    started = time.perf_counter()
    decoder.generate(ids, max_new_tokens=12, cache_length=8192)  # compiles the bucket
    print(f"first generation (compiling): {time.perf_counter() - started:.0f} s")
    steps: list[float] = []
    decoder.generate(ids, max_new_tokens=12, cache_length=8192, step_seconds=steps)
    name = f"int{bits}" if bits < 16 else "not quantized"
    print(f"{name}, batch {batch}: median step {1000 * statistics.median(steps[1:]):.1f} ms")


if __name__ == "__main__":
    main(*(int(argument) for argument in sys.argv[1:4]))
