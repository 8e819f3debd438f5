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
import torch.nn.functional as F

from headkit.ops._validation import check_padding_mask, check_rank, check_score_mask
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
    return _scores(q_shared, k_shared, mixing, content_bias, scale)


def _scores(
    q_shared: torch.Tensor,
    k_shared: torch.Tensor,
    mixing: torch.Tensor,
    content_bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """:func:`collaborative_scores` of checked arguments."""
    batch, q_len, dim_shared = q_shared.shape
    heads, kv_len = mixing.shape[0], k_shared.shape[1]
    mixed_queries = q_shared[:, None] * (scale * mixing)[None, :, None, :]  # [B, H, Tq, D̃]
    # One matrix product per batch row, every head's queries against the one shared key (never copied per head).
    scores = torch.bmm(mixed_queries.reshape(batch, heads * q_len, dim_shared), k_shared.transpose(1, 2))
    scores = scores.view(batch, heads, q_len, kv_len)
    if content_bias is not None:
        # In place (bmm keeps its inputs for backward, not its output), from a contiguous source (2× faster on
        # CPU than broadcasting a transposed [B, T, H] view).
        scores = scores.add_(content_bias.contiguous()[:, :, None, :])
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
    kernel: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Collaborative attention output [B, H, Tq, Dv] through scaled_dot_product_attention's fused kernels.

    Head h's queries are the mixed shared queries q̃ ⊙ m_h; every head attends over the one shared key k̃ (a
    stride-0 view across heads, never copied). What depends on the key alone — the content bias c_{h,j} and a
    key padding mask — is one additive float mask [B, H, 1, Tk] that SDPA broadcasts over the queries, so no
    [Tq, Tk] tensor is built. A causal call (Tq > 1) cannot combine SDPA's causal kernel with a mask: the content
    bias then rides along as one extra dimension (query side 1, key side c_{h,j}/scale) and the call is
    :func:`headkit.ops.softmax_attention`'s (fused causal kernel; with a padding mask, or Tq ≠ Tk, that builds a
    [B, 1, Tq, Tk] bool mask, as it does for ordinary heads). Off CUDA, SDPA's fused kernel needs one width for
    queries, keys and values: the narrower side is zero-padded (which changes no score and no output); on CUDA
    each width is rounded up to a multiple of 8 for the memory-efficient kernel.

    Args:
        q_shared, k_shared: shared queries and keys, [B, Tq, D̃] / [B, Tk, D̃].
        v: values [B, H, Tk, Dv] (one per head; repeat grouped key/value heads first).
        mixing: per-head mixing vectors m_h, [H, D̃].
        content_bias: per-head, per-key bias c_{h,j}, [B, H, Tk], added to the scaled scores; or None.
        causal: query i sees keys j ≤ i + (Tk − Tq).
        attention_mask: a key padding mask [B, Tk] (bool or 0/1 integers, True = keep), or a mask
            [B, 1 or H, Tq or 1, Tk], bool (True = keep) or float (added to the scores).
        scale: multiplies the mixed dot products; 1/√Dv (the per-head width of the model being re-expressed)
            by default.
        kernel: "fused" (SDPA, as above), "explicit" (:func:`collaborative_attention_weights`, then the values:
            every head's scores [Tq, Tk] in one matrix product against the shared key), or "auto": explicit
            when Tk ≤ D̃ — short sequences, where a head's scores are no larger than its mixed queries and one
            product over the D̃-wide shared key beats SDPA's per-head kernel on values padded to D̃ — else fused.
        validate: check the arguments. ``False`` is for callers that have (an attention layer on its own
            projections and a validated mask): a key padding mask must then be bool.

    Returns:
        [B, H, Tq, Dv]. Queries that see no key at all return zeros.
    """
    if validate:
        _check_values(v, *_check_collaborative(q_shared, k_shared, mixing, content_bias)[:3])
    if kernel not in ("auto", "fused", "explicit"):
        raise ValueError(f"kernel must be 'auto', 'fused' or 'explicit', got {kernel!r}")
    batch, q_len, dim_shared = q_shared.shape
    heads, kv_len = mixing.shape[0], k_shared.shape[1]
    if scale is None:
        scale = v.shape[-1] ** -0.5
    if kernel == "explicit" or (kernel == "auto" and kv_len <= dim_shared):
        weights, empty_rows = _explicit_weights(
            q_shared,
            k_shared,
            mixing,
            content_bias=content_bias,
            causal=causal,
            attention_mask=attention_mask,
            scale=scale,
            validate=validate,
        )
        out = weights @ v
        return out if empty_rows is None else out.masked_fill(empty_rows, 0.0)
    key_term, query_mask = _split_mask(attention_mask, batch, heads, q_len, kv_len, validate)
    causal = causal and q_len > 1  # a single query is the newest position: it sees every key
    queries = q_shared[:, None] * mixing[None, :, None, :]  # [B, H, Tq, D̃]
    keys = k_shared[:, None].expand(batch, heads, kv_len, dim_shared)

    if not causal and query_mask is None:
        # Everything but the dot products depends on the key alone: one [B, H|1, 1, Tk] additive mask.
        if key_term is not None and key_term.dtype == torch.bool:
            key_term = torch.zeros(key_term.shape, dtype=queries.dtype, device=queries.device).masked_fill(
                ~key_term, float("-inf")
            )
        if content_bias is not None:
            key_term = content_bias if key_term is None else key_term + content_bias
        if key_term is not None:
            key_term = key_term.to(queries.dtype)
        return _fused_attention(queries, keys, v, key_term, scale)

    # A key-only mask meets the causal one: softmax_attention builds [B, 1|H, Tq, Tk] from it.
    if key_term is not None:
        if key_term.dtype == torch.bool and key_term.shape[1] == 1:
            query_mask = key_term[:, 0]  # a key padding mask [B, Tk]
        else:
            query_mask = key_term[:, :, None, :].expand(batch, key_term.shape[1], q_len, kv_len)
    if query_mask is not None and query_mask.dtype != torch.bool:
        query_mask = query_mask.to(queries.dtype)
    key_column = None if content_bias is None else content_bias / scale
    queries, keys, values, width = _kernel_widths(queries, keys, v, key_column)
    out = softmax_attention(
        queries, keys, values, causal=causal, attention_mask=query_mask, scale=scale, validate=False
    )
    return out[..., :width]


def collaborative_attention_weights(
    q_shared: torch.Tensor,
    k_shared: torch.Tensor,
    mixing: torch.Tensor,
    *,
    content_bias: torch.Tensor | None = None,
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    scale: float,
    validate: bool = True,
) -> torch.Tensor:
    """The collaborative attention probabilities [B, H, Tq, Tk], computed explicitly (softmax in float32 or wider).

    The path for callers that need the weights themselves (``output_attentions``, dropout on the weights);
    masks and ``validate`` as in :func:`collaborative_attention`. A query that sees no key gets an all-zero
    row, never NaN.
    """
    if validate:
        _check_collaborative(q_shared, k_shared, mixing, content_bias)
    weights, empty_rows = _explicit_weights(
        q_shared,
        k_shared,
        mixing,
        content_bias=content_bias,
        causal=causal,
        attention_mask=attention_mask,
        scale=scale,
        validate=validate,
    )
    if empty_rows is None:
        return weights
    if weights.requires_grad:  # softmax keeps its output for backward: not in place then
        return weights.masked_fill(empty_rows, 0.0)
    return weights.masked_fill_(empty_rows, 0.0)


def _explicit_weights(
    q_shared: torch.Tensor,
    k_shared: torch.Tensor,
    mixing: torch.Tensor,
    *,
    content_bias: torch.Tensor | None,
    causal: bool,
    attention_mask: torch.Tensor | None,
    scale: float,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weights [B, H, Tq, Tk], rows that see no key [.., Tq or 1, 1] or None): the rows flagged hold finite
    values that the caller zeroes — in the weights, or, cheaper, in the output weights @ v. The arguments
    but the mask are checked already; ``validate``: check the mask.

    Works in place where autograd allows: fresh [B, H, Tq, Tk] tensors cost page faults as well as a pass on
    CPU. A key-only mask without causality joins the content bias (one pass over the scores).
    """
    batch, q_len = q_shared.shape[:2]
    heads, kv_len = mixing.shape[0], k_shared.shape[1]
    key_term, query_mask = _split_mask(attention_mask, batch, heads, q_len, kv_len, validate)
    empty_rows = None
    if key_term is not None and query_mask is None and not causal:
        if key_term.dtype == torch.bool:
            key_term = torch.zeros(key_term.shape, device=q_shared.device).masked_fill(
                ~key_term, float("-inf")
            )
        key_term = key_term.to(q_shared.dtype)
        empty_rows = torch.isneginf(key_term).all(dim=-1, keepdim=True)  # [B, 1|H, 1]
        key_term = key_term.masked_fill(empty_rows, 0.0).expand(batch, heads, kv_len)
        content_bias = key_term if content_bias is None else content_bias + key_term
        key_term, empty_rows = None, empty_rows[..., None]
    scores = _scores(q_shared, k_shared, mixing, content_bias, scale)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    mask = query_mask if key_term is None else key_term[:, :, None, :]
    blocked = None  # True where a query may not see a key; broadcasts against the scores
    if causal:
        blocked = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).triu(kv_len - q_len + 1)
    if mask is not None:
        if mask.dtype != torch.bool:  # additive; its -inf entries block (so that no NaN reaches a gradient)
            mask_blocked = torch.isneginf(mask)
            scores = scores.add_(mask.to(scores.dtype).masked_fill(mask_blocked, 0.0))
        else:
            mask_blocked = ~mask.to(scores.device)
        blocked = mask_blocked if blocked is None else blocked | mask_blocked
    if blocked is None:
        return scores.softmax(dim=-1).to(q_shared.dtype), empty_rows
    # A row with every key blocked would be a softmax over nothing (NaN): it sees every key, flagged for zeroing.
    empty_rows = blocked.all(dim=-1, keepdim=True)
    weights = scores.masked_fill_(blocked & ~empty_rows, float("-inf")).softmax(dim=-1)
    return weights.to(q_shared.dtype), empty_rows


def _check_values(v: torch.Tensor, batch: int, heads: int, kv_len: int) -> None:
    check_rank("v", v, 4, f"[batch, heads, kv_len, head_dim_v] = [{batch}, {heads}, {kv_len}, Dv]")
    if tuple(v.shape[:3]) != (batch, heads, kv_len):
        raise ValueError(
            f"v must have shape [batch, heads, kv_len, head_dim_v] = [{batch}, {heads}, {kv_len}, Dv], "
            f"got {tuple(v.shape)}"
        )


def _split_mask(
    attention_mask: torch.Tensor | None, batch: int, heads: int, q_len: int, kv_len: int, validate: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(key term, query mask): a mask that is the same for every query becomes a key term [B, 1|H, Tk] (bool
    True = keep, or additive float); one that varies over the queries stays [B, 1|H, Tq, Tk]."""
    if attention_mask is None:
        return None, None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        if validate:
            check_score_mask(attention_mask, batch, heads, q_len, kv_len, one_row=True)
        if (
            attention_mask.shape[2] == 1 or attention_mask.stride(2) == 0
        ):  # one row, or one row broadcast over the queries
            key_mask = attention_mask[:, :, 0]
        else:
            return None, attention_mask
    else:
        key_mask = (check_padding_mask(attention_mask, batch, kv_len) if validate else attention_mask)[
            :, None
        ]
    return key_mask, None


def _fused_attention(
    queries: torch.Tensor, keys: torch.Tensor, v: torch.Tensor, key_term: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA with a per-key additive mask [B, H|1, Tk] (or none); a head whose every key is -inf returns zeros."""
    queries, keys, values, width = _kernel_widths(queries, keys, v)
    if key_term is None:
        return F.scaled_dot_product_attention(queries, keys, values, scale=scale)[..., :width]
    empty = torch.isneginf(key_term).all(dim=-1)[..., None, None]  # [B, H|1, 1, 1]
    mask = key_term[:, :, None, :].masked_fill(empty, 0.0)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out[..., :width].masked_fill(empty, 0.0)


def _kernel_widths(
    queries: torch.Tensor,
    keys: torch.Tensor,
    v: torch.Tensor,
    key_column: torch.Tensor | None = None,
    *,
    device_type: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Queries, keys and values in widths SDPA's fused kernels take, and the values' own width (to slice the
    output back to); ``key_column`` [B, H, Tk], if given, becomes one more dimension (1 on the query side).
    Zero columns change no dot product, and zero value columns only add zero output columns.

    SDPA's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``) takes only queries, keys and
    values of one width; anything else falls back to the math kernel, which builds the [Tq, Tk] scores. CUDA's
    memory-efficient kernel takes unequal widths but wants each a multiple of 8 (the content-bias column makes
    D̃ + 1), so there each side is only rounded up. Each side is built in one concatenation. ``device_type``
    overrides the tensors' own (so that tests on a CPU can check what CUDA gets).
    """
    width_qk = queries.shape[-1] + (key_column is not None)
    width_v = v.shape[-1]
    if (device_type or queries.device.type) == "cuda":
        target_qk, target_v = _round_up(width_qk, _ALIGNMENT), _round_up(width_v, _ALIGNMENT)
    elif width_qk == width_v:
        target_qk = target_v = width_v
    else:
        target_qk = target_v = _round_up(max(width_qk, width_v), _ALIGNMENT)
    zeros = target_qk - width_qk
    if key_column is not None or zeros:
        query_parts, key_parts = [queries], [keys]
        if key_column is not None:
            query_parts.append(queries.new_ones(*queries.shape[:-1], 1))
            key_parts.append(key_column[..., None].to(keys.dtype))
        if zeros:
            query_parts.append(queries.new_zeros(*queries.shape[:-1], zeros))
            key_parts.append(keys.new_zeros(*keys.shape[:-1], zeros))
        queries, keys = torch.cat(query_parts, dim=-1), torch.cat(key_parts, dim=-1)
    if target_v > width_v:
        v = F.pad(v, (0, target_v - width_v))
    return queries, keys, v, width_v


_ALIGNMENT = 8


def _round_up(width: int, multiple: int) -> int:
    return -(-width // multiple) * multiple


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
    keep = torch.ones(batch, heads, q_len, kv_len, dtype=torch.bool, device=v.device)
    added = torch.zeros(batch, heads, q_len, kv_len, dtype=q_shared.dtype, device=v.device)
    if causal:
        keep &= torch.ones(q_len, kv_len, dtype=torch.bool, device=v.device).tril(kv_len - q_len)
    if attention_mask is not None and attention_mask.dim() == 2:
        keep &= attention_mask.bool()[:, None, None, :]
    elif attention_mask is not None and attention_mask.dtype == torch.bool:
        keep &= attention_mask
    elif attention_mask is not None:  # additive; -inf blocks (masked_fill keeps NaN out of the gradients)
        keep &= ~torch.isneginf(attention_mask)
        added = added + attention_mask.masked_fill(torch.isneginf(attention_mask), 0.0)
    outputs = []
    for h in range(heads):
        scores = scale * (q_shared * mixing[h]) @ k_shared.transpose(-1, -2)  # [B, Tq, Tk]
        if content_bias is not None:
            scores = scores + content_bias[:, h, None, :]
        scores = (scores + added[:, h]).masked_fill(~keep[:, h], float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        outputs.append(weights @ v[:, h])
    return torch.stack(outputs, dim=1)
