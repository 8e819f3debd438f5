"""Collaborative attention layer: heads that share one query and one key projection.

Cordonnier, Loukas & Jaggi 2020, "Multi-Head Attention: Collaborate Instead of Concatenate" (arXiv:2006.16362),
§3, Eq. 6: all heads share q̃ = W̃_Q x and k̃ = W̃_K x of width D̃ (``dim_shared_query_key``), head h re-weights the
shared dimensions with its mixing vector m_h, and a per-head content bias c_h scores each key on its own:

    score_h(i, j) = [(q̃_i ⊙ m_h)ᵀ k̃_j + c_hᵀ x_j] / √d,        head_h = softmax_j(score_h) V_h,

followed by the usual concatenation and output projection. With D̃ = heads · head_dim and the "concatenate"
mixing (m_h = 1 on head h's own block of D̃, 0 elsewhere) this is exactly multi-head attention; a smaller D̃
shares key/query dimensions across heads. The content bias is ``nn.Linear(hidden, heads, bias=False)`` on the
key inputs, as in the paper's code; the scale is the per-head 1/√head_dim of the multi-head model it
re-expresses (the paper's code divides by √(D̃/heads), the same at full size).

The key/value cache keeps, per token, the shared key with the unscaled content logits c_hᵀ x appended
([B, 1, T, D̃ + H] as its "keys": :func:`pack_shared_keys`) and the values ([B, Hkv, T, head_dim]).
:func:`collaborative_head_outputs` is the one implementation of the heads, shared with
:class:`headkit.surgery.CollaborativeHeads`, which puts them into pretrained models (there the stock module
updates the cache: its key projection writes the same packed layout, zero-padded to whole heads).
:func:`concatenated_mixing` and :func:`content_bias_weight` (a query bias as a content bias) are the exact
re-expression of multi-head attention, which surgery's decomposition uses too.
:meth:`CollaborativeAttention.from_weights` and :meth:`CollaborativeAttention.from_softmax_attention` build the
layer from explicit weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import initialization as init

from headkit.layers.base import HeadkitAttention, LayerInputs, fused_unless_weights_needed
from headkit.layers.registry import register_attention
from headkit.ops._validation import check_positive_int, check_rank, repeat_kv
from headkit.ops.collaborative import collaborative_attention, collaborative_attention_weights

# The "normal" mixing initialisation's standard deviation, that of the paper's reference implementation.
NORMAL_MIXING_STD = 0.2


def concatenated_mixing(num_heads: int, dim_shared_query_key: int) -> torch.Tensor:
    """The "concatenate" mixing [heads, D̃]: head h owns block h of ⌈D̃ / heads⌉ shared dimensions (1s there).

    At D̃ = heads · head_dim it makes collaborative heads exactly the heads of multi-head attention; when heads
    does not divide D̃ the last head's block is shorter.
    """
    block = -(-dim_shared_query_key // num_heads)
    mixing = torch.zeros(num_heads, dim_shared_query_key)
    for head in range(num_heads):
        mixing[head, head * block : (head + 1) * block] = 1.0
    return mixing


def content_bias_weight(q_bias: torch.Tensor, k_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The content bias [heads, hidden] that re-expresses a query bias: row h is c_h = W_{K,h}ᵀ b_{Q,h}, the
    part of head h's score that the query bias adds and that varies over the keys (the key bias only adds terms
    constant over the keys, which the softmax cancels: paper §4). `k_weight` [heads · head_dim, hidden] (one key
    head per query head); computed in float64, returned in its dtype."""
    hidden = k_weight.shape[1]
    per_head_bias = q_bias.detach().to(torch.float64).view(num_heads, -1)
    per_head_key = k_weight.detach().to(torch.float64).view(num_heads, -1, hidden)
    return torch.einsum("hd,hdi->hi", per_head_bias, per_head_key).to(k_weight.dtype)


@register_attention("collaborative")
class CollaborativeAttention(HeadkitAttention):
    """Collaborative multi-head attention (``attention="collaborative"``).

    Modules and parameters: ``q_proj``, ``k_proj`` (``nn.Linear`` hidden → D̃, no bias: the shared projections),
    ``content_bias`` (``nn.Linear`` hidden → heads, no bias), ``mixing`` [heads, D̃], ``v_proj`` (hidden →
    num_key_value_heads · head_dim) and ``o_proj``. Uses the config's ``dim_shared_query_key`` (None: heads ·
    head_dim; the ``dim_shared_query_key`` keyword overrides it), ``collaborative_init`` ("concatenate" |
    "normal"), ``attention_bias`` (on v_proj / o_proj), ``attention_dropout`` (on the probabilities, in
    training) and ``causal``. No positional encoding of its own. The [Tq, Tk] weights are materialised for
    ``output_attentions``, dropout, or keys no more than D̃ (where they are no larger than the mixed queries).
    """

    repr_fields = ("dim_shared_query_key",)

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        *,
        dim_shared_query_key: int | None = None,
        **head_overrides: int,
    ) -> None:
        super().__init__(config, layer_idx, **head_overrides)
        if dim_shared_query_key is None:
            dim_shared_query_key = config.dim_shared_query_key or self.num_heads * self.head_dim
        self.dim_shared_query_key = check_positive_int("dim_shared_query_key", dim_shared_query_key)
        self.q_proj = nn.Linear(self.hidden_size, self.dim_shared_query_key, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.dim_shared_query_key, bias=False)
        self.content_bias = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.mixing = nn.Parameter(torch.empty(self.num_heads, self.dim_shared_query_key))
        self.mixing_init = config.collaborative_init
        if self.mixing_init not in ("concatenate", "normal"):
            raise ValueError(
                f"collaborative_init must be 'concatenate' or 'normal', got {self.mixing_init!r}"
            )
        self.scale = self.head_dim**-0.5
        # A standalone layer is usable at once; inside a model, _init_weights initialises again.
        self.init_extra_parameters(config.initializer_range)

    def init_extra_parameters(self, std: float) -> None:
        if self.mixing_init == "concatenate":
            init.copy_(self.mixing, concatenated_mixing(self.num_heads, self.dim_shared_query_key))
        else:
            init.normal_(self.mixing, std=NORMAL_MIXING_STD)

    def attend(
        self, hidden_states: torch.Tensor, inputs: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        values = self.split_heads(self.v_proj(hidden_states), self.num_key_value_heads)
        head_outputs, weights = collaborative_head_outputs(
            self.q_proj(hidden_states),
            self.k_proj(hidden_states),
            self.content_bias(hidden_states),  # [B, T, H]
            values,
            self.mixing,
            scale=self.scale,
            causal=self.causal,
            attention_mask=inputs.key_mask,
            cache=inputs.cache,
            layer_idx=self.layer_idx,
            dropout=self.attention_dropout if self.training else 0.0,
            output_attentions=inputs.output_attentions,
            validate=False,
        )
        return self.project_heads(head_outputs), weights

    @classmethod
    def from_weights(
        cls,
        config: Any,
        layer_idx: int,
        *,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        mixing: torch.Tensor,
        v_weight: torch.Tensor,
        o_weight: torch.Tensor,
        content_bias_weight: torch.Tensor | None = None,
        v_bias: torch.Tensor | None = None,
        o_bias: torch.Tensor | None = None,
    ) -> CollaborativeAttention:
        """A layer holding the given weights (``nn.Linear`` layout: [out_features, in_features]).

        Args:
            config: supplies hidden_size, attention_bias, causal, dropout; head counts come from the weights.
            q_weight, k_weight: shared projections W̃_Q, W̃_K [D̃, hidden].
            mixing: [heads, D̃].
            v_weight: [kv_heads · head_dim, hidden]; o_weight: [hidden, heads · head_dim].
            content_bias_weight: [heads, hidden] (row h = c_h, unscaled); None = no content bias (zeros).
            v_bias, o_bias: needed exactly when ``config.attention_bias`` (None then means zeros).
        """
        check_rank("mixing", mixing, 2, "[heads, dim_shared_query_key]")
        num_heads, dim_shared = mixing.shape
        hidden = config.hidden_size
        _expect_shape("q_weight", q_weight, (dim_shared, hidden), "[dim_shared_query_key, hidden_size]")
        _expect_shape("k_weight", k_weight, (dim_shared, hidden), "[dim_shared_query_key, hidden_size]")
        if o_weight.dim() != 2 or o_weight.shape[0] != hidden or o_weight.shape[1] % num_heads:
            raise ValueError(
                f"o_weight must have shape [hidden_size, heads * head_dim] = [{hidden}, {num_heads} * head_dim], "
                f"got {tuple(o_weight.shape)}"
            )
        head_dim = o_weight.shape[1] // num_heads
        if v_weight.dim() != 2 or v_weight.shape[1] != hidden or v_weight.shape[0] % head_dim:
            raise ValueError(
                f"v_weight must have shape [kv_heads * head_dim, hidden_size] = [kv_heads * {head_dim}, {hidden}], "
                f"got {tuple(v_weight.shape)}"
            )
        num_kv_heads = v_weight.shape[0] // head_dim
        if content_bias_weight is not None:
            _expect_shape(
                "content_bias_weight", content_bias_weight, (num_heads, hidden), "[heads, hidden_size]"
            )
        for name, bias in (("v_bias", v_bias), ("o_bias", o_bias)):
            if bias is not None and not config.attention_bias:
                raise ValueError(f"{name} was given, but config.attention_bias is False (no bias to hold it)")

        layer = cls(
            config,
            layer_idx,
            dim_shared_query_key=dim_shared,
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
        )
        with torch.no_grad():
            layer.q_proj.weight.copy_(q_weight)
            layer.k_proj.weight.copy_(k_weight)
            layer.mixing.copy_(mixing)
            layer.v_proj.weight.copy_(v_weight)
            layer.o_proj.weight.copy_(o_weight)
            if content_bias_weight is None:
                layer.content_bias.weight.zero_()
            else:
                layer.content_bias.weight.copy_(content_bias_weight)
            for module, bias in ((layer.v_proj, v_bias), (layer.o_proj, o_bias)):
                if module.bias is not None and bias is None:
                    module.bias.zero_()
                elif module.bias is not None:
                    module.bias.copy_(bias)
        return layer

    @classmethod
    def from_softmax_attention(cls, layer: HeadkitAttention) -> CollaborativeAttention:
        """The exact collaborative form (D̃ = heads · head_dim, concatenated mixing) of a softmax layer.

        The query bias becomes the content bias c_h = W_{K,h}ᵀ b_{Q,h}; the key bias only adds a term constant
        over the keys, which the softmax cancels (paper §4). Shared key/value heads (grouped-query attention) are
        repeated into the shared key. Rotary positions have no collaborative form: such a layer is refused.
        """
        if layer.use_rope:
            raise ValueError(
                "a softmax layer with rotary positions (position_embedding_type='rope') has no exact "
                "collaborative form: the rotation acts between the query and key projections"
            )
        heads, groups, head_dim = layer.num_heads, layer.num_key_value_groups, layer.head_dim
        hidden = layer.hidden_size
        q_weight = layer.q_proj.weight.detach()
        k_weight = layer.k_proj.weight.detach().view(layer.num_key_value_heads, head_dim, hidden)
        # [heads · head_dim, hidden]: each head's key rows, grouped key/value heads repeated
        k_weight = k_weight.repeat_interleave(groups, dim=0).reshape(heads * head_dim, hidden)
        q_bias = layer.q_proj.bias
        return cls.from_weights(
            layer.config,
            layer.layer_idx,
            q_weight=q_weight,
            k_weight=k_weight,
            mixing=concatenated_mixing(heads, heads * head_dim).to(q_weight),
            v_weight=layer.v_proj.weight.detach(),
            o_weight=layer.o_proj.weight.detach(),
            content_bias_weight=None if q_bias is None else content_bias_weight(q_bias, k_weight, heads),
            v_bias=None if layer.v_proj.bias is None else layer.v_proj.bias.detach(),
            o_bias=None if layer.o_proj.bias is None else layer.o_proj.bias.detach(),
        )


def collaborative_head_outputs(
    shared_queries: torch.Tensor,
    shared_keys: torch.Tensor,
    content_logits: torch.Tensor | None,
    values: torch.Tensor,
    mixing: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    layer_idx: int | None = None,
    dropout: float = 0.0,
    output_attentions: bool = False,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-head outputs [B, H, Tq, Dv] of collaborative heads, and their weights when asked for.

    The one implementation behind :class:`CollaborativeAttention` and the surgery module that puts collaborative
    heads into a pretrained 🤗 model (:class:`headkit.surgery.CollaborativeHeads`, without a cache): cache update
    (:func:`update_collaborative_cache`), grouped values, and the one "fused unless the weights are needed"
    choice: :func:`headkit.ops.collaborative_attention` (SDPA's fused kernels with no [Tq, Tk] tensor, or
    explicit scores for short sequences) unless ``output_attentions`` or dropout on the weights need
    :func:`headkit.ops.collaborative.collaborative_attention_weights`.

    Args:
        shared_queries, shared_keys: X W̃_Q and X W̃_K of the current tokens, [B, T, D̃].
        content_logits: the current tokens' content-bias logits c_hᵀ x, unscaled, [B, T, H]; or None (no
            content bias). They are scaled here, like the mixed dot products they are added to.
        values: the current tokens' values [B, Hkv, T, Dv], Hkv dividing H.
        mixing: [H, D̃] (cast to the queries' dtype).
        scale: multiplies the mixed dot products.
        causal: query i sees keys j ≤ i + past.
        attention_mask: over every key, past and current: a key padding mask [B, Tk] or a mask
            [B, 1|H, Tq|1, Tk], bool or additive float (:func:`headkit.ops.collaborative_attention`).
        cache: a key/value cache updated in place (``update(keys, values, layer_idx)``), or None.
        dropout: probability of dropping attention weights (pass 0 outside training).
        validate: let the op check its arguments; ``False`` from :class:`CollaborativeAttention`, whose
            projections and validated key padding mask are right by construction.
    """
    if cache is not None:
        shared_keys, content_logits, values = update_collaborative_cache(
            cache, layer_idx, shared_keys, content_logits, values
        )
    heads = mixing.shape[0]
    values = repeat_kv(values, heads // values.shape[1])
    # [B, H, Tk], scaled like the mixed dot products (the op adds it as it is)
    content_bias = None if content_logits is None else (scale * content_logits).transpose(1, 2)
    mixing = mixing.to(shared_queries.dtype)
    kwargs = {
        "content_bias": content_bias,
        "causal": causal,
        "attention_mask": attention_mask,
        "scale": scale,
        "validate": validate,
    }
    return fused_unless_weights_needed(
        lambda: collaborative_attention(shared_queries, shared_keys, values, mixing, **kwargs),
        lambda: collaborative_attention_weights(shared_queries, shared_keys, mixing, **kwargs),
        values,
        dropout=dropout,
        output_attentions=output_attentions,
    )


def update_collaborative_cache(
    cache: Any,
    layer_idx: int | None,
    shared_keys: torch.Tensor,
    content_logits: torch.Tensor | None,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Append the current tokens to a key/value cache; return the whole history: shared keys [B, Tk, D̃], content
    logits [B, Tk, H] (None when there are none) and values [B, Hkv, Tk, Dv].

    The cache's "keys" are a single head [B, 1, T, D̃ (+ H)], each token's shared key with its content logits
    appended (:func:`pack_shared_keys`), and its values are the values. Any cache that concatenates along the
    sequence dimension holds it (:class:`headkit.layers.HeadkitCache`, 🤗 ``DynamicCache``).
    """
    if layer_idx is None:
        raise ValueError("a collaborative attention module without a layer_idx cannot use a key/value cache")
    keys, values = cache.update(pack_shared_keys(shared_keys, content_logits)[:, None], values, layer_idx)
    heads = 0 if content_logits is None else content_logits.shape[-1]
    return *unpack_shared_keys(keys[:, 0], shared_keys.shape[-1], heads), values


def pack_shared_keys(shared_keys: torch.Tensor, content_logits: torch.Tensor | None) -> torch.Tensor:
    """The one key layout of collaborative heads, as a cache holds it: each token's shared key [.., D̃] with its
    content logits [.., H] appended (in the keys' dtype), [.., D̃ + H]. Surgery's key projection writes it
    (:class:`headkit.surgery.collaborative.SharedProjection`, zero-padded for the stock module's view)."""
    return (
        shared_keys
        if content_logits is None
        else torch.cat([shared_keys, content_logits.to(shared_keys.dtype)], -1)
    )


def unpack_shared_keys(
    keys: torch.Tensor, dim_shared_query_key: int, content_heads: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(shared keys [.., D̃], content logits [.., H] or None without content heads) of keys packed by
    :func:`pack_shared_keys`; what follows them (a padding) is left out."""
    shared = keys[..., :dim_shared_query_key]
    if not content_heads:
        return shared, None
    return shared, keys[..., dim_shared_query_key : dim_shared_query_key + content_heads]


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must have shape {layout} = {list(shape)}, got {got}")
