"""What a recipe reports about a causal LM before and after surgery: held-out perplexity, top-1 agreement with
the original, KV-cache (or decoding-state) bytes per token, prefill and per-token decoding time, and a greedy
sample. Times of two models are taken in alternation, round after round, so that a machine whose load drifts
(other processes on shared cores) slows both alike and their ratio stays meaningful.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.compat import cache_keyword, output_cache
from headkit.surgery.latent import LatentCacheLayer
from headkit.surgery.linearize import decoding_state_bytes


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """exp of the mean next-token negative log-likelihood over every position of `windows` [N, L] but the first."""
    total_nll, count = 0.0, 0
    for chunk in windows.split(batch_size):
        logits = model(input_ids=chunk, use_cache=False).logits.float()
        total_nll += float(
            F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
            )
        )
        count += chunk[:, 1:].numel()
    return math.exp(total_nll / count)


@torch.no_grad()
def top1_agreement(
    model: nn.Module, reference: nn.Module, windows: torch.Tensor, batch_size: int = 4
) -> float:
    """Share of positions where `model`'s most likely next token is `reference`'s."""
    same, count = 0, 0
    for chunk in windows.split(batch_size):
        a = model(input_ids=chunk, use_cache=False).logits.argmax(-1)
        b = reference(input_ids=chunk, use_cache=False).logits.argmax(-1)
        same += int((a == b).sum())
        count += a.numel()
    return same / count


@torch.no_grad()
def cache_bytes(model: nn.Module, context: int) -> int:
    """Bytes of the decoding cache after a prompt of `context` tokens (batch 1)."""
    ids = torch.zeros(1, context, dtype=torch.long)
    return decoding_state_bytes(output_cache(model(input_ids=ids, use_cache=True)))


def kv_cache_bytes_per_token(model: nn.Module, context: int = 64) -> float:
    """Growth of the decoding cache per token of context (0 for a constant-size state)."""
    return (cache_bytes(model, 2 * context) - cache_bytes(model, context)) / context


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@torch.no_grad()
def prefill_seconds(model: nn.Module, ids: torch.Tensor) -> float:
    started = time.perf_counter()
    model(input_ids=ids, use_cache=False)
    return time.perf_counter() - started


@torch.no_grad()
def decode_seconds_per_token(model: nn.Module, context: int, steps: int = 8) -> float:
    """Median seconds of one greedy decoding step (batch 1) after a `context`-token prompt."""
    ids = torch.randint(0, 100, (1, context))
    output = model(input_ids=ids, use_cache=True)
    cache, token = output_cache(output), output.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        output = model(input_ids=token, **cache_keyword(cache), use_cache=True)
        times.append(time.perf_counter() - started)
        cache, token = output_cache(output), output.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def compare_speed(
    original: nn.Module, other: nn.Module, *, prefill_ids: torch.Tensor, decode_context: int, rounds: int = 3
) -> dict[str, float]:
    """Prefill and per-token decode times of both models, alternated round after round (medians, ms; the
    order reversed every other round, as in :func:`interleaved_times`)."""
    for model in (original, other):  # warm-up outside the rounds: lazy initialisation, allocator caches
        prefill_seconds(model, prefill_ids[:, :8])
    models = {"original": original, "other": other}
    prefill = interleaved_values(
        {name: functools.partial(prefill_seconds, m, prefill_ids) for name, m in models.items()}, rounds
    )
    decode = interleaved_values(
        {name: functools.partial(decode_seconds_per_token, m, decode_context) for name, m in models.items()},
        rounds,
    )
    result = {
        "prefill_ms_original": 1000 * statistics.median(prefill["original"]),
        "prefill_ms": 1000 * statistics.median(prefill["other"]),
        "decode_ms_per_token_original": 1000 * statistics.median(decode["original"]),
        "decode_ms_per_token": 1000 * statistics.median(decode["other"]),
        "prefill_tokens": int(prefill_ids.shape[1]),
        "decode_context": decode_context,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
    }
    result["prefill_ratio"] = result["prefill_ms"] / result["prefill_ms_original"]
    result["decode_ratio"] = result["decode_ms_per_token"] / result["decode_ms_per_token_original"]
    return result


@torch.no_grad()
def greedy_sample(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 24) -> str:
    """The model's greedy continuation of `prompt` (the continuation only)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=getattr(tokenizer, "pad_token_id", None) or getattr(tokenizer, "eos_token_id", None),
    )
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)


def interleaved_values(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """What each of ``measures`` returns, round after round, the order reversed every other round (a call that
    follows another can find the caches warm or the clock boosted): a machine whose load drifts slows every
    call alike, so ratios within a round hold."""
    values: dict[str, list[float]] = {name: [] for name in measures}
    for round_ in range(rounds):
        for name in list(measures) if round_ % 2 == 0 else list(reversed(measures)):
            values[name].append(measures[name]())
    return values


def interleaved_times(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of one call of each of ``calls``, round after round (see :func:`interleaved_values`), after one
    warm-up call of each."""
    for call in calls.values():
        call()  # lazy initialisation, allocator caches
    return interleaved_values(
        {name: functools.partial(median_seconds, call, 1) for name, call in calls.items()}, rounds
    )


def forward_times(models: dict[str, nn.Module], batch: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of one forward of each of ``models`` on ``batch`` (without gradients), round after round (see
    :func:`interleaved_times`)."""

    def forward(model: nn.Module) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return model(**batch)

        return call

    return interleaved_times({name: forward(model) for name, model in models.items()}, rounds)


def filled_cache(model: nn.Module, batch: int, context: int, seed: int = 0) -> Any:
    """The model's decoding cache for `batch` sequences of `context` tokens, without running a `context`-token
    prefill: a two-token prefill builds the entries the model's layers use, then every key/value entry (keys and
    values [B, G, T, D]) and every latent entry (:class:`~headkit.surgery.latent.LatentCacheLayer`, [B, T, W]) is
    filled with `context` tokens of random numbers. Decoding time and memory depend on the sizes, not the values;
    a constant-size state is left as the prefill made it."""
    generator = torch.Generator().manual_seed(seed)
    parameter = next(model.parameters())
    ids = torch.zeros(batch, 2, dtype=torch.long, device=parameter.device)
    cache = output_cache(model(input_ids=ids, use_cache=True))

    def random(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[dim] = context
        return torch.randn(shape, generator=generator, dtype=tensor.dtype).to(tensor.device)

    for layer in cache.layers:
        if isinstance(layer, LatentCacheLayer):
            layer.state, layer.seen_tokens = random(layer.state, 1), context
        elif getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
            layer.keys, layer.values = random(layer.keys, 2), random(layer.values, 2)
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = context
    return cache


@torch.no_grad()
def decode_step_seconds(model: nn.Module, batch: int, context: int, steps: int = 3) -> list[float]:
    """Seconds of each of `steps` greedy decoding steps of `batch` sequences after a `context`-token cache
    (:func:`filled_cache`), after one untimed step."""
    cache = filled_cache(model, batch, context)
    parameter = next(model.parameters())
    token = torch.ones(batch, 1, dtype=torch.long, device=parameter.device)
    model(input_ids=token, **cache_keyword(cache), use_cache=True)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model(input_ids=token, **cache_keyword(cache), use_cache=True)
        times.append(time.perf_counter() - started)
    return times


def peak_resident_bytes(fn: Callable[[], object]) -> int | None:
    """The process's peak resident memory (VmHWM) while `fn` runs, the peak reset before it (Linux
    ``/proc/self/clear_refs``); None where the kernel offers neither."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return None
    fn()
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


@torch.no_grad()
def decode_peak_bytes(model: nn.Module, batch: int, context: int) -> int | None:
    """Peak resident memory of the process while `model` fills a `context`-token cache for `batch` sequences and
    decodes one token from it (the weights of every model the process holds included)."""
    parameter = next(model.parameters())
    token = torch.ones(batch, 1, dtype=torch.long, device=parameter.device)

    def run() -> None:
        cache = filled_cache(model, batch, context)
        model(input_ids=token, **cache_keyword(cache), use_cache=True)
        del cache

    return peak_resident_bytes(run)
