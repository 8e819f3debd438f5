"""Linear attention layer: kernelised attention with a constant-size recurrent state for decoding.

Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention"
(arXiv:2006.16236). With the similarity sim(q, k) = φ(q)ᵀ φ(k) (Eq. 3) every head computes

    out_i = φ(q_i)ᵀ S_i / (φ(q_i)ᵀ z_i + eps),    S_i = Σ_{j ≤ i} φ(k_j) v_jᵀ,    z_i = Σ_{j ≤ i} φ(k_j)

(Eq. 9–11; the sums run over every key when the layer is bidirectional), then the heads are merged by
``o_proj`` as in multi-head attention. (S, z) is the whole past: decoding keeps one
:class:`~headkit.ops.LinearAttentionState` per layer, whatever the context length (Eq. 16–20). The prefill
runs :func:`headkit.ops.linear_attention` chunkwise with ``output_final_state``, each new token
:func:`headkit.ops.linear_attention_step`; both continue the same sums, so decoding equals the full forward.

The layer has no positional encoding of its own (the causal sums already order the tokens); use
``position_embedding_type="learned"`` or a hybrid with softmax/CoCA layers for explicit positions.
"""

from __future__ import annotations

from typing import Any

import torch

from headkit.layers.base import HeadkitAttention, LayerInputs
from headkit.layers.cache import StateCacheLayer
from headkit.layers.registry import register_attention
from headkit.ops.feature_maps import get_feature_map
from headkit.ops.linear import linear_attention, linear_attention_step


@register_attention("linear")
class LinearAttention(HeadkitAttention):
    """Multi-head / grouped-query linear attention (``attention="linear"``).

    Uses the config's ``feature_map`` (φ, a name from :data:`headkit.ops.FEATURE_MAPS`; "elu" = elu + 1, the
    paper's Eq. 7), ``chunk_size`` (tokens per chunk of the causal chunkwise-parallel forward; a speed knob),
    ``attention_bias`` and ``causal``. Padding keys (``attention_mask`` False) contribute nothing to the sums;
    a query that has seen no real key outputs zeros. There are no attention weights to return
    (``output_attentions`` gives None): the T × T matrix is never formed.
    """

    cache_layer_class = StateCacheLayer

    repr_fields = ("feature_map", "chunk_size")

    def __init__(self, config: Any, layer_idx: int, **head_overrides: int) -> None:
        super().__init__(config, layer_idx, **head_overrides)
        self.add_query_key_value_projections(config.attention_bias)
        get_feature_map(config.feature_map)  # an unknown name fails here, not at the first forward
        self.feature_map = config.feature_map
        self.chunk_size = config.chunk_size

    def attend(self, hidden_states: torch.Tensor, inputs: LayerInputs) -> tuple[torch.Tensor, None]:
        queries, keys, values = self.project_queries_keys_values(hidden_states)
        # The state already summarises the past keys (padding included, as zeros): only the new ones are masked.
        new_keys_mask = inputs.new_tokens_mask

        if inputs.cache is not None and not self.causal:
            raise ValueError("a cache needs a causal layer (config.causal=True): a state sums the past")
        state = self.recurrent_state(inputs)
        if (
            inputs.cache is not None
            and inputs.seq == 1
            and (new_keys_mask is None or bool(new_keys_mask.all()))
        ):
            # The recurrent form of Eq. 16-20; it has no mask, so a padding token takes the chunked path below.
            head_outputs, state = linear_attention_step(
                queries, keys, values, state, feature_map=self.feature_map, validate=False
            )
        else:
            head_outputs, state = linear_attention(
                queries,
                keys,
                values,
                feature_map=self.feature_map,
                causal=self.causal,
                attention_mask=new_keys_mask,
                chunk_size=self.chunk_size,
                initial_state=state,
                output_final_state=inputs.cache is not None,
                validate=False,
            )
        return self.finish_recurrent(inputs, state, head_outputs)
