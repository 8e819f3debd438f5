"""Where a fresh process's first fast-path step goes: SmolLM2 through headkit's fast path, load, prefill and the
first step (compile, or inductor's cache), with dynamo's per-phase compile times and the graph-cache counters.

    python docs/scripts/compile_probe.py [float32|bfloat16|int8]     # run twice: the second process hits the cache
"""

import sys
import time

started = time.perf_counter()
import torch  # noqa: E402
from torch._dynamo.utils import compile_times, counters  # noqa: E402

from headkit.runs.models import load_model, smollm2_gguf_path  # noqa: E402
from headkit.runtime.fast import FastDecoder  # noqa: E402

weights = sys.argv[1] if len(sys.argv) > 1 else "float32"
model = load_model(smollm2_gguf_path(), kind="causal_lm", dtype="float32").model.eval()
loaded = time.perf_counter()
decoder = FastDecoder(model, weights=weights)
ids = torch.randint(0, 1000, (1, 500), generator=torch.Generator().manual_seed(0))
before = time.perf_counter()
decoder.generate(ids, max_new_tokens=2)
first = time.perf_counter() - before
cache = {name: value for name, value in counters["inductor"].items() if "cache" in name}
print(
    f"{weights}: imports + load {loaded - started:.1f} s, decoder built {before - loaded:.1f} s, prefill + first "
    f"step {first:.1f} s (first step {next(iter(decoder.compile_seconds.values())):.1f} s); graph cache {cache}"
)
print(compile_times(repr="str", aggregate=True))
