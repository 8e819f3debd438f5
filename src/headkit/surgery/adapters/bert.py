"""BERT (and the sentence encoders built on it, e.g. all-MiniLM-L6-v2): ``encoder.layer[i].attention.self``
holds query/key/value; the output projection ``attention.output.dense`` lives in a sibling module."""

from __future__ import annotations

from torch import nn

from headkit.surgery.adapters.base import AttentionAdapter, register_adapter


@register_adapter
class BertAdapter(AttentionAdapter):
    name = "bert"
    layers_path = "encoder.layer"
    attention_path = "attention.self"
    output_projection_path = "attention.output.dense"
    query_name, key_name, value_name = "query", "key", "value"
    head_dim_attribute = "attention_head_size"
    epilogue_names = ()  # the output projection lives in a sibling module

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        module.num_attention_heads = num_heads
        module.all_head_size = num_heads * head_dim


# The name the collaborative-attention reference package uses.
BERTCollaborativeAdapter = BertAdapter
