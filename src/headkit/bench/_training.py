"""What the benchmarks training small models from scratch share: the optimisation loop, and generation."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import numpy as np
import torch

from headkit.bench._report import progress_bar


def optimizer_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    steps: int,
    loss_at: Callable[[int], torch.Tensor],
    progress: Callable[[int, float], None] | None = None,
    clip_norm: float | None = None,
) -> list[float]:
    """``steps`` steps of ``loss_at(step)`` in training mode: gradients zeroed, backward, the gradient norm
    clipped to ``clip_norm`` (if given), an optimiser and a schedule step; ``progress(steps done, loss)`` after
    each. Leaves the model in evaluation mode and returns the losses."""
    model.train()
    losses = []
    for step in range(steps):
        loss = loss_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1])
    model.eval()
    return losses


def train_each(
    console: Any,
    names: Iterable[str],
    build: Callable[[str], torch.nn.Module],
    train: Callable[..., list[float]],
    steps: int,
    evaluate: Callable[..., Any],
) -> list[Any]:
    """Per name of ``names``: the model ``build(name)`` trained by ``train(model, progress=…)`` (``steps`` steps,
    ``progress(steps done, loss)`` after each) under a transient progress bar "training <name>", then
    ``evaluate(name, model, trained, update)``: ``trained`` how it trained (parameters, training seconds, the
    mean of the last 20 losses, the losses), ``update(**fields)`` of the bar's task. The list of evaluations."""
    evaluations = []
    with progress_bar(console, transient=True) as progress:
        for name in names:
            model = build(name)
            task = progress.add_task(f"training {name}", total=steps)
            started = time.perf_counter()
            losses = train(
                model, progress=lambda step, loss, task=task: progress.update(task, completed=step)
            )
            trained = {
                "parameters": sum(p.numel() for p in model.parameters()),
                "train_seconds": time.perf_counter() - started,
                "final_train_loss": float(np.mean(losses[-20:])),
                "losses": losses,
            }
            evaluations.append(evaluate(name, model, trained, partial(progress.update, task)))
    return evaluations


def generate(
    model: Any, prompts: torch.Tensor, new_tokens: int, pad_token_id: int, **options: Any
) -> torch.Tensor:
    """``model.generate`` of exactly ``new_tokens`` more tokens after each of ``prompts`` [N, P] (no padding),
    greedy unless ``do_sample=True``, none of the generation config's top-k, top-p or temperature applied."""
    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        top_k=None,
        top_p=None,
        temperature=None,
        pad_token_id=pad_token_id,
        **({"do_sample": False} | options),
    )
