"""The compression recipe's settings (``headkit compress``'s options): :class:`CompressSettings` (the recipe's own
fields, then every field of :class:`~headkit.surgery.latent_config.LatentKVConfig`), their checks before any work
(:func:`check_settings`) and against MODEL's 🤗 config before any weight is loaded (:func:`preflight`), and the
latent config they ask for (:func:`latent_config`). No model code on the paths that refuse --kv-rank or
--rope-dims: ``headkit compress`` refuses a bad option from here before it imports the recipe
(:mod:`headkit.recipes.compress`); collaborative heads' and --kv-budget's checks import their modules when taken.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headkit.errors import HeadkitError
from headkit.evaluation.tasks import check_recipe_tasks
from headkit.recipes.settings import ModelSettings, check_data, training_forwards
from headkit.runs.models import DTYPES, ENCODER, model_kind
from headkit.runs.options import check_choice, check_options, option, with_fields_of
from headkit.surgery.families import COMPRESS, FAMILIES, model_type_of
from headkit.surgery.latent_config import ROPE_SELECTIONS, ROROPE_FITTED, LatentKVConfig, attention_widths

if TYPE_CHECKING:
    from headkit.recipes.memory import MemoryEstimate

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
        positive=True,
    )
    lora_rank: int | None = option(None, "Distil through LoRA of this rank (PEFT), merged after.", min=1)
    batch_size: int = option(16, "Texts (windows) per distillation step and held-out batch.", min=1)
    # tokens per text (encoders)
    max_length: int = option(64, "Tokens per encoder text (longer texts are truncated).", min=2)
    # tokens per window (causal LMs)
    window: int = option(256, "Tokens per causal-LM window.", min=2)
    train_texts: int = field(default=512, metadata={"min": 1})
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
    rope_selection: str = field(
        default=ROROPE_FITTED,
        metadata={"check": lambda value: check_choice("--rope-selection", value, ROPE_SELECTIONS)},
    )
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
    repair_lr: float = option(
        2e-3, "Rotary decoders: reconstruction learning rate (Adam, cosine decay).", positive=True
    )
    repair_precision: str = option(
        AUTO,
        "Rotary decoders: what the reconstruction's products compute in: 'bfloat16' (autocast; the weights and "
        "their updates stay float32), 'float32', or 'auto': bfloat16 where the device has bfloat16 instructions "
        "(AVX-512 BF16, AMX, CUDA; 1.6x faster on an AVX-512 BF16 CPU at the same perplexity), else float32.",
        check=lambda value: check_choice("--repair-precision", value, REPAIR_PRECISIONS),
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
        "With --kv-budget: storage in 8 or 4 bits, whatever the budget would choose: alone where it fits, else the "
        "compressed cache in those bits; 16: none, the compressed cache in bfloat16.",
    )
    kv_retrieval_heads: int | None = option(
        None,
        "With --kv-budget: this many key/value heads keep their whole cache (retrieval heads, DuoAttention), the "
        "original's best at retrieving a passkey, their bytes counted in the budget; where the compressed cache is "
        "chosen (default: about 9% of its layers' key/value heads where their caches take at most half of "
        "the budget; 0: none).",
        min=0,
    )
    kv_selection: str | None = option(
        None,
        "With --kv-budget, where the compressed cache is chosen: how it chooses the keys it keeps: 'question' (the "
        "prompt's last queries, SnapKV; the default) or 'reconstruction' (those the model reads to repeat the "
        "prompt, before any question, so that a later turn finds them: KVzip; a scoring forward over the prompt "
        "repeated runs before each prefill).",
    )
    # lm-evaluation-harness tasks scored on the original and the result (headkit.evaluation.tasks): none by default.
    eval_tasks: tuple[str, ...] = ()
    eval_include_path: Path | None = None


def check_settings(settings: CompressSettings) -> None:
    """Every option checked before any work (a bad one names itself): what the fields declare, then the
    options that go together (--kv-budget with its context and bits, without the trained conversions')."""
    check_options(settings)
    training_forwards(settings, settings.window)  # --micro-batch divides --batch-size
    check_data(settings.data)
    check_recipe_tasks(settings, default_is_causal_lm=False)
    if settings.kv_budget is None:
        for name in ("kv_budget_context", "kv_bits", "kv_retrieval_heads", "kv_selection"):
            if getattr(settings, name) is not None:
                raise HeadkitError(f"--{name.replace('_', '-')} goes with --kv-budget")
        return
    from headkit.recipes.cache_budget import check_storage_bits, parse_fraction

    check_storage_bits(settings.kv_bits, parse_fraction(settings.kv_budget))
    from headkit.surgery.compressed_cache import COMPRESSED_SELECTIONS

    if settings.kv_selection is not None and settings.kv_selection not in COMPRESSED_SELECTIONS:
        raise HeadkitError(
            f"--kv-selection must be one of {', '.join(COMPRESSED_SELECTIONS)}, got {settings.kv_selection!r}"
        )
    others = [
        flag for flag, given in (("--dim", settings.dim), ("--kv-rank", settings.kv_rank),
                                  ("--rope-dims", settings.rope_dims), ("--recovery-steps", settings.recovery_steps))
        if given
    ]  # fmt: skip
    if others:
        raise HeadkitError(
            f"--kv-budget chooses the cache itself, without training: drop {', '.join(others)}"
        )


def preflight(
    settings: CompressSettings, model_path: Path, config: Any | None, out: Path | None
) -> MemoryEstimate | None:
    """The settings checked against MODEL's 🤗 config (a folder's config.json, a GGUF file's metadata) before any
    weight is loaded: --dim refused on a rotary decoder family (it takes latent keys/values); --kv-rank /
    --rope-dims as :func:`preflight_latent` checks them; otherwise, for an encoder or a registered decoder family
    that takes collaborative heads, D̃ (--dim, or its default) and the attention as
    :meth:`CollaborativeConfig.check` checks them on a config; then, for a causal LM, the estimated peak memory
    against --max-memory (:func:`headkit.recipes.memory.check_max_memory`), which it returns. A model after headkit
    surgery, or one without such a config, is checked once loaded."""
    if config is None or getattr(config, "headkit_surgery", None):
        return None
    _check_against_config(settings, model_path, config)
    if model_kind(model_path) == ENCODER:
        return None
    from headkit.recipes.memory import check_max_memory, estimate_compress_memory

    cache_window = None
    if settings.kv_budget is not None:
        from headkit.recipes.cache_budget import budget_context, evaluation_window

        cache_window = evaluation_window(settings, budget_context(settings, config))
    estimate = functools.partial(
        estimate_compress_memory,
        repair_tokens=((settings.repair_windows or REPAIR_WINDOWS) + REPAIR_CHECK_WINDOWS) * settings.window,
        cache_window=cache_window,
    )
    return check_max_memory(settings, config, estimate, model_path)


def _check_against_config(settings: CompressSettings, model_path: Path, config: Any) -> None:
    if settings.kv_budget is not None:
        from headkit.recipes.cache_budget import budget_context, cache_plan, parse_fraction

        cache_plan(
            config,
            parse_fraction(settings.kv_budget),
            budget_context(settings, config),
            bits=settings.kv_bits,
            retrieval_heads=settings.kv_retrieval_heads,
            selection=settings.kv_selection,
        )
        return
    family = FAMILIES.get(model_type_of(config))
    # the registry's decoder families without ``compress`` are those with rotary embeddings
    rotary = family is not None and not family.supports(COMPRESS)
    if rotary and settings.dim is not None:
        raise dim_on_rotary(family.adapter)
    if settings.kv_rank is not None or settings.rope_dims is not None:
        preflight_latent(settings, config)
    elif not rotary and (family is not None or model_kind(model_path) == ENCODER):
        # collaborative heads: their config's check (headkit.surgery.collaborative, model code)
        from headkit.surgery.collaborative import CollaborativeConfig, config_widths

        widths = config_widths(config)
        dim = settings.dim if settings.dim is not None or widths is None else widths[1] // 2
        if dim is not None:
            CollaborativeConfig(dim, settings.seed, settings.tol, settings.max_iter).check(config)


def preflight_latent(settings: CompressSettings, config: Any) -> None:
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


def dim_on_rotary(adapter_name: str) -> HeadkitError:
    return HeadkitError(
        f"{adapter_name} applies rotary embeddings: --dim (collaborative heads) does not apply; "
        "use --kv-rank and --rope-dims (latent keys/values)"
    )


def default_ranks(
    head_dim: int, kv_heads: int, kv_rank: int | None, rope_dims: int | None
) -> tuple[int, int]:
    """(R, D) with the defaults of :func:`latent_defaults` filled in."""
    if rope_dims is None:
        rope_dims = 2 * max(1, head_dim // 8)
    if kv_rank is None:
        kv_rank = max(1, kv_heads * (head_dim - rope_dims)) if isinstance(rope_dims, int) else 1
    return kv_rank, rope_dims


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


__all__ = [
    "AUTO",
    "REPAIR_CHECK_WINDOWS",
    "REPAIR_PRECISIONS",
    "REPAIR_WINDOWS",
    "CompressSettings",
    "check_settings",
    "default_ranks",
    "dim_on_rotary",
    "latent_config",
    "latent_options",
    "preflight",
]
