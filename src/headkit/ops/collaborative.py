"""Collaborative multi-head attention scores (Cordonnier, Loukas & Jaggi 2020, "Multi-Head Attention:
Collaborate Instead of Concatenate", §3).

All heads share one query projection and one key projection of width D̃; head h re-weights the shared
dimensions with its mixing vector m_h:

    score_h(i, j) = scale · (q̃_i ⊙ m_h) · k̃_j + c_{h,j}

where q̃ = X W̃_Q, k̃ = X W̃_K and c_{h,j} is the per-head *content bias* of key j — the one bias term that
survives when a trained model with query/key biases is re-expressed collaboratively (b_{Q,h}ᵀ W_{K,h} x_j;
the terms that are constant over keys cancel in the softmax, §4 of the paper).
"""

from __future__ import annotations

import torch

from headkit.ops._validation import check_rank
from headkit.ops.softmax import softmax_attention


def _check_collaborative(
    q_shared: torch.Tensor,
    k_shared: torch.Tensor,
    mixing: torch.Tensor,
    content_bias: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    check_rank("q_shared", q_shared, 3, "[batch, q_len, dim_shared]")
    check_rank("k_shared", k_shared, 3, "[batch, kv_len, dim_shared]")
    check_rank("mixing", mixing, 2, "[heads, dim_shared]")
    batch, _, dim_shared = q_shared.shape
    if k_shared.shape[0] != batch or k_shared.shape[2] != dim_shared:
        raise ValueError(
            f"k_shared must have shape [{batch}, kv_len, {dim_shared}] to match q_shared, got {tuple(k_shared.shape)}"
        )
    heads = mixing.shape[0]
    if mixing.shape[1] != dim_shared:
        raise ValueError(f"mixing must have shape [heads, {dim_shared}], got {tuple(mixing.shape)}")
    kv_len = k_shared.shape[1]
    if content_bias is not None:
        check_rank("content_bias", content_bias, 3, f"[batch, heads, kv_len] = [{batch}, {heads}, {kv_len}]")
        if tuple(content_bias.shape) != (batch, heads, kv_len):
            raise ValueError(
                f"content_bias must have shape [batch, heads, kv_len] = [{batch}, {heads}, {kv_len}], "
                f"got {tuple(content_bias.shape)}"
            )
    return batch, heads, kv_len, dim_shared


def collaborative_scores(
    q_shared: torch.Tensor,
    k_shared: torch.Tensor,
    mixing: torch.Tensor,
    *,
    content_bias: torch.Tensor | None = None,
    scale: float,
) -> torch.Tensor:
    """Pre-softmax scores [B, H, Tq, Tk] of collaborative heads.

    Args:
        q_shared: shared queries X W̃_Q, [B, Tq, D̃].
        k_shared: shared keys X W̃_K, [B, Tk, D̃].
        mixing: per-head mixing vectors m_h, [H, D̃].
        content_bias: per-head, per-key bias c_{h,j}, [B, H, Tk] (added unscaled), or None.
        scale: multiplies the mixed dot products (1/√head_dim of the multi-head model being re-expressed).
    """
    _check_collaborative(q_shared, k_shared, mixing, content_bias)
    mixed_queries = q_shared[:, None] * mixing[None, :, None, :]
    scores = scale * mixed_queries @ k_shared[:, None].transpose(-1, -2)
    if content_bias is not None:
        scores = scores + content_bias[:, :, None, :]
    return scores


def collaborative_attention(
    q_shared: torch.Tensor,
    k_shared: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    *,
    content_bias: torch.Tensor | None = None,
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Collaborative attention output [B, H, Tq, Dv] through scaled_dot_product_attention.

    Each head's mixed queries q̃ ⊙ m_h attend over the shared keys; the content bias rides along as one extra
    dimension (query side 1, key side c_{h,j}/scale), so the whole score is a single dot product and SDPA's
    fused kernels apply. ``scale`` defaults to 1/√Dv, the per-head width of the model being re-expressed.
    Masks follow :func:`headkit.ops.softmax_attention`.
    """
    batch, heads, kv_len, dim_shared = _check_collaborative(q_shared, k_shared, mixing, content_bias)
    check_rank("v", v, 4, f"[batch, heads, kv_len, head_dim_v] = [{batch}, {heads}, {kv_len}, Dv]")
    if tuple(v.shape[:3]) != (batch, heads, kv_len):
        raise ValueError(
            f"v must have shape [batch, heads, kv_len, head_dim_v] = [{batch}, {heads}, {kv_len}, Dv], "
            f"got {tuple(v.shape)}"
        )
    if scale is None:
        scale = v.shape[-1] ** -0.5
    queries = q_shared[:, None] * mixing[None, :, None, :]
    keys = k_shared[:, None].expand(batch, heads, kv_len, dim_shared)
    if content_bias is not None:
        ones = queries.new_ones(*queries.shape[:-1], 1)
        queries = torch.cat([queries, ones], dim=-1)
        keys = torch.cat([keys, (content_bias / scale)[..., None].to(keys.dtype)], dim=-1)
    return softmax_attention(queries, keys, v, causal=causal, attention_mask=attention_mask, scale=scale)


def naive_collaborative_attention(
    q_shared: torch.Tensor,
    k_shared: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    *,
    content_bias: torch.Tensor | None = None,
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Test reference: explicit scores, masks and softmax, head by head (no fused kernels)."""
    scale = v.shape[-1] ** -0.5 if scale is None else scale
    batch, heads, kv_len, _ = v.shape
    q_len = q_shared.shape[1]
    outputs = []
    for h in range(heads):
        scores = scale * (q_shared * mixing[h]) @ k_shared.transpose(-1, -2)  # [B, Tq, Tk]
        if content_bias is not None:
            scores = scores + content_bias[:, h, None, :]
        keep = torch.ones(batch, q_len, kv_len, dtype=torch.bool, device=v.device)
        if causal:
            keep &= torch.ones(q_len, kv_len, dtype=torch.bool, device=v.device).tril(kv_len - q_len)
        if attention_mask is not None:
            keep &= attention_mask.bool()[:, None, :]
        scores = scores.masked_fill(~keep, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        outputs.append(weights @ v[:, h])
    return torch.stack(outputs, dim=1)
