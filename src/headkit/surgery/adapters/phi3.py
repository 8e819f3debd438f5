"""Phi-3: LLaMA's layout with one fused projection, ``qkv_proj``, whose rows are [q | k | v] (num_heads·head_dim
query rows, then num_kv_heads·head_dim key rows, then as many value rows).

Phi3Attention splits the fused output at ``config.num_attention_heads · head_dim`` — the model's config, shared by
every layer — and at its own ``num_key_value_heads``. A pruned layer therefore gets a view of the config that
states its own query-head count (:class:`LayerHeadCounts`; every other attribute, the attention implementation
included, is the model's)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headkit.surgery.adapters.base import (
    AttentionSite,
    ProjectionWeights,
    linear_parameters,
    register_adapter,
    replace_linear,
)
from headkit.surgery.adapters.llama import LlamaAdapter


class LayerHeadCounts:
    """A config as one layer sees it: ``num_attention_heads`` is the layer's, everything else (read or written)
    the shared config's."""

    def __init__(self, config: Any, num_attention_heads: int) -> None:
        shared = config.shared_config if isinstance(config, LayerHeadCounts) else config
        self.__dict__.update(shared_config=shared, num_attention_heads=num_attention_heads)

    def __getattr__(self, name: str) -> Any:
        if name == "shared_config":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.shared_config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "num_attention_heads":
            self.__dict__[name] = value
        else:
            setattr(self.shared_config, name, value)

    def __repr__(self) -> str:
        return f"LayerHeadCounts(num_attention_heads={self.num_attention_heads}, {type(self.shared_config).__name__})"


@register_adapter
class Phi3Adapter(LlamaAdapter):
    name = "phi3"
    model_types = ("phi3",)
    query_name = key_name = value_name = "qkv_proj"

    def head_geometry(self, module: nn.Module) -> tuple[int, int, int]:
        if not hasattr(module, "qkv_proj"):
            return super().head_geometry(module)
        head_dim = int(module.head_dim)
        heads = int(linear_parameters(module.o_proj)[0].shape[1]) // head_dim
        rows = int(linear_parameters(module.qkv_proj)[0].shape[0])
        return heads, (rows - heads * head_dim) // (2 * head_dim), head_dim

    def read_projections(self, site: AttentionSite) -> ProjectionWeights:
        self._require_original(site, "read its projections")
        weight, bias = linear_parameters(site.module.qkv_proj)
        sizes = [site.num_heads * site.head_dim] + [site.num_kv_heads * site.head_dim] * 2
        q_weight, k_weight, v_weight = weight.split(sizes)
        q_bias, k_bias, v_bias = (None, None, None) if bias is None else bias.split(sizes)
        o_weight, o_bias = linear_parameters(site.output_projection)
        return ProjectionWeights(q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias)

    def write_linears(self, model: nn.Module, site: AttentionSite, weights: ProjectionWeights) -> None:
        fused_weight = torch.cat([weights.q_weight, weights.k_weight, weights.v_weight])
        fused_bias = None
        if weights.q_bias is not None:
            fused_bias = torch.cat([weights.q_bias, weights.k_bias, weights.v_bias])
        replace_linear(site.module, "qkv_proj", fused_weight, fused_bias)
        replace_linear(model, site.output_projection_name, weights.o_weight, weights.o_bias)

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self._set(module, num_heads, num_kv_heads, num_heads // num_kv_heads)

    def set_gathered_head_counts(
        self, module: nn.Module, num_heads: int, num_stored_kv_heads: int, head_dim: int
    ) -> None:
        # The fused output still holds the stored key/value heads; after the cache gather there is one per query
        # head, so none is repeated.
        self._set(module, num_heads, num_stored_kv_heads, 1)

    @staticmethod
    def _set(module: nn.Module, num_heads: int, num_kv_heads: int, groups: int) -> None:
        module.num_key_value_heads = num_kv_heads
        module.num_key_value_groups = groups
        if module.config.num_attention_heads != num_heads or isinstance(module.config, LayerHeadCounts):
            module.config = LayerHeadCounts(module.config, num_heads)
