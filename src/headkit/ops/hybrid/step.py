"""The one decoding step of each hybrid op (:mod:`headkit.ops.hybrid`): one new token, in place on fixed-size
buffers, the same step for the eager cache (:class:`headkit.layers.hybrid.HybridStateCacheLayer`) and the compiled
decoder (:mod:`headkit.runtime.fast`).

The state of :func:`~headkit.ops.hybrid.hybrid_attention` (:class:`~headkit.ops.hybrid.HybridAttentionState`) is
the last W − 1 keys, values and key features with their padding flags, plus (S, z) over every earlier key —
fixed-size whatever the context length. The step keeps it as a ring (:class:`HybridRingState`; token p in slot
p mod (W − 1)): the new token takes the oldest key's slot and the oldest key moves into (S, z), so no window is
re-concatenated per token and a compiled step keeps one graph and its buffers' addresses. The sparse variant's
sinks and cache are slots that a key enters in place (:class:`SparseHybridRingState`). :func:`ring_from_state`
and :func:`state_from_ring` convert between the ordered states of the parallel form and these buffers. Decoding
token by token gives the parallel form's outputs and states (tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from headkit.ops._precision import autocast_disabled
from headkit.ops.hybrid.parallel import HybridAttentionState, prepared_hybrid_inputs
from headkit.ops.hybrid.sparse import SparseHybridState, check_key_scores, checked_sparse_inputs
from headkit.ops.quantized_attention import CodedSlots, quantized_attention_partials, quantized_layout
from headkit.ops.quantized_cache import QuantizedTensor, dequantize_values


class HybridRingState(NamedTuple):
    """:class:`HybridAttentionState` as fixed buffers that a decoding step updates in place (no tensor is
    allocated or re-concatenated per token, so a compiled step keeps one graph and its buffers' addresses).

    keys, values, key_features, keep: the last W − 1 tokens as a ring: token p (0-based over the whole sequence)
        sits in slot p mod (W − 1), so the slot the next token writes holds the oldest key, the one that leaves
        the window in that step. Window order does not matter to softmax;
        :func:`headkit.ops.hybrid.state_from_ring` gives back the ordered state.
    kv, k_sum: as in :class:`HybridAttentionState`.
    seen: int64 scalar tensor, the number of tokens the state summarises (a tensor, not an int, so that a
        compiled step reads it without being specialised on it).
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_features: torch.Tensor
    keep: torch.Tensor
    kv: torch.Tensor
    k_sum: torch.Tensor
    seen: torch.Tensor


class SparseHybridRingState(NamedTuple):
    """:class:`SparseHybridState` as fixed buffers that a decoding step updates in place, for a compiled step
    (:mod:`headkit.runtime.fast`): the window as a :class:`~headkit.ops.HybridRingState`; sinks and the sparse
    cache as slots that a key enters where it stays until evicted — no re-gathering of the whole cache per token.

    Fields as :class:`SparseHybridState`'s, except that the sparse slots are in no particular order: a kept
    key's place in the streaming top-G's order (which breaks ties between equal scores: the latest key leaves
    first) is ``sparse_order`` [B, Hkv, G] int64, increasing with the time a key entered the cache.
    """

    window: HybridRingState
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    sink_keep: torch.Tensor
    sparse_keys: torch.Tensor
    sparse_values: torch.Tensor
    sparse_key_features: torch.Tensor
    sparse_keep: torch.Tensor
    sparse_scores: torch.Tensor
    sparse_order: torch.Tensor
    reference_kv: torch.Tensor
    reference_k_sum: torch.Tensor


def ring_from_state(
    state: HybridAttentionState | SparseHybridState, seen: int
) -> HybridRingState | SparseHybridRingState:
    """The fixed buffers of an ordered state (of :func:`headkit.ops.hybrid_attention` or of this op) after
    ``seen`` tokens, for the decoding steps (new tensors; ``state`` is not touched)."""
    if isinstance(state, HybridAttentionState):
        return window_ring(state, seen)
    batch, kv_heads, budget = state.sparse_keep.shape
    order = torch.arange(budget, device=state.sparse_keep.device).expand(batch, kv_heads, budget)
    copied = [tensor.clone() for tensor in state[1:]]
    return SparseHybridRingState(window_ring(state.window, seen), *copied[:8], order.clone(), *copied[8:])


def state_from_ring(
    ring: HybridRingState | SparseHybridRingState,
) -> HybridAttentionState | SparseHybridState:
    """The ordered state the buffers hold (new tensors), the inverse of :func:`ring_from_state`: the window oldest
    first; the sparse slots sorted as the state keeps them, empty slots first, then the kept keys in the order
    they entered."""
    if isinstance(ring, HybridRingState):
        return window_state(ring)
    rank = torch.where(ring.sparse_keep, ring.sparse_order, -1)
    index = torch.sort(rank, dim=2, stable=True).indices

    def ordered(x: torch.Tensor) -> torch.Tensor:
        return x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[3]) if x.dim() == 4 else index)

    return SparseHybridState(
        window_state(ring.window),
        ring.sink_keys.clone(),
        ring.sink_values.clone(),
        ring.sink_keep.clone(),
        *(ordered(x) for x in (ring.sparse_keys, ring.sparse_values, ring.sparse_key_features)),
        ordered(ring.sparse_keep),
        ordered(ring.sparse_scores),
        ring.reference_kv.clone(),
        ring.reference_k_sum.clone(),
    )


def window_ring(state: HybridAttentionState, seen: int) -> HybridRingState:
    """The ring buffers of an ordered window state after ``seen`` tokens (new tensors; ``state`` is not
    touched). The public pair is :func:`headkit.ops.hybrid.ring_from_state` / ``state_from_ring``."""
    kept = state.keys.shape[2]
    shift = seen % kept if kept else 0

    def ring(x: torch.Tensor, dim: int) -> torch.Tensor:
        # Ordered index i holds token seen − kept + i, whose slot is (seen + i) mod kept.
        return torch.roll(x, shifts=shift, dims=dim).contiguous()

    return HybridRingState(
        keys=ring(state.keys, 2),
        values=ring(state.values, 2),
        key_features=ring(state.key_features, 2),
        keep=ring(state.keep, 1),
        kv=state.kv.clone(),
        k_sum=state.k_sum.clone(),
        seen=torch.tensor(seen, dtype=torch.int64, device=state.kv.device),
    )


def window_state(ring: HybridRingState) -> HybridAttentionState:
    """The ordered :class:`HybridAttentionState` (oldest first) the ring buffers hold (new tensors)."""
    kept = ring.keys.shape[2]
    shift = -(int(ring.seen) % kept) if kept else 0
    return HybridAttentionState(
        keys=torch.roll(ring.keys, shifts=shift, dims=2),
        values=torch.roll(ring.values, shifts=shift, dims=2),
        key_features=torch.roll(ring.key_features, shifts=shift, dims=2),
        keep=torch.roll(ring.keep, shifts=shift, dims=1),
        kv=ring.kv.clone(),
        k_sum=ring.k_sum.clone(),
    )


def hybrid_attention_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    balance: torch.Tensor,
    ring: HybridRingState,
    *,
    window: int | None = None,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-6,
    validate: bool = True,
) -> torch.Tensor:
    """The decoding step of :func:`hybrid_attention`: one new token [B, H, 1, ·] (inputs as there), on the ring
    buffers of :func:`headkit.ops.hybrid.ring_from_state`, updated in place; returns out [B, H, 1, Dv].

    The query sees its window — the ring's W − 1 keys and its own — exactly and the sums (S, z) linearly, under
    one normaliser (:mod:`headkit.ops.hybrid`); then the oldest key (in the slot the new token takes) moves into the
    sums, if real. O(W · D + F · Dv) work and no tensor re-concatenated, whatever the context: the same step
    serves the eager cache and a compiled decoder (one graph, buffers at fixed addresses). Decoding token by
    token gives the parallel form's outputs and state (tests). ``attention_mask`` [B, 1]: whether the new token
    is real. ``window``: checked against the ring's when given. ``validate=False`` skips every check, for a
    caller that built the ring itself."""
    if validate:
        check_step_inputs((q, k, v, qf, kf, balance), ring, window, attention_mask, scale, eps)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with autocast_disabled(q.device):
        window, leaving = enter_window_(ring, k, v, kf, attention_mask)
        out = attend_one_token(q, qf, balance, window, ring.kv, ring.k_sum, scale=scale, eps=eps)
        leaving_keep, _, leaving_value, leaving_feature = leaving
        fold_(ring, leaving_feature * leaving_keep[:, None, None], leaving_value)
    return out


def sparse_hybrid_attention_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    balance: torch.Tensor,
    ring: HybridRingState | SparseHybridRingState,
    *,
    sinks: int,
    budget: int,
    window: int | None = None,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-6,
    validate: bool = True,
    key_scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoding step of :func:`sparse_hybrid_attention`: one new token [B, H, 1, ·] (inputs as there) on
    the fixed buffers of :func:`ring_from_state`, updated in place; returns out [B, H, 1, Dv]. With S = G = 0
    this is :func:`headkit.ops.hybrid_attention_step_` (on the buffers' window). ``window``, ``validate`` as
    there.

    The query sees sinks, the sparse cache and its window exactly and the folded sums linearly; then the key
    leaving the window takes the next sink slot, or competes for the cache by its score — LoLA's recall error
    against the reference memory without ``key_scores``; with them, the new key's own score if it leaves at once
    (W = 1), else 0 (given scores: a decoding step asks no question, so its keys fill empty slots only). The
    worst candidate (lowest score; the latest among equal ones) is folded; when it is a kept key, the newcomer is
    written into its slot. O((S + G + W) · D + F · Dv + G) work, whatever the context; decoding token by token
    makes the parallel form's decisions (tests)."""
    if sinks == 0 and budget == 0:
        base = ring.window if isinstance(ring, SparseHybridRingState) else ring
        return hybrid_attention_step_(
            q, k, v, qf, kf, balance, base, window=window, attention_mask=attention_mask, scale=scale, eps=eps,
            validate=validate,
        )  # fmt: skip
    if validate:
        _check_ring(
            q, k, v, qf, kf, balance, ring, window, sinks, budget, attention_mask, scale, eps, key_scores
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    base = ring.window
    kv_heads = k.shape[1]
    with autocast_disabled(q.device):
        window, leaving = enter_window_(base, k, v, kf, attention_mask)
        exact = [
            (ring.sink_keys, ring.sink_values, ring.sink_keep[:, None, None, :]),
            (ring.sparse_keys, ring.sparse_values, ring.sparse_keep[:, :, None, :]),
            *window,
        ]
        out = attend_one_token(q, qf, balance, exact, base.kv, base.k_sum, scale=scale, eps=eps)
        order = base.seen + budget  # above every slot's: the newcomer is the latest candidate
        leaving_keep, leaving_key, value, feature = leaving
        is_sink = torch.zeros_like(leaving_keep)
        if sinks:
            filled = ring.sink_keep.sum(dim=1)  # [B]: sink slots fill in order
            is_sink = leaving_keep & (filled < sinks)
            slot = filled.clamp(max=sinks - 1)[:, None]
            head_slot = slot[:, None].expand(
                -1, kv_heads, -1
            )  # [B, Hkv, 1]: every head's sink, the same slot
            sink_index = _slot_index(head_slot)
            _write_slot_(ring.sink_keys, sink_index, leaving_key, is_sink[:, None])
            _write_slot_(ring.sink_values, sink_index, value, is_sink[:, None])
            rows = torch.arange(slot.shape[0], device=slot.device)
            ring.sink_keep[rows, slot[:, 0]] = ring.sink_keep[rows, slot[:, 0]] | is_sink
        eligible = (leaving_keep & ~is_sink)[:, None].expand(-1, kv_heads)  # [B, Hkv]
        if budget == 0:
            folded, folded_value = feature * eligible[..., None], value
        else:
            if key_scores is None:
                recalled = (feature.unsqueeze(-2) @ ring.reference_kv).squeeze(-2) / (
                    (feature * ring.reference_k_sum).sum(dim=-1, keepdim=True) + eps
                )
                score = (value - recalled).square().sum(dim=-1)
                written = feature * eligible[..., None]
                ring.reference_kv.addcmul_(written.unsqueeze(-1), value.unsqueeze(-2))
                ring.reference_k_sum.add_(written)
            elif base.keys.shape[2] == 0:
                score = key_scores[:, :, 0].to(value.dtype)  # window 1: the leaving key is the new one
            else:
                score = value.new_zeros(
                    value.shape[:2]
                )  # a key of the window scores 0 (:mod:`headkit.ops.hybrid.sparse`)
            score = score.masked_fill(~eligible, float("-inf"))
            # The worst of the kept keys and the newcomer: the lowest score, the latest among equal ones. The
            # newcomer is the latest of all, so it is the worst wherever it ties the lowest; the kept keys are
            # scanned where they are (no [B, Hkv, G + 1] copy of scores and order per step).
            lowest = torch.minimum(ring.sparse_scores.amin(dim=-1), score)  # [B, Hkv]
            kept_worst = torch.where(ring.sparse_scores == lowest[..., None], ring.sparse_order, -1).argmax(
                dim=-1
            )
            enters = score > lowest  # the newcomer takes the worst kept key's slot
            worst = torch.where(enters, kept_worst, budget)
            index = _slot_index(worst.clamp(max=budget - 1)[..., None])  # each head's slot, read and written
            evicted_keep = ring.sparse_keep[index]
            evicted_feature = ring.sparse_key_features[index].to(value.dtype) * evicted_keep[..., None]
            evicted_value = _slot_rows(ring.sparse_values, index, value.shape[-1]).to(value.dtype)
            folded = torch.where(enters[..., None], evicted_feature, feature * eligible[..., None])
            folded_value = torch.where(enters[..., None], evicted_value, value)
            for buffer, new in (
                (ring.sparse_keys, leaving_key),
                (ring.sparse_values, value),
                (ring.sparse_key_features, feature),
                (ring.sparse_keep, eligible),
                (ring.sparse_scores, score),
                (ring.sparse_order, order.expand(*score.shape)),
            ):
                _write_slot_(buffer, index, new, enters)
        fold_(base, folded, folded_value)
    return out


def enter_window_(
    ring: HybridRingState,
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tuple[torch.Tensor, ...]]:
    """Write one token's key, value and key features [B, Hkv, 1, ·] into the ring's oldest slot, in place.

    Returns (the query's window as exact sets for :func:`attend_one_token` — the ring after the write and the
    key that leaves —, the leaving token: keep [B] bool, key [B, Hkv, D], value [B, Hkv, Dv] and key features
    [B, Hkv, F] in the accumulation dtype). The leaving token is read before the write and its copies are what
    the query scores, so the buffers are written before they are read (autograd keeps no overwritten tensor).
    A window of one keeps nothing: the new token leaves at once. ``ring.seen`` and the sums are left to
    :func:`fold_`."""
    dtype, kept = ring.kv.dtype, ring.keys.shape[2]
    keep = torch.ones(k.shape[0], 1, dtype=torch.bool, device=k.device)
    keep = keep if attention_mask is None else attention_mask.to(device=k.device, dtype=torch.bool)
    if kept:
        slot = (ring.seen % kept).view(1)
        key, value, feature = (x.index_select(2, slot) for x in (ring.keys, ring.values, ring.key_features))
        leaving_keep = ring.keep.index_select(1, slot)
        ring.keys.index_copy_(2, slot, k.to(ring.keys.dtype))
        ring.values.index_copy_(2, slot, v.to(ring.values.dtype))
        ring.key_features.index_copy_(2, slot, kf.to(ring.key_features.dtype))
        ring.keep.index_copy_(1, slot, keep)
    else:
        key, value, feature, leaving_keep = k, v, kf, keep
    window = [(ring.keys, ring.values, ring.keep[:, None, None, :])] if kept else []
    window.append((key, value, leaving_keep[:, None, None, :]))
    leaving = (leaving_keep[:, 0], key[:, :, 0], value[:, :, 0].to(dtype), feature[:, :, 0].to(dtype))
    return window, leaving


def fold_(ring: HybridRingState, feature: torch.Tensor, value: torch.Tensor) -> None:
    """Add one key per head to the linear sums, in place: φ(k) [B, Hkv, F] (zeros for none) with its value
    [B, Hkv, Dv]; the ring has then seen one more token. The outer product φ(k)vᵀ is a broadcast multiply: a
    [F, 1] @ [1, Dv] matmul costs more in dispatch."""
    ring.kv.addcmul_(feature.unsqueeze(-1), value.unsqueeze(-2))
    ring.k_sum.add_(feature)
    ring.seen.add_(1)


def attend_one_token(
    q: torch.Tensor,
    qf: torch.Tensor,
    balance: torch.Tensor,
    exact_sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    *,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """One query token [B, H, 1, D] over exact sets (keys [B, Hkv, N, D], values [B, Hkv, N, Dv], visible
    [B, Hkv or 1, 1, N] bool) and the linear sums (kv, k_sum), under one normaliser: out [B, H, 1, Dv] in q's
    dtype, accumulated in kv's. The G query heads of a key/value head are stacked as G rows. The sets are scored
    apart, never concatenated: a fixed-size step reads its buffers where they are (the ring window, sinks, a
    sparse cache). A set whose keys and values are :class:`~headkit.ops.quantized_attention.CodedSlots` (per-token
    codes: a quantized compressed cache's kept keys on the fast decoder) is attended on the codes
    (:func:`headkit.ops.quantized_attention.quantized_attention_partials`) and merged by its partial softmax."""
    batch, q_heads = q.shape[:2]
    dtype = kv.dtype
    kv_heads, head_dim_v = kv.shape[1], kv.shape[3]
    groups = q_heads // kv_heads
    queries = q.reshape(batch, kv_heads, groups, q.shape[3]).to(dtype)
    present = [s for s in exact_sets if not isinstance(s[0], CodedSlots) and s[0].shape[2]]
    scores = [
        (_products(queries, keys) * scale).masked_fill(~visible, float("-inf"))
        for keys, _, visible in present
    ]  # each [B, Hkv, G, N]
    # A set stored as codes is attended on them (no float copy): its own softmax partials, merged below.
    partials = [
        tuple(
            x.to(dtype)
            for x in quantized_attention_partials(
                queries, keys.codes, values.codes, visible[:, :, 0], scale=scale, value_dim=head_dim_v
            )
        )
        for keys, values, visible in exact_sets
        if isinstance(keys, CodedSlots) and keys.codes.codes.shape[2]
    ]
    maxima = [block.amax(dim=-1, keepdim=True) for block in scores] + [partial[0] for partial in partials]
    m = maxima[0]
    for block_max in maxima[1:]:
        m = torch.maximum(m, block_max)
    # No visible key gives max −inf; clamping it to a finite number leaves every weight exp(−inf) = 0.
    m = m.clamp_min(torch.finfo(dtype).min)
    numerator, denominator = 0, 0
    for block, (_, values, _) in zip(scores, present, strict=True):
        weights = torch.exp(block - m)
        numerator = numerator + _weighted_sum(weights, values)
        denominator = denominator + weights.sum(dim=-1, keepdim=True)
    for set_max, set_sum, set_numerator in partials:
        rescale = torch.exp(set_max - m)
        numerator = numerator + rescale * set_numerator
        denominator = denominator + rescale * set_sum
    query_features = qf.reshape(batch, kv_heads, groups, qf.shape[3]).to(dtype)
    gamma = balance.to(dtype).view(1, kv_heads, groups, 1)
    # The linear term's numerator and denominator in one matmul: [S | z] is [B, Hkv, F, Dv + 1].
    linear = query_features @ torch.cat([kv, k_sum.unsqueeze(-1)], dim=-1)
    numerator = torch.addcmul(numerator, gamma, linear[..., :head_dim_v])
    denominator = torch.addcmul(denominator, gamma, linear[..., head_dim_v:])
    return (numerator / (denominator + eps)).view(batch, q_heads, 1, head_dim_v).to(q.dtype)


def _products(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries [B, Hkv, G, D] (the accumulation dtype) against keys [B, Hkv, N, D] as stored: [B, Hkv, G, N].

    Compiled, with keys stored in another dtype (bfloat16 on the fast decoder), a product summed over D that
    reads each key in its own dtype: a matmul first copies every key to the accumulation dtype, which at batch 8
    moves more bytes per step than the quantized kernel reads (2.5x the time of this form at batch 8, measured)."""
    if keys.dtype != queries.dtype and torch.compiler.is_compiling():
        return (queries.unsqueeze(-2) * keys.unsqueeze(-3).to(queries.dtype)).sum(dim=-1)
    return queries @ keys.to(queries.dtype).transpose(-1, -2)


def _weighted_sum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """weights [B, Hkv, G, N] (the accumulation dtype) over values [B, Hkv, N, Dv] as stored: [B, Hkv, G, Dv];
    compiled, the values read in their own dtype (:func:`_products`)."""
    if values.dtype != weights.dtype and torch.compiler.is_compiling():
        return (weights.unsqueeze(-1) * values.unsqueeze(-3).to(weights.dtype)).sum(dim=-2)
    return weights @ values.to(weights.dtype)


def check_step_inputs(
    tensors: tuple[torch.Tensor, ...],
    ring: HybridRingState,
    window: int | None,
    attention_mask: torch.Tensor | None,
    scale: float | None,
    eps: float,
) -> None:
    """The checks of :func:`hybrid_attention` on one token's inputs ``tensors`` = (q, k, v, φ(q), φ(k), γ) and
    on the ring's window fields (named ``state.<field>``)."""
    check_one_token(tensors[0])
    if not isinstance(ring, HybridRingState):
        raise ValueError(f"the state must be a HybridRingState (ring_from_state), got {type(ring).__name__}")
    window = ring.keys.shape[2] + 1 if window is None else window
    prepared_hybrid_inputs(
        *tensors, window, attention_mask, HybridAttentionState(*ring[:6]), "state", scale, eps, True
    )


def check_one_token(q: torch.Tensor) -> None:
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[2] != 1:
        raise ValueError(
            f"a decoding step takes one new token, got {q.shape[2]} (the parallel form takes more)"
        )


def _check_ring(
    q, k, v, qf, kf, balance, ring, window, sinks, budget, attention_mask, scale, eps, key_scores
) -> None:
    """The checks of :func:`checked_sparse_inputs` for one token and the buffers of :func:`ring_from_state`."""
    if not isinstance(ring, SparseHybridRingState):
        raise ValueError(
            f"the state must be a SparseHybridRingState (ring_from_state), got {type(ring).__name__}"
        )
    check_one_token(q)
    fields = {name: getattr(ring, name) for name in SparseHybridState._fields[1:]}
    # kept keys stored as codes are checked as the numbers they hold
    for name, like in (("sparse_keys", k), ("sparse_values", v)):
        if isinstance(fields[name], CodedSlots):
            bits, group_size = quantized_layout(fields[name].codes, like.shape[-1])
            fields[name] = dequantize_values(fields[name].codes, bits=bits, group_size=group_size)
    state = SparseHybridState(HybridAttentionState(*ring.window[:6]), **fields)
    window = ring.window.keys.shape[2] + 1 if window is None else window
    checked_sparse_inputs(
        q, k, v, qf, kf, balance, window, sinks, budget, attention_mask, state, scale, eps, True
    )
    check_key_scores(key_scores, k)


def _slot_index(slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advanced indices (batch, head, slot) [B, Hkv] that select, per row and head, ``slot`` [B, Hkv, 1] of a
    buffer [B, Hkv, N, ...]."""
    batch, heads = slot.shape[:2]
    rows = torch.arange(batch, device=slot.device)[:, None].expand(batch, heads)
    head_index = torch.arange(heads, device=slot.device)[None, :].expand(batch, heads)
    return rows, head_index, slot[..., 0]


def _write_slot_(
    buffer: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    new: torch.Tensor,
    write: torch.Tensor,
) -> None:
    """Write ``new`` [B, Hkv, X] into ``buffer`` [B, Hkv, N, X] at each head's slot (``index``, from
    :func:`_slot_index`) where ``write`` [B, Hkv] (its own content back elsewhere): one row per head, in place. A
    buffer of one value per slot [B, Hkv, N] takes ``new`` [B, Hkv].

    Written as an indexed assignment (``index_put_``), not a ``scatter_``: a compiled step (torch.export and
    inductor) turns the assignment back into an in-place write of the B·Hkv rows, where a scatter becomes a
    copy of the whole buffer plus a copy back into the input every step (docs/decoding.md)."""
    if isinstance(buffer, CodedSlots):  # slots stored as codes: the caller stores the row that enters
        buffer.entering.copy_(torch.where(write[..., None], new.to(buffer.entering.dtype), buffer.entering))
        if buffer.slot is not None:
            buffer.slot.copy_(index[2])
            buffer.written.copy_(write)
        return
    kept = buffer[index]
    mask = write if kept.dim() == 2 else write[..., None]
    buffer[index] = torch.where(mask, new.to(buffer.dtype), kept)


def _slot_rows(
    buffer: torch.Tensor | CodedSlots, index: tuple[torch.Tensor, torch.Tensor, torch.Tensor], width: int
) -> torch.Tensor:
    """Each head's row ``index`` of ``buffer`` [B, Hkv, N, X]: [B, Hkv, X], dequantized where stored as codes."""
    if not isinstance(buffer, CodedSlots):
        return buffer[index]
    bits, group_size = quantized_layout(buffer.codes, width)
    rows = QuantizedTensor(*(field[index] for field in buffer.codes))
    return dequantize_values(rows, bits=bits, group_size=group_size)


__all__ = [
    "HybridRingState",
    "SparseHybridRingState",
    "hybrid_attention_step_",
    "ring_from_state",
    "sparse_hybrid_attention_step_",
    "state_from_ring",
]
