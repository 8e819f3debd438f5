"""The original SmolLM2 at batch B and a long context: headkit's fast path against eager transformers, one process.

Both decode after the same prompts of random ids; the fast path through its packaged step (compiled once per
machine: the first run compiles), eager through the model's forward with a ``DynamicCache``, one token per row
per step. Prints each one's median step.

    python docs/scripts/batch_decode_probe.py [weights] [context] [batch]     # default: float32 8192 8
"""

import statistics
import sys
import time

import torch
from transformers import DynamicCache

from headkit.compat import cache_keyword
from headkit.runs.models import load_model, smollm2_gguf_path
from headkit.runtime.fast import FastDecoder

STEPS = 16


def main() -> None:
    weights = sys.argv[1] if len(sys.argv) > 1 else "float32"
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    torch.set_num_threads(2)
    model = load_model(smollm2_gguf_path(), kind="causal_lm", dtype="float32").model.eval()
    ids = torch.randint(100, 20000, (batch, context), generator=torch.Generator().manual_seed(0))
    fast = FastDecoder(model, weights=weights)
    steps: list[float] = []
    fast.generate(ids, max_new_tokens=STEPS + 1, step_seconds=steps)
    print(
        f"fast path, {weights}, batch {batch} @{context}: median step {statistics.median(steps) * 1e3:.1f} ms"
    )
    eager = fast.model  # the same prepared weights, run eagerly
    with torch.no_grad():
        cache = DynamicCache()
        logits = eager(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_keyword(cache)).logits
        token, times = logits[:, -1:].argmax(-1), []
        for _ in range(STEPS):
            started = time.perf_counter()
            logits = eager(input_ids=token, use_cache=True, logits_to_keep=1, **cache_keyword(cache)).logits
            token = logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - started)
    print(
        f"eager transformers, {weights}, batch {batch} @{context}: median step {statistics.median(times) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
