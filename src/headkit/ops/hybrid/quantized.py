"""The hybrid ops' fixed buffers with their exact keys and values stored quantized, per token: the decoding step of a
compressed cache in int8 / int4 on the fast decoder (:class:`headkit.layers.quantized_cache.QuantizedRingHybridStateCacheLayer`).

The quantizer is KIVI's asymmetric round-to-nearest one (Liu et al. 2024, "KIVI", arXiv:2402.02750, Eq. Q), grouped
per token as a compressed cache groups it (:func:`headkit.ops.quantized_cache.quantize_tokens`: slots change one
token at a time, so no group spans tokens). A *stored ring* is the ring of :func:`headkit.ops.hybrid.ring_from_state`
(:class:`~headkit.ops.hybrid.HybridRingState` or :class:`~headkit.ops.hybrid.SparseHybridRingState`) whose exact
fields — the window's keys and values, the sinks', the kept keys' — are
:class:`~headkit.ops.quantized_cache.QuantizedTensor` buffers of the same slots (codes [B, Hkv, N, D · bits / 8],
scale and zero point [B, Hkv, N, D / group_size]); the key features, flags, scores and linear sums stay as they are.

One decoding step on it, inside one compiled graph, with no buffer re-allocated between steps:

1. :func:`dequantized_ring`: the exact fields dequantized into new tensors — the numbers the eager cache
   (:class:`headkit.layers.quantized_cache.QuantizedHybridStateCacheLayer`) hands the same step —, the two
   bookkeeping fields that say which slot a key entered (``sink_keep``, ``sparse_order``) copied, everything else
   the stored tensors themselves. On the fast decoder (``kept_codes``) the kept keys, most of the state, stay
   codes (:class:`~headkit.ops.quantized_attention.CodedSlots`), which the step attends on without writing a float
   copy (:func:`headkit.ops.quantized_attention.quantized_attention_partials`);
2. the op's own in-place step on that (:func:`~headkit.ops.hybrid.hybrid_attention_step_`,
   :func:`~headkit.ops.hybrid.sparse_hybrid_attention_step_`): the new token is attended in full precision, as in
   the eager cache, where it is not stored yet;
3. :func:`store_ring_step_`: the new token quantized into its window slot (:func:`~headkit.ops.quantized_cache.
   store_token_`), and a key that left the window for a sink or a kept slot given its codes there — copied, not
   quantized again (quantizing a dequantized token moves it: the eager cache matches it to its stored codes for the
   same reason) —; then the copied bookkeeping written back.

A window kept in full precision (the ring's keys and values plain tensors, the cache's ``full_precision_window``) is
the step's own: :func:`dequantized_ring` hands it over as stored, the step writes the new token into it in place, and
the key that left it is quantized from its full-precision numbers into the sink or kept slot it entered.

The codes stored are then those the eager cache stores: :func:`naive_store_ring_step_`, the twin, is that cache's rule
written out (every exact token of the step's result quantized with :func:`~headkit.ops.quantized_cache.
naive_quantize_tokens` against the tokens stored before), and the tests compare the two bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from headkit.ops.hybrid.step import HybridRingState, SparseHybridRingState
from headkit.ops.quantized_attention import CodedSlots
from headkit.ops.quantized_cache import (
    QuantizedTensor,
    dequantize_values,
    naive_dequantize_values,
    naive_quantize_tokens,
    quantize_values,
    store_token_,
)

Ring = HybridRingState | SparseHybridRingState


def dequantized_ring(stored: Ring, *, bits: int, group_size: int, kept_codes: bool = False) -> Ring:
    """The ring a decoding step runs on: ``stored``'s exact fields dequantized (new tensors), ``sink_keep`` and
    ``sparse_order`` copied (:func:`store_ring_step_` compares them with the stored ones to find the slots the step
    filled), every other field — a window kept in full precision too — ``stored``'s own tensor, updated in place
    by the step. ``kept_codes``: the kept keys, most of the state, are not dequantized but handed over as
    :class:`~headkit.ops.quantized_attention.CodedSlots` — their codes, which the step attends on
    (:func:`headkit.ops.quantized_attention.quantized_attention_partials`: no float copy of them is written), a
    row for the key that enters a slot, and the slot it enters (recorded by the step), so ``sparse_order`` is not
    copied but updated in place."""

    def numbers(x: QuantizedTensor | torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):  # a window kept in full precision
            return x
        return dequantize_values(x, bits=bits, group_size=group_size)

    window = stored.window if isinstance(stored, SparseHybridRingState) else stored
    window = window._replace(keys=numbers(window.keys), values=numbers(window.values))
    if not isinstance(stored, SparseHybridRingState):
        return window
    if kept_codes:
        heads = stored.sparse_order.shape[:2]
        slot = stored.sparse_order.new_zeros(heads)
        written = stored.sink_keep.new_zeros(heads)
        kept = {
            name: CodedSlots(codes, codes.scale.new_zeros(*heads, width), slot, written)
            for name, codes, width in (
                ("sparse_keys", stored.sparse_keys, window.keys.shape[-1]),
                ("sparse_values", stored.sparse_values, window.values.shape[-1]),
            )
        }
        order = stored.sparse_order  # the step records the slot it fills: the order is updated in place
    else:
        kept = {name: numbers(getattr(stored, name)) for name in ("sparse_keys", "sparse_values")}
        order = stored.sparse_order.clone()
    return stored._replace(
        window=window,
        sink_keys=numbers(stored.sink_keys),
        sink_values=numbers(stored.sink_values),
        sink_keep=stored.sink_keep.clone(),
        sparse_order=order,
        **kept,
    )


def store_ring_step_(stored: Ring, working: Ring, *, bits: int, group_size: int) -> None:
    """Store one decoding step's result: ``working`` (:func:`dequantized_ring` of ``stored``, after the op's step)
    into ``stored``, in place — the new token's codes in its window slot, the codes of the key that left the window
    in the sink or kept slot it entered, the bookkeeping ``working`` copied. O(D) quantization per key/value head,
    whatever the number of slots."""
    options = {"bits": bits, "group_size": group_size}
    sparse = isinstance(stored, SparseHybridRingState)
    window, new_window = (stored.window, working.window) if sparse else (stored, working)
    # a full-precision window: the step wrote it in place; the key that left it is quantized where it enters
    quantized_window = isinstance(window.keys, QuantizedTensor)
    kept = window.keys.codes.shape[2] if quantized_window else 0
    moved = None  # the codes of the key that left the window, as stored, [B, Hkv, 1, ·] (keys, values)
    if kept:
        slot = ((new_window.seen - 1) % kept).view(
            1
        )  # the step wrote the new token where the leaving key was
        moved = tuple(
            QuantizedTensor(*(f.index_select(2, slot) for f in x)) for x in (window.keys, window.values)
        )
        store_token_(window.keys, new_window.keys, slot, **options)
        store_token_(window.values, new_window.values, slot, **options)
    if not sparse:
        return
    batch, kv_heads = stored.sparse_order.shape[:2]
    sinks = stored.sink_keep.shape[1]
    if sinks:
        sink = stored.sink_keep.sum(dim=1).clamp(max=sinks - 1)  # [B]: sinks fill in order
        entered = (
            working.sink_keep.gather(1, sink[:, None])[:, 0]
            & ~stored.sink_keep.gather(1, sink[:, None])[:, 0]
        )
        index = _rows(sink[:, None].expand(batch, kv_heads))
        written = entered[:, None].expand(batch, kv_heads)
        _store_moved_(
            (stored.sink_keys, stored.sink_values), (working.sink_keys, working.sink_values), moved, index, written,
            **options,
        )  # fmt: skip
        stored.sink_keep.copy_(working.sink_keep)
    if stored.sparse_order.shape[2]:
        recorded = working.sparse_keys
        if isinstance(recorded, CodedSlots) and recorded.slot is not None:
            # the step said which slot it filled
            index, written = _rows(recorded.slot), recorded.written
        else:
            # the slot whose order changed: the newcomer's order is above every kept key's
            changed = working.sparse_order != stored.sparse_order
            index, written = _rows(changed.to(torch.int64).argmax(dim=-1)), changed.any(dim=-1)
        _store_moved_(
            (stored.sparse_keys, stored.sparse_values), (working.sparse_keys, working.sparse_values), moved, index,
            written, **options,
        )  # fmt: skip
        if working.sparse_order is not stored.sparse_order:
            stored.sparse_order.copy_(working.sparse_order)


def _store_moved_(
    buffers: tuple[QuantizedTensor, QuantizedTensor],
    written_now: tuple[torch.Tensor, torch.Tensor],
    moved: tuple[QuantizedTensor, QuantizedTensor] | None,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    write: torch.Tensor,
    *,
    bits: int,
    group_size: int,
) -> None:
    """Each head's slot ``index`` of the quantized keys and values ``buffers`` takes, where ``write`` [B, Hkv], the
    moved key's codes; without a quantized window (``moved`` None) the key is quantized here from what the step
    wrote (``written_now``): the new token where there is no window, the key that left a full-precision one."""
    for position, buffer in enumerate(buffers):
        if moved is None:
            written = written_now[position]
            # [B, Hkv, 1, D]: the row the step wrote (slots stored as codes: the row it handed back)
            token = (written.entering if isinstance(written, CodedSlots) else written[index])[:, :, None]
            codes = quantize_values(token, bits=bits, group_size=group_size)
        else:
            codes = moved[position]
        for field, new in zip(buffer, codes, strict=True):
            kept = field[index]
            field[index] = torch.where(write[..., None], new[:, :, 0].to(field.dtype), kept)


def _rows(slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advanced indices (batch, head, slot) that select, per row and head, ``slot`` [B, Hkv] of a buffer
    [B, Hkv, N, X] (an indexed assignment, which a compiled step writes in place: :mod:`headkit.ops.hybrid.step`)."""
    batch, heads = slot.shape
    rows = torch.arange(batch, device=slot.device)[:, None].expand(batch, heads)
    head_index = torch.arange(heads, device=slot.device)[None, :].expand(batch, heads)
    return rows, head_index, slot


# -- the obviously correct twin -----------------------------------------------------------------------------------


def naive_dequantized_ring(stored: Ring, *, bits: int, group_size: int) -> Ring:
    """:func:`dequantized_ring` as the eager cache hands a step its numbers: every exact field — the kept keys'
    too — dequantized channel by channel (:func:`~headkit.ops.quantized_cache.naive_dequantize_values`) into new
    tensors, the step then attending to float numbers only; ``sink_keep`` and ``sparse_order`` copied."""

    def numbers(x: QuantizedTensor | torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x
        return naive_dequantize_values(x, bits=bits, group_size=group_size)

    window = stored.window if isinstance(stored, SparseHybridRingState) else stored
    window = window._replace(keys=numbers(window.keys), values=numbers(window.values))
    if not isinstance(stored, SparseHybridRingState):
        return window
    return stored._replace(
        window=window,
        **{name: numbers(getattr(stored, name)) for name in _KEPT_FIELDS},
        sink_keep=stored.sink_keep.clone(),
        sparse_order=stored.sparse_order.clone(),
    )


def naive_store_ring_step_(stored: Ring, working: Ring, *, bits: int, group_size: int) -> None:
    """:func:`store_ring_step_` by the eager cache's rule (:class:`headkit.layers.quantized_cache.QuantizedHybridStateCacheLayer`):
    every exact token of ``working`` quantized anew (:func:`~headkit.ops.quantized_cache.naive_quantize_tokens`),
    except that a token equal to one stored before, dequantized, takes that token's codes; all fields written.
    ``working``: the step's result on :func:`naive_dequantized_ring` (every field numbers)."""
    pairs = [
        (buffer, new) for buffer, new in _exact_pairs(stored, working) if new.shape[-2]
    ]  # window 1: none
    tables: dict[int, list[QuantizedTensor]] = {}
    for buffer, _ in pairs:  # every stored token of the same width, whichever field it sits in
        tables.setdefault(buffer.codes.shape[-1], []).append(buffer)
    joined = {
        width: QuantizedTensor(*(torch.cat(f, dim=-2) for f in zip(*found, strict=True)))
        for width, found in tables.items()
    }
    numbers = {
        width: naive_dequantize_values(table, bits=bits, group_size=group_size)
        for width, table in joined.items()
    }
    options = {"bits": bits, "group_size": group_size}
    requantized = [
        naive_quantize_tokens(
            new,
            stored=joined[buffer.codes.shape[-1]],
            stored_values=numbers[buffer.codes.shape[-1]],
            **options,
        )
        for buffer, new in pairs
    ]
    for (buffer, _), codes in zip(pairs, requantized, strict=True):
        for field, new in zip(buffer, codes, strict=True):
            field.copy_(new)
    if isinstance(stored, SparseHybridRingState):
        stored.sink_keep.copy_(working.sink_keep)
        stored.sparse_order.copy_(working.sparse_order)


def _exact_pairs(stored: Ring, working: Ring) -> list[tuple[QuantizedTensor, torch.Tensor]]:
    window, new_window = (
        (stored.window, working.window) if isinstance(stored, SparseHybridRingState) else (stored, working)
    )
    pairs: list[tuple[Any, Any]] = []
    # a full-precision window is the step's own, written in place
    if isinstance(window.keys, QuantizedTensor):
        pairs += [(window.keys, new_window.keys), (window.values, new_window.values)]
    if isinstance(stored, SparseHybridRingState):
        pairs += [(getattr(stored, name), getattr(working, name)) for name in _KEPT_FIELDS]
    return pairs


_KEPT_FIELDS = ("sink_keys", "sink_values", "sparse_keys", "sparse_values")


__all__ = ["dequantized_ring", "naive_dequantized_ring", "naive_store_ring_step_", "store_ring_step_"]
