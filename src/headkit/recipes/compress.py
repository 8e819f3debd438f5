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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.devices import model_device, native_bfloat16
from headkit.errors import HeadkitError
from headkit.evaluation.memory import kv_cache_bytes_per_token
from headkit.evaluation.quality import agreement, embedding_cosine, last_hidden_states, perplexity
from headkit.evaluation.tasks import check_recipe_tasks, with_task_table
from headkit.evaluation.timing import compare_speed, time_call
from headkit.ops._validation import is_finite_number
from headkit.recipes.cache_budget import (
    CacheBudgetSteps,
    budget_context,
    cache_plan,
    format_budget_report,
    parse_fraction,
)
from headkit.recipes.distill import DistillResult, distill_run, encoder_finetune
from headkit.recipes.options import option, with_fields_of
from headkit.recipes.settings import ModelSettings, RecipeResult, check_count, check_data
from headkit.recipes.steps import Recipe, Steps, run_settings
from headkit.runs.models import (
    CAUSAL_LM,
    DEFAULT_DTYPE,
    DTYPES,
    ENCODER,
    LoadedModel,
    default_encoder_path,
    load_model,
    model_kind,
)
from headkit.runs.objectives import CausalLMObjective
from headkit.runs.text import lm_windows, load_text, text_chunks, tokenize_batches
from headkit.surgery.adapters import AttentionAdapter, count_parameters, get_adapter
from headkit.surgery.apply import apply_
from headkit.surgery.collaborative import (
    CollaborativeConfig,
    SwapReport,
    config_widths,
)
from headkit.surgery.families import COMPRESS, FAMILIES, get_family, model_type_of
from headkit.surgery.latent import (
    UNIFORM,
    LatentKVConfig,
    LatentReport,
    attention_widths,
    check_latent_arguments,
)
from headkit.surgery.latent_fit import (
    ROPE_SELECTIONS,
    ROROPE_FITTED,
    SiteStatistics,
    collect_statistics,
    full_rank,
)
from headkit.surgery.quantized_cache import QuantizedKVConfig
from headkit.surgery.repair import reconstruct_attention

# The windows the reconstruction fits on by default, and up to how many after them judge its fit, layer by layer
# (a worse layer is restored).
REPAIR_WINDOWS, REPAIR_CHECK_WINDOWS = 64, 8
# The reconstruction's precision: a --dtype name, or bfloat16 where the device has the instructions.
AUTO = "auto"
REPAIR_PRECISIONS = (AUTO, *DTYPES)


@dataclass
@with_fields_of(LatentKVConfig)
class CompressSettings(ModelSettings):
    """Settings of one ``headkit compress`` run (see the command's --help)."""

    model: Path | None = None
    out: Path = Path("results/compressed-model")
    # shared query/key width D̃; default half of heads·head_dim
    dim: int | None = option(
        None, "Shared query/key width D̃ (default: half of heads × head_dim; full size is exact).", min=1
    )
    recovery_steps: int = option(
        0,
        "Recovery: distillation steps against the original.",
        flag="--recovery-steps",
        removed=("--distill-steps",),
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
    # Rotary decoders (latent keys/values): the fields of LatentKVConfig (R, D, the rotary selection, the rank
    # allocation: their help is the config's), with the recipe's defaults where it has its own.
    # default: half the key/value cache, R = G·(head_dim − D)
    kv_rank: int | None = field(
        default=None, metadata={"default_help": "half the KV cache, kv_heads × (head_dim − rope dims)"}
    )
    rope_dims: int | None = field(default=None, metadata={"default_help": "head_dim / 4"})
    # with calibration text (the recipe always has it) RoRoPE with the fitted criterion measured best
    # (SmolLM2 at 1/2 and 1/4 of the cache: docs/latent-kv.md)
    rope_selection: str = ROROPE_FITTED
    calibration_windows: int = option(
        16, "Rotary decoders: training windows the rotary ranking and the SVD are calibrated on.", min=1
    )
    repair: bool = option(
        True,
        "Rotary decoders: before recovery, fit each latent layer to the original's attention output from the "
        "original's own inputs (layer-local reconstruction; --no-repair to compare).",
    )
    # 160: the repair within 5 minutes on 2 cores in bfloat16 (343 s at 200 steps, 1.42x -> 1.43x; docs/latent-kv.md)
    repair_steps: int = option(160, "Rotary decoders: reconstruction steps per layer.", min=1)
    repair_lr: float = option(2e-3, "Rotary decoders: reconstruction learning rate (Adam, cosine decay).")
    repair_precision: str = option(
        AUTO,
        "Rotary decoders: what the reconstruction's products compute in: 'bfloat16' (autocast; the weights and "
        "their updates stay float32), 'float32', or 'auto': bfloat16 where the device has bfloat16 instructions "
        "(AVX-512 BF16, AMX, CUDA; 1.6x faster on an AVX-512 BF16 CPU at the same perplexity), else float32.",
    )
    repair_windows: int | None = option(
        None,
        f"Rotary decoders: training windows the reconstruction fits on (up to {REPAIR_CHECK_WINDOWS} after them "
        f"judge each layer's fit; default {REPAIR_WINDOWS}, or what the training windows leave).",
        min=1,
    )
    # default: window
    eval_window: int | None = option(
        None, "Rotary decoders: tokens per held-out window (default --window).", min=2
    )
    kv_budget: str | None = option(
        None,
        "Causal LMs: keep the key/value cache within this fraction of the original's bfloat16 bytes (1/8 or "
        "0.125), no training: quantized storage or the compressed cache, whichever measured best at that budget "
        "(headkit.recipes.cache_budget).",
    )
    kv_budget_context: int | None = option(
        None, "The context at which --kv-budget counts bytes (default: the model's context).", min=1
    )
    kv_bits: int | None = option(
        None,
        "With --kv-budget: quantized storage at 8 or 4 bits, whatever the budget would choose.",
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


def check_settings(settings: CompressSettings) -> None:
    for name in ("batch_size", "max_length", "window", "held_out_texts", "timing_repeats", "train_texts"):
        check_count(f"--{name.replace('_', '-')}", getattr(settings, name), 1)
    check_count("--recovery-steps", settings.recovery_steps, 0)
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
    check_count("--repair-steps", settings.repair_steps, 1)
    if settings.repair_precision not in REPAIR_PRECISIONS:
        raise HeadkitError(
            f"--repair-precision must be one of {', '.join(REPAIR_PRECISIONS)}, got {settings.repair_precision!r}"
        )
    if settings.repair_windows is not None:
        check_count("--repair-windows", settings.repair_windows, 1)
    if not is_finite_number(settings.repair_lr) or settings.repair_lr <= 0:
        raise HeadkitError(f"--repair-lr must be a positive number, got {settings.repair_lr!r}")
    check_data(settings.data)
    check_recipe_tasks(settings, default_is_causal_lm=False)
    if settings.kv_budget is None:
        for name in ("kv_budget_context", "kv_bits"):
            if getattr(settings, name) is not None:
                raise HeadkitError(f"--{name.replace('_', '-')} goes with --kv-budget")
        return
    parse_fraction(settings.kv_budget)
    if settings.kv_bits is not None:
        QuantizedKVConfig(bits=settings.kv_bits)
    others = [
        flag for flag, given in (("--dim", settings.dim), ("--kv-rank", settings.kv_rank),
                                  ("--rope-dims", settings.rope_dims), ("--recovery-steps", settings.recovery_steps))
        if given
    ]  # fmt: skip
    if others:
        raise HeadkitError(
            f"--kv-budget chooses the cache itself, without training: drop {', '.join(others)}"
        )


def compress(
    settings: CompressSettings | None = None, echo: Callable[[str], None] = print, **overrides: Any
) -> CompressResult:
    """Run the recipe (see the module docstring); nothing is written when any step fails."""
    return CompressResult(*run_settings(RECIPE, settings, overrides, echo, save=True))


def preflight(settings: CompressSettings, model_path: Path, config: Any | None, out: Path | None) -> None:
    """The settings checked against MODEL's 🤗 config (a folder's config.json, a GGUF file's metadata) before any
    weight is loaded: --dim refused on a rotary decoder family (it takes latent keys/values); --kv-rank /
    --rope-dims as :func:`_preflight_latent` checks them; otherwise, for an encoder or a registered decoder family
    that takes collaborative heads, D̃ (--dim, or its default) and the attention as
    :meth:`CollaborativeConfig.check` checks them on a config. A model after headkit surgery, or one without such a
    config, is checked once loaded."""
    if config is None or getattr(config, "headkit_surgery", None):
        return
    if settings.kv_budget is not None:
        cache_plan(
            config,
            parse_fraction(settings.kv_budget),
            budget_context(settings, config),
            bits=settings.kv_bits,
        )
        return
    family = FAMILIES.get(model_type_of(config))
    # the registry's decoder families without ``compress`` are those with rotary embeddings
    rotary = family is not None and not family.supports(COMPRESS)
    if rotary and settings.dim is not None:
        raise _dim_on_rotary(family.adapter)
    if settings.kv_rank is not None or settings.rope_dims is not None:
        _preflight_latent(settings, config)
    elif not rotary and (family is not None or model_kind(model_path) == ENCODER):
        widths = config_widths(config)
        dim = settings.dim if settings.dim is not None or widths is None else widths[1] // 2
        if dim is not None:
            CollaborativeConfig(dim, settings.seed, settings.tol, settings.max_iter).check(config)


def _preflight_latent(settings: CompressSettings, config: Any) -> None:
    """--kv-rank / --rope-dims against a decoder's config: the family must take latent keys/values (Qwen 3 and
    Gemma 3 do not) and R, D must fit its widths."""
    if model_type_of(config) not in FAMILIES:
        return
    try:
        _, kv_heads, head_dim = attention_widths(config)
    except (AttributeError, TypeError):  # a config that states no decoder widths: checked once loaded
        return
    kv_rank, rope_dims = default_ranks(head_dim, kv_heads, settings.kv_rank, settings.rope_dims)
    latent_config(settings, kv_rank, rope_dims).check(config)


def _dim_on_rotary(adapter_name: str) -> HeadkitError:
    return HeadkitError(
        f"{adapter_name} applies rotary embeddings: --dim (collaborative heads) does not apply; "
        "use --kv-rank and --rope-dims (latent keys/values)"
    )


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
            raise _dim_on_rotary(original.adapter.name)
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


def default_ranks(
    head_dim: int, kv_heads: int, kv_rank: int | None, rope_dims: int | None
) -> tuple[int, int]:
    """(R, D) with the defaults of :func:`latent_defaults` filled in."""
    if rope_dims is None:
        rope_dims = 2 * max(1, head_dim // 8)
    if kv_rank is None:
        kv_rank = max(1, kv_heads * (head_dim - rope_dims)) if isinstance(rope_dims, int) else 1
    return kv_rank, rope_dims


def latent_statistics(teacher: Teacher, calibration: list[dict]) -> list[SiteStatistics]:
    """The calibration statistics of every layer of the teacher, collected once: they depend on neither R nor D,
    so every student of a run (partial RoPE alone, the rank cut, each point of a curve) reuses them."""
    sites = teacher.adapter.sites(teacher.model)
    with torch.no_grad():
        return collect_statistics(teacher.model, sites, teacher.adapter, calibration)


# LatentKVConfig's fields that a settings object passes through as they are (latent_options)
_PASSED_THROUGH = ("rope_fold", "balance_kv")


def latent_options(settings: Any) -> dict[str, Any]:
    """The LatentKVConfig fields of `settings` that the recipe passes on unchanged (RoRoPE's fold, BKV)."""
    return {name: getattr(settings, name) for name in _PASSED_THROUGH if hasattr(settings, name)}


def latent_config(settings: Any, kv_rank: int, rope_dims: int) -> LatentKVConfig:
    """The LatentKVConfig `settings` ask for at (R, D)."""
    return LatentKVConfig(
        kv_rank=kv_rank,
        rope_dims=rope_dims,
        rope_selection=settings.rope_selection,
        rank_allocation=settings.rank_allocation,
        **latent_options(settings),
    )


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
