"""What the benchmarks training small models from scratch share: the optimisation loop, and generation."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


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


def train_with_progress(
    progress: Any, label: str, model: torch.nn.Module, steps: int, train: Callable[..., list[float]]
) -> tuple[dict[str, Any], Any]:
    """``train(callback)`` under a progress task "training <label>" of ``steps`` that the callback advances:
    (how the model trained — its parameters, training seconds, the mean of the last 20 losses, the losses —
    and the task, for the caller's next steps)."""
    task = progress.add_task(f"training {label}", total=steps)
    started = time.perf_counter()
    losses = train(lambda step, loss: progress.update(task, completed=step))
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": time.perf_counter() - started,
        "final_train_loss": float(np.mean(losses[-20:])),
        "losses": losses,
    }, task


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
