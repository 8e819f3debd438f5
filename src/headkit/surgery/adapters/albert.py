"""ALBERT: every transformer layer runs the AlbertLayer of its group (one group by default, so one attention
module serves all layers and is one site). Its attention module runs the output projection, dropout and the
residual LayerNorm itself."""

from __future__ import annotations

from torch import nn

from headkit.surgery.adapters.base import AttentionAdapter, register_adapter


@register_adapter
class AlbertAdapter(AttentionAdapter):
    name = "albert"
    attention_path = "attention"
    query_name, key_name, value_name = "query", "key", "value"
    head_dim_attribute = "attention_head_size"
    epilogue_names = ("dense", "output_dropout", "LayerNorm")

    def layers(self, model: nn.Module) -> list[nn.Module]:
        # AlbertTransformer.forward: layer i runs every AlbertLayer of group int(i / (layers / groups)).
        encoder = model.base_model.encoder
        config = model.config
        groups = encoder.albert_layer_groups
        per_group = config.num_hidden_layers / config.num_hidden_groups
        return [
            albert_layer
            for i in range(config.num_hidden_layers)
            for albert_layer in groups[int(i / per_group)].albert_layers
        ]

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        module.num_attention_heads = num_heads
        module.all_head_size = num_heads * head_dim


# The name the collaborative-attention reference package uses.
ALBERTCollaborativeAdapter = AlbertAdapter
