"""GPT-2: ``h[i].attn`` computes queries, keys and values with one fused ``Conv1D`` (``c_attn``, weight stored
[in, out], output split as [q | k | v]) and runs ``c_proj`` and ``resid_dropout`` itself."""

from __future__ import annotations

import torch
from torch import nn

from headkit.surgery.adapters.base import (
    AttentionAdapter,
    AttentionSite,
    ProjectionWeights,
    linear_parameters,
    new_linear,
    register_adapter,
    replace_linear,
)


@register_adapter
class GPT2Adapter(AttentionAdapter):
    name = "gpt2"
    layers_path = "h"
    attention_path = "attn"
    query_name = key_name = value_name = "c_attn"
    epilogue_names = ("c_proj", "resid_dropout", None)
    multi_head_only = "GPT-2"

    def head_geometry(self, module: nn.Module) -> tuple[int, int, int]:
        if not hasattr(module, "c_attn"):
            return super().head_geometry(module)
        heads = linear_parameters(module.c_attn)[0].shape[0] // 3 // module.head_dim
        return heads, heads, module.head_dim

    def read_projections(self, site: AttentionSite) -> ProjectionWeights:
        self._require_original(site, "read its projections")
        fused_weight, fused_bias = linear_parameters(site.module.c_attn)
        q_weight, k_weight, v_weight = fused_weight.chunk(3, dim=0)
        q_bias, k_bias, v_bias = fused_bias.chunk(3, dim=0)
        o_weight, o_bias = linear_parameters(site.output_projection)
        return ProjectionWeights(q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias)

    def write_linears(self, model: nn.Module, site: AttentionSite, weights: ProjectionWeights) -> None:
        module = site.module
        fused_weight = torch.cat([weights.q_weight, weights.k_weight, weights.v_weight])
        fused_bias = torch.cat([weights.q_bias, weights.k_bias, weights.v_bias])
        module.c_attn = new_linear(fused_weight, fused_bias, like=module.c_attn)
        replace_linear(model, site.output_projection_name, weights.o_weight, weights.o_bias)

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        module.num_heads = num_heads
        module.split_size = num_heads * head_dim  # c_attn's output is split into q, k, v of this width

    def set_fused_widths(self, module: nn.Module, widths: tuple[int, int, int]) -> None:
        # GPT2Attention.forward splits c_attn's output with Tensor.split(self.split_size), which takes a list of
        # section widths as well as one width: a list lets the queries, keys and values differ in width without
        # padding the values (nor their KV cache) to the widest part.
        module.split_size = list(widths)
