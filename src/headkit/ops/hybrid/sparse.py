"""Hybrid attention that keeps exact what the linear term cannot approximate: attention sinks and a sparse cache.

The hybrid of :mod:`headkit.ops.hybrid` (LoLCATs, Zhang et al. 2024, arXiv:2410.10254) sees the last W keys
exactly and every older key through linear attention; a fact stated once, far back, is folded into the linear
state and retrieval beyond the window collapses (0.6% passkey at 4K for LoLCATs models, McDermott et al. 2025,
"LoLA: Low-Rank Linear Attention With Sparse Caching", arXiv:2505.23666). This op keeps three exact sets besides
the window, all under the one normaliser of the hybrid (module docstring of :mod:`headkit.ops.hybrid`):

* **sinks** (Xiao et al. 2023, "StreamingLLM", arXiv:2309.17453): the first S real tokens stay exact forever;
* **a sparse global cache** (LoLA): a fixed budget of G exact key/value pairs per key/value head, chosen online
  as tokens leave the window, by how badly the linear memory represents them;
* every other key that has left the window is folded into the linear state (S, z), as before.

For query i, with E_i the exact set (window (i − W, i], sinks, the sparse cache after the decisions made before
query i) and L_i the folded keys:

    a_ij = exp(s_ij − m_i)          for j ∈ E_i          (m_i = max of the real scores over E_i)
    a_ij = γ_h · φ(q_i)ᵀ φ(k_j)     for j ∈ L_i
    y_i  = Σ_j a_ij v_j / (Σ_j a_ij + eps)

With S = G = 0, E_i is the window and this is :func:`headkit.ops.hybrid_attention` exactly (that op's chunked form
is called).

**The selection.** Key j leaves the window after query j + W − 1 (its *event*). A real key among the first S
real tokens becomes a sink. Any other real key gets the LoLA score — the squared error of the linear memory at
recalling its value (LoLA's "self-recall error", eq. 6):

    e_j = ‖v_j − Mᵀφ(k_j) / (zᵀφ(k_j) + eps)‖²,   M = Σ φ(k_u) v_uᵀ, z = Σ φ(k_u) over the non-sink real keys u
                                                 that left the window before j

The memory (M, z) it is measured against is the *reference memory*: what the linear state would hold with no
sparse cache (folded keys and cached keys alike). Scores are then fixed once computed, and the cache after each
event is exactly the G best-scored keys that have left the window so far (a streaming top-G: a newcomer enters
when it beats the worst kept key, which is evicted and folded into the linear state; otherwise the newcomer is
folded). Ties go to the earlier key. This is LoLA's criterion with one change: LoLA re-scores the kept keys against
the current, cache-less state at every step, which makes each decision depend on all earlier ones; against the
reference memory the decisions are a function of the scores alone, so a long prefill finds every decision in
parallel (a count of better-scored keys, scanned chunk by chunk, :func:`_fold_events`) and reproduces
token-by-token decoding exactly.

**Given scores** (``key_scores``): the caller scores the keys instead — SnapKV's question-chosen keys
(:mod:`headkit.ops.key_selection`): the prompt's last queries say which keys they attend to. A key's score is
fixed when it arrives, in the call that brings it (a later call's keys scored beside the keys the state holds, so
that every call's scores are the attention weights of its last queries over all they see: one scale); a key that
arrived in an earlier call and is still in the window when this call starts scores 0 (the caller scored it with
the queries of its own call, or not at all),
so a decoding step passing zeros fills empty slots only and folds its keys otherwise: the question's choice
stays. The same streaming top-G then decides, and no reference memory is kept.

At each event at most one key is folded (the newcomer or the evicted key), so the linear term is causal linear
attention over a *fold sequence* — one gathered key per event — with the hybrid's shifted visibility (event e is
seen by the queries after it). The exact extras are gathered per chunk of C queries: at most S + G + C keys are
exact beyond the window for some query of a chunk (the S + G at its start, plus one newcomer per event).

State (:class:`SparseHybridState`): the hybrid's state (window W − 1, folded sums), S sink slots, G cache slots
(keys, values, key features and scores; empty slots first, then the kept keys in the order they left the window)
and the reference memory: fixed-size whatever the context.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from headkit.ops._precision import autocast_disabled
from headkit.ops._validation import (
    check_positive_int,
)
from headkit.ops.hybrid.parallel import (
    ChunkGrid,
    HybridAttentionState,
    accumulation_dtype,
    chunk_grid,
    chunked_queries,
    empty_hybrid_state,
    exclusive_cumsum,
    extended_inputs,
    hybrid_chunked,
    prepared_hybrid_inputs,
    window_block_scores,
    window_state_after,
)


class SparseHybridState(NamedTuple):
    """Decoding state of :func:`sparse_hybrid_attention`, fixed-size; every tensor has the batch as dim 0.

    window: the :class:`~headkit.ops.HybridAttentionState` of the window (the last W − 1 keys, values, key
        features, padding flags) and the folded linear sums (kv, k_sum).
    sink_keys, sink_values: [B, Hkv, S, D] / [B, Hkv, S, Dv], the first S real keys once they left the window
        (zeros in unfilled slots), in the inputs' dtypes. sink_keep: [B, S] bool, slots filled in order.
    sparse_keys, sparse_values, sparse_key_features: [B, Hkv, G, ·], the kept keys: empty slots first, then the
        kept keys oldest first (zeros in empty slots). sparse_keep: [B, Hkv, G] bool. sparse_scores: [B, Hkv, G]
        float32 (float64 for float64 inputs), their scores (−inf in empty slots).
    reference_kv, reference_k_sum: [B, Hkv, F, Dv] / [B, Hkv, F], the reference memory Σ φ(k) vᵀ, Σ φ(k) over
        every non-sink real key that left the window (zeros when G = 0: no score is needed).
    """

    window: HybridAttentionState
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    sink_keep: torch.Tensor
    sparse_keys: torch.Tensor
    sparse_values: torch.Tensor
    sparse_key_features: torch.Tensor
    sparse_keep: torch.Tensor
    sparse_scores: torch.Tensor
    reference_kv: torch.Tensor
    reference_k_sum: torch.Tensor


def sparse_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    balance: torch.Tensor,
    *,
    window: int,
    sinks: int,
    budget: int,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: SparseHybridState | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    validate: bool = True,
    key_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SparseHybridState | None]:
    """Causal hybrid attention with S sinks and a sparse exact cache of G keys per key/value head (module
    docstring), chunkwise-parallel; decisions reproduce token-by-token decoding.

    Arguments as :func:`headkit.ops.hybrid_attention`, plus ``sinks`` (S ≥ 0) and ``budget`` (G ≥ 0). The
    selection itself is not differentiated (it is discrete); gradients flow through every key, value and
    feature that the chosen sets use. Returns (out [B, H, T, Dv] in q's dtype, the final state or None).

    ``key_scores`` [B, Hkv, T]: the cache's score of each new key, given (the question's choice:
    :func:`headkit.ops.key_selection.observation_scores`) instead of LoLA's recall error ("Given scores" in the
    module docstring).
    """
    state, keep, scale = checked_sparse_inputs(
        q, k, v, qf, kf, balance, window, sinks, budget, attention_mask, initial_state, scale, eps, validate
    )
    if validate:
        check_key_scores(key_scores, k)
    if validate:
        check_positive_int("chunk_size", chunk_size)
    if sinks == 0 and budget == 0:
        out, final = hybrid_chunked(
            q, k, v, qf, kf, balance, keep, state.window, window, chunk_size, scale, eps
        )
        return out, (state._replace(window=final) if output_final_state else None)
    out, final = _sparse_hybrid(
        q, k, v, qf, kf, balance, keep, state, window, sinks, budget, chunk_size, scale, eps, key_scores
    )
    return out, (final if output_final_state else None)


def sparse_hybrid_state(
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
    *,
    window: int,
    sinks: int,
    budget: int,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
    key_scores: torch.Tensor | None = None,
) -> SparseHybridState:
    """The final state of :func:`sparse_hybrid_attention` on a first call (no earlier state), without its
    outputs: what a cache keeps of a prompt that attended to itself in full (SnapKV's prefill, Li et al. 2024,
    §4: the prompt is read by the original attention, the cache compressed after it). Equal to that op's final
    state (the same plan, the same slots); its cost is the plan's, O(T · (S + G + C)), not the op's outputs'.
    Arguments as that op's (S + G > 0)."""
    kv_heads, seq = k.shape[1:3]
    if sinks + budget == 0:
        raise ValueError("sparse_hybrid_state needs sinks or a budget (S + G > 0)")
    check_key_scores(key_scores, k)
    with torch.no_grad(), autocast_disabled(k.device):
        state, (keys, values, key_features, keep_ext), plan = _first_call(
            k, v, kf, window, sinks, budget, attention_mask, chunk_size, eps, key_scores, final_only=True
        )
        # The folded sums: every candidate folded before the call ends (no earlier state: no cache slot before).
        folded = plan.eligible[:, None, :].expand(-1, kv_heads, -1) & (plan.fold_event[:, :, budget:] < seq)
        features = key_features[:, :, :seq] * folded[..., None]
        final_kv = state.window.kv + features.transpose(-1, -2) @ values[:, :, :seq]
        final_k_sum = state.window.k_sum + features.sum(dim=2)
        return _next_state(
            state, plan, (keys, values, key_features, keep_ext), (k, v, kf), final_kv, final_k_sum,
            sinks=sinks, budget=budget,
        )  # fmt: skip


def sparse_hybrid_exact_sets(
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
    *,
    window: int,
    sinks: int,
    budget: int,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> torch.Tensor:
    """For every query i and key j of one sequence (no earlier state), whether j is in i's exact set (window,
    sink or sparse cache): [B, Hkv, T, T] bool, from the parallel selection the fast path uses. For tests and
    analysis (which keys a retrieval kept exact); O(T²) memory."""
    batch, kv_heads, seq = k.shape[:3]
    keep = torch.ones(batch, seq, dtype=torch.bool, device=k.device)
    if attention_mask is not None:
        keep = attention_mask.to(device=k.device, dtype=torch.bool)
    kept = window - 1
    with torch.no_grad(), autocast_disabled(k.device):
        state, _, plan = _first_call(k, v, kf, window, sinks, budget, keep, chunk_size, eps)
        arrival, departure = _exact_intervals(plan, state, seq, sinks, budget, chunk_size)
    # Extra pool entry p = S + G + e is extended key e = original key e − (W − 1).
    queries = torch.arange(seq, device=k.device)
    extra = (arrival[..., sinks + budget :, None] <= queries) & (
        queries < departure[..., sinks + budget :, None]
    )
    exact = torch.zeros(batch, kv_heads, seq, seq, dtype=torch.bool, device=k.device)
    # extended key e ≥ W − 1 is original key e − W + 1; extended keys before that are empty window slots.
    old_keys = max(seq - kept, 0)
    exact[..., :, :old_keys] = extra[..., kept : kept + old_keys, :].transpose(-1, -2)
    j = queries[None, :]
    i = queries[:, None]
    in_window = (j <= i) & (j > i - window) & keep[:, None, None, :]
    return exact | in_window


def sparse_hybrid_stored_keys(state: SparseHybridState) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact keys a state holds — sinks, kept keys, window — as [B, Hkv, S + G + W − 1, D] keys and a
    [B, Hkv, S + G + W − 1] bool mask of the filled slots: what a later call's queries see beside their own keys
    (:func:`headkit.ops.key_selection.observation_scores` ranks a later turn's keys beside them)."""
    window = state.window
    kv_heads = state.sparse_keys.shape[1]
    keys = torch.cat([state.sink_keys, state.sparse_keys, window.keys.to(state.sparse_keys.dtype)], dim=2)
    per_head = [state.sink_keep[:, None].expand(-1, kv_heads, -1), state.sparse_keep]
    mask = torch.cat([*per_head, window.keep[:, None].expand(-1, kv_heads, -1)], dim=2)
    return keys, mask


class _Plan(NamedTuple):
    """The decisions of one call's events (event e: extended key e leaves the window), computed without grad."""

    is_sink: torch.Tensor  # [B, T] bool
    eligible: torch.Tensor  # [B, T] bool: real, not a sink — a candidate of the cache
    scores: torch.Tensor  # [B, Hkv, T], −inf for non-candidates
    fold_event: torch.Tensor  # [B, Hkv, G + T]: the event at which each cache candidate is folded (T: never)
    reference_kv: torch.Tensor
    reference_k_sum: torch.Tensor


def _first_call(
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
    window: int,
    sinks: int,
    budget: int,
    attention_mask: torch.Tensor | None,
    chunk: int,
    eps: float,
    key_scores: torch.Tensor | None = None,
    *,
    final_only: bool = False,
) -> tuple[SparseHybridState, tuple[torch.Tensor, ...], _Plan]:
    """(the empty state, the extended inputs, the plan) of a first call on these keys (no earlier state): what the
    state-only and exact-set functions read instead of the op's outputs."""
    keep = None if attention_mask is None else attention_mask.to(device=k.device, dtype=torch.bool)
    dtype = accumulation_dtype(k)
    state = empty_sparse_state(k, v, kf, window, sinks, budget, k.shape[0], dtype)
    grid = chunk_grid(k, k, window, chunk, dtype)
    extended, plan = _planned(
        state, k, v, kf, keep, grid, sinks, budget, chunk, eps, key_scores, final_only=final_only
    )
    return state, extended, plan


def _planned(
    state: SparseHybridState,
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
    keep: torch.Tensor | None,
    grid: ChunkGrid,
    sinks: int,
    budget: int,
    chunk: int,
    eps: float,
    key_scores: torch.Tensor | None,
    *,
    final_only: bool = False,
) -> tuple[tuple[torch.Tensor, ...], _Plan]:
    """(the extended inputs, the plan) of a call continuing `state`: event e is extended key e leaving the
    window, and the given scores are padded for the state's window keys."""
    batch, kv_heads, seq = k.shape[:3]
    extended = extended_inputs(state.window, k, v, kf, keep, grid)
    keys, values, key_features, keep_ext = extended
    given = None
    if key_scores is not None:
        # Extended key e < W − 1 is a key of the state's window: it scores 0 (module docstring).
        stored = state.window.keys.shape[2]
        given = torch.cat([key_scores.new_zeros(batch, kv_heads, stored), key_scores], dim=2)[:, :, :seq]
    plan = _plan(
        keys[:, :, :seq], values[:, :, :seq], key_features[:, :, :seq], keep_ext[:, :seq], state,
        sinks=sinks, budget=budget, chunk=chunk, eps=eps, given_scores=given, final_only=final_only,
    )  # fmt: skip
    return extended, plan


def _plan(
    leave_keys: torch.Tensor,
    leave_values: torch.Tensor,
    leave_features: torch.Tensor,
    leave_keep: torch.Tensor,
    state: SparseHybridState,
    *,
    sinks: int,
    budget: int,
    chunk: int,
    eps: float,
    given_scores: torch.Tensor | None = None,
    final_only: bool = False,
) -> _Plan:
    """Sinks, scores and fold events of the keys leaving the window in one call (each [B, Hkv, T, ·]).
    `final_only`: only whether each candidate is folded by the call's end (event 0 if so, T if not): the
    candidates then kept are the `budget` best of all (higher score, then earlier arrival), which the streaming
    decisions end with whatever their order, found by one sort instead of the scan."""
    with torch.no_grad():
        count = leave_keep.long()
        rank = state.sink_keep.sum(dim=1, keepdim=True) + torch.cumsum(count, dim=1) - count
        is_sink = leave_keep & (rank < sinks)
        eligible = leave_keep & ~is_sink
        if budget == 0:
            scores = torch.full(leave_keys.shape[:3], float("-inf"), dtype=state.sparse_scores.dtype)
            scores = scores.to(leave_keys.device)
            fold_event = torch.arange(leave_keys.shape[2], device=leave_keys.device)
            fold_event = fold_event.expand(*leave_keys.shape[:2], -1)
            return _Plan(is_sink, eligible, scores, fold_event, state.reference_kv, state.reference_k_sum)
        if given_scores is not None:
            # The question's choice: no recall error, so no reference memory to keep.
            scores = given_scores.to(state.sparse_scores.dtype)
            reference_kv, reference_k_sum = state.reference_kv, state.reference_k_sum
        else:
            features = leave_features.detach()
            values = leave_values.detach()
            written = features * eligible[:, None, :, None]
            numerator, denominator, reference_kv, reference_k_sum = _strictly_causal_linear(
                features.unsqueeze(2), written, values, state.reference_kv, state.reference_k_sum, chunk
            )
            recalled = numerator[:, :, 0] / (denominator[:, :, 0] + eps)
            scores = (values - recalled).square().sum(dim=-1)
        scores = scores.masked_fill(~eligible[:, None, :], float("-inf"))
        candidates = torch.cat([state.sparse_keep, eligible[:, None, :].expand_as(scores)], dim=2)
        pooled = torch.cat([state.sparse_scores, scores], dim=2)
        if final_only:
            events = leave_keys.shape[2]
            ranked = pooled.masked_fill(~candidates, float("-inf"))
            best = torch.sort(ranked, dim=2, descending=True, stable=True).indices[..., :budget]
            kept = torch.zeros_like(candidates).scatter_(2, best, True) & candidates
            fold_event = torch.where(kept, events, 0)
        else:
            fold_event = _fold_events(pooled, candidates, budget, chunk)
    return _Plan(is_sink, eligible, scores, fold_event, reference_kv, reference_k_sum)


def _fold_events(scores: torch.Tensor, real: torch.Tensor, budget: int, chunk: int = 64) -> torch.Tensor:
    """[B, H, G + T] scores of the cache candidates in arrival order (the G kept ones first, arriving before
    event 0; new candidate G + e arrives at event e) → the event at which each is folded, T for never.

    After event e the cache holds the `budget` best of the arrived candidates (higher score, then earlier
    arrival; a slot that holds no real key counts as −inf): candidate p is folded at the first event ≥ its
    arrival by which `budget` better ones arrived. Scanned over chunks of `chunk` events, each a [G + C, G + C]
    count among the cache at the chunk's start and the chunk's newcomers: O(T · (G + C)) work, not O(T²)."""
    batch, heads, pool = scores.shape
    events = pool - budget
    device = scores.device
    ranked = scores.masked_fill(~real, float("-inf"))
    fold = torch.full((batch, heads, pool), events, dtype=torch.long, device=device)
    cache = torch.arange(budget, device=device).expand(batch, heads, budget)  # pool indices, arrival order
    for start in range(0, events, chunk):
        size = min(chunk, events - start)
        newcomers = torch.arange(budget + start, budget + start + size, device=device).expand(
            batch, heads, size
        )
        candidates = torch.cat([cache, newcomers], dim=2)  # [B, H, K], increasing pool index = arrival order
        candidate_scores = ranked.gather(2, candidates)
        # Better ones in the cache, counted by sorting it (O(K log G), not a [K, K] comparison): a cache
        # member's count is its place in the cache sorted by (score down, arrival up) — the stable sort keeps
        # arrival order among ties — and a newcomer's is the cache members scoring at least as high (all
        # arrived earlier, so ties count).
        cache_scores = candidate_scores[..., :budget]
        order = torch.sort(cache_scores, dim=2, descending=True, stable=True)
        places = torch.arange(budget, device=device, dtype=torch.int32).expand_as(order.indices)
        place = torch.empty_like(places).scatter_(2, order.indices, places)
        below = torch.searchsorted(
            order.values.flip(-1).contiguous(), candidate_scores[..., budget:].contiguous()
        )
        in_cache = torch.cat([place, (budget - below).to(torch.int32)], dim=2)[:, :, None, :]  # [B, H, 1, K]
        # Better newcomers arrived by the chunk's event e: a running count over the C newcomers only.
        rows, columns = candidate_scores[..., budget:, None], candidate_scores[..., None, :]
        earlier = candidates[..., budget:, None] < candidates[..., None, :]
        better = (rows > columns) | ((rows == columns) & earlier)  # [B, H, C (better one), K]
        arrived = in_cache + better.to(torch.int32).cumsum(dim=2, dtype=torch.int32)  # [B, H, C, K]
        reached = arrived >= budget
        first = torch.where(reached.any(dim=2), reached.to(torch.int8).argmax(dim=2), events)
        arrival = torch.cat(
            [torch.zeros(budget, dtype=torch.long, device=device), torch.arange(size, device=device)]
        )
        local = torch.maximum(first, arrival)
        folded = local < size
        fold.scatter_(2, candidates, torch.where(folded, start + local, events))
        # Exactly one candidate leaves per event: the `budget` others stay, in arrival order.
        stay = torch.sort(folded.to(torch.uint8), dim=2, stable=True).indices[:, :, :budget]
        cache = candidates.gather(2, stay)
    return fold


def _strictly_causal_linear(
    queries: torch.Tensor,
    features: torch.Tensor,
    values: torch.Tensor,
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear attention of query t over the entries e < t and the initial sums: queries [B, H, R, L, F] (R rows
    per head), features [B, H, L, F], values [B, H, L, Dv], sums [B, H, F, Dv] / [B, H, F]. Chunked like
    :mod:`headkit.ops.linear`. Returns (numerator [B, H, R, L, Dv], denominator [B, H, R, L, 1], final sums)."""
    batch, heads, rows, length, width = queries.shape
    dv = values.shape[3]
    n = max(1, -(-length // chunk))
    tail = n * chunk - length

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(*x.shape[:-2], tail, x.shape[-1])], dim=-2)

    chunk_queries = padded(queries).view(batch, heads, rows, n, chunk, width).transpose(2, 3)
    chunk_features = padded(features).view(batch, heads, n, 1, chunk, width)
    chunk_values = padded(values).view(batch, heads, n, 1, chunk, dv)
    chunk_kv = chunk_features.transpose(-1, -2) @ chunk_values  # [B, H, n, 1, F, Dv]
    chunk_k_sum = chunk_features.sum(dim=4)  # [B, H, n, 1, F]
    kv_before = kv[:, :, None, None] + exclusive_cumsum(chunk_kv)
    k_sum_before = k_sum[:, :, None, None] + exclusive_cumsum(chunk_k_sum)
    inside = (chunk_queries @ chunk_features.transpose(-1, -2)).tril(-1)  # [B, H, n, R, C, C]
    numerator = chunk_queries @ kv_before + inside @ chunk_values
    denominator = chunk_queries @ k_sum_before.unsqueeze(-1) + inside.sum(dim=-1, keepdim=True)

    def unchunked(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(2, 3).reshape(batch, heads, rows, n * chunk, x.shape[-1])[:, :, :, :length]

    return (
        unchunked(numerator),
        unchunked(denominator),
        kv + chunk_kv.sum(dim=(2, 3)),
        k_sum + chunk_k_sum.sum(dim=(2, 3)),
    )


def _exact_intervals(
    plan: _Plan, state: SparseHybridState, seq: int, sinks: int, budget: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the pool [S sink slots, G cache slots, T leaving keys]: the first query that sees each exactly beyond
    the window (arrival) and the first that no longer does (departure); arrival ≥ departure = never."""
    batch, heads = plan.scores.shape[:2]
    device = plan.scores.device
    never = seq + chunk + 1
    events = torch.arange(seq, device=device)
    sink_departure = torch.where(state.sink_keep, never, 0)[:, None, :].expand(batch, heads, sinks)
    folded_at = torch.where(plan.fold_event >= seq, never, plan.fold_event + 1)
    cache_departure = torch.where(state.sparse_keep, folded_at[:, :, :budget], 0)
    new_departure = torch.where(
        plan.is_sink[:, None, :], never, torch.where(plan.eligible[:, None, :], folded_at[:, :, budget:], 0)
    )
    arrival = torch.cat([torch.zeros(sinks + budget, dtype=torch.long, device=device), events + 1]).expand(
        batch, heads, -1
    )
    departure = torch.cat([sink_departure, cache_departure, new_departure], dim=2)
    return arrival, departure


def _sparse_hybrid(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    balance: torch.Tensor,
    keep: torch.Tensor | None,
    state: SparseHybridState,
    window: int,
    sinks: int,
    budget: int,
    chunk: int,
    scale: float,
    eps: float,
    key_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SparseHybridState]:
    """The chunked computation on validated inputs (S + G > 0)."""
    base = state.window
    grid = chunk_grid(q, k, window, chunk, base.kv.dtype)
    batch, kv_heads, groups, n_chunks, padded, block = (
        grid.batch, grid.kv_heads, grid.groups, grid.n_chunks, grid.padded, grid.block
    )  # fmt: skip
    seq, dtype, device = q.shape[2], grid.dtype, q.device
    q_heads, head_dim_v, features = q.shape[1], v.shape[3], qf.shape[3]

    with autocast_disabled(device):
        extended, plan = _planned(state, k, v, kf, keep, grid, sinks, budget, chunk, eps, key_scores)
        keys, values, key_features, keep_ext = extended
        # Event e (after query e − 1 … before query e + 1): extended key e leaves the window.
        leave_keys, leave_values, leave_features = (
            keys[:, :, :seq],
            values[:, :, :seq],
            key_features[:, :, :seq],
        )
        queries = chunked_queries(q, grid)
        window_scores, window_values = window_block_scores(queries, keys, values, keep_ext, grid, scale)

        # --- the exact extras: sinks and cached keys, at most S + G + C per chunk of queries ---
        arrival, departure = _exact_intervals(plan, state, seq, sinks, budget, chunk)
        pool_keys = torch.cat([state.sink_keys.to(dtype), state.sparse_keys.to(dtype), leave_keys], dim=2)
        pool_values = torch.cat(
            [state.sink_values.to(dtype), state.sparse_values.to(dtype), leave_values], dim=2
        )
        pool = pool_keys.shape[2]
        starts = torch.arange(n_chunks, device=device) * chunk
        relevant = (
            (arrival[:, :, None, :] < (starts + chunk)[:, None])
            & (departure[:, :, None, :] > starts[:, None])
            & (arrival < departure)[:, :, None, :]
        )  # [B, Hkv, n, pool]
        # At most S + G + C pool entries matter to a chunk; a prompt shorter than the budget has fewer.
        extras = max(1, min(pool, sinks + budget + chunk, int(relevant.sum(dim=-1).max())))
        picked = torch.sort(relevant.to(torch.uint8), dim=-1, descending=True, stable=True).indices
        picked = picked[..., :extras]  # [B, Hkv, n, K]

        def gather_pool(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, pool, X] -> [B, Hkv, n, K, X]
            expanded = x[:, :, None].expand(-1, -1, n_chunks, -1, -1)
            return expanded.gather(3, picked[..., None].expand(-1, -1, -1, -1, x.shape[3]))

        extra_keys, extra_values = gather_pool(pool_keys), gather_pool(pool_values)
        extra_arrival = arrival[:, :, None].expand(-1, -1, n_chunks, -1).gather(3, picked)
        extra_departure = departure[:, :, None].expand(-1, -1, n_chunks, -1).gather(3, picked)
        times = (starts[:, None] + torch.arange(chunk, device=device))[None, None, :, :, None]  # [1,1,n,C,1]
        member = (extra_arrival[:, :, :, None, :] <= times) & (times < extra_departure[:, :, :, None, :])
        extra_scores = (queries @ extra_keys.transpose(-1, -2)) * scale  # [B, Hkv, n, G·C, K]
        extra_scores = extra_scores.view(batch, kv_heads, n_chunks, groups, chunk, extras)
        extra_scores = extra_scores.masked_fill(~member[:, :, :, None], float("-inf"))

        m = torch.maximum(window_scores.amax(dim=-1, keepdim=True), extra_scores.amax(dim=-1, keepdim=True))
        m = m.masked_fill(~torch.isfinite(m), 0.0)
        window_weights = torch.exp(window_scores - m).view(batch, kv_heads, n_chunks, groups * chunk, block)
        extra_weights = torch.exp(extra_scores - m).view(batch, kv_heads, n_chunks, groups * chunk, extras)
        numerator = window_weights @ window_values + extra_weights @ extra_values
        denominator = window_weights.sum(dim=-1, keepdim=True) + extra_weights.sum(dim=-1, keepdim=True)

        def by_head(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, n, G·C, X] -> [B, Hkv, G, T, X]
            x = x.view(batch, kv_heads, n_chunks, groups, chunk, x.shape[-1]).transpose(2, 3)
            return x.reshape(batch, kv_heads, groups, padded, x.shape[-1])[:, :, :, :seq]

        numerator, denominator = by_head(numerator), by_head(denominator)

        # --- the linear term: causal linear attention over the fold sequence (one folded key per event) ---
        pool_features = torch.cat([state.sparse_key_features.to(dtype), leave_features], dim=2)
        cache_values = torch.cat([state.sparse_values.to(dtype), leave_values], dim=2)
        candidates = torch.cat([state.sparse_keep, plan.eligible[:, None, :].expand(-1, kv_heads, -1)], dim=2)
        folds = candidates & (plan.fold_event < seq)
        slot = torch.where(folds, plan.fold_event, seq)  # events without a fold gather nothing
        sources = torch.arange(budget + seq, device=device).expand(batch, kv_heads, -1)
        fold_source = torch.zeros(batch, kv_heads, seq + 1, dtype=torch.long, device=device)
        fold_source = fold_source.scatter(2, slot, sources)[:, :, :seq]
        fold_keep = torch.zeros(batch, kv_heads, seq + 1, dtype=torch.bool, device=device)
        fold_keep = fold_keep.scatter(2, slot, folds)[:, :, :seq]
        folded_features = pool_features.gather(2, fold_source[..., None].expand(-1, -1, -1, features))
        folded_features = folded_features * fold_keep[..., None]
        folded_values = cache_values.gather(2, fold_source[..., None].expand(-1, -1, -1, head_dim_v))
        query_features = qf.to(dtype).view(batch, kv_heads, groups, seq, features)
        linear_numerator, linear_denominator, final_kv, final_k_sum = _strictly_causal_linear(
            query_features, folded_features, folded_values, base.kv, base.k_sum, chunk
        )

        gamma = balance.to(dtype).view(1, kv_heads, groups, 1, 1)
        out = (numerator + gamma * linear_numerator) / (denominator + gamma * linear_denominator + eps)
        out = out.reshape(batch, q_heads, seq, head_dim_v).to(q.dtype)

        # --- the next state ---
        final = _next_state(
            state, plan, (keys, values, key_features, keep_ext), (k, v, kf), final_kv, final_k_sum,
            sinks=sinks, budget=budget,
        )  # fmt: skip
    return out, final


def _next_state(
    state: SparseHybridState,
    plan: _Plan,
    extended: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    final_kv: torch.Tensor,
    final_k_sum: torch.Tensor,
    *,
    sinks: int,
    budget: int,
) -> SparseHybridState:
    """The state after a call from its plan: the last W − 1 extended tokens as the window, the first S sinks, and
    the candidates never folded as the cache. `extended`: (keys, values, key features, keep flags) of the
    extended sequence (:func:`~headkit.ops.hybrid.parallel.extended_inputs`); `new`: the call's k, v, φ(k)."""
    keys, values, key_features, keep_ext = extended
    k, v, kf = new
    seq, kept, dtype, kv_heads = k.shape[2], state.window.keys.shape[2], keys.dtype, k.shape[1]
    leave_keys, leave_values, leave_features = keys[:, :, :seq], values[:, :, :seq], key_features[:, :, :seq]
    window_state = window_state_after(
        keys, values, key_features, keep_ext, seq, kept, final_kv, final_k_sum, k, v, kf
    )
    # Sinks: the first S flagged among [the sink slots, the leaving keys], in order; empty slots zero.
    sink_flags = torch.cat([state.sink_keep, plan.is_sink], dim=1)
    sink_order = torch.sort(sink_flags.to(torch.uint8), dim=1, descending=True, stable=True).indices[
        :, :sinks
    ]
    sink_keep = sink_flags.gather(1, sink_order)

    def sink_slots(stored: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        both = torch.cat([stored.to(dtype), new], dim=2)
        index = sink_order[:, None, :, None].expand(-1, kv_heads, -1, both.shape[3])
        return (both.gather(2, index) * sink_keep[:, None, :, None]).to(stored.dtype)

    # Cache: the candidates never folded, oldest first, behind the empty slots; empty slots zero, −inf.
    candidates = torch.cat([state.sparse_keep, plan.eligible[:, None, :].expand(-1, kv_heads, -1)], dim=2)
    remaining = candidates & (plan.fold_event >= seq)
    cache_order = torch.sort(remaining.to(torch.uint8), dim=2, stable=True).indices
    cache_order = cache_order[:, :, cache_order.shape[2] - budget :]
    sparse_keep = remaining.gather(2, cache_order)

    def cache_slots(stored: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        both = torch.cat([stored.to(dtype), new], dim=2)
        index = cache_order[..., None].expand(-1, -1, -1, both.shape[3])
        return (both.gather(2, index) * sparse_keep[..., None]).to(stored.dtype)

    all_scores = torch.cat([state.sparse_scores, plan.scores], dim=2)
    return SparseHybridState(
        window=window_state,
        sink_keys=sink_slots(state.sink_keys, leave_keys),
        sink_values=sink_slots(state.sink_values, leave_values),
        sink_keep=sink_keep,
        sparse_keys=cache_slots(state.sparse_keys, leave_keys),
        sparse_values=cache_slots(state.sparse_values, leave_values),
        sparse_key_features=cache_slots(state.sparse_key_features, leave_features),
        sparse_keep=sparse_keep,
        sparse_scores=all_scores.gather(2, cache_order).masked_fill(~sparse_keep, float("-inf")),
        reference_kv=plan.reference_kv,
        reference_k_sum=plan.reference_k_sum,
    )


def check_key_scores(key_scores: torch.Tensor | None, k: torch.Tensor) -> None:
    if key_scores is None:
        return
    expected = tuple(k.shape[:3])
    if not isinstance(key_scores, torch.Tensor) or tuple(key_scores.shape) != expected:
        got = tuple(key_scores.shape) if isinstance(key_scores, torch.Tensor) else type(key_scores).__name__
        raise ValueError(
            f"key_scores must be a tensor of shape {list(expected)} (one per new key), got {got}"
        )
    if torch.isnan(key_scores).any():
        raise ValueError("key_scores must not hold NaN")


def empty_sparse_state(
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
    window: int,
    sinks: int,
    budget: int,
    batch: int,
    dtype,
) -> SparseHybridState:
    """The state before the first token: empty window, sinks and cache, zero sums."""
    kv_heads, device = k.shape[1], k.device
    features, dv = kf.shape[3], v.shape[3]
    window_state = empty_hybrid_state(k, v, kf, window, dtype)
    return SparseHybridState(
        window_state,
        sink_keys=k.new_zeros(batch, kv_heads, sinks, k.shape[3]),
        sink_values=v.new_zeros(batch, kv_heads, sinks, dv),
        sink_keep=torch.zeros(batch, sinks, dtype=torch.bool, device=device),
        sparse_keys=k.new_zeros(batch, kv_heads, budget, k.shape[3]),
        sparse_values=v.new_zeros(batch, kv_heads, budget, dv),
        sparse_key_features=kf.new_zeros(batch, kv_heads, budget, features),
        sparse_keep=torch.zeros(batch, kv_heads, budget, dtype=torch.bool, device=device),
        sparse_scores=torch.full((batch, kv_heads, budget), float("-inf"), dtype=dtype, device=device),
        reference_kv=torch.zeros(batch, kv_heads, features, dv, dtype=dtype, device=device),
        reference_k_sum=torch.zeros(batch, kv_heads, features, dtype=dtype, device=device),
    )


def checked_sparse_inputs(
    q, k, v, qf, kf, balance, window, sinks, budget, attention_mask, state, scale, eps, validate
) -> tuple[SparseHybridState, torch.Tensor | None, float]:
    """(the state — empty when None —, the bool padding mask or None, the scale), checked when ``validate``."""
    dtype = accumulation_dtype(q)
    if not validate:
        if state is None:
            state = empty_sparse_state(k, v, kf, window, sinks, budget, q.shape[0], dtype)
        return state, attention_mask, q.shape[-1] ** -0.5 if scale is None else scale
    for name, value in (("sinks", sinks), ("budget", budget)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if state is not None and not isinstance(state, SparseHybridState):
        raise ValueError(f"the state must be a SparseHybridState (from this op), got {type(state).__name__}")
    keep, window_state, scale = prepared_hybrid_inputs(
        q, k, v, qf, kf, balance, window, attention_mask,
        None if state is None else state.window, "state.window", scale, eps, True,
    )  # fmt: skip
    if state is None:
        return empty_sparse_state(k, v, kf, window, sinks, budget, q.shape[0], dtype), keep, scale
    batch, kv_heads = k.shape[:2]
    expected = {
        "sink_keys": (batch, kv_heads, sinks, k.shape[3]),
        "sink_values": (batch, kv_heads, sinks, v.shape[3]),
        "sink_keep": (batch, sinks),
        "sparse_keys": (batch, kv_heads, budget, k.shape[3]),
        "sparse_values": (batch, kv_heads, budget, v.shape[3]),
        "sparse_key_features": (batch, kv_heads, budget, kf.shape[3]),
        "sparse_keep": (batch, kv_heads, budget),
        "sparse_scores": (batch, kv_heads, budget),
        "reference_kv": (batch, kv_heads, kf.shape[3], v.shape[3]),
        "reference_k_sum": (batch, kv_heads, kf.shape[3]),
    }
    for field, shape in expected.items():
        got = tuple(getattr(state, field).shape)
        if got != shape:
            raise ValueError(
                f"state.{field} must have shape {list(shape)} (sinks {sinks}, budget {budget}), got {got}"
            )
    return state._replace(window=window_state), keep, scale


__all__ = [
    "SparseHybridState",
    "sparse_hybrid_attention",
    "sparse_hybrid_exact_sets",
    "sparse_hybrid_stored_keys",
]
