"""What the recipes (compress, linearize, prune) share around their settings and results: a settings object with
a call's overrides, the checks every recipe makes of its counts and of ``--data``, and a result that prints as
its report."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from headkit.errors import HeadkitError
from headkit.runs.models import CAUSAL_LM, DEFAULT_DTYPE, check_output_folder, dtype_name, read_model_config
from headkit.runs.options import quick_preset

SettingsT = TypeVar("SettingsT")

# A training forward holds at most this many tokens unless --micro-batch says otherwise. Not for its live tensors
# (with gradient checkpointing one layer's) but for the allocator: glibc carves each forward's freed buffers from a
# heap that keeps their pages, and the heap grew by about one layer's working set per layer. Measured on SmolLM2, a
# LoRA distillation step of 16 × 256 tokens: 5.45 GiB peak in one forward, 3.21 GiB in forwards of 4 × 256, at
# the same step time (docs/memory.md).
TRAINING_FORWARD_TOKENS = 1024


@dataclass
class ModelSettings:
    """Base of every recipe's settings dataclass: ``dtype``, the precision the model is loaded, trained and
    decoded in ("float32" or "bfloat16", ``--dtype``; a torch dtype is taken too and stored by name). A keyword
    field, after a recipe's own; a value outside those is refused here, when the settings are made. In bfloat16
    the recovery trains the bfloat16 weights themselves (no float32 master copy: at full fine-tuning's 1e-4 some
    updates round away; LoRA's adapters train in float32, as PEFT makes them)."""

    dtype: str = field(default=DEFAULT_DTYPE, kw_only=True)
    # Options of every command that saves (prune, compress, linearize); not of a benchmark, which saves no model
    # (``saves``: headkit.runs.options.with_fields_of leaves them out of a benchmark's settings).
    resume: bool = field(
        default=False,
        kw_only=True,
        metadata={
            "help": "Continue an interrupted run of the same command from its work folder beside --out "
            "(<out>.partial): finished stages are skipped, training continues from its newest checkpoint. "
            "Refused when the settings or the input differ.",
            "saves": True,
        },
    )
    checkpoint_steps: int = field(
        default=50,
        kw_only=True,
        metadata={
            "help": "Training steps between the checkpoints kept in the work folder (--resume continues from "
            "the newest).",
            "min": 1,
            "saves": True,
        },
    )

    micro_batch: int | None = field(
        default=None,
        kw_only=True,
        metadata={
            "help": "Examples per forward of the recovery's training (and linearize's attention transfer): each "
            "--batch-size step runs in forwards of this many, their gradients summed into the same step, its "
            "activations' memory divided (divides --batch-size). Default: the most examples whose tokens fit "
            f"{TRAINING_FORWARD_TOKENS:,} a forward (one at least).",
            "min": 1,
        },
    )

    # None: on where the model supports it (every 🤗 decoder and encoder headkit takes). On by default because a
    # forward's activations are what a recovery holds most of: SmolLM2's linearize 3.79 → 2.62 GiB (docs/memory.md).
    gradient_checkpointing: bool | None = field(
        default=None,
        kw_only=True,
        metadata={
            "help": "Recompute each decoder layer's activations in the recovery's backward instead of keeping them "
            "(🤗 gradient checkpointing): the same steps, about a third more compute, one layer's activations "
            "held instead of every layer's. Default: on where the model supports it; --gradient-checkpointing "
            "refuses a model that does not, --no-gradient-checkpointing keeps every activation.",
        },
    )

    max_memory: float | None = field(
        default=None,
        kw_only=True,
        metadata={
            "help": "Refuse before any weight is loaded when the run's peak resident memory, estimated from the "
            "model's config, exceeds this many GiB (causal LMs; default: the machine's memory). The report keeps "
            "the estimate beside the measured peak.",
            "positive": True,
            "saves": True,
        },
    )

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype)


def default_micro_batch(batch: int, example_tokens: int) -> int:
    """Examples per forward without ``--micro-batch``: the largest divisor of `batch` whose examples hold at most
    :data:`TRAINING_FORWARD_TOKENS` tokens together (one example at least)."""
    fitting = [
        size
        for size in range(1, batch + 1)
        if batch % size == 0 and size * example_tokens <= TRAINING_FORWARD_TOKENS
    ]
    return max(fitting, default=1)


def training_forwards(settings: Any, example_tokens: int) -> tuple[int, int]:
    """(examples per forward, forwards per optimizer step) of a recipe's training on examples of `example_tokens`
    tokens: ``--batch-size`` split into forwards of ``--micro-batch`` (times ``--gradient-accumulation`` where the
    recipe has it), the same optimizer step in less memory; refused in one line where the micro-batch does not
    divide the batch. Without ``--micro-batch``, :func:`default_micro_batch`."""
    batch, accumulation = settings.batch_size, getattr(settings, "gradient_accumulation_steps", 1)
    micro = getattr(settings, "micro_batch", None)
    if micro is None:
        micro = default_micro_batch(batch, example_tokens)
    # Under torchrun / accelerate each of N processes takes a share of every forward: one example each at least.
    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if micro < processes and batch % processes == 0:
        micro = processes
    if micro == batch:
        return batch, accumulation
    if micro > batch or batch % micro:
        raise HeadkitError(f"--micro-batch must divide --batch-size ({batch}), got {micro}")
    return micro, accumulation * (batch // micro)


# A causal LM's recovery after pruning trains LoRA adapters by default. Every weight under AdamW holds 16 bytes per
# parameter beside the original's 4: SmolLM2's full recovery cannot stay within 3 GiB, and a 1B model's does not fit 24 GB
# in float32 (docs/memory.md). Measured on SmolLM2 (`headkit prune --quick`, 20 steps, docs/pruning.md): held-out
# perplexity 24.97 through rank 16 against 24.67 training every weight, from 28.70 after the repair.
CAUSAL_LM_LORA_RANK = 16


def recovery_lora_rank(settings: Any, kind: str) -> int | None:
    """The recovery's LoRA rank on a model of `kind`, None where every weight trains: --lora-rank (0: every
    weight), or by default CAUSAL_LM_LORA_RANK on a causal LM and every weight of an encoder."""
    if settings.lora_rank is None:
        return CAUSAL_LM_LORA_RANK if kind == CAUSAL_LM else None
    return settings.lora_rank or None


@dataclass
class QuickSettings(ModelSettings):
    """Base of a recipe's settings dataclass that has a --quick mode: each field's ``quick`` metadata, the value
    that replaces its default there (headkit.runs.options)."""

    quick = quick_preset("The few-minute path on two CPU cores.")


def with_overrides(
    settings_class: type[SettingsT],
    settings: Any,
    overrides: dict[str, Any],
    check: Callable[[SettingsT], None] | None = None,
) -> SettingsT:
    """``settings`` (the defaults of ``settings_class`` when None) with ``overrides`` replacing its fields, passed
    through ``check`` (the recipe's own validation, which raises on a bad field) when given."""
    if settings is None:
        settings = settings_class(**overrides)
    elif overrides:
        settings = settings_class(**(asdict(settings) | overrides))
    if check is not None:
        check(settings)
    return settings


def check_count(option: str, value: Any, minimum: int) -> None:
    """A setting that counts something: an integer ≥ ``minimum`` (0, or 1 and more), else a HeadkitError naming
    its command-line ``option``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer ≥ {minimum}")
        raise HeadkitError(f"{option} must be {kind}, got {value!r}")


def check_data(data: Path | None) -> None:
    """``--data``: None (the default corpus), or a path that exists."""
    if data is not None and not Path(data).exists():
        raise HeadkitError(f"--data {str(data)!r} does not exist")


def check_before_loading(
    preflight: Callable[[Any, Path, Any | None, Path | None], Any],
    settings: Any,
    model_path: Path,
    out: Path | None,
) -> Any:
    """Every check of a recipe's settings that MODEL's 🤗 config can answer (a folder's config.json, a GGUF file's
    metadata), before any weight or text is read: `out` against the model and an existing result (when the run
    saves), then the recipe's ``preflight(settings, model_path, config, out)``. The recipe's skeleton runs it
    first (:func:`headkit.recipes.steps.run_recipe`), and so does the command line, from the light settings module,
    before it imports the recipe. Returns what the preflight does: the run's memory estimate, where it makes one
    (:mod:`headkit.recipes.memory`)."""
    if out is not None:
        check_output_folder(model_path, out, settings.overwrite)
    return preflight(settings, model_path, read_model_config(model_path), out)


@dataclass
class RecipeResult:
    """What a recipe did: its model, and ``report``, what report.json holds; ``str()`` formats the report."""

    model: nn.Module
    report: dict[str, Any] = field(default_factory=dict)
