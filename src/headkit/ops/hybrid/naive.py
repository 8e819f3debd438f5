"""The test references of the hybrid ops (:mod:`headkit.ops.hybrid`): the dense O(T²) weights of
:func:`~headkit.ops.hybrid.hybrid_attention` with explicit masks, and the one-token-at-a-time lists of
:func:`~headkit.ops.hybrid.sparse_hybrid_attention`. Plain and slow on purpose: the tests compare the parallel
form and the decoding step with them (outputs, states, gradients).
"""

from __future__ import annotations

import torch

from headkit.ops._validation import (
    check_padding_mask,
    check_qkv,
    repeat_kv,
)
from headkit.ops.hybrid.parallel import HybridAttentionState
from headkit.ops.hybrid.sparse import SparseHybridState


def naive_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    balance: torch.Tensor,
    *,
    window: int,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, HybridAttentionState | None]:
    """Test reference for :func:`hybrid_attention` (no initial state): the dense O(T²) weights with explicit masks.

    Computed in q's dtype (pass float64 for a high-precision reference); the state, when asked for, is built
    from its definition (the last W − 1 tokens, and the sums over the others) in that dtype too.
    """
    batch, q_heads, kv_heads, seq = check_qkv(q, k, v)
    groups = q_heads // kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = check_padding_mask(attention_mask, batch, seq)
    if keep is None:
        keep = torch.ones(batch, seq, dtype=torch.bool, device=q.device)

    i = torch.arange(seq, device=q.device)[:, None]
    j = torch.arange(seq, device=q.device)[None, :]
    real = keep[:, None, None, :]
    in_window = (j <= i) & (j > i - window) & real  # [B, 1, T, T]
    in_linear = (j <= i - window) & real

    scores = (q @ repeat_kv(k, groups).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~in_window, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = m.masked_fill(~torch.isfinite(m), 0.0)  # a window with no real key: no weight to stabilise
    window_weights = torch.exp(scores - m)  # exp(−inf) = 0 off the window
    linear_weights = (qf @ repeat_kv(kf, groups).transpose(-1, -2)) * in_linear
    weights = window_weights + balance.to(q.dtype)[None, :, None, None] * linear_weights
    out = (weights @ repeat_kv(v, groups)) / (weights.sum(dim=-1, keepdim=True) + eps)

    if not output_final_state:
        return out, None
    # The state from its definition: the last W − 1 tokens (zeros and keep=False in front when fewer), and the
    # sums over the real tokens before them.
    kept, left = window - 1, max(seq - (window - 1), 0)
    missing = kept - (seq - left)

    def last_tokens(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, X] -> [B, H, W − 1, X]
        return torch.cat([x.new_zeros(*x.shape[:2], missing, x.shape[3]), x[:, :, left:]], dim=2)

    old_features = kf[:, :, :left] * keep[:, None, :left, None]
    state = HybridAttentionState(
        keys=last_tokens(k),
        values=last_tokens(v),
        key_features=last_tokens(kf),
        keep=torch.cat([keep.new_zeros(batch, missing), keep[:, left:]], dim=1),
        kv=old_features.transpose(-1, -2) @ v[:, :, :left],
        k_sum=old_features.sum(dim=2),
    )
    return out, state


def naive_sparse_hybrid_attention(
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
    scale: float | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    key_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, SparseHybridState | None]:
    """Test reference: one token at a time, per sequence and key/value head, with Python lists for the sinks, the
    cache and the folded keys, in the most direct way (:mod:`headkit.ops.hybrid.sparse`). Computed in q's dtype.

    Returns (out [B, H, T, Dv], exact [B, Hkv, T, T] bool — whether key j is in query i's exact set —, the final
    state or None)."""
    batch, q_heads, seq, _ = q.shape
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = torch.ones(batch, seq, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()
    rows, exact = [], torch.zeros(batch, kv_heads, seq, seq, dtype=torch.bool)
    finals = []
    for b in range(batch):
        head_rows, head_finals = [], []
        for h in range(kv_heads):
            sink_list: list[int] = []
            cache: list[tuple[int, float]] = []  # (key index, score), oldest first
            folded: list[int] = []
            reference_kv = q.new_zeros(kf.shape[3], v.shape[3])
            reference_k_sum = q.new_zeros(kf.shape[3])
            outputs = []
            for i in range(seq):
                in_window = [j for j in range(max(0, i - window + 1), i + 1) if keep[b, j]]
                members = sorted(set(in_window) | set(sink_list) | {j for j, _ in cache})
                exact[b, h, i, members] = True
                per_head = []
                for g in range(groups):
                    head = h * groups + g
                    numerator = q.new_zeros(v.shape[3])
                    denominator = q.new_zeros(())
                    if members:
                        scores = (k[b, h, members] @ q[b, head, i]) * scale
                        weights = torch.exp(scores - scores.max())
                        numerator = numerator + weights @ v[b, h, members]
                        denominator = denominator + weights.sum()
                    if folded:
                        linear = balance[head] * (kf[b, h, folded] @ qf[b, head, i])
                        numerator = numerator + linear @ v[b, h, folded]
                        denominator = denominator + linear.sum()
                    per_head.append(numerator / (denominator + eps))
                outputs.append(torch.stack(per_head))
                # After query i, key i − W + 1 leaves the window.
                j = i - window + 1
                if j < 0 or not keep[b, j]:
                    continue
                if len(sink_list) < sinks:
                    sink_list.append(j)
                    continue
                if budget == 0:
                    folded.append(j)
                    continue
                if key_scores is not None:
                    score = float(key_scores[b, h, j])
                else:
                    recalled = (kf[b, h, j] @ reference_kv) / (kf[b, h, j] @ reference_k_sum + eps)
                    score = float((v[b, h, j] - recalled).square().sum().detach())
                    reference_kv = reference_kv + torch.outer(kf[b, h, j], v[b, h, j])
                    reference_k_sum = reference_k_sum + kf[b, h, j]
                cache.append((j, score))
                if len(cache) > budget:
                    # The worst kept key: the lowest score, the latest among equal ones.
                    worst = min(range(len(cache)), key=lambda n: (cache[n][1], -n))
                    folded.append(cache.pop(worst)[0])
            head_rows.append(torch.stack(outputs, dim=1))  # [G, T, Dv]
            head_finals.append((sink_list, cache, folded, reference_kv, reference_k_sum))
        rows.append(torch.cat(head_rows, dim=0))
        finals.append(head_finals)
    out = torch.stack(rows)
    if not output_final_state:
        return out, exact, None
    return out, exact, _naive_state(k, v, kf, keep, window, sinks, budget, finals)


def _naive_state(k, v, kf, keep, window, sinks, budget, finals) -> SparseHybridState:
    """The final state from the reference's lists (layout of :class:`SparseHybridState`)."""
    batch, kv_heads, seq = k.shape[:3]
    dtype = k.dtype
    kept = window - 1
    left = max(seq - kept, 0)
    missing = kept - (seq - left)

    def last_tokens(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.new_zeros(*x.shape[:2], missing, x.shape[3]), x[:, :, left:]], dim=2)

    features, dv = kf.shape[3], v.shape[3]
    kv = k.new_zeros(batch, kv_heads, features, dv)
    k_sum = k.new_zeros(batch, kv_heads, features)
    sink_keys = k.new_zeros(batch, kv_heads, sinks, k.shape[3])
    sink_values = v.new_zeros(batch, kv_heads, sinks, dv)
    sink_keep = torch.zeros(batch, sinks, dtype=torch.bool)
    sparse_keys = k.new_zeros(batch, kv_heads, budget, k.shape[3])
    sparse_values = v.new_zeros(batch, kv_heads, budget, dv)
    sparse_features = kf.new_zeros(batch, kv_heads, budget, features)
    sparse_keep = torch.zeros(batch, kv_heads, budget, dtype=torch.bool)
    sparse_scores = torch.full((batch, kv_heads, budget), float("-inf"), dtype=dtype)
    reference_kv = torch.zeros_like(kv)
    reference_k_sum = torch.zeros_like(k_sum)
    for b in range(batch):
        for h in range(kv_heads):
            sink_list, cache, folded, ref_kv, ref_k_sum = finals[b][h]
            for slot, j in enumerate(sink_list):
                sink_keys[b, h, slot], sink_values[b, h, slot] = k[b, h, j], v[b, h, j]
                sink_keep[b, slot] = True
            first = budget - len(cache)
            for n, (j, score) in enumerate(cache):
                slot = first + n
                sparse_keys[b, h, slot], sparse_values[b, h, slot] = k[b, h, j], v[b, h, j]
                sparse_features[b, h, slot] = kf[b, h, j]
                sparse_keep[b, h, slot] = True
                sparse_scores[b, h, slot] = score
            for j in folded:
                kv[b, h] += torch.outer(kf[b, h, j], v[b, h, j])
                k_sum[b, h] += kf[b, h, j]
            reference_kv[b, h], reference_k_sum[b, h] = ref_kv, ref_k_sum
    window_state = HybridAttentionState(
        keys=last_tokens(k),
        values=last_tokens(v),
        key_features=last_tokens(kf),
        keep=torch.cat([keep.new_zeros(batch, missing), keep[:, left:]], dim=1),
        kv=kv,
        k_sum=k_sum,
    )
    return SparseHybridState(
        window_state,
        sink_keys,
        sink_values,
        sink_keep,
        sparse_keys,
        sparse_values,
        sparse_features,
        sparse_keep,
        sparse_scores,
        reference_kv,
        reference_k_sum,
    )


__all__ = [
    "naive_hybrid_attention",
    "naive_sparse_hybrid_attention",
]
