"""Training head gates to a head budget, on headkit's one training loop (:func:`headkit.recipes.loop.train_loop`).

The gates themselves — putting them on a model, reading them, folding and removing them — are surgery
(:mod:`headkit.surgery.gating`); training them is a workflow, and every workflow that trains goes through the one
loop, so it lives here, above the loop: surgery imports nothing from recipes.

The objective is the Lagrangian relaxation of Wang, Wohlwend & Lei, "Structured Pruning of Large Language Models"
(EMNLP 2020), Eq. 4: task_loss + λ₁·(E[L0] − t) + λ₂·(E[L0] − t)², minimised in the gates (and optionally the
weights) and maximised in λ₁, λ₂ (:class:`headkit.layers.gates.L0Controller`), where E[L0] is the relaxed L0
penalty of Louizos et al. 2018, Eq. 12 (:func:`headkit.surgery.gating.l0_penalty`) and the target t is annealed
linearly from every gated head down to the budget over the first part of the steps, as Wang et al. anneal it,
so the model is not pushed off a cliff at step 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.gates import HardConcreteGate, L0Controller
from headkit.recipes.loop import check_count, train_loop
from headkit.surgery.gating import evaluation_gate_values, head_gates, l0_penalty

_EMPTY = object()


@dataclass
class GateTrainingLog:
    """What :func:`train_gates_to_budget` recorded, one entry per logged step.

    ``gate_values[i]`` maps each layer to its evaluation-mode gate values at ``steps[i]`` (for heatmaps of gate
    values over training, :func:`headkit.analysis.plots.plot_gate_history`).
    """

    target_heads: float
    steps: list[int] = field(default_factory=list)
    task_losses: list[float] = field(default_factory=list)
    expected_heads: list[float] = field(default_factory=list)
    targets: list[float] = field(default_factory=list)
    gate_values: list[dict[int, list[float]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Every field, the layers of ``gate_values`` as string keys (for JSON)."""
        return vars(self) | {
            "gate_values": [{str(k): v for k, v in values.items()} for values in self.gate_values]
        }


def train_gates_to_budget(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: Iterable[Any],
    *,
    target_heads: float,
    steps: int,
    gate_lr: float = 0.1,
    weight_lr: float = 0.0,
    controller_lr: float = 0.05,
    anneal_fraction: float = 0.5,
    log_every: int = 10,
    callback: Callable[[int, GateTrainingLog], None] | None = None,
    seed: int = 0,
    gradient_accumulation_steps: int = 1,
    companions: Sequence[nn.Module] = (),
) -> GateTrainingLog:
    """Train a model's Hard Concrete gates (and optionally its weights) until about `target_heads` stay open.

    Args:
        model: a model with Hard Concrete gates (:func:`headkit.surgery.gating.add_head_gates`). Its gates sample
            (training mode) while this runs and return to their previous mode after; the rest of the model
            trains in the mode the caller set (call ``model.train()`` to train with dropout).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, the task loss (e.g. a distillation loss against the
            unpruned model).
        batches: re-iterable (a list, a DataLoader) of whole batches: drawn in a seeded shuffled order, cycled
            for `steps` steps.
        target_heads: heads to keep, in [0, number of gated heads].
        steps: optimisation steps.
        gate_lr: learning rate of the gates' log α.
        weight_lr: learning rate (AdamW, no weight decay) of the model's own parameters; 0 trains the gates only.
        controller_lr: learning rate of the multipliers λ₁, λ₂ (gradient ascent).
        anneal_fraction: share of the steps over which the target goes from all heads to `target_heads`.
        log_every: record the losses and gate values every this many steps (and at the last step).
        callback: called as ``callback(step, log)`` after each logged step.
        seed: the order of the batches.
        gradient_accumulation_steps: forwards per step.
        companions: modules ``loss_fn`` calls beside the model (a frozen teacher), moved to its device.
    """
    gates = list(head_gates(model).values())
    if not gates:
        raise HeadkitError("the model has no head gates; call headkit.add_head_gates(model) first")
    if not all(isinstance(gate, HardConcreteGate) for gate in gates):
        raise HeadkitError(
            "train_gates_to_budget needs Hard Concrete gates: add_head_gates(model, 'hard_concrete')"
        )
    total_heads = sum(gate.num_heads for gate in gates)
    _check_number("target_heads", target_heads, 0, total_heads)
    steps = check_count("steps", steps)
    log_every = check_count("log_every", log_every)
    for name, value in (("gate_lr", gate_lr), ("controller_lr", controller_lr)):
        _check_number(name, value, 0, math.inf, open_low=True)
    _check_number("weight_lr", weight_lr, 0, math.inf)
    _check_number("anneal_fraction", anneal_fraction, 0, 1)
    if not isinstance(batches, Iterable) or iter(batches) is batches:
        raise HeadkitError("batches must be re-iterable (a list or a DataLoader), not a one-shot iterator")
    if next(iter(batches), _EMPTY) is _EMPTY:
        raise HeadkitError("batches must hold at least one batch, got an empty iterable")

    controller = L0Controller(target_heads=total_heads, lr=controller_lr)
    anneal_steps = max(1, round(anneal_fraction * steps))
    gate_ids = {id(gate.log_alpha) for gate in gates}
    weights = [p for p in model.parameters() if p.requires_grad and id(p) not in gate_ids]
    groups = [{"params": [gate.log_alpha for gate in gates], "lr": gate_lr}, controller.param_group()]
    if weight_lr > 0 and weights:
        groups.append({"params": weights, "lr": weight_lr})

    log = GateTrainingLog(target_heads=float(target_heads))
    task_loss: dict[str, torch.Tensor] = {}

    def loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        for gate in gates:
            gate.train()  # sampling, whatever mode the loop put the model in
        progress = min(1.0, (step + 1) / anneal_steps)
        controller.target_heads = total_heads + progress * (target_heads - total_heads)
        task_loss["last"] = loss_fn(model, batch)
        return task_loss["last"] + controller.penalty(gates)

    def record(step: int, _loss: float, _seconds: float) -> None:
        if step % log_every and step != steps:
            return
        log.steps.append(step)
        log.task_losses.append(float(task_loss["last"].detach()))
        log.expected_heads.append(float(l0_penalty(gates).detach()))
        log.targets.append(controller.target_heads)
        log.gate_values.append(
            {index: evaluation_gate_values(gate).tolist() for index, gate in head_gates(model).items()}
        )
        if callback is not None:
            callback(step, log)

    modes, training = [gate.training for gate in gates], model.training
    try:
        train_loop(
            model,
            loss,
            list(batches),
            steps=steps,
            param_groups=groups,
            dropout=training,
            seed=seed,
            gradient_accumulation_steps=gradient_accumulation_steps,
            on_step=record,
            companions=companions,
        )
    finally:
        model.train(training)
        for gate, mode in zip(gates, modes, strict=True):
            gate.train(mode)
    return log


def _check_number(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise HeadkitError(
            f"{name} must be a number in {'(' if open_low else '['}{low}, {high}], got {value!r}"
        )
    if value < low or value > high or (open_low and value == low):
        raise HeadkitError(f"{name} must be in {'(' if open_low else '['}{low}, {high}], got {value!r}")
    return float(value)
