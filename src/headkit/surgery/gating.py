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

Saving. :func:`add_head_gates` and :func:`remove_head_gates` record themselves in ``config.headkit_surgery``, so a
gated model saved with ``save_pretrained`` reloads with its gates through :func:`headkit.from_pretrained`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.base import HeadkitAttention
from headkit.layers.gates import GATES, FixedGate, HardConcreteGate, HeadkitGate
from headkit.layers.gates import l0_penalty as _gates_l0_penalty
from headkit.surgery.adapters import AttentionAdapter, AttentionSite, get_adapter
from headkit.surgery.attention import HEAD_GATE, release_dispatcher, use_dispatcher
from headkit.surgery.records import record_surgery, register_surgery_op

GATE_ATTRIBUTE = HEAD_GATE
GATES_OP = "gates"
REMOVE_GATES_OP = "remove_gates"
# log α of a Hard Concrete gate that starts closed (a head outside ``alive_heads``): its evaluation gate is
# exactly 0 (σ(−10)·1.2 − 0.1 < 0) and P(g ≠ 0) = σ(−10 + 0.79) ≈ 1e-4.
CLOSED_LOG_ALPHA = -10.0


# -- where the gate acts ---------------------------------------------------------------------------------------


def gates_natively(site: AttentionSite) -> bool:
    """True when the site's module applies ``head_gate`` itself (headkit's own attention layers); a stock module's
    gate is applied by the registered ``headkit_<base>`` attention function."""
    return isinstance(site.module, HeadkitAttention)


def site_gate(site: AttentionSite) -> HeadkitGate | None:
    """The gate on a site's attention module, or None."""
    return getattr(site.module, HEAD_GATE, None)


def _set_site_gate(model: nn.Module, site: AttentionSite, gate: HeadkitGate | None) -> None:
    if gate is None:
        if isinstance(site.module, HeadkitAttention):
            site.module.head_gate = None  # the layer's slot stays, empty
        elif HEAD_GATE in site.module._modules:
            del site.module._modules[HEAD_GATE]
            release_dispatcher(model)
        return
    gate.train(site.module.training)  # a gate added to a model in eval mode must not sample
    site.module.add_module(HEAD_GATE, gate)
    if not gates_natively(site):
        use_dispatcher(model)


# -- validation shared with pruning ----------------------------------------------------------------------------


def check_site_heads(
    argument: str, heads: Mapping[int, Iterable[int]], sites: list[AttentionSite]
) -> dict[int, list[int]]:
    """Validate ``{site index: [head indices]}`` against the model's sites; sorted, de-duplicated lists."""
    if not isinstance(heads, Mapping):
        raise HeadkitError(
            f"{argument} must be a mapping {{layer: [head indices]}}, got {type(heads).__name__}"
        )
    checked: dict[int, list[int]] = {}
    for layer, layer_heads in heads.items():
        layer_index = _as_index(argument, "layer index", layer)
        if not 0 <= layer_index < len(sites):
            raise HeadkitError(
                f"{argument} names layer {layer!r}, out of range: the model has {len(sites)} attention layers "
                f"(0 … {len(sites) - 1})"
            )
        if layer_index in checked:
            raise HeadkitError(f"{argument} names layer {layer_index} twice")
        if isinstance(layer_heads, (str, bytes)) or not isinstance(layer_heads, Iterable):
            raise HeadkitError(
                f"{argument}[{layer!r}] must be an iterable of head indices, got {type(layer_heads).__name__}"
            )
        num_heads = sites[layer_index].num_heads
        indices = set()
        for head in layer_heads:
            head_index = _as_index(argument, f"head index of layer {layer_index}", head)
            if not 0 <= head_index < num_heads:
                raise HeadkitError(
                    f"{argument}[{layer_index}] holds head {head!r}, out of range: layer {layer_index} has "
                    f"{num_heads} heads (0 … {num_heads - 1})"
                )
            indices.add(head_index)
        checked[layer_index] = sorted(indices)
    return checked


def _as_index(argument: str, what: str, value: Any) -> int:
    # bool is an int, but True as a layer or head index is a mistake, not 1.
    if isinstance(value, bool):
        raise HeadkitError(f"{argument}: {what} must be an int, got {value!r}")
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)  # JSON keys (a recorded plan) are strings
    try:
        return operator.index(value)
    except TypeError:
        raise HeadkitError(f"{argument}: {what} must be an int, got {value!r}") from None


# -- adding and removing gates ---------------------------------------------------------------------------------


def add_head_gates(
    model: nn.Module,
    kind: str = "hard_concrete",
    alive_heads: Mapping[int, Iterable[int]] | None = None,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    **gate_options: Any,
) -> dict[int, HeadkitGate]:
    """Gate every attention head of `model`: head h's output is multiplied by g_h before the output projection.

    Args:
        model: a supported 🤗 model (BERT, RoBERTa, DistilBERT, ALBERT, GPT-2, LLaMA family, ViT) or a headkit
            model; see :func:`headkit.surgery.adapters.supported_architectures`.
        kind: ``"hard_concrete"`` (learned :class:`~headkit.layers.gates.HardConcreteGate`, Voita et al. 2019) or
            ``"fixed"`` (constant 0/1 :class:`~headkit.layers.gates.FixedGate`).
        alive_heads: ``{layer: [heads kept]}``; layers not named keep every head. Fixed gates are 1 on kept heads
            and 0 elsewhere; Hard Concrete gates of the other heads start closed (log α = −10, evaluation gate
            exactly 0). None: every head open.
        adapter: the architecture adapter; by default the one matching ``model.config.model_type``.
        gate_options: passed to every gate's constructor (Hard Concrete: ``temperature``, ``stretch``,
            ``init_log_alpha`` (a float), ``hard``, ``generator``).

    Returns:
        ``{layer: gate}``. Layers whose attention has no head left (pruned to zero) get no gate. The model is
        left untouched on any error; gates already present are an error (:func:`remove_head_gates` first).
    """
    if kind not in GATES:
        raise HeadkitError(f"kind must be one of {sorted(GATES)}, got {kind!r}")
    adapter = get_adapter(model, adapter)
    sites = adapter.sites(model)
    gated = [site.index for site in sites if site_gate(site) is not None]
    if gated:
        raise HeadkitError(
            f"the model already has head gates on layers {gated}; call remove_head_gates(model) first"
        )
    alive = {} if alive_heads is None else check_site_heads("alive_heads", alive_heads, sites)
    init_log_alpha = gate_options.get("init_log_alpha", 3.0)
    if kind == "hard_concrete" and (
        isinstance(init_log_alpha, bool) or not isinstance(init_log_alpha, (int, float))
    ):
        raise HeadkitError(
            f"init_log_alpha must be a float for add_head_gates (one value for every head), got {init_log_alpha!r}"
        )
    # Every gate is built (and its options validated) before any is attached: a bad option leaves the model as
    # it was.
    gates: dict[int, HeadkitGate] = {}
    for site in sites:
        if site.num_heads == 0:
            continue
        gates[site.index] = _build_gate(kind, site, alive.get(site.index), gate_options)
    for site in sites:
        if site.index in gates:
            _set_site_gate(model, site, gates[site.index])
    record_surgery(
        model,
        {
            "op": GATES_OP,
            "adapter": adapter.name,
            "kind": kind,
            "num_heads": {str(index): gate.num_heads for index, gate in gates.items()},
            "options": _recordable_options(gate_options),
        },
    )
    return gates


def _build_gate(
    kind: str, site: AttentionSite, alive: list[int] | None, gate_options: dict[str, Any]
) -> HeadkitGate:
    reference = next(site.module.parameters(), None)
    if kind == "fixed":
        if gate_options:
            raise HeadkitError(f"fixed gates take no options, got {sorted(gate_options)}")
        gate: HeadkitGate = FixedGate(site.num_heads, alive)
    else:
        options = dict(gate_options)
        init = float(options.pop("init_log_alpha", 3.0))
        log_alpha = torch.full((site.num_heads,), init)
        if alive is not None:
            closed = torch.ones(site.num_heads, dtype=torch.bool)
            closed[alive] = False
            log_alpha[closed] = CLOSED_LOG_ALPHA
        try:
            gate = HardConcreteGate(site.num_heads, init_log_alpha=log_alpha, **options)
        except (TypeError, ValueError) as exc:
            raise HeadkitError(f"bad Hard Concrete gate option: {exc}") from None
    if reference is not None:
        # Built in float32 whatever the model's dtype (log α needs the precision); only moved to its device.
        gate.to(reference.device)
    return gate


def _recordable_options(gate_options: dict[str, Any]) -> dict[str, Any]:
    """The options a reloaded gate needs to behave the same (what is not in its state dict)."""
    options = {}
    for name in ("temperature", "hard"):
        if name in gate_options:
            options[name] = gate_options[name]
    if "stretch" in gate_options:
        options["stretch"] = [float(bound) for bound in gate_options["stretch"]]
    return options


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
    for site in sites:
        if site.index in recorded:
            _set_site_gate(
                model, site, _build_gate(entry["kind"], site, None, dict(entry.get("options", {})))
            )


def _reapply_remove_gates(model: nn.Module, entry: dict[str, Any]) -> None:
    for site in get_adapter(model, entry["adapter"]).sites(model):
        if site_gate(site) is not None:
            _set_site_gate(model, site, None)


register_surgery_op(GATES_OP, _reapply_gates)
register_surgery_op(REMOVE_GATES_OP, _reapply_remove_gates)
