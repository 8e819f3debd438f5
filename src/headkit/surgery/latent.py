"""Compress a rotary, grouped-query decoder's keys and values into a shared latent (multi-head latent attention).

MHA2MLA (Ji et al. 2025, "Towards Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in Any
Transformer-based LLMs", arXiv:2502.14837), on the stock modules of a 🤗 decoder, per layer:

1. **Partial RoPE**: per key/value head g, rotary stays on D/2 frequency pairs (i, i + head_dim/2); the other
   n = head_dim − D dimensions become rotary-free. Which pairs (``rope_selection``):

   * ``"norms"`` — MHA2MLA's (their Sec. 3.2, "S_2-norm"): the largest query-key contribution
     Σ_{h∈g} E‖q_{h,i}‖ · E‖k_{g,i}‖ of the pair's 2-norms over calibration tokens (without calibration text,
     the Frobenius norms of the pair's projection rows), the rest left unrotated (q·k at every distance).
   * ``"fitted"`` (headkit's, the default with calibration text): a pair's score term Re(q·conj(k)·e^{iθ(m−n)})
     is replaced by Re(q·conj(k)·c) with the one complex factor c that minimises its squared error weighted by
     the model's own attention probabilities on calibration text (:func:`expected_rotation`: c ≈ 1 for slow
     pairs, as MHA2MLA assumes, but damped and turned for fast ones, whose rotation averages out over the
     distances attention looks at). c is folded into the rotary-free key rows before the factorization
     (:func:`fold_rotation`: free at run time), and the pairs kept rotary are those whose residual error is
     largest. On SmolLM2-135M at D = 16 it takes the partial-RoPE perplexity from 7.2x to 1.9x the original
     (docs/latent-kv.md).
2. **Joint low rank** (their Sec. 3.3, "SVD_joint"): the rotary-free key rows and the value rows of every
   key/value head, stacked into W = [W_K,nope ; W_V] (G·(n + head_dim) rows), are factored as W ≈ U_R (U_Rᵀ W):
   the down-projection W_down = U_Rᵀ W [R, hidden] writes the latent c = W_down x, the up-projections are
   U_R's rows (K_g [n, R], V_g [head_dim, R]). U_R are the leading left singular vectors of W Σ^{1/2}, Σ the
   second moment of the layer's attention inputs on calibration text (ASVD/SVD-LLM-style activation weighting: it
   minimises ‖(W − U_R U_Rᵀ W) X‖, the error of the keys and values the layer actually computes; with
   Σ = I it is MHA2MLA's plain joint SVD). At R = G·(n + head_dim) ≤ hidden, U_R U_Rᵀ = I: exact.

The key bias of the rotary-free dimensions adds q · b to every score of a query: constant over the keys, it
cancels in the softmax and is dropped. The value bias is added after the weighted sum (the weights sum to one).

**Through transformers' extension points** (:mod:`headkit.surgery.attention`), like the collaborative swap:

* ``v_proj`` becomes a :class:`~headkit.surgery.collaborative.SharedProjection` writing the latent c (zero-padded to
  a multiple of head_dim, so that the stock view takes it as "heads");
* ``k_proj`` becomes a :class:`RotaryKeyProjection` writing only the D rotary dimensions of each key/value head
  (zeros elsewhere, so that the stock rotary embedding and view apply unchanged);
* the module gains the :class:`LatentKVHeads` mechanism (``headkit_attention``: K_g, V_g, the value bias), run
  by the registered ``headkit_<base>`` attention. It undoes the stock rotation of the queries' rotary-free
  dimensions (the stock module rotates every dimension; :func:`headkit.ops.rotary.unrotate_pairs`, with the
  cos/sin a :class:`PositionEmbeddingsHook` hands it), keeps in its :class:`LatentCacheLayer` one row
  [c ; k_rope] of R + G·D numbers per token — instead of 2·G·head_dim — and attends with the key up-projection
  absorbed into the queries and the value up-projection applied to the weighted latent
  (:func:`headkit.ops.latent.latent_attention`), so the cache is never expanded. ``absorbed = False`` runs the
  expanded reference (:func:`headkit.ops.latent.naive_latent_attention`).

Refused, with the reason, before any work: families whose keys are normalised per head after the projection
(Qwen 3, Gemma 3's ``k_norm``: the norm of [k_rope ; K_g c] is not linear in the latent, so K_g cannot be absorbed
into the query), and those whose attention is not the LLaMA layout with full rotary (see
:data:`headkit.surgery.families.FAMILIES`, operation ``latent``); a model already carrying a headkit mechanism,
uneven key/value pruning or head gates. A model pruned uniformly is a stock model and is supported.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.base import KV_HEAD_INDEX
from headkit.layers.cache import StateCacheLayer
from headkit.ops.latent import LatentProjection, latent_attention, naive_latent_attention
from headkit.ops.rotary import apply_rotary, unrotate_pairs
from headkit.surgery.adapters import AttentionAdapter, AttentionSite, count_parameters, get_adapter
from headkit.surgery.attention import (
    HEAD_GATE,
    POSITION_EMBEDDINGS_KEYWORD,
    AttentionCall,
    PositionEmbeddingsHook,
    attach_mechanisms,
    mechanism_of,
    refuse_modules_off_the_interface,
)
from headkit.surgery.collaborative import SharedProjection
from headkit.surgery.families import LATENT, get_family, text_config
from headkit.surgery.gating import config_prunes_unevenly, config_records_gates, kv_head_counts
from headkit.surgery.records import (
    fields_of_record,
    given_config,
    record_surgery,
    register_conversion,
    say_deprecated,
)
from headkit.surgery.repair import capture_attention_calls, fisher_weighted_error

SURGERY_OP = "latent_kv"


class LatentCacheLayer(StateCacheLayer):
    """The entry of a latent layer in a 🤗 ``Cache``: one tensor [B, S, R + G·D] (per token the latent, then each
    key/value head's rotary key dimensions), grown by :class:`LatentKVHeads`."""

    describes = "a latent key/value attention layer"


def latent_cache_layer(cache: Any, layer_idx: int) -> LatentCacheLayer:
    """The :class:`LatentCacheLayer` of ``layer_idx`` in ``cache``."""
    return LatentCacheLayer.in_cache(cache, layer_idx)


class RotaryKeyProjection(nn.Module):
    """The key projection of a latent layer: x ↦ the D rotary dimensions of each key/value head, written at their
    places ``rope_index[g]`` of a [G·head_dim] output whose other entries are zero (the stock module rotates and
    views it unchanged). ``weight`` [G·D, hidden] and ``bias`` are the original key rows of those dimensions."""

    def __init__(
        self,
        hidden_size: int,
        rope_index: torch.Tensor,
        head_dim: int,
        *,
        bias: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        groups, rope = rope_index.shape
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.zeros(groups * rope, hidden_size, **factory))
        self.bias = nn.Parameter(torch.zeros(groups * rope, **factory)) if bias else None
        self.register_buffer("rope_index", rope_index.to(device), persistent=False)
        self.head_dim, self.in_features = head_dim, hidden_size
        self.out_features = groups * head_dim

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        groups, rope = self.rope_index.shape
        rotary = F.linear(hidden_states, self.weight, self.bias).unflatten(-1, (groups, rope))
        index = self.rope_index.expand(*rotary.shape[:-2], groups, rope)
        full = rotary.new_zeros(*rotary.shape[:-2], groups, self.head_dim).scatter(-1, index, rotary)
        return full.flatten(-2)

    def extra_repr(self) -> str:
        groups, rope = self.rope_index.shape
        return (
            f"in_features={self.in_features}, kv_heads={groups}, rope_dims={rope}, head_dim={self.head_dim}"
        )


class LatentKVHeads(nn.Module):
    """The mechanism of a latent layer (``<attention module>.headkit_attention``).

    Called by the registered attention with what the stock module computed: queries [B, H, T, head_dim] (every
    dimension rotated), keys [B, G, T, head_dim] (rotated rotary dimensions, zeros elsewhere), values
    [B, ⌈R/head_dim⌉, T, head_dim] (the padded latent); returns ``(output [B, T, H, head_dim], None)``.
    Parameters: ``key_up`` [G, n, R], ``value_up`` [G, head_dim, R], ``value_bias`` [G, head_dim] or None.
    """

    # The rotary-free query dimensions are rotated back with the module's own tables (attach_mechanisms).
    needs_position_embeddings = True

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rank: int,
        rope_index: torch.Tensor,
        value_bias: bool,
        scale: float,
        layer_idx: int,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rank, self.rope_dims = rank, rope_index.shape[1]
        self.scale, self.layer_idx = scale, layer_idx
        self.absorbed = True
        factory = {"dtype": dtype, "device": device}
        nope = head_dim - self.rope_dims
        self.key_up = nn.Parameter(torch.zeros(num_kv_heads, nope, rank, **factory))
        self.value_up = nn.Parameter(torch.zeros(num_kv_heads, head_dim, rank, **factory))
        self.value_bias = nn.Parameter(torch.zeros(num_kv_heads, head_dim, **factory)) if value_bias else None
        self.register_buffer("rope_index", rope_index.to(device), persistent=False)
        self.register_buffer("nope_index", nope_indices(rope_index, head_dim).to(device), persistent=False)

    @property
    def cache_width(self) -> int:
        """Numbers cached per token: the latent and every key/value head's rotary key dimensions."""
        return self.rank + self.num_kv_heads * self.rope_dims

    def cache_layer(self, cache: Any) -> LatentCacheLayer:
        """This layer's entry in the model's cache (see :class:`headkit.surgery.attention.CacheLayerHook`)."""
        return latent_cache_layer(cache, self.layer_idx)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, None]:
        queries, keys, values, cache_layer = call.queries, call.keys, call.values, call.cache_layer
        embeddings = call.options.get(POSITION_EMBEDDINGS_KEYWORD)
        if embeddings is None:
            raise HeadkitError(
                f"latent layer {self.layer_idx} needs the rotary cos/sin of its attention module (its "
                "PositionEmbeddingsHook is missing: rebuild the model with headkit.from_pretrained)"
            )
        batch, heads, length, _ = queries.shape
        groups, rope = self.num_kv_heads, self.rope_dims
        latent = values.transpose(1, 2).reshape(batch, length, -1)[..., : self.rank]
        rope_keys = keys.gather(-1, self.rope_index[None, :, None].expand(batch, groups, length, rope))
        rows = torch.cat((latent, rope_keys.transpose(1, 2).reshape(batch, length, groups * rope)), dim=-1)
        past = 0
        if cache_layer is not None:
            previous = cache_layer.get_state()
            past = cache_layer.get_seq_length()
            rows = rows if previous is None else torch.cat((previous, rows), dim=1)
            cache_layer.set_state(rows, length)
        mask, is_causal = attention_mask_for(call.attention_mask, batch, length, past, queries.device)
        per_head = heads // groups
        rope_index = self.rope_index.repeat_interleave(per_head, dim=0)[None, :, None]
        nope_index = self.nope_index.repeat_interleave(per_head, dim=0)[None, :, None]
        every_pair = torch.ones(self.head_dim // 2, dtype=torch.bool, device=queries.device)
        unrotated = unrotate_pairs(queries, *embeddings, every_pair)
        scale = call.scale(self.scale)
        if self.absorbed:
            query_rope = queries.gather(-1, rope_index.expand(batch, heads, length, rope))
            query_nope = unrotated.gather(-1, nope_index.expand(batch, heads, length, -1))
            output = latent_attention(
                query_nope, query_rope, rows, self.projection, mask, scale=scale, is_causal=is_causal
            )
        else:
            index = rope_index.expand(batch, heads, length, rope)
            mixed = unrotated.scatter(-1, index, queries.gather(-1, index))
            output = naive_latent_attention(
                mixed, rows, self.projection, mask, scale=scale, is_causal=is_causal
            )
        return output.transpose(1, 2).contiguous(), None

    @property
    def projection(self) -> LatentProjection:
        """The up-projections from this layer's cache rows (see :class:`headkit.ops.latent.LatentProjection`)."""
        return LatentProjection(self.key_up, self.value_up, self.value_bias, self.rope_index, self.nope_index)

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, rank={self.rank}, rope_dims={self.rope_dims}, absorbed={self.absorbed}"
        )


def attention_mask_for(
    attention_mask: Any, batch: int, length: int, past: int, device: torch.device | None = None
) -> tuple[torch.Tensor | None, bool]:
    """The model's mask as (bool [B, 1, T, S] with True = attend, or None; is_causal) over S = past + T keys.

    None means causal (a 🤗 decoder passes None to sdpa when nothing is padded); a query row with no key left
    (a left-padding position) attends to all keys instead, so that it stays finite (its output is unused)."""
    total = past + length
    if attention_mask is None:
        if length == 1:
            return None, False
        if past == 0:
            return None, True
        keys = torch.arange(total, device=device)
        return (keys[None] <= past + torch.arange(length, device=device)[:, None])[None, None], False
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise HeadkitError(
            "latent key/value attention takes the 4D masks of attn_implementation 'sdpa' or 'eager', got "
            f"{type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}"
        )
    mask = attention_mask[..., :total]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    if mask.shape[-1] != total or mask.shape[0] not in (1, batch):
        raise HeadkitError(
            f"attention_mask must cover the {total} keys of a batch of {batch}, got {tuple(attention_mask.shape)}"
        )
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty, False


def nope_indices(rope_index: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[G, head_dim − D]: per key/value head, the dimensions not in ``rope_index`` [G, D], ascending."""
    keep = torch.ones(rope_index.shape[0], head_dim, dtype=torch.bool, device=rope_index.device)
    keep.scatter_(1, rope_index, False)
    return torch.stack([torch.nonzero(row).flatten() for row in keep])


def rope_indices(pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[G, 2P]: the dimensions of the kept frequency pairs ``pairs`` [G, P] (pair i is dims i and i + head_dim/2),
    ascending."""
    return torch.cat((pairs, pairs + head_dim // 2), dim=1).sort(dim=1).values


# -- calibration ------------------------------------------------------------------------------------------------


@dataclass
class SiteStatistics:
    """What the conversion of one layer measures on calibration text."""

    input_moment: torch.Tensor  # [hidden, hidden] float64: E[x xᵀ] of the attention inputs
    query_pair_norms: torch.Tensor  # [H, head_dim/2]: E‖(q_i, q_{i+head_dim/2})‖ per query head
    key_pair_norms: torch.Tensor  # [G, head_dim/2]
    tokens: int
    rotation_moments: torch.Tensor | None = None  # [G, head_dim/2, 3, 3] (rotation_moments); None: no text

    @functools.cached_property
    def rotation_fit(self) -> RotationFit | None:
        """:func:`expected_rotation` of the moments, once for the pair selection and the fold; None without text."""
        return None if self.rotation_moments is None else expected_rotation(self.rotation_moments)


def pair_norms(projected: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[..., heads·head_dim] → [heads, head_dim/2]: the 2-norm of each rotary pair, averaged over the leading
    dimensions (rotation keeps it, so the unrotated projection gives the rotated pair's norm)."""
    per_head = projected.reshape(-1, heads, 2, head_dim // 2)
    return per_head.double().norm(dim=2).mean(dim=0)


# The score terms of one frequency pair, as bilinear forms in the query features (q1, q2, q̂1, q̂2) at m and the key
# features (k1, k2, k̂1, k̂2) at n (hats: rotated; pair i is dims i and i + head_dim/2): Re z = q1k1 + q2k2 and
# −Im z = q1k2 − q2k1 for z = q·conj(k) unrotated, and the rotated score term s = q̂1k̂1 + q̂2k̂2.
_SCORE_TERMS = torch.zeros(3, 4, 4, dtype=torch.float64)
_SCORE_TERMS[0, 0, 0] = _SCORE_TERMS[0, 1, 1] = 1.0
_SCORE_TERMS[1, 0, 1], _SCORE_TERMS[1, 1, 0] = 1.0, -1.0
_SCORE_TERMS[2, 2, 2] = _SCORE_TERMS[2, 3, 3] = 1.0


def _pair_features(x: torch.Tensor, rotated: torch.Tensor) -> torch.Tensor:
    """[B, T, heads, head_dim] (unrotated and rotated) → [B, T, heads, P, 4]: each pair's (x1, x2, x̂1, x̂2)."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:], rotated[..., :half], rotated[..., half:]), dim=-1)


def rotation_moments(
    queries: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float
) -> torch.Tensor:
    """[G, P, 3, 3] float64: per key/value group and frequency pair, Σ_h∈g Σ_{m ≥ n} a_h,mn t tᵀ with
    t = (Re z, −Im z, s) the pair's score terms (:data:`_SCORE_TERMS`) and a_h,mn the model's own attention
    probabilities — the normal equations of the attention-weighted least-squares fit in :func:`expected_rotation`.

    queries [B, T, H, head_dim] and keys [B, T, G, head_dim] as the projections write them (before rotary);
    cos/sin [B, T, head_dim] as the decoder layer hands them to attention. Causal, every position attended."""
    batch, length, heads, head_dim = queries.shape
    groups, pairs = keys.shape[2], head_dim // 2
    per_group = heads // groups
    # 🤗's cos/sin repeat the pair angles in both halves; apply_rotary takes them once.
    cos, sin = cos[..., :pairs].float(), sin[..., :pairs].float()
    queries, keys = queries.float(), keys.float()
    rotated_q, rotated_k = (
        apply_rotary(x.transpose(1, 2), cos, sin, validate=False).transpose(1, 2) for x in (queries, keys)
    )
    query_features = _pair_features(queries, rotated_q)  # [B, T, H, P, 4]
    key_features = _pair_features(keys, rotated_k)  # [B, T, G, P, 4]
    rotated_k = rotated_k.repeat_interleave(per_group, dim=2)
    scores = torch.einsum("bmhd,bnhd->bhmn", rotated_q, rotated_k) * scale
    causal = torch.ones(length, length, dtype=torch.bool, device=queries.device).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [B, H, T, T]
    key_products = (key_features[..., :, None] * key_features[..., None, :]).flatten(-2)  # [B, T, G, P, 16]
    key_products = key_products.repeat_interleave(per_group, dim=2).permute(0, 2, 1, 3, 4)
    weighted = weights @ key_products.reshape(batch, heads, length, pairs * 16)  # Σ_n a_mn B_j B_j'(n)
    query_products = (query_features[..., :, None] * query_features[..., None, :]).flatten(-2)
    moments = torch.einsum(
        "bmhpx,bhmpy->hpxy", query_products.double(), weighted.view(batch, heads, length, pairs, 16).double()
    ).view(heads, pairs, 4, 4, 4, 4)  # [h, p, i, i', j, j']: Σ a (A_i A_i')(m) (B_j B_j')(n)
    terms = _SCORE_TERMS.to(moments.device)
    per_head = torch.einsum("xij,yab,hpiajb->hpxy", terms, terms, moments)
    return per_head.view(groups, per_group, pairs, 3, 3).sum(dim=1)


@dataclass
class RotationFit:
    """:func:`expected_rotation`'s result, per key/value group g and frequency pair i ([G, P] each)."""

    cos: torch.Tensor  # a: the fixed rotation's cosine part (scaled)
    sin: torch.Tensor  # b
    residual: torch.Tensor  # the pair's weighted squared score error with the fitted (a, b)
    unrotated_residual: torch.Tensor  # … with (a, b) = (1, 0): the pair merely left unrotated
    energy: torch.Tensor  # … with (a, b) = (0, 0): the pair dropped; Σ a s²


def expected_rotation(moments: torch.Tensor) -> RotationFit:
    """Replace a rotary pair's relative rotation e^{iθ(m−n)} by the one fixed complex factor c = a + ib that best
    reproduces its score terms: (a, b) minimise Σ a_mn (s − a·Re z − b·(−Im z))², the attention-weighted squared
    error of the pair's contribution to the scores (``moments`` from :func:`rotation_moments`).

    Why: a rotary-free pair of partial RoPE (MHA2MLA) contributes Re z = q·k unrotated to every score — exact only
    at distance 0. A slow pair is well served by c ≈ 1 (what MHA2MLA does), but a fast one whose rotation averages
    out over the distances attention looks at wants c ≈ 0, and anything in between a damped, turned factor.
    c folds into the key projection (:func:`fold_rotation`), so it costs nothing at run time; the residual is
    the error the pair leaves, the criterion for which pairs stay rotary."""
    normal = moments[..., :2, :2]
    target = moments[..., :2, 2]
    ridge = 1e-12 * normal.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-300)[..., None, None]
    identity = torch.eye(2, dtype=normal.dtype, device=normal.device)
    solution = torch.linalg.solve(normal + ridge * identity, target)
    energy = moments[..., 2, 2]
    return RotationFit(
        cos=solution[..., 0],
        sin=solution[..., 1],
        residual=(energy - (solution * target).sum(-1)).clamp_min(0),
        unrotated_residual=(energy - 2 * moments[..., 0, 2] + moments[..., 0, 0]).clamp_min(0),
        energy=energy,
    )


def fold_rotation(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Key rows [G, head_dim, …] (weight rows or bias) with every pair i multiplied by conj(a_i + i b_i), so that
    q·k' unrotated equals Re(q·conj(k)·c) (:func:`expected_rotation`). cos/sin [G, P]; pairs to keep as they
    are get (1, 0)."""
    half = rows.shape[1] // 2
    shape = (*cos.shape, *([1] * (rows.dim() - 2)))
    a, b = (part.reshape(shape).to(rows.device, rows.dtype) for part in (cos, sin))
    first, second = rows[:, :half], rows[:, half:]
    return torch.cat((a * first + b * second, a * second - b * first), dim=1)


def collect_statistics(
    model: nn.Module, sites: list[AttentionSite], adapter: AttentionAdapter, batches: Iterable[dict]
) -> list[SiteStatistics]:
    """Run `model` on the calibration `batches` (dicts of model inputs) and return each site's statistics, read
    by forward hooks on its projections (their inputs: the attention inputs; their outputs: queries and keys
    before rotary). Padding tokens are counted too (calibration windows have none)."""
    sums: list[dict[str, Any]] = [
        {"moment": 0.0, "q": 0.0, "k": 0.0, "rotation": 0.0, "tokens": 0, "calls": 0} for _ in sites
    ]
    handles = []
    seen: list[dict[str, Any]] = [{} for _ in sites]  # this call's queries, keys and cos/sin, per site

    def hook(index: int, which: str, heads: int, head_dim: int):
        def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            entry = sums[index]
            if which == "v":
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
                entry["moment"] = entry["moment"] + x.T @ x
                entry["tokens"] += x.shape[0]
            else:
                seen[index][which] = output.detach().unflatten(-1, (heads, head_dim))
                entry[which] = entry[which] + pair_norms(output.detach(), heads, head_dim)
                if which == "q":
                    entry["calls"] += 1

        return record

    def embeddings(index: int):
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            found = kwargs.get("position_embeddings")
            seen[index]["rotary"] = args[1] if found is None and len(args) > 1 else found

        return record

    def moments(index: int, scale: float):
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # The stock module has run its projections: the rotation fit reads what they wrote.
            call = seen[index]
            if call.get("rotary") is not None and "q" in call and "k" in call:
                sums[index]["rotation"] = (
                    sums[index]["rotation"]
                    + rotation_moments(call["q"], call["k"], *call["rotary"], scale).cpu()
                )
            call.clear()

        return record

    for index, site in enumerate(sites):
        module = site.module
        handles.append(module.register_forward_pre_hook(embeddings(index), with_kwargs=True))
        handles.append(module.register_forward_hook(moments(index, site.scale), with_kwargs=True))
        for which, name, heads in (
            ("q", adapter.query_name, site.num_heads),
            ("k", adapter.key_name, site.num_kv_heads),
            ("v", adapter.value_name, site.num_kv_heads),
        ):
            projection = module.get_submodule(name)
            handles.append(projection.register_forward_hook(hook(index, which, heads, site.head_dim)))
    try:
        with torch.no_grad():
            for batch in batches:
                model(
                    **{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")},
                    use_cache=False,
                )
    finally:
        for handle in handles:
            handle.remove()
    if not sums or sums[0]["tokens"] == 0:
        raise HeadkitError("calibration needs at least one batch of text")
    return [
        SiteStatistics(
            input_moment=entry["moment"] / entry["tokens"],
            query_pair_norms=entry["q"] / entry["calls"],
            key_pair_norms=entry["k"] / entry["calls"],
            tokens=entry["tokens"],
            rotation_moments=entry["rotation"] if isinstance(entry["rotation"], torch.Tensor) else None,
        )
        for entry in sums
    ]


def weight_statistics(adapter: AttentionAdapter, site: AttentionSite) -> SiteStatistics:
    """Data-free stand-in for :func:`collect_statistics`: pair norms of the projection rows (‖W_{q,i}‖_F for the
    pair's two rows) and an identity input moment (plain joint SVD, MHA2MLA's own)."""
    weights = adapter.read_projections(site)
    hidden = weights.q_weight.shape[1]
    q = weights.q_weight.detach().double().reshape(site.num_heads, 2, site.head_dim // 2, hidden)
    k = weights.k_weight.detach().double().reshape(site.num_kv_heads, 2, site.head_dim // 2, hidden)
    return SiteStatistics(
        input_moment=torch.eye(hidden, dtype=torch.float64),
        query_pair_norms=q.pow(2).sum(dim=(1, 3)).sqrt(),
        key_pair_norms=k.pow(2).sum(dim=(1, 3)).sqrt(),
        tokens=0,
    )


FITTED, NORMS = "fitted", "norms"
ROPE_SELECTIONS = (FITTED, NORMS)
UNIFORM, SPECTRUM, SENSITIVITY = "uniform", "spectrum", "sensitivity"
RANK_ALLOCATIONS = (UNIFORM, SPECTRUM, SENSITIVITY)


def select_rotary_pairs(statistics: SiteStatistics, pairs: int, selection: str = NORMS) -> torch.Tensor:
    """[G, pairs]: per key/value head, the frequency pairs to keep rotary, ascending. Ties go to the lower
    (faster-rotating) frequency.

    ``"norms"``: the largest Σ_{h∈g} E‖q_{h,i}‖ · E‖k_{g,i}‖ (MHA2MLA's 2-norm criterion). ``"fitted"``: the largest
    residual of :func:`expected_rotation` — the score error a pair would leave rotary-free, after its fixed
    rotation is folded into the keys (needs ``statistics.rotation_moments``)."""
    if selection == FITTED:
        if statistics.rotation_fit is None:
            raise HeadkitError("rope_selection 'fitted' needs calibration text (calibration=...)")
        contribution = statistics.rotation_fit.residual
    else:
        queries, keys = statistics.query_pair_norms, statistics.key_pair_norms
        groups = keys.shape[0]
        contribution = queries.reshape(groups, -1, queries.shape[-1]).sum(dim=1) * keys
    order = torch.argsort(-contribution, dim=1, stable=True)
    return order[:, :pairs].sort(dim=1).values


# -- the factorization ------------------------------------------------------------------------------------------


@dataclass
class LatentFactors:
    """W ≈ up @ down for the stacked rotary-free key and value rows W [G·(n + head_dim), hidden]."""

    down: torch.Tensor  # [R, hidden]
    key_up: torch.Tensor  # [G, n, R]
    value_up: torch.Tensor  # [G, head_dim, R]
    key_error: float  # ‖(W_K,nope − K̂) Σ^{1/2}‖ / ‖W_K,nope Σ^{1/2}‖ (0 when no dimension is rotary-free)
    value_error: float  # the same for the values


def _weighted_rows(
    key_nope: torch.Tensor, value: torch.Tensor, input_moment: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, W Σ^{1/2}) in float64: the stacked rotary-free key and value rows, and the same weighted by the
    square root of the input moment (what the joint SVD factors)."""
    hidden = key_nope.shape[-1]
    stacked = torch.cat((key_nope.reshape(-1, hidden), value.reshape(-1, hidden)), dim=0).double()
    moment = input_moment.double()
    # Σ^{1/2}, regularised so that directions no calibration token spanned keep a little weight.
    eigenvalues, eigenvectors = torch.linalg.eigh(
        moment + 1e-6 * moment.diagonal().mean() * torch.eye(hidden)
    )
    root = (eigenvectors * eigenvalues.clamp_min(0).sqrt()) @ eigenvectors.T
    return stacked, stacked @ root


def allocate_by_error(curves: list[tuple[list[int], list[float]]], total: int) -> list[int]:
    """Share `total` latent dimensions out over the layers so that Σ_ℓ e_ℓ(R_ℓ) is smallest, where curve ℓ gives
    the error e_ℓ at candidate ranks (ascending) and is taken linear between them; each layer's rank stays within
    its candidates' range. Every layer starts at its smallest candidate, then the unit steps that lower the
    summed error most are taken first, along each curve's lower convex hull: optimal for convex curves (where
    the hull is the curve), and for the hull otherwise. Ties go to the earlier layer."""
    low = sum(ranks[0] for ranks, _ in curves)
    high = sum(ranks[-1] for ranks, _ in curves)
    if not curves or not low <= total <= high:
        raise HeadkitError(
            f"total must be in [{low}, {high}] (every layer between its smallest and largest candidate rank), "
            f"got {total}"
        )
    steps = []
    for layer, (ranks, errors) in enumerate(curves):
        hull: list[tuple[int, float]] = []
        for point in zip(ranks, errors, strict=True):
            # Lower hull, left to right: drop the last point while it lies on or above the chord to this one.
            while len(hull) > 1 and (hull[-1][0] - hull[-2][0]) * (point[1] - hull[-2][1]) <= (
                hull[-1][1] - hull[-2][1]
            ) * (point[0] - hull[-2][0]):
                hull.pop()
            hull.append(point)
        for (r0, e0), (r1, e1) in itertools.pairwise(hull):
            steps += [((e0 - e1) / (r1 - r0), layer)] * (r1 - r0)
    allocated = [ranks[0] for ranks, _ in curves]
    for _, layer in sorted(steps, key=lambda step: -step[0])[: total - low]:
        allocated[layer] += 1
    return allocated


def allocate_ranks(spectra: list[torch.Tensor], total: int) -> list[int]:
    """Share `total` latent dimensions out over the layers whose weighted key/value singular values are
    `spectra`, so that the sum over layers of the relative error each layer is left with,
    Σ_{j>R_ℓ} σ_{ℓj}² / Σ_j σ_{ℓj}² (the activation-weighted key/value error of :func:`joint_latent_factors`), is
    smallest (:func:`allocate_by_error`; the error is convex in R_ℓ, the σ being sorted). Every layer keeps at
    least one dimension and at most as many as its spectrum has."""
    curves = []
    for spectrum in spectra:
        energy = spectrum.double().pow(2)
        share = energy / energy.sum().clamp_min(1e-300)
        left = share.flip(0).cumsum(0).flip(0).tolist()  # left[r] = Σ_{j≥r} share_j: the error at rank r
        curves.append((list(range(1, len(spectrum) + 1)), left[1:] + [0.0]))
    return allocate_by_error(curves, total)


# The candidate ranks whose errors :func:`rank_error_curves` measures, as multiples of the uniform rank R.
SENSITIVITY_MULTIPLES = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def candidate_ranks(kv_rank: int, top: int) -> list[int]:
    """The ranks (ascending, within [1, top]) at which each layer's sensitivity is measured: R itself and
    :data:`SENSITIVITY_MULTIPLES` of it."""
    return sorted({min(top, max(1, round(kv_rank * multiple))) for multiple in SENSITIVITY_MULTIPLES})


def rank_error_curves(
    model: nn.Module,
    config: LatentKVConfig,
    calibration: list[dict],
    statistics: list[SiteStatistics],
    adapter: AttentionAdapter,
    ranks: list[int],
) -> list[list[float]]:
    """Per layer, the loss-weighted error its attention output is left with at each of `ranks`
    (:func:`headkit.surgery.repair.fisher_weighted_error` on `calibration`): what each choice costs the model,
    in the loss's units, so layers compare. Each rank converts a copy of `model` (every layer at that rank;
    `model` untouched), and each layer is judged on the original's own inputs, so no error crosses layers."""
    sites = adapter.sites(model)
    calls = capture_attention_calls(model, calibration, range(len(sites)), adapter, gradients=True)
    curves: list[list[float]] = [[] for _ in sites]
    uniform = dataclasses.replace(config, rank_allocation=UNIFORM)
    for rank in ranks:
        candidate = copy.deepcopy(model)
        _compress(
            candidate, dataclasses.replace(uniform, kv_rank=rank), statistics=statistics, adapter=adapter
        )
        for layer, site in enumerate(sites):
            curves[layer].append(fisher_weighted_error(candidate.get_submodule(site.name), calls[layer]))
        del candidate
    return curves


def joint_latent_factors(
    key_nope: torch.Tensor, value: torch.Tensor, rank: int, input_moment: torch.Tensor
) -> LatentFactors:
    """MHA2MLA's joint SVD (their Eq. 7), weighted by the input moment Σ (module docstring): U_R the leading left
    singular vectors of [W_K,nope ; W_V] Σ^{1/2}, down = U_Rᵀ W, up = U_R. key_nope [G, n, hidden], value
    [G, head_dim, hidden]; computed in float64, returned in value's dtype."""
    groups, nope, hidden = key_nope.shape
    head_dim = value.shape[1]
    stacked, weighted = _weighted_rows(key_nope, value, input_moment)
    left, _, _ = torch.linalg.svd(weighted, full_matrices=False)
    up = left[:, :rank]
    down = up.T @ stacked
    residual = (weighted - up @ (up.T @ weighted)).reshape(-1, hidden)
    split = groups * nope

    def relative(rows: slice) -> float:
        total = weighted[rows].norm()
        return float(residual[rows].norm() / total) if total > 0 else 0.0

    dtype = value.dtype
    return LatentFactors(
        down=down.to(dtype),
        key_up=up[:split].reshape(groups, nope, rank).to(dtype),
        value_up=up[split:].reshape(groups, head_dim, rank).to(dtype),
        key_error=relative(slice(0, split)),
        value_error=relative(slice(split, None)),
    )


def full_rank(hidden: int, num_kv_heads: int, head_dim: int, rope_dims: int) -> int:
    """The largest useful latent width: the rank of [W_K,nope ; W_V], at most G·(2·head_dim − D) and hidden."""
    return min(hidden, num_kv_heads * (2 * head_dim - rope_dims))


# -- the conversion ---------------------------------------------------------------------------------------------


@dataclass
class LatentSiteReport:
    name: str
    layer: int
    rope_pairs: list[list[int]]  # per key/value head, the frequency pairs kept rotary
    key_error: float
    value_error: float
    # The rotary-free pairs' share of the score terms' energy that the partial RoPE loses (attention-weighted
    # squared error / Σ a s² over every pair, on calibration text); None without calibration.
    rope_error: float | None = None


@dataclass
class LatentReport:
    """What :func:`compress_kv_to_latent` did."""

    architecture: str
    kv_rank: int  # the mean over layers
    kv_ranks: list[int]  # per layer (all kv_rank unless the ranks were allocated)
    rope_dims: int
    full_rank: int
    calibrated: bool
    rope_selection: str
    cache_numbers_before: int  # per token per layer: 2·G·head_dim
    cache_numbers_after: int  # R + G·D
    parameters_before: int
    parameters_after: int
    seconds: float
    sites: list[LatentSiteReport] = field(default_factory=list)
    rank_allocation: str = UNIFORM
    # "sensitivity": the candidate ranks and, per layer, the loss-weighted error at each (rank_error_curves)
    candidate_ranks: list[int] | None = None
    rank_errors: list[list[float]] | None = None

    @property
    def cache_fraction(self) -> float:
        return self.cache_numbers_after / self.cache_numbers_before

    @property
    def max_key_error(self) -> float:
        return max((site.key_error for site in self.sites), default=0.0)

    @property
    def max_value_error(self) -> float:
        return max((site.value_error for site in self.sites), default=0.0)

    @property
    def max_rope_error(self) -> float | None:
        errors = [site.rope_error for site in self.sites if site.rope_error is not None]
        return max(errors) if errors else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "cache_fraction": self.cache_fraction,
            "max_key_error": self.max_key_error,
            "max_value_error": self.max_value_error,
            "max_rope_error": self.max_rope_error,
        }

    def __str__(self) -> str:
        return (
            f"latent keys/values ({self.architecture}): rank {self.kv_rank} of {self.full_rank}{self._allocation()}, "
            f"{self.rope_dims} "
            f"rotary dims per key/value head ({self._selection_words()}), "
            f"{len(self.sites)} layers in {self.seconds:.1f} s; cache per token and layer "
            f"{self.cache_numbers_before} -> {self.cache_numbers_after} numbers ({self.cache_fraction:.1%}); "
            f"max relative error: keys {self.max_key_error:.3g}, values {self.max_value_error:.3g}; parameters "
            f"{self.parameters_before:,} -> {self.parameters_after:,}"
        )

    def _allocation(self) -> str:
        if len(set(self.kv_ranks)) <= 1:
            return ""
        by = "the loss-weighted output errors" if self.rank_allocation == SENSITIVITY else "the spectra"
        return f" (mean; per layer {min(self.kv_ranks)}–{max(self.kv_ranks)}, by {by})"

    def _selection_words(self) -> str:
        if not self.calibrated:
            return "weight norms"
        if self.max_rope_error is None:
            return f"calibrated, {self.rope_selection}"
        return f"calibrated, {self.rope_selection}: score-term error up to {self.max_rope_error:.3g}"


def check_latent_arguments(site: AttentionSite, hidden: int, kv_rank: Any, rope_dims: Any) -> None:
    """Name the valid range of `rope_dims` (whole rotary pairs) and of `kv_rank` (given rope_dims)."""
    check_latent_ranks(site.head_dim, site.num_kv_heads, hidden, kv_rank, rope_dims)


def attention_widths(config: Any) -> tuple[int, int, int]:
    """(hidden size, key/value heads, head_dim) as a decoder's 🤗 config states them (its text config)."""
    text = text_config(config)
    heads = text.num_attention_heads
    return (
        text.hidden_size,
        getattr(text, "num_key_value_heads", None) or heads,
        getattr(text, "head_dim", None) or text.hidden_size // heads,
    )


def check_latent_ranks(head_dim: int, num_kv_heads: int, hidden: int, kv_rank: Any, rope_dims: Any) -> None:
    """:func:`check_latent_arguments` from the widths alone (a model's 🤗 config is enough)."""
    if isinstance(rope_dims, bool) or not isinstance(rope_dims, int) or not 0 <= rope_dims <= head_dim:
        raise HeadkitError(f"rope_dims must be an integer in [0, {head_dim}] (head_dim), got {rope_dims!r}")
    if rope_dims % 2:
        raise HeadkitError(
            f"rope_dims must be a whole number of rotary pairs (even: 0, 2, …, {head_dim}), got {rope_dims}"
        )
    top = full_rank(hidden, num_kv_heads, head_dim, rope_dims)
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 1 <= kv_rank <= top:
        raise HeadkitError(
            f"kv_rank must be an integer in [1, {top}] (the full width min(hidden {hidden}, kv_heads "
            f"{num_kv_heads} × (2·head_dim {2 * head_dim} − rope_dims {rope_dims}))), got {kv_rank!r}"
        )


def _check_not_latent(model: nn.Module) -> None:
    # Before the adapter reads the projections: a latent layer's are no longer nn.Linear.
    converted = [m.layer_idx for m in latent_mechanisms(model)]
    if converted:
        raise HeadkitError(f"the model's keys and values are already latent (layers {converted})")


def _check_sites(model: nn.Module, adapter: AttentionAdapter) -> list[AttentionSite]:
    sites = adapter.sites(model)
    if not sites:
        raise HeadkitError(f"the {adapter.name} adapter found no attention module in this model")
    for site in sites:
        mechanism = mechanism_of(site.module)
        if isinstance(mechanism, LatentKVHeads):
            raise HeadkitError(f"the model's keys and values are already latent ({site.name})")
        if mechanism is not None:
            raise HeadkitError(
                f"{site.name} already runs {type(mechanism).__name__} (earlier surgery: linearized or swapped); "
                "latent keys/values need the stock softmax attention"
            )
        if getattr(site.module, KV_HEAD_INDEX, None) is not None or getattr(site.module, HEAD_GATE, None):
            raise HeadkitError(
                f"{site.name} is pruned unevenly (a key/value head index) or gated: latent keys/values need "
                "every layer's stock key/value heads; prune uniformly (a stock architecture) instead"
            )
        if len(site.layers) != 1 or site.head_dim % 2 or site.num_heads % site.num_kv_heads:
            raise HeadkitError(
                f"{site.name} is not one layer of grouped-query attention with an even head_dim"
            )
        for name in ("k_norm", "q_norm"):
            if isinstance(getattr(site.module, name, None), nn.Module):
                raise HeadkitError(
                    f"{site.name} normalises each head's {name[0]} after the projection ({name}): the norm of "
                    "[k_rope ; K c] is not linear in the latent, so the key up-projection cannot be absorbed"
                )
    return sites


@dataclass
class _SitePlan:
    site: AttentionSite
    key: RotaryKeyProjection
    value: SharedProjection
    mechanism: LatentKVHeads
    report: LatentSiteReport


def _key_rows(
    k_weight: torch.Tensor, pairs: torch.Tensor, statistics: SiteStatistics, fold: bool
) -> tuple[torch.Tensor, float | None]:
    """The key projection's rows per key/value head [G, head_dim, hidden], with the fitted fixed rotation folded
    into the rotary-free pairs when `fold` (:func:`fold_rotation`), and the score-term error the rotary-free
    pairs leave (None without a rotation fit)."""
    groups, hidden = pairs.shape[0], k_weight.shape[1]
    k_weight = k_weight.detach().reshape(groups, -1, hidden)
    kept = torch.zeros(groups, k_weight.shape[1] // 2, dtype=torch.bool).scatter_(1, pairs.cpu(), True)
    fit = statistics.rotation_fit
    if fit is None:
        return k_weight, None
    lost = torch.where(kept, 0.0, fit.residual if fold else fit.unrotated_residual)
    if fold:
        # Kept pairs stay as they are (their rotation is applied at run time, exactly).
        cos = torch.where(kept, 1.0, fit.cos)
        sin = torch.where(kept, 0.0, fit.sin)
        k_weight = fold_rotation(k_weight.double(), cos, sin).to(k_weight.dtype)
    return k_weight, float(lost.sum() / fit.energy.sum().clamp_min(1e-300))


def _gather_rows(k_weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [G, n] of each key/value head's key rows k_weight [G, head_dim, hidden]."""
    return k_weight.gather(1, index[..., None].expand(-1, -1, k_weight.shape[-1]))


def latent_spectrum(
    adapter: AttentionAdapter,
    site: AttentionSite,
    pairs: torch.Tensor,
    statistics: SiteStatistics,
    fold: bool,
) -> torch.Tensor:
    """The singular values of one site's weighted rotary-free key and value rows [W_K,nope ; W_V] Σ^{1/2} (what
    :func:`joint_latent_factors` cuts at R), with `pairs` kept rotary: the error each rank leaves."""
    weights = adapter.read_projections(site)
    groups, head_dim = site.num_kv_heads, site.head_dim
    k_weight, _ = _key_rows(weights.k_weight, pairs, statistics, fold)
    nope = nope_indices(rope_indices(pairs, head_dim), head_dim)
    value = weights.v_weight.detach().reshape(groups, head_dim, -1)
    _, weighted = _weighted_rows(_gather_rows(k_weight, nope), value, statistics.input_moment)
    return torch.linalg.svdvals(weighted)


def _plan_site(
    adapter: AttentionAdapter,
    site: AttentionSite,
    kv_rank: int,
    pairs: torch.Tensor,
    statistics: SiteStatistics | None,
    fold: bool = False,
) -> _SitePlan:
    """The new projections and mechanism of one site; with `statistics` None, left at zero (the structure
    :func:`headkit.from_pretrained` loads saved weights into). `fold`: the rotary-free pairs' keys carry their
    fitted fixed rotation (:func:`expected_rotation`, :func:`fold_rotation`) into the factorization."""
    weights = adapter.read_projections(site)
    groups, head_dim = site.num_kv_heads, site.head_dim
    hidden = weights.k_weight.shape[1]
    factory = {"dtype": weights.k_weight.dtype, "device": weights.k_weight.device}
    rope_index = rope_indices(pairs, head_dim)
    key = RotaryKeyProjection(hidden, rope_index, head_dim, bias=weights.k_bias is not None, **factory)
    value = SharedProjection(hidden, kv_rank, head_dim, **factory)
    mechanism = LatentKVHeads(
        num_heads=site.num_heads,
        num_kv_heads=groups,
        head_dim=head_dim,
        rank=kv_rank,
        rope_index=rope_index,
        value_bias=weights.v_bias is not None,
        scale=site.scale,
        layer_idx=site.layers[0],
        **factory,
    )
    report = LatentSiteReport(site.name, site.layers[0], pairs.tolist(), 0.0, 0.0)
    if statistics is not None:
        k_weight, report.rope_error = _key_rows(weights.k_weight, pairs, statistics, fold)
        gather = functools.partial(_gather_rows, k_weight)
        factors = joint_latent_factors(
            gather(mechanism.nope_index.cpu()),
            weights.v_weight.detach().reshape(groups, head_dim, hidden),
            kv_rank,
            statistics.input_moment,
        )
        with torch.no_grad():
            key.weight.copy_(gather(rope_index).reshape(-1, hidden))
            if key.bias is not None:
                key.bias.copy_(
                    weights.k_bias.detach().reshape(groups, head_dim).gather(1, rope_index).flatten()
                )
            value.weight.copy_(factors.down)
            mechanism.key_up.copy_(factors.key_up)
            mechanism.value_up.copy_(factors.value_up)
            if mechanism.value_bias is not None:
                mechanism.value_bias.copy_(weights.v_bias.detach().reshape(groups, head_dim))
        report.key_error, report.value_error = factors.key_error, factors.value_error
    for module in (key, value, mechanism):
        module.train(site.module.training)
    return _SitePlan(site, key, value, mechanism, report)


def _apply(model: nn.Module, adapter: AttentionAdapter, planned: list[_SitePlan]) -> None:
    """Put the planned projections in place and attach the mechanisms (assignments only)."""
    for plan in planned:
        setattr(plan.site.module, adapter.key_name, plan.key)
        setattr(plan.site.module, adapter.value_name, plan.value)
    attach_mechanisms(model, [(plan.site.module, plan.mechanism) for plan in planned])


@dataclass(frozen=True)
class LatentKVConfig:
    """How :func:`compress_kv_to_latent` converts a model: the one declaration of each option.

    Built, it checks its types and ranges; :meth:`check` checks it against a model (family, attention modules,
    the ranks their widths allow) before any calibration text is read or weight changed. The model's
    ``config.headkit_surgery`` records it, with the rotary pairs each layer kept.

    Attributes:
        kv_rank: R, the latent width per layer, in [1, min(hidden, G·(2·head_dim − rope_dims))]; the top is exact.
        rope_dims: D, rotary dimensions kept per key/value head (whole pairs: even, ≤ head_dim); head_dim keeps
            every one (exact).
        rope_selection: ``"fitted"`` (the default with calibration): keep rotary where the fitted fixed rotation
            leaves the largest score error, and fold that rotation into the rotary-free keys
            (:func:`expected_rotation`); ``"norms"`` (the default without): MHA2MLA's 2-norm criterion,
            rotary-free pairs left unrotated. None: the default for the calibration given.
        rank_allocation: ``"uniform"``: every layer gets R. ``"spectrum"`` (needs calibration): the same total,
            L·R, shared out by the error each choice leaves in the keys and values (:func:`allocate_ranks`: the
            layers whose keys and values are hardest to compress get more of it). ``"sensitivity"`` (needs
            calibration batches): shared out by what each choice costs the model — each layer's attention-output
            error at candidate ranks, weighted by the loss gradient (:func:`rank_error_curves`,
            :func:`allocate_by_error`).
    """

    # Each field's metadata makes it a command-line option where a command takes this config's fields
    # (headkit.recipes.options: `headkit compress`).
    kv_rank: int = field(
        metadata={
            "help": "Rotary decoders (LLaMA, SmolLM2, Mistral, Qwen 2): latent width R of the shared key/value "
            "latent per layer (MHA2MLA).",
            "min": 1,
        }
    )
    rope_dims: int = field(
        metadata={
            "help": "Rotary decoders: rotary dimensions kept per key/value head, whole pairs.",
            "min": 0,
        }
    )
    rope_selection: str | None = field(
        default=None,
        metadata={
            "help": "Rotary decoders: 'fitted' keeps rotary where a fixed rotation fitted on the calibration text "
            "errs most and folds that rotation into the other pairs' keys; 'norms' is MHA2MLA's 2-norm ranking."
        },
    )
    rank_allocation: str = field(
        default=UNIFORM,
        metadata={
            "help": "Rotary decoders: 'uniform' gives every layer R; 'spectrum' shares the same total out by each "
            "layer's key/value spectrum on the calibration text (the error each rank leaves in the keys and "
            "values); 'sensitivity' by what each rank costs the model (each layer's attention-output error at 7 "
            "candidate ranks, weighted by the loss gradient)."
        },
    )

    def __post_init__(self) -> None:
        # Types here; the ranges are the model's (its head_dim and widths), which check() names.
        for name in ("kv_rank", "rope_dims"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise HeadkitError(f"{name} must be an integer, got {value!r}")
        if self.rank_allocation not in RANK_ALLOCATIONS:
            raise HeadkitError(
                f"rank_allocation must be one of {RANK_ALLOCATIONS}, got {self.rank_allocation!r}"
            )
        if self.rope_selection is not None and self.rope_selection not in ROPE_SELECTIONS:
            raise HeadkitError(
                f"rope_selection must be one of {ROPE_SELECTIONS}, got {self.rope_selection!r}"
            )

    def selection(self, calibrated: bool) -> str:
        """The rotary-pair selection for a conversion with (`calibrated`) or without calibration text."""
        if self.rank_allocation == SPECTRUM and not calibrated:
            raise HeadkitError(
                "rank_allocation 'spectrum' shares the ranks out by the calibration text's key/value spectra: pass "
                "calibration=..., or rank_allocation='uniform'"
            )
        if self.rank_allocation == SENSITIVITY and not calibrated:
            raise HeadkitError(
                "rank_allocation 'sensitivity' measures each layer's cost on calibration text: pass "
                "calibration=..., or rank_allocation='uniform'"
            )
        selection = self.rope_selection or (FITTED if calibrated else NORMS)
        if selection == FITTED and not calibrated:
            raise HeadkitError(
                "rope_selection 'fitted' fits each rotary-free pair's rotation on calibration text: pass "
                "calibration=..., or rope_selection='norms'"
            )
        return selection

    def check(
        self,
        model_or_config: Any,
        adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ) -> None:
        """Everything that can refuse this conversion, before any work. On a 🤗 config (before the weights are
        loaded): the family takes latent keys/values, and R and D fit the widths it states. On a model also its
        attention modules (:meth:`sites_to_convert`)."""
        if isinstance(model_or_config, nn.Module):
            self.sites_to_convert(model_or_config, adapter)
            return
        get_family(model_or_config, LATENT)
        if config_records_gates(model_or_config) or config_prunes_unevenly(model_or_config):
            uneven = config_prunes_unevenly(model_or_config)
            raise HeadkitError(
                f"the model is {f'pruned unevenly in layers {uneven}' if uneven else 'gated'}: latent keys/values "
                "need every layer's stock key/value heads; prune whole key/value groups, or remove the gates first"
            )
        hidden, kv_heads, head_dim = attention_widths(model_or_config)
        check_latent_ranks(head_dim, kv_heads, hidden, self.kv_rank, self.rope_dims)

    def record(self) -> dict[str, Any]:
        """The fields as JSON (``config.headkit_surgery`` keeps them, ``rope_selection`` there being the one
        used, with the ranks, sites and rotary pairs the conversion chose)."""
        return asdict(self)

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> LatentKVConfig:
        """The config a record was written from (a field the record predates takes its default)."""
        return cls(**fields_of_record(cls, entry))

    def bytes_per_token(self, config: Any, *, bytes_per_number: int = 2) -> int | None:
        """The latent cache's bytes per token of context for a model with the 🤗 `config`: per layer R latent
        numbers and D rotary ones per key/value head (the pruning the config records applied)."""
        counts = kv_head_counts(config)
        if counts is None:
            return None
        return sum(self.kv_rank + kv * self.rope_dims for kv in counts) * bytes_per_number

    def sites_to_convert(
        self, model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
    ) -> tuple[AttentionAdapter, list[AttentionSite]]:
        """The adapter and the attention sites to convert, checked: the model's family, its attention modules
        (stock softmax, one layer of grouped-query attention each, no per-head k/q norm) and the ranks their
        widths allow."""
        _check_not_latent(model)
        if adapter is None:
            get_family(model, LATENT)
        adapter = get_adapter(model, adapter)
        sites = _check_sites(model, adapter)
        hidden = adapter.read_projections(sites[0]).k_weight.shape[1]
        for site in sites:
            check_latent_arguments(site, hidden, self.kv_rank, self.rope_dims)
        return adapter, sites


def compress_kv_to_latent(
    model: nn.Module,
    config: LatentKVConfig | None = None,
    *,
    calibration: Iterable[dict] | None = None,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    statistics: list[SiteStatistics] | None = None,
    **options: Any,
) -> LatentReport:
    """Convert every attention layer of a rotary, grouped-query causal LM to latent keys and values, in place.

    Args:
        model: a causal LM of a family registered for ``latent`` (:mod:`headkit.surgery.families`).
        config: how (:class:`LatentKVConfig`); or its fields as keywords (``kv_rank=…, rope_dims=…``).
        calibration: batches (dicts with ``input_ids``, optionally ``attention_mask``) on which the rotary pairs
            are ranked and the SVD weighted; None ranks by weight norms and uses the plain joint SVD.
        adapter: the architecture's adapter; detected when None.
        statistics: the calibration's per-layer statistics already collected (:func:`collect_statistics` on this
            model, or on a model with the same weights): they do not depend on the rank, so a curve over R
            collects them once. Given, `calibration` is not run again for them (it still says the conversion is
            calibrated; ``rank_allocation="sensitivity"`` runs it, with gradients).

    Returns a :class:`LatentReport`. Raises :class:`HeadkitError` for an unsupported family, an argument out of
    range, a model already converted or pruned unevenly — the model is then untouched.
    """
    say_deprecated("compress_kv_to_latent", LatentKVConfig)
    config = LatentKVConfig(**options) if config is None else given_config(LatentKVConfig, config, options)
    return _compress(model, config, calibration=calibration, adapter=adapter, statistics=statistics)


def _compress(
    model: nn.Module,
    config: LatentKVConfig,
    *,
    calibration: Iterable[dict] | None = None,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    statistics: list[SiteStatistics] | None = None,
) -> LatentReport:
    """:func:`headkit.apply_` of a :class:`LatentKVConfig` (see :func:`compress_kv_to_latent`)."""
    start = time.perf_counter()
    calibrated = calibration is not None or statistics is not None
    rope_selection = config.selection(calibrated)
    if config.rank_allocation == SENSITIVITY and calibration is None:
        raise HeadkitError(
            "rank_allocation 'sensitivity' runs the calibration batches with gradients: pass calibration=..., "
            "not only statistics"
        )
    calibration = None if calibration is None else list(calibration)  # read twice for 'sensitivity'
    kv_rank, rope_dims = config.kv_rank, config.rope_dims
    adapter, sites = config.sites_to_convert(model, adapter)
    hidden = adapter.read_projections(sites[0]).k_weight.shape[1]
    if statistics is not None and len(statistics) != len(sites):
        raise HeadkitError(
            f"statistics must hold one entry per attention layer ({len(sites)}), got {len(statistics)}"
        )
    refuse_modules_off_the_interface(
        model, [(s.name, s.module) for s in sites], f"{adapter.name} cannot be converted"
    )
    before = count_parameters(model)
    if statistics is None:
        statistics = (
            [weight_statistics(adapter, site) for site in sites]
            if calibration is None
            else collect_statistics(model, sites, adapter, calibration)
        )
    top = full_rank(hidden, sites[0].num_kv_heads, sites[0].head_dim, rope_dims)
    pairs = [select_rotary_pairs(stats, rope_dims // 2, rope_selection) for stats in statistics]
    fold = rope_selection == FITTED
    ranks = [kv_rank] * len(sites)
    candidates, rank_errors = None, None
    if config.rank_allocation == SPECTRUM:
        spectra = [
            latent_spectrum(adapter, site, chosen, stats, fold)
            for site, chosen, stats in zip(sites, pairs, statistics, strict=True)
        ]
        ranks = allocate_ranks(spectra, kv_rank * len(sites))
    elif config.rank_allocation == SENSITIVITY:
        candidates = candidate_ranks(kv_rank, top)
        rank_errors = rank_error_curves(model, config, calibration, statistics, adapter, candidates)
        ranks = allocate_by_error([(candidates, errors) for errors in rank_errors], kv_rank * len(sites))
    planned = [
        _plan_site(adapter, site, rank, chosen, stats, fold=fold)
        for site, rank, chosen, stats in zip(sites, ranks, pairs, statistics, strict=True)
    ]
    # Everything is computed and checked: only now does the model change.
    _apply(model, adapter, planned)
    record_surgery(
        model,
        {"op": SURGERY_OP, "adapter": adapter.name}
        | config.record()
        | {
            "rope_selection": rope_selection,
            "kv_ranks": ranks,
            "sites": [site.name for site in sites],
            "rope_pairs": [plan.report.rope_pairs for plan in planned],
        },
    )
    site = sites[0]
    return LatentReport(
        architecture=adapter.name,
        kv_rank=kv_rank,
        kv_ranks=ranks,
        rope_dims=rope_dims,
        full_rank=top,
        calibrated=calibrated,
        rope_selection=rope_selection,
        cache_numbers_before=2 * site.num_kv_heads * site.head_dim,
        cache_numbers_after=kv_rank + site.num_kv_heads * rope_dims,
        parameters_before=before,
        parameters_after=count_parameters(model),
        seconds=time.perf_counter() - start,
        sites=[plan.report for plan in planned],
        rank_allocation=config.rank_allocation,
        candidate_ranks=candidates,
        rank_errors=rank_errors,
    )


def latent_mechanisms(model: nn.Module) -> list[LatentKVHeads]:
    """The model's :class:`LatentKVHeads`, in layer order."""
    found = {id(m): m for m in model.modules() if isinstance(m, LatentKVHeads)}
    return sorted(found.values(), key=lambda mechanism: mechanism.layer_idx)


def set_absorbed(model: nn.Module, absorbed: bool) -> None:
    """Run every latent layer absorbed (True, the default) or through the expanded reference (False)."""
    for mechanism in latent_mechanisms(model):
        mechanism.absorbed = bool(absorbed)


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded conversion on a freshly built model (the weights are loaded afterwards)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = _check_sites(model, adapter)
    if [site.name for site in sites] != list(entry["sites"]):
        raise HeadkitError(
            f"the recorded latent conversion covered {entry['sites']}, but the rebuilt model has attention modules "
            f"{[site.name for site in sites]}"
        )
    config = LatentKVConfig.from_record(entry)
    rope_dims = config.rope_dims
    # Records written before ranks could be allocated per layer hold one rank for all.
    ranks = [int(rank) for rank in entry.get("kv_ranks") or [config.kv_rank] * len(sites)]
    hidden = adapter.read_projections(sites[0]).k_weight.shape[1]
    for site, rank in zip(sites, ranks, strict=True):
        check_latent_arguments(site, hidden, rank, rope_dims)
    planned = [
        _plan_site(
            adapter, site, rank, torch.tensor(pairs, dtype=torch.long).reshape(site.num_kv_heads, -1), None
        )
        for site, rank, pairs in zip(sites, ranks, entry["rope_pairs"], strict=True)
    ]
    _apply(model, adapter, planned)


register_conversion(LatentKVConfig, SURGERY_OP, _compress, _reapply, replaces_attention=True)

__all__ = [
    "FITTED",
    "LatentKVConfig",
    "LatentCacheLayer",
    "LatentFactors",
    "LatentKVHeads",
    "LatentReport",
    "NORMS",
    "RANK_ALLOCATIONS",
    "SENSITIVITY",
    "PositionEmbeddingsHook",
    "ROPE_SELECTIONS",
    "SPECTRUM",
    "UNIFORM",
    "allocate_by_error",
    "allocate_ranks",
    "candidate_ranks",
    "rank_error_curves",
    "RotaryKeyProjection",
    "RotationFit",
    "SiteStatistics",
    "attention_mask_for",
    "attention_widths",
    "check_latent_arguments",
    "check_latent_ranks",
    "collect_statistics",
    "compress_kv_to_latent",
    "expected_rotation",
    "fold_rotation",
    "full_rank",
    "joint_latent_factors",
    "latent_cache_layer",
    "latent_mechanisms",
    "latent_spectrum",
    "rotation_moments",
    "select_rotary_pairs",
    "set_absorbed",
    "weight_statistics",
]
