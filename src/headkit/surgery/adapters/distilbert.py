"""DistilBERT: ``transformer.layer[i].attention`` holds q_lin/k_lin/v_lin and runs ``out_lin`` itself."""

from __future__ import annotations

from torch import nn

from headkit.surgery.adapters.base import AttentionAdapter, register_adapter


@register_adapter
class DistilBertAdapter(AttentionAdapter):
    name = "distilbert"
    layers_path = "transformer.layer"
    attention_path = "attention"
    query_name, key_name, value_name = "q_lin", "k_lin", "v_lin"
    head_dim_attribute = "attention_head_size"
    epilogue_names = ("out_lin", None, None)

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        module.n_heads = num_heads


# The name the collaborative-attention reference package uses.
DistilBERTCollaborativeAdapter = DistilBertAdapter
