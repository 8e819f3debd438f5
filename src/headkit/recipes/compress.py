"""The compression recipe (``headkit compress``): collaborative heads at a shared query/key width, recovered by
distillation, measured and saved.

Cordonnier, Loukas and Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (2020), Sec. 4: the
query/key projections of a trained model are re-parametrised as one shared pair of width D̃ plus a mixing vector
per head, fitted by a CP decomposition of the heads' bilinear forms (:func:`headkit.swap_to_collaborative`), and
the model is then distilled against the original to win back what the lower rank lost.

- Sentence encoders (default all-MiniLM-L6-v2): fidelity is the mean cosine of mean-pooled embeddings on held-out
  text, the objective :class:`~headkit.recipes.objectives.EncoderObjective`.
- Causal LMs without rotary embeddings (GPT-2): the LM head is kept, the objective is KL on next-token
  distributions (:class:`~headkit.recipes.objectives.CausalLMObjective`) and the report gives held-out perplexity
  before and after, top-1 agreement and prefill/decode times.
- Rotary, grouped-query decoders (LLaMA, SmolLM2, Mistral, Qwen 2, …): their scores are not a bilinear form of
  the inputs, so the collaborative idea takes the form it has in multi-head latent attention — every head's keys
  and values out of one shared latent of width ``--kv-rank`` per layer, rotary kept on ``--rope-dims`` dimensions
  per key/value head (MHA2MLA, Ji et al. 2025; :func:`headkit.surgery.latent.compress_kv_to_latent`), calibrated
  on training windows, then distilled the same way. The report separates the two lossy steps (partial RoPE at
  full rank, then the rank) and gives the KV-cache bytes per token.

The output folder (model, tokenizer, report.json) is written atomically and reloads with
:func:`headkit.from_pretrained`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.evaluation.memory import kv_cache_bytes_per_token
from headkit.evaluation.quality import agreement, embedding_cosine, last_hidden_states, perplexity
from headkit.evaluation.tasks import check_recipe_tasks, recipe_tasks, with_task_table
from headkit.evaluation.timing import compare_speed, time_call
from headkit.recipes.distill import distill_run, encoder_finetune
from headkit.recipes.models import (
    DEFAULT_DTYPE,
    check_output_folder,
    default_encoder_path,
    load_model,
    read_model_config,
)
from headkit.recipes.objectives import CausalLMObjective
from headkit.recipes.options import option
from headkit.recipes.settings import ModelSettings, RecipeResult, check_count, check_data, with_overrides
from headkit.recipes.skeleton import main_process_echo, save_result
from headkit.recipes.text import lm_windows, load_text, text_chunks, tokenize_batches
from headkit.surgery.adapters import AttentionAdapter, count_parameters, get_adapter
from headkit.surgery.collaborative import SwapReport, swap_to_collaborative
from headkit.surgery.families import COMPRESS, FAMILIES, get_family, model_type_of
from headkit.surgery.latent import (
    FITTED,
    ROPE_SELECTIONS,
    LatentKVConfig,
    LatentReport,
    SiteStatistics,
    attention_widths,
    check_latent_arguments,
    collect_statistics,
    compress_kv_to_latent,
    full_rank,
)


@dataclass
class CompressSettings(ModelSettings):
    """Settings of one ``headkit compress`` run (see the command's --help)."""

    model: Path | None = None
    out: Path = Path("results/compressed-model")
    # shared query/key width D̃; default half of heads·head_dim
    dim: int | None = option(
        None, "Shared query/key width D̃ (default: half of heads × head_dim; full size is exact).", min=1
    )
    distill_steps: int = option(
        0,
        "Recovery: distillation steps against the original.",
        flag="--recovery-steps",
        deprecated=("--distill-steps",),
        min=0,
    )
    lr: float = option(
        1e-4,
        "Distillation learning rate (AdamW, every weight; on a rotary decoder the peak of a cosine decay after a "
        "5% warm-up).",
        min=0.0,
    )
    lora_rank: int | None = option(None, "Distil through LoRA of this rank (PEFT), merged after.", min=1)
    batch_size: int = option(16, "Texts (windows) per distillation step and held-out batch.", min=1)
    # tokens per text (encoders)
    max_length: int = option(64, "Tokens per encoder text (longer texts are truncated).", min=2)
    # tokens per window (causal LMs)
    window: int = option(256, "Tokens per causal-LM window.", min=2)
    train_texts: int = 512
    held_out_texts: int = option(
        128, "Held-out texts (windows) the fidelity is measured on.", flag="--held-out", min=1
    )
    data: Path | None = option(
        None, "Text to train and measure on: a file, a folder of them, or JSONL with a 'text' field."
    )
    temperature: float = 1.0
    seed: int = option(0, "Seed of the decomposition and the corpus sampling.")
    # Below full size the decomposition's error is set by the rank limit: sweeps past ~100 gain little.
    tol: float = option(1e-6, "Stop the decomposition when its error changes less.", min=0.0)
    max_iter: int = option(100, "ALS sweeps of the query/key decomposition, at most.", min=0)
    overwrite: bool = False
    timing_repeats: int = option(5, "Timed forward passes (the median is reported).", min=1)
    # Rotary decoders (latent keys/values): R, D, calibration windows, held-out window length.
    # default: half the key/value cache, R = G·(head_dim − D)
    kv_rank: int | None = option(
        None,
        "Rotary decoders (LLaMA, SmolLM2, Mistral, Qwen 2): latent width R of the shared key/value latent per "
        "layer (MHA2MLA; default: half the KV cache, kv_heads × (head_dim − rope dims)).",
        min=1,
    )
    # default: head_dim / 4 (whole pairs)
    rope_dims: int | None = option(
        None,
        "Rotary decoders: rotary dimensions kept per key/value head, whole pairs (default head_dim / 4).",
        min=0,
    )
    # which pairs stay rotary; FITTED also folds a fixed rotation into the rest
    rope_selection: str = option(
        FITTED,
        "Rotary decoders: 'fitted' keeps rotary where a fixed rotation fitted on the calibration text errs most "
        "and folds that rotation into the other pairs' keys; 'norms' is MHA2MLA's 2-norm ranking.",
    )
    calibration_windows: int = option(
        16, "Rotary decoders: training windows the rotary ranking and the SVD are calibrated on.", min=1
    )
    # default: window
    eval_window: int | None = option(
        None, "Rotary decoders: tokens per held-out window (default --window).", min=2
    )
    # lm-evaluation-harness tasks scored on the original and the result (headkit.evaluation.tasks): none by default.
    eval_tasks: tuple[str, ...] = ()
    eval_include_path: Path | None = None


@dataclass
class Fidelity:
    """Agreement of a student's held-out outputs with the teacher's."""

    mean_cosine: float
    min_cosine: float
    max_abs_diff: float  # hidden states at real (non-pad) tokens


@dataclass
class Teacher:
    """The original model, frozen, with what every compression of it needs."""

    path: Path
    model: nn.Module
    tokenizer: Any
    adapter: AttentionAdapter
    full_dim: int  # heads · head_dim: the width at which the swap is exact
    kind: str = "encoder"


@dataclass
class EncoderText:
    """Tokenised text: training batches, held-out batches and the teacher's states on the held-out ones."""

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


class CompressResult(RecipeResult):
    """What :func:`compress` did; ``report`` is what report.json holds."""

    def __str__(self) -> str:
        return with_task_table(format_report(self.report), self.report)


def load_teacher(model_path: Path, dtype: str = DEFAULT_DTYPE) -> Teacher:
    """Load the model (in `dtype`) and freeze it; an unsupported architecture fails here, before any work."""
    loaded = load_model(model_path, dtype=dtype)
    adapter = get_adapter(loaded.model)
    site = adapter.sites(loaded.model)[0]
    loaded.model.requires_grad_(False)
    return Teacher(
        model_path, loaded.model, loaded.tokenizer, adapter, site.num_heads * site.head_dim, loaded.kind
    )


def prepare_encoder_text(
    teacher: Teacher,
    train_texts: int,
    held_out_texts: int,
    batch_size: int,
    max_length: int,
    seed: int,
    data: Path | None = None,
) -> EncoderText:
    """Disjoint training and held-out texts, tokenised into fixed-shape batches; the teacher's held-out states
    are computed once, for every student to be compared with."""
    train, held_out = text_chunks(load_text(data), train_texts, held_out_texts, seed)
    train_batches = tokenize_batches(teacher.tokenizer, train, batch_size, max_length)
    held_out_batches = tokenize_batches(teacher.tokenizer, held_out, batch_size, max_length)
    if not held_out_batches or (train_texts and not train_batches):
        raise HeadkitError(
            "--batch-size is larger than --held-out or --train-texts: each needs at least one full batch of texts"
        )
    with torch.no_grad():
        teacher_held_out = [teacher.model(**batch).last_hidden_state for batch in held_out_batches]
    return EncoderText(train_batches, held_out_batches, teacher_held_out)


def encoder_fidelity(student: nn.Module, batches: list[dict], teacher_states: list[torch.Tensor]) -> Fidelity:
    """Mean and min cosine of mean-pooled embeddings, and max |Δ| of hidden states at real tokens."""
    states = last_hidden_states(student, batches)
    cosine = embedding_cosine(states, teacher_states, batches)
    max_diff = max(
        float((got - expected)[batch["attention_mask"].bool()].abs().max())
        for got, expected, batch in zip(states, teacher_states, batches, strict=True)
    )
    return Fidelity(mean_cosine=float(cosine.mean()), min_cosine=float(cosine.min()), max_abs_diff=max_diff)


def compress_and_distill(
    teacher: Teacher, text: EncoderText, dim: int, settings: Any, echo: Callable[[str], None] = print
) -> Compressed:
    """Swap a fresh copy of the teacher (an encoder) to collaborative heads of width `dim`, measure its held-out
    fidelity, distil it (:func:`~headkit.recipes.distill.encoder_finetune`) and measure again. `settings`: a
    :class:`CompressSettings`, or any object with its ``distill_steps``, ``lr``, ``seed``, ``tol``, ``max_iter``
    and ``batch_size``. The teacher is left untouched."""
    seed = settings.seed
    torch.manual_seed(seed)
    student = copy.deepcopy(teacher.model)
    swap = swap_to_collaborative(
        student,
        teacher.adapter,
        dim_shared_query_key=dim,
        seed=seed,
        tol=settings.tol,
        max_iter=settings.max_iter,
    )
    echo(str(swap))
    after_swap = encoder_fidelity(student, text.held_out, text.teacher_held_out)
    echo(f"fidelity after the swap: mean cosine {after_swap.mean_cosine:.4f}")
    result = encoder_finetune(
        student,
        teacher.model,
        text.train,
        steps=settings.distill_steps,
        lr=settings.lr,
        batch_size=settings.batch_size,
        seed=seed,
        echo=echo,
    )
    student = result.model
    fidelity = encoder_fidelity(student, text.held_out, text.teacher_held_out) if result.steps else after_swap
    return Compressed(student, swap, after_swap, fidelity, result.losses, result.seconds)


def check_settings(settings: CompressSettings) -> None:
    for name in ("batch_size", "max_length", "window", "held_out_texts", "timing_repeats", "train_texts"):
        check_count(f"--{name.replace('_', '-')}", getattr(settings, name), 1)
    check_count("--recovery-steps", settings.distill_steps, 0)
    if not settings.lr > 0:
        raise HeadkitError(f"--lr must be positive, got {settings.lr!r}")
    if settings.dim is not None:
        check_count("--dim", settings.dim, 1)
    for name in ("kv_rank", "eval_window"):
        if getattr(settings, name) is not None:
            check_count(f"--{name.replace('_', '-')}", getattr(settings, name), 1)
    if settings.rope_dims is not None:
        check_count("--rope-dims", settings.rope_dims, 0)
    check_count("--calibration-windows", settings.calibration_windows, 1)
    if settings.rope_selection not in ROPE_SELECTIONS:
        raise HeadkitError(
            f"--rope-selection must be one of {', '.join(ROPE_SELECTIONS)}, got {settings.rope_selection!r}"
        )
    check_data(settings.data)
    check_recipe_tasks(settings, default_is_causal_lm=False)


def compress(
    settings: CompressSettings | None = None, echo: Callable[[str], None] = print, **overrides: Any
) -> CompressResult:
    """Run the recipe (see the module docstring); nothing is written when any step fails."""
    started = time.perf_counter()
    settings = with_overrides(CompressSettings, settings, overrides, check_settings)
    model_path = Path(settings.model) if settings.model is not None else default_encoder_path()
    out = Path(settings.out)
    check_output_folder(model_path, out, settings.overwrite)
    check_latent_before_loading(settings, model_path)
    echo = main_process_echo(echo)
    torch.manual_seed(settings.seed)
    teacher = load_teacher(model_path, settings.dtype)
    dim = teacher.full_dim // 2 if settings.dim is None else settings.dim
    latent = teacher.adapter.rotary
    if not latent and (settings.kv_rank is not None or settings.rope_dims is not None):
        raise HeadkitError(
            f"--kv-rank and --rope-dims compress rotary decoders; {teacher.adapter.name} has no rotary embeddings "
            "and takes collaborative heads (--dim)"
        )
    if latent and settings.dim is not None:
        raise HeadkitError(
            f"{teacher.adapter.name} applies rotary embeddings: --dim (collaborative heads) does not apply; "
            "use --kv-rank and --rope-dims (latent keys/values)"
        )
    if not latent and teacher.kind == "causal_lm":
        get_family(teacher.model, COMPRESS)  # the registry says which decoders take collaborative heads
    if latent:  # everything that can refuse the conversion, before any text is read
        if teacher.kind != "causal_lm":
            raise HeadkitError("latent keys/values (--kv-rank) convert causal LMs")
        kv_rank, rope_dims = latent_defaults(teacher, settings.kv_rank, settings.rope_dims)
        LatentKVConfig(kv_rank, rope_dims, settings.rope_selection).check(teacher.model, teacher.adapter)
        student, report = _compress_latent(teacher, settings, kv_rank, rope_dims, echo)
    elif teacher.kind == "causal_lm":
        student, report = _compress_causal_lm(teacher, dim, settings, echo)
    else:
        student, report = _compress_encoder(teacher, dim, settings, echo)
    report |= {
        "model": str(model_path),
        "out": str(out),
        "kind": teacher.kind,
        "dim_shared_query_key": None if latent else dim,
        "full_dim": teacher.full_dim,
        "distill_steps": settings.distill_steps,
        "parameters_before": count_parameters(teacher.model),
        "parameters_after": count_parameters(student),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
    }
    if settings.eval_tasks:
        report["tasks"] = recipe_tasks(
            settings, teacher.model, student, teacher.tokenizer, "compressed", echo
        )
    save_result(out, student, teacher.tokenizer, report, started=started)
    return CompressResult(student, report)


def _compress_encoder(
    teacher: Teacher, dim: int, settings: CompressSettings, echo: Callable[[str], None]
) -> tuple[nn.Module, dict[str, Any]]:
    text = prepare_encoder_text(
        teacher,
        settings.train_texts if settings.distill_steps else 0,
        settings.held_out_texts,
        settings.batch_size,
        settings.max_length,
        settings.seed,
        settings.data,
    )
    batch = text.held_out[0]
    forward_before = time_call(
        lambda: _no_grad(teacher.model, batch), repeats=settings.timing_repeats, warmup=0
    ).median_s
    compressed = compress_and_distill(teacher, text, dim, settings, echo)
    student = compressed.student
    forward_after = time_call(
        lambda: _no_grad(student, batch), repeats=settings.timing_repeats, warmup=0
    ).median_s
    return student, {
        "fidelity_after_swap": asdict(compressed.fidelity_after_swap),
        "fidelity": asdict(compressed.fidelity),
        "max_relative_error": compressed.swap.max_relative_error,
        "forward_ms_before": 1000 * forward_before,
        "forward_ms_after": 1000 * forward_after,
        "distill_losses": compressed.losses,
        "swap": compressed.swap.to_dict(),
    }


def _compress_causal_lm(
    teacher: Teacher, dim: int, settings: CompressSettings, echo: Callable[[str], None]
) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(settings.seed)
    student = copy.deepcopy(teacher.model)
    # Refuses rotary and grouped-query attention before any data is read.
    swap = swap_to_collaborative(
        student,
        teacher.adapter,
        dim_shared_query_key=dim,
        seed=settings.seed,
        tol=settings.tol,
        max_iter=settings.max_iter,
    )
    echo(str(swap))
    windows = lm_windows(
        teacher.tokenizer,
        load_text(settings.data),
        length=settings.window,
        train_windows=settings.train_texts,
        held_out_windows=settings.held_out_texts,
        seed=settings.seed,
    )
    eval_batch = max(1, min(settings.batch_size, 8))
    original = perplexity(teacher.model, windows.held_out, eval_batch)
    after_swap = perplexity(student, windows.held_out, eval_batch)
    echo(f"held-out perplexity: original {original:.3f}, after the swap {after_swap:.3f}")
    objective = CausalLMObjective(settings.temperature)
    result = distill_run(
        student,
        teacher.model,
        windows.train,
        objective,
        settings,
        steps=settings.distill_steps,
        lr=settings.lr,
        logs=5,
        echo=echo,
    )
    student = result.model
    recovered = perplexity(student, windows.held_out, eval_batch)
    speed = compare_speed(
        teacher.model,
        student,
        prefill_ids=windows.held_out[:1],
        decode_context=min(128, settings.window),
        rounds=settings.timing_repeats,
    )
    return student, {
        "perplexity_original": original,
        "perplexity_after_swap": after_swap,
        "perplexity_recovered": recovered,
        "top1_agreement": agreement(student, teacher.model, windows.held_out, eval_batch).top1,
        "max_relative_error": swap.max_relative_error,
        "speed": speed,
        "distill_losses": result.losses,
        "data": windows.summary(),
        "swap": swap.to_dict(),
    }


def latent_defaults(teacher: Teacher, kv_rank: int | None, rope_dims: int | None) -> tuple[int, int]:
    """(R, D), checked against the model (the valid ranges named): D defaults to head_dim / 4 rounded to whole
    pairs, R to half the key/value cache, G·head_dim − G·D."""
    site = teacher.adapter.sites(teacher.model)[0]
    kv_rank, rope_dims = default_ranks(site.head_dim, site.num_kv_heads, kv_rank, rope_dims)
    hidden = teacher.adapter.read_projections(site).k_weight.shape[1]
    check_latent_arguments(site, hidden, kv_rank, rope_dims)
    return kv_rank, rope_dims


def default_ranks(
    head_dim: int, kv_heads: int, kv_rank: int | None, rope_dims: int | None
) -> tuple[int, int]:
    """(R, D) with the defaults of :func:`latent_defaults` filled in."""
    if rope_dims is None:
        rope_dims = 2 * max(1, head_dim // 8)
    if kv_rank is None:
        kv_rank = max(1, kv_heads * (head_dim - rope_dims)) if isinstance(rope_dims, int) else 1
    return kv_rank, rope_dims


def check_latent_before_loading(settings: CompressSettings, model_path: Path) -> None:
    """--kv-rank / --rope-dims checked against MODEL's 🤗 config (a folder's config.json, a GGUF file's metadata)
    before any weight is loaded: the family must take latent keys/values (Qwen 3 and Gemma 3 do not) and R, D must
    fit its widths. A model after headkit surgery, or one without such a config, is checked once loaded."""
    if settings.kv_rank is None and settings.rope_dims is None:
        return
    config = read_model_config(model_path)
    if config is None or getattr(config, "headkit_surgery", None) or model_type_of(config) not in FAMILIES:
        return
    try:
        _, kv_heads, head_dim = attention_widths(config)
    except (AttributeError, TypeError):  # a config that states no decoder widths: checked once loaded
        return
    kv_rank, rope_dims = default_ranks(head_dim, kv_heads, settings.kv_rank, settings.rope_dims)
    LatentKVConfig(kv_rank, rope_dims, settings.rope_selection).check_config(config)


def latent_statistics(teacher: Teacher, calibration: list[dict]) -> list[SiteStatistics]:
    """The calibration statistics of every layer of the teacher, collected once: they depend on neither R nor D,
    so every student of a run (partial RoPE alone, the rank cut, each point of a curve) reuses them."""
    sites = teacher.adapter.sites(teacher.model)
    with torch.no_grad():
        return collect_statistics(teacher.model, sites, teacher.adapter, calibration)


def latent_student(
    teacher: Teacher,
    kv_rank: int,
    rope_dims: int,
    calibration: list[dict],
    rope_selection: str = FITTED,
    statistics: list[SiteStatistics] | None = None,
) -> tuple[nn.Module, LatentReport]:
    """A fresh copy of the teacher with latent keys/values (calibrated on `calibration`, or on its `statistics`
    from :func:`latent_statistics`); the teacher untouched."""
    student = copy.deepcopy(teacher.model)
    config = LatentKVConfig(kv_rank=kv_rank, rope_dims=rope_dims, rope_selection=rope_selection)
    report = compress_kv_to_latent(student, config, calibration=calibration, statistics=statistics)
    return student, report


def calibration_batches(windows: list[dict], count: int, batch_size: int = 4) -> list[dict]:
    """The first `count` training windows as batches of `batch_size` (what the conversion is calibrated on)."""
    chosen = windows[:count]
    return [
        {"input_ids": torch.stack([w["input_ids"] for w in chosen[i : i + batch_size]])}
        for i in range(0, len(chosen), batch_size)
    ]


def latent_windows(
    teacher: Teacher, settings: CompressSettings
) -> tuple[list[dict], torch.Tensor, dict[str, Any]]:
    """Training windows of ``window`` tokens and held-out windows of ``eval_window`` (default ``window``) tokens,
    from disjoint documents."""
    corpus = load_text(settings.data)
    eval_window = settings.eval_window or settings.window
    train = lm_windows(
        teacher.tokenizer,
        corpus,
        length=settings.window,
        train_windows=max(settings.train_texts, settings.calibration_windows),
        held_out_windows=1,
        seed=settings.seed,
    )
    held_out = lm_windows(
        teacher.tokenizer,
        corpus,
        length=eval_window,
        train_windows=1,
        held_out_windows=settings.held_out_texts,
        seed=settings.seed,
    )
    summary = {"train": train.summary(), "held_out": held_out.summary(), "eval_window": eval_window}
    return train.train, held_out.held_out, summary


def _compress_latent(
    teacher: Teacher, settings: CompressSettings, kv_rank: int, rope_dims: int, echo: Callable[[str], None]
) -> tuple[nn.Module, dict[str, Any]]:
    """Latent keys/values at (R, D), already checked against the teacher by :func:`compress`."""
    train, held_out, data = latent_windows(teacher, settings)
    train = train[: settings.train_texts]
    calibration = calibration_batches(train, settings.calibration_windows)
    statistics = latent_statistics(teacher, calibration)
    eval_batch = max(1, min(settings.batch_size, 8))
    original = perplexity(teacher.model, held_out, eval_batch)
    # The two lossy steps apart: partial RoPE alone (at full rank), then the rank.
    rope_only, rope_report = latent_student(
        teacher,
        rope_report_rank(teacher, rope_dims),
        rope_dims,
        calibration,
        settings.rope_selection,
        statistics,
    )
    after_rope = perplexity(rope_only, held_out, eval_batch)
    del rope_only
    torch.manual_seed(settings.seed)
    student, conversion = latent_student(
        teacher, kv_rank, rope_dims, calibration, settings.rope_selection, statistics
    )
    echo(str(conversion))
    converted = perplexity(student, held_out, eval_batch)
    echo(
        f"held-out perplexity @{data['eval_window']}: original {original:.3f}, partial RoPE (D={rope_dims}, full "
        f"rank) {after_rope:.3f}, converted (R={kv_rank}) {converted:.3f}"
    )
    result = distill_run(
        student,
        teacher.model,
        train,
        CausalLMObjective(settings.temperature),
        settings,
        steps=settings.distill_steps,
        lr=settings.lr,
        echo=echo,
        # The conversion starts far from the teacher: a short warm-up, then a decay that lets the last steps
        # settle instead of hovering at the constant rate's noise floor.
        scheduler="cosine" if settings.distill_steps >= 10 else "constant",
        warmup_steps=settings.distill_steps // 20,
    )
    student = result.model
    recovered = perplexity(student, held_out, eval_batch) if result.steps else converted
    speed = compare_speed(
        teacher.model,
        student,
        prefill_ids=held_out[:1, : settings.window],
        decode_context=min(128, settings.window),
        rounds=settings.timing_repeats,
    )
    before_bytes = round(kv_cache_bytes_per_token(teacher.model))
    after_bytes = round(kv_cache_bytes_per_token(student))
    return student, {
        "method": "latent",
        "kv_rank": kv_rank,
        "rope_dims": rope_dims,
        "rope_selection": settings.rope_selection,
        "kv_bytes_per_token_original": before_bytes,
        "kv_bytes_per_token": after_bytes,
        "kv_cache_fraction": after_bytes / before_bytes,
        "perplexity_original": original,
        "perplexity_partial_rope": after_rope,
        "perplexity_after_swap": converted,
        "perplexity_recovered": recovered,
        "top1_agreement": agreement(student, teacher.model, held_out, eval_batch).top1,
        "max_relative_error": max(conversion.max_key_error, conversion.max_value_error),
        "speed": speed,
        "distill_losses": result.losses,
        "distill_seconds": result.seconds,
        "data": data,
        "conversion": conversion.to_dict(),
        "partial_rope_conversion": {
            "kv_rank": rope_report.kv_rank,
            "max_key_error": rope_report.max_key_error,
            "max_rope_error": rope_report.max_rope_error,
            "max_value_error": rope_report.max_value_error,
        },
    }


def rope_report_rank(teacher: Teacher, rope_dims: int) -> int:
    """The full latent width at `rope_dims` (exact in rank: only the partial RoPE loses information)."""
    site = teacher.adapter.sites(teacher.model)[0]
    hidden = teacher.adapter.read_projections(site).k_weight.shape[1]
    return full_rank(hidden, site.num_kv_heads, site.head_dim, rope_dims)


def _no_grad(model: nn.Module, batch: dict) -> Any:
    with torch.no_grad():
        return model(**batch)


def format_report(report: dict[str, Any]) -> str:
    """The printed table of a compression report."""
    if report.get("method") == "latent":
        return _format_latent(report)
    lines = [
        f"collaborative heads at D̃={report['dim_shared_query_key']} (full size {report['full_dim']}); "
        f"decomposition relative error ≤ {report['max_relative_error']:.3g}"
    ]
    if report["kind"] == "causal_lm":
        original = report["perplexity_original"]
        lines += [
            f"held-out perplexity: original {original:.3f}, after the swap {report['perplexity_after_swap']:.3f} "
            f"({report['perplexity_after_swap'] / original:.2f}x), after {report['distill_steps']} distillation "
            f"steps {report['perplexity_recovered']:.3f} ({report['perplexity_recovered'] / original:.2f}x)",
            f"top-1 next-token agreement with the original: {report['top1_agreement']:.1%}",
            f"prefill: {report['speed']['prefill_ratio']:.2f}x the original; decode per token: "
            f"{report['speed']['decode_ratio']:.2f}x",
        ]
    else:
        swap, fidelity = report["fidelity_after_swap"], report["fidelity"]
        lines.append(
            f"fidelity after the swap: mean cosine {swap['mean_cosine']:.4f} (min {swap['min_cosine']:.4f}), "
            f"max |Δ| {swap['max_abs_diff']:.4g}"
        )
        if report["distill_steps"]:
            lines.append(
                f"fidelity after {report['distill_steps']} distillation steps: mean cosine "
                f"{fidelity['mean_cosine']:.4f} (min {fidelity['min_cosine']:.4f}), max |Δ| "
                f"{fidelity['max_abs_diff']:.4g}"
            )
        lines.append(
            f"forward time: {report['forward_ms_before']:.1f} ms -> {report['forward_ms_after']:.1f} ms "
            f"({report['forward_ms_after'] / report['forward_ms_before']:.2f}x)"
        )
    lines.append(
        f"parameters: {report['parameters_before']:,} -> {report['parameters_after']:,} "
        f"({report['parameters_after'] / report['parameters_before']:.1%})"
    )
    if "seconds" in report:
        lines.append(f"saved to {report['out']} in {report['seconds']:.0f} s")
    return "\n".join(lines)


def _format_latent(report: dict[str, Any]) -> str:
    original = report["perplexity_original"]

    def ratio(key: str) -> str:
        return f"{report[key]:.3f} ({report[key] / original:.2f}x)"

    lines = [
        f"latent keys/values: rank {report['kv_rank']}, {report['rope_dims']} rotary dims per key/value head "
        f"({report['rope_selection']}); "
        f"KV cache {report['kv_bytes_per_token_original']:,} -> {report['kv_bytes_per_token']:,} bytes per token "
        f"({report['kv_cache_fraction']:.1%})",
        f"held-out perplexity @{report['data']['eval_window']}: original {original:.3f}; partial RoPE only "
        f"{ratio('perplexity_partial_rope')}; converted {ratio('perplexity_after_swap')}; after "
        f"{report['distill_steps']} distillation steps {ratio('perplexity_recovered')}",
        f"top-1 next-token agreement with the original: {report['top1_agreement']:.1%}",
        f"prefill: {report['speed']['prefill_ratio']:.2f}x the original; decode per token "
        f"(context {report['speed']['decode_context']}): {report['speed']['decode_ratio']:.2f}x",
        f"parameters: {report['parameters_before']:,} -> {report['parameters_after']:,}",
    ]
    if "seconds" in report:
        lines.append(f"saved to {report['out']} in {report['seconds']:.0f} s")
    return "\n".join(lines)
