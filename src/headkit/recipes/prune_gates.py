"""Hard Concrete head gates trained for pruning (Voita et al. 2019; Wang, Wohlwend & Lei 2020, Eq. 4):
:func:`train_head_gates` (a gated copy of the teacher trained towards a head budget under the L0 constraint), the
report's record of the training (:func:`gate_log`) and a callback that echoes its progress
(:func:`echo_gate_progress`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from headkit.recipes.gates import GateTrainingLog, train_gates_to_budget
from headkit.surgery.apply import apply_
from headkit.surgery.gating import GateConfig


def train_head_gates(
    teacher: nn.Module,
    batches: list[dict],
    objective: Callable,
    keep: int,
    *,
    weight_lr: float = 0.0,
    seed: int = 0,
    adapter: Any = None,
    **training: Any,
) -> tuple[nn.Module, GateTrainingLog]:
    """A copy of `teacher` with Hard Concrete gates on every head, trained (and its weights when `weight_lr` > 0)
    towards `keep` open heads under the L0 constraint with ``objective(student, teacher, batch)`` on `batches` as
    the task loss (:func:`headkit.recipes.gates.train_gates_to_budget`, which takes the other ``training``
    options: steps, gate_lr, log_every, …); returns (the gated copy, the log)."""
    training["log_every"] = training.get("log_every") or max(1, training["steps"] // 6)
    torch.manual_seed(seed)  # the gates' noise
    student = copy.deepcopy(teacher)
    student.requires_grad_(weight_lr > 0)
    apply_(student, GateConfig(kind="hard_concrete"), adapter=adapter)
    log = train_gates_to_budget(
        student,
        lambda model, batch: objective(model, teacher, batch),
        batches,
        target_heads=keep,
        weight_lr=weight_lr,
        seed=seed,
        companions=[teacher],
        **{"log_every": max(1, training["steps"] // 6)}
        | {k: v for k, v in training.items() if v is not None},
    )
    return student, log


def gate_log(log: GateTrainingLog) -> dict[str, Any]:
    """The report's record of a gate training: steps, losses, expected heads and gate values at the end."""
    return {
        "steps": log.steps[-1],
        "losses": log.task_losses,
        "expected_heads_at_end": log.expected_heads[-1],
        "gate_values": [values for _, values in sorted(log.gate_values[-1].items())],
    }


def echo_gate_progress(
    echo: Callable[[str], None], steps: int, every: int = 1
) -> Callable[[int, GateTrainingLog], None]:
    """A :func:`~headkit.recipes.gates.train_gates_to_budget` callback that echoes the loss and the expected heads
    at logged steps that are multiples of `every`."""

    def report(step: int, log: GateTrainingLog) -> None:
        if step % every:
            return
        echo(
            f"  gate step {step}/{steps}: loss {log.task_losses[-1]:.4f}, expected heads "
            f"{log.expected_heads[-1]:.1f} (target {log.targets[-1]:.1f})"
        )

    return report


__all__ = [
    "echo_gate_progress",
    "gate_log",
    "train_head_gates",
]
