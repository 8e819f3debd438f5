"""The compression recipe (``headkit compress``): collaborative heads at a shared query/key width, recovered by
distillation, measured and saved.

Cordonnier, Loukas and Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (2020), Sec. 4: the
query/key projections of a trained model are re-parametrised as one shared pair of width D̃ plus a mixing vector
per head, fitted by a CP decomposition of the heads' bilinear forms (:func:`headkit.swap_to_collaborative`), and
the model is then distilled against the original to win back what the lower rank lost.

- Sentence encoders (default all-MiniLM-L6-v2): fidelity is the mean cosine of mean-pooled embeddings on held-out
  text, the objective :class:`~headkit.runs.objectives.EncoderObjective`.
- Causal LMs without rotary embeddings (GPT-2): the LM head is kept, the objective is KL on next-token
  distributions (:class:`~headkit.runs.objectives.CausalLMObjective`) and the report gives held-out perplexity
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.devices import model_device, native_bfloat16
from headkit.errors import HeadkitError
from headkit.evaluation.memory import kv_cache_bytes_per_token
from headkit.evaluation.quality import agreement, embedding_cosine, last_hidden_states, perplexity
from headkit.evaluation.tasks import with_task_table
from headkit.evaluation.timing import compare_speed, time_call
from headkit.recipes.cache_budget import (
    CacheBudgetSteps,
    format_budget_report,
)
from headkit.recipes.compress_settings import (  # noqa: F401  (the names the recipe has always offered)
    AUTO,
    REPAIR_CHECK_WINDOWS,
    REPAIR_PRECISIONS,
    REPAIR_WINDOWS,
    CompressSettings,
    check_settings,
    default_ranks,
    dim_on_rotary,
    latent_config,
    latent_options,
    preflight,
)
from headkit.recipes.distill import DistillResult, distill_run, encoder_finetune
from headkit.recipes.settings import RecipeResult
from headkit.recipes.steps import Recipe, Steps, run_settings
from headkit.runs.models import (
    CAUSAL_LM,
    DEFAULT_DTYPE,
    DTYPES,
    LoadedModel,
    default_encoder_path,
    load_model,
)
from headkit.runs.objectives import CausalLMObjective
from headkit.runs.text import lm_windows, load_text, text_chunks, tokenize_batches
from headkit.surgery.adapters import AttentionAdapter, count_parameters, get_adapter
from headkit.surgery.apply import apply_
from headkit.surgery.collaborative import (
    CollaborativeConfig,
    SwapReport,
)
from headkit.surgery.families import COMPRESS, get_family
from headkit.surgery.latent import (
    UNIFORM,
    LatentKVConfig,
    LatentReport,
    check_latent_arguments,
)
from headkit.surgery.latent_fit import (
    ROROPE_FITTED,
    SiteStatistics,
    collect_statistics,
    full_rank,
)
from headkit.surgery.repair import reconstruct_attention


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
    return teacher_of(load_model(model_path, dtype=dtype))


def teacher_of(loaded: LoadedModel) -> Teacher:
    """The loaded model, frozen, with its adapter (an unsupported architecture fails here) and full width."""
    adapter = get_adapter(loaded.model)
    site = adapter.sites(loaded.model)[0]
    loaded.model.requires_grad_(False)
    return Teacher(
        loaded.source, loaded.model, loaded.tokenizer, adapter, site.num_heads * site.head_dim, loaded.kind
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


def swap_encoder(
    teacher: Teacher, text: EncoderText, dim: int, settings: Any, echo: Callable[[str], None] = print
) -> tuple[nn.Module, SwapReport, Fidelity]:
    """A fresh copy of the teacher swapped to collaborative heads of width `dim`, what the swap did, and the copy's
    held-out fidelity. `settings`: any object with ``seed``, ``tol`` and ``max_iter``."""
    torch.manual_seed(settings.seed)
    student = copy.deepcopy(teacher.model)
    config = CollaborativeConfig(dim, seed=settings.seed, tol=settings.tol, max_iter=settings.max_iter)
    swap = apply_(student, config, adapter=teacher.adapter)
    echo(str(swap))
    after_swap = encoder_fidelity(student, text.held_out, text.teacher_held_out)
    echo(f"fidelity after the swap: mean cosine {after_swap.mean_cosine:.4f}")
    return student, swap, after_swap


def distill_encoder(
    teacher: Teacher,
    student: nn.Module,
    text: EncoderText,
    after_swap: Fidelity,
    settings: Any,
    echo: Callable[[str], None] = print,
) -> tuple[DistillResult, Fidelity]:
    """The swapped `student` distilled (:func:`~headkit.recipes.distill.encoder_finetune`) and its held-out
    fidelity (`after_swap` when no step ran). `settings`: any object with ``recovery_steps``, ``lr``, ``seed`` and
    ``batch_size``."""
    result = encoder_finetune(
        student,
        teacher.model,
        text.train,
        steps=settings.recovery_steps,
        lr=settings.lr,
        batch_size=settings.batch_size,
        seed=settings.seed,
        echo=echo,
        gradient_checkpointing=getattr(settings, "gradient_checkpointing", False),
    )
    fidelity = (
        encoder_fidelity(result.model, text.held_out, text.teacher_held_out) if result.steps else after_swap
    )
    return result, fidelity


def compress_and_distill(
    teacher: Teacher, text: EncoderText, dim: int, settings: Any, echo: Callable[[str], None] = print
) -> Compressed:
    """Swap a fresh copy of the teacher (an encoder) to collaborative heads of width `dim`, measure its held-out
    fidelity, distil it and measure again (:func:`swap_encoder`, :func:`distill_encoder`: the recipe's convert
    and recover steps). `settings`: a :class:`CompressSettings`, or any object with its ``recovery_steps``, ``lr``,
    ``seed``, ``tol``, ``max_iter`` and ``batch_size``. The teacher is left untouched."""
    student, swap, after_swap = swap_encoder(teacher, text, dim, settings, echo)
    result, fidelity = distill_encoder(teacher, student, text, after_swap, settings, echo)
    return Compressed(result.model, swap, after_swap, fidelity, result.losses, result.seconds)


def compress(
    settings: CompressSettings | None = None, echo: Callable[[str], None] = print, **overrides: Any
) -> CompressResult:
    """Run the recipe (see the module docstring); nothing is written when any step fails."""
    return CompressResult(*run_settings(RECIPE, settings, overrides, echo, save=True))


class _CompressSteps(Steps):
    """What every compression shares: the frozen original (:class:`Teacher`), the refusal of options that do not
    fit its attention, and the report's common figures. Collaborative heads have no repair; latent keys/values
    do (:meth:`LatentSteps.repair`)."""

    result_name = "compressed"
    dim: int | None = None  # collaborative heads' D̃; None for latent keys/values

    def __init__(
        self, settings: CompressSettings, model_path: Path, loaded: LoadedModel, echo: Callable[[str], None]
    ) -> None:
        super().__init__(settings, model_path, loaded, echo)
        self.original = teacher_of(loaded)

    def check(self) -> None:
        settings, original = self.settings, self.original
        latent = original.adapter.rotary
        if not latent and (settings.kv_rank is not None or settings.rope_dims is not None):
            raise HeadkitError(
                f"--kv-rank and --rope-dims compress rotary decoders; {original.adapter.name} has no rotary "
                "embeddings and takes collaborative heads (--dim)"
            )
        if latent and settings.dim is not None:
            raise dim_on_rotary(original.adapter.name)
        if not latent and original.kind == CAUSAL_LM:
            get_family(original.model, COMPRESS)  # the registry says which decoders take collaborative heads

    def measure(self) -> None:
        self.report |= {
            "kind": self.original.kind,
            "dim_shared_query_key": self.dim,
            "full_dim": self.original.full_dim,
            "recovery_steps": self.settings.recovery_steps,
            "parameters_before": count_parameters(self.original.model),
            "parameters_after": count_parameters(self.student),
        }


class _CollaborativeSteps(_CompressSteps):
    """Collaborative heads at the shared query/key width D̃ (--dim)."""

    def check(self) -> None:
        super().check()
        settings = self.settings
        self.dim = self.original.full_dim // 2 if settings.dim is None else settings.dim
        CollaborativeConfig(self.dim, settings.seed, settings.tol, settings.max_iter).check(
            self.original.model, self.original.adapter
        )


class EncoderCompressSteps(_CollaborativeSteps):
    """An encoder: fidelity is the cosine of held-out embeddings."""

    def data(self) -> None:
        settings, original = self.settings, self.original
        self.text = prepare_encoder_text(
            original,
            settings.train_texts if settings.recovery_steps else 0,
            settings.held_out_texts,
            settings.batch_size,
            settings.max_length,
            settings.seed,
            settings.data,
        )
        self.forward_before = self._forward_seconds(original.model)

    def _forward_seconds(self, model: nn.Module) -> float:
        batch = self.text.held_out[0]
        return time_call(
            lambda: _no_grad(model, batch), repeats=self.settings.timing_repeats, warmup=0
        ).median_s

    def convert(self) -> None:
        self.student, self.swap, self.after_swap = swap_encoder(
            self.original, self.text, self.dim, self.settings, self.echo
        )

    def recover(self) -> None:
        self.recovery, self.fidelity = distill_encoder(
            self.original, self.student, self.text, self.after_swap, self.settings, self.echo
        )
        self.student = self.recovery.model

    def measure(self) -> None:
        forward_after = self._forward_seconds(self.student)
        self.report |= {
            "fidelity_after_swap": asdict(self.after_swap),
            "fidelity": asdict(self.fidelity),
            "max_relative_error": self.swap.max_relative_error,
            "forward_ms_before": 1000 * self.forward_before,
            "forward_ms_after": 1000 * forward_after,
            "distill_losses": self.recovery.losses,
            "swap": self.swap.to_dict(),
        }
        super().measure()


class CausalLMCompressSteps(_CollaborativeSteps):
    """A causal LM without rotary embeddings (GPT-2): the LM head kept, KL on next-token distributions."""

    def data(self) -> None:
        settings = self.settings
        self.windows = lm_windows(
            self.tokenizer,
            load_text(settings.data),
            length=settings.window,
            train_windows=settings.train_texts,
            held_out_windows=settings.held_out_texts,
            seed=settings.seed,
        )
        self.eval_batch = max(1, min(settings.batch_size, 8))
        self.perplexity_original = perplexity(self.original.model, self.windows.held_out, self.eval_batch)

    def convert(self) -> None:
        settings = self.settings
        torch.manual_seed(settings.seed)
        self.student = copy.deepcopy(self.original.model)
        config = CollaborativeConfig(
            self.dim, seed=settings.seed, tol=settings.tol, max_iter=settings.max_iter
        )
        self.swap = apply_(self.student, config, adapter=self.original.adapter)
        self.echo(str(self.swap))
        self.perplexity_after_swap = perplexity(self.student, self.windows.held_out, self.eval_batch)
        self.echo(
            f"held-out perplexity: original {self.perplexity_original:.3f}, after the swap "
            f"{self.perplexity_after_swap:.3f}"
        )

    def recover(self) -> None:
        settings = self.settings
        self.recovery = distill_run(
            self.student,
            self.original.model,
            self.windows.train,
            CausalLMObjective(settings.temperature),
            settings,
            steps=settings.recovery_steps,
            lr=settings.lr,
            logs=5,
            echo=self.echo,
        )
        self.student = self.recovery.model

    def measure(self) -> None:
        settings, teacher, student, held_out = (
            self.settings,
            self.original.model,
            self.student,
            self.windows.held_out,
        )
        recovered = perplexity(student, held_out, self.eval_batch)
        speed = compare_speed(
            teacher,
            student,
            prefill_ids=held_out[:1],
            decode_context=min(128, settings.window),
            rounds=settings.timing_repeats,
        )
        self.report |= {
            "perplexity_original": self.perplexity_original,
            "perplexity_after_swap": self.perplexity_after_swap,
            "perplexity_recovered": recovered,
            "top1_agreement": agreement(student, teacher, held_out, self.eval_batch).top1,
            "max_relative_error": self.swap.max_relative_error,
            "speed": speed,
            "distill_losses": self.recovery.losses,
            "data": self.windows.summary(),
            "swap": self.swap.to_dict(),
        }
        super().measure()


class LatentSteps(_CompressSteps):
    """A rotary decoder: latent keys/values at (R, D), calibrated once on training windows; the report separates
    the two lossy steps (partial RoPE at full rank, then the rank)."""

    def check(self) -> None:
        super().check()
        settings, original = self.settings, self.original
        if original.kind != CAUSAL_LM:
            raise HeadkitError("latent keys/values (--kv-rank) convert causal LMs")
        self.kv_rank, self.rope_dims = latent_defaults(original, settings.kv_rank, settings.rope_dims)
        latent_config(settings, self.kv_rank, self.rope_dims).check(original.model, original.adapter)
        if settings.repair:
            self.repair_split = repair_split(settings)

    def data(self) -> None:
        settings = self.settings
        train, self.held_out, self.data_summary = latent_windows(self.original, settings)
        self.train = train[: settings.train_texts]
        self.calibration = calibration_batches(self.train, settings.calibration_windows)
        # Once per model: they depend on neither R nor D.
        self.statistics = latent_statistics(self.original, self.calibration)
        self.eval_batch = max(1, min(settings.batch_size, 8))
        self.perplexity_original = perplexity(self.original.model, self.held_out, self.eval_batch)

    def convert(self) -> None:
        settings, original, rope_dims = self.settings, self.original, self.rope_dims
        # The two lossy steps apart: partial RoPE alone (at full rank), then the rank.
        rope_only, self.rope_report = latent_student(
            original,
            rope_report_rank(original, rope_dims),
            rope_dims,
            self.calibration,
            settings.rope_selection,
            self.statistics,
            **latent_options(settings),
        )
        self.perplexity_partial_rope = perplexity(rope_only, self.held_out, self.eval_batch)
        del rope_only
        torch.manual_seed(settings.seed)
        self.student, self.conversion = latent_student(
            original,
            self.kv_rank,
            rope_dims,
            self.calibration,
            settings.rope_selection,
            self.statistics,
            settings.rank_allocation,
            **latent_options(settings),
        )
        self.echo(str(self.conversion))
        self.perplexity_converted = perplexity(self.student, self.held_out, self.eval_batch)
        self.perplexity_before_recovery = self.perplexity_converted
        self.echo(
            f"held-out perplexity @{self.data_summary['eval_window']}: original {self.perplexity_original:.3f}, "
            f"partial RoPE (D={rope_dims}, full rank) {self.perplexity_partial_rope:.3f}, converted "
            f"(R={self.kv_rank}) {self.perplexity_converted:.3f}"
        )

    def repair(self) -> dict[str, Any] | None:
        """Layer-local reconstruction (:func:`headkit.surgery.repair.reconstruct_attention`): every latent
        layer's parameters fit to the original's attention output from the original's inputs, one teacher pass."""
        settings = self.settings
        if not settings.repair:
            return None
        fit, check = self.repair_split
        reconstruction = reconstruct_attention(
            self.student,
            self.original.model,
            calibration_batches(self.train, fit),
            calibration_batches(self.train[fit:], check),
            steps=settings.repair_steps,
            lr=settings.repair_lr,
            precision=repair_precision(settings.repair_precision, self.student),
            adapter=self.original.adapter,
        )
        self.echo(str(reconstruction))
        self.perplexity_before_recovery = perplexity(self.student, self.held_out, self.eval_batch)
        self.echo(
            f"held-out perplexity after repair: {self.perplexity_before_recovery:.3f} "
            f"({self.perplexity_before_recovery / self.perplexity_original:.2f}x)"
        )
        return reconstruction.to_dict() | {"perplexity": self.perplexity_before_recovery}

    def recover(self) -> None:
        settings = self.settings
        self.recovery = distill_run(
            self.student,
            self.original.model,
            self.train,
            CausalLMObjective(settings.temperature),
            settings,
            steps=settings.recovery_steps,
            lr=settings.lr,
            echo=self.echo,
            # The conversion starts far from the teacher: a short warm-up, then a decay that lets the last steps
            # settle instead of hovering at the constant rate's noise floor.
            scheduler="cosine" if settings.recovery_steps >= 10 else "constant",
            warmup_steps=settings.recovery_steps // 20,
        )
        self.student = self.recovery.model

    def measure(self) -> None:
        settings, teacher, student, held_out = self.settings, self.original.model, self.student, self.held_out
        recovered = (
            perplexity(student, held_out, self.eval_batch)
            if self.recovery.steps
            else self.perplexity_before_recovery
        )
        speed = compare_speed(
            teacher,
            student,
            prefill_ids=held_out[:1, : settings.window],
            decode_context=min(128, settings.window),
            rounds=settings.timing_repeats,
        )
        before_bytes = round(kv_cache_bytes_per_token(teacher))
        after_bytes = round(kv_cache_bytes_per_token(student))
        conversion, rope_report = self.conversion, self.rope_report
        self.report |= {
            "method": "latent",
            "kv_rank": self.kv_rank,
            "rope_dims": self.rope_dims,
            "rope_selection": settings.rope_selection,
            "rank_allocation": settings.rank_allocation,
            **latent_options(settings),
            "kv_ranks": conversion.kv_ranks,
            "kv_bytes_per_token_original": before_bytes,
            "kv_bytes_per_token": after_bytes,
            "kv_cache_fraction": after_bytes / before_bytes,
            "perplexity_original": self.perplexity_original,
            "perplexity_partial_rope": self.perplexity_partial_rope,
            "perplexity_after_swap": self.perplexity_converted,
            "perplexity_recovered": recovered,
            "top1_agreement": agreement(student, teacher, held_out, self.eval_batch).top1,
            "max_relative_error": max(conversion.max_key_error, conversion.max_value_error),
            "speed": speed,
            "distill_losses": self.recovery.losses,
            "distill_seconds": self.recovery.seconds,
            "data": self.data_summary,
            "conversion": conversion.to_dict(),
            "partial_rope_conversion": {
                "kv_rank": rope_report.kv_rank,
                "max_key_error": rope_report.max_key_error,
                "max_rope_error": rope_report.max_rope_error,
                "max_value_error": rope_report.max_value_error,
            },
        }
        super().measure()


def _steps(
    settings: CompressSettings, model_path: Path, loaded: LoadedModel, echo: Callable[[str], None]
) -> _CompressSteps:
    """The steps that fit the model: the cache budget's where --kv-budget is given, latent keys/values for rotary
    attention, else collaborative heads."""
    if settings.kv_budget is not None:
        return CacheBudgetSteps(settings, model_path, loaded, echo)
    rotary = get_adapter(loaded.model).rotary
    steps = LatentSteps if rotary else CausalLMCompressSteps if loaded.is_causal_lm else EncoderCompressSteps
    return steps(settings, model_path, loaded, echo)


RECIPE = Recipe(preflight, _steps, CompressSettings, check_settings, default_encoder_path)


def repair_precision(choice: str, model: nn.Module) -> torch.dtype | None:
    """The autocast dtype of the reconstruction for `choice` (:data:`REPAIR_PRECISIONS`): bfloat16 for
    'bfloat16', and for 'auto' where `model`'s device has bfloat16 instructions; None (the weights' own dtype)
    otherwise."""
    if choice == AUTO:
        return torch.bfloat16 if native_bfloat16(model_device(model)) else None
    return None if DTYPES[choice] == torch.float32 else DTYPES[choice]


def repair_split(settings: CompressSettings) -> tuple[int, int]:
    """(windows the reconstruction fits on, windows after them that judge it), out of the run's training windows:
    --repair-windows (default :data:`REPAIR_WINDOWS`, or what is left after the judging windows) and up to
    :data:`REPAIR_CHECK_WINDOWS`; refused when --repair-windows leaves none to judge."""
    total = settings.train_texts
    if total < 2:
        raise HeadkitError(
            f"the repair needs at least 2 training windows (one to fit, one to judge), the run has {total} "
            "(train_texts): --no-repair"
        )
    if settings.repair_windows is None:
        check = min(REPAIR_CHECK_WINDOWS, total // 2)
        return min(REPAIR_WINDOWS, total - check), check
    check = min(REPAIR_CHECK_WINDOWS, total - settings.repair_windows)
    if check < 1:
        raise HeadkitError(
            f"--repair-windows must be below the run's {total} training windows (train_texts), so that some are "
            f"left to judge the fit, got {settings.repair_windows}: lower it, or --no-repair"
        )
    return settings.repair_windows, check


def latent_defaults(teacher: Teacher, kv_rank: int | None, rope_dims: int | None) -> tuple[int, int]:
    """(R, D), checked against the model (the valid ranges named): D defaults to head_dim / 4 rounded to whole
    pairs, R to half the key/value cache, G·head_dim − G·D."""
    site = teacher.adapter.sites(teacher.model)[0]
    kv_rank, rope_dims = default_ranks(site.head_dim, site.num_kv_heads, kv_rank, rope_dims)
    hidden = teacher.adapter.read_projections(site).k_weight.shape[1]
    check_latent_arguments(site, hidden, kv_rank, rope_dims)
    return kv_rank, rope_dims


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
    rope_selection: str = ROROPE_FITTED,
    statistics: list[SiteStatistics] | None = None,
    rank_allocation: str = UNIFORM,
    **options: Any,
) -> tuple[nn.Module, LatentReport]:
    """A fresh copy of the teacher with latent keys/values (calibrated on `calibration`, or on its `statistics`
    from :func:`latent_statistics`); the teacher untouched. `options`: LatentKVConfig's other fields
    (``rope_fold``, ``balance_kv``)."""
    student = copy.deepcopy(teacher.model)
    config = LatentKVConfig(
        kv_rank=kv_rank,
        rope_dims=rope_dims,
        rope_selection=rope_selection,
        rank_allocation=rank_allocation,
        **options,
    )
    report = apply_(student, config, calibration=calibration, statistics=statistics)
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
    if report.get("method") == "kv_budget":
        return format_budget_report(report)
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
            f"({report['perplexity_after_swap'] / original:.2f}x), after {report['recovery_steps']} distillation "
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
        if report["recovery_steps"]:
            lines.append(
                f"fidelity after {report['recovery_steps']} distillation steps: mean cosine "
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
        f"{ratio('perplexity_partial_rope')}; converted {ratio('perplexity_after_swap')}; "
        + (
            f"repaired {report['repair']['perplexity']:.3f} ({report['repair']['perplexity'] / original:.2f}x, "
            f"{report['repair']['seconds']:.0f} s); "
            if report.get("repair")
            else ""
        )
        + f"after {report['recovery_steps']} distillation steps {ratio('perplexity_recovered')}",
        f"top-1 next-token agreement with the original: {report['top1_agreement']:.1%}",
        f"prefill: {report['speed']['prefill_ratio']:.2f}x the original; decode per token "
        f"(context {report['speed']['decode_context']}): {report['speed']['decode_ratio']:.2f}x",
        f"parameters: {report['parameters_before']:,} -> {report['parameters_after']:,}",
    ]
    if "seconds" in report:
        lines.append(f"saved to {report['out']} in {report['seconds']:.0f} s")
    return "\n".join(lines)
