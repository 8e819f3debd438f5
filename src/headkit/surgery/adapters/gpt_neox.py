"""GPT-NeoX (Pythia): ``layers[i].attention`` computes queries, keys and values with one fused ``nn.Linear``,
``query_key_value``, whose rows are interleaved per head: head h owns rows h·3d … (h+1)·3d − 1 as [q_h | k_h | v_h]
(the forward views the output as [..., heads, 3·head_size] and chunks the last axis in three). The module runs
``dense`` itself. Multi-head attention (no grouped-query), rotary embeddings on the first ``rotary_ndims``
features of each head only. The head width is ``hidden_size // num_attention_heads`` in the config, which
therefore cannot state fewer heads of the same width: a pruned model reloads with headkit.from_pretrained."""

from __future__ import annotations

import torch
from torch import nn

from headkit.surgery.adapters.base import (
    AttentionAdapter,
    AttentionSite,
    ProjectionWeights,
    linear_parameters,
    register_adapter,
    replace_linear,
)


@register_adapter
class GPTNeoXAdapter(AttentionAdapter):
    name = "gpt_neox"
    attention_path = "attention"
    query_name = key_name = value_name = "query_key_value"
    head_dim_attribute = "head_size"
    epilogue_names = ("dense", None, None)
    multi_head_only = "GPT-NeoX"
    rotary = True

    def head_geometry(self, module: nn.Module) -> tuple[int, int, int]:
        if not hasattr(module, "query_key_value"):
            return super().head_geometry(module)
        head_dim = int(module.head_size)
        heads = int(linear_parameters(module.query_key_value)[0].shape[0]) // (3 * head_dim)
        return heads, heads, head_dim

    def read_projections(self, site: AttentionSite) -> ProjectionWeights:
        self._require_original(site, "read its projections")
        weight, bias = linear_parameters(site.module.query_key_value)
        heads, d = site.num_heads, site.head_dim
        q_weight, k_weight, v_weight = (
            w.reshape(heads * d, -1) for w in weight.view(heads, 3, d, -1).unbind(1)
        )
        q_bias = k_bias = v_bias = None
        if bias is not None:
            q_bias, k_bias, v_bias = (b.reshape(heads * d) for b in bias.view(heads, 3, d).unbind(1))
        o_weight, o_bias = linear_parameters(site.output_projection)
        return ProjectionWeights(q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias)

    def write_linears(self, model: nn.Module, site: AttentionSite, weights: ProjectionWeights) -> None:
        d = site.head_dim
        heads = weights.q_weight.shape[0] // d
        fused_weight = torch.stack(
            [w.view(heads, d, -1) for w in (weights.q_weight, weights.k_weight, weights.v_weight)], dim=1
        ).reshape(heads * 3 * d, -1)
        fused_bias = None
        if weights.q_bias is not None:
            fused_bias = torch.stack(
                [b.view(heads, d) for b in (weights.q_bias, weights.k_bias, weights.v_bias)], dim=1
            ).reshape(heads * 3 * d)
        replace_linear(site.module, "query_key_value", fused_weight, fused_bias)
        replace_linear(model, site.output_projection_name, weights.o_weight, weights.o_bias)
