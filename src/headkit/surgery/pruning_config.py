"""The config of head pruning, :class:`PruneConfig`, in a module of its own without torch model code: its fields
are command-line options (``headkit prune``, headkit.runs.options), and the command line refuses a bad one
against a model's 🤗 config before any model code is imported. Its checks on a model, and the surgery itself, are
:mod:`headkit.surgery.pruning`'s (the model's sites read by :mod:`headkit.surgery.pruning_sites`, imported when a
model is checked).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from headkit.errors import HeadkitError
from headkit.surgery.heads import (
    LayerHeads,
    check_layer_heads,
    check_not_emptied,
    config_head_counts,
    config_kv_bytes_per_token,
    config_query_groups,
    config_records_gates,
    layer_heads,
    parse_layer_heads,
    refuse_ungated,
)
from headkit.surgery.records import config_after, fields_of_record

if TYPE_CHECKING:
    from headkit.surgery.adapters import AttentionAdapter, AttentionSite
    from headkit.surgery.pruning_sites import SitePlan

PRUNE_OP = "prune"
# What a pruning removes: query heads, or whole key/value groups.
QUERY, GROUP = "query", "group"
UNITS = (QUERY, GROUP)


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
    # (headkit.runs.options).
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
            refuse_ungated()
        counts = config_head_counts(model_or_config)
        if counts is None:
            return self.plan
        checked = check_layer_heads("heads", self.heads, counts)
        for layer, pruned in sorted(checked.items()):
            if pruned and len(pruned) == counts[layer]:
                check_not_emptied(layer, pruned, self.allow_empty_layers)
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
    ) -> tuple[dict[int, list[int]], AttentionAdapter, list[AttentionSite], list[SitePlan]]:
        # the model's side, imported only for a model (the config's own checks stand on no model code)
        from headkit.surgery.adapters import get_adapter
        from headkit.surgery.pruning_sites import dead_heads, plan_sites, query_to_kv_heads

        adapter = get_adapter(model, adapter)
        sites = adapter.sites(model)
        checked = check_layer_heads("heads", self.heads, [site.num_heads for site in sites])
        if self.dead_threshold is not None:
            for index, dead in dead_heads(sites, self.dead_threshold).items():
                checked[index] = sorted(set(checked.get(index, [])) | set(dead))
        self._check_unit(checked, [query_to_kv_heads(site) for site in sites])
        return checked, adapter, sites, plan_sites(adapter, sites, checked, self.allow_empty_layers)

    def record(self) -> dict[str, Any]:
        """The fields as JSON (``config.headkit_surgery`` keeps them, ``heads`` there being the heads actually
        removed, those `dead_threshold` chose included)."""
        return {
            "heads": heads_record(self.plan),
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


def heads_record(pruned: Mapping[int, Iterable[int]]) -> dict[str, list[int]]:
    """``{layer: [heads]}`` as JSON: string layer keys, sorted, layers with none left out."""
    return {str(layer): sorted(heads) for layer, heads in sorted(pruned.items()) if heads}
