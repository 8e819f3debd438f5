"""Physical removal of attention heads: shrink the query/key/value rows and output-projection columns.

Removing head h of a layer deletes rows h·d … (h+1)·d − 1 of the query projection and the matching columns of
the output projection (Michel, Levy & Neubig, "Are Sixteen Heads Really Better than One?", NeurIPS 2019: pruned
heads are taken out of the computation, which is what makes pruning faster). Since
MultiHead(x) = Σ_h head_h(x) W^O_h + b^O (Vaswani et al. 2017, §3.2.2, split by head), the pruned model computes
exactly what the full model computes with the pruned heads' outputs set to zero — that is the test of
:func:`prune_heads` (against gating the same heads to 0 with :func:`headkit.surgery.gating.add_head_gates`).

Grouped-query attention (Ainslie et al. 2023). Query head h reads key/value head ⌊h / G⌋ (G query heads per
key/value head); a key/value head is removed only when all its query heads are. When the query heads left per
key/value head are unequal — say 3 and 1 — no G expresses the grouping, so ``repeat_kv`` cannot either. The
layer then keeps only the key/value heads still used (no parameter is duplicated), and a persistent buffer on the
attention module, ``headkit_kv_head_index``, says for each remaining query head which of them it reads. The
module's own forward runs unchanged — projections, norms, rotary, and the KV cache, which so stores only the
key/value heads still read — and the registered ``headkit_<base>`` attention function
(:mod:`headkit.surgery.attention`) gathers the heads for the query heads before the base implementation (eager,
sdpa, flash), which then sees plain multi-head attention (``num_key_value_groups = 1``). headkit's own layers
gather in their projection step (the same buffer). The checkpoint so states what the layer computes.

A layer may lose all its heads (``allow_empty_layers=True``). Its module stays the stock one
(:meth:`AttentionAdapter.write_empty`): its projections become parameter-free :class:`~headkit.surgery.adapters.NoHeads`
placeholders of one zero head, its output projection :class:`~headkit.surgery.adapters.BiasOnly`, and its
mechanism :class:`EmptyHeads` skips attention and keeps nothing in the cache. It contributes what the output
projection adds to zero heads (its bias) and whatever the module runs after it (dropout, residual LayerNorm).

Every call validates the whole plan before it changes anything (:class:`PruneConfig`: built, then checked against
the model, or only its 🤗 config, with :meth:`PruneConfig.check`), and records itself in
``config.headkit_surgery`` so that ``save_pretrained`` + :func:`headkit.from_pretrained` restore the pruned shapes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.base import KV_HEAD_INDEX
from headkit.surgery.adapters import (
    AttentionAdapter,
    AttentionSite,
    count_parameters,
    get_adapter,
)
from headkit.surgery.families import FAMILIES, UNIFORM, get_family
from headkit.surgery.gating import (
    check_layer_heads,
)

# The config (no model code) and the model's sites, each in a module of its own; their names stay here too.
from headkit.surgery.pruning_config import (  # noqa: F401  (the names pruning has always offered)
    GROUP,
    PRUNE_OP,
    QUERY,
    UNITS,
    PruneConfig,
    check_not_emptied,
    heads_record,
    refuse_ungated,
)
from headkit.surgery.pruning_sites import (  # noqa: F401  (the names pruning has always offered)
    EmptyHeads,
    EmptyHeadsCacheLayer,
    SitePlan,
    apply_site_plan,
    check_prunable,
    dead_heads,
    empty_site,
    head_rows,
    plan_sites,
    query_to_kv_heads,
    refuse_replaced,
    set_kv_index,
    slice_gate,
)
from headkit.surgery.records import (
    SURGERY_KEY,
    config_in_place_of,
    given_config,
    record_surgery,
    recorded_surgery,
    register_conversion,
    say_deprecated,
)


def _prune_config_of(
    heads: PruneConfig | Mapping[int, Iterable[int]] | None,
    config: PruneConfig | None,
    options: dict[str, Any],
) -> PruneConfig:
    """The config of a :func:`prune_heads` call: given (positionally or as ``config=``), or built from the
    keywords (the call's API before the config)."""
    heads, config = config_in_place_of(PruneConfig, heads, config)
    if config is None:
        return PruneConfig(**options) if heads is None else PruneConfig(heads=heads, **options)
    return given_config(PruneConfig, config, options, ["heads"] if heads is not None else [])


# -- public API ------------------------------------------------------------------------------------------------


@dataclass
class PruneReport:
    """What :func:`prune_heads` did. Head indices are those before the call; layers are attention sites."""

    architecture: str
    pruned: dict[int, list[int]]
    kept: dict[int, list[int]]
    heads_before: dict[int, int]
    heads_after: dict[int, int]
    kv_heads_before: dict[int, int]
    kv_heads_after: dict[int, int]
    parameters_before: int
    parameters_after: int
    uneven_layers: list[int] = field(default_factory=list)

    @property
    def parameters_removed(self) -> int:
        return self.parameters_before - self.parameters_after

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"parameters_removed": self.parameters_removed}

    def __str__(self) -> str:
        total_before, total_after = sum(self.heads_before.values()), sum(self.heads_after.values())
        lines = [
            f"pruned {total_before - total_after} of {total_before} heads ({self.architecture}); parameters "
            f"{self.parameters_before:,} -> {self.parameters_after:,}"
        ]
        for layer in sorted(self.heads_before):
            lines.append(
                f"  layer {layer}: {self.heads_after[layer]}/{self.heads_before[layer]} heads, "
                f"{self.kv_heads_after[layer]}/{self.kv_heads_before[layer]} key/value heads"
                f"{' (uneven groups: gathered)' if layer in self.uneven_layers else ''}"
            )
        return "\n".join(lines)


def prune_heads(
    model: nn.Module,
    heads: PruneConfig | Mapping[int, Iterable[int]] | None = None,
    *,
    config: PruneConfig | None = None,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    **options: Any,
) -> PruneReport:
    """Remove attention heads from `model` in place.

    Args:
        model: a supported 🤗 model or a headkit model (see :func:`headkit.surgery.adapters.get_adapter`).
        heads: a :class:`PruneConfig` (``prune_heads(model, PruneConfig(...))``), or its ``heads``:
            ``{layer: [heads to remove]}``, indices as the model is now (after earlier pruning, heads are
            renumbered 0 … remaining − 1). Layers are attention sites: the layer index for every model except
            ALBERT, whose shared module is site 0 (removing its heads removes them from every layer).
        config: the :class:`PruneConfig`, as a keyword; or its other field as a keyword, not both:
            ``allow_empty_layers``, allow removing every head of a layer; its attention then contributes only its
            output projection's bias (and whatever the module ran after it, e.g. a residual LayerNorm).
        adapter: the architecture adapter; by default the one matching the model.

    Returns:
        a :class:`PruneReport`. Gates on the model (:func:`headkit.add_head_gates`) keep the values of the
        surviving heads. Out-of-range layers or heads, an emptied layer without `allow_empty_layers`, or an
        unsupported model raise :class:`~headkit.errors.HeadkitError` with the model untouched.
    """
    say_deprecated("prune_heads", PruneConfig)
    return _prune(model, _prune_config_of(heads, config, options), adapter=adapter)


def _prune(
    model: nn.Module,
    config: PruneConfig,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> PruneReport:
    """:func:`headkit.apply_` of a :class:`PruneConfig`: remove the heads it names (see :func:`prune_heads`)."""
    checked, adapter, sites, plans = config._check_model(model, adapter)
    parameters_before = count_parameters(model)
    # Everything is checked: only now does the model change.
    for plan in plans:
        apply_site_plan(model, adapter, plan)
    if plans:
        record_surgery(
            model,
            {"op": PRUNE_OP, "adapter": adapter.name}
            | config.record()
            | {"heads": heads_record({plan.site.index: checked[plan.site.index] for plan in plans})}
            | {"num_heads": {str(plan.site.index): plan.site.num_heads for plan in plans}},
        )
    after = {site.index: site for site in adapter.sites(model)}
    by_site = {plan.site.index: plan for plan in plans}
    return PruneReport(
        architecture=adapter.name,
        pruned={index: checked.get(index, []) for index in after},
        kept={
            index: by_site[index].keep_query if index in by_site else list(range(site.num_heads))
            for index, site in enumerate(sites)
        },
        heads_before={site.index: site.num_heads for site in sites},
        heads_after={index: site.num_heads for index, site in after.items()},
        kv_heads_before={site.index: site.num_kv_heads for site in sites},
        kv_heads_after={index: site.num_kv_heads for index, site in after.items()},
        parameters_before=parameters_before,
        parameters_after=count_parameters(model),
        uneven_layers=[index for index, site in after.items() if _is_gathered(site)],
    )


def _is_gathered(site: AttentionSite) -> bool:
    return site.num_heads > 0 and getattr(site.module, KV_HEAD_INDEX, None) is not None


def prune_dead_heads(
    model: nn.Module,
    threshold: float = 0.0,
    *,
    allow_empty_layers: bool = False,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> PruneReport:
    """Remove every head whose evaluation-mode gate value is at most `threshold`: :func:`prune_heads` with
    ``PruneConfig(dead_threshold=threshold, allow_empty_layers=allow_empty_layers)``.

    With the default threshold 0 only heads whose gate is exactly closed go, so the model's evaluation-mode
    outputs do not change at all (a Hard Concrete gate is exactly 0 in evaluation once σ(log α)·(r − l) + l ≤ 0,
    Louizos et al. 2018, §4.2). A larger threshold also removes heads that were only scaled down.

    Args:
        threshold: in [0, 1) (:attr:`PruneConfig.dead_threshold`).
        allow_empty_layers: as in :func:`prune_heads`.

    The gates of the surviving heads stay on the model (:func:`headkit.surgery.gating.remove_head_gates` with
    ``fold=True`` bakes their values into the output projections).
    """
    config = PruneConfig(dead_threshold=threshold, allow_empty_layers=allow_empty_layers)
    return _prune(model, config, adapter=adapter)


def heads_per_layer(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
) -> dict[int, int]:
    """``{layer: number of query heads}`` as the model is now."""
    return {site.index: site.num_heads for site in get_adapter(model, adapter).sites(model)}


def kv_heads_per_layer(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
) -> dict[int, int]:
    """``{layer: key/value heads still read}``: after uneven pruning a layer gathers them per query head, so this
    counts the distinct heads its query heads read, not the slots the attention module holds."""
    return {
        site.index: len(set(query_to_kv_heads(site))) for site in get_adapter(model, adapter).sites(model)
    }


def to_stock_architecture(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
) -> dict[str, int]:
    """Turn a uniformly pruned model back into its architecture's stock form, in place: the config states the
    new head counts (e.g. ``LlamaConfig(num_attention_heads=6, num_key_value_heads=2, head_dim=64)``) and no
    longer records the pruning, so ``save_pretrained`` writes a checkpoint that plain
    ``AutoModelForCausalLM.from_pretrained`` loads, with headkit not installed.

    Needs every layer to keep the same number of query heads and of key/value heads, grouped evenly (no
    gathered key/value heads, no emptied layer), pruning as the only recorded surgery, and an adapter whose
    config can state head counts (:meth:`AttentionAdapter.stock_head_config`). Returns the config fields set.
    Raises :class:`~headkit.errors.HeadkitError`, with the model untouched, otherwise.
    """
    adapter = get_adapter(model, adapter)
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is not None and not family.supports(UNIFORM):
        get_family(model, UNIFORM)  # raises: the family's config cannot state other head counts
    other = sorted({str(entry.get("op")) for entry in recorded_surgery(model)} - {PRUNE_OP})
    if other:
        raise HeadkitError(
            f"only pruning can be expressed in the stock architecture; the model also records {other}"
        )
    sites = adapter.sites(model)
    heads = {site.num_heads for site in sites}
    kv_heads = {site.num_kv_heads for site in sites}
    widths = {site.head_dim for site in sites}
    if len(heads) != 1 or len(kv_heads) != 1 or len(widths) != 1 or 0 in heads:
        raise HeadkitError(
            f"the stock architecture needs the same heads in every layer; the model has query heads "
            f"{[site.num_heads for site in sites]} and key/value heads {[site.num_kv_heads for site in sites]}"
        )
    if any(_is_gathered(site) for site in sites):
        raise HeadkitError(
            "the stock architecture needs the same query heads per key/value head in every group"
        )
    update = adapter.stock_head_config(heads.pop(), kv_heads.pop(), widths.pop())
    if update is None:
        raise HeadkitError(
            f"the {adapter.name} config cannot state other head counts; reload the model with headkit.from_pretrained"
        )
    candidate = copy.deepcopy(model.config)
    for name, value in update.items():
        setattr(candidate, name, value)
    validate = getattr(candidate, "validate", None)  # strict configs check themselves
    try:  # e.g. LlamaConfig insists that hidden_size be a multiple of num_attention_heads
        if callable(validate):
            validate()
    except Exception as exc:
        raise HeadkitError(
            f"the stock {type(candidate).__name__} refuses these head counts ({exc})"
        ) from None
    for name, value in update.items():
        setattr(model.config, name, value)
    if hasattr(model.config, SURGERY_KEY):
        delattr(model.config, SURGERY_KEY)
    return update


# -- reloading -------------------------------------------------------------------------------------------------


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded pruning on a freshly built model (the weights load afterwards)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = adapter.sites(model)
    expected = {int(index): int(count) for index, count in entry["num_heads"].items()}
    actual = {index: sites[index].num_heads for index in expected if index < len(sites)}
    if actual != expected:
        raise HeadkitError(
            f"the recorded pruning expects {expected} heads per layer before it, the rebuilt model has {actual}"
        )
    config = PruneConfig.from_record(entry)
    checked = check_layer_heads("heads", config.heads, [site.num_heads for site in sites])
    for plan in plan_sites(adapter, sites, checked, config.allow_empty_layers):
        apply_site_plan(model, adapter, plan)


register_conversion(PruneConfig, PRUNE_OP, _prune, _reapply)
