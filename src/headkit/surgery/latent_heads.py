"""The latent key/value mechanism of a converted layer and its cache (multi-head latent attention).

What :func:`headkit.surgery.latent.compress_kv_to_latent` puts into each attention module of a rotary,
grouped-query decoder (MHA2MLA, Ji et al. 2025, arXiv:2502.14837), through transformers' extension points
(:mod:`headkit.surgery.attention`):

* ``k_proj`` becomes a :class:`RotaryKeyProjection` writing only the D rotary dimensions of each key/value head
  (zeros elsewhere, so that the stock rotary embedding and view apply unchanged);
* the module gains the :class:`LatentKVHeads` mechanism (``headkit_attention``: K_g, V_g, the value bias), run
  by the registered ``headkit_<base>`` attention with the module's :class:`~headkit.surgery.attention.AttentionCall`.
  It undoes the stock rotation of the queries' rotary-free dimensions (the stock module rotates every dimension;
  :func:`headkit.ops.rotary.unrotate_pairs`, with the cos/sin a
  :class:`~headkit.surgery.attention.PositionEmbeddingsHook` hands it), keeps in its :class:`LatentCacheLayer`
  one row [c ; k_rope] of R + G·D numbers per token — instead of 2·G·head_dim — and attends with the key
  up-projection absorbed into the queries and the value up-projection applied to the weighted latent
  (:func:`headkit.ops.latent.latent_attention`), so the cache is never expanded. ``absorbed = False`` runs the
  expanded reference (:func:`headkit.ops.latent.naive_latent_attention`).

The mechanism is surgery's, not a layer of :mod:`headkit.layers`: it is called with surgery's
:class:`~headkit.surgery.attention.AttentionCall` and reads the rotary tables surgery's hook hands it. How its
weights are computed — the calibration, the rotation fit and the factorization — is
:mod:`headkit.surgery.latent_fit`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.cache import StateCacheLayer
from headkit.ops.latent import (
    LatentProjection,
    latent_attention,
    naive_latent_attention,
    naive_shared_rope_latent_attention,
)
from headkit.ops.rotary import unrotate_pairs
from headkit.surgery.attention import POSITION_EMBEDDINGS_KEYWORD, AttentionCall


class LatentCacheLayer(StateCacheLayer):
    """The entry of a latent layer in a 🤗 ``Cache``: one tensor [B, S, R + G·D] (per token the latent, then each
    key/value head's rotary key dimensions), grown by :class:`LatentKVHeads`."""

    describes = "a latent key/value attention layer"


class StaticLatentCacheLayer(LatentCacheLayer):
    """The fast decoder's entry of a latent layer (:mod:`headkit.runtime.fast`): the rows in one buffer
    [B, capacity, R + G·D] allocated once, a decoding step's row written in place at slot ``seen`` (an int64
    scalar tensor, so that a compiled step is not specialised on it, as transformers' ``StaticLayer`` counts),
    and attention over the whole buffer with the model's mask hiding the slots not written yet.

    A prompt (several tokens) runs the eager path: :meth:`get_state` hands it the rows written so far and
    :meth:`set_state` copies the result into the buffer. ``mask_length``: the key length it reports to the
    model's mask builder (``get_mask_sizes``), the static cache's length, as ``StaticLayer`` reports its
    ``max_cache_len``; ``capacity``: the tokens the buffer holds (the fast decoder's bucket)."""

    is_compileable = True

    def __init__(self, mask_length: int = 1, capacity: int = 0) -> None:
        super().__init__()
        self.mask_length, self.capacity = mask_length, capacity
        self.seen: torch.Tensor | None = None

    def get_state(self) -> torch.Tensor | None:
        if self.state is None or not self.is_initialized:
            return None
        return self.state[:, : int(self.seen)]

    def set_state(self, state: torch.Tensor, num_new_tokens: int) -> None:
        """Copy the rows of every token so far ([B, S, R + G·D], S ≤ ``capacity``) into the buffer, in place
        where it has their batch and width (a compiled step holds its address)."""
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative integer, got {num_new_tokens!r}")
        batch, held, width = state.shape
        if held > self.capacity:
            raise HeadkitError(
                f"latent layer: {held} tokens are more than the fixed buffer's capacity of {self.capacity}"
            )
        if (
            self.state is None
            or self.state.shape != (batch, self.capacity, width)
            or self.state.dtype != state.dtype
        ):
            self.state = state.new_zeros(batch, self.capacity, width)
            self.seen = torch.zeros((), dtype=torch.int64, device=state.device)
        self.state[:, :held].copy_(state)
        self.seen.fill_(held)
        self.is_initialized = True
        self.seen_tokens = held

    def step_(self, rows: torch.Tensor) -> torch.Tensor:
        """Write one token's rows [B, 1, R + G·D] at slot ``seen``, advance it, and return the whole buffer."""
        slot = self.seen.view(1)
        self.state.index_copy_(1, slot, rows.to(self.state.dtype))
        self.seen.add_(1)
        return self.state

    def get_seq_length(self) -> Any:
        if self.seen is None or not self.is_initialized:
            return 0
        return self.seen if torch.compiler.is_compiling() else int(self.seen)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.mask_length, 0

    def reset(self) -> None:
        # In place: the buffer keeps its address, which compiled steps hold.
        if self.state is not None:
            self.state.zero_()
            self.seen.zero_()
        self.is_initialized = False
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise HeadkitError("the fast decoder's fixed-size latent cache decodes greedily: no beam search")

    batch_select_indices = batch_repeat_interleave = reorder_cache


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
        mixed: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rank, self.rope_dims = rank, rope_index.shape[1]
        self.scale, self.layer_idx = scale, layer_idx
        self.absorbed = True
        factory = {"dtype": dtype, "device": device}
        # RoRoPE (mixed): the rotary keys are the virtual heads' (mixed across the key/value heads), each query
        # head reads all of them through rope_mix, and the rotary-free part is every dimension of the head's own
        # query against K_g c (the rest of its keys after the rotary slots, headkit.surgery.latent_fit.RotaryMixing).
        nope = head_dim if mixed else head_dim - self.rope_dims
        self.key_up = nn.Parameter(torch.zeros(num_kv_heads, nope, rank, **factory))
        self.value_up = nn.Parameter(torch.zeros(num_kv_heads, head_dim, rank, **factory))
        self.value_bias = nn.Parameter(torch.zeros(num_kv_heads, head_dim, **factory)) if value_bias else None
        pairs = self.rope_dims // 2
        self.rope_mix = (
            nn.Parameter(torch.zeros(num_kv_heads, pairs, num_kv_heads, head_dim // 2, **factory))
            if mixed
            else None
        )
        self.register_buffer("rope_index", rope_index.to(device), persistent=False)
        every = torch.arange(head_dim, device=device).expand(num_kv_heads, -1)
        nope_index = every if mixed else nope_indices(rope_index, head_dim).to(device)
        self.register_buffer("nope_index", nope_index, persistent=False)

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
        if isinstance(cache_layer, StaticLatentCacheLayer) and length == 1 and cache_layer.is_initialized:
            # the fast decoder's step: one real token per row, the whole fixed buffer read under the model's mask
            rows = cache_layer.step_(rows)
            mask, is_causal = static_step_mask(call.attention_mask, cache_layer.seen, rows.shape[1]), False
        else:
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
        if self.rope_mix is not None:
            query_rope = self.mixed_rotary_queries(unrotated, *embeddings)
            arguments = (unrotated, query_rope, rows, self.projection, mask)
            options = {"scale": scale, "is_causal": is_causal}
            if self.absorbed:
                output = latent_attention(*arguments, **options, shared_rope=True)
            else:
                output = naive_shared_rope_latent_attention(*arguments, **options)
        elif self.absorbed:
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

    def mixed_rotary_queries(
        self, unrotated: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """RoRoPE's rotary queries [B, H, T, G·D] from the unrotated queries [B, H, T, head_dim]: head h's pairs
        mixed into every kept slot (c, s) by ``rope_mix[c, s, g(h)]``, then rotated at the slot's frequency
        (rotate-half: x₁ cos − x₂ sin, x₂ cos + x₁ sin), laid out as the cache stores the virtual heads' rotary keys
        (per head c its first coordinates, then its second ones)."""
        batch, heads, length, head_dim = unrotated.shape
        groups, pairs, half = self.num_kv_heads, self.rope_dims // 2, head_dim // 2
        mix = self.rope_mix.repeat_interleave(heads // groups, dim=2).to(unrotated.dtype)  # [G, S, H, P]
        first = torch.einsum("bhtf,cshf->bhtcs", unrotated[..., :half], mix)
        second = torch.einsum("bhtf,cshf->bhtcs", unrotated[..., half:], mix)
        frequencies = self.rope_index[
            :, :pairs
        ]  # [G, S]: the kept pairs' first dimensions are their frequencies
        cos = cos[..., :half][:, None, :, frequencies].to(unrotated.dtype)  # [B, 1, T, G, S]
        sin = sin[..., :half][:, None, :, frequencies].to(unrotated.dtype)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.reshape(batch, heads, length, groups * 2 * pairs)

    @property
    def projection(self) -> LatentProjection:
        """The up-projections from this layer's cache rows (see :class:`headkit.ops.latent.LatentProjection`)."""
        return LatentProjection(self.key_up, self.value_up, self.value_bias, self.rope_index, self.nope_index)

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, rank={self.rank}, rope_dims={self.rope_dims}, absorbed={self.absorbed}, "
            f"mixed={self.rope_mix is not None}"
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
    mask = _attended(attention_mask, total)
    if mask.shape[-1] != total or mask.shape[0] not in (1, batch):
        raise HeadkitError(
            f"attention_mask must cover the {total} keys of a batch of {batch}, got {tuple(attention_mask.shape)}"
        )
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty, False


def _attended(attention_mask: Any, keys: int) -> torch.Tensor:
    """The model's 4D mask (bool, or additive with the dtype's minimum for a hidden key) over its first `keys`
    keys, as bool (True = attend)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise HeadkitError(
            "latent key/value attention takes the 4D masks of attn_implementation 'sdpa' or 'eager', got "
            f"{type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}"
        )
    mask = attention_mask[..., :keys]
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def static_step_mask(attention_mask: Any, seen: torch.Tensor, capacity: int) -> torch.Tensor:
    """The bool mask [B or 1, 1, 1, capacity] (True = attend) of one decoding step over a fixed buffer holding
    ``seen`` tokens: the model's 4D mask over the buffer (padding and the slots not written yet) where it passes
    one, else the written slots."""
    if attention_mask is None:
        return (torch.arange(capacity, device=seen.device) < seen)[None, None, None]
    return _attended(attention_mask, capacity)


def nope_indices(rope_index: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[G, head_dim − D]: per key/value head, the dimensions not in ``rope_index`` [G, D], ascending."""
    keep = torch.ones(rope_index.shape[0], head_dim, dtype=torch.bool, device=rope_index.device)
    keep.scatter_(1, rope_index, False)
    return torch.stack([torch.nonzero(row).flatten() for row in keep])


def rope_indices(pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[G, 2P]: the dimensions of the kept frequency pairs ``pairs`` [G, P] (pair i is dims i and i + head_dim/2),
    ascending."""
    return torch.cat((pairs, pairs + head_dim // 2), dim=1).sort(dim=1).values


__all__ = [
    "LatentCacheLayer",
    "LatentKVHeads",
    "RotaryKeyProjection",
    "StaticLatentCacheLayer",
    "attention_mask_for",
    "latent_cache_layer",
    "nope_indices",
    "rope_indices",
    "static_step_mask",
]
