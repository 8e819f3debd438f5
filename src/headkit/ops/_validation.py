"""Argument checks shared by every kernel in :mod:`headkit.ops`.

Kernels never broadcast silently: a wrong rank, shape or dtype raises a ``ValueError`` that names the
argument and says what was expected.
"""

from __future__ import annotations

import math

import torch


def check_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {layout}, got {type(tensor).__name__}")
    if tensor.dim() != rank:
        raise ValueError(f"{name} must have shape {layout} ({rank} dims), got shape {tuple(tensor.shape)}")


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    allow_gqa: bool = True,
    k_name: str = "k",
    same_head_dim: bool = True,
) -> tuple[int, int, int, int]:
    """Check [batch, heads, seq, head_dim] inputs; return (batch, q_heads, kv_heads, kv_len).

    Query and key/value heads may differ only when the key/value head count divides the query head count
    (grouped-query attention).
    """
    check_rank("q", q, 4, "[batch, heads, seq, head_dim]")
    check_rank(k_name, k, 4, "[batch, kv_heads, seq, head_dim]")
    check_rank("v", v, 4, "[batch, kv_heads, seq, head_dim_v]")
    batch, q_heads, _, head_dim = q.shape
    kb, kv_heads, kv_len, k_dim = k.shape
    if kb != batch or v.shape[0] != batch:
        raise ValueError(
            f"batch sizes differ: q has {batch}, {k_name} has {kb}, v has {v.shape[0]}; expected all equal"
        )
    if v.shape[1] != kv_heads or v.shape[2] != kv_len:
        raise ValueError(
            f"v must have shape [batch, {kv_heads}, {kv_len}, head_dim_v] to match {k_name}, "
            f"got {tuple(v.shape)}"
        )
    if same_head_dim and k_dim != head_dim:
        raise ValueError(f"{k_name} must have head_dim {head_dim} like q, got {k_dim}")
    if kv_heads != q_heads:
        if not allow_gqa:
            raise ValueError(f"{k_name} must have {q_heads} heads like q, got {kv_heads}")
        if kv_heads == 0 or q_heads % kv_heads != 0:
            raise ValueError(
                f"{k_name} has {kv_heads} heads, which does not divide q's {q_heads} heads "
                "(grouped-query attention needs q_heads % kv_heads == 0)"
            )
    return batch, q_heads, kv_heads, kv_len


def check_padding_mask(attention_mask: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor | None:
    """Validate a key padding mask [batch, seq] (bool, or integers 0/1; True/1 = a real token).

    Returns it as a bool tensor, or None.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"attention_mask must be a torch.Tensor of shape [batch, seq] = [{batch}, {seq}], "
            f"got {type(attention_mask).__name__}"
        )
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(
            f"attention_mask must be bool or integer (1 = keep, 0 = padding), got dtype {attention_mask.dtype}"
        )
    if tuple(attention_mask.shape) != (batch, seq):
        raise ValueError(
            f"attention_mask must have shape [batch, seq] = [{batch}, {seq}], got {tuple(attention_mask.shape)}"
        )
    return attention_mask.bool()


def check_batch_position_ids(position_ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Check the positions a model or an attention layer takes: integers [batch or 1, seq]; return them."""
    if (
        not isinstance(position_ids, torch.Tensor)
        or position_ids.dim() != 2
        or position_ids.shape[0] not in (1, batch)
        or position_ids.shape[1] != seq
        or position_ids.dtype.is_floating_point
        or position_ids.dtype.is_complex
        or position_ids.dtype == torch.bool
    ):
        got = (
            f"{tuple(position_ids.shape)} {position_ids.dtype}"
            if isinstance(position_ids, torch.Tensor)
            else type(position_ids).__name__
        )
        raise ValueError(f"position_ids must be integers of shape [{batch} or 1, {seq}], got {got}")
    return position_ids


def check_score_mask(
    attention_mask: torch.Tensor, batch: int, heads: int, q_len: int, kv_len: int, *, one_row: bool = False
) -> None:
    """Check a rank-4 score mask: [batch, 1 or heads, q_len, kv_len] (``one_row``: or a single query row
    broadcast over the queries), bool (True = keep) or float (additive)."""
    mb, mh, mq, mk = attention_mask.shape
    queries_ok = mq == q_len or (one_row and mq == 1)
    if mb != batch or mh not in (1, heads) or not queries_ok or mk != kv_len:
        queries, sizes = ("q_len or 1", f"{q_len}|1") if one_row else ("q_len", f"{q_len}")
        raise ValueError(
            f"attention_mask of rank 4 must have shape [batch, 1 or heads, {queries}, kv_len] = "
            f"[{batch}, 1|{heads}, {sizes}, {kv_len}], got {tuple(attention_mask.shape)}"
        )
    if not (attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point):
        raise ValueError(
            f"a rank-4 attention_mask must be bool (True = keep) or float (additive), got {attention_mask.dtype}"
        )


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is a finite int or float (a bool is not a number here)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def checked_scale(scale: float | None, head_dim: int) -> float:
    """The score scale: 1/√head_dim for None, else a finite number > 0 as a float."""
    if scale is None:
        return head_dim**-0.5
    if not is_finite_number(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 or None, got {scale!r}")
    return float(scale)


def check_eps(eps: float) -> None:
    if not is_finite_number(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number ≥ 0, got {eps!r}")


def check_positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * groups, T, D], each key/value head serving `groups` query heads."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)
