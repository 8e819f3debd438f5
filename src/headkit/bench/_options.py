"""Checks of benchmark settings, worded as the command-line options they come from (``steps`` → ``--steps``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from headkit.errors import HeadkitError


def check_positive_option(name: str, value: Any) -> None:
    """``value`` must be an int > 0 (bool is refused); the error names the option ``--name-with-dashes``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HeadkitError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def check_positive_options(config: Any, names: Iterable[str]) -> None:
    """Each of ``config``'s attributes ``names`` must be a positive integer (see :func:`check_positive_option`)."""
    for name in names:
        check_positive_option(name, getattr(config, name))


def check_device(device: str) -> torch.device:
    """``device`` as a torch device: cpu or an existing CUDA device, else an error naming ``--device``."""
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError):
        torch_device = None
    if torch_device is None or torch_device.type not in ("cpu", "cuda"):
        raise HeadkitError(f"--device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise HeadkitError(f"--device {device!r} asked for, but CUDA is not available here; use --device cpu")
    if torch_device.type == "cuda" and (torch_device.index or 0) >= torch.cuda.device_count():
        raise HeadkitError(f"--device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    return torch_device


def check_names(flag: str, names: Iterable[str], valid: Iterable[str]) -> list[str]:
    """``names`` without repeats, each one of ``valid`` (e.g. registered mechanisms), else an error naming ``flag``."""
    valid = list(valid)
    names = list(dict.fromkeys(name.strip() for name in names))
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise HeadkitError(
            f"{flag}: unknown mechanism(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"valid names: {', '.join(valid)}"
        )
    return names


def check_out_dir(out: str | Path) -> Path:
    """``out`` as a Path, refused when it exists and is not a directory."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {str(out)!r} exists and is not a directory")
    return out
