"""Choosing the heads to prune: :func:`plan_pruning` turns per-head scores into ``{layer: [query heads to
remove]}`` under the unit (query heads or whole key/value groups) and uniformity, :func:`heads_to_keep` gives the
count a pruned fraction keeps, and :func:`keep_top_gated_heads` the plan of trained Hard Concrete gates (the largest
log α kept).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.surgery.adapters import get_adapter
from headkit.surgery.gating import head_gates
from headkit.surgery.pruning import PruneConfig, query_to_kv_heads


def plan_pruning(
    scores: list[torch.Tensor],
    kv_of_query: list[list[int]],
    keep: int,
    *,
    unit: str = "query",
    uniform: bool = False,
) -> dict[int, list[int]]:
    """``{layer: [query heads to remove]}`` keeping `keep` query heads in all, by descending score.

    `scores[l][h]` ranks query head h of layer l (larger: more important; comparable across layers);
    `kv_of_query[l][h]` is the key/value head it reads. ``unit="group"`` scores a key/value group by its query
    heads' mean and removes whole groups. ``uniform`` keeps ``keep / layers`` heads in every layer, as many in
    each key/value group. Ties go to the lower layer and head. Invalid counts raise HeadkitError."""
    PruneConfig(unit=unit, uniform=uniform)  # the config checks its own fields
    layers = len(scores)
    total = sum(len(s) for s in scores)
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= total:
        raise HeadkitError(
            f"--heads must be in [1, {total}] (the model has {total} query heads), got {keep!r}"
        )
    groups = [_groups(kv) for kv in kv_of_query]
    if uniform:
        shapes = {(len(s), len(g)) for s, g in zip(scores, groups, strict=True)}
        if len(shapes) != 1:
            raise HeadkitError(
                f"--uniform needs the same heads in every layer, the model has {sorted(shapes)}"
            )
        heads, kv_heads = shapes.pop()
        group_size = heads // kv_heads
        if any(len(members) != group_size for layer in groups for members in layer.values()):
            raise HeadkitError(
                "--uniform needs every key/value group to serve as many query heads; this model's groups are "
                "unequal (pruned before?)"
            )
        if keep % layers:
            raise HeadkitError(
                f"--uniform: --heads {keep} is not the same number in each of the {layers} layers"
            )
        per_layer = keep // layers
        if unit == "group" and per_layer % group_size:
            raise HeadkitError(
                f"--unit group --uniform: {per_layer} heads per layer is not a whole number of key/value groups "
                f"of {group_size} query heads (use a multiple of {group_size * layers})"
            )
        if unit == "query" and per_layer % kv_heads:
            if group_size == 1:  # multi-head attention: a query head is a whole key/value group
                raise HeadkitError(
                    f"--uniform: every query head has its own key/value head in this model, so keeping {per_layer} "
                    f"of {heads} per layer removes whole groups: pass --unit group"
                )
            raise HeadkitError(
                f"--uniform: {per_layer} query heads per layer cannot be spread evenly over {kv_heads} key/value "
                f"groups (use a multiple of {kv_heads * layers}, or --unit group)"
            )
    elif unit == "group":
        sizes = {len(members) for layer in groups for members in layer.values()}
        if len(sizes) == 1 and keep % sizes.pop():
            raise HeadkitError(f"--unit group: --heads {keep} is not a whole number of key/value groups")

    plan: dict[int, list[int]] = {}
    if unit == "group":
        ranked = sorted(
            (-float(scores[layer][members].mean()), layer, kv)
            for layer, layer_groups in enumerate(groups)
            for kv, members in layer_groups.items()
        )
        if uniform:
            keep_groups = (keep // layers) // group_size
            for layer in range(layers):
                dropped = [kv for _, lay, kv in ranked if lay == layer][keep_groups:]
                plan[layer] = sorted(h for kv in dropped for h in groups[layer][kv].tolist())
        else:
            kept = 0
            for _, layer, kv in ranked:
                members = groups[layer][kv].tolist()
                if kept + len(members) <= keep:
                    kept += len(members)
                else:
                    plan.setdefault(layer, []).extend(members)
            if kept != keep:
                raise HeadkitError(
                    f"--unit group: no set of whole key/value groups holds exactly {keep} heads"
                )
    elif uniform:
        per_group = (keep // layers) // len(groups[0])
        for layer, layer_groups in enumerate(groups):
            for members in layer_groups.values():
                order = sorted(members.tolist(), key=lambda h, layer=layer: (-float(scores[layer][h]), h))
                plan.setdefault(layer, []).extend(order[per_group:])
    else:
        ranked = sorted(
            (-float(score), layer, head)
            for layer, s in enumerate(scores)
            for head, score in enumerate(s.tolist())
        )
        for _, layer, head in ranked[keep:]:
            plan.setdefault(layer, []).append(head)
    plan = {layer: sorted(heads) for layer, heads in sorted(plan.items()) if heads}
    kept = total - sum(len(heads) for heads in plan.values())
    if kept != keep:  # a guard: every branch above must keep exactly `keep`
        raise HeadkitError(f"the plan would keep {kept} query heads, not the {keep} asked for")
    return plan


def _groups(kv_of_query: list[int]) -> dict[int, torch.Tensor]:
    found: dict[int, list[int]] = {}
    for head, kv in enumerate(kv_of_query):
        found.setdefault(kv, []).append(head)
    return {kv: torch.tensor(heads) for kv, heads in sorted(found.items())}


def heads_to_keep(
    heads: dict[int, int], kv_heads: dict[int, int], unit: str, fraction: float, uniform: bool
) -> int:
    """Query heads kept when `fraction` of them is pruned, as :func:`plan_pruning` can keep them: whole
    key/value groups for ``unit="group"``, the same count in every layer under `uniform` (rounded to whole
    groups, or to as many per group)."""
    layers, total = len(heads), sum(heads.values())
    per_layer, kv = max(heads.values()), max(kv_heads.values())
    group = per_layer // kv
    if unit == "group":
        groups_kept = max(1, round(kv * (1 - fraction)))
        return (
            layers * groups_kept * group
            if uniform
            else max(group, round(total * (1 - fraction) / group) * group)
        )
    if uniform:
        return layers * kv * max(1, round(per_layer * (1 - fraction) / kv))
    return max(1, round(total * (1 - fraction)))


def keep_top_gated_heads(model: nn.Module, keep: int, adapter: Any = None) -> dict[int, list[int]]:
    """``{layer: heads to remove}`` keeping the `keep` heads whose Hard Concrete gates have the largest log α
    over all layers (ties: lower layer, head); layers may empty."""
    adapter = get_adapter(model, adapter)
    gates = head_gates(model, adapter)
    scores = [
        gates[i].log_alpha.detach() if i in gates else torch.zeros(0)
        for i in range(len(adapter.sites(model)))
    ]
    return plan_pruning(scores, [query_to_kv_heads(site) for site in adapter.sites(model)], keep)


__all__ = [
    "heads_to_keep",
    "keep_top_gated_heads",
    "plan_pruning",
]
