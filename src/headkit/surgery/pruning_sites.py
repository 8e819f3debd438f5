"""The sites a pruning changes, on a model: what remains of a layer with no head (:class:`EmptyHeads`), the
uneven grouped-query gather, the plan per site (:func:`plan_sites`) and its application (:func:`apply_site_plan`) — the model
side of :mod:`headkit.surgery.pruning`, apart from its config (:mod:`headkit.surgery.pruning_config`), which
imports this module only when it checks a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.base import KV_HEAD_INDEX
from headkit.layers.cache import StateCacheLayer
from headkit.layers.gates import FixedGate, HardConcreteGate
from headkit.surgery.adapters import (
    AttentionAdapter,
    AttentionSite,
    ProjectionWeights,
    linear_parameters,
)
from headkit.surgery.attention import (
    AttentionCall,
    attach_mechanisms,
    computes_attention_itself,
    mechanism_of,
    needs_dispatch,
    use_dispatcher,
)
from headkit.surgery.gating import (
    evaluation_gate_values,
    site_gate,
)
from headkit.surgery.heads import check_not_emptied, refuse_ungated

PRUNE_OP = "prune"
# What a pruning removes: query heads, or whole key/value groups.
QUERY, GROUP = "query", "group"
UNITS = (QUERY, GROUP)


# -- what remains of a layer with no head ----------------------------------------------------------------------


class EmptyHeadsCacheLayer(StateCacheLayer):
    """The cache entry of a layer with no head: counts its tokens (so the layers after it see the right lengths)
    and stores nothing."""

    describes = "a layer with no heads"


class EmptyHeads(nn.Module):
    """The mechanism of a stock attention module whose heads were all pruned (:meth:`AttentionAdapter.write_empty`
    leaves the module one placeholder head of zeros): skips attention, returns that head's zeros and, for
    ``output_attentions``, weights over no head [B, 0, Tq, Tk]; the output projection then adds its bias."""

    def __init__(self, layer_idx: int | None) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def cache_layer(self, cache: Any) -> EmptyHeadsCacheLayer:
        if self.layer_idx is None:
            raise HeadkitError("this attention module has no layer_idx, so it cannot use a KV cache")
        return EmptyHeadsCacheLayer.in_cache(cache, self.layer_idx)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        queries, cache_layer = call.queries, call.cache_layer
        batch, _, seq, head_dim = queries.shape
        past = 0 if cache_layer is None else cache_layer.get_seq_length()
        if cache_layer is not None:
            cache_layer.set_state(None, seq)
        return queries.new_zeros(batch, seq, 1, head_dim), queries.new_zeros(batch, 0, seq, past + seq)


# -- uneven grouped-query attention ----------------------------------------------------------------------------


def set_kv_index(module: nn.Module, kv_index: list[int] | None, device: torch.device) -> None:
    """Set (or, with None, clear) the module's ``headkit_kv_head_index``: a persistent buffer, so the checkpoint
    says which key/value head each query head reads (from_pretrained replays the recorded pruning, which
    registers the same buffer, then loads it strictly)."""
    index = None if kv_index is None else torch.tensor(kv_index, dtype=torch.long, device=device)
    if computes_attention_itself(module):
        setattr(module, KV_HEAD_INDEX, index)  # the layer's own slot
    elif index is None:
        module._buffers.pop(KV_HEAD_INDEX, None)
    else:
        module.register_buffer(KV_HEAD_INDEX, index, persistent=True)


def check_prunable(sites: list[AttentionSite]) -> None:
    """Refuse, before any work, a model in which earlier surgery replaced a layer that still has heads (a
    collaborative or linearized module): its heads are no longer the architecture's to slice."""
    for index, site in enumerate(sites):
        if site.is_headkit and site.num_heads:
            refuse_replaced(index, site)


def refuse_replaced(index: int, site: AttentionSite) -> None:
    raise HeadkitError(
        f"cannot prune heads of layer {index} ({site.name}): it already runs "
        f"{type(mechanism_of(site.module)).__name__} (earlier surgery); prune before other surgery"
    )


def query_to_kv_heads(site: AttentionSite) -> list[int]:
    """For each query head of the site, the index of the key/value head it reads."""
    if site.num_heads == 0:
        return []
    index = getattr(site.module, KV_HEAD_INDEX, None)
    if index is not None:
        return [int(i) for i in index.tolist()]
    group = site.num_heads // site.num_kv_heads
    return [head // group for head in range(site.num_heads)]


# -- planning --------------------------------------------------------------------------------------------------


@dataclass
class SitePlan:
    site: AttentionSite
    keep_query: list[int]
    keep_kv: list[int]
    kv_index: list[int]  # for each kept query head, the position of its key/value head among keep_kv

    @property
    def empty(self) -> bool:
        return not self.keep_query

    @property
    def grouped_evenly(self) -> bool:
        """Whether repeat_kv expresses the grouping: query head i reads key/value head ⌊i / G⌋."""
        heads, kv_heads = len(self.keep_query), len(self.keep_kv)
        if heads % kv_heads:
            return False
        return self.kv_index == [i // (heads // kv_heads) for i in range(heads)]


def plan_sites(
    adapter: AttentionAdapter,
    sites: list[AttentionSite],
    heads: dict[int, list[int]],
    allow_empty_layers: bool,
) -> list[SitePlan]:
    plans = []
    for index, pruned in sorted(heads.items()):
        if not pruned:
            continue
        site = sites[index]
        if site.is_headkit:
            refuse_replaced(index, site)
        removed = set(pruned)
        keep_query = [h for h in range(site.num_heads) if h not in removed]
        if not keep_query:
            check_not_emptied(index, pruned, allow_empty_layers)
        try:
            adapter.read_projections(site)  # every site must be readable before the first one is rewritten
        except (AttributeError, TypeError) as exc:
            raise HeadkitError(
                f"cannot prune heads of layer {index} ({site.name}, {type(site.module).__name__}): the "
                f"{adapter.name} adapter finds no query/key/value projections there ({exc})"
            ) from None
        kv_of_query = query_to_kv_heads(site)
        keep_kv = sorted({kv_of_query[h] for h in keep_query})
        plan = SitePlan(site, keep_query, keep_kv, [keep_kv.index(kv_of_query[h]) for h in keep_query])
        gate = site_gate(site)
        if gate is not None and not isinstance(gate, (HardConcreteGate, FixedGate)):
            raise HeadkitError(
                f"layer {index} has a {type(gate).__name__} gate, which pruning cannot slice; remove it first"
            )
        plans.append(plan)
    return plans


# -- applying --------------------------------------------------------------------------------------------------


def head_rows(heads: list[int], head_dim: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [head * head_dim + i for head in heads for i in range(head_dim)], dtype=torch.long, device=device
    )


def apply_site_plan(model: nn.Module, adapter: AttentionAdapter, plan: SitePlan) -> None:
    site = plan.site
    if plan.empty:
        empty_site(model, adapter, site)
        return
    weights = adapter.read_projections(site)
    device = weights.q_weight.device
    query_rows = head_rows(plan.keep_query, site.head_dim, device)
    kv_rows = head_rows(plan.keep_kv, site.head_dim, device)

    def rows(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
        return None if tensor is None else tensor.index_select(0, index)

    shrunk = ProjectionWeights(
        q_weight=rows(weights.q_weight, query_rows),
        k_weight=rows(weights.k_weight, kv_rows),
        v_weight=rows(weights.v_weight, kv_rows),
        o_weight=weights.o_weight.index_select(1, query_rows),
        q_bias=rows(weights.q_bias, query_rows),
        k_bias=rows(weights.k_bias, kv_rows),
        v_bias=rows(weights.v_bias, kv_rows),
        o_bias=None if weights.o_bias is None else weights.o_bias.clone(),
        q_norm=rows(weights.q_norm, query_rows),
        k_norm=rows(weights.k_norm, kv_rows),
    )
    module = site.module
    if plan.grouped_evenly:
        set_kv_index(module, None, device)
        adapter.write_projections(model, site, shrunk)
    else:
        adapter.write_linears(model, site, shrunk)
        # After the gather the attention sees one key/value head per query head.
        adapter.set_gathered_head_counts(module, len(plan.keep_query), len(plan.keep_kv), site.head_dim)
        set_kv_index(module, plan.kv_index, device)
        if needs_dispatch(module):
            use_dispatcher(model)  # the registered attention function gathers after the cache
    gate = site_gate(site)
    if gate is not None:
        slice_gate(gate, plan.keep_query)


def slice_gate(gate: HardConcreteGate | FixedGate, keep: list[int]) -> None:
    if isinstance(gate, HardConcreteGate):
        index = torch.tensor(keep, dtype=torch.long, device=gate.log_alpha.device)
        kept = gate.log_alpha.detach().index_select(0, index).clone()
        gate.log_alpha = nn.Parameter(kept, requires_grad=gate.log_alpha.requires_grad)
    else:
        gate.mask = gate.mask.index_select(0, torch.tensor(keep, dtype=torch.long, device=gate.mask.device))
    gate.num_heads = len(keep)


def empty_site(model: nn.Module, adapter: AttentionAdapter, site: AttentionSite) -> None:
    gate = site_gate(site)
    if gate is not None:
        slice_gate(gate, [])
    set_kv_index(site.module, None, linear_parameters(site.output_projection)[0].device)
    adapter.write_empty(model, site)
    if not computes_attention_itself(site.module):
        attach_mechanisms(model, [(site.module, EmptyHeads(getattr(site.module, "layer_idx", None)))])


def dead_heads(sites: list[AttentionSite], threshold: float) -> dict[int, list[int]]:
    """``{site: [heads whose evaluation-mode gate value is at most threshold]}`` over the gated sites."""
    dead: dict[int, list[int]] = {}
    for site in sites:
        gate = site_gate(site)
        if gate is not None:
            values = evaluation_gate_values(gate)
            dead[site.index] = [head for head in range(gate.num_heads) if float(values[head]) <= threshold]
    if not dead:
        refuse_ungated()
    return dead
