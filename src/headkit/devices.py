"""Devices: checking one a command is asked to run on, worded as the ``--device`` option it comes from, and
the one a model's weights are on.

The check is shared by ``headkit train`` (:mod:`headkit.train`) and the benchmarks (:mod:`headkit.bench`): one
check, one wording, validated before any work or loading.
"""

from __future__ import annotations

import torch

from headkit.errors import HeadkitError


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device: cpu or an existing CUDA device, else an error naming ``--device``."""
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError):
        torch_device = None
    if torch_device is None or torch_device.type not in ("cpu", "cuda"):
        raise HeadkitError(f"--device must be 'cpu' or 'cuda' (or 'cuda:N'), got {str(device)!r}")
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise HeadkitError(
            f"--device {str(device)!r} asked for, but CUDA is not available here; use --device cpu"
        )
    if torch_device.type == "cuda" and (torch_device.index or 0) >= torch.cuda.device_count():
        raise HeadkitError(
            f"--device {str(device)!r} does not exist: {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch_device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s (first) parameters: where its inputs go."""
    return next(model.parameters()).device


__all__ = ["check_device", "model_device"]
