"""Measuring a GGUF file in llama.cpp itself (llama-cpp-python, the ``llamacpp`` extra): held-out perplexity
from llama.cpp's own logits, prompt-processing and generation tokens/s, and KV-cache bytes per token.

Every measurement runs in a child process (``python -m headkit.export.llamacpp``): llama-cpp-python 0.3.36's
ggml crashes (SIGSEGV in ``ggml_backend_amx_mul_mat``) when a batch of several tokens meets quantized weights on
CPUs with AMX, and a crash must cost one measurement, not the run. Quantized files are therefore evaluated one
token at a time (``n_batch=1``, which takes the plain dot-product kernels): their perplexity is exact, their
generation speed is measured after a prompt fed token by token, and their prompt-processing speed is not
measured (:data:`QUANTIZED_PP_SKIPPED`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from headkit.errors import HeadkitError
from headkit.evaluation.quality import summed_nats
from headkit.evaluation.timing import timed_call

LLAMA_CPP_INSTALL_HINT = "pip install 'headkit[llamacpp]' (llama-cpp-python)"
FLOAT_TYPES = ("f32", "f16", "bf16")
QUANTIZED_PP_SKIPPED = (
    "not measured: llama-cpp-python 0.3.36 segfaults in ggml_backend_amx_mul_mat when a batch of tokens meets "
    "quantized weights on this AMX CPU, so quantized files are evaluated one token at a time"
)
F16_CACHE_BYTES = 2  # llama.cpp's default KV cache type is f16
# llama.cpp's KV cache types (`--cache-type-k/v`) and their bytes per number: q8_0 keeps 32 numbers in 34 bytes (an
# f16 scale), q4_0 in 18. A quantized value cache needs flash attention.
CACHE_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def llamacpp_kv_cache_bytes_per_token(kv_heads: list[int], head_dim: int) -> int:
    """llama.cpp's KV cache per token of context at its default f16 cache: K and V of every key/value head of
    every layer, as the GGUF file declares them (duplicated heads included)."""
    return sum(kv_heads) * head_dim * 2 * F16_CACHE_BYTES


def _cache_type(name: str) -> int:
    import llama_cpp

    return {
        "f16": llama_cpp.GGML_TYPE_F16,
        "q8_0": llama_cpp.GGML_TYPE_Q8_0,
        "q4_0": llama_cpp.GGML_TYPE_Q4_0,
    }[name]


def _llama(
    path: str,
    *,
    n_ctx: int,
    n_batch: int,
    threads: int,
    logits_all: bool,
    flash_attn: bool = True,
    cache_type: str = "f16",
) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        type_k=_cache_type(cache_type),
        type_v=_cache_type(cache_type),
        model_path=path,
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        # llama.cpp's own tools default to flash attention on CPU (`-fa auto`); llama-cpp-python's wrapper to
        # off. Without it a deci model's per-layer KV widths make attention over a long cache 2-3x slower than
        # llama's (measured at 4,096 tokens: docs/export.md), which is the wrapper, not what users run. A
        # plain llama model decodes 1.5-2.3x faster without it on this CPU (docs/decoding.md): callers choose.
        flash_attn=flash_attn,
        verbose=False,
    )


def _perplexity(
    path: str,
    windows: list[list[int]],
    n_batch: int,
    threads: int,
    cache_type: str = "f16",
    scored: int | None = None,
) -> dict[str, Any]:
    """exp of the mean next-token NLL from llama.cpp's logits over every position of `windows` but the first, or
    over each window's last `scored` tokens; the KV cache kept as `cache_type`."""
    import numpy as np

    length = max(len(window) for window in windows)
    llm = _llama(
        path,
        n_ctx=length,
        n_batch=min(n_batch, length),
        threads=threads,
        logits_all=True,
        cache_type=cache_type,
    )
    total, count = 0.0, 0
    try:
        for window in windows:
            first = 1 if scored is None else len(window) - scored
            llm.reset()
            llm.eval(window)
            logits = torch.from_numpy(np.array(llm.scores[first - 1 : len(window) - 1], dtype=np.float32))
            total += summed_nats(logits, torch.tensor(window[first:]))
            count += len(window) - first
    finally:
        llm.close()
    return {"perplexity": math.exp(total / count), "tokens": count}


def _answers(
    path: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    n_batch: int,
    threads: int,
    cache_type: str = "f16",
) -> dict[str, Any]:
    """llama.cpp's greedy continuation (token ids, at most `max_new_tokens`) of each prompt, the KV cache kept as
    `cache_type`."""
    length = max(len(prompt) for prompt in prompts) + max_new_tokens
    llm = _llama(
        path, n_ctx=length, n_batch=n_batch, threads=threads, logits_all=False, cache_type=cache_type
    )
    answers = []
    try:
        for prompt in prompts:
            tokens = []
            for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
                if llm.token_eos() == token:
                    break
                tokens.append(int(token))
                if len(tokens) == max_new_tokens:
                    break
            answers.append(tokens)
    finally:
        llm.close()
    return {"answers": answers}


def _speed(
    path: str,
    prompt: list[int],
    steps: int,
    n_batch: int,
    threads: int,
    token_by_token_prompt: bool,
    flash_attn: bool = True,
    cache_type: str = "f16",
) -> dict[str, Any]:
    """Prompt-processing tokens/s (one ``eval`` of `prompt`) and generation tokens/s (`steps` single-token
    ``eval`` calls after it), the KV cache kept as `cache_type`, with the state size llama.cpp reports at the
    end."""
    llm = _llama(
        path,
        n_ctx=len(prompt) + steps + 1,
        n_batch=n_batch,
        threads=threads,
        logits_all=False,
        flash_attn=flash_attn,
        cache_type=cache_type,
    )
    try:
        if token_by_token_prompt:
            for token in prompt:
                llm.eval([token])
            pp = None
        else:
            _, seconds = timed_call(lambda: llm.eval(prompt))
            pp = len(prompt) / seconds
        token = prompt[-1]
        _, seconds = timed_call(lambda: [llm.eval([token]) for _ in range(steps)])
        generation = steps / seconds
        import llama_cpp

        state = (
            int(llama_cpp.llama_state_get_size(llm.ctx))
            if hasattr(llama_cpp, "llama_state_get_size")
            else None
        )
    finally:
        llm.close()
    return {"pp_tokens_per_s": pp, "gen_tokens_per_s": generation, "state_bytes": state}


_FUNCTIONS = {"perplexity": _perplexity, "speed": _speed, "answers": _answers}


def run_isolated(function: str, timeout: float | None = None, **kwargs: Any) -> dict[str, Any]:
    """``function(**kwargs)`` of this module in a child process; a crash or a failure is returned as
    ``{"error": "..."}`` (the signal or the exception), never raised."""
    with tempfile.TemporaryDirectory(prefix="headkit-llamacpp-") as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        request.write_text(json.dumps({"function": function, "kwargs": kwargs, "result": str(result)}))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")])
        )
        try:
            done = subprocess.run(
                [sys.executable, "-m", "headkit.export.llamacpp", str(request)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:g} s"}
        if done.returncode != 0 or not result.exists():
            code = done.returncode
            cause = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            tail = done.stderr.strip().splitlines()[-1:] if done.stderr.strip() else []
            return {"error": "; ".join([f"llama.cpp process {cause}", *tail])}
        return json.loads(result.read_text())


def llama_cpp_perplexity(
    path: str | Path,
    windows: list[list[int]],
    *,
    quantized: bool,
    threads: int,
    n_batch: int = 512,
    cache_type: str = "f16",
    scored: int | None = None,
) -> dict[str, Any]:
    """Held-out perplexity of the GGUF file through llama.cpp's logits (one token at a time if `quantized`), of
    every token but each window's first or of its last `scored`, the KV cache kept as `cache_type` (a key of
    :data:`CACHE_TYPE_BYTES`)."""
    return run_isolated(
        "perplexity", path=str(path), windows=windows, n_batch=1 if quantized else n_batch, threads=threads,
        cache_type=cache_type, scored=scored,
    )  # fmt: skip


def llama_cpp_answers(
    path: str | Path,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    quantized: bool,
    threads: int,
    n_batch: int = 512,
    cache_type: str = "f16",
) -> dict[str, Any]:
    """llama.cpp's greedy answers ({"answers": token ids per prompt}) to `prompts`, the KV cache kept as
    `cache_type`; a crash is returned as {"error": ...} (:func:`run_isolated`)."""
    return run_isolated(
        "answers", path=str(path), prompts=prompts, max_new_tokens=max_new_tokens,
        n_batch=1 if quantized else n_batch, threads=threads, cache_type=cache_type,
    )  # fmt: skip


def llama_cpp_speed(
    path: str | Path,
    prompt: list[int],
    *,
    steps: int,
    quantized: bool,
    threads: int,
    n_batch: int = 512,
    flash_attn: bool = True,
    cache_type: str = "f16",
) -> dict[str, Any]:
    """Prompt-processing and generation tokens/s at ``len(prompt)`` tokens of context (quantized files: the
    prompt fed token by token and its speed not measured, see the module docstring), with llama.cpp's flash
    attention on (its own tools' default on CPU) or off (llama-cpp-python's), the KV cache kept as
    `cache_type` (a quantized value cache needs flash attention)."""
    return run_isolated(
        "speed",
        path=str(path),
        prompt=prompt,
        steps=steps,
        n_batch=1 if quantized else n_batch,
        threads=threads,
        token_by_token_prompt=quantized,
        flash_attn=flash_attn,
        cache_type=cache_type,
    )


def require_llama_cpp() -> None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise HeadkitError(f"measuring in llama.cpp needs llama-cpp-python: {LLAMA_CPP_INSTALL_HINT}")


def _main(request_file: str) -> None:
    request = json.loads(Path(request_file).read_text())
    result = _FUNCTIONS[request["function"]](**request["kwargs"])
    Path(request["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
