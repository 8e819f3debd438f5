"""The process's peak resident memory over a stretch of work — a recipe's stage, a benchmark's step — read from the
kernel's high-water mark (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), and, where a CUDA device is in
use, its peak allocated bytes (``torch.cuda.max_memory_allocated``).

:func:`tracking_peak` measures one stretch; stretches nest (a stage that times decoding inside it): whoever resets
the mark first folds the peak so far into every stretch still open, so an outer stretch still sees the inner
one's peak. Where the mark cannot be reset (not Linux), each stretch's figure is the process's peak since it began
(``resource.getrusage``), which still makes the largest of them the run's peak.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

GIB = 1024**3


def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_bytes() -> int | None:
    """The process's resident memory now (``VmRSS``); None where the kernel does not say."""
    return _read_status("VmRSS")


def high_water_bytes() -> int:
    """The process's peak resident memory since it began or since the mark was last reset (``VmHWM``; elsewhere
    ``resource.getrusage``'s maximum, which cannot be reset)."""
    found = _read_status("VmHWM")
    if found is not None:
        return found
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def machine_memory_bytes() -> int | None:
    """The memory this process may use: the machine's physical memory, or its control group's limit where lower
    (a container's); None where neither can be read."""
    import os

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    try:
        with open("/sys/fs/cgroup/memory.max") as handle:
            limit = handle.read().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total


def _device_peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0


@dataclass
class Peak:
    """The peak of one stretch so far: resident bytes, and the CUDA device's allocated bytes (0 without one)."""

    resident: int = 0
    device: int = 0

    def update(self) -> Peak:
        """Fold the marks' current values in; returns itself."""
        self.resident = max(self.resident, high_water_bytes())
        self.device = max(self.device, _device_peak())
        return self

    def fold(self, other: Peak) -> Peak:
        """Take in the peak of a stretch that belongs to this one but was measured apart; returns itself."""
        self.resident = max(self.resident, other.resident)
        self.device = max(self.device, other.device)
        return self


_OPEN: list[Peak] = []


def release_free_memory() -> bool:
    """Hand the C allocator's free pages back to the kernel (glibc's ``malloc_trim``): memory a finished stage
    freed stays resident in the heap otherwise, and is counted again in every later stage's peak. True where the
    allocator did so (glibc); False elsewhere."""
    global _TRIM
    if _TRIM is None:
        _TRIM = False
        if sys.platform.startswith("linux"):
            import ctypes
            import ctypes.util

            try:
                _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                _TRIM = False
    if not _TRIM:
        return False
    _TRIM(0)
    return True


_TRIM: Any = None


def _reset_marks() -> None:
    """Fold the marks into every open stretch, give the allocator's free pages back, then reset the marks (where
    the kernel allows): a stage's peak is then what it held, not what an earlier one left in the heap."""
    for peak in _OPEN:
        peak.update()
    release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


@contextmanager
def tracking_peak() -> Iterator[Peak]:
    """``with tracking_peak() as peak:`` — after the block, ``peak.resident`` is the process's peak resident bytes
    during it (and ``peak.device`` the CUDA device's peak allocated bytes); inside it, ``peak.update()`` gives the
    peak so far."""
    _reset_marks()
    peak = Peak()
    _OPEN.append(peak)
    try:
        yield peak
    finally:
        peak.update()
        _OPEN.remove(peak)


def stage_peaks(stages: dict[str, Peak]) -> dict[str, object]:
    """A report's ``peak_memory``: the run's peak resident bytes, the stage that reached it, each stage's peak,
    and the CUDA device's peak allocated bytes (None where none was used)."""
    if not stages:
        return {}
    stage = max(stages, key=lambda name: stages[name].resident)
    summary: dict[str, object] = {
        "resident_bytes": stages[stage].resident,
        "stage": stage,
        "stages": {name: peak.resident for name, peak in stages.items()},
        "device_bytes": max(peak.device for peak in stages.values()) or None,
    }
    return summary


def peak_memory_line(report: dict) -> str | None:
    """The line a command ends with: "peak resident memory 1.83 GiB (stage convert)"; None without a figure."""
    summary = report.get("peak_memory") or {}
    if not summary.get("resident_bytes"):
        return None
    line = f"peak resident memory {summary['resident_bytes'] / GIB:.2f} GiB (stage {summary['stage']})"
    if summary.get("device_bytes"):
        line += f"; device {summary['device_bytes'] / GIB:.2f} GiB"
    return line


__all__ = [
    "GIB",
    "Peak",
    "high_water_bytes",
    "machine_memory_bytes",
    "peak_memory_line",
    "release_free_memory",
    "resident_bytes",
    "stage_peaks",
    "tracking_peak",
]
