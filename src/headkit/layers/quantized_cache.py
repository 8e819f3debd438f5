"""A key/value cache layer that keeps keys and values quantized (KIVI), behind a full-precision residual.

KIVI (Liu et al. 2024, arXiv:2402.02750, Algorithm 1 and Fig. 3): keys quantized per channel over groups of
``group_size`` tokens, values per token over groups of ``group_size`` channels (:mod:`headkit.ops.quantized_cache`),
and the most recent tokens kept in full precision — a key group can only be quantized once its ``group_size``
tokens are there. :class:`QuantizedKVCacheLayer` is that cache as one entry of a transformers ``Cache``:

* ``update(keys, values)`` — what a stock attention module calls — returns the keys and values attention reads
  now: the quantized part dequantized, then the residual, then the new tokens as they came (in full precision, as
  KIVI's prefill attends in full precision); *then* the new tokens join the residual, and while the residual holds
  at least ``residual + group_size`` tokens its oldest ``group_size`` are quantized (between ``residual`` and
  ``residual + group_size − 1`` stay in full precision). A query so reads quantized keys and values only of tokens
  before it, grouped with tokens before it: the quantization never lets a token see later ones.
* The state is one :class:`QuantizedKVState` — codes, scales and zero points of keys and values, and the residual
  keys and values [B, Hkv, ·, ·] — whose every tensor has the batch first, so that
  :class:`~headkit.layers.cache.StateCacheLayer`'s beam search and batch selection (``reorder_cache``,
  ``batch_select_indices``, ``batch_repeat_interleave``) index the codes themselves, without a dequantize /
  quantize round trip, and :func:`~headkit.surgery.linearize.decoding_state_bytes` counts every byte kept.
* Padding is the model's mask's business, as in transformers' ``DynamicLayer``: padded tokens are stored like the
  others and masked out of attention. A row left-padded by a multiple of ``group_size`` tokens groups its real
  tokens as it would alone (the groups start at the first position), so it decodes as it would alone.
* Like every state, it cannot be cropped (assisted generation); sliding-window layers keep every token and rely on
  their mask (the memory a window would save is not saved).

The layer is created by :meth:`StateCacheLayer.in_cache` in place of the stock entry and told its settings with
:meth:`QuantizedKVCacheLayer.configure` (the surgery's mechanism does both,
:class:`headkit.surgery.quantized_cache.QuantizedKVHeads`).

:class:`QuantizedHybridStateCacheLayer` is the same storage for a compressed cache (a linearized layer's state,
:class:`~headkit.layers.hybrid.HybridStateCacheLayer`: sinks, the window ring, the kept keys, retrieval heads' full
cache): those keys and values held as codes with per-token scales
(:func:`~headkit.ops.quantized_cache.quantize_tokens`), dequantized into the op's state whenever it is read — the
op then attends to them exactly as the unquantized cache would to the dequantized numbers. A token is quantized
when it is stored: at the end of a prompt (or of each chunk of one) and at each decoding step. No full-precision
residual: a token's group is itself, so nothing waits for a group to fill (the step's own new token is attended in
full precision, as it is not stored yet). Unless it is configured with ``full_precision_window``: then the window
ring — the newest W − 1 tokens, KIVI's full-precision residual for a cache whose newest tokens are its window —
stays in full precision, and a token is quantized when it leaves the window for a sink or a kept slot (a retrieval
head's whole cache, which has no window, is quantized when stored). A prompt no longer than the window is then
attended exactly as the unquantized cache attends it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from headkit.errors import HeadkitError
from headkit.layers.cache import StateCacheLayer
from headkit.layers.hybrid import (
    HybridStateCacheLayer,
    RingHybridStateCacheLayer,
    SplitHeadsRing,
    SplitHeadsState,
)
from headkit.ops.hybrid import HybridAttentionState, HybridRingState
from headkit.ops.hybrid.quantized import dequantized_ring, store_ring_step_
from headkit.ops.quantized_attention import CodedSlots
from headkit.ops.quantized_cache import (
    QuantizedTensor,
    append_quantized,
    dequantize_keys,
    dequantize_values,
    empty_quantized,
    quantize_keys,
    quantize_tokens,
    quantize_values,
    store_token_,
    tokens_to_quantize,
)


class QuantizedKVState(NamedTuple):
    """A quantized key/value cache: keys [B, Hkv, Tq, ·] quantized per channel, values quantized per token (both
    :class:`~headkit.ops.quantized_cache.QuantizedTensor`), then the full-precision residual keys and values
    [B, Hkv, Tr, D] of the newest Tr tokens."""

    keys: QuantizedTensor
    values: QuantizedTensor
    residual_keys: torch.Tensor
    residual_values: torch.Tensor


class QuantizedKVCacheLayer(StateCacheLayer):
    """The entry of a layer whose keys and values are kept quantized (module docstring)."""

    describes = "a layer with a quantized key/value cache"

    def __init__(self) -> None:
        super().__init__()
        self.bits: int | None = None
        self.group_size: int | None = None
        self.residual: int | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(seen_tokens={self.seen_tokens}, bits={self.bits}, "
            f"group_size={self.group_size}, residual={self.residual})"
        )

    def configure(self, *, bits: int, group_size: int, residual: int) -> QuantizedKVCacheLayer:
        """Set the quantization (once: a layer holding tokens keeps the settings it stored them with)."""
        settings = (bits, group_size, residual)
        if self.bits is None:
            self.bits, self.group_size, self.residual = settings
        elif (self.bits, self.group_size, self.residual) != settings:
            raise HeadkitError(
                f"this cache layer quantizes with bits={self.bits}, group_size={self.group_size}, "
                f"residual={self.residual}; it cannot switch to {settings} (start from an empty cache)"
            )
        return self

    def _empty(self, keys: torch.Tensor, values: torch.Tensor) -> QuantizedKVState:
        options = {"bits": self.bits, "group_size": self.group_size}
        return QuantizedKVState(
            empty_quantized(keys, per_channel=True, **options),
            empty_quantized(values, per_channel=False, **options),
            keys.new_empty(*keys.shape[:-2], 0, keys.shape[-1]),
            values.new_empty(*values.shape[:-2], 0, values.shape[-1]),
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, S, D] for attention over every token so far (the quantized ones dequantized,
        the residual and the `key_states` / `value_states` [B, Hkv, T, D] given as they are); then store the new
        tokens, quantizing whole groups of the oldest residual tokens."""
        if self.bits is None:
            raise HeadkitError(
                "a quantized key/value cache layer needs its settings (QuantizedKVCacheLayer.configure) first"
            )
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise HeadkitError(
                f"a quantized key/value cache stores keys and values [batch, heads, tokens, head_dim], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        state = self.state if self.state is not None else self._empty(key_states, value_states)
        options = {"bits": self.bits, "group_size": self.group_size}
        past_keys = dequantize_keys(state.keys, dtype=key_states.dtype, **options)
        past_values = dequantize_values(state.values, dtype=value_states.dtype, **options)
        keys = torch.cat((past_keys, state.residual_keys, key_states), dim=-2)
        values = torch.cat((past_values, state.residual_values, value_states), dim=-2)

        residual_keys = torch.cat((state.residual_keys, key_states), dim=-2)
        residual_values = torch.cat((state.residual_values, value_states), dim=-2)
        count = tokens_to_quantize(
            residual_keys.shape[-2], group_size=self.group_size, residual=self.residual
        )
        quantized_keys, quantized_values = state.keys, state.values
        if count:
            quantized_keys = append_quantized(
                quantized_keys, quantize_keys(residual_keys[..., :count, :], **options)
            )
            quantized_values = append_quantized(
                quantized_values, quantize_values(residual_values[..., :count, :], **options)
            )
            # copies: a view would keep the whole concatenation alive
            residual_keys = residual_keys[..., count:, :].clone()
            residual_values = residual_values[..., count:, :].clone()
        new_state = QuantizedKVState(quantized_keys, quantized_values, residual_keys, residual_values)
        self.set_state(new_state, key_states.shape[-2])
        return keys, values

    @property
    def quantized_tokens(self) -> int:
        """Tokens kept quantized (the others are the residual)."""
        return 0 if self.state is None else self.state.keys.codes.shape[-2]


# The fields of the hybrid ops' states (and of a retrieval layer's split state) that hold exact keys and values
# [B, H, slots, D]: the window ring's, the sinks', the kept keys', the exact heads' full cache. Key features, flags,
# scores and linear sums are the op's bookkeeping and stay as they are.
EXACT_FIELDS = frozenset({"keys", "values", "sink_keys", "sink_values", "sparse_keys", "sparse_values"})
# The states whose keys and values are a window's (the newest W − 1 tokens), as a prompt's result or as a ring.
WINDOW_STATES = (HybridAttentionState, HybridRingState)


def exact_leaves(
    state: Any, path: tuple[str, ...] = (), *, window: bool = True
) -> list[tuple[tuple[str, ...], Any]]:
    """(path, leaf) of every exact field of a (nested) state: a tensor, or a QuantizedTensor where stored.
    ``window`` False: the window's keys and values left out (a cache that keeps them in full precision)."""
    if state is None or isinstance(state, torch.Tensor | QuantizedTensor):
        return []
    leaves = []
    in_window = isinstance(state, WINDOW_STATES)
    for name, value in zip(state._fields, state, strict=True):
        if name in EXACT_FIELDS and isinstance(value, torch.Tensor | QuantizedTensor):
            if window or not in_window:
                leaves.append(((*path, name), value))
        elif hasattr(value, "_fields"):
            leaves += exact_leaves(value, (*path, name), window=window)
    return leaves


def _replaced(state: Any, leaves: dict[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> Any:
    """`state` with the exact fields at the paths of `leaves` replaced by them."""
    if state is None or not hasattr(state, "_fields") or isinstance(state, QuantizedTensor):
        return state
    changes = {}
    for name, value in zip(state._fields, state, strict=True):
        here = (*path, name)
        if here in leaves:
            changes[name] = leaves[here]
        elif hasattr(value, "_fields"):
            changes[name] = _replaced(value, leaves, here)
    return state._replace(**changes)


class QuantizedHybridStateCacheLayer(HybridStateCacheLayer):
    """A compressed cache's entry whose exact keys and values are stored quantized, per token (module docstring).

    It holds what :class:`~headkit.layers.hybrid.HybridStateCacheLayer` holds — the op's buffers, the window as a
    ring — with every exact field (:data:`EXACT_FIELDS`) a :class:`~headkit.ops.quantized_cache.QuantizedTensor`
    (codes [B, H, slots, D · bits / 8], scale and zero point [B, H, slots, D / group_size], batch first, so beam
    search reorders the codes themselves) — but the window's keys and values where ``full_precision_window`` is set
    (module docstring). Every read — :meth:`get_state` for a prompt, :meth:`buffers` for a
    decoding step — dequantizes into a fresh full-precision state; every write — :meth:`set_state`,
    :meth:`stepped` — quantizes, a token already stored keeping its codes
    (:func:`~headkit.ops.quantized_cache.quantize_tokens`). The eager cache; the fast decoder's is
    :class:`QuantizedRingHybridStateCacheLayer`."""

    describes = "a compressed-cache layer with quantized keys and values"
    # Whether a decoding step attends the kept keys on their codes (the fast decoder's) or on the dequantized numbers
    # (this eager cache's: the compressed cache's own step on them, bit for bit).
    attends_on_codes = False

    def __init__(self) -> None:
        super().__init__()
        self.bits: int | None = None
        self.group_size: int | None = None
        self.full_precision_window = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(seen_tokens={self.seen_tokens}, bits={self.bits}, group_size={self.group_size}, "
            f"full_precision_window={self.full_precision_window})"
        )

    def configure(
        self, *, bits: int, group_size: int, full_precision_window: bool = False
    ) -> QuantizedHybridStateCacheLayer:
        """Set the quantization (once: a layer holding tokens keeps the settings it stored them with)."""
        settings = (bits, group_size, full_precision_window)
        if self.bits is None:
            self.bits, self.group_size, self.full_precision_window = settings
        elif (self.bits, self.group_size, self.full_precision_window) != settings:
            raise HeadkitError(
                f"this cache layer quantizes with bits={self.bits}, group_size={self.group_size}, "
                f"full_precision_window={self.full_precision_window}; it cannot switch to bits={bits}, "
                f"group_size={group_size}, full_precision_window={full_precision_window} (start from an empty "
                "cache)"
            )
        return self

    def quantized_fields(self, state: Any) -> list[tuple[tuple[str, ...], Any]]:
        """The fields this layer stores quantized: every exact field, the window's unless kept in full precision."""
        return exact_leaves(state, window=not self.full_precision_window)

    def get_state(self) -> Any:
        if self.state is None or not self.is_initialized:
            return None
        return self._ordered(self.dequantized())

    def buffers(self) -> Any:
        """What a decoding step runs on: the ring with its exact sets dequantized — but the kept keys' codes where
        the layer :attr:`attends_on_codes` — (:func:`~headkit.ops.hybrid.quantized.dequantized_ring`), and a
        retrieval layer's exact heads' keys and values dequantized; :meth:`stepped` stores back only what the step
        wrote."""
        options = {"bits": self.bits, "group_size": self.group_size, "kept_codes": self.attends_on_codes}
        state = self.state
        if not isinstance(state, SplitHeadsState | SplitHeadsRing):
            return dequantized_ring(state, **options)
        return state._replace(
            linear=None if state.linear is None else dequantized_ring(state.linear, **options),
            **{name: self._exact_heads(getattr(state, name)) for name in ("keys", "values")},
        )

    def _exact_heads(self, stored: QuantizedTensor) -> torch.Tensor | CodedSlots:
        """A retrieval layer's exact heads' keys or values for a step: dequantized, or (the fast decoder's buffers,
        :attr:`attends_on_codes`) their codes with a row for the new token."""
        if self.attends_on_codes and isinstance(self.state, SplitHeadsRing):
            width = stored.codes.shape[-1] * 8 // self.bits
            return CodedSlots(stored, stored.scale.new_zeros(*stored.scale.shape[:2], width))
        return dequantize_values(stored, bits=self.bits, group_size=self.group_size)

    def stepped(self, buffers: Any) -> None:
        """Store one decoding step: the new token quantized into its window slot, a key that left the window
        keeping its codes (:func:`~headkit.ops.hybrid.quantized.store_ring_step_`), and the exact heads' new token
        quantized and appended. O(D) quantization per head, whatever the context: the same codes as quantizing the
        whole state again with :func:`~headkit.ops.quantized_cache.quantize_tokens` (the fast decoder's rule,
        tested bit for bit against that one), without its O(context) matching of every stored token."""
        options = {"bits": self.bits, "group_size": self.group_size}
        state = self.state
        if not isinstance(state, SplitHeadsState):
            store_ring_step_(state, buffers, **options)
        else:
            if state.linear is not None:
                store_ring_step_(state.linear, buffers.linear, **options)
            grown = [
                append_quantized(stored, quantize_values(new[:, :, -1:], **options))
                for stored, new in ((state.keys, buffers.keys), (state.values, buffers.values))
            ]
            self.state = state._replace(keys=grown[0], values=grown[1], keep=buffers.keep)
        self.seen_tokens += 1

    def _store(self, buffers: Any) -> None:
        self.state = self._quantized(buffers)

    def _quantized(self, buffers: Any) -> Any:
        """``buffers`` with every exact field quantized, a token equal to one stored taking its codes."""
        if self.bits is None:
            raise HeadkitError(
                "a quantized compressed-cache layer needs its settings (QuantizedHybridStateCacheLayer.configure) "
                "first"
            )
        options = {"bits": self.bits, "group_size": self.group_size}
        # Every stored token of the same rows, whichever field it sits in (a window key becomes a sink): one table
        # per shape of rows.
        tables: dict[tuple[Any, ...], list[tuple[QuantizedTensor, torch.Tensor]]] = {}
        for _, leaf in (
            self.quantized_fields(self.state) if self.state is not None and self.is_initialized else []
        ):
            values = self._dequantize(leaf)
            tables.setdefault((*values.shape[:-2], values.shape[-1], values.dtype), []).append((leaf, values))
        joined = {
            key: (
                QuantizedTensor(
                    *(torch.cat(f, dim=-2) for f in zip(*(leaf for leaf, _ in found), strict=True))
                ),
                torch.cat([values for _, values in found], dim=-2),
            )
            for key, found in tables.items()
        }
        leaves = {}
        for path, tensor in self.quantized_fields(buffers):
            table, values = joined.get((*tensor.shape[:-2], tensor.shape[-1], tensor.dtype), (None, None))
            leaves[path] = quantize_tokens(tensor, stored=table, stored_values=values, **options)
        return _replaced(buffers, leaves)

    def _dequantize(self, leaf: QuantizedTensor) -> torch.Tensor:
        return dequantize_values(leaf, bits=self.bits, group_size=self.group_size)

    def dequantized(self) -> Any:
        """The buffers with every exact field dequantized (new tensors where quantized, the stored ones else)."""
        leaves = {path: self._dequantize(leaf) for path, leaf in self.quantized_fields(self.state)}
        return _replaced(self.state, leaves)

    def quantized_bytes(self) -> int:
        """Bytes of the quantized keys and values: codes, scales and zero points (what
        :meth:`headkit.surgery.quantized_cache.QuantizedKVConfig.bytes_per_token` counts)."""
        return sum(
            t.numel() * t.element_size() for _, leaf in self.quantized_fields(self.state) for t in leaf
        )

    def state_bytes(self) -> int:
        """Bytes of the state as the op defines it (:meth:`HybridStateCacheLayer.state_bytes`), its exact keys and
        values counted as stored: quantized."""
        if self.state is None or not self.is_initialized:
            return 0
        full = sum(t.numel() * t.element_size() for _, t in self.quantized_fields(self.dequantized()))
        return super().state_bytes() - full + self.quantized_bytes()


class QuantizedRingHybridStateCacheLayer(QuantizedHybridStateCacheLayer, RingHybridStateCacheLayer):
    """The fast decoder's entry of a compressed cache whose exact keys and values are stored quantized
    (:mod:`headkit.runtime.fast`): what :class:`QuantizedHybridStateCacheLayer` stores, in the fixed buffers of a
    :class:`~headkit.layers.hybrid.RingHybridStateCacheLayer` — codes, scales and zero points of every slot,
    allocated once, the retrieval heads' for ``capacity`` tokens, the token count a tensor.

    A prompt runs the eager path and its state is quantized as the eager cache quantizes it, then copied into the
    buffers. A step of one token, inside the compiled graph: the window and sinks dequantized for the op's in-place
    step, the kept keys and a retrieval head's whole buffer attended on their codes
    (:func:`headkit.ops.hybrid.quantized.dequantized_ring`, :func:`headkit.ops.softmax.softmax_attention_coded_step_`),
    then only what the step
    wrote stored back — the new token quantized into its slot, a key that left the window copied with its codes
    (:func:`headkit.ops.hybrid.quantized.store_ring_step_`, :func:`headkit.ops.quantized_cache.store_token_`) —, so
    the codes are those the eager cache stores for the same tokens (tests)."""

    describes = "a fast decoder's compressed-cache layer with quantized keys and values"
    attends_on_codes = True

    def __init__(self, mask_length: int = 1, capacity: int = 0) -> None:
        super().__init__()
        self.mask_length, self.capacity = mask_length, capacity

    def stepped(self, buffers: Any) -> None:
        """Store what the step wrote into :meth:`buffers`' result, in place (the count is the buffers' ``seen``)."""
        options = {"bits": self.bits, "group_size": self.group_size}
        state = self.state
        if not isinstance(state, SplitHeadsRing):
            store_ring_step_(state, buffers, **options)
            return
        slot = state.seen - 1  # the exact heads' step wrote the token at the old count, then advanced it
        for stored, written in ((state.keys, buffers.keys), (state.values, buffers.values)):
            # codes attended as they are: the step handed the new token back (its row 0 stored at the slot)
            token, at = (
                (written.entering[:, :, None], slot.new_zeros(()))
                if isinstance(written, CodedSlots)
                else (written, slot)
            )
            store_token_(stored, token, at, into=slot, **options)
        if state.linear is not None:
            store_ring_step_(state.linear, buffers.linear, **options)

    def _store(self, buffers: Any) -> None:
        RingHybridStateCacheLayer._store(self, self._quantized(buffers))

    state_bytes = StateCacheLayer.state_bytes  # the buffers as allocated: codes, scales and zero points


__all__ = [
    "EXACT_FIELDS",
    "QuantizedHybridStateCacheLayer",
    "QuantizedRingHybridStateCacheLayer",
    "exact_leaves",
    "QuantizedKVCacheLayer",
    "QuantizedKVState",
]
