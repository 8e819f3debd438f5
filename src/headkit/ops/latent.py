"""Attention over a shared key/value latent with a few rotary key dimensions (multi-head latent attention, MLA).

DeepSeek-V2 (arXiv:2405.04434, Sec. 2.1.2–2.1.3) caches, per token, one latent c ∈ ℝ^R shared by every head plus a
few rotary key dimensions; head h's key and value are up-projections of it:

    k_h = [k_rope,g(h) ; K_g(h) c],        v_h = V_g(h) c + b_g(h)

(g(h) the key/value group of query head h, K_g [n, R], V_g [head_dim, R]). MHA2MLA (Ji et al. 2025,
arXiv:2502.14837, Eq. 4–7) converts a trained grouped-query model to this form: partial RoPE leaves D rotary
dimensions per key/value head and makes the other n = head_dim − D rotary-free, and a joint SVD of the rotary-free
key and the value projections gives the latent.

The score of query head h against token s is q_rope,h · k_rope,g,s + q_nope,h · K_g c_s = q_rope,h · k_rope,g,s +
(K_gᵀ q_nope,h) · c_s, and its output V_g (Σ_s a_s c_s) + b_g: with the key up-projection absorbed into the query
and the value up-projection applied after the weighted sum (equivalently, absorbed into the output projection),
attention reads only the cache — never the per-head keys and values expanded from it.

With TransMLA's RoRoPE (Meng et al. 2025, arXiv:2502.07864, Sec. 4.2) the rotary keys are mixed across the
groups, so a head's rotary query spans every group's block (``shared_rope``) rather than its own.

:func:`latent_attention` computes this absorbed form as attention of every head against a single shared key
``[c ; k_rope,1 ; … ; k_rope,G]`` (the cache row as it is stored): each query head carries its absorbed query in
the latent part and its rotary query in its own group's block, zeros elsewhere, so the zeros cancel the other
groups' rotary keys and every head reads the one cache. :func:`naive_latent_attention`
is its obviously-correct twin: expand every head's keys and values from the latent, then softmax attention
(:func:`naive_shared_rope_latent_attention` with ``shared_rope``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from headkit.ops.softmax import eager_attention


class LatentProjection(NamedTuple):
    """How a layer's keys and values come out of its cache row [c ; k_rope,1 ; … ; k_rope,G] (G key/value groups).

    key_up: K_g [G, n, R], the rotary-free key dims from the latent; value_up: V_g [G, head_dim, R]; value_bias:
    b_g [G, head_dim] or None; rope_index [G, D] / nope_index [G, n]: the head dims that are rotary (stored) and
    rotary-free (up-projected) in each group's keys."""

    key_up: torch.Tensor
    value_up: torch.Tensor
    value_bias: torch.Tensor | None
    rope_index: torch.Tensor
    nope_index: torch.Tensor


def latent_queries(
    query_nope: torch.Tensor, query_rope: torch.Tensor, key_up: torch.Tensor, *, shared_rope: bool = False
) -> torch.Tensor:
    """The absorbed queries [B, H, T, R + G·D]: head h's (K_gᵀ q_nope,h) then its rotary query in block g(h).

    query_nope [B, H, T, n] (rotary-free part), query_rope [B, H, T, D], key_up [G, n, R]; H a multiple of G.
    With ``shared_rope``, query_rope [B, H, T, G·D] is already head h's query against every group's rotary keys
    (TransMLA's RoRoPE mixes the groups' rotary keys, so a head reads all of them) and is taken as it is."""
    batch, heads, length, nope = query_nope.shape
    groups, _, rank = key_up.shape
    per_group = heads // groups
    absorbed = query_nope.reshape(batch, groups, per_group * length, nope) @ key_up.unsqueeze(0)
    if shared_rope:
        packed = torch.cat((absorbed.reshape(batch, heads, length, rank), query_rope), dim=-1)
        return packed
    rope = query_rope.shape[-1]
    blocks = query_rope.new_zeros(batch, groups, per_group * length, groups, rope)
    index = torch.arange(groups, device=query_rope.device)
    blocks[:, index, :, index] = query_rope.reshape(batch, groups, per_group * length, rope).transpose(0, 1)
    packed = torch.cat((absorbed, blocks.flatten(-2)), dim=-1)
    return packed.reshape(batch, heads, length, rank + groups * rope)


def latent_attention(
    query_nope: torch.Tensor,
    query_rope: torch.Tensor,
    cache: torch.Tensor,
    projection: LatentProjection,
    attention_mask: torch.Tensor | None,
    *,
    scale: float,
    is_causal: bool = False,
    shared_rope: bool = False,
) -> torch.Tensor:
    """Absorbed latent attention (see the module docstring). Returns [B, H, T, head_dim].

    One query per row (a decoding step): the heads' queries are the rows of one query block against the cache as
    a single key/value head, through ``scaled_dot_product_attention`` (the cache never copied per head, each of
    its blocks read once). A prompt goes through ``scaled_dot_product_attention`` with the cache as every head's
    one key and value, whose fused kernel never materialises the scores.

    Args:
        query_nope: [B, H, T, n], the rotary-free queries; query_rope: [B, H, T, D], the rotary queries (with
            ``shared_rope``, [B, H, T, G·D]: each head's query against every group's rotary keys).
        cache: [B, S, R + G·D], per token the latent c then each group's D rotary key dimensions.
        projection: the layer's up-projections (:class:`LatentProjection`; its indices are not needed here).
        attention_mask: None or bool [B or 1, 1, T, S] (True = attend; every row attends somewhere); is_causal:
            a causal mask over T = S instead.
        scale: the score scale.
    """
    key_up, value_up, value_bias = projection.key_up, projection.value_up, projection.value_bias
    batch, heads, length, _ = query_nope.shape
    groups, head_dim, rank = value_up.shape
    per_group = heads // groups
    keys_total = cache.shape[1]
    queries = latent_queries(query_nope, query_rope, key_up, shared_rope=shared_rope)
    if length > 1:
        # A prompt: one shared key and value per token for every head, through SDPA's fused kernel, which never
        # holds the [H, T, S] scores (at 8,192 tokens 2.4 GB a layer in float32). The whole row is the value too:
        # the fused CPU kernel wants the keys' width, and with it the prompt ran 6.4x faster (2,048 tokens, measured).
        shared = cache[:, None].expand(batch, heads, keys_total, cache.shape[-1])
        mixed = torch.nn.functional.scaled_dot_product_attention(
            queries, shared, shared, attn_mask=attention_mask, is_causal=is_causal, scale=scale
        )[..., :rank]
    else:
        # A step: the heads' one query each are the rows of a single query block against the cache as one key and
        # value head (the multi-query layout), so the fused kernel reads each block of the cache once for the
        # scores and the weighted sum; two batched products read it twice (SmolLM2 at a quarter of the
        # cache, batch 8, 8,192 tokens: 1.27x -> 1.83x the original's fast step, docs/latent-kv.md). The mask
        # [B or 1, 1, 1, S] is every head's.
        row = cache[:, None]
        mixed = torch.nn.functional.scaled_dot_product_attention(
            queries.reshape(batch, 1, heads, -1), row, row, attn_mask=attention_mask, scale=scale
        )[:, 0, :, :rank]
    output = mixed.reshape(batch, groups, per_group * length, rank) @ value_up.transpose(1, 2).unsqueeze(0)
    if value_bias is not None:
        output = output + value_bias[None, :, None]
    return output.reshape(batch, heads, length, head_dim)


def expand_latent(cache: torch.Tensor, projection: LatentProjection) -> tuple[torch.Tensor, torch.Tensor]:
    """Every key/value head's keys and values [B, G, S, head_dim] from the cache [B, S, R + G·D]: key dims
    ``rope_index[g]`` hold the stored rotary keys, dims ``nope_index[g]`` the up-projected latent."""
    key_up, value_up, value_bias, rope_index, nope_index = projection
    groups, head_dim, rank = value_up.shape
    batch, length, _ = cache.shape
    latent = cache[..., :rank].unsqueeze(1)  # [B, 1, S, R]
    rope = cache[..., rank:].reshape(batch, length, groups, -1).transpose(1, 2)  # [B, G, S, D]
    nope = latent @ key_up.transpose(1, 2).unsqueeze(0)  # [B, G, S, n]
    keys = cache.new_zeros(batch, groups, length, head_dim)
    keys = keys.scatter(-1, rope_index[None, :, None].expand_as(rope), rope)
    keys = keys.scatter(-1, nope_index[None, :, None].expand_as(nope), nope)
    values = latent @ value_up.transpose(1, 2).unsqueeze(0)
    if value_bias is not None:
        values = values + value_bias[None, :, None]
    return keys, values


def naive_latent_attention(
    queries: torch.Tensor,
    cache: torch.Tensor,
    projection: LatentProjection,
    attention_mask: torch.Tensor | None,
    *,
    scale: float,
    is_causal: bool = False,
) -> torch.Tensor:
    """Reference for :func:`latent_attention`: expand every head's keys and values from the latent
    (:func:`expand_latent`), then plain softmax attention. queries: [B, H, T, head_dim], each head's rotary
    dims rotated and its rotary-free dims not. Returns [B, H, T, head_dim]."""
    keys, values = expand_latent(cache, projection)
    if is_causal:
        length = queries.shape[2]
        attention_mask = torch.ones(length, length, dtype=torch.bool, device=queries.device).tril()[
            None, None
        ]
    output, _ = eager_attention(queries, keys, values, attention_mask, scale=scale)
    return output.transpose(1, 2)


def naive_shared_rope_latent_attention(
    query_nope: torch.Tensor,
    query_rope: torch.Tensor,
    cache: torch.Tensor,
    projection: LatentProjection,
    attention_mask: torch.Tensor | None,
    *,
    scale: float,
    is_causal: bool = False,
) -> torch.Tensor:
    """Reference for :func:`latent_attention` with ``shared_rope`` (RoRoPE): group g's keys written out as
    [k_rope,1 ; … ; k_rope,G ; K_g c] (every group's stored rotary keys, then its own up-projected latent), its
    values V_g c + b_g, and head h's query [query_rope,h ; query_nope,h]; then plain softmax attention.
    query_nope [B, H, T, n], query_rope [B, H, T, G·D]. Returns [B, H, T, head_dim]."""
    key_up, value_up, value_bias = projection.key_up, projection.value_up, projection.value_bias
    groups, _, rank = value_up.shape
    batch, length, _ = cache.shape
    latent = cache[..., :rank].unsqueeze(1)  # [B, 1, S, R]
    rope = cache[..., rank:].unsqueeze(1).expand(batch, groups, length, -1)  # [B, G, S, G·D]
    keys = torch.cat((rope, latent @ key_up.transpose(1, 2).unsqueeze(0)), dim=-1)
    values = latent @ value_up.transpose(1, 2).unsqueeze(0)
    if value_bias is not None:
        values = values + value_bias[None, :, None]
    queries = torch.cat((query_rope, query_nope), dim=-1)
    if is_causal:
        steps = queries.shape[2]
        attention_mask = torch.ones(steps, steps, dtype=torch.bool, device=queries.device).tril()[None, None]
    output, _ = eager_attention(queries, keys, values, attention_mask, scale=scale)
    return output.transpose(1, 2)


__all__ = [
    "LatentProjection",
    "expand_latent",
    "latent_attention",
    "latent_queries",
    "naive_latent_attention",
    "naive_shared_rope_latent_attention",
]
