"""Scaled dot-product (softmax) attention, the baseline every other mechanism is measured against.

Vaswani et al. 2017, Eq. 1: softmax(Q Kᵀ / √d) V, computed by
:func:`torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels where available).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headkit.ops._validation import check_padding_mask, check_qkv, check_score_mask, repeat_kv
from headkit.ops.quantized_attention import CodedSlots, quantized_attention_partials


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Softmax attention over [batch, heads, seq, head_dim] tensors.

    Args:
        q: queries [B, H, Tq, D].
        k, v: keys and values [B, Hkv, Tk, D] / [B, Hkv, Tk, Dv]; ``H % Hkv == 0`` (grouped-query attention).
        causal: query i sees keys j ≤ i + (Tk − Tq) (the queries are the last Tq positions, as when decoding
            with a cache).
        attention_mask: either a key padding mask [B, Tk] (bool or 0/1 integers, True = keep), or a full
            mask [B, 1 or H, Tq, Tk], bool (True = keep) or float (added to the scores).
        scale: score scale, 1/√D by default.
        validate: check the arguments. ``False`` is for callers that have (an attention layer on its own
            projections and a validated mask): a key padding mask must then be bool.

    Returns:
        [B, H, Tq, Dv]. Queries that see no key at all (fully padded rows) return zeros rather than NaN.
    """
    if validate:
        check_qkv(q, k, v)
    batch, q_heads, q_len, _ = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    k = repeat_kv(k, q_heads // kv_heads)
    v = repeat_kv(v, q_heads // kv_heads)

    mask = _full_mask(attention_mask, batch, q_heads, q_len, kv_len, q.device, validate)
    if causal:
        if mask is None and q_len == kv_len:  # SDPA's own causal kernels never build the [T, T] mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
        mask = allowed if mask is None else _and_mask(mask, allowed)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    # A query row with no visible key would be a softmax over nothing (NaN): let it see every key, zero it after.
    if mask.dtype == torch.bool:
        empty_rows = ~mask.any(dim=-1, keepdim=True)
        mask = mask | empty_rows
    else:
        mask = mask.to(q.dtype)
        empty_rows = torch.isneginf(mask).all(dim=-1, keepdim=True)
        mask = mask.masked_fill(empty_rows, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.masked_fill(empty_rows, 0.0)


def softmax_attention_static_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    keep: torch.Tensor,
    seen: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """One decoding step of one real token per row over a fixed-size key/value buffer, updated in place (a
    compiled step keeps one graph and the buffers' addresses, as transformers' ``StaticCache`` does).

    q [B, H, 1, D]; k, v [B, Hkv, 1, ·] the new key and value; keys [B, Hkv, L, D], values [B, Hkv, L, Dv] and
    keep [B, L] (True = a real token) the buffer, ``seen`` an int64 scalar tensor, the tokens it holds. The new
    token is written at slot ``seen``, which then advances. Returns out [B, H, 1, Dv]: softmax over the real
    keys, :func:`softmax_attention` of the query over the held keys and the new one (its reference in tests).
    The G query heads of a key/value head are the G query rows of one SDPA call: keys are never repeated."""
    slot = seen.view(1)
    keys.index_copy_(2, slot, k.to(keys.dtype))
    values.index_copy_(2, slot, v.to(values.dtype))
    keep.index_fill_(1, slot, True)
    seen.add_(1)
    return grouped_query_step_attention(
        q.to(keys.dtype), keys, values, keep[:, None, None, :], scale=scale
    ).to(q.dtype)


def softmax_attention_coded_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: CodedSlots,
    values: CodedSlots,
    keep: torch.Tensor,
    seen: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """:func:`softmax_attention_static_step_` over a buffer stored as codes (a quantized cache's retrieval heads on
    the fast decoder: :class:`~headkit.ops.quantized_attention.CodedSlots`): the held tokens attended on their
    codes (:func:`headkit.ops.quantized_attention.quantized_attention_partials`), the new token in full precision,
    under one normaliser. The new key and value are handed back in ``keys.entering`` / ``values.entering``
    [B, Hkv, ·] for the caller to store at slot ``seen`` (before the step), which then advances; ``keep`` marks it."""
    batch, q_heads, _, head_dim = q.shape
    kv_heads, value_dim = k.shape[1], v.shape[-1]
    rows = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim).to(torch.float32)
    held_max, held_sum, held_numerator = quantized_attention_partials(
        rows, keys.codes, values.codes, keep[:, None, :], scale=scale, value_dim=value_dim
    )  # the slot the new token takes is not kept yet
    new_score = (rows @ k.to(torch.float32).transpose(-1, -2)) * scale  # [B, Hkv, G, 1]
    top = torch.maximum(held_max, new_score)
    held, new = torch.exp(held_max - top), torch.exp(new_score - top)
    out = (held * held_numerator + new * v.to(torch.float32)) / (held * held_sum + new)
    keys.entering.copy_(k[:, :, 0].to(keys.entering.dtype))
    values.entering.copy_(v[:, :, 0].to(values.entering.dtype))
    keep.index_fill_(1, seen.view(1), True)
    seen.add_(1)
    return out.reshape(batch, q_heads, 1, value_dim).to(q.dtype)


def grouped_query_step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention of one query token per row over a grouped-query key/value cache, keys never repeated
    (Ainslie et al. 2023, GQA): the G = H / Hkv query heads that share a key/value head are the G query rows of
    one SDPA call over that head's keys. Repeating the keys (transformers' ``repeat_kv`` before SDPA when a mask
    is given) copies the whole cache G times per step: at 8,192 tokens most of a small model's decoding step.

    q [B, H, 1, D]; k [B, Hkv, L, D], v [B, Hkv, L, Dv]; mask None, or [B, 1, 1, L] (True = attend, or additive:
    the same for every head). Returns [B, H, 1, Dv], equal to :func:`softmax_attention` over the keys repeated
    per query head (its reference in tests)."""
    batch, q_heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    if length != 1 or q_heads % kv_heads:
        raise ValueError(
            f"q must be one token per row [B, H, 1, D] with H a multiple of the {kv_heads} key/value heads, "
            f"got {list(q.shape)}"
        )
    if mask is not None and mask.dim() == 4 and mask.shape[1] != 1:
        raise ValueError(f"mask must be the same for every head, [B, 1, 1, L]; got {list(mask.shape)}")
    rows = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    if q.dtype == torch.float32:
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
    else:
        # Written out, scores and softmax in float32: for one query token over thousands of bfloat16 keys, SDPA's
        # CPU flash kernel measured 2.4× slower than this (822 against 346 µs at 8,448 keys; docs/decoding.md).
        scale = head_dim**-0.5 if scale is None else scale
        scores = torch.matmul(rows, k.transpose(-1, -2)).float() * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    return out.reshape(batch, q_heads, 1, v.shape[3])


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention written out, as 🤗 decoders' own "eager" attention computes it, for the layers a
    converted model leaves softmax when the model ran eager (sdpa refuses Gemma 2's soft-capping).

    scores = Q Kᵀ · scale; with ``softcap`` c, c · tanh(scores / c) (Gemma 2's logit soft-capping); plus the
    additive mask, or −∞ where a bool mask is False; softmax in float32, cast back; dropout; times V.

    Args:
        query: [B, H, Tq, D]; key, value: [B, Hkv, Tk, D] / [B, Hkv, Tk, Dv], ``H % Hkv == 0``.
        attention_mask: None, or [B, 1|H, Tq, ≥Tk] additive float or bool (True = keep); columns past Tk are
            ignored (a static cache's mask may be longer).
        scale: 1/√D by default.

    Returns:
        (output [B, Tq, H, Dv] — the layout 🤗 attention functions return —, weights [B, H, Tq, Tk]).
    """
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask.to(scores.dtype)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _full_mask(
    attention_mask: torch.Tensor | None,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    validate: bool,
) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        if validate:
            check_score_mask(attention_mask, batch, heads, q_len, kv_len)
        return attention_mask.to(device)
    keep = check_padding_mask(attention_mask, batch, kv_len) if validate else attention_mask
    return keep[:, None, None, :].to(device)


def _and_mask(mask: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))
