"""Timing, CUDA-synchronised: the one clock (:func:`timed_call`) and the one timer of calls (:func:`time_call`);
a greedy decoding step (:func:`decode_step_seconds`, and on it :func:`time_greedy_decoding`,
:func:`decode_seconds_per_token`, :func:`decode_profile`); prefill against decode of two models
(:func:`compare_speed`); the torch threads while measuring (:func:`thread_limit`); the rate this machine reads
memory at (:func:`read_bandwidth`), against which a decoding step that must read its weights and cache is judged.

Times of two models are taken in alternation, round after round (:func:`interleaved_values`), so that a machine
whose load drifts (other processes on shared cores) slows both alike and their ratio stays meaningful.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from headkit.compat import cache_keyword, output_cache
from headkit.devices import model_device
from headkit.evaluation.memory import filled_cache
from headkit.surgery.linearize import decoding_state_bytes

T = TypeVar("T")


@contextlib.contextmanager
def thread_limit(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch threads (and BLAS threads, where threadpoolctl is installed),
    restoring the previous setting after; None leaves everything as it is. (On two shared cores a second thread
    spin-waiting in OpenMP can cost more than it brings.)"""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            yield
        else:
            with threadpool_limits(limits=threads):
                yield
    finally:
        torch.set_num_threads(previous)


def read_bandwidth(megabytes: int = 512, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second this machine reads from memory with the torch threads in force: the median of `repeats`
    sums of a float32 tensor of `megabytes` (far beyond the caches). A decoding step at batch sizes where it is
    memory-bound reads its weights and its cache once; their bytes over this rate is the fastest it can be."""
    if megabytes < 1 or repeats < 1:
        raise ValueError(f"megabytes and repeats must be at least 1, got {megabytes} and {repeats}")
    data = torch.ones(megabytes * 2**20 // 4, device=device)
    data.sum()  # the first touch (pages, threads) is not timed
    times = [timed_call(data.sum, device)[1] for _ in range(repeats)]
    return data.numel() * data.element_size() / statistics.median(times)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on ``device``: CUDA runs asynchronously, so a clock read must come after it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[T, float]:
    """(``fn()``, its wall seconds), the clock read after ``device``'s queued kernels finish: the one clock of
    every timer in headkit (:func:`time_call`, :func:`decode_step_seconds`, the fast decoder's steps)."""
    synchronize(device)
    started = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - started


@dataclass(frozen=True)
class Timing:
    """Seconds per call measured by each timed repeat, their median, and the calls each repeat averaged."""

    median_s: float
    times_s: tuple[float, ...]
    calls_per_repeat: int = 1


# A repeat never loops more than this, however fast the call: enough to average out a 1 ms scheduler hiccup.
MAX_CALLS_PER_REPEAT = 100


def time_call(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 1,
    min_repeat_s: float = 0.0,
    device: torch.device | str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Median seconds per call of ``fn()`` over ``repeats`` timed repeats, after ``warmup`` untimed calls, the
    clock read after ``device``'s queued kernels finish (:func:`synchronize`): the one timer of calls.

    A repeat of a call faster than ``min_repeat_s`` loops over enough calls to last about that long (at most
    :data:`MAX_CALLS_PER_REPEAT`, their count from the last warm-up call) and reports their mean, as :mod:`timeit`
    does: one call of a millisecond is at the mercy of a single context switch."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats <= 0:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if not min_repeat_s >= 0:
        raise ValueError(f"min_repeat_s must be ≥ 0 seconds, got {min_repeat_s!r}")
    device = torch.device(device)

    def timed(calls: int) -> float:
        synchronize(device)
        start = clock()
        for _ in range(calls):
            fn()
        synchronize(device)
        return (clock() - start) / calls

    last_call_s = 0.0
    for _ in range(warmup):
        last_call_s = timed(1)
    calls_per_repeat = 1
    if min_repeat_s > 0:
        if warmup == 0:
            last_call_s = timed(1)
        wanted = math.ceil(min_repeat_s / last_call_s) if last_call_s > 0 else MAX_CALLS_PER_REPEAT
        calls_per_repeat = min(max(wanted, 1), MAX_CALLS_PER_REPEAT)
    times = tuple(timed(calls_per_repeat) for _ in range(repeats))
    return Timing(median_s=statistics.median(times), times_s=times, calls_per_repeat=calls_per_repeat)


@torch.no_grad()
def prefill_seconds(model: nn.Module, ids: torch.Tensor) -> float:
    """Seconds of one forward of `ids` without a cache."""
    return time_call(
        lambda: model(input_ids=ids, use_cache=False), repeats=1, warmup=0, device=ids.device
    ).median_s


@torch.no_grad()
def decode_step_seconds(
    model: nn.Module, cache: Any, token: torch.Tensor, steps: int
) -> tuple[list[float], Any, torch.Tensor]:
    """Seconds of each of `steps` greedy decoding steps (one forward of one token per row, with the cache) from
    `cache` and the next input `token` [B, 1], the clock read after the device's kernels finish: the one timer
    of a decoding step. Returns (seconds per step, the cache after them, the tokens chosen [B, steps])."""
    times, chosen = [], []
    for _ in range(steps):

        def step(token: torch.Tensor = token, cache: Any = cache) -> tuple[torch.Tensor, Any]:
            output = model(input_ids=token, **cache_keyword(cache), use_cache=True)
            return output.logits[:, -1:].argmax(-1), output_cache(output)

        (token, cache), seconds = timed_call(step, token.device)
        times.append(seconds)
        chosen.append(token)
    return times, cache, torch.cat(chosen, dim=1) if chosen else token[:, :0]


@torch.no_grad()
def decode_seconds_after_filled_cache(
    model: nn.Module, batch: int, context: int, steps: int = 3
) -> list[float]:
    """Seconds of each of `steps` greedy decoding steps (:func:`decode_step_seconds`) of `batch` sequences after
    a `context`-token cache (:func:`filled_cache`), after one untimed step."""
    token = torch.ones(batch, 1, dtype=torch.long, device=model_device(model))
    _, cache, chosen = decode_step_seconds(model, filled_cache(model, batch, context), token, 1)
    return decode_step_seconds(model, cache, chosen[:, -1:], steps)[0]


@torch.no_grad()
def time_greedy_decoding(
    model: nn.Module, prompt: torch.Tensor, new_tokens: int, *, cache: Any = None
) -> tuple[float, list[float], torch.Tensor]:
    """Prefill ``prompt`` [B, P] (into `cache`, or the model's default one), then decode greedily to
    ``new_tokens`` tokens, one forward per token with the cache: the loop of greedy ``generate()`` without its
    bookkeeping. Returns (prefill seconds, seconds of every decoding step after the first token, the generated
    ids [B, new_tokens])."""
    synchronize(prompt.device)
    started = time.perf_counter()
    output = model(input_ids=prompt, **cache_keyword(cache), use_cache=True, logits_to_keep=1)
    token = output.logits[:, -1:].argmax(-1)
    synchronize(prompt.device)
    prefill_s = time.perf_counter() - started
    step_s, _, generated = decode_step_seconds(model, output_cache(output), token, new_tokens - 1)
    return prefill_s, step_s, torch.cat([token, generated], dim=1)


def decode_seconds_per_token(model: nn.Module, context: int, steps: int = 8, seed: int = 0) -> float:
    """Median seconds of one greedy decoding step (batch 1) after a seeded random `context`-token prompt."""
    vocabulary = min(int(getattr(model.config, "vocab_size", 100)), 100)
    ids = torch.randint(0, vocabulary, (1, context), generator=torch.Generator().manual_seed(seed))
    return statistics.median(time_greedy_decoding(model, ids.to(model_device(model)), steps + 1)[1])


# Tokens per forward of a long prompt's chunked prefill (decode_profile's ``prefill_tokens``): the working set of a
# forward grows with its tokens (a layer's activations, an attention's scores), the cache with the prompt.
PREFILL_TOKENS = 1024


def prefill_tokens(conversion: Any) -> int | None:
    """Tokens per forward of a linearized model's prefill (:func:`prefill`) under `conversion` (a
    :class:`~headkit.surgery.LinearizeConfig`): :data:`PREFILL_TOKENS`, or None (the whole prompt in one forward)
    where question-chosen keys (``budget``) select from the prompt's end, which each chunk would choose again."""
    return None if conversion.budget else PREFILL_TOKENS


@torch.no_grad()
def prefill(model: nn.Module, ids: torch.Tensor, chunk: int | None = None) -> tuple[Any, torch.Tensor]:
    """(the decoding cache, the greedy next token [B, 1]) after the prompt `ids` [B, T], computing only the last
    position's logits (a whole prompt's are [T, vocabulary]: 1.6 GB at 8,192 tokens on SmolLM2). With `chunk`, the
    prompt goes through in forwards of that many tokens onto the growing cache: the same cache and next token up to
    rounding (tests/evaluation/test_compare_speed.py) in one chunk's working memory, for every cache but one that
    selects by the prompt's last tokens (a compressed cache's question-chosen keys choose again at each chunk)."""
    cache, step = None, chunk or ids.shape[1]
    for start in range(0, ids.shape[1], step):
        output = model(
            input_ids=ids[:, start : start + step],
            **({} if cache is None else cache_keyword(cache)),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = output_cache(output)
    return cache, output.logits[:, -1:].argmax(-1)


@torch.no_grad()
def decode_profile(
    models: dict[str, nn.Module],
    context: int,
    steps: int,
    seed: int = 0,
    *,
    batch_sizes: tuple[int, ...] = (1,),
    prefill_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """Per batch size and model: the median milliseconds of one greedy decoding step after a `context`-token
    prompt, and the bytes of its decoding cache after the prompt.

    Each model prefills one prompt at batch 1; for a larger batch its cache is repeated along the batch
    (``Cache.batch_repeat_interleave``, as beam search does), so every row holds a real `context`-token cache
    without paying a batch-sized prefill. The models step in alternation (one untimed warm-up step, then `steps`
    timed ones), so load that drifts on shared cores slows them alike. With `prefill_tokens`, each prompt is
    prefilled in forwards of that many tokens (:func:`prefill`). Returns one entry per batch size:
    ``{"batch_size": b, name: {"ms_per_token": …, "cache_bytes": …}, …}``.
    """
    first = next(iter(models.values()))
    vocabulary = min(int(getattr(first.config, "vocab_size", 1000)), 1000)
    ids = torch.randint(0, vocabulary, (1, context), generator=torch.Generator().manual_seed(seed))
    prefilled = {name: prefill(model, ids, prefill_tokens) for name, model in models.items()}
    points = []
    for index, batch_size in enumerate(batch_sizes):
        caches, tokens, sizes = {}, {}, {}
        last = index == len(batch_sizes) - 1
        for name, (cache, token) in prefilled.items():
            # every batch size decodes from the prompt's own cache; the last one from the prompt's cache itself
            caches[name] = cache if last else copy.deepcopy(cache)
            if batch_size > 1:
                caches[name].batch_repeat_interleave(batch_size)
            tokens[name] = token.expand(batch_size, 1)
            sizes[name] = decoding_state_bytes(caches[name])
        times: dict[str, list[float]] = {name: [] for name in models}
        for step in range(steps + 1):
            for name, model in models.items():
                (elapsed,), caches[name], chosen = decode_step_seconds(model, caches[name], tokens[name], 1)
                tokens[name] = chosen[:, -1:]
                if step > 0:
                    times[name].append(elapsed)
        points.append(
            {
                "batch_size": batch_size,
                **{
                    name: {"ms_per_token": 1000 * statistics.median(times[name]), "cache_bytes": sizes[name]}
                    for name in models
                },
            }
        )
    return points


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
        {name: functools.partial(_seconds, call) for name, call in calls.items()}, rounds
    )


def _seconds(call: Callable[[], object]) -> float:
    return time_call(call, repeats=1, warmup=0).median_s


def forward_times(models: dict[str, nn.Module], batch: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of one forward of each of ``models`` on ``batch`` (without gradients), round after round (see
    :func:`interleaved_times`)."""

    def forward(model: nn.Module) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return model(**batch)

        return call

    return interleaved_times({name: forward(model) for name, model in models.items()}, rounds)
