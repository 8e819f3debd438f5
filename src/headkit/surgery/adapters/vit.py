"""ViT: ``layers[i].attention`` holds q_proj/k_proj/v_proj and runs ``o_proj`` itself."""

from __future__ import annotations

from torch import nn

from headkit.surgery.adapters.base import AttentionAdapter, register_adapter


@register_adapter
class ViTAdapter(AttentionAdapter):
    name = "vit"
    attention_path = "attention"

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        module.num_attention_heads = num_heads
