"""``headkit bench decode``: time per generated token of softmax, linear and additive language models.

Same-size :class:`~headkit.models.HeadkitForCausalLM` models (4 layers, hidden 256, byte vocabulary, fp32, one
seed) decode greedily after prompts of P tokens: ``softmax`` (Vaswani et al. 2017, RoPE) attends over a KV
cache that grows with P; ``linear`` (Katharopoulos et al. 2020, Eq. 16–20) and ``additive`` (Wu et al. 2021,
Fastformer, causal) update a state of constant size. Each decoding step is timed on its own; the targets are
judged on the fastest step (load only ever adds time), medians reported beside. Method: docs/decoding.md.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from headkit.bench._engines import DEFAULT_ENGINES, engine_names, run_engines
from headkit.bench._options import check_out_dir
from headkit.bench._report import (
    column_rows,
    figure_axes,
    find_point,
    grid_rows,
    log2_length_axis,
    machine_line,
    markdown_page,
    plot_series,
    progress_bar,
    rich_table,
    verdict,
)
from headkit.bench.registry import option, quick_preset, register_benchmark
from headkit.data import ByteTokenizer
from headkit.devices import check_device
from headkit.evaluation.timing import synchronize, time_greedy_decoding
from headkit.layers import HeadkitCache, StateCacheLayer, attention_classes
from headkit.models import HeadkitConfig, HeadkitForCausalLM
from headkit.train import default_config

BASELINE = "softmax"
MODEL_SIZE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
WARMUP_PROMPT, WARMUP_STEPS = 16, 4
SEED = 0
MAX_FLATNESS = 1.2  # per-token time at the longest prompt / at the shortest, of the constant-state mechanisms
MIN_SPEEDUP = 3.0  # over softmax at the longest prompt
PLOT_FILE = "decode.png"


def model_config(mechanism: str, max_positions: int) -> HeadkitConfig:
    """The benchmarked model: 4 layers, hidden 256, byte vocabulary, ``attention=mechanism``."""
    return default_config(
        ByteTokenizer(), attention=mechanism, max_position_embeddings=max_positions, **MODEL_SIZE
    )


def _time_decoding(
    model: HeadkitForCausalLM, prompt: torch.Tensor, new_tokens: int
) -> tuple[float, list[float], torch.Tensor]:
    """:func:`headkit.evaluation.timing.time_greedy_decoding` into a fresh :class:`HeadkitCache`."""
    return time_greedy_decoding(model, prompt, new_tokens, cache=HeadkitCache(model))


def constant_state_mechanisms() -> list[str]:
    """The registered mechanisms compared by default whose decoding state does not grow with the context."""
    return [
        name
        for name, layer in attention_classes().items()
        if layer.compared and issubclass(layer.cache_layer_class, StateCacheLayer)
    ]


@dataclass
class DecodeSettings:
    """Settings of one ``headkit bench decode`` run."""

    device: str = option("cpu", "Device to measure on: cpu or cuda.", check=check_device)
    prompt_lengths: tuple[int, ...] = option(
        (256, 1024, 4096),
        "Comma-separated prompt lengths.",
        flag="--prompts",
        quick=(256, 1024),
        min=1,
    )
    new_tokens: int = option(128, "Tokens generated per prompt.", min=2, quick=32)
    mechanisms: tuple[str, ...] = option(
        (),
        "Comma-separated registered attention mechanisms (default: softmax and those with a constant-size "
        "decoding state: softmax,linear,additive).",
        choices=attention_classes,
    )
    repeats: int = option(
        3, "Prefill + decode runs per point, interleaved with the others (steps pooled).", min=1
    )
    batch_size: int = option(1, "Prompts decoded together.", min=1)
    threads: int | None = option(None, "torch threads during the run (default: torch's setting).", min=1)
    compile: bool = option(
        False,
        "Decode with torch.compile(model) (inductor: a C++ compiler on CPU); the untimed warm-up compiles. "
        "Also times the eager models at the longest prompt and a training step (forward + backward of "
        "--train-batch × --train-length tokens) eager and compiled: torch.compile's speed-ups, in one run.",
    )
    train_batch: int = option(8, "Sequences per timed training step (with --compile).", min=1)
    train_length: int = option(256, "Tokens per sequence of the timed training step (with --compile).", min=2)
    out: Path = option(
        Path("results/decode"), "Output directory for results.json, plot and table.", check=check_out_dir
    )
    smollm2: bool = option(
        False,
        "Also decode SmolLM2-135M-Instruct side by side in llama.cpp (Q4_1 GGUF; skipped when llama-cpp-python "
        "is absent) and in headkit's fast path (compiled step, fixed-size caches), engines alternated in every "
        "round: per-token time, state bytes, compile time per shape bucket, held-out perplexity, targets.",
    )
    engines: tuple[str, ...] = option(
        DEFAULT_ENGINES,
        "With --smollm2: comma-separated engines.",
        choices=engine_names,
    )
    contexts: tuple[int, ...] = option(
        (512, 2048, 8192),
        "With --smollm2: tokens of context before decoding.",
        min=1,
        distinct=True,
        quick=(512,),
    )
    engine_batches: tuple[int, ...] = option(
        (1, 8), "With --smollm2: batch sizes.", min=1, distinct=True, quick=(1,)
    )
    max_batch_tokens: int = option(
        65536, "With --smollm2: skip (and list) batch × context points above this many prompt tokens.", min=1
    )
    engine_tokens: int = option(32, "With --smollm2: tokens generated per point.", min=4, quick=8)
    engine_repeats: int = option(1, "With --smollm2: rounds, engines alternated in each.", min=1)
    first_token: tuple[str, ...] = option(
        ("fast float32",),
        "With --smollm2: engines whose first token is timed in fresh processes (headkit generate --fast), cold "
        "(an empty compiled-step folder: it compiles) then warm (it loads what the cold one saved).",
        choices=engine_names,
    )
    engine_compile: bool = option(
        True, "With --smollm2: compile the fast path's step (--no-engine-compile: the same step eagerly)."
    )
    linearized: Path | None = option(None, "With --smollm2: a linearized SmolLM2 folder (headkit linearize).")
    pruned: Path | None = option(
        None, "With --smollm2: a pruned SmolLM2 folder, exported to Q4_1 and run in llama.cpp."
    )
    perplexity_windows: int = option(
        8, "With --smollm2: held-out windows of 256 tokens for perplexity.", min=1
    )

    quick = quick_preset("Short run: prompts 256 and 1024, 32 new tokens.")


def _measure(
    settings: DecodeSettings,
    device: torch.device,
    lengths: list[int],
    mechanisms: list[str],
    console: Console,
    show_progress: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every (mechanism, prompt length) point, and torch.compile's speed-ups (None without --compile). Repeats are the outer loop and mechanisms the inner one, so that
    every point's steps are spread over the whole run and the points compared by a target are measured
    seconds apart, under the same machine load."""
    max_positions = max(2048, max(lengths) + settings.new_tokens)
    generator = torch.Generator().manual_seed(SEED)
    prompts = {
        n: torch.randint(0, 256, (settings.batch_size, n), generator=generator).to(device) for n in lengths
    }
    warm_up = prompts[lengths[0]][:, :WARMUP_PROMPT]
    timed_decoding = partial(_time_decoding, new_tokens=settings.new_tokens)
    models, eager = {}, {}
    for mechanism in mechanisms:
        torch.manual_seed(SEED)
        models[mechanism] = HeadkitForCausalLM(model_config(mechanism, max_positions)).to(device).eval()
        if settings.compile:  # the eager model stays, timed beside its compiled self at the longest prompt
            eager[mechanism], models[mechanism] = models[mechanism], torch.compile(models[mechanism])
            _time_decoding(eager[mechanism], warm_up, WARMUP_STEPS)
        _time_decoding(models[mechanism], warm_up, WARMUP_STEPS)

    keys = [(mechanism, length) for length in lengths for mechanism in mechanisms]
    eager_steps: dict[str, list[float]] = {mechanism: [] for mechanism in eager}
    prefills: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    steps: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    with progress_bar(console, show_progress, 28) as progress:
        task = progress.add_task("decode", total=settings.repeats * len(keys))
        for _ in range(settings.repeats):
            for mechanism, length in keys:
                progress.update(task, description=f"{mechanism} P={length}")
                prefill_s, step_s, _ = timed_decoding(models[mechanism], prompts[length])
                prefills[mechanism, length].append(prefill_s)
                steps[mechanism, length].extend(step_s)
                if mechanism in eager and length == lengths[-1]:
                    _, step_s, _ = timed_decoding(eager[mechanism], prompts[length])
                    eager_steps[mechanism].extend(step_s)
                progress.advance(task)
    compile_report = None
    if settings.compile:
        compile_report = {
            "decode": [
                _speedup(mechanism, min(eager_steps[mechanism]), min(steps[mechanism, lengths[-1]]))
                | {"prompt_length": lengths[-1]}
                for mechanism in mechanisms
            ],
            "train_step": _time_training_steps(eager, settings, device),
            "statistic": "fastest decoding step / fastest training step, eager and compiled alternated",
        }
    points = [
        {
            "mechanism": mechanism,
            "prompt_length": length,
            "min_token_s": min(steps[mechanism, length]),
            "median_token_s": statistics.median(steps[mechanism, length]),
            "mean_token_s": statistics.fmean(steps[mechanism, length]),
            "step_s": steps[mechanism, length],
            "prefill_s": statistics.median(prefills[mechanism, length]),
        }
        for mechanism, length in keys
    ]
    return points, compile_report


def _speedup(mechanism: str, eager_s: float, compiled_s: float) -> dict[str, Any]:
    return {
        "mechanism": mechanism,
        "eager_s": eager_s,
        "compiled_s": compiled_s,
        "speedup": eager_s / compiled_s,
    }


def _time_training_steps(
    models: dict[str, HeadkitForCausalLM], settings: DecodeSettings, device: torch.device, rounds: int = 3
) -> list[dict[str, Any]]:
    """One training step — the loss's forward and backward on a fixed batch — of each model, eager and under
    torch.compile, alternated round by round (the first, untimed call compiles); the two losses are compared
    too: compiling must not change what the model computes."""
    ids = torch.randint(
        0, 256, (settings.train_batch, settings.train_length), generator=torch.Generator().manual_seed(SEED)
    ).to(device)
    results = []
    for mechanism, model in models.items():
        model.train()
        compiled = torch.compile(model)
        compiled_loss, eager_loss = (_training_step(m, model, ids, device)[1] for m in (compiled, model))
        eager_s, compiled_s = [], []
        for _ in range(rounds):
            eager_s.append(_training_step(model, model, ids, device)[0])
            compiled_s.append(_training_step(compiled, model, ids, device)[0])
        model.zero_grad(set_to_none=True)
        model.eval()
        speedup = _speedup(mechanism, min(eager_s), min(compiled_s))
        results.append(speedup | {"loss_difference": abs(compiled_loss - eager_loss)})
    return results


def _training_step(
    module: Any, model: HeadkitForCausalLM, ids: torch.Tensor, device: torch.device
) -> tuple[float, float]:
    """Seconds of one forward + backward of the loss through ``module`` (``model`` or its compiled form), and
    the loss."""
    model.zero_grad(set_to_none=True)
    synchronize(device)
    start = time.perf_counter()
    loss = module(input_ids=ids, labels=ids).loss
    loss.backward()
    synchronize(device)
    return time.perf_counter() - start, loss.item()


def evaluate_targets(points: list[dict[str, Any]], prompt_lengths: Sequence[int]) -> list[dict[str, Any]]:
    """The issue's targets for the constant-state mechanisms: flatness (per-token time at the longest prompt /
    at the shortest ≤ 1.2) and speed-up over softmax at the longest prompt (≥ 3). Judged on the fastest step
    (``measured``); ``measured_median`` is the same ratio of medians. None where a side was not measured."""
    shortest, longest = min(prompt_lengths), max(prompt_lengths)

    def ratio(numerator: dict | None, denominator: dict | None, key: str) -> float | None:
        if numerator is None or denominator is None or numerator is denominator:
            return None
        return numerator[key] / denominator[key]

    targets = []
    constant = constant_state_mechanisms()  # the targets' subjects: those measured, else all (not measured)
    measured = [name for name in dict.fromkeys(point["mechanism"] for point in points) if name in constant]
    for mechanism in measured or constant:
        long_point = find_point(points, mechanism=mechanism, prompt_length=longest)
        short_point = find_point(points, mechanism=mechanism, prompt_length=shortest)
        baseline = find_point(points, mechanism=BASELINE, prompt_length=longest)
        flatness = f"{mechanism}: per-token time at P={longest} ≤ {MAX_FLATNESS}× that at P={shortest}"
        speedup = f"{mechanism}: ≥ {MIN_SPEEDUP:g}× faster per token than softmax at P={longest}"
        for kind, description, numerator, denominator, required in (
            ("flatness", flatness, long_point, short_point, MAX_FLATNESS),
            ("speedup", speedup, baseline, long_point, MIN_SPEEDUP),
        ):
            value = ratio(numerator, denominator, "min_token_s")
            passed = None if value is None else value <= required if kind == "flatness" else value >= required
            targets.append(
                {"description": description, "mechanism": mechanism, "kind": kind, "measured": value}
                | {"measured_median": ratio(numerator, denominator, "median_token_s"), "required": required}
                | {"passed": passed}
            )
    return targets


def _milliseconds(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.3g}"


def _times(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.3g}×"


TARGET_COLUMNS = {
    "target": lambda t: t["description"],
    "measured (fastest step)": lambda t: _times(t["measured"]),
    "measured (median)": lambda t: _times(t.get("measured_median")),
    "required": lambda t: ("≤ " if t["kind"] == "flatness" else "≥ ") + f"{t['required']:g}×",
    "result": lambda t: verdict(t["passed"]),
}
SPEEDUP_COLUMNS = {
    "mechanism": lambda row: row["mechanism"],
    "eager (ms)": lambda row: _milliseconds(row["eager_s"]),
    "compiled (ms)": lambda row: _milliseconds(row["compiled_s"]),
    "speed-up": lambda row: _times(row["speedup"]),
}


def _grid(results: dict[str, Any], key: str) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the milliseconds of ``key``: a row per mechanism, a column per prompt length."""
    lengths = results["config"]["prompt_lengths"]
    rows = [{"mechanism": mechanism} for mechanism in results["config"]["mechanisms"]]
    cells = grid_rows(
        results["points"], rows, "prompt_length", lengths, lambda p: _milliseconds(p and p[key])
    )
    return ["mechanism", *(f"P={n}" for n in lengths)], cells


def _compile_tables(results: dict[str, Any]) -> list[tuple[str, tuple[list[str], list[list[object]]]]]:
    """(title, (headers, rows)) of torch.compile's speed-ups, decoding and training; none without --compile."""
    speedups, settings = results.get("compile_speedup"), results["settings"]
    if speedups is None:
        return []
    training = f"forward + backward, {settings['train_batch']} × {settings['train_length']} tokens"
    longest = max(results["config"]["prompt_lengths"])
    return [
        (f"torch.compile: decoding step at P={longest}, fastest", speedups["decode"]),
        (f"torch.compile: training step ({training}), fastest", speedups["train_step"]),
    ]


def _tables(results: dict[str, Any]) -> tuple[Any, ...]:
    """The console's tables: time per token (fastest step / median), the targets, torch.compile's speed-ups."""
    (headers, fastest), (_, median) = _grid(results, "min_token_s"), _grid(results, "median_token_s")
    time_rows = [
        [a[0], *(f"{x} / {y}" for x, y in zip(a[1:], b[1:], strict=True))]
        for a, b in zip(fastest, median, strict=True)
    ]
    return (
        rich_table("time per generated token, fastest step / median (ms)", headers, time_rows),
        rich_table("targets", *column_rows(TARGET_COLUMNS, results["targets"]), left=len(TARGET_COLUMNS)),
        *(rich_table(title, *column_rows(SPEEDUP_COLUMNS, rows)) for title, rows in _compile_tables(results)),
    )


def render_markdown(results: dict[str, Any]) -> str:
    """table.md: per-token times (fastest step, median, mean), prefill times, targets, torch.compile's speed-ups."""
    config, model = results["config"], results["config"]["model"]
    intro = (
        f"{model['num_hidden_layers']} layers, hidden {model['hidden_size']}, {model['num_attention_heads']} heads, "
        f"vocab {model['vocab_size']}, {model['dtype']}; batch {config['batch_size']}, {config['new_tokens']} new "
        f"tokens (greedy) after each prompt; {machine_line(results)}"
        f"{', models under torch.compile' if config.get('compiled') else ''}. A decoding step generates "
        f"one token for each of the batch's {config['batch_size']} sequence(s)."
    )
    times = (
        ("Time per generated token, fastest decoding step", "min_token_s"),
        ("Time per generated token, median over decoding steps", "median_token_s"),
        ("Time per generated token, mean", "mean_token_s"),
        ("Prefill of the prompt", "prefill_s"),
    )
    return markdown_page(
        "headkit bench decode",
        intro,
        results["command"],
        [
            *((f"{title} (ms)", _grid(results, key)) for title, key in times),
            ("Targets", column_rows(TARGET_COLUMNS, results["targets"])),
            *((title, column_rows(SPEEDUP_COLUMNS, rows)) for title, rows in _compile_tables(results)),
            *_engine_tables(results),
        ],
    )


def _engine_tables(results: dict[str, Any]) -> list[tuple[str, tuple[list[str], list[list[object]]]]]:
    """(title, (headers, rows)) of the SmolLM2 engines (--smollm2): per-token time, state bytes, compile time,
    perplexity and targets; none without --smollm2."""
    engines = results.get("smollm2")
    if engines is None:
        return []
    points = engines["points"]
    columns = sorted({(p["batch"], p["context"]) for p in points})
    headers = ["engine", *(f"b{batch} @{context}" for batch, context in columns)]

    def cell(engine: str, key: tuple[int, int], field: str, scale: float, spec: str) -> str:
        for p in points:
            if (p["engine"], p["batch"], p["context"]) == (engine, *key):
                if p.get(field) is None:
                    return p.get("error", "—")
                return format(p[field] * scale, spec)
        return "—"

    times = [
        [name, *(cell(name, key, "token_s", 1e3, ".1f") for key in columns)] for name in engines["engines"]
    ]
    memory = [
        [name, *(cell(name, key, "state_bytes", 2**-20, ".1f") for key in columns)]
        for name in engines["engines"]
    ]
    compiled = [
        [
            row["engine"],
            row["batch"],
            row["cache"] or "state only",
            row.get("step", "—"),
            f"{row['first_step_s']:.1f}",
        ]
        for row in engines["compile"]
    ]
    first_token = [
        [
            row["engine"],
            row.get("start", "—"),
            row.get("step", "—"),
            *([row["error"], ""] if "error" in row else [f"{row['load_s']:.1f}", f"{row['ready_s']:.1f}"]),
        ]
        for row in engines.get("first_token", [])
    ]
    quality = [[name, f"{q['perplexity']:.4f}"] for name, q in engines["perplexity"]["by_engine"].items()]
    targets = [
        [
            t["description"],
            "—" if t["measured"] is None else f"{t['measured']:.3g}",
            t["required"],
            verdict(t["passed"]),
        ]
        for t in engines["targets"]
    ]
    return [
        (f"SmolLM2-135M: time per generated token (ms), {engines['threads']} threads", (headers, times)),
        (
            "SmolLM2-135M: decoding state (MiB: KV cache / fixed buffers; llama.cpp: its state)",
            (headers, memory),
        ),
        (
            "SmolLM2-135M: first decoding step per shape bucket, finding or compiling the step included (s)",
            (["engine", "batch", "cache", "step", "seconds"], compiled),
        ),
        (
            "SmolLM2-135M: a fresh process's first token (headkit generate --fast), cold and warm (s)",
            (["engine", "start", "step", "model loaded", "ready after"], first_token),
        ),
        (
            f"SmolLM2-135M: held-out perplexity ({engines['perplexity']['windows']} × {engines['perplexity']['window']} tokens)",
            (["engine", "perplexity"], quality),
        ),
        ("SmolLM2-135M: targets", (["target", "measured", "required", "result"], targets)),
    ]


def plot_results(results: dict[str, Any]) -> Any:
    """Per-token time (left) and prefill time (right) vs prompt length, log-log, one line per mechanism."""
    config, points = results["config"], results["points"]
    names = config["mechanisms"]
    figure, axes = figure_axes((11, 4.5), 1, 2, "constrained")

    def colour(mechanism: str) -> dict[str, str]:
        return {"color": "black" if mechanism == BASELINE else f"C{names.index(mechanism)}"}

    panels = (("min_token_s", "time per generated token (fastest step)"), ("prefill_s", "prefill"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        plot_series(ax, points, "prompt_length", key, scale=1e3, style=colour)
        if key == "min_token_s":  # the median, faint: how much a loaded machine adds
            median = dict(linestyle=":", alpha=0.5, label="{} (median)")
            plot_series(ax, points, "prompt_length", "median_token_s", scale=1e3, style=colour, **median)
        log2_length_axis(ax, config["prompt_lengths"], "prompt length P (tokens)", f"{title} (ms)", title)
    axes[0].legend(fontsize="small")
    model = config["model"]
    figure.suptitle(
        f"greedy decoding, {model['num_hidden_layers']} layers × hidden {model['hidden_size']}, "
        f"batch {config['batch_size']}, {config['new_tokens']} new tokens, {config['device']}"
    )
    return figure


@register_benchmark(
    "decode", DecodeSettings, render=render_markdown, plots={PLOT_FILE: plot_results}, tables=_tables
)
def run_decode_benchmark(
    settings: DecodeSettings, console: Console, show_progress: bool = True
) -> dict[str, Any]:
    """Time per generated token (greedy) after long prompts: softmax vs linear vs additive, same model size.

    Writes results.json, table.md and decode.png to ``settings.out`` and returns what results.json holds."""
    default = [BASELINE, *constant_state_mechanisms()]
    names = list(dict.fromkeys(name.strip() for name in settings.mechanisms)) or default
    device, lengths = torch.device(settings.device), sorted(set(settings.prompt_lengths))
    # Each mechanism's model, in decoding and in training mode, is its own set of graphs of one code object
    # (HeadkitForCausalLM.forward): past dynamo's default budget of 8 recompilations per code object the rest would
    # quietly run eagerly and be timed as compiled. The budget is raised for the run, and running out raises.
    budget = dict(recompile_limit=64, fail_on_recompile_limit_hit=True)
    with torch._dynamo.config.patch(**budget) if settings.compile else contextlib.nullcontext():
        points, compile_report = _measure(settings, device, lengths, names, console, show_progress)
    config = {
        "model": {**MODEL_SIZE, "vocab_size": ByteTokenizer.vocab_size, "dtype": "float32"},
        "device": str(device),
        "prompt_lengths": lengths,
        "new_tokens": settings.new_tokens,
        "batch_size": settings.batch_size,
        "threads": torch.get_num_threads(),
        "compiled": settings.compile,
        "repeats": settings.repeats,
        "mechanisms": names,
        "statistic": "fastest decoding step (targets); median and mean reported too",
    }
    sections = {"config": config, "points": points, "targets": evaluate_targets(points, lengths)}
    if settings.smollm2:
        sections["smollm2"] = run_engines(settings, console)
    return sections if compile_report is None else sections | {"compile_speedup": compile_report}


if __name__ == "__main__":  # python -m headkit.bench.decode: the program is the command line's `bench decode`
    from headkit.bench.registry import run_as_script

    run_as_script("decode")
