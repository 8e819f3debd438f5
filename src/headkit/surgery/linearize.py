"""Linearize a pretrained causal LM: softmax attention → sliding-window softmax + linear attention (LoLCATs).

Each chosen self-attention module of a LLaMA-family (RoPE, grouped-query attention; e.g. SmolLM2) or GPT-2 model
becomes a :class:`LinearizedAttention`: exact softmax over the last ``window`` keys plus linear attention, through
learnable feature maps (Hedgehog by default), over every earlier key, under one shared normaliser
(:func:`headkit.ops.hybrid_attention`; Zhang et al. 2024, "LoLCATs", arXiv:2410.10254). It reuses the pretrained
query/key/value/output projections and biases (GPT-2's fused ``c_attn`` is split into ``q_proj`` / ``k_proj`` /
``v_proj`` of its own ``Conv1D`` kind), the module's own score scale, and the position encoding the model hands
its attention: LLaMA's decoder layers pass the ``(cos, sin)`` of the model's rotary embedding, applied through the
adapter (:meth:`~headkit.surgery.adapters.AttentionAdapter.apply_rotary`) exactly as the original module applies
it. The learnable parts are the feature maps (``feature_map_q`` per query head, ``feature_map_k`` per key/value
head) and the per-head balance γ_h = exp(``log_balance``).

Exact at conversion where it can be: the window term of query i is exp(s_ij − m_i) over its last ``window`` keys,
so a query whose whole past fits in the window gets the original softmax attention (up to the op's eps = 1e-6 in
a denominator ≥ 1). With ``window ≥ T`` the converted model equals the original on T tokens; beyond the window
the linear term starts from the untrained feature maps, which is what the recovery recipe
(:mod:`headkit.recipes.linearize`) trains.

**Decoding cache.** A 🤗 decoder hands every attention module the same cache (``cache``, ``past_key_values`` before 5.24) (a ``DynamicCache``
that ``generate()`` or the model creates), one entry per layer in ``cache.layers``. A converted module replaces
its own entry, on first use, by a :class:`HybridStateCacheLayer` — headkit's constant-size
:class:`~headkit.layers.cache.RecurrentStateLayer` holding a :class:`headkit.ops.HybridAttentionState` (the last
W − 1 rotated keys, values and key features, plus the linear sums of every older key), declared a transformers
``CacheLayerMixin`` so that ``get_seq_length`` / ``get_mask_sizes`` count its tokens like a key/value layer.
Softmax layers keep their ``DynamicLayer``. So one stock cache holds both kinds side by side, a partly converted
(hybrid) model needs nothing special, ``generate()`` works unchanged, beam search reorders the states, and the
cache of a fully converted model does not grow with the context. (A state cannot be rewound: assisted
generation's ``crop`` is refused.)

The padding mask reaches the module as the model's 4D attention mask (or None); its last query row is the key
padding mask over every token seen, which is all the hybrid op needs (it counts its window in token positions,
so left padding leaves real tokens' windows unchanged).

:func:`linearize` validates everything and builds every new module before it replaces any, so a bad argument
leaves the model untouched; the conversion is recorded in ``config.headkit_surgery`` so that ``save_pretrained``
+ :func:`headkit.from_pretrained` rebuilds it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin

from headkit.errors import HeadkitError
from headkit.layers.cache import RecurrentStateLayer, map_state
from headkit.layers.feature_maps import build_feature_map, valid_feature_map_names
from headkit.ops.hybrid import hybrid_attention, hybrid_attention_step
from headkit.surgery.adapters import (
    AttentionAdapter,
    AttentionSite,
    ReplacementAttention,
    bind_attention_call,
    count_parameters,
    get_adapter,
    new_linear,
)
from headkit.surgery.io import record_surgery, register_surgery_op

SURGERY_OP = "linearize"
LINEARIZABLE_ARCHITECTURES = ("llama", "gpt2")


class HybridStateCacheLayer(RecurrentStateLayer, CacheLayerMixin):
    """The entry of a converted layer in a 🤗 ``Cache``: one fixed-size :class:`headkit.ops.HybridAttentionState`.

    A :class:`~headkit.layers.cache.RecurrentStateLayer` (state, token count, beam-search reordering) that is also
    a transformers ``CacheLayerMixin``, so the container counts its tokens (``get_seq_length``, mask sizes) even when
    no layer of the model keeps keys and values."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate ahead: the state is created by the layer's first forward."""


def hybrid_cache_layer(cache: Any, layer_idx: int) -> HybridStateCacheLayer:
    """The :class:`HybridStateCacheLayer` of ``layer_idx`` in ``cache``, put in place of the empty key/value entry
    the cache made for it (or appended, for a cache that creates its layers lazily)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise HeadkitError(
            f"a linearized attention layer needs a transformers Cache with per-layer entries, got {type(cache).__name__}"
        )
    if layer_idx < len(layers) and isinstance(layers[layer_idx], HybridStateCacheLayer):
        return layers[layer_idx]
    if layer_idx >= len(layers):
        make = getattr(cache, "layer_class_to_replicate", None)
        if make is None:
            raise HeadkitError(
                f"the cache holds {len(layers)} layers and cannot grow to layer {layer_idx}; use a DynamicCache"
            )
        while len(layers) <= layer_idx:
            layers.append(make())
    existing = layers[layer_idx]
    if existing.get_seq_length() > 0:
        raise HeadkitError(
            f"cache layer {layer_idx} already holds keys and values of {existing.get_seq_length()} tokens; a "
            "linearized layer keeps a fixed-size state instead (start from an empty cache)"
        )
    layers[layer_idx] = HybridStateCacheLayer()
    return layers[layer_idx]


def decoding_state_bytes(cache: Any) -> int:
    """Bytes of every tensor a 🤗 cache holds: keys and values of key/value layers, the states of converted
    layers (the memory decoding needs besides the weights)."""
    tensors: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        tensors.append(tensor)
        return tensor

    for layer in getattr(cache, "layers", []):
        if isinstance(layer, RecurrentStateLayer):
            map_state(layer.state, collect)
        else:
            tensors += [
                t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None
            ]
    return sum(t.numel() * t.element_size() for t in tensors)


def key_padding_mask(attention_mask: Any, batch: int, kv_len: int) -> torch.Tensor | None:
    """The [B, kv_len] bool key padding mask (True = real token) behind any mask a 🤗 decoder hands its attention:
    None, a [B, kv_len] padding mask, or a 4D causal mask [B, 1|H, Tq, kv_len] (bool, True = keep; or additive
    float) whose last query row — the query that sees every earlier key — is exactly the key padding."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise HeadkitError(
            f"attention_mask of type {type(attention_mask).__name__} is not supported by linearized attention; "
            "use attn_implementation='sdpa' or 'eager'"
        )
    if attention_mask.dim() == 4:
        attention_mask = attention_mask[:, 0, -1, :]
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if (
        attention_mask.dim() != 2
        or attention_mask.shape[0] not in (1, batch)
        or attention_mask.shape[1] != kv_len
    ):
        raise HeadkitError(
            f"attention_mask must cover [batch, past + new tokens] = [{batch}, {kv_len}] keys, got "
            f"{tuple(attention_mask.shape)}"
        )
    return attention_mask.bool().expand(batch, kv_len)


class LinearizedAttention(ReplacementAttention):
    """A pretrained softmax self-attention module turned into sliding-window softmax + linear attention.

    Takes the replaced module's call (its signature, its masks, the model's cache, the rotary ``(cos, sin)``) and
    returns what it returned, ``(output, None)`` (attention weights are never materialised). Children: ``q_proj``,
    ``k_proj``, ``v_proj`` (the pretrained projections, ``nn.Linear`` or GPT-2's ``Conv1D``), ``feature_map_q`` /
    ``feature_map_k`` (learnable, per query / key-value head), ``log_balance`` [heads], and what the replaced
    module ran after its heads (output projection, dropout) under its original attribute names.
    """

    def __init__(
        self,
        *,
        projections: dict[str, nn.Module],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int,
        feature_map: str,
        feature_dim: int | None,
        chunk_size: int,
        layer_idx: int,
        adapter: AttentionAdapter,
        call_signature: inspect.Signature,
        epilogue: dict[str, tuple[str, nn.Module]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        nn.Module.__init__(self)  # not super(): replace_attention mixes the 🤗 class into this one's bases
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window, self.chunk_size = window, chunk_size
        self.feature_map_name, self.feature_dim = feature_map, feature_dim
        self.layer_idx = layer_idx
        self.is_causal = True
        self.adapter = adapter
        self.call_signature = call_signature
        for name in ("q_proj", "k_proj", "v_proj"):
            self.add_module(name, projections[name])
        self.feature_map_q = build_feature_map(feature_map, num_heads, head_dim, feature_dim).to(
            dtype=dtype, device=device
        )
        self.feature_map_k = build_feature_map(feature_map, num_kv_heads, head_dim, feature_dim).to(
            dtype=dtype, device=device
        )
        # γ_h = exp(log_balance_h) = 1 at conversion: window and linear terms on an equal footing.
        self.log_balance = nn.Parameter(torch.zeros(num_heads, dtype=dtype, device=device))
        self.epilogue_roles: dict[str, str] = {}
        for role, (name, module) in epilogue.items():
            if role == "norm":
                raise HeadkitError(
                    "linearize converts decoder self-attention, which runs no residual norm itself"
                )
            self.epilogue_roles[role] = name
            self.add_module(name, module)

    @property
    def balance(self) -> torch.Tensor:
        """γ_h per query head, [num_heads]."""
        return self.log_balance.exp()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What attention transfer trains: the feature maps and the balances."""
        return [*self.feature_map_q.parameters(), *self.feature_map_k.parameters(), self.log_balance]

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        call = bind_attention_call(self.call_signature, self, hidden_states, args, kwargs)
        if call.encoder_hidden_states is not None:
            raise HeadkitError(
                "linearized attention replaces causal self-attention only; got encoder_hidden_states"
            )
        batch, seq, _ = hidden_states.shape

        def heads(module: nn.Module, count: int) -> torch.Tensor:
            return module(hidden_states).view(batch, seq, count, self.head_dim).transpose(1, 2)

        queries, keys, values = (
            heads(self.q_proj, self.num_heads),
            heads(self.k_proj, self.num_kv_heads),
            heads(self.v_proj, self.num_kv_heads),
        )
        queries, keys = self.adapter.apply_rotary(queries, keys, call)
        cache = call.cache
        cache = getattr(cache, "self_attention_cache", cache)
        layer = None if cache is None else hybrid_cache_layer(cache, self.layer_idx)
        past = 0 if layer is None else layer.get_seq_length()
        mask = key_padding_mask(call.attention_mask, batch, past + seq)
        new_mask = None if mask is None else mask[:, past:].to(hidden_states.device)
        query_features, key_features = self.feature_map_q(queries), self.feature_map_k(keys)
        # The mask is checked above and states come from the op itself: its own checks would only repeat that.
        options = {"window": self.window, "attention_mask": new_mask, "scale": self.scale, "validate": False}
        tensors = (queries, keys, values, query_features, key_features, self.balance)
        if layer is None:
            outputs, _ = hybrid_attention(*tensors, chunk_size=self.chunk_size, **options)
        else:
            if seq == 1:
                outputs, state = hybrid_attention_step(*tensors, layer.get_state(), **options)
            else:
                outputs, state = hybrid_attention(
                    *tensors,
                    chunk_size=self.chunk_size,
                    initial_state=layer.get_state(),
                    output_final_state=True,
                    **options,
                )
            layer.set_state(state, seq)
        output = outputs.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        roles = self.epilogue_roles
        if "projection" in roles:
            output = getattr(self, roles["projection"])(output)
        if "dropout" in roles:
            output = getattr(self, roles["dropout"])(output)
        return output, None

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, window={self.window}, feature_map={self.feature_map_name!r}, "
            f"chunk_size={self.chunk_size}"
        )


# -- the conversion ---------------------------------------------------------------------------------------------


@dataclass
class LinearizeReport:
    """What :func:`linearize` did."""

    architecture: str
    layers: list[int]
    window: int
    feature_map: str
    feature_dim: int | None
    chunk_size: int
    parameters_before: int
    parameters_after: int
    trainable_parameters: int  # feature maps and balances added
    softmax_layers: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        kept = f"; softmax kept in layers {self.softmax_layers}" if self.softmax_layers else ""
        return (
            f"linearized {len(self.layers)} {self.architecture} attention layers (window {self.window}, "
            f"{self.feature_map} features{kept}); parameters {self.parameters_before:,} -> "
            f"{self.parameters_after:,} (+{self.trainable_parameters:,} feature-map and balance parameters)"
        )


def max_context(model: nn.Module) -> int | None:
    """The longest context the model's config allows (``max_position_embeddings``; GPT-2's ``n_positions``)."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def linearize(
    model: nn.Module,
    *,
    window: int = 64,
    feature_map: str = "hedgehog",
    layers: Iterable[int] | None = None,
    feature_dim: int | None = None,
    chunk_size: int = 64,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> LinearizeReport:
    """Convert the softmax self-attention of a causal LM to sliding-window + linear attention, in place.

    Args:
        model: a LLaMA-family (``*ForCausalLM`` / ``*Model``, model_type "llama") or GPT-2 model.
        window: W ≥ 1, the keys each query sees exactly (its own included), at most the model's context.
        feature_map: the linear term's feature map: a learnable one ("hedgehog") or a fixed one ("elu", …).
        layers: the layer indices to convert; None converts every layer. Layers not listed keep their softmax
            attention and key/value cache (a hybrid model).
        feature_dim: the learnable map's projection width (None: head_dim; Hedgehog then has 2·head_dim features).
        chunk_size: queries per chunk of the parallel form (speed/memory only).
        adapter: the architecture's adapter; detected from the model when None.

    Returns a :class:`LinearizeReport`. Raises :class:`HeadkitError` for an unsupported architecture, a window
    out of range, an unknown feature map, layers out of range or already converted — the model is then untouched.
    """
    adapter = get_adapter(model, adapter)
    sites = _check_sites(model, adapter)
    chosen = _check_arguments(model, sites, window, feature_map, layers, feature_dim, chunk_size)
    before = count_parameters(model)
    planned = [
        (site, _plan_site(adapter, site, window, feature_map, feature_dim, chunk_size)) for site in chosen
    ]
    # Everything is built: only now does the model change.
    for site, module in planned:
        adapter.replace_attention(model, site, module)
    indices = [site.layers[0] for site in chosen]
    record_surgery(
        model,
        {
            "op": SURGERY_OP,
            "adapter": adapter.name,
            "layers": indices,
            "window": window,
            "feature_map": feature_map,
            "feature_dim": feature_dim,
            "chunk_size": chunk_size,
            "sites": [site.name for site in chosen],
        },
    )
    after = count_parameters(model)
    return LinearizeReport(
        architecture=adapter.name,
        layers=indices,
        window=window,
        feature_map=feature_map,
        feature_dim=feature_dim,
        chunk_size=chunk_size,
        parameters_before=before,
        parameters_after=after,
        trainable_parameters=sum(p.numel() for _, m in planned for p in m.trainable_parameters()),
        softmax_layers=[
            site.layers[0]
            for site in adapter.sites(model)
            if not isinstance(site.module, LinearizedAttention)
        ],
    )


def linearized_modules(model: nn.Module) -> list[LinearizedAttention]:
    """The model's converted attention modules, in layer order."""
    found = {id(m): m for m in model.modules() if isinstance(m, LinearizedAttention)}
    return sorted(found.values(), key=lambda module: module.layer_idx)


def linearized_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every feature-map and balance parameter of the model's converted layers (what attention transfer trains)."""
    return [p for module in linearized_modules(model) for p in module.trainable_parameters()]


def _check_sites(model: nn.Module, adapter: AttentionAdapter) -> list[AttentionSite]:
    if adapter.name not in LINEARIZABLE_ARCHITECTURES:
        raise HeadkitError(
            f"linearize supports causal LMs of the {', '.join(LINEARIZABLE_ARCHITECTURES)} architectures, got "
            f"{adapter.name} ({type(model).__name__})"
        )
    sites = adapter.sites(model)
    if not sites:
        raise HeadkitError(f"the {adapter.name} adapter found no attention module in this model")
    for site in sites:
        if len(site.layers) != 1:
            raise HeadkitError(
                f"{site.name} is shared by layers {site.layers}; linearize needs one module per layer"
            )
        if site.is_headkit and not isinstance(site.module, LinearizedAttention):
            raise HeadkitError(
                f"{site.name} was already replaced by {type(site.module).__name__}; cannot linearize it"
            )
    return sites


def _check_arguments(
    model: nn.Module,
    sites: list[AttentionSite],
    window: Any,
    feature_map: Any,
    layers: Iterable[int] | None,
    feature_dim: Any,
    chunk_size: Any,
) -> list[AttentionSite]:
    """Validate every argument; return the sites to convert."""
    context = max_context(model)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise HeadkitError(f"window must be a positive integer, got {window!r}")
    if context is not None and window > context:
        raise HeadkitError(f"window must be at most the model's context of {context} tokens, got {window}")
    if not isinstance(feature_map, str) or feature_map not in valid_feature_map_names():
        raise HeadkitError(
            f"unknown feature map {feature_map!r}; valid: {', '.join(valid_feature_map_names())}"
        )
    if feature_dim is not None and (
        isinstance(feature_dim, bool) or not isinstance(feature_dim, int) or feature_dim < 1
    ):
        raise HeadkitError(f"feature_dim must be a positive integer or None, got {feature_dim!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise HeadkitError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    count = len(sites)
    if layers is None:
        indices: Sequence[int] = range(count)
    else:
        indices = list(layers) if not isinstance(layers, (str, bytes)) else [layers]
        if not indices:
            raise HeadkitError("layers must name at least one layer to convert (None converts all)")
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
        if bad:
            raise HeadkitError(
                f"layers must be indices in [0, {count}) (the model has {count} layers), got {bad}"
            )
        if len(set(indices)) != len(indices):
            raise HeadkitError(f"layers lists a layer twice: {list(indices)}")
    chosen = [sites[i] for i in sorted(indices)]
    done = [site.layers[0] for site in chosen if isinstance(site.module, LinearizedAttention)]
    if done:
        raise HeadkitError(f"layers {done} are already linearized")
    try:  # the feature map's own checks (e.g. a fixed map keeps head_dim features)
        build_feature_map(feature_map, 1, sites[0].head_dim, feature_dim)
    except ValueError as exc:
        raise HeadkitError(str(exc)) from None
    return chosen


def _plan_site(
    adapter: AttentionAdapter,
    site: AttentionSite,
    window: int,
    feature_map: str,
    feature_dim: int | None,
    chunk_size: int,
) -> LinearizedAttention:
    """The replacement of one site, built from its projections without touching the model."""
    weights = adapter.read_projections(site)
    like = site.module.get_submodule(adapter.query_name)
    projections = {
        "q_proj": new_linear(weights.q_weight.clone(), _clone(weights.q_bias), like=like),
        "k_proj": new_linear(weights.k_weight.clone(), _clone(weights.k_bias), like=like),
        "v_proj": new_linear(weights.v_weight.clone(), _clone(weights.v_bias), like=like),
    }
    return LinearizedAttention(
        projections=projections,
        num_heads=site.num_heads,
        num_kv_heads=site.num_kv_heads,
        head_dim=site.head_dim,
        scale=site.scale,
        window=window,
        feature_map=feature_map,
        feature_dim=feature_dim,
        chunk_size=chunk_size,
        layer_idx=site.layers[0],
        adapter=adapter,
        call_signature=inspect.signature(type(site.module).forward),
        epilogue=adapter.epilogue_modules(site),
        dtype=weights.q_weight.dtype,
        device=weights.q_weight.device,
    )


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded conversion on a freshly built model (the weights are loaded afterwards)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = _check_sites(model, adapter)
    chosen = _check_arguments(
        model,
        sites,
        int(entry["window"]),
        entry["feature_map"],
        [int(i) for i in entry["layers"]],
        entry.get("feature_dim"),
        int(entry.get("chunk_size", 64)),
    )
    if [site.name for site in chosen] != list(entry["sites"]):
        raise HeadkitError(
            f"the recorded linearization covered {entry['sites']}, but the rebuilt model's layers {entry['layers']} "
            f"are {[site.name for site in chosen]}"
        )
    planned = [
        (
            site,
            _plan_site(
                adapter,
                site,
                int(entry["window"]),
                entry["feature_map"],
                entry.get("feature_dim"),
                int(entry.get("chunk_size", 64)),
            ),
        )
        for site in chosen
    ]
    for site, module in planned:
        adapter.replace_attention(model, site, module)


register_surgery_op(SURGERY_OP, _reapply)

__all__ = [
    "HybridStateCacheLayer",
    "LinearizeReport",
    "LinearizedAttention",
    "decoding_state_bytes",
    "hybrid_cache_layer",
    "key_padding_mask",
    "linearize",
    "linearized_modules",
    "linearized_parameters",
    "max_context",
]
