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

import collections
import copy
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
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
    count_parameters,
    get_adapter,
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
from headkit.surgery.families import FAMILIES, UNIFORM, get_family
from headkit.surgery.gating import (
    LayerHeads,
    check_layer_heads,
    config_head_counts,
    config_kv_bytes_per_token,
    config_query_groups,
    config_records_gates,
    evaluation_gate_values,
    layer_heads,
    parse_layer_heads,
    site_gate,
)
from headkit.surgery.records import (
    SURGERY_KEY,
    config_after,
    config_in_place_of,
    fields_of_record,
    given_config,
    record_surgery,
    recorded_surgery,
    register_conversion,
    say_deprecated,
)

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


def _set_kv_index(module: nn.Module, kv_index: list[int] | None, device: torch.device) -> None:
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
            _refuse_replaced(index, site)


def _refuse_replaced(index: int, site: AttentionSite) -> None:
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
class _SitePlan:
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


def _plan(
    adapter: AttentionAdapter,
    sites: list[AttentionSite],
    heads: dict[int, list[int]],
    allow_empty_layers: bool,
) -> list[_SitePlan]:
    plans = []
    for index, pruned in sorted(heads.items()):
        if not pruned:
            continue
        site = sites[index]
        if site.is_headkit:
            _refuse_replaced(index, site)
        removed = set(pruned)
        keep_query = [h for h in range(site.num_heads) if h not in removed]
        if not keep_query:
            _check_not_emptied(index, pruned, allow_empty_layers)
        try:
            adapter.read_projections(site)  # every site must be readable before the first one is rewritten
        except (AttributeError, TypeError) as exc:
            raise HeadkitError(
                f"cannot prune heads of layer {index} ({site.name}, {type(site.module).__name__}): the "
                f"{adapter.name} adapter finds no query/key/value projections there ({exc})"
            ) from None
        kv_of_query = query_to_kv_heads(site)
        keep_kv = sorted({kv_of_query[h] for h in keep_query})
        plan = _SitePlan(site, keep_query, keep_kv, [keep_kv.index(kv_of_query[h]) for h in keep_query])
        gate = site_gate(site)
        if gate is not None and not isinstance(gate, (HardConcreteGate, FixedGate)):
            raise HeadkitError(
                f"layer {index} has a {type(gate).__name__} gate, which pruning cannot slice; remove it first"
            )
        plans.append(plan)
    return plans


# -- applying --------------------------------------------------------------------------------------------------


def _head_rows(heads: list[int], head_dim: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [head * head_dim + i for head in heads for i in range(head_dim)], dtype=torch.long, device=device
    )


def _apply(model: nn.Module, adapter: AttentionAdapter, plan: _SitePlan) -> None:
    site = plan.site
    if plan.empty:
        _empty_site(model, adapter, site)
        return
    weights = adapter.read_projections(site)
    device = weights.q_weight.device
    query_rows = _head_rows(plan.keep_query, site.head_dim, device)
    kv_rows = _head_rows(plan.keep_kv, site.head_dim, device)

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
        _set_kv_index(module, None, device)
        adapter.write_projections(model, site, shrunk)
    else:
        adapter.write_linears(model, site, shrunk)
        # After the gather the attention sees one key/value head per query head.
        adapter.set_gathered_head_counts(module, len(plan.keep_query), len(plan.keep_kv), site.head_dim)
        _set_kv_index(module, plan.kv_index, device)
        if needs_dispatch(module):
            use_dispatcher(model)  # the registered attention function gathers after the cache
    gate = site_gate(site)
    if gate is not None:
        _slice_gate(gate, plan.keep_query)


def _slice_gate(gate: HardConcreteGate | FixedGate, keep: list[int]) -> None:
    if isinstance(gate, HardConcreteGate):
        index = torch.tensor(keep, dtype=torch.long, device=gate.log_alpha.device)
        kept = gate.log_alpha.detach().index_select(0, index).clone()
        gate.log_alpha = nn.Parameter(kept, requires_grad=gate.log_alpha.requires_grad)
    else:
        gate.mask = gate.mask.index_select(0, torch.tensor(keep, dtype=torch.long, device=gate.mask.device))
    gate.num_heads = len(keep)


def _empty_site(model: nn.Module, adapter: AttentionAdapter, site: AttentionSite) -> None:
    gate = site_gate(site)
    if gate is not None:
        _slice_gate(gate, [])
    _set_kv_index(site.module, None, linear_parameters(site.output_projection)[0].device)
    adapter.write_empty(model, site)
    if not computes_attention_itself(site.module):
        attach_mechanisms(model, [(site.module, EmptyHeads(getattr(site.module, "layer_idx", None)))])


# -- the config ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PruneConfig:
    """Which heads :func:`prune_heads` removes: the one declaration of each option.

    Built, it checks its types (indices are non-negative integers, no layer named twice); :meth:`check` checks it
    against a model, or only its 🤗 config, before any weight changes (the layers and heads exist, a layer is
    emptied only with `allow_empty_layers`). The model's ``config.headkit_surgery`` records it (:meth:`record`:
    the layers actually pruned), and :func:`headkit.from_pretrained` replays that record (:meth:`from_record`).

    Attributes:
        heads: ``{layer: [heads to remove]}``, held as its sorted items ((layer, (head, …)), …), indices as the
            model is now (after earlier pruning, heads are renumbered 0 … remaining − 1). Layers are attention
            sites: the layer index for every model except ALBERT, whose shared module is site 0.
        allow_empty_layers: allow removing every head of a layer; its attention then contributes only its output
            projection's bias (and whatever the module runs after it, e.g. a residual LayerNorm).
        dead_threshold: also remove every head whose evaluation-mode gate value (:func:`add_head_gates`) is at
            most this, in [0, 1); None: only the heads listed. 0 removes only exactly closed gates, so the model's
            evaluation-mode outputs do not change (:func:`prune_dead_heads`). The record holds the heads it
            chose, so a reload replays them without reading the gates.
    """

    # Each field's metadata makes it a command-line option where a command takes this config's fields
    # (headkit.recipes.options).
    heads: LayerHeads = field(
        default=(),
        metadata={
            "help": "Heads to remove, as layer:head pairs ('0:1,0:2,3:0'), indices as the model is now.",
            "parse": parse_layer_heads,
        },
    )
    allow_empty_layers: bool = field(
        default=False,
        metadata={
            "help": "Allow removing every head of a layer (its attention then adds only its output bias).",
            "flag": "--allow-empty-layers/--keep-a-head",
        },
    )
    dead_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Also remove every head whose evaluation gate value is at most this, in [0, 1) (needs head "
            "gates; 0: only closed gates). Default: only the heads listed.",
        },
    )

    unit: str = field(
        default=QUERY,
        metadata={
            "help": "What is removed: 'query' heads (a key/value head goes with the last query head reading it), "
            "or whole key/value 'group's (a key/value head with every query head reading it)."
        },
    )
    uniform: bool = field(
        default=False,
        metadata={
            "help": "The same number of heads removed in every layer, as many from each key/value group: a "
            "LLaMA-family result is the stock architecture."
        },
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", layer_heads("heads", self.heads))
        if self.unit not in UNITS:
            raise HeadkitError(f"unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        if not isinstance(self.uniform, bool):
            raise HeadkitError(f"uniform must be a bool, got {self.uniform!r}")
        if not isinstance(self.allow_empty_layers, bool):
            raise HeadkitError(f"allow_empty_layers must be a bool, got {self.allow_empty_layers!r}")
        threshold = self.dead_threshold
        if threshold is None:
            return
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not 0.0 <= threshold < 1.0
        ):
            raise HeadkitError(f"dead_threshold must be a gate value in [0, 1), got {threshold!r}")
        object.__setattr__(self, "dead_threshold", float(threshold))

    @property
    def plan(self) -> dict[int, list[int]]:
        """``{layer: [heads to remove]}``."""
        return {layer: list(heads) for layer, heads in self.heads}

    def check(
        self,
        model_or_config: Any,
        adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ) -> None:
        """Everything that can refuse this pruning, before any weight changes (:meth:`heads_to_remove` says
        which heads go)."""
        self.heads_to_remove(model_or_config, adapter)

    def heads_to_remove(
        self,
        model_or_config: Any,
        adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ) -> dict[int, list[int]]:
        """``{layer: [heads to remove]}``, checked: the layers and heads named exist (a 🤗 config's head counts
        are those it states, the pruning it records applied) and no layer is emptied without
        `allow_empty_layers`; with `dead_threshold`, the model has head gates; a model's layers must also still be
        the architecture's to slice (no earlier surgery replaced them) and gated by gates pruning can slice. From
        a 🤗 config alone, without the heads whose gates are at most `dead_threshold` (their values are
        weights)."""
        if isinstance(model_or_config, nn.Module):
            return self._check_model(model_or_config, adapter)[0]
        if self.dead_threshold is not None and not config_records_gates(model_or_config):
            _refuse_ungated()
        counts = config_head_counts(model_or_config)
        if counts is None:
            return self.plan
        checked = check_layer_heads("heads", self.heads, counts)
        for layer, pruned in sorted(checked.items()):
            if pruned and len(pruned) == counts[layer]:
                _check_not_emptied(layer, pruned, self.allow_empty_layers)
        groups = config_query_groups(model_or_config)
        if groups is not None:
            self._check_unit(checked, groups)
        return checked

    def _check_unit(self, checked: dict[int, list[int]], groups: list[list[int]]) -> None:
        """`checked` (``{layer: [heads removed]}``) against :attr:`unit` and :attr:`uniform`, each layer's
        `groups` being the key/value group of each of its query heads."""
        for layer, pruned in sorted(checked.items()):
            if self.unit == GROUP:
                gone = {groups[layer][head] for head in pruned}
                whole = {head for head, group in enumerate(groups[layer]) if group in gone}
                if whole != set(pruned):
                    raise HeadkitError(
                        f"unit 'group' removes whole key/value groups: layer {layer}'s heads {pruned} leave part of "
                        f"groups {sorted(gone)} (their query heads are {sorted(whole)})"
                    )
        if self.uniform:
            removed = [set(checked.get(layer, [])) for layer in range(len(groups))]
            # per layer: how many heads go, and how many query heads each key/value group keeps
            shapes = {
                (
                    len(gone),
                    tuple(
                        sorted(collections.Counter(g for h, g in enumerate(heads) if h not in gone).values())
                    ),
                )
                for gone, heads in zip(removed, groups, strict=True)
            }
            if len(shapes) != 1 or len(set(next(iter(shapes))[1])) > 1:
                raise HeadkitError(
                    "uniform pruning removes the same number of heads from every layer, leaving every key/value "
                    f"group as many query heads; got {[len(gone) for gone in removed]} heads removed per layer"
                )

    def _check_model(
        self, model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None
    ) -> tuple[dict[int, list[int]], AttentionAdapter, list[AttentionSite], list[_SitePlan]]:
        adapter = get_adapter(model, adapter)
        sites = adapter.sites(model)
        checked = check_layer_heads("heads", self.heads, [site.num_heads for site in sites])
        if self.dead_threshold is not None:
            for index, dead in _dead_heads(sites, self.dead_threshold).items():
                checked[index] = sorted(set(checked.get(index, [])) | set(dead))
        self._check_unit(checked, [query_to_kv_heads(site) for site in sites])
        return checked, adapter, sites, _plan(adapter, sites, checked, self.allow_empty_layers)

    def record(self) -> dict[str, Any]:
        """The fields as JSON (``config.headkit_surgery`` keeps them, ``heads`` there being the heads actually
        removed, those `dead_threshold` chose included)."""
        return {
            "heads": _heads_record(self.plan),
            "allow_empty_layers": self.allow_empty_layers,
            "dead_threshold": self.dead_threshold,
            "unit": self.unit,
            "uniform": self.uniform,
        }

    def bytes_per_token(self, config: Any, *, bytes_per_number: int = 2, context: int = 8192) -> int | None:
        """The key/value cache's bytes per token of a model with the 🤗 `config` once these heads are removed
        (a key/value head goes when every query head of its group does; the same at any `context`); None where
        the config does not state its heads."""
        return config_kv_bytes_per_token(config_after(config, self), bytes_per_number)

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> PruneConfig:
        """The config a record was written from (its string layer keys read as integers; a field the record
        predates takes its default)."""
        return cls(**fields_of_record(cls, entry))


def _heads_record(pruned: Mapping[int, Iterable[int]]) -> dict[str, list[int]]:
    """``{layer: [heads]}`` as JSON: string layer keys, sorted, layers with none left out."""
    return {str(layer): sorted(heads) for layer, heads in sorted(pruned.items()) if heads}


def _dead_heads(sites: list[AttentionSite], threshold: float) -> dict[int, list[int]]:
    """``{site: [heads whose evaluation-mode gate value is at most threshold]}`` over the gated sites."""
    dead: dict[int, list[int]] = {}
    for site in sites:
        gate = site_gate(site)
        if gate is not None:
            values = evaluation_gate_values(gate)
            dead[site.index] = [head for head in range(gate.num_heads) if float(values[head]) <= threshold]
    if not dead:
        _refuse_ungated()
    return dead


def _refuse_ungated() -> None:
    raise HeadkitError("the model has no head gates; call headkit.add_head_gates(model) and train them first")


def _check_not_emptied(layer: int, pruned: list[int], allow_empty_layers: bool) -> None:
    """Refuse pruning every head of `layer` (`pruned`) unless `allow_empty_layers`."""
    if not allow_empty_layers:
        raise HeadkitError(
            f"pruning heads {pruned} removes every head of layer {layer}; pass allow_empty_layers=True to "
            "allow it (the layer's attention then adds only its output projection's bias)"
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
        _apply(model, adapter, plan)
    if plans:
        record_surgery(
            model,
            {"op": PRUNE_OP, "adapter": adapter.name}
            | config.record()
            | {"heads": _heads_record({plan.site.index: checked[plan.site.index] for plan in plans})}
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
    for plan in _plan(adapter, sites, checked, config.allow_empty_layers):
        _apply(model, adapter, plan)


register_conversion(PruneConfig, PRUNE_OP, _prune, _reapply)
