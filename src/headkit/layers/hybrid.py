"""Hybrid attention layer: sliding-window softmax plus learnable linear attention, the LoLCATs layer.

Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large Language Models" (arXiv:2410.10254). Each head
attends with exact softmax to the last ``hybrid_window`` tokens and with linear attention, through learnable
Hedgehog feature maps (Zhang et al. 2024, arXiv:2402.04347), to every earlier token, under one normaliser:

    y_i = [Σ_{j ∈ window} exp(s_ij − m_i) v_j + γ_h Σ_{j ≤ i − W} φ_q(q_i)ᵀ φ_k(k_j) v_j] / [same weights summed]

(:func:`headkit.ops.hybrid_attention`, whose docstring gives the convention for the stabiliser m_i). The layer
has the usual ``q_proj``/``k_proj``/``v_proj``/``o_proj`` — a pretrained softmax layer's weights load into them
unchanged, which is what linearising a pretrained model needs — plus, per layer, a feature map for the queries
(one projection per query head) and one for the keys (one per key/value head, so grouped-query keys are mapped
once), and the per-head balance γ_h = exp(``log_balance``), positive by construction and 1 at initialisation.

The feature maps read the queries and keys *after* the rotary embedding, as LoLCATs does: the linear term is
trained to mimic the same softmax scores exp(q·k/√d) that the window computes, and those are scores of the
rotated vectors. The window is counted in token positions of the input (padding slots included), so left
padding — the only padding of batched generation — leaves every real token's window and linear sums unchanged.

Decoding keeps a fixed-size :class:`headkit.ops.HybridAttentionState` per layer in a
:class:`~headkit.layers.cache.StateCacheLayer` (the last W − 1 rotated keys, values and key features, and
the linear sums of everything older): its size does not grow with the context.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import initialization as init

from headkit.layers.base import HeadkitAttention, LayerInputs
from headkit.layers.cache import StateCacheLayer
from headkit.layers.feature_maps import build_feature_map
from headkit.layers.registry import register_attention
from headkit.ops.hybrid import hybrid_attention, hybrid_attention_step
from headkit.ops.rotary import apply_rotary, rotary_cos_sin


@register_attention("hybrid", rotary=True, compared=False)
class HybridAttention(HeadkitAttention):
    """Sliding-window softmax + linear attention with learnable feature maps (``attention="hybrid"``).

    Uses the config's ``hybrid_window`` (W, tokens seen exactly, the query's own included),
    ``hybrid_feature_map`` (a learnable map such as "hedgehog", or a parameter-free one such as "elu"),
    ``hybrid_feature_dim`` (the learnable map's projection width; None = head_dim), ``chunk_size`` (queries per
    chunk of the parallel form), ``attention_bias`` and, when ``position_embedding_type == "rope"``, the rotary
    settings. Causal only. ``output_attentions`` gives None and ``attention_dropout`` is not applied: the weights
    are never materialised as a T × T matrix.
    """

    cache_layer_class = StateCacheLayer

    repr_fields = ("window", "chunk_size")

    def __init__(self, config: Any, layer_idx: int, **head_overrides: int) -> None:
        super().__init__(config, layer_idx, **head_overrides)
        if not self.causal:
            raise ValueError(
                "hybrid attention is causal only (a sliding window over the past plus a linear state of what "
                "left it); set config.causal=True or use another mechanism for a bidirectional model"
            )
        self.add_query_key_value_projections(config.attention_bias)
        self.window = config.hybrid_window
        self.chunk_size = config.chunk_size
        self.scale = self.head_dim**-0.5
        self.use_rope = config.position_embedding_type == "rope"
        self.rope_kwargs = config.rope_kwargs() if self.use_rope else {}
        feature_map, feature_dim = config.hybrid_feature_map, config.hybrid_feature_dim
        self.feature_map_q = build_feature_map(feature_map, self.num_heads, self.head_dim, feature_dim)
        self.feature_map_k = build_feature_map(
            feature_map, self.num_key_value_heads, self.head_dim, feature_dim
        )
        # γ_h = exp(log_balance_h): positive, so the shared normaliser stays positive for non-negative features.
        self.log_balance = nn.Parameter(torch.empty(self.num_heads))
        # A standalone layer is usable at once; inside a model, _init_weights initialises again.
        self.init_extra_parameters(config.initializer_range)

    def init_extra_parameters(self, std: float) -> None:
        # γ = 1: window and linear terms start on an equal footing (LoLCATs starts from a comparable 2).
        init.zeros_(self.log_balance)
        self.feature_map_q.reset_parameters()
        self.feature_map_k.reset_parameters()

    @property
    def balance(self) -> torch.Tensor:
        """γ_h per query head, [num_heads]."""
        return self.log_balance.exp()

    def attend(self, hidden_states: torch.Tensor, inputs: LayerInputs) -> tuple[torch.Tensor, None]:
        queries, keys, values = self.project_queries_keys_values(hidden_states)
        if self.use_rope:
            # Rotate before the state: stored window keys keep the rotation of their own positions.
            cos, sin = rotary_cos_sin(inputs.positions, self.head_dim, **self.rope_kwargs, validate=False)
            queries = apply_rotary(queries, cos, sin, validate=False)
            keys = apply_rotary(keys, cos, sin, validate=False)
        # The state carries the padding flags of the past tokens: only the new ones are passed.
        new_keys_mask = inputs.new_tokens_mask
        query_features = self.feature_map_q(queries)
        key_features = self.feature_map_k(keys)

        state = self.recurrent_state(inputs)
        tensors = (queries, keys, values, query_features, key_features, self.balance)
        if inputs.cache is not None and inputs.seq == 1:
            head_outputs, state = hybrid_attention_step(
                *tensors,
                state,
                window=self.window,
                attention_mask=new_keys_mask,
                scale=self.scale,
                validate=False,
            )
        else:
            head_outputs, state = hybrid_attention(
                *tensors,
                window=self.window,
                attention_mask=new_keys_mask,
                chunk_size=self.chunk_size,
                scale=self.scale,
                initial_state=state,
                output_final_state=inputs.cache is not None,
                validate=False,
            )
        return self.finish_recurrent(inputs, state, head_outputs)
