"""ViT: ``layers[i].attention`` holds q_proj/k_proj/v_proj and runs ``o_proj`` itself."""

from __future__ import annotations

from torch import nn

from headkit.surgery.adapters.base import AttentionAdapter, register_adapter


@register_adapter
class ViTAdapter(AttentionAdapter):
    name = "vit"
    model_types = ("vit",)
    layers_path = "layers"
    attention_path = "attention"
    output_projection_path = "attention.o_proj"
    query_name, key_name, value_name = "q_proj", "k_proj", "v_proj"
    epilogue_names = ("o_proj", None, None)

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        module.num_attention_heads = num_heads
