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
attention: it may follow pruning or head gates, and a surgery that replaces the attention (collaborative, latent)
can neither precede it (``apply_`` refuses any step after those) nor follow it (they refuse a module that runs a
mechanism already).

**After a compressed cache** (``[CompressedCacheConfig(...), QuantizedKVConfig(bits=4)]``, or after a
:class:`~headkit.surgery.LinearizeConfig`): fewer tokens *and* fewer bits. The converted layers keep their
mechanism and store its exact keys and values — sinks, the window ring, the question-chosen keys, the retrieval
heads' full cache — as codes with per-token scales
(:class:`~headkit.layers.quantized_cache.QuantizedHybridStateCacheLayer`: each token quantized once, when it is
stored, and dequantized into the op's state when it is attended; ``residual`` does not apply). With
``full_precision_window=True`` the window ring stays in full precision — KIVI's residual, for a cache whose newest
tokens are its window: a prompt no longer than the window is attended as the unquantized cache attends it, and a
token is quantized when it leaves the window for a sink or a kept slot. Layers the compressed cache left alone keep
their cache as it is (a sliding layer's window, which KIVI's cache, keeping every token, would outgrow). Anything after it is refused, and so is a second quantization.
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
from headkit.surgery.compressed_cache import CompressedCacheConfig
from headkit.surgery.families import LINEARIZE, get_family, text_config
from headkit.surgery.gating import config_head_dim, kv_head_counts
from headkit.surgery.linearize import LinearizeConfig, LinearizedHeads, state_bytes_per_token
from headkit.surgery.pruning import EmptyHeads
from headkit.surgery.records import (
    conversion_of,
    fields_of_record,
    record_surgery,
    recorded_configs,
    register_conversion,
)

SURGERY_OP = "quantized_kv"
# What quantized storage may follow, though they replace the attention: their mechanism stores exact keys and values.
STORES_EXACT = (LinearizeConfig, CompressedCacheConfig)


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
            `residual` + `group_size` − 1 once that many are cached). KIVI keeps 128. Not after a compressed
            cache, whose layers quantize each token alone when they store it (module docstring).
        full_precision_window: after a compressed cache (or a linearization), keep its window ring — the newest
            W − 1 tokens of each head — in full precision, the rest of what it keeps quantized; refused on a stock
            cache, whose full-precision tokens are `residual`.
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
        metadata={
            "help": "The newest tokens kept in full precision (KIVI's residual); a compressed cache's keys and "
            "values keep none.",
            "min": 0,
        },
    )
    full_precision_window: bool = field(
        default=False,
        metadata={
            "help": "After a compressed cache: keep its window (the newest tokens) in full precision, the rest "
            "quantized."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise HeadkitError(f"bits must be one of {{4, 8}}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise HeadkitError(f"group_size must be a positive integer, got {self.group_size!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise HeadkitError(f"residual must be a non-negative integer, got {self.residual!r}")
        if not isinstance(self.full_precision_window, bool):
            raise HeadkitError(
                f"full_precision_window must be True or False, got {self.full_precision_window!r}"
            )

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
        earlier_configs = recorded_configs(model_or_config)
        if any(isinstance(earlier, QuantizedKVConfig) for earlier in earlier_configs):
            raise HeadkitError("the model's key/value cache is already quantized")
        for index, earlier in enumerate(earlier_configs):
            last = index == len(earlier_configs) - 1
            if conversion_of(earlier).replaces_attention and not (last and isinstance(earlier, STORES_EXACT)):
                raise HeadkitError(
                    f"the model's attention was replaced by {type(earlier).__name__} (earlier surgery): it keeps no "
                    "stock key/value cache to quantize"
                )
        if self.full_precision_window and not (
            earlier_configs and isinstance(earlier_configs[-1], STORES_EXACT)
        ):
            raise HeadkitError(
                "full_precision_window keeps a compressed cache's window in full precision: it needs a "
                "CompressedCacheConfig (or LinearizeConfig) just before it; a stock cache's full-precision tokens "
                "are `residual`"
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
        (:meth:`check`), then each module — one layer with a ``layer_idx``, no headkit mechanism but a compressed
        cache's or a linearized layer's (a layer pruned empty keeps no cache and is left out)."""
        self.check(model.config)
        adapter = get_adapter(model, adapter)
        sites = _sites_with_a_cache(model, adapter)
        if not sites:
            raise HeadkitError(
                f"the {adapter.name} adapter found no attention module with a cache to quantize"
            )
        for site in sites:
            mechanism = mechanism_of(site.module)
            if isinstance(mechanism, QuantizedKVHeads) or (
                isinstance(mechanism, LinearizedHeads) and mechanism.quantized_storage is not None
            ):
                raise HeadkitError(f"the model's key/value cache is already quantized ({site.name})")
            if mechanism is not None and not isinstance(mechanism, LinearizedHeads):
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
        (the surgery it records applied). Per layer and key/value head of a stock cache, the codes of the tokens
        quantized by then with their scales and zero points (`bytes_per_number` each) amortised over their group
        (:func:`headkit.ops.quantized_cache.quantized_bytes_per_token`), and the full-precision residual — the
        tokens :func:`~headkit.ops.quantized_cache.tokens_to_quantize` leaves — spread over the `context` tokens.
        After a compressed cache, its layers' kept tokens
        (:meth:`~headkit.surgery.compressed_cache.CompressedCacheConfig.layer_tokens`) at the per-token cost
        (keys grouped as values), the layers it left alone at their own, unquantized. None where the config does
        not state its heads. After a linearization, its converted layers' state with their exact keys and values
        (window, sinks, kept keys, retrieval heads) at the per-token cost, the rest of the state as it is. A window
        kept in full precision (`full_precision_window`): its W − 1 tokens per head (not a retrieval head's) at
        `bytes_per_number` a number."""
        counts, head_dim = kv_head_counts(config), config_head_dim(text_config(config))
        if counts is None or head_dim is None:
            return None
        earlier = recorded_configs(config)
        layers, left_alone = [(kv_heads, None) for kv_heads in counts], 0.0
        options = {"bits": self.bits, "group_size": self.group_size, "bytes_per_number": bytes_per_number}
        if earlier and isinstance(earlier[-1], LinearizeConfig):
            # its exact keys and values quantized a token at a time (keys grouped as values), the rest as it is
            return state_bytes_per_token(
                earlier[-1],
                config,
                bytes_per_number=bytes_per_number,
                context=context,
                token_bytes=quantized_bytes_per_token(head_dim, per_token_keys=True, **options),
                full_precision_window=self.full_precision_window,
            )
        per_token = quantized_bytes_per_token(head_dim, per_token_keys=True, **options)
        if earlier and isinstance(earlier[-1], CompressedCacheConfig):
            compressed = earlier[-1]
            kept = compressed.layer_tokens(config, context)
            if kept is None:
                return None
            layers = [(layer.kv_heads, layer.tokens) for layer in kept if layer.compressed]
            # a layer the compressed cache left alone keeps its own cache, unquantized; so does a kept window
            full = sum(layer.tokens for layer in kept if not layer.compressed)
            if self.full_precision_window:
                window = min(compressed.window - 1, context)
                windows = sum(
                    (layer.kv_heads - layer.retrieval_heads) * window for layer in kept if layer.compressed
                )
                full += windows
                left_alone -= windows * per_token / context
            left_alone += full * 2 * head_dim * bytes_per_number / context
        quantized = tokens_to_quantize(context, group_size=self.group_size, residual=self.residual)
        stock_head = (
            quantized * quantized_bytes_per_token(head_dim, **options)
            + (context - quantized) * 2 * head_dim * bytes_per_number
        )
        total = sum(
            kv_heads * stock_head if tokens is None else tokens * per_token for kv_heads, tokens in layers
        )
        return total / context + left_alone


@dataclass
class QuantizedKVReport:
    """What :func:`headkit.apply_` of a :class:`QuantizedKVConfig` did: the layers whose cache is quantized, and
    the cache's bytes per token in bfloat16 before and after, at 8,192 tokens (None where the config does not
    state them)."""

    architecture: str
    bits: int
    group_size: int
    residual: int
    layers: list[int]
    bytes_per_token_before: float | None
    bytes_per_token_after: float | None
    # of those, the ones storing a compressed cache
    compressed_layers: list[int] = field(default_factory=list)
    full_precision_window: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        sizes = ""
        if self.bytes_per_token_before and self.bytes_per_token_after:
            ratio = self.bytes_per_token_after / self.bytes_per_token_before
            sizes = (
                f": {self.bytes_per_token_before:g} → {self.bytes_per_token_after:g} bytes per token in bfloat16 "
                f"({ratio:.1%}, scales and zero points included)"
            )
        how = f"groups of {self.group_size}, {self.residual} newest tokens in full precision"
        if self.compressed_layers:
            how = (
                f"groups of {self.group_size} channels per token; {len(self.compressed_layers)} of them a compressed "
                "cache, each token quantized when stored"
                + (", its window in full precision" if self.full_precision_window else "")
            )
        return (
            f"{self.architecture}: key/value cache of {len(self.layers)} layers quantized to {self.bits} bits "
            f"({how}){sizes}"
        )


def _sites_with_a_cache(model: nn.Module, adapter: AttentionAdapter) -> list[AttentionSite]:
    """The sites whose cache a quantization stores: after a compressed cache (or a linearization), the layers it
    converted — a layer it left alone keeps its cache as it is (a sliding layer its window, which KIVI's cache,
    keeping every token, would outgrow); else every site but those pruned empty."""
    sites = [site for site in adapter.sites(model) if not isinstance(mechanism_of(site.module), EmptyHeads)]
    converted = [site for site in sites if isinstance(mechanism_of(site.module), LinearizedHeads)]
    return converted or sites


def _attach(model: nn.Module, config: QuantizedKVConfig, sites: list[AttentionSite]) -> None:
    """Stock sites get KIVI's mechanism; a compressed cache's (or linearized) layers store their exact keys and
    values quantized."""
    options = {"bits": config.bits, "group_size": config.group_size, "residual": config.residual}
    storage = {
        "bits": config.bits,
        "group_size": config.group_size,
        "full_precision_window": config.full_precision_window,
    }
    stock = [site for site in sites if mechanism_of(site.module) is None]
    for site in sites:
        mechanism = mechanism_of(site.module)
        if isinstance(mechanism, LinearizedHeads):
            mechanism.quantized_storage = dict(storage)
    attach_mechanisms(
        model, [(site.module, QuantizedKVHeads(layer_idx=site.module.layer_idx, **options)) for site in stock]
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
    stock = [site for site in sites if mechanism_of(site.module) is None]
    if stock:
        refuse_modules_off_the_interface(
            model,
            [(s.name, s.module) for s in stock],
            f"{adapter.name}'s key/value cache cannot be quantized",
        )
    counts, head_dim = kv_head_counts(model.config), config_head_dim(text_config(model.config))
    earlier = recorded_configs(model.config)
    if earlier and conversion_of(earlier[-1]).replaces_attention:  # a compressed cache (or linearized layers)
        per_token = getattr(earlier[-1], "bytes_per_token", None)
        before = None if per_token is None else per_token(model.config)
    else:  # only pruning and gates may come before: the cache is still the stock keys and values
        before = None if counts is None or head_dim is None else 2 * sum(counts) * head_dim * 2
    after = config.bytes_per_token(model.config)  # the records before this one say what it stores
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
        bytes_per_token_after=after,
        compressed_layers=[s.module.layer_idx for s in sites if s not in stock],
        full_precision_window=config.full_precision_window,
    )


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded quantization on a freshly built model (it has no weights of its own)."""
    config = QuantizedKVConfig.from_record(entry)
    adapter = get_adapter(model, entry["adapter"])
    sites = _sites_with_a_cache(model, adapter)
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


register_conversion(
    QuantizedKVConfig, SURGERY_OP, _quantize, _reapply, replaces_attention=True, follows=STORES_EXACT
)

__all__ = [
    "QuantizedKVConfig",
    "QuantizedKVHeads",
    "QuantizedKVReport",
    "quantized_mechanisms",
]
