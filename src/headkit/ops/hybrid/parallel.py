"""The parallel (training / prefill) form of the hybrid attention of :mod:`headkit.ops.hybrid` (LoLCATs, Zhang et
al. 2024, arXiv:2410.10254), and the pieces of it that the sparse variant (:mod:`headkit.ops.hybrid.sparse`)
reuses.

Parallel (training / prefill) form, :func:`hybrid_attention`: the queries are cut into chunks of C. A chunk's
window keys are the C + W − 1 keys ending at its last query — one band-masked [C, C + W − 1] score block per
chunk, taken from overlapping (unfolded) views of the keys, never a T × T tensor. The linear term is causal
linear attention over the keys delayed by W − 1 positions, strictly before the query (key j reaches query i
when j + W − 1 < i, i.e. j ≤ i − W): an exclusive prefix sum of per-chunk states S = Σ φ(k) vᵀ, z = Σ φ(k)
plus a strictly lower [C, C] block inside the chunk, as in :mod:`headkit.ops.linear`. Memory O(T · (C + W)) per
head, time O(T · (C + W) · D + T · F · Dv).

The state it starts from and returns (:class:`HybridAttentionState`) is ordered, oldest key first; a prefill
followed by more tokens in a second call gives the outputs of one call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from headkit.ops._precision import autocast_disabled
from headkit.ops._validation import (
    check_eps,
    check_padding_mask,
    check_positive_int,
    check_qkv,
    check_rank,
    checked_scale,
)


class HybridAttentionState(NamedTuple):
    """Decoding state of :func:`hybrid_attention`, fixed-size (every tensor has the batch as dim 0).

    keys, values, key_features: the last W − 1 keys [B, Hkv, W − 1, D], values [B, Hkv, W − 1, Dv] and key
        features φ(k) [B, Hkv, W − 1, F], oldest first, in the inputs' dtypes — the keys the next query still
        sees through the softmax window (the window of W includes the query's own key).
    keep: [B, W − 1] bool, False for padding and for slots before the first token.
    kv: Σ φ(k_j) v_jᵀ over every real key that has left the window, [B, Hkv, F, Dv], float32 (float64 for
        float64 inputs).
    k_sum: Σ φ(k_j) over the same keys, [B, Hkv, F].

    A NamedTuple, like the other ops' states, so that :class:`headkit.layers.StateCacheLayer` can reorder and
    select it for beam search.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_features: torch.Tensor
    keep: torch.Tensor
    kv: torch.Tensor
    k_sum: torch.Tensor


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    balance: torch.Tensor,
    *,
    window: int,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: HybridAttentionState | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    validate: bool = True,
) -> tuple[torch.Tensor, HybridAttentionState | None]:
    """Causal sliding-window softmax + linear attention (LoLCATs), chunkwise-parallel; see :mod:`headkit.ops.hybrid`.

    Args:
        q: queries [B, H, T, D], rotary embeddings already applied.
        k, v: keys and values [B, Hkv, T, D] / [B, Hkv, T, Dv]; ``H % Hkv == 0`` (grouped-query attention: query
            head h reads key/value head h // (H / Hkv)).
        qf, kf: feature maps φ(q) [B, H, T, F] and φ(k) [B, Hkv, T, F] of the linear term, non-negative for a
            positive normaliser (e.g. :func:`headkit.ops.hedgehog_feature_map`).
        balance: γ_h ≥ 0, the weight of the linear term per query head, [H] (LoLCATs' linear/window factor).
        window: W ≥ 1, the number of keys each query sees exactly, its own included: keys j ∈ (i − W, i].
        attention_mask: key padding mask [B, T] over these tokens (bool or 0/1 integers, True = real token).
            Padded keys contribute nothing (their inputs must still be finite).
        chunk_size: queries per chunk of the parallel form (a speed/memory knob; results agree up to rounding).
        scale: score scale of the window, 1/√D by default.
        initial_state: the state after earlier tokens (from ``output_final_state=True`` or
            :func:`headkit.ops.hybrid.state_from_ring` after decoding steps); None = no earlier token.
        output_final_state: also return the state after the last token.
        eps: added to the denominator; a query that sees no real key returns zeros.
        validate: False skips the checks, for a caller (a layer) that built the inputs itself: a bool mask or
            None, a float scale, a state this op returned.

    Returns:
        (out [B, H, T, Dv] in q's dtype, final :class:`HybridAttentionState` or None). Accumulated in float32
        (float64 for float64 inputs), also under ``torch.autocast``.
    """
    inputs = (q, k, v, qf, kf, balance, window, attention_mask)
    keep, state, scale = prepared_hybrid_inputs(*inputs, initial_state, "initial_state", scale, eps, validate)
    if validate:
        check_positive_int("chunk_size", chunk_size)
    out, final = hybrid_chunked(q, k, v, qf, kf, balance, keep, state, window, chunk_size, scale, eps)
    return out, (final if output_final_state else None)


def hybrid_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    balance: torch.Tensor,
    keep: torch.Tensor | None,
    state: HybridAttentionState,
    window: int,
    chunk: int,
    scale: float,
    eps: float,
) -> tuple[torch.Tensor, HybridAttentionState]:
    """The chunked computation on validated inputs; ``state`` is never None here (zeros for no past)."""
    grid = chunk_grid(q, k, window, chunk, state.kv.dtype)
    batch, kv_heads, groups, n_chunks, padded = (
        grid.batch,
        grid.kv_heads,
        grid.groups,
        grid.n_chunks,
        grid.padded,
    )
    seq, kept, dtype, device = q.shape[2], window - 1, grid.dtype, q.device
    q_heads, head_dim_v, features = q.shape[1], v.shape[3], qf.shape[3]

    with autocast_disabled(device):
        keys, values, key_features, keep_ext = extended_inputs(state, k, v, kf, keep, grid)
        scores, window_values = window_block_scores(
            chunked_queries(q, grid), keys, values, keep_ext, grid, scale
        )
        m = scores.amax(dim=-1, keepdim=True)
        m = m.masked_fill(~torch.isfinite(m), 0.0)  # a query whose window holds no real key
        window_weights = torch.exp(scores - m).view(batch, kv_heads, n_chunks, groups * chunk, grid.block)
        numerator = window_weights @ window_values  # [B, Hkv, n, G·C, Dv]
        denominator = window_weights.sum(dim=-1, keepdim=True)

        # --- the linear term: causal linear attention of query t over the extended keys < t ---
        # (key j ≤ t − W of the new tokens is extended key j + W − 1 < t.) Extended keys at positions ≥ T are
        # seen only by tail queries; masking them makes the final sums stop where the next window starts.
        linear_keep = keep_ext[:, :padded] & (torch.arange(padded, device=device) < seq)
        shifted_features = key_features[:, :, :padded].masked_fill(~linear_keep[:, None, :, None], 0.0)
        shifted_features = shifted_features.view(batch, kv_heads, n_chunks, chunk, features)
        shifted_values = values[:, :, :padded].reshape(batch, kv_heads, n_chunks, chunk, head_dim_v)
        chunk_kv = shifted_features.transpose(-1, -2) @ shifted_values  # [B, Hkv, n, F, Dv]
        chunk_k_sum = shifted_features.sum(dim=3)  # [B, Hkv, n, F]
        kv_before = state.kv.unsqueeze(2) + exclusive_cumsum(chunk_kv)
        k_sum_before = state.k_sum.unsqueeze(2) + exclusive_cumsum(chunk_k_sum)
        final_kv = state.kv + chunk_kv.sum(dim=2)
        final_k_sum = state.k_sum + chunk_k_sum.sum(dim=2)

        query_features = chunked_queries(qf, grid)  # [B, Hkv, n, G·C, F]
        # Inside the chunk, query r sees the extended keys u < r of its chunk: one strictly lower [C, C] triangle
        # per stacked query head.
        linear_scores = query_features @ shifted_features.transpose(-1, -2)  # [B, Hkv, n, G·C, C]
        linear_scores = linear_scores.view(batch, kv_heads, n_chunks, groups, chunk, chunk).tril(-1)
        linear_scores = linear_scores.view(batch, kv_heads, n_chunks, groups * chunk, chunk)
        linear_numerator = query_features @ kv_before + linear_scores @ shifted_values
        linear_denominator = query_features @ k_sum_before.unsqueeze(-1) + linear_scores.sum(
            dim=-1, keepdim=True
        )

        # γ per query head, broadcast over the stacked [G·C] rows of each key/value head.
        gamma = balance.to(dtype).view(1, kv_heads, 1, groups, 1).expand(-1, -1, -1, -1, chunk)
        gamma = gamma.reshape(1, kv_heads, 1, groups * chunk, 1)
        out = (numerator + gamma * linear_numerator) / (denominator + gamma * linear_denominator + eps)
        out = out.view(batch, kv_heads, n_chunks, groups, chunk, head_dim_v).transpose(2, 3)
        out = out.reshape(batch, q_heads, padded, head_dim_v)[:, :, :seq].to(q.dtype)

        final = window_state_after(
            keys, values, key_features, keep_ext, seq, kept, final_kv, final_k_sum, k, v, kf
        )
    return out, final


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Σ over earlier chunks (dim 2), the first chunk getting zeros."""
    before = torch.zeros_like(x[:, :, :1])
    return torch.cat([before, x[:, :, :-1].cumsum(dim=2)], dim=2)


class ChunkGrid(NamedTuple):
    """How the chunked form lays out T new queries: ``n_chunks`` chunks of ``chunk`` (``padded`` = n · C, the
    last ``tail`` queries past the end computed and dropped), each seeing a ``block`` of C + W − 1 window keys;
    accumulation in ``dtype``."""

    batch: int
    kv_heads: int
    groups: int
    chunk: int
    n_chunks: int
    padded: int
    tail: int
    block: int
    dtype: torch.dtype


def chunk_grid(q: torch.Tensor, k: torch.Tensor, window: int, chunk: int, dtype: torch.dtype) -> ChunkGrid:
    n_chunks = max(1, -(-q.shape[2] // chunk))
    padded = n_chunks * chunk
    return ChunkGrid(
        q.shape[0], k.shape[1], q.shape[1] // k.shape[1], chunk, n_chunks, padded, padded - q.shape[2],
        chunk + window - 1, dtype,
    )  # fmt: skip


def extended_inputs(
    state: HybridAttentionState,
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
    keep: torch.Tensor | None,
    grid: ChunkGrid,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The "extended" sequence: the stored window, the new tokens, zeros for the tail (keys, values, key
    features in ``grid.dtype``; keep flags [B, W − 1 + padded]). Query t (0-based among the new tokens) is
    extended position t + W − 1; it sees extended keys [t, t + W − 1] through the window and extended keys < t
    (plus the state's sums) through the linear term."""
    batch, seq, device = k.shape[0], k.shape[2], k.device
    keep = torch.ones(batch, seq, dtype=torch.bool, device=device) if keep is None else keep.to(device)

    def extend(stored: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        zeros = new.new_zeros(*new.shape[:2], grid.tail, new.shape[3]).to(grid.dtype)
        return torch.cat([stored.to(grid.dtype), new.to(grid.dtype), zeros], dim=2)

    no_tail = torch.zeros(batch, grid.tail, dtype=torch.bool, device=device)
    keep_ext = torch.cat([state.keep.to(device), keep, no_tail], dim=1)
    return extend(state.keys, k), extend(state.values, v), extend(state.key_features, kf), keep_ext


def chunked_queries(x: torch.Tensor, grid: ChunkGrid) -> torch.Tensor:
    """[B, H, T, X] -> [B, Hkv, n, G·C, X]: the G query heads of a key/value head stacked per chunk."""
    x = torch.cat([x.to(grid.dtype), x.new_zeros(*x.shape[:2], grid.tail, x.shape[3]).to(grid.dtype)], dim=2)
    x = x.view(grid.batch, grid.kv_heads, grid.groups, grid.n_chunks, grid.chunk, x.shape[3]).transpose(2, 3)
    return x.reshape(grid.batch, grid.kv_heads, grid.n_chunks, grid.groups * grid.chunk, x.shape[5])


def window_block_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    keep_ext: torch.Tensor,
    grid: ChunkGrid,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window: one band-masked [C, C + W − 1] block of scores per chunk, from overlapping (unfolded) views of
    the extended keys. Returns (scores [B, Hkv, n, G, C, C + W − 1], −inf off the band and on padding; the
    block's values [B, Hkv, n, C + W − 1, Dv])."""
    chunk, block, kept = grid.chunk, grid.block, grid.block - grid.chunk
    window_keys = keys.unfold(2, block, chunk)  # [B, Hkv, n, D, C + W − 1]
    window_values = values.unfold(2, block, chunk).transpose(-1, -2)
    window_keep = keep_ext.unfold(1, block, chunk)  # [B, n, C + W − 1]
    offsets = (
        torch.arange(block, device=keys.device)[None, :] - torch.arange(chunk, device=keys.device)[:, None]
    )
    band = (offsets >= 0) & (offsets <= kept)  # query r sees block keys r … r + W − 1
    # In the band and a real token (neither padding nor an empty state slot).
    visible = band & window_keep[:, None, :, None, None, :]
    scores = (queries @ window_keys) * scale
    scores = scores.view(grid.batch, grid.kv_heads, grid.n_chunks, grid.groups, chunk, block)
    return scores.masked_fill(~visible, float("-inf")), window_values


def window_state_after(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_features: torch.Tensor,
    keep_ext: torch.Tensor,
    seq: int,
    kept: int,
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
) -> HybridAttentionState:
    """The next state of the chunked form: the last W − 1 extended tokens (the tail starts after them), in the
    inputs' dtypes, and the sums (kv, k_sum)."""

    def last_window(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x[:, :, seq : seq + kept].to(like.dtype)

    return HybridAttentionState(
        keys=last_window(keys, k),
        values=last_window(values, v),
        key_features=last_window(key_features, kf),
        keep=keep_ext[:, seq : seq + kept],
        kv=kv,
        k_sum=k_sum,
    )


def prepared_hybrid_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    balance: torch.Tensor,
    window: int,
    attention_mask: torch.Tensor | None,
    state: HybridAttentionState | None,
    state_name: str,
    scale: float | None,
    eps: float,
    validate: bool,
) -> tuple[torch.Tensor | None, HybridAttentionState, float]:
    """(bool padding mask or None, the state — zeros when None —, the score scale), checked when ``validate``."""
    if not validate:
        state = empty_hybrid_state(k, v, kf, window, accumulation_dtype(q)) if state is None else state
        return attention_mask, state, q.shape[-1] ** -0.5 if scale is None else scale
    batch, q_heads, kv_heads, kv_len = check_qkv(q, k, v)
    seq, head_dim, head_dim_v = q.shape[2], k.shape[3], v.shape[3]
    if kv_len != seq:
        raise ValueError(f"k and v must have the same seq length as q ({seq}), got {kv_len}")
    check_positive_int("window", window)
    check_rank("qf", qf, 4, "[batch, heads, seq, feature_dim]")
    check_rank("kf", kf, 4, "[batch, kv_heads, seq, feature_dim]")
    features = qf.shape[3]
    for name, tensor, heads in (("qf", qf, q_heads), ("kf", kf, kv_heads)):
        if tuple(tensor.shape[:3]) != (batch, heads, seq) or tensor.shape[3] != features:
            raise ValueError(
                f"{name} must have shape [{batch}, {heads}, {seq}, feature_dim] (feature_dim {features}, as qf) "
                f"to match q and k, got {tuple(tensor.shape)}"
            )
    for name, tensor in (("q", q), ("k", k), ("v", v), ("qf", qf), ("kf", kf)):
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if not isinstance(balance, torch.Tensor) or tuple(balance.shape) != (q_heads,):
        got = tuple(balance.shape) if isinstance(balance, torch.Tensor) else type(balance).__name__
        raise ValueError(f"balance must be a tensor of shape [heads] = [{q_heads}], got {got}")
    if not balance.dtype.is_floating_point:
        raise ValueError(f"balance must be a floating-point tensor, got dtype {balance.dtype}")
    keep = check_padding_mask(attention_mask, batch, seq)
    scale = checked_scale(scale, head_dim)
    check_eps(eps)

    dtype = accumulation_dtype(q)
    kept, device = window - 1, q.device
    if state is None:
        return keep, empty_hybrid_state(k, v, kf, window, dtype), scale
    if not (isinstance(state, tuple) and len(state) == 6 and all(isinstance(t, torch.Tensor) for t in state)):
        raise ValueError(
            f"{state_name} must be a HybridAttentionState(keys, values, key_features, keep, kv, k_sum) of tensors, "
            f"got {type(state).__name__}"
        )
    state = HybridAttentionState(*state)
    expected = {
        "keys": ((batch, kv_heads, kept, head_dim), "[batch, kv_heads, window - 1, head_dim]"),
        "values": ((batch, kv_heads, kept, head_dim_v), "[batch, kv_heads, window - 1, head_dim_v]"),
        "key_features": ((batch, kv_heads, kept, features), "[batch, kv_heads, window - 1, feature_dim]"),
        "keep": ((batch, kept), "[batch, window - 1]"),
        "kv": ((batch, kv_heads, features, head_dim_v), "[batch, kv_heads, feature_dim, head_dim_v]"),
        "k_sum": ((batch, kv_heads, features), "[batch, kv_heads, feature_dim]"),
    }
    for field, (shape, layout) in expected.items():
        tensor = getattr(state, field)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{state_name}.{field} must have shape {layout} = {list(shape)} (window {window}), "
                f"got {tuple(tensor.shape)}"
            )
        if field == "keep":
            if tensor.dtype != torch.bool:
                raise ValueError(f"{state_name}.keep must be a bool tensor, got dtype {tensor.dtype}")
        elif not tensor.dtype.is_floating_point:
            raise ValueError(
                f"{state_name}.{field} must be a floating-point tensor, got dtype {tensor.dtype}"
            )
    state = state._replace(
        kv=state.kv.to(device=device, dtype=dtype), k_sum=state.k_sum.to(device=device, dtype=dtype)
    )
    return keep, state, scale


def empty_hybrid_state(
    k: torch.Tensor, v: torch.Tensor, kf: torch.Tensor, window: int, dtype: torch.dtype
) -> HybridAttentionState:
    """The state before the first token: an empty window (keep all False) and zero sums in ``dtype``."""
    batch, kv_heads, kept, device = k.shape[0], k.shape[1], window - 1, k.device
    return HybridAttentionState(
        keys=k.new_zeros(batch, kv_heads, kept, k.shape[3]),
        values=v.new_zeros(batch, kv_heads, kept, v.shape[3]),
        key_features=kf.new_zeros(batch, kv_heads, kept, kf.shape[3]),
        keep=torch.zeros(batch, kept, dtype=torch.bool, device=device),
        kv=torch.zeros(batch, kv_heads, kf.shape[3], v.shape[3], dtype=dtype, device=device),
        k_sum=torch.zeros(batch, kv_heads, kf.shape[3], dtype=dtype, device=device),
    )


def accumulation_dtype(q: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (also under autocast)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


__all__ = [
    "HybridAttentionState",
    "hybrid_attention",
]
