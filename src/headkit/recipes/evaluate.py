"""The one evaluator: every measurement headkit reports about a model, each defined once here, which the recipes'
reports, the benchmarks and ``headkit eval`` call.

- the next-token loss (:func:`next_token_nats`) behind held-out perplexity (:func:`perplexity`) and bits per byte
  (:func:`held_out_bits_per_byte`); top-1 agreement and KL against a reference (:func:`agreement`);
- timing, CUDA-synchronised: of any call (:func:`time_call`), of a greedy decoding step (:func:`decode_step_seconds`,
  and on it :func:`time_greedy_decoding`, :func:`decode_seconds_per_token`, :func:`decode_profile`); the bytes of
  the decoding state (:func:`cache_bytes`), a greedy sample;
- encoders: cosine of mean-pooled embeddings (:func:`embedding_cosine`);
- passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv:2305.16300, §4.2): a key stated once
  inside natural filler text, asked for at the end, scored by exact match of the greedy answer, with Wilson 95%
  intervals (:func:`passkey_trials`, :func:`retrieve_passkeys`, :func:`score_passkeys`);
- :func:`evaluate`: all of them on one model (and its reference), what ``headkit eval`` runs.

Times of two models are taken in alternation, round after round, so that a machine whose load drifts (other
processes on shared cores) slows both alike and their ratio stays meaningful.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import io
import math
import random
import re
import statistics
import time
import tokenize
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from headkit.analysis.plots import plot_passkey_heatmap
from headkit.analysis.retrieval import RetrievalExample
from headkit.compat import cache_keyword, output_cache
from headkit.data import Corpus, count_text_bytes
from headkit.errors import HeadkitError
from headkit.files import check_output_folder, write_json_atomic
from headkit.recipes.objectives import mean_pool, next_token_kl
from headkit.recipes.tasks import (
    LoadedTasks,
    TaskSettings,
    as_task_names,
    check_task_settings,
    format_task_table,
    load_tasks,
    measure_tasks,
)
from headkit.surgery.latent import LatentCacheLayer
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


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def summed_nats(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Σ −log softmax(logits)[target] in nats over rows ([N, V] logits, [N] targets), in float32 at least: the
    one next-token loss behind perplexity and bits per byte, headkit's models' and llama.cpp's alike."""
    return float(F.cross_entropy(logits.float(), targets, reduction="sum"))


@torch.no_grad()
def next_token_nats(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 4, ignored_ids: torch.Tensor | None = None
) -> tuple[float, torch.Tensor]:
    """The summed next-token negative log-likelihood (nats) of `model` over `windows` [N, T] — every token but
    the first of each window predicted, except those in `ignored_ids` (special tokens: document separators) —
    and the mask of the predicted targets [N, T − 1]: the one loss behind perplexity and bits per byte."""
    device = _device(model)
    total, predicted = 0.0, []
    for chunk in windows.split(batch_size):
        targets = chunk[:, 1:].to(device)
        keep = torch.ones_like(targets, dtype=torch.bool)
        if ignored_ids is not None and ignored_ids.numel():
            keep = ~torch.isin(targets, ignored_ids.to(device))
        logits = model(input_ids=chunk.to(device), use_cache=False).logits[:, :-1]
        total += summed_nats(logits[keep], targets[keep])
        predicted.append(keep.cpu())
    return total, torch.cat(predicted)


def perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """exp of the mean next-token negative log-likelihood over every position of `windows` [N, L] but the first."""
    nats, predicted = next_token_nats(model, windows, batch_size)
    return math.exp(nats / int(predicted.sum()))


def held_out_bits_per_byte(
    model: nn.Module,
    windows: torch.Tensor,
    tokenizer: Any,
    ignored_ids: torch.Tensor | None = None,
    batch_size: int = 8,
) -> float:
    """Bits per UTF-8 byte of the next-token loss over ``windows`` [N, T] (tokens 1… of each are predicted), in
    evaluation mode (the model's mode restored after).

    Tokens in ``ignored_ids`` (special tokens) are not predicted and their bytes are not counted.
    """
    was_training = model.training
    model.eval()
    try:
        nats, predicted = next_token_nats(model, windows, batch_size, ignored_ids)
    finally:
        model.train(was_training)
    total_bytes = sum(
        count_text_bytes(tokenizer, row[1:][mask]) for row, mask in zip(windows, predicted, strict=True)
    )
    if total_bytes == 0:
        raise HeadkitError("the held-out windows encode no text bytes; use a larger held-out split")
    return nats / (math.log(2) * total_bytes)


@dataclass(frozen=True)
class Agreement:
    """How closely a model's next-token predictions follow a reference's on the same windows: the share of
    positions whose most likely token is the same (``top1``), and the mean KL(reference ‖ model) of the
    next-token distributions in nats (``kl``)."""

    top1: float
    kl: float


@torch.no_grad()
def agreement(
    model: nn.Module, reference: nn.Module, windows: torch.Tensor, batch_size: int = 4
) -> Agreement:
    """Top-1 agreement and mean KL(reference ‖ model) (:func:`headkit.recipes.objectives.next_token_kl`, the
    distillation loss at τ = 1) over every position of `windows` [N, L]."""
    same, kl_sum, count = 0, 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(next(model.parameters()).device)
        got = model(input_ids=chunk, use_cache=False).logits.float()
        expected = reference(input_ids=chunk.to(next(reference.parameters()).device), use_cache=False).logits
        expected = expected.float().to(got.device)
        same += int((got.argmax(-1) == expected.argmax(-1)).sum())
        kl_sum += float(next_token_kl(got, expected)) * chunk.numel()
        count += chunk.numel()
    return Agreement(top1=same / count, kl=kl_sum / count)


@torch.no_grad()
def last_hidden_states(model: nn.Module, batches: Sequence[dict]) -> list[torch.Tensor]:
    """An encoder's last hidden states [B, T, hidden] on each of `batches`."""
    return [model(**batch).last_hidden_state for batch in batches]


@torch.no_grad()
def embedding_cosine(
    model: nn.Module | Sequence[torch.Tensor],
    reference: nn.Module | Sequence[torch.Tensor],
    batches: Sequence[dict],
) -> torch.Tensor:
    """Per text of `batches`: the cosine of `model`'s and `reference`'s sentence embeddings (mean-pooled last
    hidden states over real tokens, sentence-transformers' pooling) [texts]. Each of `model` and `reference` is
    an encoder or its :func:`last_hidden_states` on `batches` (a reference's, computed once for many students)."""
    states = [
        last_hidden_states(side, batches) if isinstance(side, nn.Module) else list(side)
        for side in (model, reference)
    ]
    return torch.cat(
        [
            F.cosine_similarity(
                mean_pool(got, b["attention_mask"]), mean_pool(expected, b["attention_mask"]), dim=-1
            )
            for got, expected, b in zip(*states, batches, strict=True)
        ]
    )


@torch.no_grad()
def cache_bytes(model: nn.Module, context: int) -> int:
    """Bytes of the decoding cache after a prompt of `context` tokens (batch 1)."""
    ids = torch.zeros(1, context, dtype=torch.long)
    return decoding_state_bytes(output_cache(model(input_ids=ids, use_cache=True)))


def kv_cache_bytes_per_token(model: nn.Module, context: int = 64) -> float:
    """Growth of the decoding cache per token of context (0 for a constant-size state)."""
    return (cache_bytes(model, 2 * context) - cache_bytes(model, context)) / context


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


def filled_cache(model: nn.Module, batch: int, context: int, seed: int = 0) -> Any:
    """The model's decoding cache for `batch` sequences of `context` tokens, without running a `context`-token
    prefill: a two-token prefill builds the entries the model's layers use, then every key/value entry (keys and
    values [B, G, T, D]) and every latent entry (:class:`~headkit.surgery.latent.LatentCacheLayer`, [B, T, W]) is
    filled with `context` tokens of random numbers. Decoding time and memory depend on the sizes, not the values;
    a constant-size state is left as the prefill made it."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, 2, dtype=torch.long, device=_device(model))
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
def decode_seconds_after_filled_cache(
    model: nn.Module, batch: int, context: int, steps: int = 3
) -> list[float]:
    """Seconds of each of `steps` greedy decoding steps (:func:`decode_step_seconds`) of `batch` sequences after
    a `context`-token cache (:func:`filled_cache`), after one untimed step."""
    token = torch.ones(batch, 1, dtype=torch.long, device=_device(model))
    _, cache, chosen = decode_step_seconds(model, filled_cache(model, batch, context), token, 1)
    return decode_step_seconds(model, cache, chosen[:, -1:], steps)[0]


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
    token = torch.ones(batch, 1, dtype=torch.long, device=_device(model))

    def run() -> None:
        cache = filled_cache(model, batch, context)
        model(input_ids=token, **cache_keyword(cache), use_cache=True)
        del cache

    return peak_resident_bytes(run)


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
    return statistics.median(time_greedy_decoding(model, ids.to(_device(model)), steps + 1)[1])


@torch.no_grad()
def decode_profile(
    models: dict[str, nn.Module],
    context: int,
    steps: int,
    seed: int = 0,
    *,
    batch_sizes: tuple[int, ...] = (1,),
) -> list[dict[str, Any]]:
    """Per batch size and model: the median milliseconds of one greedy decoding step after a `context`-token
    prompt, and the bytes of its decoding cache after the prompt.

    Each model prefills one prompt at batch 1; for a larger batch its cache is repeated along the batch
    (``Cache.batch_repeat_interleave``, as beam search does), so every row holds a real `context`-token cache
    without paying a batch-sized prefill. The models step in alternation (one untimed warm-up step, then `steps`
    timed ones), so load that drifts on shared cores slows them alike. Returns one entry per batch size:
    ``{"batch_size": b, name: {"ms_per_token": …, "cache_bytes": …}, …}``.
    """
    first = next(iter(models.values()))
    vocabulary = min(int(getattr(first.config, "vocab_size", 1000)), 1000)
    ids = torch.randint(0, vocabulary, (1, context), generator=torch.Generator().manual_seed(seed))
    prefilled = {}
    for name, model in models.items():
        output = model(input_ids=ids, use_cache=True)
        prefilled[name] = (output_cache(output), output.logits[:, -1:].argmax(-1))
    points = []
    for batch_size in batch_sizes:
        caches, tokens, sizes = {}, {}, {}
        for name, (cache, token) in prefilled.items():
            caches[name] = copy.deepcopy(cache)  # every batch size decodes from the prompt's own cache
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


def generate_tokens(
    model: Any,
    prompts: torch.Tensor,
    max_new_tokens: int,
    pad_token_id: int | None,
    *,
    exact: bool = False,
    **options: Any,
) -> torch.Tensor:
    """``model.generate`` after each of ``prompts`` [N, P] (no padding): greedy unless ``do_sample=True``, none
    of the generation config's top-k, top-p or temperature applied; exactly ``max_new_tokens`` new tokens with
    ``exact``, else up to them. Returns the whole sequences [N, P + n]."""
    lengths = {"max_new_tokens": max_new_tokens} | ({"min_new_tokens": max_new_tokens} if exact else {})
    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        top_k=None,
        top_p=None,
        temperature=None,
        pad_token_id=pad_token_id,
        **lengths,
        **({"do_sample": False} | options),
    )


def pad_token_of(tokenizer: Any) -> int | None:
    """The tokenizer's padding token, else its end token (what generate() pads finished rows with)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else getattr(tokenizer, "eos_token_id", None)


@torch.no_grad()
def greedy_sample(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 24) -> str:
    """The model's greedy continuation of `prompt` (the continuation only)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    output = generate_tokens(model, ids, max_new_tokens, pad_token_of(tokenizer))
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


# -- passkey retrieval -------------------------------------------------------------------------------------------

KEY_DIGITS = 5
# z of a two-sided 95% interval.
Z_95 = 1.959963984540054
# A filler sentence from prose: letters, spaces and plain punctuation only, so no code reads as prose and the key
# is the only number in the text.
_PROSE_SENTENCE = re.compile(r"[A-Za-z][A-Za-z ,;:'()\-]*[.!?]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
MIN_SENTENCE_WORDS, MAX_SENTENCE_WORDS = 5, 40


@dataclass(frozen=True)
class PasskeyFormat:
    """How a passkey prompt reads: ``instruction``, the document (filler with ``key_sentence`` inside),
    ``question``; then the answer starts with ``answer_prefix``. With ``chat`` and a tokenizer that has a chat
    template, the instruction, document and question are the user's turn and the answer prefix opens the
    assistant's (``apply_chat_template(..., add_generation_prompt=True)``); otherwise they are plain text, one
    after the other."""

    key_sentence: str = "The pass key is {key}. Remember it. {key} is the pass key."
    instruction: str = (
        "There is a pass key, a five-digit number, hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about it."
    )
    # Calibrated on SmolLM2-135M-Instruct with the embedded corpus' prose (docs/evaluate.md):
    # "What is the pass key?" answered by "The pass key is" lets it define the term instead ("… is a string
    # that …": 0-15% at 1,024 tokens); naming the five digits twice gets the number (9/10).
    question: str = "What is the five-digit pass key?"
    answer_prefix: str = "The five-digit pass key is"
    chat: bool = True
    separator: str = "\n\n"  # between the instruction, the document and the question


# The format of instruction-tuned models (SmolLM2-135M-Instruct): the default of headkit eval.
INSTRUCTION_FORMAT = PasskeyFormat()


@dataclass(frozen=True)
class PasskeyTrial:
    """One passkey prompt: ``length`` tokens with the answer, the prompt ``input_ids`` the ``length −
    answer_tokens`` before it; the key sentence starts at token ``key_position``, at ``depth`` (the share of the
    filler before it: 0 = first, 1 = just before the question)."""

    input_ids: tuple[int, ...]
    key: str
    depth: float
    key_position: int
    length: int


def prose_sentences(corpus: Corpus, limit: int = 20_000, seed: int = 0) -> list[str]:
    """Up to `limit` filler sentences from `corpus`'s held-out documents (then its training ones), in a seeded
    document order and in reading order within a document: of Python source, the prose of its docstrings and
    comments (:func:`python_prose`); of any other text, the text itself. Only sentences that read as prose are
    kept: 5 to 40 words of letters and plain punctuation (no digits: the key is the only number)."""
    documents = list(corpus.held_out) + list(corpus.train)
    random.Random(seed).shuffle(documents)
    sentences: list[str] = []
    for document in documents:
        text = python_prose(document.text) if document.name.endswith(".py") else document.text
        for paragraph in re.split(r"\n\s*\n", text):
            for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
                if (
                    _PROSE_SENTENCE.fullmatch(sentence)
                    and MIN_SENTENCE_WORDS <= len(sentence.split()) <= MAX_SENTENCE_WORDS
                ):
                    sentences.append(sentence)
        if len(sentences) >= limit:
            break
    if len(sentences) < 10:
        raise HeadkitError(
            f"the text ({corpus.source}) holds {len(sentences)} prose sentences, too few for passkey filler: "
            "give --data a text of sentences"
        )
    return sentences[:limit]


def python_prose(source: str) -> str:
    """The docstrings and comments of Python `source`, paragraphs apart ("" where it does not parse)."""
    paragraphs = []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node)
            if docstring:
                paragraphs.append(docstring)
    comments = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                comments.append(token.string.lstrip("#").strip())
            elif (
                token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
                and comments
            ):
                paragraphs.append(" ".join(comments))  # a run of comment lines is one paragraph
                comments = []
    except (tokenize.TokenError, SyntaxError):
        pass
    return "\n\n".join(paragraphs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def passkey_frame(tokenizer: Any, format: PasskeyFormat = INSTRUCTION_FORMAT) -> tuple[list[int], list[int]]:
    """(token ids before the document, token ids after it) of `format` with `tokenizer` (see
    :class:`PasskeyFormat`)."""
    marker = "\x00DOCUMENT\x00"
    user = format.separator.join(part for part in (format.instruction, marker, format.question) if part)
    if format.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        text += format.answer_prefix
    else:
        text = user + (" " if format.question and format.answer_prefix else "") + format.answer_prefix
    head, tail = text.split(marker)
    # Plain text starts as the tokenizer starts any text (with its BOS, if it adds one); a chat template writes
    # its own special tokens.
    start: list[int] = []
    if not uses_chat_template(tokenizer, format):
        special, plain = list(tokenizer("a", add_special_tokens=True)["input_ids"]), _encode(tokenizer, "a")
        start = next((special[:i] for i in range(len(special)) if special[i : i + len(plain)] == plain), [])
    return start + _encode(tokenizer, head), _encode(tokenizer, tail)


def uses_chat_template(tokenizer: Any, format: PasskeyFormat = INSTRUCTION_FORMAT) -> bool:
    return bool(format.chat and getattr(tokenizer, "chat_template", None))


def min_passkey_length(
    tokenizer: Any, format: PasskeyFormat = INSTRUCTION_FORMAT, key_digits: int = KEY_DIGITS
) -> int:
    """Tokens of a passkey prompt with no filler: the frame, the key sentence and the question."""
    head, tail = passkey_frame(tokenizer, format)
    key = _encode(tokenizer, " " + format.key_sentence.format(key="9" * key_digits))
    return len(head) + len(key) + len(tail)


def random_key(rng: np.random.Generator, digits: int = KEY_DIGITS) -> str:
    """A `digits`-digit decimal key without a leading zero (a model may rightly drop one)."""
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def passkey_trials(
    tokenizer: Any,
    sentences: Sequence[str],
    length: int,
    trials: int,
    depths: Sequence[float],
    *,
    seed: int = 0,
    answer_tokens: int = 8,
    format: PasskeyFormat = INSTRUCTION_FORMAT,
    key_digits: int = KEY_DIGITS,
) -> list[PasskeyTrial]:
    """`trials` passkey prompts of exactly `length` − `answer_tokens` tokens (so that prompt and answer fill
    `length`), seeded by (`seed`, `length`): trial i puts its key at
    ``depths[i % len(depths)]`` (stratified: every depth as often, ±1), its filler a run of consecutive
    `sentences` from a random start, cut to the token. The key sentence goes between two filler sentences: the
    boundary nearest the depth."""
    check_depths(depths)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise HeadkitError(f"--trials must be a positive integer, got {trials!r}")
    shortest = min_passkey_length(tokenizer, format, key_digits) + answer_tokens
    if length < shortest:
        raise HeadkitError(
            f"--passkey-lengths: {length} tokens cannot hold the key sentence and the question with this "
            f"tokenizer ({shortest} tokens without filler, with a {answer_tokens}-token answer): use lengths of "
            f"at least {shortest}"
        )
    if not sentences:
        raise HeadkitError("passkey filler needs at least one sentence")
    head, tail = passkey_frame(tokenizer, format)
    rng = np.random.default_rng([seed, length])
    encoded: dict[int, list[int]] = {}

    def sentence_ids(index: int) -> list[int]:
        index %= len(sentences)
        if index not in encoded:
            encoded[index] = _encode(tokenizer, " " + sentences[index])
        return encoded[index]

    result = []
    for trial in range(trials):
        key, depth = random_key(rng, key_digits), float(depths[trial % len(depths)])
        key_ids = _encode(tokenizer, " " + format.key_sentence.format(key=key))
        room = length - answer_tokens - len(head) - len(tail) - len(key_ids)
        filler, boundaries, index = [], [0], int(rng.integers(len(sentences)))
        while len(filler) < room:
            filler += sentence_ids(index)
            boundaries.append(min(len(filler), room))
            index += 1
        filler = filler[:room]
        cut = min(boundaries, key=lambda boundary: abs(boundary - depth * room))
        ids = head + filler[:cut] + key_ids + filler[cut:] + tail
        result.append(PasskeyTrial(tuple(ids), key, depth, len(head) + cut, length))
    return result


def passkey_examples(
    tokenizer: Any,
    sentences: Sequence[str],
    length: int,
    count: int,
    *,
    seed: int = 0,
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75),
    format: PasskeyFormat = INSTRUCTION_FORMAT,
) -> list[RetrievalExample]:
    """`count` passkey prompts of `length` tokens followed by their right answer, with the key sentence's token
    span: what :func:`headkit.analysis.retrieval.retrieval_head_scores` reads the retrieval heads from."""
    examples = []
    for trial in passkey_trials(tokenizer, sentences, length, count, depths, seed=seed, format=format):
        key_tokens = len(_encode(tokenizer, " " + format.key_sentence.format(key=trial.key)))
        answer = _encode(tokenizer, " " + trial.key)
        examples.append(
            RetrievalExample(
                trial.input_ids + tuple(answer),
                trial.key_position,
                trial.key_position + key_tokens,
                len(trial.input_ids),
            )
        )
    return examples


def check_depths(depths: Sequence[float]) -> None:
    if not depths or any(
        isinstance(d, bool) or not isinstance(d, int | float) or not 0.0 <= d <= 1.0 for d in depths
    ):
        raise HeadkitError(
            f"--depths must be numbers in [0, 1] (0: the key first, 1: last), got {list(depths)}"
        )
    if len(set(depths)) != len(depths):
        raise HeadkitError(f"--depths must be distinct, got {list(depths)}")


@torch.no_grad()
def retrieve_passkeys(
    model: nn.Module,
    tokenizer: Any,
    trials: Sequence[PasskeyTrial],
    *,
    max_new_tokens: int = 8,
    batch_tokens: int = 8192,
) -> list[str]:
    """The model's greedy answers (decoded text, at most `max_new_tokens` tokens) to the trials' prompts,
    prompts of equal length decoded together, about `batch_tokens` prompt tokens per batch."""
    device = next(model.parameters()).device
    pad = pad_token_of(tokenizer)
    answers: dict[int, str] = {}
    by_length: dict[int, list[int]] = {}
    for index, trial in enumerate(trials):
        by_length.setdefault(len(trial.input_ids), []).append(index)
    for length, indices in by_length.items():
        rows = max(1, batch_tokens // length)
        for start in range(0, len(indices), rows):
            chunk = indices[start : start + rows]
            ids = torch.tensor([trials[i].input_ids for i in chunk], dtype=torch.long, device=device)
            generated = generate_tokens(model, ids, max_new_tokens, pad)[:, ids.shape[1] :]
            for i, row in zip(chunk, generated, strict=True):
                answers[i] = tokenizer.decode(row.tolist(), skip_special_tokens=True)
    return [answers[i] for i in range(len(trials))]


def passkey_answer(text: str) -> str:
    """The key a generated answer gives: its first run of digits ("" if none)."""
    found = re.search(r"\d+", text)
    return found.group() if found else ""


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927; Brown, Cai & DasGupta 2001, eq. 4)."""
    if trials <= 0 or not 0 <= successes <= trials:
        raise HeadkitError(f"need 0 ≤ successes ≤ trials and trials ≥ 1, got {successes} of {trials}")
    p, n = successes / trials, trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def score_passkeys(trials: Sequence[PasskeyTrial], answers: Sequence[str]) -> dict[str, Any]:
    """Exact-match accuracy (the answer's first digits are the key) with its 95% Wilson interval, per length and
    per (length, depth)."""
    if len(trials) != len(answers) or not trials:
        raise HeadkitError(f"need as many answers as trials (≥ 1), got {len(answers)} and {len(trials)}")
    correct = [passkey_answer(a) == t.key for t, a in zip(trials, answers, strict=True)]

    def cell(members: list[int]) -> dict[str, Any]:
        hits = sum(correct[i] for i in members)
        low, high = wilson_interval(hits, len(members))
        return {"trials": len(members), "correct": hits, "accuracy": hits / len(members), "ci95": [low, high]}

    lengths = sorted({t.length for t in trials})
    by_length = [{"length": n} | cell([i for i, t in enumerate(trials) if t.length == n]) for n in lengths]
    cells = [
        {"length": n, "depth": d} | cell([i for i, t in enumerate(trials) if t.length == n and t.depth == d])
        for n in lengths
        for d in sorted({t.depth for t in trials if t.length == n})
    ]
    return {"by_length": by_length, "by_depth": cells, "correct": correct}


# -- headkit eval ------------------------------------------------------------------------------------------------

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
DEFAULT_PASSKEY_LENGTHS = (512, 1024, 2048, 4096)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_DECODE_CONTEXTS = (256, 1024, 4096)
REPORT_FILE, PLOT_FILE = "report.json", "passkey.png"


@dataclass
class EvalSettings:
    """What ``headkit eval`` measures. A length list left None is its default cut to the model's context (see
    :func:`model_context`); an empty one skips that measurement."""

    model: Path
    reference: Path | None = None
    data: Path | None = None
    lengths: tuple[int, ...] | None = None  # held-out perplexity (and agreement with --reference)
    eval_tokens: int = 8192  # held-out tokens scored at each length (at least one window)
    passkey_lengths: tuple[int, ...] | None = None
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 20  # passkey prompts per length, spread evenly over the depths
    max_new_tokens: int = 8  # of each passkey answer
    decode_contexts: tuple[int, ...] | None = None
    decode_steps: int = 8
    batch_tokens: int = 8192  # tokens per forward in perplexity and passkey batches
    seed: int = 0
    dtype: str = "float32"
    threads: int | None = None  # torch threads while measuring (None: torch's setting)
    out: Path | None = Path("results/eval")  # None: write nothing
    # lm-eval tasks (headkit.recipes.tasks), with lm-eval's option names. With tasks, a measurement above whose
    # lengths are left None is skipped: --tasks replaces the default measurements, and runs beside those asked for.
    tasks: tuple[str, ...] = ()
    include_path: Path | None = None
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 1

    @property
    def task_settings(self) -> TaskSettings:
        return TaskSettings(
            tasks=as_task_names(self.tasks),
            include_path=self.include_path,
            num_fewshot=self.num_fewshot,
            limit=self.limit,
            batch_size=self.batch_size,
        )


def model_context(model: nn.Module) -> int | None:
    """The positions the model was trained for (``config.max_position_embeddings``), None if it says none."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _lengths(
    option: str, given: tuple[int, ...] | None, default: tuple[int, ...], context: int | None
) -> list[int]:
    if given is None:
        return [n for n in default if context is None or n <= context]
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in given):
        raise HeadkitError(f"{option} must be integers ≥ 2, got {list(given)}")
    beyond = [n for n in given if context is not None and n > context]
    if beyond:
        raise HeadkitError(
            f"{option} {', '.join(map(str, beyond))} beyond the model's context of {context} tokens "
            "(max_position_embeddings)"
        )
    return sorted(set(given))


def check_eval_settings(settings: EvalSettings) -> None:
    """The checks that need no model, before anything loads."""
    check_depths(settings.depths)
    for name in ("eval_tokens", "trials", "max_new_tokens", "decode_steps", "batch_tokens", "threads"):
        value = getattr(settings, name)
        if name == "threads" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HeadkitError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if not Path(settings.model).exists():
        raise HeadkitError(f"MODEL {str(settings.model)!r} does not exist")
    if settings.reference is not None and not Path(settings.reference).exists():
        raise HeadkitError(f"--reference {str(settings.reference)!r} does not exist")
    if settings.tasks:
        check_task_settings(settings.task_settings)
    if settings.out is not None:
        inputs = {"model": settings.model} | (
            {"--reference": settings.reference} if settings.reference else {}
        )
        check_output_folder(settings.out, True, inputs)


def evaluate(
    settings: EvalSettings,
    *,
    loaded: Any = None,
    reference: Any = None,
    tasks: LoadedTasks | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Everything ``headkit eval`` measures on `settings.model` (and `settings.reference` beside it): held-out
    perplexity at each length; top-1 agreement and KL against the reference; passkey retrieval by length and
    depth (exact match, Wilson 95% intervals); per-token decode time (batch 1) and decoding-state bytes at each
    context; lm-eval task scores (`settings.tasks`). `loaded` / `reference`: models already loaded
    (:class:`headkit.recipes.models.LoadedModel`); `tasks`: the tasks already loaded (:func:`load_tasks`, which
    runs here, before any model loads, when None). Writes report.json and the passkey heat map to `settings.out`
    (atomically) and returns the report."""
    check_eval_settings(settings)
    if settings.tasks and tasks is None:
        tasks = load_tasks(settings.task_settings)
    with thread_limit(settings.threads):
        return _evaluate(settings, loaded, reference, echo, tasks)


def _evaluate(
    settings: EvalSettings,
    loaded: Any,
    reference: Any,
    echo: Callable[[str], None],
    tasks: LoadedTasks | None = None,
) -> dict[str, Any]:
    from headkit.recipes.models import CAUSAL_LM, load_model
    from headkit.recipes.text import lm_windows, load_text

    started = time.perf_counter()
    loaded = loaded or load_model(settings.model, kind=CAUSAL_LM, dtype=settings.dtype)
    if settings.reference is not None and reference is None:
        reference = load_model(settings.reference, kind=CAUSAL_LM, dtype=settings.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    if reference is not None and reference.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise HeadkitError(f"--reference {str(settings.reference)!r} has another tokenizer than MODEL")
    context = model_context(model)
    # With tasks, the defaults are no measurement: only the lengths given run beside them.
    alone = bool(settings.tasks)
    lengths = _lengths("--lengths", settings.lengths, () if alone else DEFAULT_LENGTHS, context)
    passkey_lengths = _lengths(
        "--passkey-lengths", settings.passkey_lengths, () if alone else DEFAULT_PASSKEY_LENGTHS, context
    )
    decode_contexts = _lengths(
        "--decode-contexts", settings.decode_contexts, () if alone else DEFAULT_DECODE_CONTEXTS, context
    )
    shortest = min_passkey_length(tokenizer) + settings.max_new_tokens
    if passkey_lengths and passkey_lengths[0] < shortest:
        raise HeadkitError(
            f"--passkey-lengths: {passkey_lengths[0]} tokens cannot hold the key sentence and the question with "
            f"this tokenizer ({shortest} tokens without filler, with a {settings.max_new_tokens}-token answer): "
            f"use lengths of at least {shortest}"
        )
    models = {"model": model} | ({"reference": reference.model} if reference is not None else {})
    # Tasks alone read no text: the corpus is for perplexity and passkey filler.
    corpus = load_text(settings.data) if lengths or passkey_lengths or not settings.tasks else None
    echo(f"eval: {settings.model}" + (f" against {settings.reference}" if reference is not None else ""))

    perplexities = []
    for length in lengths:
        windows = lm_windows(
            tokenizer,
            corpus,
            length=length,
            train_windows=0,
            held_out_windows=max(1, settings.eval_tokens // length),
            seed=settings.seed,
        ).held_out
        batch = max(1, settings.batch_tokens // length)
        point: dict[str, Any] = {"length": length, "windows": int(windows.shape[0])}
        for name, network in models.items():
            point[f"{name}_perplexity"] = perplexity(network, windows, batch)
        if reference is not None:
            measured = agreement(model, reference.model, windows, batch)
            point |= {"top1_agreement": measured.top1, "kl": measured.kl}
        perplexities.append(point)
        echo(_point_line(point, PERPLEXITY_LINE))

    passkey: dict[str, Any] = {}
    if passkey_lengths:
        sentences = prose_sentences(corpus, seed=settings.seed)
        trials = [
            trial
            for length in passkey_lengths
            for trial in passkey_trials(
                tokenizer,
                sentences,
                length,
                settings.trials,
                settings.depths,
                seed=settings.seed,
                answer_tokens=settings.max_new_tokens,
            )
        ]
        passkey = {
            "chat_template": uses_chat_template(tokenizer),
            "example_prompt": tokenizer.decode(list(trials[0].input_ids)),
            "keys": [t.key for t in trials],
        }
        for name, network in models.items():
            answers = []
            for length in passkey_lengths:
                of_length = [t for t in trials if t.length == length]
                answers += retrieve_passkeys(
                    network,
                    tokenizer,
                    of_length,
                    max_new_tokens=settings.max_new_tokens,
                    batch_tokens=settings.batch_tokens,
                )
                scores = score_passkeys(of_length, answers[-len(of_length) :])["by_length"][0]
                echo(f"passkey ({name}) at {length}: {_accuracy(scores)}")
            passkey[name] = score_passkeys(trials, answers) | {"answers": answers}
            del passkey[name]["correct"]

    decode = []
    for context_length in decode_contexts:
        point = {"context": context_length}
        for name, network in models.items():
            point[f"{name}_ms_per_token"] = 1000 * decode_seconds_per_token(
                network, context_length, settings.decode_steps
            )
            point[f"{name}_state_bytes"] = cache_bytes(network, context_length)
        decode.append(point)
        echo(_point_line(point, DECODE_LINE))

    task_report = None
    if settings.tasks:
        tokenizers = {"model": tokenizer} | (
            {"reference": reference.tokenizer} if reference is not None else {}
        )
        task_report = measure_tasks(
            {name: (network, tokenizers[name]) for name, network in models.items()},
            settings.task_settings,
            reference="reference" if reference is not None else None,
            tasks=tasks,
            echo=echo,
        )

    report = {
        "model": str(settings.model),
        "reference": None if settings.reference is None else str(settings.reference),
        "data": None if corpus is None else corpus.source,
        "context": context,
        "settings": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in dataclasses.asdict(settings).items()
        }
        | {"lengths": lengths, "passkey_lengths": passkey_lengths, "decode_contexts": decode_contexts},
        "perplexity": perplexities,
        "passkey": passkey,
        "decode": decode,
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started,
    }
    if task_report is not None:
        report["tasks"] = task_report
    if settings.out is not None:
        out = Path(settings.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / REPORT_FILE, report)
        if passkey:
            plot_passkey_heatmap(
                {name: passkey[name]["by_depth"] for name in models},
                out / PLOT_FILE,
                title=Path(settings.model).name,
            )
    return report


# How a perplexity or decode point prints: its own part, then the reference's where it was measured against one.
PERPLEXITY_LINE = (
    "perplexity at {length} ({windows} windows): {model_perplexity:.3f}",
    ", reference {reference_perplexity:.3f}; top-1 agreement {top1_agreement:.1%}, KL {kl:.4f}",
)
DECODE_LINE = (
    "decode at {context}: {model_ms_per_token:.2f} ms/token, state {model_state_mib:.2f} MiB",
    "; reference {reference_ms_per_token:.2f} ms/token, {reference_state_mib:.2f} MiB",
)


def _point_line(point: dict[str, Any], line: tuple[str, str]) -> str:
    fields = point | {
        key.removesuffix("_bytes") + "_mib": value / 2**20
        for key, value in point.items()
        if key.endswith("_bytes")
    }
    own, reference = line
    return own.format(**fields) + (
        reference.format(**fields) if any(k.startswith("reference_") for k in point) else ""
    )


def _accuracy(cell: dict[str, Any]) -> str:
    low, high = cell["ci95"]
    return f"{cell['accuracy']:.0%} ({cell['correct']}/{cell['trials']}, 95% CI {low:.0%}–{high:.0%})"


def format_eval_table(report: dict[str, Any]) -> str:
    """The report as Markdown tables: perplexity (and agreement), passkey accuracy by length, decoding."""
    names = ["model"] + (["reference"] if report["reference"] else [])
    lines = []
    if report["perplexity"]:
        header = ["length", "windows"] + [f"{n} perplexity" for n in names]
        header += ["top-1 agreement", "KL (nats)"] if report["reference"] else []
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in report["perplexity"]:
            row = [str(p["length"]), str(p["windows"])] + [f"{p[f'{n}_perplexity']:.3f}" for n in names]
            row += [f"{p['top1_agreement']:.1%}", f"{p['kl']:.4f}"] if report["reference"] else []
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if report["passkey"]:
        header = ["passkey length"] + [f"{n} accuracy (95% CI)" for n in names]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for index, cell in enumerate(report["passkey"]["model"]["by_length"]):
            row = [str(cell["length"])] + [_accuracy(report["passkey"][n]["by_length"][index]) for n in names]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if report["decode"]:
        header = ["context"] + [f"{n} {what}" for n in names for what in ("ms/token", "state MiB")]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in report["decode"]:
            row = [str(p["context"])] + [
                value
                for n in names
                for value in (f"{p[f'{n}_ms_per_token']:.2f}", f"{p[f'{n}_state_bytes'] / 2**20:.2f}")
            ]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if report.get("tasks"):
        lines.append(format_task_table(report["tasks"]))
    return "\n".join(lines).rstrip() + "\n"
