"""Linearize a pretrained causal LM: softmax attention → sliding-window softmax + linear attention (LoLCATs).

Each chosen self-attention layer of a decoder that dispatches through transformers' attention interface (every
family in :mod:`headkit.surgery.adapters`: llama, mistral, qwen2/3, gemma2/3, phi3, gpt_neox, olmo2, granite,
smollm3, starcoder2, GPT-2, …) computes exact softmax over the last ``window`` keys plus linear attention,
through learnable feature maps (Hedgehog by default), over every earlier key, under one shared normaliser
(:func:`headkit.ops.hybrid_attention`; Zhang et al. 2024, "LoLCATs", arXiv:2410.10254).

The stock attention module stays: its projections, biases, q/k norms, rotary (full, partial or none — SmolLM3's
NoPE layers), scaling and masks are the family's own. It gains a :class:`LinearizedHeads` submodule
(``headkit_attention``: ``feature_map_q`` per query head, ``feature_map_k`` per key/value head, the per-head
balance γ_h = exp(``log_balance``)), which the registered ``headkit_<base>`` attention function runs in place of
softmax for that layer (:mod:`headkit.surgery.attention`); every other layer runs what it ran before.

Exact at conversion where it can be: the window term of query i is exp(s_ij − m_i) over its last ``window`` keys,
so a query whose whole past fits in the window gets the original softmax attention (up to the op's eps = 1e-6 in
a denominator ≥ 1). With ``window ≥ T`` the converted model equals the original on T tokens; beyond the window
the linear term starts from the untrained feature maps, which is what the recovery recipe
(:mod:`headkit.recipes.linearize`) trains. Gemma 2's logit soft-capping is not applied by the window term: the
report says so, and recovery absorbs it.

**Sliding-window layers** (Gemma 2/3, a Mistral or Qwen2 with ``sliding_window``) are already bounded: they keep
softmax and their sliding key/value cache by default, and the report gives the bytes that cache holds; a model whose
every layer slides (a default Mistral) is refused with that reason unless ``convert_sliding=True``, which converts
them too (all of them: the model builds one mask per layer type, sized from one layer's cache entry). A
converted sliding layer gets the model's sliding mask, whose last row no longer reaches the early keys; the
mechanism reads each new key's padding from the mask's diagonal instead (:func:`new_key_padding_mask`), which a
causal and a sliding mask share, and its own window replaces the model's.

**Decoding cache.** A 🤗 decoder hands every attention module the same cache (a ``DynamicCache`` that
``generate()`` or the model creates), one entry per layer in ``cache.layers``. A converted layer's entry is
replaced, on first use, by a :class:`HybridStateCacheLayer` — a :class:`~headkit.layers.cache.StateCacheLayer`
(the transformers ``CacheLayerMixin`` of every headkit decoding state, so that ``get_seq_length`` /
``get_mask_sizes`` count its tokens like a key/value layer's) holding a constant-size
:class:`headkit.ops.HybridAttentionState` (the last W − 1 keys, values and key features, plus the linear sums of
every older key). Its
``update`` hands the new keys and values straight through; the mechanism folds them into the state. So one stock
cache holds key/value, sliding and linearized layers side by side, ``generate()``, beam search and batch
reordering work unchanged, and the cache of a fully converted model does not grow with the context. (A state
cannot be rewound: assisted generation's ``crop`` is refused.)

The padding mask reaches the mechanism as the model's own mask (4D or None); its last query row is the key
padding mask over every token seen, which is all the hybrid op needs.

**Keeping exact what the linear term cannot recall** (``sinks``, ``budget``): the first S tokens (attention
sinks, StreamingLLM) and, per layer and key/value head, a budget of G keys chosen online as tokens leave the
window — those the linear state recalls worst (LoLA's criterion) — stay exact under the same normaliser; evicted
keys fold into the linear state (:mod:`headkit.ops.hybrid.sparse`). The state grows by S + G keys and values
per head (plus the cached keys' features and scores and a reference memory), still constant in the context.
The parallel form makes the decisions token-by-token decoding makes, so attention transfer trains the mechanism
the model decodes with. With S = G = 0 (the default of :func:`linearize`) the layer is the plain hybrid.

:func:`linearize` validates everything and builds every mechanism before it attaches any, so a bad argument
leaves the model untouched; the conversion is recorded in ``config.headkit_surgery`` so that ``save_pretrained``
+ :func:`headkit.from_pretrained` rebuilds it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.cache import StateCacheLayer, state_tensors
from headkit.layers.feature_maps import build_feature_map
from headkit.layers.hybrid import HybridHeads, HybridStateCacheLayer, SplitHeadsRing, SplitHeadsState
from headkit.layers.kept_exact import SELECTIONS, ExactHeads, KeptKeys, causal_softmax
from headkit.layers.quantized_cache import QuantizedHybridStateCacheLayer, exact_leaves
from headkit.ops.hybrid import hybrid_attention, sparse_hybrid_attention, sparse_hybrid_state
from headkit.ops.key_selection import RECONSTRUCTION
from headkit.surgery.adapters import (
    AttentionAdapter,
    AttentionSite,
    check_mask_is_tensor,
    count_parameters,
    get_adapter,
)
from headkit.surgery.attention import (
    POSITION_EMBEDDINGS_KEYWORD,
    AttentionCall,
    attach_mechanisms,
    mechanism_of,
    refuse_modules_off_the_interface,
)
from headkit.surgery.families import LINEARIZE, get_family
from headkit.surgery.heads import config_head_dim, config_query_groups

# The config (no model code) in a module of its own; its names stay here too.
from headkit.surgery.linearize_config import (  # noqa: F401  (the names linearize has always offered)
    LinearizeConfig,
    config_kv_heads,
    max_context,
    sliding_layers,
)
from headkit.surgery.reconstruction import attach_reconstruction_prefill
from headkit.surgery.records import (
    SURGERY_KEY,
    given_config,
    record_surgery,
    recorded_surgery,
    register_conversion,
    say_deprecated,
)

SURGERY_OP = "linearize"


def hybrid_cache_layer(cache: Any, layer_idx: int) -> HybridStateCacheLayer:
    """The :class:`HybridStateCacheLayer` of ``layer_idx`` in ``cache``."""
    return HybridStateCacheLayer.in_cache(cache, layer_idx)


def decoding_state_bytes(cache: Any) -> int:
    """Bytes of every tensor a 🤗 cache holds: keys and values of key/value layers, the states of converted
    layers (the memory decoding needs besides the weights)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, StateCacheLayer):
            total += layer.state_bytes()
        else:
            tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def new_key_padding_mask(attention_mask: Any, batch: int, past: int, seq: int) -> torch.Tensor | None:
    """The [B, seq] bool padding mask (True = real token) of the `seq` new keys, behind any mask a 🤗 decoder
    hands its attention: None, a [B, past + seq] padding mask, or a 4D mask [B, 1|H, seq, kv_len] (bool, True =
    keep; or additive float) over kv_len ≥ past + seq keys. In a 4D mask new token r is a real token exactly
    when query r may attend to itself — its diagonal entry — under a causal mask and a sliding-window one alike
    (a sliding layer's last row no longer reaches the early keys; the diagonal always does)."""
    if attention_mask is None:
        return None
    check_mask_is_tensor(attention_mask, "linearized attention")
    if (
        attention_mask.dim() == 4
        and attention_mask.shape[-2] == seq
        and attention_mask.shape[-1] >= past + seq
    ):
        rows = torch.arange(seq, device=attention_mask.device)
        attention_mask = attention_mask[:, 0, rows, past + rows]
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    elif attention_mask.dim() == 2 and attention_mask.shape[1] == past + seq:
        attention_mask = attention_mask[:, past:]
    else:
        raise HeadkitError(
            f"attention_mask must be a [batch, {past + seq}] padding mask or a [batch, 1, {seq}, ≥ {past + seq}] "
            f"mask over the past and new tokens, got {tuple(attention_mask.shape)}"
        )
    if attention_mask.shape[0] not in (1, batch):
        raise HeadkitError(f"attention_mask must have batch size 1 or {batch}, got {attention_mask.shape[0]}")
    return attention_mask.bool().expand(batch, seq)


class LinearizedHeads(HybridHeads):
    """The mechanism of a linearized layer (``<attention module>.headkit_attention``): headkit's hybrid mechanism
    (:class:`headkit.layers.hybrid.HybridHeads`, which :class:`headkit.layers.HybridAttention` is built from too)
    over the queries, keys and values the stock module computed (rotary applied, keys and values not repeated).
    Parameters: ``feature_map_q`` (per query head), ``feature_map_k`` (per key/value head), ``log_balance``
    [heads]. Called by the registered attention function; returns ``(output [B, T, H, D], None)``.

    With ``sinks`` or ``budget`` it also keeps the first tokens and a budget of chosen keys exact beyond the
    window (:func:`headkit.ops.sparse_hybrid_attention`), in its training, prefill and decoding forms alike. The
    budget's keys are chosen by ``selection``: ``"recall"`` — online, those the linear state recalls worst (LoLA);
    ``"question"`` — when a prompt is prefilled into a cache, those its last ``observation`` queries attend to
    most (SnapKV, :mod:`headkit.ops.key_selection`); a forward without a cache (training, perplexity) is causal
    and has no question yet: the budget then takes the first keys that leave the window, and a decoding step's
    keys fill empty slots only. ``fold=False`` drops what is not kept instead of folding it into a linear state
    (no feature maps, γ = 0; a first prompt attends to itself in full, as SnapKV's prefill does): the original
    model with a compressed key/value cache, the baseline the linear state must beat. ``exact_heads`` lists the
    key/value heads (with their query heads) that keep softmax with a full cache (retrieval heads, DuoAttention):
    one attention call splits the heads, the layer's cache entry holds a :class:`SplitHeadsState`.

    Each of these is a piece of :mod:`headkit.layers.kept_exact` (``kept``: sinks and the budget with its
    selection; ``exact``: the exact heads), set by :meth:`configure`; the layer only routes the heads and the
    options through them.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int,
        feature_map: str,
        feature_dim: int | None,
        chunk_size: int,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        sinks: int = 0,
        budget: int = 0,
        selection: str = "recall",
        observation: int = 32,
        fold: bool = True,
        exact_heads: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # Exact beyond the window (headkit.ops.hybrid.sparse): the first `sinks` tokens and `budget` keys
        # per key/value head, chosen by `selection`. 0 and 0: the plain hybrid.
        self.configure(
            sinks=sinks, budget=budget, selection=selection, observation=observation,
            exact_heads=exact_heads,
        )  # fmt: skip
        self.feature_map_name, self.feature_dim = feature_map, feature_dim
        self.layer_idx = layer_idx
        # QuantizedHybridStateCacheLayer.configure's settings (bits, group_size, full_precision_window) where the
        # exact keys and values are stored quantized (QuantizedKVConfig after it).
        self.quantized_storage: dict[str, Any] | None = None
        self.build_hybrid_heads(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, window=window, chunk_size=chunk_size,
            scale=scale, feature_map=feature_map, feature_dim=feature_dim, fold=fold, dtype=dtype, device=device,
        )  # fmt: skip

    def configure(
        self, *, sinks: int, budget: int, selection: str, observation: int, exact_heads: Sequence[int]
    ) -> None:
        """Set what is kept exact, as pieces (:mod:`headkit.layers.kept_exact`): the sinks and the budget with its
        selection, the exact heads. None of it has parameters, so a trained layer takes another budget or other
        retrieval heads as it is (:func:`reconfigure`)."""
        self.kept = KeptKeys(sinks, budget, SELECTIONS[selection](observation))
        self.exact = ExactHeads(exact_heads, self.num_heads, self.num_kv_heads)

    sinks = property(lambda self: self.kept.sinks)
    budget = property(lambda self: self.kept.budget)
    selection = property(lambda self: self.kept.selection.name)
    observation = property(lambda self: self.kept.selection.observation)
    exact_heads = property(lambda self: self.exact.heads)
    linear_heads = property(lambda self: self.exact.linear_heads)

    @property
    def needs_position_embeddings(self) -> bool:
        """Whether the feature maps read rotary pairs rotated back (the module's cos and sin are then handed to
        the attention function: :func:`headkit.surgery.attention.attach_mechanisms`)."""
        return self.unrotated_pairs is not None

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What attention transfer trains: the feature maps and the balances (nothing when nothing folds)."""
        if not self.fold:
            return []
        return [*self.feature_map_q.parameters(), *self.feature_map_k.parameters(), self.log_balance]

    @torch.no_grad()
    def state_bytes(
        self,
        context: int = 1,
        *,
        bytes_per_number: int | None = None,
        token_bytes: float | None = None,
        full_precision_window: bool = False,
    ) -> float:
        """Bytes of this layer's decoding state for one sequence after `context` tokens: constant for the
        converted heads (their tensors have their final sizes from the first token on), growing with the context
        for the exact heads. `bytes_per_number`: count the state's floating-point numbers at that many bytes each
        and leave out its bookkeeping (slot positions, flags), as a cache's bytes per token are counted (None:
        every tensor at its own size); with it, `token_bytes`: what one head's key and value of one token cost
        where the exact keys and values are stored quantized (:class:`~headkit.surgery.QuantizedKVConfig`), and
        `full_precision_window`: the window's keys and values then kept at `bytes_per_number` a number."""
        weight = self.log_balance
        heads, kv_heads = self.exact.linear_query_heads, list(self.linear_heads)
        queries = weight.new_zeros(1, len(heads), 1, self.head_dim)
        keys = weight.new_zeros(1, len(kv_heads), 1, self.head_dim)
        if bytes_per_number is None:
            exact = self.exact.state_bytes(context, self.head_dim, weight.element_size())
        else:  # the exact heads' keys and values, not their flags
            exact = 2 * len(self.exact_heads) * self.head_dim * bytes_per_number * context
            if token_bytes is not None:
                exact = len(self.exact_heads) * context * token_bytes
        if not kv_heads:
            return exact
        rotary_pairs = self.head_dim // 2 if self.unrotated_pairs is None else len(self.unrotated_pairs)
        query_features, key_features = self.features(
            weight.new_zeros(1, self.num_heads, 1, self.head_dim),
            weight.new_zeros(1, self.num_kv_heads, 1, self.head_dim),
            # Angle-0 tables as wide as the rotary part: only the features' shapes matter here.
            (weight.new_ones(1, 1, 2 * rotary_pairs), weight.new_zeros(1, 1, 2 * rotary_pairs)),
        )
        tensors = (
            queries, keys, keys, query_features[:, heads], key_features[:, kv_heads], self.balance[heads],
        )  # fmt: skip
        options = {"window": self.window, "validate": False, "output_final_state": True}
        if self.kept:
            _, state = sparse_hybrid_attention(*tensors, sinks=self.sinks, budget=self.budget, **options)
        else:
            _, state = hybrid_attention(*tensors, **options)
        if bytes_per_number is None:
            return sum(t.numel() * t.element_size() for t in state_tensors(state)) + exact
        if token_bytes is None:
            numbers = sum(t.numel() for t in state_tensors(state) if t.is_floating_point())
            return numbers * bytes_per_number + exact
        # the exact keys and values stored at `token_bytes` a (head, token), the rest at bytes_per_number
        leaves = exact_leaves(state, window=not full_precision_window)
        kept = sum(t.numel() for _, t in leaves) // (2 * self.head_dim)  # a key and a value a slot
        numbers = sum(t.numel() for t in state_tensors(state) if t.is_floating_point())
        numbers -= sum(t.numel() for _, t in leaves)
        return numbers * bytes_per_number + (kept + len(self.exact_heads) * context) * token_bytes

    def cache_layer(self, cache: Any) -> HybridStateCacheLayer:
        """This layer's entry in the model's cache (see :class:`headkit.surgery.attention.CacheLayerHook`): one
        that stores the exact keys and values quantized where :attr:`quantized_storage` is set."""
        if self.quantized_storage is None:
            return hybrid_cache_layer(cache, self.layer_idx)
        layer = QuantizedHybridStateCacheLayer.in_cache(cache, self.layer_idx)
        return layer.configure(**self.quantized_storage)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, None]:
        queries, keys, values, cache_layer = call.queries, call.keys, call.values, call.cache_layer
        rotary = call.options.get(POSITION_EMBEDDINGS_KEYWORD)
        batch, _, seq, _ = queries.shape
        scale = call.scale(self.scale)
        state, stepping = self.cached_state(cache_layer, seq)
        new_mask = None
        if not (stepping and cache_layer.real_tokens_only):  # the fast decoder's steps read no mask
            past = 0 if cache_layer is None else cache_layer.get_seq_length()
            new_mask = new_key_padding_mask(call.attention_mask, batch, past, seq)
            new_mask = None if new_mask is None else new_mask.to(queries.device)
        if getattr(self.kept.selection, "scoring", None) is not None:
            # A reconstruction's scoring forward (headkit.surgery.reconstruction): the original attention over the
            # whole sequence, no cache; the repetition's attention to the prompt is recorded.
            outputs, _ = causal_softmax(queries, keys, values, new_mask, scale, None)
            self.kept.selection.record_scores(queries, keys, new_mask, scale, self.linear_heads)
            return outputs.transpose(1, 2).contiguous(), None
        options = (new_mask, scale, cache_layer, stepping, rotary)
        if not self.exact:
            outputs, state = self._converted(queries, keys, values, state, *options)
        else:
            split = state if isinstance(state, SplitHeadsState | SplitHeadsRing) else None
            outputs = queries.new_empty(batch, self.num_heads, seq, values.shape[-1])
            outputs[:, self.exact.query_heads], state = self.exact.attend(
                queries, keys, values, new_mask, scale, split
            )
            if self.linear_heads:
                linear_q, linear_kv = self.exact.linear_query_heads, list(self.linear_heads)
                outputs[:, linear_q], linear_state = self._converted(
                    queries[:, linear_q], keys[:, linear_kv], values[:, linear_kv],
                    None if split is None else split.linear, *options,
                )  # fmt: skip
                state = state._replace(linear=linear_state)
        self.keep_state(cache_layer, state, seq, stepping)
        return outputs.transpose(1, 2).contiguous(), None

    def _converted(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        state: Any,
        new_mask: torch.Tensor | None,
        scale: float,
        cache_layer: Any,
        stepping: bool,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """The converted heads (all of them, or those beside the exact heads): outputs, and the next state when
        there is a cache (the buffers ``state``, written in place, for a decoding step)."""
        seq = queries.shape[2]
        heads, kv_heads = self.exact.linear_query_heads, list(self.linear_heads)
        query_features, key_features = self._head_features(queries, keys, heads, kv_heads, rotary)
        # The mask is checked above and states come from the op itself: its own checks would only repeat that.
        options = {"window": self.window, "attention_mask": new_mask, "scale": scale, "validate": False}
        tensors = (queries, keys, values, query_features, key_features, self.balance[heads])
        # A prompt prefilled into a cache is the only call that asks a question.
        options |= self.kept.options(
            queries, keys, new_mask, scale, cache_layer is not None and seq != 1, state
        )
        if cache_layer is not None and seq > 1 and not self.fold and state is None:
            # The compressed cache prefills as the original model does (SnapKV): the prompt attends to itself in
            # full, and the cache keeps what the op's plan keeps, without the op's own outputs.
            outputs, _ = causal_softmax(queries, keys, values, new_mask, scale, None)
            if not self.kept:
                _, state_after = self.hybrid_heads(tensors, state, cached=True, **options)
                return outputs, state_after
            return outputs, sparse_hybrid_state(
                keys, values, key_features, window=self.window, sinks=options["sinks"], budget=options["budget"],
                attention_mask=new_mask, chunk_size=self.chunk_size, key_scores=options.get("key_scores"),
            )  # fmt: skip
        return self.hybrid_heads(tensors, state, cached=cache_layer is not None, stepping=stepping, **options)

    def _head_features(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        heads: list[int],
        kv_heads: list[int],
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.exact:
            return self.features(queries, keys, rotary)
        # The feature maps hold one map per head of the layer: place the converted heads at their indices.
        full_q = queries.new_zeros(queries.shape[0], self.num_heads, *queries.shape[2:])
        full_k = keys.new_zeros(keys.shape[0], self.num_kv_heads, *keys.shape[2:])
        full_q[:, heads], full_k[:, kv_heads] = queries, keys
        query_features, key_features = self.features(full_q, full_k, rotary)
        return query_features[:, heads], key_features[:, kv_heads]

    def extra_repr(self) -> str:
        extra = f", selection={self.selection!r}, observation={self.observation}" if self.budget else ""
        extra += "" if self.fold else ", fold=False"
        extra += f", exact_heads={list(self.exact_heads)}" if self.exact_heads else ""
        if self.quantized_storage is not None:
            storage = self.quantized_storage
            extra += f", stored in {storage['bits']} bits (groups of {storage['group_size']})"
            extra += ", window in full precision" if storage.get("full_precision_window") else ""
        return (
            f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, window={self.window}, sinks={self.sinks}, "
            f"budget={self.budget}{extra}, feature_map={self.feature_map_name!r}, "
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
    sliding_layers: list[int] = field(default_factory=list)  # kept: their cache is bounded already
    sliding_cache_bytes: int = 0  # what those layers' caches hold at most, per sequence
    converted_sliding_layers: list[int] = field(default_factory=list)  # with convert_sliding=True
    notes: list[str] = field(default_factory=list)
    sinks: int = 0  # first tokens kept exact in every converted layer
    budget: int = 0  # exact keys kept per key/value head, chosen by the linear state's recall error
    state_bytes: int = 0  # decoding state of the converted layers, per sequence, after one token
    selection: str = "recall"  # how the sparse cache's keys are chosen
    observation: int = 32  # the prompt's last queries that choose them (selection "question")
    fold: bool = True  # False: the keys not kept exact are dropped (the compressed-cache baseline)
    retrieval_heads: list[list[int]] = field(default_factory=list)  # (layer, key/value head) kept softmax
    state_bytes_8192: int = 0  # the same after 8,192 tokens: the retrieval heads' full cache grows
    feature_wavelength: int = 0  # rotary pairs slower than this read rotated back by the feature maps
    unrotated_pairs: int = 0  # how many pairs that is (per layer, the most of any layer)
    rotary_pairs: int = 0  # of how many rotary pairs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        kept = f"; softmax kept in layers {self.softmax_layers}" if self.softmax_layers else ""
        if self.sliding_layers:
            kept += (
                f" (sliding-window layers {self.sliding_layers}: at most {self.sliding_cache_bytes:,} cache bytes "
                "per sequence)"
            )
        if self.converted_sliding_layers:
            kept += f"; sliding-window layers {self.converted_sliding_layers} converted too"
        notes = "".join(f"; {note}" for note in self.notes)
        exact = f", {self.sinks} sinks, budget {self.budget}" if self.sinks or self.budget else ""
        if self.budget and self.selection == "question":
            exact += f" chosen by the prompt's last {self.observation} queries"
        if self.retrieval_heads:
            exact += f", {len(self.retrieval_heads)} retrieval heads kept softmax"
        if not self.fold:
            exact += ", the rest dropped (no linear state)"
        if self.unrotated_pairs:
            exact += (
                f", features read {self.unrotated_pairs} of {self.rotary_pairs} rotary pairs (wavelength > "
                f"{self.feature_wavelength} tokens) rotated back"
            )
        return (
            f"linearized {len(self.layers)} {self.architecture} attention layers (window {self.window}{exact}, "
            f"{self.feature_map} features{kept}); decoding state {self.state_bytes:,} bytes per sequence ({self.state_bytes_8192:,} at 8,192 tokens); parameters {self.parameters_before:,} -> "
            f"{self.parameters_after:,} (+{self.trainable_parameters:,} feature-map and balance parameters){notes}"
        )


def linearize(
    model: nn.Module,
    config: LinearizeConfig | None = None,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    **options: Any,
) -> LinearizeReport:
    """Convert the softmax self-attention of a causal LM to sliding-window + linear attention, in place.

    Args:
        model: a causal LM (``*ForCausalLM`` / ``*Model``) of a family :mod:`headkit.surgery.adapters` knows,
            whose attention modules dispatch through transformers' attention interface.
        config: how to convert (:class:`LinearizeConfig`); or its fields as keywords (``window=256, …``).
        adapter: the architecture's adapter; detected from the model when None.

    Returns a :class:`LinearizeReport`. Raises :class:`HeadkitError` for an unsupported architecture or one whose
    attention does not go through the attention interface, a window out of range, an unknown feature map, layers
    out of range, sliding or already converted — the model is then untouched.
    """
    say_deprecated("linearize", LinearizeConfig)
    return _linearize(model, _config_of(config, options), adapter=adapter)


def _linearize(
    model: nn.Module,
    config: LinearizeConfig,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> LinearizeReport:
    """:func:`headkit.apply_` of a :class:`LinearizeConfig` (see :func:`linearize`)."""
    if adapter is None:  # an unregistered family, or one that cannot be linearized: one line, before any work
        get_family(model, LINEARIZE)
    adapter = get_adapter(model, adapter)
    sites = _check_sites(model, adapter)
    sliding = sliding_layers(model.config, len(sites))
    chosen = _chosen_sites(model, sites, config)
    refuse_modules_off_the_interface(
        model, [(s.name, s.module) for s in chosen], f"{adapter.name} cannot be linearized"
    )
    before = count_parameters(model)
    unrotated = unrotated_rotary_pairs(model, [site.layers[0] for site in chosen], config.feature_wavelength)
    pair_count = _rotary_pair_count(model)
    planned = [
        (site, _plan_site(site, config, pairs, pair_count))
        for site, pairs in zip(chosen, unrotated, strict=True)
    ]
    # Everything is built and checked: only now does the model change.
    attach_mechanisms(model, [(site.module, mechanism) for site, mechanism in planned])
    if config.selection == RECONSTRUCTION:
        attach_reconstruction_prefill(model)
    indices = [site.layers[0] for site in chosen]
    record_surgery(
        model,
        {"op": SURGERY_OP, "adapter": adapter.name}
        | config.record()
        | {"layers": indices}
        | {"sites": [site.name for site in chosen], "unrotated_pairs": unrotated, "rotary_pairs": pair_count},
    )
    notes = []
    if getattr(model.config, "attn_logit_softcapping", None):
        notes.append(
            f"the converted layers' window term does not soft-cap logits (attn_logit_softcapping="
            f"{model.config.attn_logit_softcapping}); recovery absorbs it"
        )
    return LinearizeReport(
        architecture=adapter.name,
        layers=indices,
        window=config.window,
        feature_map=config.feature_map,
        feature_dim=config.feature_dim,
        chunk_size=config.chunk_size,
        parameters_before=before,
        parameters_after=count_parameters(model),
        trainable_parameters=sum(p.numel() for _, m in planned for p in m.trainable_parameters()),
        softmax_layers=[site.layers[0] for site in sites if mechanism_of(site.module) is None],
        sliding_layers=[] if config.convert_sliding else sliding,
        sliding_cache_bytes=0 if config.convert_sliding else _sliding_cache_bytes(model, sites, sliding),
        converted_sliding_layers=sliding if config.convert_sliding else [],
        notes=notes,
        sinks=config.sinks,
        budget=config.budget,
        state_bytes=sum(mechanism.state_bytes() for _, mechanism in planned),
        selection=config.selection,
        observation=config.observation,
        fold=config.fold,
        retrieval_heads=[list(pair) for pair in config.retrieval_heads],
        state_bytes_8192=sum(mechanism.state_bytes(8192) for _, mechanism in planned),
        feature_wavelength=config.feature_wavelength,
        unrotated_pairs=max((len(pairs or ()) for pairs in unrotated), default=0),
        rotary_pairs=pair_count,
    )


# What a trained linearized model can change without retraining: nothing with parameters.
RECONFIGURABLE = ("sinks", "budget", "selection", "observation", "retrieval_heads")


def reconfigure(model: nn.Module, **changes: Any) -> LinearizeConfig:
    """Change what a linearized model keeps exact — ``sinks``, ``budget``, ``selection``, ``observation``,
    ``retrieval_heads`` (:class:`LinearizeConfig`) — in place, without retraining: none of them has parameters.
    The new config is validated against the model first (a bad change leaves it untouched) and replaces the
    model's record, so ``save_pretrained`` + :func:`headkit.from_pretrained` rebuild it. Returns the new config.
    (A retrieval head's feature maps are kept, unused; one turned back into a linear head uses the maps it
    had.)"""
    unknown = sorted(set(changes) - set(RECONFIGURABLE))
    if unknown:
        raise HeadkitError(f"reconfigure changes only {', '.join(RECONFIGURABLE)}; got {', '.join(unknown)}")
    entries = recorded_surgery(model)
    index = next((i for i in reversed(range(len(entries))) if entries[i].get("op") == SURGERY_OP), None)
    modules = linearized_modules(model)
    if index is None or not modules:
        raise HeadkitError("reconfigure needs a linearized model (headkit.linearize)")
    config = replace(LinearizeConfig.from_record(entries[index]), **changes)
    layers = config.layers_to_convert(model)
    if layers != [module.layer_idx for module in modules]:
        raise HeadkitError(
            f"the model's linearized layers {[m.layer_idx for m in modules]} differ from its record"
        )
    for module in modules:
        module.configure(
            sinks=config.sinks, budget=config.budget, selection=config.selection,
            observation=config.observation,
            exact_heads=[head for layer, head in config.retrieval_heads if layer == module.layer_idx],
        )  # fmt: skip
    if config.selection == RECONSTRUCTION:
        attach_reconstruction_prefill(model)
    entries[index] = entries[index] | config.record() | {"layers": layers}
    setattr(model.config, SURGERY_KEY, json.loads(json.dumps(entries)))
    return config


def state_bytes_per_token(
    conversion: LinearizeConfig,
    config: Any,
    *,
    bytes_per_number: int = 2,
    context: int = 8192,
    token_bytes: float | None = None,
    full_precision_window: bool = False,
) -> float | None:
    """The decoding state's bytes per token of a `context`-token sequence for a model with the 🤗 `config` (the
    pruning it records applied) after `conversion` (what :func:`headkit.surgery.bytes_per_token` reads for a
    :class:`LinearizeConfig`): each converted layer's window, sinks and kept keys and, where it folds, its linear
    state and normalizer (constant in the context), and its retrieval heads' keys and values (growing), measured on
    its mechanism, built
    with the layer's head counts and nothing of the model's weights (one per distinct layer; the random generators
    left as they were); each other layer its key/value cache. Floating-point numbers at `bytes_per_number` bytes
    each; the bookkeeping (slot positions, flags) is not counted. None where the config does not state its heads.
    `token_bytes`: a converted layer's exact keys and
    values stored quantized, at that many bytes a head's key and value of one token (the layers left alone keep
    their cache unquantized); `full_precision_window`: their windows' keys and values not quantized."""
    groups, head_dim = config_query_groups(config), config_head_dim(config)
    if groups is None or head_dim is None:
        return None
    count = len(groups)
    converted = set(conversion.layers_to_convert(config, count))
    sliding = set(sliding_layers(config, count))
    # transformers' sliding layer keeps the window's W − 1 past tokens
    window = (getattr(config, "sliding_window", None) or context + 1) - 1
    measured: dict[tuple[int, int, tuple[int, ...]], float] = {}
    total = 0.0
    for layer, group in enumerate(groups):
        heads, kv_heads = len(group), len(set(group))
        if layer not in converted:
            tokens = min(context, window) if layer in sliding else context
            total += 2 * kv_heads * head_dim * tokens * bytes_per_number
            continue
        exact = tuple(head for where, head in conversion.retrieval_heads if where == layer)
        key = (heads, kv_heads, exact)
        if key not in measured:
            with torch.random.fork_rng(devices=[]):
                mechanism = LinearizedHeads(
                    num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5,
                    window=conversion.window, feature_map=conversion.feature_map,
                    feature_dim=conversion.feature_dim, chunk_size=conversion.chunk_size, layer_idx=layer,
                    dtype=torch.float32, device=torch.device("cpu"), sinks=conversion.sinks,
                    budget=conversion.budget, selection=conversion.selection, observation=conversion.observation,
                    fold=conversion.fold, exact_heads=exact,
                )  # fmt: skip
            measured[key] = mechanism.state_bytes(
                context, bytes_per_number=bytes_per_number, token_bytes=token_bytes,
                full_precision_window=full_precision_window,
            )  # fmt: skip
        total += measured[key]
    return total / context


def linearized_modules(model: nn.Module) -> list[LinearizedHeads]:
    """The mechanisms of the model's converted layers, in layer order."""
    found = {id(m): m for m in model.modules() if isinstance(m, LinearizedHeads)}
    return sorted(found.values(), key=lambda module: module.layer_idx)


def converted_attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index → the stock attention module of each converted layer (the module a layer's call goes to)."""
    return {
        mechanism.layer_idx: module
        for module in model.modules()
        if isinstance(mechanism := mechanism_of(module), LinearizedHeads)
    }


def linearized_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every feature-map and balance parameter of the model's converted layers (what attention transfer trains)."""
    return [p for module in linearized_modules(model) for p in module.trainable_parameters()]


def _check_sites(model: nn.Module, adapter: AttentionAdapter) -> list[AttentionSite]:
    sites = adapter.sites(model)
    if not sites:
        raise HeadkitError(f"the {adapter.name} adapter found no attention module in this model")
    if not all(site.causal for site in sites):
        raise HeadkitError(
            f"linearize converts causal self-attention; {adapter.name} ({type(model).__name__}) attends both ways"
        )
    for site in sites:
        if len(site.layers) != 1:
            raise HeadkitError(
                f"{site.name} is shared by layers {site.layers}; linearize needs one module per layer"
            )
        mechanism = mechanism_of(site.module)
        if mechanism is not None and not isinstance(mechanism, LinearizedHeads):
            raise HeadkitError(
                f"{site.name} already runs {type(mechanism).__name__} (earlier surgery); cannot linearize it"
            )
    return sites


def _config_of(config: LinearizeConfig | None, options: dict[str, Any]) -> LinearizeConfig:
    if config is None:
        return LinearizeConfig(**options)
    return given_config(LinearizeConfig, config, options)


def _chosen_sites(
    model: nn.Module, sites: list[AttentionSite], config: LinearizeConfig
) -> list[AttentionSite]:
    """The sites to convert: the config checked against the model, then what only its modules answer."""
    chosen = [sites[i] for i in config.layers_to_convert(model, len(sites))]
    done = [site.layers[0] for site in chosen if isinstance(mechanism_of(site.module), LinearizedHeads)]
    if done:
        raise HeadkitError(f"layers {done} are already linearized")
    try:  # the feature map's own checks (e.g. a fixed map keeps head_dim features)
        build_feature_map(config.feature_map, 1, sites[0].head_dim, config.feature_dim)
    except ValueError as exc:
        raise HeadkitError(str(exc)) from None
    return chosen


def _plan_site(
    site: AttentionSite, config: LinearizeConfig, unrotated: list[int] | None = None, pair_count: int = 0
) -> LinearizedHeads:
    """The mechanism of one site, built without touching the model (`unrotated`: the rotary pairs, of the
    model's `pair_count`, that its feature maps read rotated back; None for none)."""
    weight = next(site.module.parameters())
    mechanism = LinearizedHeads(
        num_heads=site.num_heads,
        num_kv_heads=site.num_kv_heads,
        head_dim=site.head_dim,
        scale=site.scale,
        window=config.window,
        feature_map=config.feature_map,
        feature_dim=config.feature_dim,
        chunk_size=config.chunk_size,
        layer_idx=site.layers[0],
        dtype=weight.dtype,
        device=weight.device,
        sinks=config.sinks,
        budget=config.budget,
        selection=config.selection,
        observation=config.observation,
        fold=config.fold,
        exact_heads=[head for layer, head in config.retrieval_heads if layer == site.layers[0]],
    )
    if unrotated:
        pairs = torch.zeros(pair_count, dtype=torch.bool, device=weight.device)
        pairs[list(unrotated)] = True
        mechanism.unrotated_pairs = pairs
    return mechanism


def _rotary_inverse_frequencies(model: nn.Module) -> dict[str, torch.Tensor]:
    """The rotary modules' inverse frequencies θ_i by layer type ("" for a model with one table; Gemma 3 keeps
    one per layer type, as ``<type>_inv_freq``)."""
    found: dict[str, torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name.endswith("inv_freq") and not name.endswith("original_inv_freq") and buffer is not None:
                found.setdefault(name[: -len("inv_freq")].rstrip("_"), buffer.detach().double().cpu())
    return found


def _rotary_pair_count(model: nn.Module) -> int:
    tables = _rotary_inverse_frequencies(model)
    return max((len(table) for table in tables.values()), default=0)


def unrotated_rotary_pairs(
    model: nn.Module, layers: Sequence[int], wavelength: int
) -> list[list[int] | None]:
    """Per layer, the rotary pairs whose wavelength 2π/θ_i exceeds `wavelength` tokens (what
    :class:`LinearizeConfig`'s ``feature_wavelength`` rotates back before the feature maps); None where there are
    none, the option is off (0) or the model has no rotary embeddings."""
    tables = _rotary_inverse_frequencies(model) if wavelength else {}
    if not tables:
        return [None] * len(layers)
    layer_types = getattr(model.config, "layer_types", None) or []
    chosen = []
    for layer in layers:
        kind = layer_types[layer] if layer < len(layer_types) else ""
        table = tables.get(kind, tables.get("", next(iter(tables.values()))))
        pairs = torch.nonzero(2 * math.pi / table > wavelength).flatten().tolist()
        chosen.append(pairs or None)
    return chosen


def _sliding_cache_bytes(model: nn.Module, sites: list[AttentionSite], sliding: list[int]) -> int:
    window = getattr(model.config, "sliding_window", None)
    if not sliding or not isinstance(window, int):
        return 0
    size = next(model.parameters()).element_size()
    return sum(2 * sites[i].num_kv_heads * sites[i].head_dim * window * size for i in sliding)


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded conversion on a freshly built model (the weights are loaded afterwards)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = _check_sites(model, adapter)
    config = LinearizeConfig.from_record(entry)
    chosen = _chosen_sites(model, sites, config)
    if [site.name for site in chosen] != list(entry["sites"]):
        raise HeadkitError(
            f"the recorded linearization covered {entry['sites']}, but the rebuilt model's layers {entry['layers']} "
            f"are {[site.name for site in chosen]}"
        )
    unrotated, count = entry.get("unrotated_pairs") or [None] * len(chosen), entry.get("rotary_pairs", 0)
    planned = [
        (site, _plan_site(site, config, pairs, count)) for site, pairs in zip(chosen, unrotated, strict=True)
    ]
    attach_mechanisms(model, [(site.module, mechanism) for site, mechanism in planned])
    if config.selection == RECONSTRUCTION:
        attach_reconstruction_prefill(model)


register_conversion(
    LinearizeConfig,
    SURGERY_OP,
    _linearize,
    _reapply,
    replaces_attention=True,
    bytes_per_token=state_bytes_per_token,
)

__all__ = [
    "LinearizeConfig",
    "LinearizeReport",
    "LinearizedHeads",
    "converted_attention_modules",
    "decoding_state_bytes",
    "hybrid_cache_layer",
    "new_key_padding_mask",
    "linearize",
    "linearized_modules",
    "linearized_parameters",
    "max_context",
    "reconfigure",
    "sliding_layers",
]
