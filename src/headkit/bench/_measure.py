"""Peak memory of one call and the machine's matmul rate, for the benchmarks (the method: docs/kernels.md,
``bench speed``); calls are timed by :func:`headkit.evaluation.timing.time_call`, the evaluator's one timer.

Peak memory is what a call allocates above what was allocated at the start, plus the call's inputs:
``torch.cuda.max_memory_allocated`` on CUDA, the running sum of the CPU allocator's ``[memory]`` profiler events
on CPU, so that numbers from both devices mean the same thing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType

from headkit.evaluation.timing import synchronize, time_call

# The kineto event name under which the profiler records allocator activity (torch/autograd/profiler_util.py).
MEMORY_EVENT_NAME = "[memory]"
# Memory that the CPU allocator hands out; torch.autograd.profiler counts the same device types as CPU memory.
_CPU_MEMORY_DEVICE_TYPES = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)


@dataclass(frozen=True)
class PeakMemory:
    """Peak memory of one call in bytes: the inputs alive when it starts plus the most it allocated on top."""

    peak_bytes: int
    input_bytes: int
    extra_peak_bytes: int


def matmul_rate(size: int, device: torch.device | str = "cpu", **timing: Any) -> float:
    """The machine's fp32 matmul rate, FLOP/s: 2·size³ over the median time of a [size, size] @ [size, size]
    matmul into a preallocated output, timed by :func:`time_call` with ``timing`` (repeats, warm-up…)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator, device=device) for _ in range(2))
    out = torch.empty(size, size, device=device)
    return 2 * size**3 / time_call(lambda: torch.mm(a, b, out=out), device=device, **timing).median_s


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once (views share their base's)."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def peak_of_running_total(deltas: Iterable[int]) -> int:
    """Highest value of the running sum of allocation deltas (+alloc, −free) from 0, never below 0 (a free of
    memory allocated before the window drives the sum negative; the peak is still above the start)."""
    return max(itertools.accumulate(deltas, initial=0))


def cpu_peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Most CPU memory that ``fn()`` holds at once beyond what was allocated when it started, in bytes: its
    ``[memory]`` profiler events replayed in chronological order."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        profiler.start()
    try:
        fn()
    finally:
        with _quiet_native_stderr():
            profiler.stop()
    kineto_results = getattr(profiler.profiler, "kineto_results", None)
    if kineto_results is None:
        raise RuntimeError(
            "torch.profiler returned no kineto results; CPU peak memory needs a torch built with kineto"
        )
    memory_events = [
        event
        for event in kineto_results.events()
        if event.name() == MEMORY_EVENT_NAME and event.device_type() in _CPU_MEMORY_DEVICE_TYPES
    ]
    # Python's sort is stable, so events with equal timestamps keep the order in which they were recorded.
    memory_events.sort(key=lambda event: event.start_ns())
    return peak_of_running_total(event.nbytes() for event in memory_events)


def measure_peak_memory(
    fn: Callable[[], object], *, inputs: Iterable[torch.Tensor], device: torch.device | str = "cpu"
) -> PeakMemory:
    """Peak memory of one call of ``fn()``: the bytes of ``inputs`` plus the most it allocates on top of what
    was allocated when it started (on CUDA, the allocator's peak since a reset)."""
    device, input_bytes = torch.device(device), tensor_bytes(inputs)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_at_start = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        extra = max(0, torch.cuda.max_memory_allocated(device) - allocated_at_start)
    elif device.type == "cpu":
        extra = cpu_peak_extra_bytes(fn)
    else:
        raise ValueError(f"device must be cpu or cuda, got {str(device)!r}")
    return PeakMemory(peak_bytes=input_bytes + extra, input_bytes=input_bytes, extra_peak_bytes=extra)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null for the duration: kineto prints "profiler_start"/"profiler_stop" from
    C++ to it whatever its log level, through a live progress bar. Only the profiler's start and stop are
    wrapped, never the measured call, so no error of the caller's is swallowed."""
    stderr_fd = 2  # kineto writes to the descriptor, whatever Python's sys.stderr points at
    sys.stderr.flush()
    try:
        saved_fd = os.dup(stderr_fd)
    except OSError:  # no stderr descriptor to redirect (e.g. a closed fd 2): nothing to hide
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stderr_fd)
        yield
    finally:
        os.dup2(saved_fd, stderr_fd)
        os.close(saved_fd)
        os.close(devnull)
