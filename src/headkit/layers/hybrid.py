"""Hybrid attention layer: sliding-window softmax plus learnable linear attention, the LoLCATs layer.

Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large Language Models" (arXiv:2410.10254). Each head
attends with exact softmax to the last ``hybrid_window`` tokens and with linear attention, through learnable
Hedgehog feature maps (Zhang et al. 2024, arXiv:2402.04347), to every earlier token, under one normaliser:

    y_i = [Σ_{j ∈ window} exp(s_ij − m_i) v_j + γ_h Σ_{j ≤ i − W} φ_q(q_i)ᵀ φ_k(k_j) v_j] / [same weights summed]

(:func:`headkit.ops.hybrid_attention`, whose docstring gives the convention for the stabiliser m_i). The layer
has the usual ``q_proj``/``k_proj``/``v_proj``/``o_proj`` — a pretrained softmax layer's weights load into them
unchanged, which is what linearising a pretrained model needs — plus, per layer, a feature map for the queries
(one projection per query head) and one for the keys (one per key/value head, so grouped-query keys are mapped
once), and the per-head balance γ_h = exp(``log_balance``), positive by construction and 1 at initialisation.

The feature maps read the queries and keys *after* the rotary embedding, as LoLCATs does: the linear term is
trained to mimic the same softmax scores exp(q·k/√d) that the window computes, and those are scores of the
rotated vectors. The window is counted in token positions of the input (padding slots included), so left
padding — the only padding of batched generation — leaves every real token's window and linear sums unchanged.

Decoding keeps a fixed-size :class:`headkit.ops.HybridAttentionState` per layer in a
:class:`HybridStateCacheLayer` (the last W − 1 rotated keys, values and key features, and
the linear sums of everything older): its size does not grow with the context.

The mechanism itself — the feature maps, the balance and the choice between the parallel form and the decoding
step — is :class:`HybridHeads`, the one implementation that this layer and a linearized pretrained layer
(:class:`headkit.surgery.linearize.LinearizedHeads`, which configures it for a stock attention module) are built
from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import initialization as init

from headkit.errors import HeadkitError
from headkit.layers.base import HeadkitAttention, LayerInputs
from headkit.layers.cache import StateCacheLayer, state_tensors
from headkit.layers.feature_maps import build_feature_map
from headkit.layers.registry import register_attention
from headkit.ops.hybrid import (
    SparseHybridRingState,
    hybrid_attention,
    hybrid_attention_step_,
    ring_from_state,
    state_from_ring,
)
from headkit.ops.rotary import apply_rotary, rotary_cos_sin, unrotate_pairs


class SplitHeadsState(NamedTuple):
    """The decoding state of a hybrid layer whose retrieval heads keep softmax
    (:class:`headkit.surgery.linearize.LinearizedHeads` with ``exact_heads``): the converted heads' constant
    state (None when every head is exact), and the full key/value cache of the exact heads ([B, E, T, D] keys and
    values, [B, T] padding flags: True = real token)."""

    linear: Any
    keys: torch.Tensor
    values: torch.Tensor
    keep: torch.Tensor


class SplitHeadsRing(NamedTuple):
    """:class:`SplitHeadsState` as fixed buffers: the converted heads' ring state, and the exact heads' keys and
    values in buffers of a fixed capacity L ([B, E, L, ·], keep [B, L]) written in place at slot ``seen``
    (:func:`headkit.ops.softmax.softmax_attention_static_step_`)."""

    linear: Any
    keys: torch.Tensor
    values: torch.Tensor
    keep: torch.Tensor
    seen: torch.Tensor


class HybridStateCacheLayer(StateCacheLayer):
    """The cache entry of the hybrid mechanism (:class:`HybridHeads`: a :class:`HybridAttention` layer, a linearized
    stock layer): one fixed-size :class:`headkit.ops.HybridAttentionState` (or a larger state of the same
    mechanism keeping more keys exact) in a :class:`~headkit.layers.cache.StateCacheLayer`.

    The state is held as the buffers the op's one decoding step updates in place
    (:func:`headkit.ops.hybrid.ring_from_state`: the window as a ring); :meth:`get_state` gives the
    ordered state a prompt continues from (None before the first token) and :meth:`set_state` takes one back. A
    retrieval layer's exact heads keep a growing key/value cache beside the ring (:class:`SplitHeadsState`)."""

    describes = "a hybrid (sliding-window + linear) attention layer"
    # Whether a decoding step's token may be padding (the eager path reads the mask; the fast decoder does not).
    real_tokens_only = False

    def get_state(self) -> Any:
        # An empty layer has no state (zeroed buffers are not the empty state of a sparse cache: −inf scores).
        return None if self.state is None or not self.is_initialized else self._ordered(self.state)

    def set_state(self, state: Any, num_new_tokens: int) -> None:
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative integer, got {num_new_tokens!r}")
        seen = self.seen_tokens + num_new_tokens
        self._store(self._buffers(state, seen))
        self.is_initialized = True
        self.seen_tokens = seen

    def buffers(self) -> Any:
        """What the decoding step updates in place (the ring; a retrieval layer's :class:`SplitHeadsState` or
        :class:`SplitHeadsRing`)."""
        return self.state

    def stepped(self, buffers: Any) -> None:
        """Count the token a decoding step just wrote into :meth:`buffers`; ``buffers``: what it holds now (the
        same ring; a retrieval layer's exact heads grow)."""
        self.state = buffers
        self.seen_tokens += 1

    def _store(self, buffers: Any) -> None:
        self.state = buffers

    def _buffers(self, state: Any, seen: int) -> Any:
        if isinstance(state, SplitHeadsState):
            linear = None if state.linear is None else ring_from_state(state.linear, seen)
            return state._replace(linear=linear)
        return ring_from_state(state, seen)

    def _ordered(self, buffers: Any) -> Any:
        if isinstance(buffers, SplitHeadsState):
            return buffers._replace(
                linear=None if buffers.linear is None else state_from_ring(buffers.linear)
            )
        return state_from_ring(buffers)

    def state_bytes(self) -> int:
        """Bytes of the state as the op defines it (:meth:`get_state`, what the conversion report counts): the
        ring's counters are bookkeeping of the eager cache."""
        return sum(t.numel() * t.element_size() for t in state_tensors(self.get_state()))


def _same_kind(old: Any, new: Any) -> bool:
    if type(old) is not type(new):
        return False
    return not isinstance(new, SplitHeadsState | SplitHeadsRing) or type(old.linear) is type(new.linear)


def _ring_seen(ring: Any) -> torch.Tensor:
    return ring.window.seen if isinstance(ring, SparseHybridRingState) else ring.seen


class RingHybridStateCacheLayer(HybridStateCacheLayer):
    """A :class:`HybridStateCacheLayer` for a compiled decoding step (:mod:`headkit.runtime.fast`): one graph, no
    tensor allocated or re-concatenated per token; retrieval heads keep their keys and values in buffers of
    ``capacity`` tokens (:class:`SplitHeadsRing`), and its token count is the buffers' own tensor.

    A prompt (several tokens) runs the ordinary eager path: :meth:`get_state` hands it the ordered state and
    :meth:`set_state` copies the result into the buffers. A step of one token runs the in-place steps on the
    buffers (:meth:`headkit.surgery.linearize.LinearizedHeads.forward`); the fast decoder feeds only real tokens
    there, so no padding mask is read.

    ``mask_length``: the key length it reports to the model's mask builder (``get_mask_sizes``), as transformers'
    ``StaticLayer`` reports its ``max_cache_len``: the static cache's length beside key/value layers, anything
    once the prompt is in when no layer reads a mask. ``capacity``: the tokens the exact heads' buffers hold (the
    static length of the fast decoder's bucket). The token count is a tensor under compilation (as
    ``StaticLayer``'s), so that a compiled step is not specialised on it."""

    is_compileable = True
    real_tokens_only = True

    def __init__(self, mask_length: int = 1, capacity: int = 0) -> None:
        super().__init__()
        self.mask_length, self.capacity = mask_length, capacity

    def stepped(self, buffers: Any) -> None:
        """Nothing: the step wrote the buffers in place, and the count is their ``seen`` (a Python counter would
        specialise a compiled step on it)."""

    def _store(self, buffers: Any) -> None:
        current, new = state_tensors(self.state), state_tensors(buffers)
        if [t.shape for t in current] == [t.shape for t in new] and _same_kind(self.state, buffers):
            # In place: a compiled step holds these buffers.
            for buffer, value in zip(current, new, strict=True):
                buffer.copy_(value)
        else:
            self.state = buffers

    def _buffers(self, state: Any, seen: int) -> Any:
        if not isinstance(state, SplitHeadsState):
            return super()._buffers(state, seen)
        held = state.keys.shape[2]
        if held > self.capacity:
            raise HeadkitError(
                f"the exact heads hold {held} tokens, more than the fixed buffers' capacity of {self.capacity}"
            )

        def buffer(x: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(x.shape)
            shape[dim] = self.capacity
            room = x.new_zeros(shape)
            room.narrow(dim, 0, held).copy_(x)
            return room

        linear = None if state.linear is None else ring_from_state(state.linear, seen)
        seen_tensor = torch.tensor(held, dtype=torch.int64, device=state.keys.device)
        return SplitHeadsRing(
            linear, buffer(state.keys, 2), buffer(state.values, 2), buffer(state.keep, 1), seen_tensor
        )

    def _ordered(self, buffers: Any) -> Any:
        if not isinstance(buffers, SplitHeadsRing):
            return super()._ordered(buffers)
        held = int(buffers.seen)
        return SplitHeadsState(
            None if buffers.linear is None else state_from_ring(buffers.linear),
            buffers.keys[:, :, :held].clone(),
            buffers.values[:, :, :held].clone(),
            buffers.keep[:, :held].clone(),
        )

    state_bytes = StateCacheLayer.state_bytes  # the buffers as allocated: the exact heads' whole capacity

    def reset(self) -> None:
        # In place: the buffers keep their addresses, which compiled steps hold.
        if self.state is not None:
            for buffer in state_tensors(self.state):
                buffer.zero_()
        self.is_initialized = False
        self.seen_tokens = 0

    def get_seq_length(self) -> Any:
        if self.state is None:
            return 0
        if torch.compiler.is_compiling():
            return _ring_seen(self.state)
        return int(_ring_seen(self.state))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.mask_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise HeadkitError("the fast decoder's fixed-size hybrid state decodes greedily: no beam search")

    batch_select_indices = batch_repeat_interleave = reorder_cache


class HybridHeads(nn.Module):
    """Sliding-window softmax + linear attention over given queries, keys and values (LoLCATs; Zhang et al. 2024,
    arXiv:2410.10254): its parameters and its forms, whoever projects and rotates the inputs.

    :meth:`build_hybrid_heads` adds the parameters — ``feature_map_q`` (one map per query head), ``feature_map_k``
    (one per key/value head) and the per-head balance γ_h = exp(``log_balance``) — under these names in the module
    that is the mechanism (a :class:`HybridAttention` layer, a linearized layer's mechanism), so checkpoints of
    either keep their keys. ``fold=False`` builds no feature maps and fixes γ = 0: nothing leaves the window for
    a linear state (the compressed-cache baseline of a linearized model).
    """

    def build_hybrid_heads(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        chunk_size: int,
        scale: float,
        feature_map: str,
        feature_dim: int | None,
        fold: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.window, self.chunk_size, self.scale, self.fold = window, chunk_size, scale, fold
        # Rotary pairs the feature maps read rotated back to angle 0 (None: every pair as rotated; see features).
        self.register_buffer("unrotated_pairs", None, persistent=False)
        self.feature_map_q: nn.Module | None = None
        self.feature_map_k: nn.Module | None = None
        if fold:
            self.feature_map_q = build_feature_map(feature_map, num_heads, head_dim, feature_dim).to(
                dtype=dtype, device=device
            )
            self.feature_map_k = build_feature_map(feature_map, num_kv_heads, head_dim, feature_dim).to(
                dtype=dtype, device=device
            )
        # γ_h = exp(log_balance_h) = 1 at first: window and linear terms on an equal footing (LoLCATs starts from
        # a comparable 2); positive, so the shared normaliser stays positive for non-negative features.
        self.log_balance = nn.Parameter(
            torch.zeros(num_heads, dtype=dtype, device=device), requires_grad=fold
        )

    @property
    def balance(self) -> torch.Tensor:
        """γ_h per query head, [num_heads] (zeros when nothing folds)."""
        balance = self.log_balance.exp()
        return balance if self.fold else torch.zeros_like(balance)

    def features(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """φ(q), φ(k) of the linear term; one zero feature when nothing folds (γ = 0 makes it unused).

        With ``unrotated_pairs`` set, the maps read the queries and keys with those rotary pairs rotated back to
        angle 0 by ``rotary`` (the attention module's own cos and sin): the slow pairs, whose angles a model
        trained on short windows never saw beyond its training length (:class:`headkit.surgery.LinearizeConfig`'s
        ``feature_wavelength``). The window term keeps every rotation."""
        if self.fold:
            if self.unrotated_pairs is not None:
                if rotary is None:
                    raise HeadkitError(
                        "this hybrid layer's feature maps read some rotary pairs rotated back, which needs the "
                        "attention module's cos and sin (rebuild the model with headkit.from_pretrained)"
                    )
                queries = unrotate_pairs(queries, *rotary, self.unrotated_pairs)
                keys = unrotate_pairs(keys, *rotary, self.unrotated_pairs)
            return self.feature_map_q(queries), self.feature_map_k(keys)
        return queries.new_zeros(*queries.shape[:3], 1), keys.new_zeros(*keys.shape[:3], 1)

    @staticmethod
    def cached_state(entry: HybridStateCacheLayer | None, seq: int) -> tuple[Any, bool]:
        """(the state these ``seq`` tokens continue, whether they are a decoding step) of a cache entry: one token
        after the first takes the step on the entry's buffers (:meth:`HybridStateCacheLayer.buffers`), anything
        else the parallel form from the ordered state (None without a cache or before the first token)."""
        if entry is None:
            return None, False
        if seq == 1 and entry.is_initialized:
            return entry.buffers(), True
        return entry.get_state(), False

    @staticmethod
    def keep_state(entry: HybridStateCacheLayer | None, state: Any, seq: int, stepping: bool) -> None:
        """Keep the state after this call in the cache entry (if any): the buffers a step wrote, or the parallel
        form's ordered state."""
        if entry is None:
            return
        if stepping:
            entry.stepped(state)
        else:
            entry.set_state(state, seq)

    def hybrid_heads(
        self,
        tensors: tuple[torch.Tensor, ...],
        state: Any,
        *,
        cached: bool,
        stepping: bool = False,
        parallel: Callable[..., tuple[torch.Tensor, Any]] = hybrid_attention,
        decode: Callable[..., torch.Tensor] = hybrid_attention_step_,
        **options: Any,
    ) -> tuple[torch.Tensor, Any]:
        """(per-head outputs, the state after these tokens, None without a cache) of ``tensors`` = (queries, keys,
        values, φ(q), φ(k), γ): a decoding step (``stepping``, :meth:`cached_state`) runs the op's one step on
        the buffers ``state``, in place, and returns them; anything else the chunkwise parallel form, continuing
        the ordered ``state``. ``parallel``/``decode`` and ``options`` (window, mask, scale, …) are the op's: the
        plain hybrid, or :mod:`headkit.ops.hybrid.sparse` with its sinks and budget."""
        if stepping:
            return decode(*tensors, state, **options), state
        if not cached and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            # A training forward: the window's block scores and weights are recomputed in the backward instead of
            # kept ([chunks, heads, C, C + W − 1] twice a layer: 1 GiB over SmolLM2's 30 layers at 1,024 tokens).
            def outputs(*inputs: torch.Tensor) -> torch.Tensor:
                return parallel(*inputs, chunk_size=self.chunk_size, initial_state=state, **options)[0]

            return torch.utils.checkpoint.checkpoint(outputs, *tensors, use_reentrant=False), None
        return parallel(
            *tensors, chunk_size=self.chunk_size, initial_state=state, output_final_state=cached, **options
        )


@register_attention("hybrid", rotary=True, compared=False)
class HybridAttention(HeadkitAttention, HybridHeads):
    """Sliding-window softmax + linear attention with learnable feature maps (``attention="hybrid"``).

    Uses the config's ``hybrid_window`` (W, tokens seen exactly, the query's own included),
    ``hybrid_feature_map`` (a learnable map such as "hedgehog", or a parameter-free one such as "elu"),
    ``hybrid_feature_dim`` (the learnable map's projection width; None = head_dim), ``chunk_size`` (queries per
    chunk of the parallel form), ``attention_bias`` and, when ``position_embedding_type == "rope"``, the rotary
    settings. Causal only. ``output_attentions`` gives None and ``attention_dropout`` is not applied: the weights
    are never materialised as a T × T matrix.
    """

    cache_layer_class = HybridStateCacheLayer

    repr_fields = ("window", "chunk_size")

    def __init__(self, config: Any, layer_idx: int, **head_overrides: int) -> None:
        super().__init__(config, layer_idx, **head_overrides)
        if not self.causal:
            raise ValueError(
                "hybrid attention is causal only (a sliding window over the past plus a linear state of what "
                "left it); set config.causal=True or use another mechanism for a bidirectional model"
            )
        self.add_query_key_value_projections(config.attention_bias)
        self.use_rope = config.position_embedding_type == "rope"
        self.rope_kwargs = config.rope_kwargs() if self.use_rope else {}
        self.build_hybrid_heads(
            num_heads=self.num_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            window=config.hybrid_window,
            chunk_size=config.chunk_size,
            scale=self.head_dim**-0.5,
            feature_map=config.hybrid_feature_map,
            feature_dim=config.hybrid_feature_dim,
        )
        # A standalone layer is usable at once; inside a model, _init_weights initialises again.
        self.init_extra_parameters(config.initializer_range)

    def init_extra_parameters(self, std: float) -> None:
        init.zeros_(self.log_balance)
        self.feature_map_q.reset_parameters()
        self.feature_map_k.reset_parameters()

    def attend(self, hidden_states: torch.Tensor, inputs: LayerInputs) -> tuple[torch.Tensor, None]:
        queries, keys, values = self.project_queries_keys_values(hidden_states)
        if self.use_rope:
            # Rotate before the state: stored window keys keep the rotation of their own positions.
            cos, sin = rotary_cos_sin(inputs.positions, self.head_dim, **self.rope_kwargs, validate=False)
            queries = apply_rotary(queries, cos, sin, validate=False)
            keys = apply_rotary(keys, cos, sin, validate=False)
        entry = self.state_entry(inputs.cache)
        state, stepping = self.cached_state(entry, inputs.seq)
        # The state carries the padding flags of the past tokens: only the new ones are passed.
        head_outputs, state = self.hybrid_heads(
            (queries, keys, values, *self.features(queries, keys), self.balance),
            state,
            cached=entry is not None,
            stepping=stepping,
            window=self.window,
            attention_mask=inputs.new_tokens_mask,
            scale=self.scale,
            validate=False,
        )
        self.keep_state(entry, state, inputs.seq, stepping)
        return self.project_heads(head_outputs), None
