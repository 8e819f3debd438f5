"""The pruning recipe's settings (``headkit prune``'s options): :class:`PruneSettings`, their checks before any
work (:func:`check_settings`), and what they resolve to for a model: the query heads kept (:func:`target_heads`),
the held-out count (:func:`held_out_count`) and the recovery learning rate (:func:`recovery_lr`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headkit.errors import HeadkitError
from headkit.evaluation.tasks import check_recipe_tasks
from headkit.recipes.settings import (
    CAUSAL_LM_LORA_RANK,
    QuickSettings,
    check_data,
    recovery_lora_rank,
    training_forwards,
)
from headkit.runs.models import CAUSAL_LM, ENCODER, model_kind
from headkit.runs.options import check_choice, check_options, option, with_fields_of
from headkit.surgery.families import text_config
from headkit.surgery.pruning_config import PruneConfig

if TYPE_CHECKING:
    from headkit.recipes.memory import MemoryEstimate

METHODS = ("importance", "l0", "refit")


@dataclass
@with_fields_of(PruneConfig, names=("unit", "uniform"))
class PruneSettings(QuickSettings):
    """Settings of one pruning run (``headkit prune --help`` documents each)."""

    model: Path | None = None
    out: Path = Path("results/pruned-model")
    heads: int | None = option(None, "Query heads to keep in all (default: half of them).")
    # unit, uniform: PruneConfig's fields (with_fields_of), recorded with the pruning
    # None: "l0" for encoders; for causal LMs "refit" with the repair, "importance" without (--no-repair)
    method: str | None = option(
        None,
        "Head ranking: 'refit' (causal LMs, the default with the repair: the error each removal leaves after the "
        "least-squares repair, weighed token by token by the loss's gradient, chooses the heads and how many each "
        "layer gives up), 'importance' (gradient importance; the default for causal LMs with --no-repair) or "
        "'l0' gates (encoders).",
        check=lambda method: check_choice("--method", method, METHODS),
    )
    data: Path | None = option(
        None, "Text to train and measure on: a file, a folder of them, or JSONL with a 'text' field."
    )
    gate_steps: int = option(300, "Gate training steps.", flag="--steps", min=0, quick=60)
    recovery_steps: int = option(
        100, "Distillation steps after removal.", min=0, removed=("--finetune-steps",), quick=20
    )
    # None: CAUSAL_LM_LORA_RANK on a causal LM, every weight of an encoder (recovery_lora_rank)
    lora_rank: int | None = option(
        None,
        "Recover through LoRA adapters of this rank (PEFT), merged after; 0 trains every weight.",
        default_help=f"{CAUSAL_LM_LORA_RANK} on a causal LM, every weight of an encoder",
        min=0,
    )
    # None: 1e-4 full fine-tuning, 1e-3 LoRA
    lr: float | None = option(None, "Recovery learning rate (default 1e-4; 1e-3 with LoRA).", min=0.0)
    gate_lr: float = option(0.1, "Learning rate of the gates' log alpha.", min=0.0)
    batch_size: int = option(16, "Texts or windows per step.", min=1, quick=8)
    gradient_accumulation_steps: int = option(
        1, "Forwards per optimizer step.", flag="--gradient-accumulation", min=1
    )
    # tokens per text (encoders)
    max_length: int = field(default=64, metadata={"quick": 48, "min": 2, "flag": "--max-length"})
    # tokens per window (causal LMs)
    window: int = option(256, "Tokens per causal-LM window.", min=2, quick=128)
    # encoder texts, or causal-LM windows
    train_texts: int = option(1024, "Training texts or windows.", min=1, quick=128)
    # None: 256 encoder texts, 64 causal-LM windows
    held_out_texts: int | None = option(
        None,
        "Held-out texts or windows measured on (default 256 texts / 64 windows; 16 with --quick).",
        flag="--held-out",
        min=1,
        quick=16,
    )
    importance_batches: int = field(default=8, metadata={"quick": 2, "min": 1})
    temperature: float = option(
        1.0, "Distillation temperature of the causal-LM objective, > 0.", positive=True
    )
    hidden_weight: float = 0.0
    seed: int = option(0, "Seed of the sampling, the gate noise and the training order.")
    overwrite: bool = False
    # also write the result as a GGUF file for llama.cpp (export.gguf)
    export_gguf: Path | None = option(
        None, "Also write the result as a GGUF file for llama.cpp (see `headkit export`)."
    )
    export_type: str = option("f16", "Weight type of --export-gguf: f32, f16, bf16 or q8_0.")
    timing_rounds: int = field(default=3, metadata={"quick": 2, "min": 1})
    decode_context: int = field(default=512, metadata={"quick": 128, "min": 1})
    repair: bool = option(
        True,
        "Refit each pruned layer's output projection (and its bias, where it has one) by least squares on "
        "calibration text before recovery; encoders: on the original's weights, kept where closer than the gated "
        "ones (--no-repair keeps the sliced projections, to compare).",
    )
    # lm-evaluation-harness tasks scored on the original and the result (headkit.evaluation.tasks): none by default.
    eval_tasks: tuple[str, ...] = ()
    eval_include_path: Path | None = None


def check_settings(settings: PruneSettings) -> None:
    """Every option checked before any work (a bad one names itself): the pruning plan's fields by PruneConfig,
    the recipe's by what their fields declare."""
    PruneConfig(unit=settings.unit, uniform=settings.uniform)  # the config checks its own fields
    check_options(settings)
    training_forwards(settings, settings.window)  # --micro-batch divides --batch-size
    check_data(settings.data)
    check_recipe_tasks(settings, default_is_causal_lm=False)


DEFAULT_HELD_OUT = {ENCODER: 256, CAUSAL_LM: 64}  # encoder texts, causal-LM windows


def held_out_count(settings: PruneSettings, kind: str) -> int:
    """How many held-out texts (encoders) or windows (causal LMs) measure the model: --held-out, or the default
    of the model's kind."""
    return DEFAULT_HELD_OUT[kind] if settings.held_out_texts is None else settings.held_out_texts


def target_heads(total: int, settings: PruneSettings) -> int:
    """The query heads to keep of a model's `total`: --heads, or half of them; out of [1, total], refused."""
    keep = total // 2 if settings.heads is None else settings.heads
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= total:
        raise HeadkitError(
            f"--heads must be in [1, {total}] (the model has {total} query heads), got {keep!r}"
        )
    return keep


def recovery_lr(settings: PruneSettings, kind: str) -> float:
    """The recovery's learning rate on a model of `kind`: --lr, or 1e-4 (1e-3 with LoRA)."""
    if settings.lr is not None:
        return settings.lr
    return 1e-3 if recovery_lora_rank(settings, kind) else 1e-4


def preflight(
    settings: PruneSettings, model_path: Path, config: Any | None, out: Path | None
) -> MemoryEstimate | None:
    """Before any weight is loaded: --heads against MODEL's 🤗 config (layers × heads; a folder's config.json or a
    GGUF file's metadata), the estimated peak memory against --max-memory (a causal LM;
    :func:`~headkit.recipes.memory.check_max_memory`, which builds the model on the meta device: after the
    checks that need no model code), and --export-gguf's target when the result is saved. A model after headkit
    surgery (its heads no longer what the config states), or one without such a config, is checked once loaded;
    so is an encoder, which may share a layer (ALBERT). Here, beside the settings, so that ``headkit prune``
    refuses a bad option before the recipe's modules are imported."""
    if out is not None and settings.export_gguf is not None:
        from headkit.export.gguf import check_export_target

        check_export_target(model_path, settings.export_gguf, settings.export_type, settings.overwrite)
    if config is None or getattr(config, "headkit_surgery", None) or model_kind(model_path) != CAUSAL_LM:
        return
    if settings.heads is not None:
        text = text_config(config)
        layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
        heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
        if isinstance(layers, int) and isinstance(heads, int):
            target_heads(layers * heads, settings)
    from headkit.recipes.memory import check_max_memory, estimate_prune_memory

    return check_max_memory(settings, config, estimate_prune_memory, model_path)


__all__ = [
    "CAUSAL_LM_LORA_RANK",
    "DEFAULT_HELD_OUT",
    "METHODS",
    "PruneSettings",
    "check_settings",
    "held_out_count",
    "preflight",
    "recovery_lora_rank",
    "recovery_lr",
    "target_heads",
]
