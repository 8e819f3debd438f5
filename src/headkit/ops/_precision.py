"""Accumulation precision shared by the ops: leave autocast where sums must be float32."""

from __future__ import annotations

import contextlib

import torch


def autocast_disabled(device: torch.device) -> contextlib.AbstractContextManager:
    """A context that turns autocast off on ``device`` for the accumulations inside it, or a no-op when autocast
    is not on there: constructing and entering a disabled ``torch.autocast`` costs a one-token decoding step more
    than its arithmetic on CPU, and does nothing when autocast is off anyway."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()
