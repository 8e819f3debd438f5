"""What the benchmarks training small models from scratch share: training each of their models alike on headkit's
one loop (:func:`headkit.train.train_on_batches`) under a progress bar, and generation."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import numpy as np
import torch

from headkit.bench._report import progress_bar
from headkit.train import train_on_batches


def train_each(
    console: Any,
    names: Iterable[str],
    build: Callable[[str], torch.nn.Module],
    training: Callable[[torch.nn.Module], dict[str, Any]],
    steps: int,
    evaluate: Callable[..., Any],
) -> list[Any]:
    """Per name of ``names``: the model ``build(name)`` trained for ``steps`` steps by
    :func:`headkit.train.train_on_batches` with the options ``training(model)`` (its batches, seed, optimizer
    groups, schedule) under a transient progress bar "training <name>", then ``evaluate(name, model, trained,
    update)``: ``trained`` how it trained (parameters, training seconds, the mean of the last 20 losses, the
    losses), ``update(**fields)`` of the bar's task. The list of evaluations."""
    evaluations = []
    with progress_bar(console, transient=True) as progress:
        for name in names:
            model = build(name)
            task = progress.add_task(f"training {name}", total=steps)
            started = time.perf_counter()
            losses = train_on_batches(
                model,
                steps=steps,
                on_step=lambda step, loss, seconds, task=task: progress.update(task, completed=step),
                **training(model),
            ).losses
            trained = {
                "parameters": sum(p.numel() for p in model.parameters()),
                "train_seconds": time.perf_counter() - started,
                "final_train_loss": float(np.mean(losses[-20:])),
                "losses": losses,
            }
            evaluations.append(evaluate(name, model, trained, partial(progress.update, task)))
    return evaluations
