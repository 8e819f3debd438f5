"""LLaMA family: ``layers[i].self_attn`` with grouped-query attention (num_key_value_groups query heads per
key/value head) and rotary position embeddings applied to queries and keys; it runs ``o_proj`` itself.

Every decoder family laid out like LLaMA (Mistral, Qwen 2/3, Granite, SmolLM3, StarCoder2, Gemma 2/3, …) is
handled by this adapter: its entry in :mod:`headkit.surgery.families` names ``adapter="llama"``, and
``model_types`` is read from the registry. What sets those families apart stays on their modules and is left
alone by pruning: the score scale (``scaling``: Gemma's ``query_pre_attn_scalar``, Granite's
``attention_multiplier``), soft-capping, sliding windows, NoPE layers, per-head q/k norms (over ``head_dim``,
so the kept heads are normalised exactly as before)."""

from __future__ import annotations

from torch import nn

from headkit.surgery.adapters.base import AttentionAdapter, register_adapter
from headkit.surgery.families import FAMILIES


@register_adapter
class LlamaAdapter(AttentionAdapter):
    name = "llama"
    model_types = tuple(sorted(f.model_type for f in FAMILIES.values() if f.adapter == "llama"))
    rotary = True

    def stock_head_config(self, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, int] | None:
        # LlamaConfig carries head_dim explicitly, so fewer heads need not change their width.
        return {"num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim}

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        # Both eager and sdpa attention repeat each key/value head this many times.
        module.num_key_value_groups = num_heads // num_kv_heads
