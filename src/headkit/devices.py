"""Devices: checking one a command is asked to run on, worded as the ``--device`` option it comes from, the one
a model's weights are on, and whether it computes bfloat16 products in hardware.

The check is shared by ``headkit train`` (:mod:`headkit.train`) and the benchmarks (:mod:`headkit.bench`): one
check, one wording, validated before any work or loading.
"""

from __future__ import annotations

from pathlib import Path

import torch

from headkit.errors import HeadkitError

# CPU flags (Linux /proc/cpuinfo) of bfloat16 matrix instructions: AVX-512 BF16 (Intel Cooper Lake and later, AMD
# Zen 4 and later) and AMX (Intel Sapphire Rapids and later). Without them oneDNN emulates bfloat16 products by
# converting to float32, slower than float32 itself.
BFLOAT16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPU_INFO = Path("/proc/cpuinfo")


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


def cpu_flags(cpu_info: Path = CPU_INFO) -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (the first ``flags`` line of `cpu_info`); empty where
    that file does not exist (macOS, Windows)."""
    try:
        text = cpu_info.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` computes bfloat16 matrix products in hardware: a CUDA device that supports bfloat16, or
    a CPU with one of :data:`BFLOAT16_CPU_FLAGS`. Where it does not, bfloat16 is emulated and no faster than
    float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & BFLOAT16_CPU_FLAGS)


__all__ = ["BFLOAT16_CPU_FLAGS", "check_device", "cpu_flags", "model_device", "native_bfloat16"]
