"""The decoder family registry: which 🤗 decoder families headkit's surgery handles, through which adapter, and
which operations each supports.

One :class:`DecoderFamily` per ``config.model_type``. A family whose attention is laid out like LLaMA's
(``layers[i].self_attn`` with ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, rotary embeddings, grouped-query
attention) needs only an entry here: the ``llama`` adapter handles every family that names it. A family whose
layout departs from it names its own adapter (one small file in ``headkit/surgery/adapters``).

Operations
    ``prune``: physical removal of query heads (:func:`headkit.surgery.pruning.prune_heads`).
    ``uniform``: pruning the same heads in every layer gives the family's *stock* architecture, because its
        config can state num_attention_heads, num_key_value_heads and head_dim
        (:func:`headkit.surgery.pruning.to_stock_architecture`).
    ``linearize``: the family's attention modules call transformers' attention interface, which linearization
        replaces.
    ``compress``: the collaborative re-parametrisation, only for families without rotary embeddings.
    ``latent``: keys and values compressed into a shared latent with partial RoPE (MHA2MLA,
        :mod:`headkit.surgery.latent`; what ``headkit compress`` runs on a rotary decoder): the LLaMA layout with
        full rotary and no per-head key norm.

``head_norm`` says whether the family normalises queries and keys inside attention: ``"per_head"`` (over each
head's width; pruning heads leaves the kept heads exactly as they were) or ``"across_heads"`` (over all heads
together: pruning slices the norm's weight to the kept heads, but their normalisation statistic changes, so the
pruned model is no longer exactly the full model with those heads zeroed; recovery absorbs the change).

This module holds data only; it imports nothing from the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from headkit.errors import HeadkitError

PRUNE, UNIFORM, LINEARIZE, COMPRESS, LATENT = "prune", "uniform", "linearize", "compress", "latent"
OPERATIONS = (PRUNE, UNIFORM, LINEARIZE, COMPRESS, LATENT)
HEAD_NORMS = (None, "per_head", "across_heads")

_ROTARY_DECODER = frozenset({PRUNE, UNIFORM, LINEARIZE})
_LATENT_DECODER = _ROTARY_DECODER | {LATENT}


@dataclass(frozen=True)
class DecoderFamily:
    """One decoder family: its ``config.model_type``, the name of its 🤗 config class (a top-level
    ``transformers`` name), the adapter that handles it, how it normalises queries and keys, the operations it
    supports and a note on what sets it apart."""

    model_type: str
    config_class_name: str
    adapter: str = "llama"
    head_norm: str | None = None
    operations: frozenset[str] = field(default=_ROTARY_DECODER)
    note: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.operations) - set(OPERATIONS)
        if unknown:
            raise HeadkitError(f"family {self.model_type!r}: unknown operations {sorted(unknown)}")
        if self.head_norm not in HEAD_NORMS:
            raise HeadkitError(f"family {self.model_type!r}: head_norm must be one of {HEAD_NORMS}")

    @property
    def exact_pruning(self) -> bool:
        """Whether a pruned model computes exactly what the full model computes with the pruned heads zeroed."""
        return self.head_norm != "across_heads"

    def supports(self, operation: str) -> bool:
        return operation in self.operations


FAMILIES: dict[str, DecoderFamily] = {}


def register_family(family: DecoderFamily) -> DecoderFamily:
    """Add `family` to :data:`FAMILIES` (a model_type registers once)."""
    existing = FAMILIES.get(family.model_type)
    if existing is not None and existing != family:
        raise HeadkitError(f"decoder family {family.model_type!r} is already registered")
    FAMILIES[family.model_type] = family
    return family


for _family in (
    DecoderFamily("llama", "LlamaConfig", operations=_LATENT_DECODER, note="grouped-query attention, rotary"),
    DecoderFamily("mistral", "MistralConfig", operations=_LATENT_DECODER, note="sliding-window attention"),
    DecoderFamily("qwen2", "Qwen2Config", operations=_LATENT_DECODER, note="query/key/value biases"),
    DecoderFamily("qwen3", "Qwen3Config", head_norm="per_head", note="per-head q/k RMSNorm"),
    DecoderFamily(
        "granite", "GraniteConfig", operations=_LATENT_DECODER, note="score scale attention_multiplier"
    ),
    DecoderFamily("smollm3", "SmolLM3Config", note="NoPE layers (no rotary in every fourth layer)"),
    DecoderFamily(
        "starcoder2", "Starcoder2Config", operations=_LATENT_DECODER, note="biases, residual dropout"
    ),
    DecoderFamily("gemma2", "Gemma2Config", note="logit soft-capping, sliding layers, query_pre_attn_scalar"),
    DecoderFamily(
        "gemma3_text", "Gemma3TextConfig", head_norm="per_head", note="per-head q/k RMSNorm, sliding/global"
    ),
    DecoderFamily(
        "olmo2",
        "Olmo2Config",
        adapter="olmo2",
        head_norm="across_heads",
        note="q/k RMSNorm across all heads: sliced, kept heads renormalised",
    ),
    DecoderFamily("phi3", "Phi3Config", adapter="phi3", note="fused qkv_proj"),
    DecoderFamily(
        "gpt_neox",
        "GPTNeoXConfig",
        adapter="gpt_neox",
        operations=frozenset({PRUNE, LINEARIZE}),
        note="fused per-head interleaved query_key_value, partial rotary; head width is hidden/heads, so "
        "fewer heads are not a stock config",
    ),
    DecoderFamily(
        "gpt2",
        "GPT2Config",
        adapter="gpt2",
        operations=frozenset({PRUNE, LINEARIZE, COMPRESS}),
        note="fused Conv1D c_attn, learned positions; head width is hidden/heads",
    ),
    DecoderFamily(
        "headkit",
        "HeadkitConfig",
        adapter="headkit",
        operations=frozenset({PRUNE}),
        note="headkit's own models",
    ),
):
    register_family(_family)


def supported_families(operation: str | None = None) -> list[str]:
    """model_types of the registered families (those supporting `operation`, when given), sorted."""
    return sorted(name for name, f in FAMILIES.items() if operation is None or operation in f.operations)


def model_type_of(model: Any) -> str | None:
    config = getattr(model, "config", model)
    return getattr(config, "model_type", None)


def text_config(config: Any) -> Any:
    """The decoder's part of a 🤗 config: ``get_text_config()`` where the config has it (a multimodal model's
    holds the text model's), else the config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def get_family(model: Any, operation: str | None = None) -> DecoderFamily:
    """The registered family of `model` (a model or its config), checked to support `operation` when given.

    Raises :class:`~headkit.errors.HeadkitError` with one line naming the family, the supported families and
    what is missing."""
    if operation is not None and operation not in OPERATIONS:
        raise HeadkitError(f"unknown operation {operation!r}; operations: {', '.join(OPERATIONS)}")
    model_type = model_type_of(model)
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    described = f"{type(model).__name__} (model_type={model_type!r})"
    if family is None:
        supported = supported_families(operation)
        raise HeadkitError(
            f"unsupported decoder family {described}"
            + (f" for {operation}" if operation else "")
            + f"; supported families: {', '.join(supported)}; missing: a DecoderFamily entry for "
            f"{model_type!r} in headkit/surgery/families.py (and an adapter file if its attention is not laid "
            "out like LLaMA's)"
        )
    if operation is not None and operation not in family.operations:
        supported = supported_families(operation)
        raise HeadkitError(
            f"the {family.model_type} decoder family {described} does not support {operation} "
            f"(it supports {', '.join(sorted(family.operations))}); families that support {operation}: "
            f"{', '.join(supported)}; missing: {_missing(family, operation)}"
        )
    return family


def _missing(family: DecoderFamily, operation: str) -> str:
    if operation == UNIFORM:
        return "a config that states num_attention_heads, num_key_value_heads and head_dim"
    if operation == COMPRESS:
        return "attention without rotary embeddings (queries and keys linear in the hidden states)"
    if operation == LATENT:
        if family.head_norm == "per_head":
            return (
                "keys without a per-head norm after the projection: k_norm of [k_rope ; K c] is not linear in the "
                "latent, so the key up-projection cannot be absorbed into the query"
            )
        return "the LLaMA attention layout with full rotary on every layer (separate q/k/v projections)"
    if operation == LINEARIZE:
        return "attention modules that call transformers' attention interface"
    return f"an adapter for {family.model_type}'s attention layout"
