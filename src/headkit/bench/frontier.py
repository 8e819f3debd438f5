"""``headkit bench frontier``: long context in a fraction of the memory — every way of shrinking the key/value
cache of one model, side by side at equal bytes, in one run.

Three orthogonal axes: which tokens are kept (:class:`~headkit.surgery.compressed_cache.CompressedCacheConfig`:
sinks, a window, keys chosen by the question — SnapKV — and retrieval heads with a full cache), how many numbers
per token (:class:`~headkit.surgery.latent.LatentKVConfig`, training-free), and how many bits per number
(:class:`~headkit.surgery.quantized_cache.QuantizedKVConfig`, KIVI) — and the first and last together
(``compressed+quantized``: the compressed cache's keys and values in 8 or 4 bits, at the budgets where those bits
alone do not fit: fewer bits keep more tokens). Each row is a list of configs applied with
:func:`headkit.apply_` to the original; its bytes are :func:`headkit.surgery.bytes_per_token` of the configs, in
bfloat16 (what engines keep), at ``--state-context`` tokens (and at 4× that). For each budget 1/N of the
original's bytes, each method's row is the largest configuration that fits.

External rows in the same run, on the same prompts and text: **llama.cpp** with its own quantized KV cache
(``--cache-type-k/v`` f16, q8_0, q4_0; llama-cpp-python, the model exported to an f16 GGUF by
:func:`headkit.export.gguf.export_gguf`, so its weights are headkit's), and with ``--kvpress-python`` NVIDIA
kvpress' ``SnapKVPress`` at the compressed cache's tokens per head (passkey only).

Columns: passkey accuracy with the key beyond the window at each ``--lengths`` (Wilson 95% intervals), the same
key asked in a second turn, perplexity of the last ``--scored-tokens`` of held-out windows of each
``--perplexity-lengths`` read through the cache (:func:`headkit.evaluation.quality.continuation_perplexity`:
the prefix prefilled, the continuation fed ``--chunk`` tokens at a time, so a quantized or compressed cache is what
it reads), the time to first token and the decoding speed at each ``--speed-contexts`` (batch 1, the eager path:
one forward of the prompt with the cache, the question's key choice included, then ``--decode-steps`` greedy
steps; llama.cpp's prompt evaluation and single-token evaluations at the same lengths), and the conversion's
seconds. Two plots: bytes against perplexity, bytes against passkey.

``--device cuda`` measures the headkit rows on a GPU (each converted on the CPU first), ``--speed-contexts none``
leaves the time columns out, and every row is appended to ``points.jsonl`` as it is measured, so a run stopped
early keeps what it finished and ``--resume`` measures only the rest.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.analysis.retrieval import top_heads
from headkit.bench._options import check_out_dir
from headkit.bench._report import TABLE_FILE, markdown_table
from headkit.bench.registry import option, quick_preset, register_benchmark
from headkit.bench.retrieval import (
    ANSWER_TOKENS,
    beyond_window_trials,
    check_kvpress,
    kvpress_answers,
    passkey_rates,
    retrieval_rates,
)
from headkit.devices import check_device, model_device
from headkit.errors import HeadkitError
from headkit.evaluation.quality import continuation_perplexity
from headkit.evaluation.retrieval import (
    passkey_retrieval_scores,
    prose_sentences,
)
from headkit.evaluation.timing import read_bandwidth, time_greedy_decoding
from headkit.export.gguf import export_gguf
from headkit.export.llamacpp import (
    CACHE_TYPE_BYTES,
    llama_cpp_answers,
    llama_cpp_perplexity,
    llama_cpp_speed,
)
from headkit.ops.key_selection import QUESTION, RECONSTRUCTION
from headkit.recipes.cache_budget import largest_fitting
from headkit.runs.models import CAUSAL_LM, load_model, smollm2_gguf_path
from headkit.runs.options import check_choice, check_integers, parse_list
from headkit.runs.text import held_out_by_length, lm_windows, load_text, window_batches
from headkit.runtime.fast import WEIGHTS, FastDecoder
from headkit.surgery.apply import apply_, bytes_per_token
from headkit.surgery.compressed_cache import COMPRESSED_SELECTIONS, CompressedCacheConfig
from headkit.surgery.gating import config_head_dim, kv_head_counts
from headkit.surgery.latent import LatentKVConfig
from headkit.surgery.linearize import max_context
from headkit.surgery.quantized_cache import QuantizedKVConfig
from headkit.surgery.reconstruction import repetition_request

QUANTIZED, COMPRESSED, COMPRESSED_QUANTIZED, LATENT, LLAMA_CPP, KVPRESS = (
    "quantized",
    "compressed",
    "compressed+quantized",
    "latent",
    "llama.cpp",
    "kvpress",
)
METHODS = (QUANTIZED, COMPRESSED, COMPRESSED_QUANTIZED, LATENT, LLAMA_CPP, KVPRESS)
# A row kept from a run resumed, by (method, label), else None; a new row saved as measured (returned as is).
EarlierRow = Callable[[str, str], "dict[str, Any] | None"]
SaveRow = Callable[[dict[str, Any]], dict[str, Any]]
# How a compressed+quantized row stores its window: in its bits, or in full precision (bfloat16; KIVI's residual).
WINDOW_STORAGES = ("quantized", "full")
LLAMA_CPP_CACHE_TYPES = tuple(CACHE_TYPE_BYTES)
LONGER = 4  # the bytes are also stated at this many times --state-context
PROGRESS_FILE = "points.jsonl"
# Settings that choose which rows a run measures, not how a row is measured: a run resumed under another choice keeps
# the rows both choose (by method and label, which name a row's configuration), so that a new budget or method is
# measured beside rows an earlier run measured (the original's, above all: the longest row), rather than anew.
# --kvpress-python is not one: another interpreter may hold another kvpress, which would measure its rows otherwise.
_ROW_CHOICE = ("methods", "budgets", "bits", "window_storages", "retrieval_head_counts", "selections")


@dataclass
class FrontierBenchSettings:
    model: Path | None = option(None, "A causal LM (default: SmolLM2-135M-Instruct's GGUF).")
    budgets: tuple[int, ...] = option(
        (2, 4, 8, 16, 32),
        "Budgets N: 1/N of the original's bfloat16 key/value bytes at --state-context.",
        min=2,
        distinct=True,
        quick=(4,),
    )
    methods: tuple[str, ...] = option(
        METHODS[:-1],
        f"Methods measured: {', '.join(METHODS)} (kvpress needs --kvpress-python).",
        choices=lambda: METHODS,
        distinct=True,
        quick=(QUANTIZED, COMPRESSED, COMPRESSED_QUANTIZED, LATENT),
    )
    bits: tuple[int, ...] = option((8, 4), "Bits of the quantized key/value cache rows.", distinct=True)
    group_size: int = option(
        32, "Group size of the quantized rows (KIVI's 32); divides the head width.", min=1
    )
    residual: int = option(128, "Full-precision residual of the quantized rows (KIVI's 128).", min=0)
    window_storages: tuple[str, ...] = option(
        WINDOW_STORAGES[:1],
        "How the compressed+quantized rows store their window: quantized (in their bits), full (bfloat16: the "
        "newest tokens in full precision), or both.",
        choices=lambda: WINDOW_STORAGES,
        distinct=True,
    )
    retrieval_head_counts: tuple[int, ...] = option(
        (0, 8), "Retrieval heads of the compressed cache rows (full cache, DuoAttention).", min=0, quick=(0,)
    )
    selections: tuple[str, ...] = option(
        (QUESTION,),
        "How the compressed cache rows choose their keys: question (the prompt's last queries, SnapKV), "
        "reconstruction (those read to repeat the prompt, before any question: KVzip), or both.",
        choices=lambda: COMPRESSED_SELECTIONS,
        distinct=True,
    )
    window: int = option(256, "Largest window of the compressed cache.", min=1, quick=64)
    sinks: int = option(4, "Sinks of the compressed cache.", min=0)
    observation: int = option(32, "Queries at the end of a prompt that choose its keys.", min=1, quick=8)
    lengths: tuple[int, ...] = option((1024, 2048, 4096), "Passkey prompt lengths.", min=64, quick=(512,))
    trials: int = option(50, "Passkey prompts per length, every key beyond the window.", min=1, quick=4)
    second_turn_gap: int = option(
        512, "Tokens of other text between the key's turn and the question's (the second turn).", quick=128
    )
    perplexity_lengths: tuple[int, ...] = option(
        (1024, 4096), "Held-out window lengths for perplexity.", min=2, quick=(512,)
    )
    scored_tokens: int = option(
        512,
        "Tokens at the end of each held-out window whose perplexity is read through the cache.",
        min=1,
        quick=64,
    )
    chunk: int = option(16, "Tokens fed at a time after the prefill when reading through the cache.", min=1)
    speed_contexts: tuple[int, ...] = option(
        (4096, 8192),
        "Tokens in the cache at which the time to first token and the decoding speed are measured (batch 1); "
        "'none': not measured (the quality columns only).",
        check=lambda values: values == () or check_integers("--speed-contexts", values, low=2, distinct=True),
        parse=lambda flag, text: () if text.strip() == "none" else parse_list(flag, text, minimum=2),
        quick=(512,),
    )
    decode_steps: int = option(
        8, "Greedy decoding steps timed after each prompt (their median).", min=1, quick=2
    )
    fast_batch_sizes: tuple[int, ...] = option(
        (),
        "Batch sizes decoded through the fast path (a compiled step, fixed-size caches) at each --speed-contexts, "
        "the prompt repeated, for the rows it runs; none: not measured (each row compiles a step per context).",
        check=lambda values: values == () or check_integers("--fast-batch-sizes", values, distinct=True),
    )
    fast_weights: str = option(
        "bfloat16",
        f"Weights of the fast path's rows: {', '.join(WEIGHTS)}. bfloat16 reads the bytes llama.cpp's rows read (an f16 "
        "GGUF of the same weights); float32 reads twice as many a step.",
        check=lambda value: check_choice("--fast-weights", value, WEIGHTS),
    )
    fast_packaged: bool = option(
        True,
        "Decode through the step compiled ahead of time as one graph (the fast path's default; minutes to build "
        "per row and batch, kept per machine and loaded by later runs); --no-fast-packaged: compiled in the process "
        "as regions, which adds the dispatch of 31 compiled regions a step (most of a batch-1 step on SmolLM2).",
    )
    fast_compile: bool = option(
        True,
        "Compile the fast path's step (--no-fast-compile: the same fixed-size step eagerly, not a speed).",
    )
    batch_tokens: int = option(
        8192,
        "Prompt tokens a batch when the passkey prompts are answered (those of equal length together): more on "
        "a GPU.",
        min=1,
    )
    held_out_windows: int = option(2, "Held-out windows per perplexity length.", min=1, quick=1)
    calibration_windows: int = option(
        8, "Windows of 512 training tokens that calibrate the latent rows.", min=1, quick=2
    )
    state_context: int = option(8192, "Context at which bytes are counted (and at 4× it).", min=1)
    data: Path | None = option(None, "Text for filler and perplexity (default: the Python standard library).")
    kvpress_python: Path | None = option(
        None,
        "A Python interpreter with NVIDIA's kvpress installed (`make kvpress`): the kvpress rows (passkey only).",
    )
    threads: int = option(2, "torch threads (and llama.cpp's).", min=1)
    device: str = option(
        "cpu",
        "Device the headkit rows are measured on: cpu or cuda (conversions run on the CPU; llama.cpp and kvpress "
        "rows stay on the CPU).",
        check=check_device,
    )
    seed: int = option(0, "Seed of the prompts, keys and windows.")
    resume: bool = option(
        False,
        "Keep the rows that a run with the same settings saved in --out (points.jsonl: a run killed before its "
        "end) and measure only the others. The rows chosen may differ "
        f"({', '.join('--' + name.replace('_', '-') for name in _ROW_CHOICE)}): the rows both runs choose are kept.",
    )
    out: Path = option(
        Path("results/frontier"),
        "Output directory for results.json, table.md and the plots.",
        check=check_out_dir,
    )

    quick = quick_preset(
        "One budget (1/4), 4 prompts of 512 tokens, 64 scored tokens: a smoke test of the grid."
    )


def _check(settings: FrontierBenchSettings) -> None:
    if settings.model is not None and not Path(settings.model).exists():
        raise HeadkitError(f"MODEL {str(settings.model)!r} does not exist")
    if KVPRESS in settings.methods:
        if settings.kvpress_python is None:
            raise HeadkitError("--methods lists kvpress: give its interpreter with --kvpress-python")
        check_kvpress(Path(settings.kvpress_python))
    for bits in settings.bits:
        _quantized(settings, bits)  # refuses bits other than 4 and 8 in one line naming them
    if "full" in settings.window_storages and COMPRESSED_QUANTIZED not in settings.methods:
        raise HeadkitError(
            f"--window-storages full applies to the {COMPRESSED_QUANTIZED} rows: add them to --methods"
        )
    if settings.observation >= min(settings.lengths):
        raise HeadkitError(
            f"--observation must be shorter than the shortest prompt ({min(settings.lengths)} tokens), got "
            f"{settings.observation}"
        )
    if settings.speed_contexts and settings.decode_steps >= min(settings.speed_contexts):
        raise HeadkitError(
            f"--decode-steps must be fewer than the shortest --speed-contexts ({min(settings.speed_contexts)}), "
            f"got {settings.decode_steps}"
        )
    if settings.scored_tokens >= min(settings.perplexity_lengths):
        raise HeadkitError(
            f"--scored-tokens must be shorter than the shortest --perplexity-lengths "
            f"({min(settings.perplexity_lengths)}), got {settings.scored_tokens}"
        )


def _quantized(settings: FrontierBenchSettings, bits: int, full_window: bool = False) -> QuantizedKVConfig:
    return QuantizedKVConfig(
        bits=bits,
        group_size=settings.group_size,
        residual=settings.residual,
        full_precision_window=full_window,
    )


@dataclass
class Row:
    """One configuration: its method, label, configs (applied in order to the original) and the budget it was
    chosen for (None: the method's only point)."""

    method: str
    label: str
    configs: list[Any]
    budget: int | None = None


def compressed_rows(
    config: Any,
    settings: FrontierBenchSettings,
    retrieval_heads: dict[int, list[tuple[int, int]]],
    bytes_of: Any,
    bits: int | None = None,
    full_window: bool = False,
    request: tuple[int, ...] = (),
) -> list[Row]:
    """Per selection, budget and retrieval-head count, the most tokens per head whose compressed cache fits: the
    window up to ``--window`` (half the tokens while they are fewer than twice that), the rest chosen by the
    question or by the prompt's reconstruction (after the `request` to repeat it). `bits`: its keys and values
    stored in those bits (``compressed+quantized``; its window in full precision with `full_window`), at the
    budgets where that quantized storage alone does not fit."""
    tail = [] if bits is None else [_quantized(settings, bits, full_window)]
    rows = []
    for selection, count, budget in itertools.product(settings.selections, retrieval_heads, settings.budgets):
        heads = retrieval_heads[count]
        target = bytes_of([]) / budget
        if tail and bytes_of(tail) <= target:
            continue  # the quantized row alone fits: it keeps every token

        def make(tokens: int, heads: list[tuple[int, int]] = heads, selection: str = selection) -> list[Any]:
            window = max(1, min(settings.window, tokens // 2))
            chosen_by = {"selection": selection}
            chosen_by |= {"reconstruction_prompt": request} if selection == RECONSTRUCTION else {}
            return [
                CompressedCacheConfig(
                    window=window, sinks=settings.sinks, budget=max(0, tokens - window),
                    observation=settings.observation, retrieval_heads=tuple(heads), **chosen_by,
                ),
                *tail,
            ]  # fmt: skip

        tokens = largest_fitting(make, bytes_of, target, settings.state_context)
        if tokens is None or tokens < 1:
            continue
        made = make(tokens)
        compressed = made[0]
        label = f"W={compressed.window} S={compressed.sinks} B={compressed.budget} R={count}"
        label += " by reconstruction" if selection == RECONSTRUCTION else ""
        if tail:
            label += " window bf16" if full_window else ""
            rows.append(Row(COMPRESSED_QUANTIZED, f"int{bits} {label}", made, budget))
        else:
            rows.append(Row(COMPRESSED, label, made, budget))
    return rows


def latent_rows(config: Any, settings: FrontierBenchSettings, bytes_of: Any) -> list[Row]:
    """Per budget, latent keys/values of R + G·D numbers per token and layer: D the even number nearest N/(2G)
    below 3/8 of the head width (D = 24, 16, 8, 4, 2 for SmolLM2 at 1/2 … 1/32), R the rest of the budget."""
    counts, head_dim = kv_head_counts(config), config_head_dim(config)
    if not counts or head_dim is None:
        return []
    groups = max(counts)
    rows = []
    for budget in settings.budgets:
        numbers = 2 * groups * head_dim // budget
        rope = min(3 * head_dim // 8, numbers // (2 * groups)) // 2 * 2
        rank = numbers - groups * rope
        if rope < 2 or rank < 1:
            continue
        try:
            made = LatentKVConfig(kv_rank=rank, rope_dims=rope)
            made.check(config)
        except HeadkitError:
            continue
        if bytes_of([made]) <= bytes_of([]) / budget + 1e-6:
            rows.append(Row(LATENT, f"R={rank} D={rope}", [made], budget))
    return rows


def _rate_line(point: dict[str, Any], settings: FrontierBenchSettings) -> str:
    cells = []
    for length in settings.lengths:
        cell = point.get(f"passkey_{length}")
        cells.append("—" if cell is None else f"{cell['correct']}/{cell['trials']}@{length}")
    for length in settings.perplexity_lengths:
        value = point.get(f"perplexity_{length}")
        cells.append("—" if value is None else f"ppl@{length} {value:.3f}")
    for context in settings.speed_contexts:
        first, step = point.get(f"first_token_seconds_{context}"), point.get(f"decode_ms_{context}")
        if first is not None and step is not None:
            cells.append(f"first token@{context} {first:.2f} s, {step:.1f} ms/token")
        for batch in settings.fast_batch_sizes:
            fast = point.get(f"fast_decode_ms_{context}_b{batch}")
            if fast is not None:
                cells.append(f"fast@{context}×{batch} {fast:.1f} ms/token{_read_rate(point, context, batch)}")
    return (
        f"{point['method']} {point['label']}: {point['bytes'] / 2**20:.1f} MiB at {settings.state_context} "
        f"(1/{point['fraction_inverse']:.1f}); {'; '.join(cells)} ({point['seconds']:.0f} s)"
    )


def _read_rate(point: dict[str, Any], context: int, batch: int) -> str:
    """The least bytes the fast step reads (weights and cache) and the rate they were read at, where counted."""
    read, ms = (
        point.get(f"fast_read_bytes_{context}_b{batch}"),
        point.get(f"fast_decode_ms_{context}_b{batch}"),
    )
    return "" if read is None or not ms else f" ({read / 2**20:.0f} MiB, {read / ms / 1e6:.1f} GB/s)"


def _measure(
    row: Row, original: nn.Module, settings: FrontierBenchSettings, shared: dict[str, Any], echo: Any
) -> dict[str, Any]:
    """One headkit row: the original converted by the row's configs, then every column."""
    started = time.perf_counter()
    model = shared["on_device"]
    if row.configs:
        model = copy.deepcopy(original)  # converted on the CPU, then measured on --device
        context = {"calibration": shared["calibration"]} if row.method == LATENT else {}
        apply_(model, row.configs, **context)
        model.to(shared["device"])
    converted = time.perf_counter() - started
    point = _point(row, shared, settings)
    point["conversion_seconds"] = converted
    point |= retrieval_rates(
        model, shared["tokenizer"], shared["trials"], shared["second_turn"], settings,
        batch_tokens=settings.batch_tokens,
    )  # fmt: skip
    for length, windows in shared["held_out"].items():
        point[f"perplexity_{length}"] = continuation_perplexity(
            model, windows, scored=settings.scored_tokens, chunk=settings.chunk
        )
    point |= _speed(model, shared["speed_prompts"], settings)
    point |= _fast_speed(model, shared["speed_prompts"], settings, echo)
    point["seconds"] = time.perf_counter() - started
    echo(_rate_line(point, settings))
    return point


def save_progress(point: dict[str, Any], progress: Path) -> None:
    """Append a measured row to `progress` (the output folder's points.jsonl) as soon as it is measured: a run
    stopped before its end (a session's time, a machine's lease) keeps the rows it finished, which ``--resume``
    takes back (:func:`start_progress`). results.json is written at the end."""
    progress.parent.mkdir(parents=True, exist_ok=True)
    with progress.open("a", encoding="utf-8") as file:
        file.write(json.dumps(point) + "\n")
        file.flush()
        os.fsync(file.fileno())


# Settings that change no measured number: where the results go, whether earlier rows are kept.
_NOT_MEASURED = ("out", "resume")


def progress_settings(settings: FrontierBenchSettings) -> dict[str, Any]:
    """The settings a row's numbers depend on, as points.jsonl's first line states them (JSON values)."""
    values = {f.name: getattr(settings, f.name) for f in fields(settings) if f.name not in _NOT_MEASURED}
    return json.loads(json.dumps(values, default=str))


def start_progress(settings: FrontierBenchSettings, progress: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The rows an earlier run saved in `progress` under these settings, by (method, label), with ``--resume``
    (the file left as it is, this run appending to it); else none, the file started anew with the settings line.
    Refused in one line, before any work, where the saved rows were measured under other settings; another choice
    of rows (``_ROW_CHOICE``: methods, budgets, bits, …) is not another setting: the rows both runs choose are kept."""
    stated = progress_settings(settings)
    if not settings.resume or not progress.exists():
        progress.parent.mkdir(parents=True, exist_ok=True)
        progress.write_text(json.dumps({"settings": stated}) + "\n", encoding="utf-8")
        return {}
    lines = [line for line in progress.read_text(encoding="utf-8").splitlines() if line.strip()]
    header = json.loads(lines[0]) if lines else {}
    if "settings" not in header:
        raise HeadkitError(
            f"--resume: {progress} does not state the settings its rows were measured with: run without --resume"
        )
    changed = sorted(
        name for name in stated if name not in _ROW_CHOICE and header["settings"].get(name) != stated[name]
    )
    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise HeadkitError(
            f"--resume: the rows in {progress} were measured with other {flags}: run with the same settings, or "
            "without --resume"
        )
    kept = {}
    for line in lines[1:]:
        try:
            point = json.loads(line)
        except json.JSONDecodeError:  # the line a killed run was writing
            continue
        kept[(point["method"], point["label"])] = point
    return kept


def _speed(
    model: nn.Module, prompts: dict[int, torch.Tensor], settings: FrontierBenchSettings
) -> dict[str, float]:
    """Per context L: the seconds of the prompt's forward (L − steps − 1 tokens, the cache filled and its keys
    chosen) and the median milliseconds of the greedy steps after it, which end with L tokens in the cache."""
    measured = {}
    for context, ids in prompts.items():
        first, steps, _ = time_greedy_decoding(model, ids.to(model_device(model)), settings.decode_steps + 1)
        measured[f"first_token_seconds_{context}"] = first
        measured[f"decode_ms_{context}"] = 1000 * statistics.median(steps)
    return measured


def _fast_speed(
    model: nn.Module, prompts: dict[int, torch.Tensor], settings: FrontierBenchSettings, echo: Any
) -> dict[str, float]:
    """Per context and --fast-batch-sizes B: the median milliseconds of the fast path's greedy steps
    (:class:`~headkit.runtime.fast.FastDecoder`) after the prompt repeated B times, and the seconds its first step
    took to compile; nothing for a row the fast path refuses (said in one line)."""
    if not settings.fast_batch_sizes:
        return {}
    try:
        decoder = FastDecoder(
            model,
            weights=settings.fast_weights,
            compile=settings.fast_compile,
            ahead_of_time=settings.fast_packaged,
        )
    except HeadkitError as error:
        echo(f"  fast path skipped: {error}")
        return {}
    measured = {}
    per_number = 4 if settings.fast_weights == "float32" else 2  # the cache keeps the step's float dtype
    weights = decoder.weight_bytes
    for context, ids in prompts.items():
        cache = bytes_per_token(model.config, bytes_per_number=per_number, context=context)
        for batch in settings.fast_batch_sizes:
            steps: list[float] = []
            # The first step compiles and is left out of `steps`: decode_steps timed steps follow it.
            prompt = ids.expand(batch, -1).contiguous().to(model_device(model))
            decoder.generate(prompt, max_new_tokens=settings.decode_steps + 2, step_seconds=steps)
            bucket = decoder.bucket(batch, prompt.shape[1] + settings.decode_steps + 2)
            measured[f"fast_decode_ms_{context}_b{batch}"] = 1000 * statistics.median(steps)
            measured[f"fast_compile_seconds_{context}_b{batch}"] = decoder.compile_seconds.get(bucket)
            if cache is not None:
                # The least a step reads: its weights once, and each row's cache of `context` tokens.
                measured[f"fast_read_bytes_{context}_b{batch}"] = weights + batch * cache * context
    return measured


def _read_bandwidth(points: list[dict[str, Any]], device: torch.device) -> float | None:
    """:func:`headkit.evaluation.timing.read_bandwidth` on the CPU where a row was timed on the fast path."""
    timed = any(key.startswith("fast_read_bytes_") for point in points for key in point)
    return read_bandwidth() if timed and device.type == "cpu" else None


def _point(row: Row, shared: dict[str, Any], settings: FrontierBenchSettings) -> dict[str, Any]:
    full = shared["bytes_of"]([])
    value = shared["bytes_of"](row.configs)
    return {
        "method": row.method,
        "label": row.label,
        "budget": row.budget,
        "configs": [type(config).__name__ for config in row.configs],
        "records": [config.record() for config in row.configs],
        "bytes": value,
        "bytes_longer": shared["bytes_of_at"](row.configs, LONGER * settings.state_context),
        "fraction_inverse": full / value,
    }


def _llama_cpp_points(
    settings: FrontierBenchSettings, shared: dict[str, Any], echo: Any, earlier: EarlierRow, save: SaveRow
) -> list[dict[str, Any]]:
    """llama.cpp's rows: the original exported to an f16 GGUF (headkit's weights), its KV cache kept as f16, q8_0
    and q4_0; passkey and perplexity on the same prompts and windows (no second turn: one prefill per prompt).
    ``earlier(method, label)``: a row kept from a run resumed, else None; ``save(point)`` saves a new one."""
    numbers = shared["bytes_of"]([]) / 2  # the original's numbers per token at --state-context
    trials, tokenizer = shared["trials"], shared["tokenizer"]
    kept = {cache_type: earlier(LLAMA_CPP, f"KV {cache_type}") for cache_type in CACHE_TYPE_BYTES}
    if all(point is not None for point in kept.values()):
        return list(kept.values())  # nothing left to measure: no export
    points = []
    with tempfile.TemporaryDirectory(prefix="headkit-frontier-") as folder:
        saved = Path(folder) / "original"
        shared["original"].save_pretrained(saved)
        tokenizer.save_pretrained(saved)
        gguf = export_gguf(saved, Path(folder) / "original-f16.gguf", type="f16").out
        for cache_type, per_number in CACHE_TYPE_BYTES.items():
            if kept[cache_type] is not None:
                points.append(kept[cache_type])
                continue
            started = time.perf_counter()
            value = numbers * per_number
            point = {
                "method": LLAMA_CPP,
                "label": f"KV {cache_type}",
                "budget": None,
                "configs": [],
                "records": [{"cache_type_k": cache_type, "cache_type_v": cache_type}],
                "bytes": value,
                "bytes_longer": value,
                "fraction_inverse": shared["bytes_of"]([]) / value,
                "second_turn": None,
            }
            run = llama_cpp_answers(
                gguf, [list(t.input_ids) for t in trials], max_new_tokens=ANSWER_TOKENS, quantized=False,
                threads=settings.threads, cache_type=cache_type,
            )  # fmt: skip
            if "error" in run:
                echo(f"llama.cpp KV {cache_type}: skipped: {run['error']}")
                continue
            answers = [tokenizer.decode(ids, skip_special_tokens=True) for ids in run["answers"]]
            point |= passkey_rates(answers, trials, settings.lengths)
            for length, windows in shared["held_out"].items():
                measured = llama_cpp_perplexity(
                    gguf, windows.tolist(), quantized=False, threads=settings.threads, cache_type=cache_type,
                    scored=settings.scored_tokens,
                )  # fmt: skip
                point[f"perplexity_{length}"] = measured.get("perplexity")
            for context, ids in shared["speed_prompts"].items():
                speed = llama_cpp_speed(
                    gguf, ids[0].tolist(), steps=settings.decode_steps, quantized=False,
                    threads=settings.threads, cache_type=cache_type,
                )  # fmt: skip
                if "error" in speed:
                    echo(f"llama.cpp KV {cache_type} speed at {context}: skipped: {speed['error']}")
                    continue
                point[f"first_token_seconds_{context}"] = ids.shape[1] / speed["pp_tokens_per_s"]
                point[f"decode_ms_{context}"] = 1000 / speed["gen_tokens_per_s"]
            point["seconds"] = time.perf_counter() - started
            echo(_rate_line(point, settings))
            points.append(save(point))
    return points


def _kvpress_points(
    rows: list[Row],
    model_path: Path,
    settings: FrontierBenchSettings,
    shared: dict[str, Any],
    echo: Any,
    earlier: EarlierRow,
    save: SaveRow,
) -> list[dict[str, Any]]:
    """kvpress' SnapKVPress keeping each compressed row's tokens per head (rows without retrieval heads)."""
    points = []
    trials, tokenizer = shared["trials"], shared["tokenizer"]
    for row in rows:
        made = row.configs[0]
        if row.method != COMPRESSED or made.retrieval_heads or made.selection != QUESTION:
            continue
        kept = made.sinks + made.window + made.budget
        label = f"SnapKVPress {kept} tokens per head"
        point = earlier(KVPRESS, label)
        if point is not None:
            points.append(point)
            continue
        started = time.perf_counter()
        run = kvpress_answers(
            Path(settings.kvpress_python), model_path, [t.input_ids for t in trials], kept, settings.observation,
            settings.threads,
        )  # fmt: skip
        answers = [tokenizer.decode(ids, skip_special_tokens=True) for ids in run["answers"]]
        point = _point(Row(KVPRESS, label, row.configs, row.budget), shared, settings)
        point |= {"records": [{"kept": kept, "versions": run["versions"]}], "second_turn": None}
        point |= passkey_rates(answers, trials, settings.lengths)
        point["seconds"] = time.perf_counter() - started
        echo(_rate_line(point, settings))
        points.append(save(point))
    return points


def best_per_budget(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per budget, the measured row of at most 1/N of the original's bytes with the lowest perplexity at the
    longest length (ties: the higher passkey accuracy at the longest length)."""
    longest = f"perplexity_{max(report['perplexity_lengths'])}"
    passkey = f"passkey_{max(report['lengths'])}"
    full = report["points"][0]["bytes"]
    best = []
    for budget in report["budgets"]:
        fitting = [
            p for p in report["points"] if p["bytes"] <= full / budget + 1e-6 and p.get(longest) is not None
        ]
        if not fitting:
            best.append({"budget": budget, "point": None})
            continue
        chosen = min(fitting, key=lambda p: (p[longest], -(p.get(passkey) or {}).get("accuracy", 0.0)))
        best.append({"budget": budget, "point": chosen})
    return best


def frontier_table(report: dict[str, Any]) -> str:
    """table.md: every row, then the best per budget."""
    original = report["points"][0]
    lengths, perplexities = report["lengths"], report["perplexity_lengths"]
    speeds, fast = report.get("speed_contexts", []), report.get("fast_batch_sizes", [])
    weights = report.get("fast_weights", "float32")  # reports before --fast-weights: float32

    def cells(point: dict[str, Any]) -> list[str]:
        out = [
            f"{point['method']} {point['label']}",
            f"{point['bytes'] / 2**20:.1f} MiB",
            f"{point['bytes_longer'] / 2**20:.1f} MiB",
            f"1/{point['fraction_inverse']:.1f}",
        ]
        for length in perplexities:
            value, base = point.get(f"perplexity_{length}"), original[f"perplexity_{length}"]
            out.append("—" if value is None else f"{value / base:.3f}×")
        for length in lengths:
            cell = point.get(f"passkey_{length}")
            out.append(
                "—"
                if cell is None
                else f"{cell['accuracy']:.0%} [{cell['wilson_95'][0]:.0%}, {cell['wilson_95'][1]:.0%}]"
            )
        turn = point.get("second_turn")
        out.append("—" if turn is None else f"{turn['accuracy']:.0%}")
        for context in speeds:
            first, step = point.get(f"first_token_seconds_{context}"), point.get(f"decode_ms_{context}")
            out.append("—" if first is None else f"{first:.2f} s")
            out.append("—" if step is None else f"{step:.1f}")
            for batch in fast:
                value = point.get(f"fast_decode_ms_{context}_b{batch}")
                out.append("—" if value is None else f"{value:.1f}{_read_rate(point, context, batch)}")
        out.append(f"{point.get('conversion_seconds', 0.0):.0f} s")
        return out

    columns = [
        "method",
        f"bytes @{report['state_context']}",
        f"@{LONGER * report['state_context']}",
        "of the original",
        *(f"ppl @{n}" for n in perplexities),
        *(f"passkey @{n}" for n in lengths),
        "second turn",
        *(
            column
            for n in speeds
            for column in (
                f"first token @{n}",
                f"ms/token @{n}",
                *(f"fast ({weights}) ms/token @{n} ×{batch}" for batch in fast),
            )
        ),
        "conversion",
    ]
    header = (
        f"{report['model']}: bfloat16 bytes of the decoding cache, batch 1; perplexity of the last "
        f"{report['scored_tokens']} tokens of {report['held_out_windows']} held-out windows read through the cache "
        f"({report['chunk']} tokens at a time), against the original's; passkey with the key beyond a "
        f"{report['window']}-token window ({report['trials']} prompts per length, Wilson 95%)"
    )
    device = report.get("device", "cpu")
    if speeds:
        header += (
            f"; time to first token and milliseconds per decoded token at batch 1, eager path "
            f"({report.get('threads')} threads{'' if device == 'cpu' else ', headkit rows on ' + device})."
        )
    else:
        header += "." if device == "cpu" else f"; headkit rows measured on {device}."
    if report.get("read_bandwidth"):
        header += (
            f" Fast-path cells: ms/token (the least bytes the step reads, its weights and cache, and the rate they "
            f"were read at; this machine reads {report['read_bandwidth'] / 1e9:.1f} GB/s)."
        )
    best_rows = []
    for entry in best_per_budget(report):
        point = entry["point"]
        best_rows.append(
            [f"1/{entry['budget']}", "—" if point is None else f"{point['method']} {point['label']}"]
        )
    return (
        f"{header}\n\n"
        + markdown_table(columns, [cells(p) for p in report["points"]])
        + "\n\nBest measured per budget (lowest perplexity at the longest length):\n\n"
        + markdown_table(["budget", "configuration"], best_rows)
    )


def _plot(report: dict[str, Any], column: Callable[[dict[str, Any]], float | None], ylabel: str) -> Any:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axes = figure.add_subplot()
    full = report["points"][0]["bytes"]
    by_method: dict[str, list[tuple[float, float]]] = {}
    for point in report["points"]:
        value = column(point)
        if value is not None:
            by_method.setdefault(point["method"], []).append((point["bytes"] / full, value))
    for method, values in by_method.items():
        values.sort()
        axes.plot([x for x, _ in values], [y for _, y in values], marker="o", label=method)
    axes.set_xscale("log", base=2)
    axes.set_xlabel(f"bytes of the original's bfloat16 KV cache at {report['state_context']} tokens")
    axes.set_ylabel(ylabel)
    axes.legend()
    axes.grid(alpha=0.3)
    return figure


def plot_perplexity(report: dict[str, Any]) -> Any:
    length = max(report["perplexity_lengths"])
    base = report["points"][0][f"perplexity_{length}"]
    return _plot(
        report,
        lambda p: None if p.get(f"perplexity_{length}") is None else p[f"perplexity_{length}"] / base,
        f"perplexity @{length} (× the original's)",
    )


def plot_passkey(report: dict[str, Any]) -> Any:
    length = max(report["lengths"])
    return _plot(
        report,
        lambda p: None if p.get(f"passkey_{length}") is None else p[f"passkey_{length}"]["accuracy"],
        f"passkey accuracy @{length}, key beyond the window",
    )


@register_benchmark(
    "frontier",
    FrontierBenchSettings,
    check=_check,
    render=frontier_table,
    files={"table": TABLE_FILE, "perplexity_plot": "perplexity.png", "passkey_plot": "passkey.png"},
    plots={"perplexity.png": plot_perplexity, "passkey.png": plot_passkey},
)
def run_frontier_benchmark(settings: FrontierBenchSettings, console: Any) -> dict[str, Any]:
    """Every way of shrinking the key/value cache at equal bytes, in one run: quantized storage, the compressed
    cache (alone and in 8 or 4 bits), latent keys/values and llama.cpp's quantized cache at budgets of 1/N of the
    original's bfloat16 bytes; passkey beyond the window, second turn, perplexity read through the cache; two
    plots."""

    def echo(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    progress = Path(settings.out) / PROGRESS_FILE
    kept = start_progress(settings, progress)  # before any work: --resume under other settings is refused
    model_path = Path(settings.model) if settings.model is not None else smollm2_gguf_path()
    loaded = load_model(model_path, kind=CAUSAL_LM)
    original, tokenizer = loaded.model.eval(), loaded.tokenizer
    device = torch.device(settings.device)
    on_device = original if device.type == "cpu" else copy.deepcopy(original).to(device)
    config = original.config
    context = max_context(original)
    longest = max([*settings.lengths, *settings.perplexity_lengths, *settings.speed_contexts])
    if context is not None and longest > context:
        raise HeadkitError(f"lengths must be at most the model's context of {context}, got {longest}")

    def bytes_of_at(configs: list[Any], at: int) -> float:
        value = bytes_per_token(config, configs, bytes_per_number=2, context=at)
        if value is None:
            raise HeadkitError(f"the bytes of {configs} are not stated by their configs")
        return value * at

    def bytes_of(configs: list[Any]) -> float:
        return bytes_of_at(configs, settings.state_context)

    corpus = load_text(settings.data)
    sentences = prose_sentences(corpus, seed=settings.seed)
    trials, second_turn = beyond_window_trials(
        tokenizer, sentences, settings.lengths, settings.trials, settings.window, settings.second_turn_gap,
        settings.seed,
    )  # fmt: skip
    held_out = held_out_by_length(
        tokenizer, corpus, settings.perplexity_lengths, settings.held_out_windows, settings.seed
    )
    # The prompt of each speed context: held-out text, short of it by the steps decoded after it.
    speed_prompts = {
        context: windows[:1, : context - settings.decode_steps - 1]
        for context, windows in held_out_by_length(
            tokenizer, corpus, settings.speed_contexts, 1, settings.seed
        ).items()
    }
    calibration = None
    if LATENT in settings.methods:
        windows = lm_windows(
            tokenizer, corpus, length=512, train_windows=settings.calibration_windows, held_out_windows=1,
            seed=settings.seed,
        ).train  # fmt: skip
        calibration = window_batches(windows, 4)
    shared = {
        "tokenizer": tokenizer,
        "trials": trials,
        "second_turn": second_turn,
        "held_out": held_out,
        "speed_prompts": speed_prompts,
        "calibration": calibration,
        "bytes_of": bytes_of,
        "bytes_of_at": bytes_of_at,
        "original": original,
        "on_device": on_device,
        "device": device,
    }

    rows = [Row("original", "full KV cache", [])]
    if QUANTIZED in settings.methods:
        for bits in settings.bits:
            made = _quantized(settings, bits)
            made.check(config)
            rows.append(Row(QUANTIZED, f"int{bits} g{made.group_size} r{made.residual}", [made]))
    retrieval_heads: dict[int, list[tuple[int, int]]] = {}
    # what the rows chosen by reconstruction ask before the repetition
    request = repetition_request(tokenizer)
    compressing = COMPRESSED in settings.methods or COMPRESSED_QUANTIZED in settings.methods
    if compressing or KVPRESS in settings.methods:
        counts = [count for count in settings.retrieval_head_counts if count] if compressing else []
        if counts:
            scores, _ = passkey_retrieval_scores(
                on_device, tokenizer, sentences, context=context, seed=settings.seed
            )
            retrieval_heads = {count: top_heads(scores, count) for count in counts}
        if 0 in settings.retrieval_head_counts or KVPRESS in settings.methods:
            retrieval_heads = {0: []} | retrieval_heads
        compressed = compressed_rows(config, settings, retrieval_heads, bytes_of, request=request)
        rows += compressed if COMPRESSED in settings.methods else []
    if COMPRESSED_QUANTIZED in settings.methods:
        for bits in settings.bits:
            _quantized(settings, bits).check(config)
            for storage in settings.window_storages:
                full = storage == "full"
                rows += compressed_rows(
                    config, settings, retrieval_heads, bytes_of, bits, full, request=request
                )
    if LATENT in settings.methods:
        rows += latent_rows(config, settings, bytes_of)

    def measured(point: dict[str, Any]) -> dict[str, Any]:
        save_progress(point, progress)
        return point

    def earlier(method: str, label: str) -> dict[str, Any] | None:
        point = kept.get((method, label))
        if point is not None:
            echo(f"{method} {label}: kept from the earlier run (--resume)")
        return point

    points = [
        earlier(row.method, row.label) or measured(_measure(row, original, settings, shared, echo))
        for row in rows
    ]
    if LLAMA_CPP in settings.methods:
        points += _llama_cpp_points(settings, shared, echo, earlier, measured)
    if KVPRESS in settings.methods:
        points += _kvpress_points(compressed, model_path, settings, shared, echo, earlier, measured)
    return {
        "model": str(model_path),
        "budgets": list(settings.budgets),
        "window": settings.window,
        "lengths": list(settings.lengths),
        "trials": settings.trials,
        "second_turn_gap": settings.second_turn_gap,
        "second_turn_trials": len(second_turn),
        "perplexity_lengths": list(settings.perplexity_lengths),
        "scored_tokens": settings.scored_tokens,
        "chunk": settings.chunk,
        "held_out_windows": settings.held_out_windows,
        "state_context": settings.state_context,
        "speed_contexts": list(settings.speed_contexts),
        "decode_steps": settings.decode_steps,
        "fast_batch_sizes": list(settings.fast_batch_sizes),
        "fast_weights": settings.fast_weights,
        "fast_packaged": settings.fast_packaged and settings.fast_compile,
        "threads": settings.threads,
        "device": str(device),
        # what this machine reads per second (with --threads), measured once after the rows: a memory-bound
        # step is at best its bytes over this rate
        "read_bandwidth": _read_bandwidth(points, device),
        "points": points,
        "best_per_budget": [
            {
                "budget": entry["budget"],
                "method": None if entry["point"] is None else entry["point"]["method"],
                "label": None if entry["point"] is None else entry["point"]["label"],
            }
            for entry in best_per_budget(
                {
                    "points": points,
                    "budgets": list(settings.budgets),
                    "perplexity_lengths": list(settings.perplexity_lengths),
                    "lengths": list(settings.lengths),
                }
            )
        ],  # fmt: skip
    }


if __name__ == "__main__":
    from headkit.bench.registry import run_as_script

    run_as_script("frontier")

__all__ = [
    "FrontierBenchSettings",
    "best_per_budget",
    "frontier_table",
    "largest_fitting",
    "run_frontier_benchmark",
]
