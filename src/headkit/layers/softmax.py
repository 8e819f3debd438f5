"""Softmax attention layer: multi-head or grouped-query attention with optional rotary positions.

The baseline every other mechanism is compared with. Vaswani et al. 2017, "Attention Is All You Need",
Eq. 1 and §3.2.2: head_h = softmax(Q W_h^Q (K W_h^K)ᵀ / √d) V W_h^V, output = Concat(head_1, …, head_H) W^O;
grouped-query attention (Ainslie et al. 2023, "GQA") shares each key/value head among H / Hkv query heads;
rotary position embeddings (Su et al. 2021, RoFormer, Eq. 34) rotate queries and keys by their absolute
positions so that scores depend on relative positions only. Decoding keeps every past key and value in the
cache (a transformers ``DynamicLayer``).
"""

from __future__ import annotations

from typing import Any

import torch

from headkit.layers.base import HeadkitAttention, LayerInputs, fused_unless_weights_needed
from headkit.layers.registry import register_attention
from headkit.ops._validation import repeat_kv
from headkit.ops.rotary import apply_rotary, rotary_cos_sin
from headkit.ops.softmax import softmax_attention


@register_attention("softmax", rotary=True)
class SoftmaxAttention(HeadkitAttention):
    """Multi-head / grouped-query softmax attention (``attention="softmax"``).

    Uses the config's ``attention_bias``, ``attention_dropout`` (on the attention probabilities, in training),
    ``causal`` and, when ``position_embedding_type == "rope"``, its rotary settings (``rope_parameters``).
    Attention weights are materialised only when ``output_attentions`` is asked for (or for dropout);
    otherwise :func:`headkit.ops.softmax_attention` runs PyTorch's fused kernels.
    """

    def __init__(self, config: Any, layer_idx: int, **head_overrides: int) -> None:
        super().__init__(config, layer_idx, **head_overrides)
        self.add_query_key_value_projections(config.attention_bias)
        self.scale = self.head_dim**-0.5
        self.use_rope = config.position_embedding_type == "rope"
        self.rope_kwargs = config.rope_kwargs() if self.use_rope else {}

    def attend(
        self, hidden_states: torch.Tensor, inputs: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        queries, keys, values = self.project_queries_keys_values(hidden_states)
        if self.use_rope:
            # Rotate before caching: cached keys keep the rotation of their own positions.
            cos, sin = rotary_cos_sin(inputs.positions, self.head_dim, **self.rope_kwargs, validate=False)
            queries = apply_rotary(queries, cos, sin, validate=False)
            keys = apply_rotary(keys, cos, sin, validate=False)
        if inputs.cache is not None:
            keys, values = inputs.cache.update(keys, values, self.layer_idx)

        kwargs = dict(causal=self.causal, attention_mask=inputs.key_mask, scale=self.scale)
        head_outputs, weights = fused_unless_weights_needed(
            lambda: softmax_attention(queries, keys, values, **kwargs, validate=False),
            lambda: softmax_attention_weights(queries, keys, **kwargs),
            values,
            dropout=self.attention_dropout if self.training else 0.0,
            output_attentions=inputs.output_attentions,
        )
        return self.project_heads(head_outputs), weights


def softmax_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The attention probabilities softmax(Q Kᵀ · scale) [B, H, Tq, Tk], computed explicitly (Vaswani et al. Eq. 1).

    Same masking as :func:`headkit.ops.softmax_attention`: ``causal`` lets query i see keys j ≤ i + Tk − Tq;
    ``attention_mask`` is a [B, Tk] bool key padding mask (True = real). A query that sees no key gets an
    all-zero row (the kernel returns a zero output for it), never NaN.
    """
    q_len, kv_len = q.shape[2], k.shape[2]
    keys = repeat_kv(k, q.shape[1] // k.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ keys.transpose(-1, -2)).float() * scale

    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(kv_len - q_len)
    visible = visible[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask[:, None, None, :].to(q.device)

    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    weights = weights.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    return weights.to(q.dtype)
