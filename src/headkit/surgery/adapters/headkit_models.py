"""headkit's own models (``model_type="headkit"``): ``layers[i].self_attn`` is a headkit attention layer
(:class:`headkit.layers.HeadkitAttention`) that runs ``o_proj`` itself, through ``project_heads`` — the one place
where it also applies its ``head_gate``, so head gates need no hook here. Grouped-query attention; rotary
positions when ``position_embedding_type="rope"``.

Pruning needs the ``q_proj`` / ``k_proj`` / ``v_proj`` projections that the softmax mechanism has; gating works
for every mechanism.
"""

from __future__ import annotations

from torch import nn

from headkit.layers.base import HeadkitAttention
from headkit.surgery.adapters.base import AttentionAdapter, register_adapter


@register_adapter
class HeadkitModelAdapter(AttentionAdapter):
    name = "headkit"
    rotary = True

    def head_geometry(self, module: nn.Module) -> tuple[int, int, int]:
        if hasattr(module, self.query_name):
            return super().head_geometry(module)  # from the weights' shapes, right after pruning too
        return module.num_heads, module.num_key_value_heads, module.head_dim

    def scale(self, module: nn.Module) -> float:
        return float(getattr(module, "scale", module.head_dim**-0.5))

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if not isinstance(module, HeadkitAttention):
            raise TypeError(f"expected a headkit attention layer, got {type(module).__name__}")
        # The layer splits its projections with these (never with the config), so layers may differ.
        module.num_heads = num_heads
        module.num_key_value_heads = num_kv_heads
        module.num_key_value_groups = num_heads // num_kv_heads
