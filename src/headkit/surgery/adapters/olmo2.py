"""OLMo 2: LLaMA's layout, with an RMSNorm over the queries of all heads together (``q_norm``, width
num_heads·head_dim) and one over all keys (``k_norm``), applied before rotary embeddings.

Pruning slices each norm's weight to the kept heads' rows. The norm's statistic spans every head, so the kept
heads are renormalised over fewer heads: a pruned OLMo 2 is not exactly the full model with the pruned heads
zeroed (the prune recipe says so in its report; recovery absorbs the change)."""

from __future__ import annotations

from torch import nn

from headkit.errors import HeadkitError
from headkit.surgery.adapters.base import AttentionSite, ProjectionWeights, register_adapter
from headkit.surgery.adapters.llama import LlamaAdapter


@register_adapter
class Olmo2Adapter(LlamaAdapter):
    name = "olmo2"
    model_types = ("olmo2",)

    def read_projections(self, site: AttentionSite) -> ProjectionWeights:
        weights = super().read_projections(site)
        weights.q_norm = site.module.q_norm.weight.detach()
        weights.k_norm = site.module.k_norm.weight.detach()
        return weights

    def write_linears(self, model: nn.Module, site: AttentionSite, weights: ProjectionWeights) -> None:
        module = site.module
        for name, norm_weight, rows in (
            ("q_norm", weights.q_norm, weights.q_weight.shape[0]),
            ("k_norm", weights.k_norm, weights.k_weight.shape[0]),
        ):
            current = getattr(module, name).weight
            if norm_weight is None and current.shape[0] != rows:
                raise HeadkitError(
                    f"{site.name}.{name} normalises all {current.shape[0]} rows together; writing {rows} rows "
                    f"needs its weight for them (ProjectionWeights.{name})"
                )
            if norm_weight is not None and tuple(norm_weight.shape) != (rows,):
                raise HeadkitError(f"{name} must have shape [{rows}], got {tuple(norm_weight.shape)}")
        super().write_linears(model, site, weights)
        for name, norm_weight in (("q_norm", weights.q_norm), ("k_norm", weights.k_norm)):
            if norm_weight is not None:
                norm = getattr(module, name)
                norm.weight = nn.Parameter(
                    norm_weight.detach().clone().to(norm.weight.dtype),
                    requires_grad=norm.weight.requires_grad,
                )

    def write_empty(self, model: nn.Module, site: AttentionSite) -> None:
        super().write_empty(model, site)
        # The norms would see only the placeholder head's zeros, which normalise to zeros: none is needed.
        site.module.q_norm = nn.Identity()
        site.module.k_norm = nn.Identity()


__all__ = ["Olmo2Adapter"]
