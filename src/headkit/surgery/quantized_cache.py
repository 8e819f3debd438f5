"""Keep a stock decoder's key/value cache quantized: 8 or 4 bits, keys per channel and values per token (KIVI).

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv:2402.02750):
``headkit.apply_(model, QuantizedKVConfig(bits=4))`` changes no weight. Each attention module keeps its
projections, rotary, masks and attention implementation, and gains the mechanism :class:`QuantizedKVHeads`,
whose only job is its entry in the cache: a :class:`~headkit.layers.quantized_cache.QuantizedKVCacheLayer`
(through :class:`~headkit.surgery.attention.CacheLayerHook`), which the module's own ``cache.update`` call fills
— keys quantized per channel over groups of ``group_size`` tokens, values per token over groups of ``group_size``
channels, the newest ``residual`` (to ``residual + group_size − 1``) tokens in full precision — and which hands
back the dequantized keys and values the mechanism then gives the implementation the model ran before (sdpa,
eager, flash, …; :func:`headkit.surgery.attention.base_attention`).

Without a cache (``use_cache=False``) nothing is stored and nothing quantized: the forward is the original's.
Quantization acts where a cache is read — decoding, and a prompt fed in chunks.

The config (:class:`QuantizedKVConfig`) states the bytes per token of the cache it leaves
(:meth:`QuantizedKVConfig.bytes_per_token`: codes, plus the scales and zero points amortised over their group), which
:func:`headkit.surgery.bytes_per_token` composes with earlier pruning. Quantization changes the cache, not the
attention: it may follow pruning or head gates, and a surgery that replaces the attention (collaborative, latent,
linearized heads) can neither precede it (``apply_`` refuses any step after those) nor follow it (they refuse a
module that runs a mechanism already).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.quantized_cache import QuantizedKVCacheLayer
from headkit.ops.quantized_cache import BITS, quantized_bytes_per_token, tokens_to_quantize
from headkit.surgery.adapters import AttentionAdapter, AttentionSite, get_adapter
from headkit.surgery.attention import (
    AttentionCall,
    attach_mechanisms,
    base_attention,
    mechanism_of,
    refuse_modules_off_the_interface,
)
from headkit.surgery.families import LINEARIZE, get_family, text_config
from headkit.surgery.gating import config_head_dim, kv_head_counts
from headkit.surgery.pruning import EmptyHeads
from headkit.surgery.records import (
    conversion_of,
    fields_of_record,
    record_surgery,
    recorded_configs,
    register_conversion,
)

SURGERY_OP = "quantized_kv"


class QuantizedKVHeads(nn.Module):
    """The mechanism of an attention module whose cache is quantized (``<attention module>.headkit_attention``):
    puts a :class:`QuantizedKVCacheLayer` with its settings in the module's cache entry (:meth:`cache_layer`) and
    runs the model's own attention implementation on the keys and values the cache returned (dequantized). No
    parameters."""

    def __init__(self, *, bits: int, group_size: int, residual: int, layer_idx: int) -> None:
        super().__init__()
        self.bits, self.group_size, self.residual, self.layer_idx = bits, group_size, residual, layer_idx

    def cache_layer(self, cache: Any) -> QuantizedKVCacheLayer:
        """This layer's entry in the model's cache (see :class:`headkit.surgery.attention.CacheLayerHook`)."""
        layer = QuantizedKVCacheLayer.in_cache(cache, self.layer_idx)
        return layer.configure(bits=self.bits, group_size=self.group_size, residual=self.residual)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.module is None:
            raise HeadkitError(
                "a quantized key/value layer runs the module's attention: the call names no module"
            )
        attention = base_attention(call.base)
        return attention(
            call.module,
            call.queries,
            call.keys,
            call.values,
            call.attention_mask,
            scaling=call.scaling,
            dropout=call.dropout,
            **call.options,
        )

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, bits={self.bits}, group_size={self.group_size}, residual={self.residual}"


@dataclass(frozen=True)
class QuantizedKVConfig:
    """How :func:`headkit.apply_` quantizes a decoder's key/value cache (KIVI; module docstring).

    Built, it checks its types and ranges; :meth:`check` checks it against a model, or only its 🤗 config (the
    family calls transformers' attention interface, ``group_size`` divides head_dim, no earlier surgery replaced
    the attention or quantized the cache already).

    Attributes:
        bits: bits per key or value code, 8 or 4 (two 4-bit codes per byte).
        group_size: tokens per key group (keys are quantized per channel over that many tokens) and channels per
            value group (values per token over that many channels); divides head_dim. KIVI uses 32.
        residual: the newest tokens always kept in full precision (the residual holds between `residual` and
            `residual` + `group_size` − 1 once that many are cached). KIVI keeps 128.
    """

    bits: int = field(metadata={"help": "Bits per cached key or value number: 8 or 4 (two per byte)."})
    group_size: int = field(
        default=32,
        metadata={
            "help": "Tokens per key group (keys quantized per channel) and channels per value group (values per "
            "token); divides head_dim.",
            "min": 1,
        },
    )
    residual: int = field(
        default=128,
        metadata={"help": "The newest tokens kept in full precision (KIVI's residual).", "min": 0},
    )

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise HeadkitError(f"bits must be one of {{4, 8}}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise HeadkitError(f"group_size must be a positive integer, got {self.group_size!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise HeadkitError(f"residual must be a non-negative integer, got {self.residual!r}")

    def check(
        self,
        model_or_config: Any,
        adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ) -> None:
        """Everything that can refuse this quantization, before any work: on a 🤗 config, the family, the surgery
        it records and head_dim; on a model also its attention modules (:meth:`sites_to_quantize`)."""
        if isinstance(model_or_config, nn.Module):
            self.sites_to_quantize(model_or_config, adapter)
            return
        family = get_family(model_or_config)
        if not family.supports(LINEARIZE):
            raise HeadkitError(
                f"the {family.model_type} family's attention modules do not call transformers' attention "
                "interface, through which a quantized key/value cache is read"
            )
        for earlier in recorded_configs(model_or_config):
            if isinstance(earlier, QuantizedKVConfig):
                raise HeadkitError("the model's key/value cache is already quantized")
            if conversion_of(earlier).replaces_attention:
                raise HeadkitError(
                    f"the model's attention was replaced by {type(earlier).__name__} (earlier surgery): it keeps no "
                    "stock key/value cache to quantize"
                )
        head_dim = config_head_dim(text_config(model_or_config))
        if head_dim is not None:
            self._check_head_dim(head_dim)

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.group_size:
            raise HeadkitError(
                f"group_size must divide head_dim {head_dim} (values are quantized in groups of group_size "
                f"channels), got {self.group_size}"
            )
        if self.bits == 4 and head_dim % 2:
            raise HeadkitError(
                f"bits 4 packs two codes per byte, which needs an even head_dim, got {head_dim}"
            )

    def sites_to_quantize(
        self, model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
    ) -> tuple[AttentionAdapter, list[AttentionSite]]:
        """The adapter and the attention sites whose cache to quantize, checked: the model's 🤗 config
        (:meth:`check`), then each module — one layer with a ``layer_idx``, no headkit mechanism (a layer pruned
        empty keeps no cache and is left out)."""
        self.check(model.config)
        adapter = get_adapter(model, adapter)
        sites = [
            site for site in adapter.sites(model) if not isinstance(mechanism_of(site.module), EmptyHeads)
        ]
        if not sites:
            raise HeadkitError(
                f"the {adapter.name} adapter found no attention module with a cache to quantize"
            )
        for site in sites:
            mechanism = mechanism_of(site.module)
            if isinstance(mechanism, QuantizedKVHeads):
                raise HeadkitError(f"the model's key/value cache is already quantized ({site.name})")
            if mechanism is not None:
                raise HeadkitError(
                    f"{site.name} already runs {type(mechanism).__name__} (earlier surgery): it keeps no stock "
                    "key/value cache to quantize"
                )
            if len(site.layers) != 1 or not isinstance(getattr(site.module, "layer_idx", None), int):
                raise HeadkitError(f"{site.name} is not one decoder layer's attention with a layer_idx")
            self._check_head_dim(site.head_dim)
        return adapter, sites

    def record(self) -> dict[str, Any]:
        """The fields as JSON (``config.headkit_surgery`` keeps them, with the layers quantized)."""
        return asdict(self)

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> QuantizedKVConfig:
        """The config a record was written from (a field the record predates takes its default)."""
        return cls(**fields_of_record(cls, entry))

    def bytes_per_token(self, config: Any, *, bytes_per_number: int = 2, context: int = 8192) -> float | None:
        """The quantized cache's bytes per token of a `context`-token sequence for a model with the 🤗 `config`
        (the pruning it records applied): per layer and key/value head, the codes of the tokens quantized by then
        with their scales and zero points (`bytes_per_number` each) amortised over their group
        (:func:`headkit.ops.quantized_cache.quantized_bytes_per_token`), and the full-precision residual — the
        tokens :func:`~headkit.ops.quantized_cache.tokens_to_quantize` leaves — spread over the `context` tokens.
        None where the config does not state its heads."""
        counts, head_dim = kv_head_counts(config), config_head_dim(text_config(config))
        if counts is None or head_dim is None:
            return None
        quantized = tokens_to_quantize(context, group_size=self.group_size, residual=self.residual)
        per_head = (
            quantized
            * quantized_bytes_per_token(
                head_dim, bits=self.bits, group_size=self.group_size, bytes_per_number=bytes_per_number
            )
            + (context - quantized) * 2 * head_dim * bytes_per_number
        )
        return sum(counts) * per_head / context


@dataclass
class QuantizedKVReport:
    """What :func:`headkit.apply_` of a :class:`QuantizedKVConfig` did: the layers whose cache is quantized, and
    the cache's bytes per token in bfloat16 before and after (None where the config does not state its heads)."""

    architecture: str
    bits: int
    group_size: int
    residual: int
    layers: list[int]
    bytes_per_token_before: int | None
    bytes_per_token_after: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        sizes = ""
        if self.bytes_per_token_before and self.bytes_per_token_after:
            ratio = self.bytes_per_token_after / self.bytes_per_token_before
            sizes = (
                f": {self.bytes_per_token_before} → {self.bytes_per_token_after} bytes per token in bfloat16 "
                f"({ratio:.1%}, scales and zero points included)"
            )
        return (
            f"{self.architecture}: key/value cache of {len(self.layers)} layers quantized to {self.bits} bits "
            f"(groups of {self.group_size}, {self.residual} newest tokens in full precision){sizes}"
        )


def _attach(model: nn.Module, config: QuantizedKVConfig, sites: list[AttentionSite]) -> None:
    options = {"bits": config.bits, "group_size": config.group_size, "residual": config.residual}
    attach_mechanisms(
        model, [(site.module, QuantizedKVHeads(layer_idx=site.module.layer_idx, **options)) for site in sites]
    )


def _quantize(
    model: nn.Module,
    config: QuantizedKVConfig,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> QuantizedKVReport:
    """:func:`headkit.apply_` of a :class:`QuantizedKVConfig`: every attention module's cache entry becomes a
    quantized one (module docstring)."""
    adapter, sites = config.sites_to_quantize(model, adapter)
    refuse_modules_off_the_interface(
        model, [(s.name, s.module) for s in sites], f"{adapter.name}'s key/value cache cannot be quantized"
    )
    counts, head_dim = kv_head_counts(model.config), config_head_dim(text_config(model.config))
    # Only pruning and gates may come before: the cache is still the stock keys and values.
    before = None if counts is None or head_dim is None else 2 * sum(counts) * head_dim * 2
    # Everything is checked: only now does the model change.
    _attach(model, config, sites)
    layers = [site.module.layer_idx for site in sites]
    record_surgery(
        model,
        {"op": SURGERY_OP, "adapter": adapter.name} | config.record() | {"sites": [s.name for s in sites]},
    )
    return QuantizedKVReport(
        architecture=adapter.name,
        bits=config.bits,
        group_size=config.group_size,
        residual=config.residual,
        layers=layers,
        bytes_per_token_before=before,
        bytes_per_token_after=config.bytes_per_token(model.config),
    )


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded quantization on a freshly built model (it has no weights of its own)."""
    config = QuantizedKVConfig.from_record(entry)
    adapter = get_adapter(model, entry["adapter"])
    sites = [site for site in adapter.sites(model) if not isinstance(mechanism_of(site.module), EmptyHeads)]
    if [site.name for site in sites] != list(entry["sites"]):
        raise HeadkitError(
            f"the recorded key/value quantization covered {entry['sites']}, but the rebuilt model has attention "
            f"modules {[site.name for site in sites]}"
        )
    _attach(model, config, sites)


def quantized_mechanisms(model: nn.Module) -> list[QuantizedKVHeads]:
    """The model's :class:`QuantizedKVHeads`, in layer order."""
    found = {id(m): m for m in model.modules() if isinstance(m, QuantizedKVHeads)}
    return sorted(found.values(), key=lambda mechanism: mechanism.layer_idx)


register_conversion(QuantizedKVConfig, SURGERY_OP, _quantize, _reapply, replaces_attention=True)

__all__ = [
    "QuantizedKVConfig",
    "QuantizedKVHeads",
    "QuantizedKVReport",
    "quantized_mechanisms",
]
