"""Head gates on whole models: put a gate on every attention head, read it out, train it to a head budget.

Voita, Talbot, Moiseev, Sennrich & Titov, "Analyzing Multi-Head Self-Attention: Specialized Heads Do the Heavy
Lifting, the Rest Can Be Pruned" (ACL 2019), §4.1: each head's output is multiplied by a gate before the
heads are concatenated and projected,

    MultiHead(Q, K, V) = Concat_h(g_h · head_h) W^O,

and the gates are Hard Concrete variables (:class:`headkit.layers.gates.HardConcreteGate`) trained with the
relaxed L0 penalty Σ_h P(g_h ≠ 0) (Louizos et al. 2018, Eq. 12). A gate that ends at exactly 0 marks a head
that :func:`headkit.surgery.pruning.prune_heads` can remove without changing the model's outputs. This module is
the gates' mechanics; training them to a head budget is a workflow, on headkit's one training loop:
:func:`headkit.recipes.gates.train_gates_to_budget`.

Where the gate acts. A stock module calls transformers' attention interface, which returns the heads'
outputs [B, T, heads, head_dim] before the module merges and projects them; the model's implementation becomes
the registered ``headkit_<base>`` (:mod:`headkit.surgery.attention`), which scales head h's output by g_h
there — the same for every architecture the adapters know (:mod:`headkit.surgery.adapters`), ALBERT's shared
layer included. headkit's own attention layers gate heads themselves (their ``head_gate`` slot, applied in
``project_heads``).

Where the gate lives. The gate is the child ``head_gate`` of the site's attention module (e.g.
``encoder.layer.3.attention.self.head_gate``), so it is trained, saved, moved with ``.to()`` and copied with the
model. A module shared by several layers (ALBERT) has one gate, used by every layer that runs it: removing a
head of a shared module removes it everywhere. Gates are indexed by *site* (distinct attention module, see
:meth:`AttentionAdapter.sites`), which is the layer index for every model without shared layers.

Options. :class:`GateConfig` declares them once (kind, alive heads, the Hard Concrete options), validates them
when built and checks them against a model or its 🤗 config (:meth:`GateConfig.check`) before any gate is attached.

Saving. :func:`add_head_gates` (its :class:`GateConfig`) and :func:`remove_head_gates` record themselves in
``config.headkit_surgery``, so a gated model saved with ``save_pretrained`` reloads with its gates through
:func:`headkit.from_pretrained`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.gates import GATES, FixedGate, HardConcreteGate, HeadkitGate
from headkit.layers.gates import l0_penalty as _gates_l0_penalty
from headkit.surgery.adapters import AttentionAdapter, AttentionSite, get_adapter
from headkit.surgery.attention import HEAD_GATE, computes_attention_itself, release_dispatcher, use_dispatcher

# The validation of heads shared with pruning, on configs (no model): headkit.surgery.heads.
from headkit.surgery.heads import (  # noqa: F401  (re-exported: the names gating has always offered)
    GATES_OP,
    REMOVE_GATES_OP,
    LayerHeads,
    check_layer_heads,
    config_head_counts,
    config_head_dim,
    config_kv_bytes_per_token,
    config_prunes_unevenly,
    config_query_groups,
    config_records_gates,
    kv_head_counts,
    layer_heads,
    parse_head_pairs,
    parse_layer_heads,
)
from headkit.surgery.records import (
    config_in_place_of,
    given_config,
    record_surgery,
    register_conversion,
    register_surgery_op,
    say_deprecated,
)

GATE_ATTRIBUTE = HEAD_GATE
# log α of a Hard Concrete gate that starts closed (a head outside ``alive_heads``): its evaluation gate is
# exactly 0 (σ(−10)·1.2 − 0.1 < 0) and P(g ≠ 0) = σ(−10 + 0.79) ≈ 1e-4.
CLOSED_LOG_ALPHA = -10.0


# -- where the gate acts ---------------------------------------------------------------------------------------


def site_gate(site: AttentionSite) -> HeadkitGate | None:
    """The gate on a site's attention module, or None."""
    return getattr(site.module, HEAD_GATE, None)


def _set_site_gate(model: nn.Module, site: AttentionSite, gate: HeadkitGate | None) -> None:
    if gate is None:
        if computes_attention_itself(site.module):
            site.module.head_gate = None  # the layer's slot stays, empty
        elif HEAD_GATE in site.module._modules:
            del site.module._modules[HEAD_GATE]
            release_dispatcher(model)
        return
    gate.train(site.module.training)  # a gate added to a model in eval mode must not sample
    site.module.add_module(HEAD_GATE, gate)
    if not computes_attention_itself(site.module):
        use_dispatcher(model)


# -- the config ------------------------------------------------------------------------------------------------

# The Hard Concrete gate's options (HardConcreteGate's arguments, its defaults the config's): a fixed gate takes
# none of them.
HARD_CONCRETE_OPTIONS = ("temperature", "stretch", "init_log_alpha", "hard")


@dataclass(frozen=True)
class GateConfig:
    """How :func:`add_head_gates` gates a model: the one declaration of each option.

    Built, it checks its types and ranges; :meth:`check` checks it against a model, or only its 🤗 config (the
    heads ``alive_heads`` names, gates already there), before any gate is attached. The model's
    ``config.headkit_surgery`` records it (:meth:`record`), and :func:`headkit.from_pretrained` rebuilds the gates
    from that record (:meth:`from_record`), records written before the config (the Hard Concrete options under
    ``"options"``) included.

    Attributes:
        kind: ``"hard_concrete"`` (learned :class:`~headkit.layers.gates.HardConcreteGate`, Voita et al. 2019) or
            ``"fixed"`` (constant 0/1 :class:`~headkit.layers.gates.FixedGate`).
        alive_heads: ``{layer: [heads kept]}`` (held as its sorted items); layers not named keep every head.
            Fixed gates are 1 on kept heads and 0 elsewhere; Hard Concrete gates of the other heads start closed
            (log α = −10, evaluation gate exactly 0). None: every head open.
        temperature: β > 0 of the Hard Concrete gates (lower: samples closer to 0/1).
        stretch: (l, r) with l < 0 < 1 < r, the interval the Hard Concrete samples are stretched to before
            clipping.
        init_log_alpha: the initial log α of every open Hard Concrete gate (3.0: almost every sample 1).
        hard: straight-through Hard Concrete gates (forward 0/1, gradient of the soft gate).
    The last four are the Hard Concrete gate's; a fixed gate takes none of them (they must keep their defaults).
    """

    # Each field's metadata makes it a command-line option where a command takes this config's fields
    # (headkit.runs.options).
    kind: str = field(
        default="hard_concrete",
        metadata={"help": "Gate kind: 'hard_concrete' (learned, L0-trained) or 'fixed' (constant 0/1)."},
    )
    alive_heads: LayerHeads | None = field(
        default=None,
        metadata={
            "help": "Heads whose gate starts open, as layer:head pairs ('0:1,3:0'); layers not named keep every "
            "head (default: every head open).",
            "parse": lambda flag, text: parse_layer_heads(flag, text),
        },
    )
    temperature: float = field(
        default=0.33, metadata={"help": "Hard Concrete temperature β > 0 (lower: samples closer to 0/1)."}
    )
    stretch: tuple[float, float] = field(
        default=(-0.1, 1.1),
        metadata={"help": "Hard Concrete stretch interval l,r with l < 0 < 1 < r."},
    )
    init_log_alpha: float = field(
        default=3.0, metadata={"help": "Initial log alpha of every open Hard Concrete gate."}
    )
    hard: bool = field(
        default=False,
        metadata={
            "help": "Straight-through Hard Concrete gates: 0/1 forward, the soft gate's gradient.",
            "flag": "--hard/--soft",
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in GATES:
            raise HeadkitError(f"kind must be one of {sorted(GATES)}, got {self.kind!r}")
        if self.alive_heads is not None:
            object.__setattr__(self, "alive_heads", layer_heads("alive_heads", self.alive_heads))
        if self.kind == "fixed":
            given = [name for name in HARD_CONCRETE_OPTIONS if not _is_default(name, getattr(self, name))]
            if given:
                raise HeadkitError(f"fixed gates take no options, got {given}")
        init = self.init_log_alpha
        if isinstance(init, bool) or not isinstance(init, (int, float)):
            raise HeadkitError(
                f"init_log_alpha must be a float for add_head_gates (one value for every head), got {init!r}"
            )
        if not math.isfinite(init):
            raise HeadkitError(f"bad Hard Concrete gate option: init_log_alpha must be finite, got {init!r}")
        if not isinstance(self.hard, bool):
            raise HeadkitError(f"bad Hard Concrete gate option: hard must be a bool, got {self.hard!r}")
        try:  # the gate's own checks (and its normalised values): one gate of one head
            gate = HardConcreteGate(1, temperature=self.temperature, stretch=self.stretch, hard=self.hard)
        except (TypeError, ValueError) as exc:
            raise HeadkitError(f"bad Hard Concrete gate option: {exc}") from None
        object.__setattr__(self, "temperature", gate.temperature)
        object.__setattr__(self, "stretch", gate.stretch)
        object.__setattr__(self, "init_log_alpha", float(init))

    def check(
        self,
        model_or_config: Any,
        adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ) -> None:
        """What a model (or only its 🤗 config) answers, before any gate is attached (:meth:`alive`)."""
        self.alive(model_or_config, adapter)

    def alive(
        self,
        model_or_config: Any,
        adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ) -> dict[int, list[int]]:
        """``{layer: [heads kept]}`` for the layers named, checked: the model has no gates yet, and
        ``alive_heads`` names its layers and heads (a config's head counts are those it states, the pruning it
        records applied)."""
        if isinstance(model_or_config, nn.Module):
            return self._check_model(model_or_config, adapter)[2]
        config = model_or_config
        if config_records_gates(config):
            raise HeadkitError(
                "the model already has head gates (its config records them); call remove_head_gates(model) first"
            )
        counts = config_head_counts(config)
        if self.alive_heads is None:
            return {}
        if counts is None:
            return {layer: list(heads) for layer, heads in self.alive_heads}
        return check_layer_heads("alive_heads", self.alive_heads, counts)

    def _check_model(
        self, model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None
    ) -> tuple[AttentionAdapter, list[AttentionSite], dict[int, list[int]]]:
        adapter = get_adapter(model, adapter)
        sites = adapter.sites(model)
        gated = [site.index for site in sites if site_gate(site) is not None]
        if gated:
            raise HeadkitError(
                f"the model already has head gates on layers {gated}; call remove_head_gates(model) first"
            )
        counts = [site.num_heads for site in sites]
        alive = {} if self.alive_heads is None else check_layer_heads("alive_heads", self.alive_heads, counts)
        return adapter, sites, alive

    def record(self) -> dict[str, Any]:
        """The fields as ``config.headkit_surgery`` keeps them (JSON: lists, string layer keys)."""
        return {
            "kind": self.kind,
            "alive_heads": None
            if self.alive_heads is None
            else {str(layer): list(heads) for layer, heads in self.alive_heads},
            "temperature": self.temperature,
            "stretch": list(self.stretch),
            "init_log_alpha": self.init_log_alpha,
            "hard": self.hard,
        }

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> GateConfig:
        """The config a record was written from. A record written before the config existed holds the Hard
        Concrete options given under ``"options"`` (temperature, stretch, hard); the others take their
        defaults (the initial log α and the alive heads are in the saved weights)."""
        names = {f.name for f in fields(cls)}
        values = {name: value for name, value in (entry.get("options") or {}).items() if name in names}
        values |= {name: value for name, value in entry.items() if name in names}
        return cls(**values)


def _is_default(name: str, value: Any) -> bool:
    default = next(f.default for f in fields(GateConfig) if f.name == name)
    try:
        return value == default or (name == "stretch" and tuple(value) == default)
    except TypeError:
        return False


def _gate_config_of(
    kind: GateConfig | str | None,
    alive_heads: Mapping[int, Iterable[int]] | None,
    config: GateConfig | None,
    options: dict[str, Any],
) -> GateConfig:
    """The config of an :func:`add_head_gates` call: given (positionally or as ``config=``), or built from the
    keywords (the call's API before the config)."""
    kind, config = config_in_place_of(GateConfig, kind, config)
    if config is not None:
        given = [name for name, value in (("alive_heads", alive_heads), ("kind", kind)) if value is not None]
        return given_config(GateConfig, config, options, given)
    values = dict(options)
    if kind is not None:
        values["kind"] = kind
    if alive_heads is not None:
        values["alive_heads"] = alive_heads
    unknown = sorted(set(options) - {f.name for f in fields(GateConfig)})
    if unknown:
        if values.get("kind") == "fixed":
            raise HeadkitError(f"fixed gates take no options, got {sorted(options)}")
        raise HeadkitError(
            f"bad Hard Concrete gate option: unknown {unknown}; the options are "
            f"{', '.join(HARD_CONCRETE_OPTIONS)} and generator"
        )
    return GateConfig(**values)


# -- adding and removing gates ---------------------------------------------------------------------------------


def add_head_gates(
    model: nn.Module,
    kind: GateConfig | str | None = None,
    alive_heads: Mapping[int, Iterable[int]] | None = None,
    *,
    config: GateConfig | None = None,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    generator: torch.Generator | None = None,
    **options: Any,
) -> dict[int, HeadkitGate]:
    """Gate every attention head of `model`: head h's output is multiplied by g_h before the output projection.

    Args:
        model: a supported 🤗 model (BERT, RoBERTa, DistilBERT, ALBERT, GPT-2, LLaMA family, ViT) or a headkit
            model; see :func:`headkit.surgery.adapters.supported_architectures`.
        kind: a :class:`GateConfig` (how to gate: ``add_head_gates(model, GateConfig(...))``), or its ``kind``:
            ``"hard_concrete"`` (the default; learned :class:`~headkit.layers.gates.HardConcreteGate`, Voita et
            al. 2019) or ``"fixed"`` (constant 0/1 :class:`~headkit.layers.gates.FixedGate`).
        alive_heads: ``{layer: [heads kept]}`` (:attr:`GateConfig.alive_heads`); None: every head open.
        config: the :class:`GateConfig`, as a keyword; or its fields as keywords (``temperature``, ``stretch``,
            ``init_log_alpha`` (a float), ``hard``), not both.
        adapter: the architecture adapter; by default the one matching ``model.config.model_type``.
        generator: the Hard Concrete gates' random source (torch's global one when None).

    Returns:
        ``{layer: gate}``. Layers whose attention has no head left (pruned to zero) get no gate. The model is
        left untouched on any error; gates already present are an error (:func:`remove_head_gates` first).
    """
    say_deprecated("add_head_gates", GateConfig)
    return _add_gates(
        model, _gate_config_of(kind, alive_heads, config, options), adapter=adapter, generator=generator
    )


def _add_gates(
    model: nn.Module,
    config: GateConfig,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    generator: torch.Generator | None = None,
) -> dict[int, HeadkitGate]:
    """:func:`headkit.apply_` of a :class:`GateConfig`: gate every head (see :func:`add_head_gates`)."""
    if generator is not None and config.kind == "fixed":
        raise HeadkitError("fixed gates take no options, got ['generator']")
    adapter, sites, alive = config._check_model(model, adapter)
    # Every gate is built (and its options validated) before any is attached: a bad option leaves the model as
    # it was.
    gates: dict[int, HeadkitGate] = {}
    for site in sites:
        if site.num_heads == 0:
            continue
        gates[site.index] = _build_gate(config, site, alive.get(site.index), generator)
    for site in sites:
        if site.index in gates:
            _set_site_gate(model, site, gates[site.index])
    record_surgery(
        model,
        {"op": GATES_OP, "adapter": adapter.name}
        | config.record()
        | {"num_heads": {str(index): gate.num_heads for index, gate in gates.items()}},
    )
    return gates


def _build_gate(
    config: GateConfig, site: AttentionSite, alive: list[int] | None, generator: torch.Generator | None
) -> HeadkitGate:
    reference = next(site.module.parameters(), None)
    if config.kind == "fixed":
        gate: HeadkitGate = FixedGate(site.num_heads, alive)
    else:
        log_alpha = torch.full((site.num_heads,), config.init_log_alpha)
        if alive is not None:
            closed = torch.ones(site.num_heads, dtype=torch.bool)
            closed[alive] = False
            log_alpha[closed] = CLOSED_LOG_ALPHA
        try:
            gate = HardConcreteGate(
                site.num_heads,
                temperature=config.temperature,
                stretch=config.stretch,
                init_log_alpha=log_alpha,
                hard=config.hard,
                generator=generator,
            )
        except (TypeError, ValueError) as exc:
            raise HeadkitError(f"bad Hard Concrete gate option: {exc}") from None
    if reference is not None:
        # Built in float32 whatever the model's dtype (log α needs the precision); only moved to its device.
        gate.to(reference.device)
    return gate


def remove_head_gates(
    model: nn.Module,
    *,
    fold: bool = False,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> None:
    """Take every head gate off `model`.

    Args:
        fold: multiply each head's columns of the output projection by its evaluation-mode gate value first, so
            that the model without gates computes what the gated model computed in evaluation mode (gates of
            exactly 0 or 1 change nothing either way). Without it, every head is fully open again.
    """
    adapter = get_adapter(model, adapter)
    sites = [site for site in adapter.sites(model) if site_gate(site) is not None]
    if not sites:
        raise HeadkitError("the model has no head gates to remove")
    if fold:
        for site in sites:
            _fold_gate(site)
    for site in sites:
        _set_site_gate(model, site, None)
    record_surgery(model, {"op": REMOVE_GATES_OP, "adapter": adapter.name})


def _fold_gate(site: AttentionSite) -> None:
    values = evaluation_gate_values(site_gate(site))
    projection = site.output_projection
    column_scale = values.repeat_interleave(site.head_dim)  # input column h·d + i belongs to head h
    with torch.no_grad():
        if isinstance(projection, nn.Linear):
            projection.weight.mul_(column_scale.to(projection.weight)[None, :])
        else:  # GPT-2 Conv1D stores its weight [in, out]
            projection.weight.mul_(column_scale.to(projection.weight)[:, None])


# -- reading gates ---------------------------------------------------------------------------------------------


def head_gates(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
) -> dict[int, HeadkitGate]:
    """``{layer: gate}`` for every gated attention site of `model` (empty when it has no gates)."""
    return {
        site.index: site_gate(site)
        for site in get_adapter(model, adapter).sites(model)
        if site_gate(site) is not None
    }


def evaluation_gate_values(gate: HeadkitGate) -> torch.Tensor:
    """The gate's deterministic evaluation-mode values [num_heads], detached, whatever its current mode."""
    was_training = gate.training
    try:
        gate.eval()
        with torch.no_grad():
            return gate().detach().float().cpu()
    finally:
        gate.train(was_training)


def gate_values(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
) -> dict[int, torch.Tensor]:
    """``{layer: evaluation-mode gate values [heads]}`` (detached, on CPU): what the model uses in eval mode."""
    return {index: evaluation_gate_values(gate) for index, gate in _require_gates(model, adapter).items()}


def gate_probabilities(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
) -> dict[int, torch.Tensor]:
    """``{layer: P(gate ≠ 0) [heads]}`` (detached, on CPU): each head's term of :func:`l0_penalty`."""
    with torch.no_grad():
        return {
            index: gate.probability_nonzero().detach().float().cpu()
            for index, gate in _require_gates(model, adapter).items()
        }


def _require_gates(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None
) -> dict[int, HeadkitGate]:
    gates = head_gates(model, adapter)
    if not gates:
        raise HeadkitError("the model has no head gates; call headkit.add_head_gates(model) first")
    return gates


def l0_penalty(model: nn.Module | HeadkitGate | Iterable[HeadkitGate]) -> torch.Tensor:
    """The relaxed L0 norm of the model's head gates: Σ over every gated head of P(g_h ≠ 0), a scalar tensor.

    Louizos et al. 2018, Eq. 12, as Voita et al. 2019 use it (§4.1): the penalty is the *expected number of
    open heads*, a sum and not a mean, so a coefficient λ costs "λ per open head" in every model whatever its
    size. Differentiable in every Hard Concrete gate's log α; fixed gates add their constant count of kept heads.
    A gate shared by several layers (ALBERT) is counted once, as its heads are removed once.

    Args:
        model: a model gated with :func:`add_head_gates` (every :class:`HeadkitGate` module in it counts), or
            gates directly (one gate or an iterable of them).
    """
    if isinstance(model, nn.Module) and not isinstance(model, HeadkitGate):
        gates = [module for module in model.modules() if isinstance(module, HeadkitGate)]
        if not gates:
            raise HeadkitError("the model has no head gates; call headkit.add_head_gates(model) first")
        return _gates_l0_penalty(gates)
    return _gates_l0_penalty(model)


# -- reloading -------------------------------------------------------------------------------------------------


def _reapply_gates(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded gates on a freshly built model (their log α / masks load with the weights)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = adapter.sites(model)
    recorded = {int(index): int(count) for index, count in entry["num_heads"].items()}
    actual = {site.index: site.num_heads for site in sites if site.num_heads > 0}
    if recorded != actual:
        raise HeadkitError(
            f"the recorded head gates cover heads {recorded} per layer, but the rebuilt model has {actual}"
        )
    config = GateConfig.from_record(entry)
    for site in sites:
        if site.index in recorded:
            _set_site_gate(model, site, _build_gate(config, site, None, None))


def _reapply_remove_gates(model: nn.Module, entry: dict[str, Any]) -> None:
    for site in get_adapter(model, entry["adapter"]).sites(model):
        if site_gate(site) is not None:
            _set_site_gate(model, site, None)


register_conversion(GateConfig, GATES_OP, _add_gates, _reapply_gates)
register_surgery_op(REMOVE_GATES_OP, _reapply_remove_gates)
