"""Timing and peak-memory utilities: a fake clock for timing, known allocation patterns for memory."""

from __future__ import annotations

import os
import time

import pytest
import torch

from headkit.bench._measure import (
    cpu_peak_extra_bytes,
    measure_peak_memory,
    peak_of_running_total,
    tensor_bytes,
)
from headkit.evaluation.timing import MAX_CALLS_PER_REPEAT, read_bandwidth, time_call

MB = 1_000_000


class FakeClock:
    """A clock that only moves when a fake call says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scripted_calls(clock: FakeClock, durations: list[float]):
    """fn() whose n-th call advances the clock by durations[n]; records how many calls happened."""
    calls = []

    def fn() -> None:
        clock.now += durations[len(calls)]
        calls.append(None)

    return fn, calls


# --- timing --------------------------------------------------------------------------------------------------


def test_time_call_reports_the_median_of_the_timed_calls_and_skips_the_warmup():
    clock = FakeClock()
    # The warm-up call is very slow (first-call initialisation); it must not reach the statistics.
    fn, calls = scripted_calls(clock, [100.0, 3.0, 1.0, 2.0, 50.0])
    timing = time_call(fn, repeats=4, warmup=1, clock=clock)
    assert len(calls) == 5
    assert timing.times_s == pytest.approx((3.0, 1.0, 2.0, 50.0))
    assert timing.median_s == pytest.approx(2.5)
    assert timing.calls_per_repeat == 1


@pytest.mark.parametrize("warmup", [0, 2])
def test_time_call_loops_fast_calls_until_a_repeat_lasts_min_repeat_s(warmup):
    clock = FakeClock()
    fn, calls = scripted_calls(clock, [0.01] * 100)
    timing = time_call(fn, repeats=3, warmup=warmup, min_repeat_s=0.05, clock=clock)
    assert timing.calls_per_repeat == 5
    assert timing.median_s == pytest.approx(0.01)
    # Calibration reuses the last warm-up call, or costs one extra call when there is none.
    assert len(calls) == max(warmup, 1) + 3 * 5


def test_time_call_caps_the_loop_for_calls_too_fast_to_measure():
    clock = FakeClock()
    fn, calls = scripted_calls(clock, [0.0] * (1 + 2 * MAX_CALLS_PER_REPEAT))
    timing = time_call(fn, repeats=2, warmup=1, min_repeat_s=1.0, clock=clock)
    assert timing.calls_per_repeat == MAX_CALLS_PER_REPEAT
    assert len(calls) == 1 + 2 * MAX_CALLS_PER_REPEAT


def test_time_call_with_the_real_clock_measures_at_least_the_sleep():
    timing = time_call(lambda: time.sleep(0.02), repeats=3, warmup=0)
    assert len(timing.times_s) == 3
    assert 0.02 <= timing.median_s < 1.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"repeats": 0}, "repeats"),
        ({"repeats": 2.5}, "repeats"),
        ({"repeats": 1, "warmup": -1}, "warmup"),
        ({"repeats": 1, "min_repeat_s": -0.1}, "min_repeat_s"),
        ({"repeats": 1, "min_repeat_s": float("nan")}, "min_repeat_s"),
    ],
)
def test_time_call_rejects_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        time_call(lambda: None, **kwargs)


# --- peak memory ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("deltas", "expected"),
    [
        ([], 0),
        ([10, -10, 4], 10),  # the freed block no longer counts, the smaller one never beats it
        ([10, 4, -14], 14),  # both alive at once
        ([4, 6, -6, 5], 10),
        ([-8, 3], 0),  # freeing memory from before the window: nothing was held above the start
        ([-8, 3, 9], 4),
    ],
)
def test_peak_of_running_total(deltas, expected):
    assert peak_of_running_total(deltas) == expected


def test_cpu_peak_of_allocate_free_allocate_is_the_larger_block():
    def pattern() -> None:
        big = torch.empty(10 * MB, dtype=torch.uint8)
        del big
        small = torch.empty(4 * MB, dtype=torch.uint8)
        del small

    assert cpu_peak_extra_bytes(pattern) == pytest.approx(10 * MB, rel=0.01)


def test_cpu_peak_of_two_live_blocks_is_their_sum():
    def pattern() -> None:
        big = torch.empty(10 * MB, dtype=torch.uint8)
        small = torch.empty(4 * MB, dtype=torch.uint8)
        del big, small

    assert cpu_peak_extra_bytes(pattern) == pytest.approx(14 * MB, rel=0.01)


@pytest.mark.parametrize(("m", "k", "n"), [(512, 256, 1024), (300, 64, 700)])
def test_cpu_peak_of_a_matmul_is_its_output(m, k, n):
    a, b = torch.randn(m, k), torch.randn(k, n)
    output_bytes = m * n * a.element_size()
    assert cpu_peak_extra_bytes(lambda: a @ b) == pytest.approx(output_bytes, rel=0.05)


def test_cpu_peak_of_a_backward_holds_output_and_gradient():
    x = torch.randn(MB // 4, requires_grad=True)  # 1 MB of fp32
    cotangent = torch.randn(MB // 4)

    def forward_backward() -> None:
        # exp keeps its output for the backward; the gradient x.exp() * cotangent is one more block.
        torch.autograd.grad(x.exp(), [x], grad_outputs=cotangent)

    assert cpu_peak_extra_bytes(forward_backward) == pytest.approx(2 * MB, rel=0.01)


def test_measure_peak_memory_adds_the_inputs_once_per_storage():
    a = torch.empty(4 * MB, dtype=torch.uint8)
    b = torch.empty(1 * MB, dtype=torch.uint8)
    view = a[: MB // 2]
    memory = measure_peak_memory(lambda: torch.empty(2 * MB, dtype=torch.uint8), inputs=[a, view, b])
    assert memory.input_bytes == 5 * MB
    assert memory.extra_peak_bytes == pytest.approx(2 * MB, rel=0.01)
    assert memory.peak_bytes == memory.input_bytes + memory.extra_peak_bytes


def test_tensor_bytes_counts_shared_storage_once():
    base = torch.zeros(10, 20)
    assert tensor_bytes([base, base.t(), base[3:5], torch.zeros(7, dtype=torch.float64)]) == 800 + 56


def test_measure_peak_memory_rejects_other_devices():
    with pytest.raises(ValueError, match="device"):
        measure_peak_memory(lambda: None, inputs=[], device="meta")


def test_profiler_chatter_is_hidden_and_stderr_is_restored(capfd):
    cpu_peak_extra_bytes(lambda: torch.empty(1000))
    os.write(2, b"still here\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert "still here" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_of_allocate_free_allocate_is_the_larger_block():
    def pattern() -> None:
        big = torch.empty(10 * MB, dtype=torch.uint8, device="cuda")
        del big
        small = torch.empty(4 * MB, dtype=torch.uint8, device="cuda")
        del small

    memory = measure_peak_memory(pattern, inputs=[], device="cuda")
    assert memory.extra_peak_bytes == pytest.approx(10 * MB, rel=0.01)


def test_thread_limit_sets_and_restores_torch_threads():
    from headkit.evaluation.timing import thread_limit

    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    with thread_limit(wanted):
        assert torch.get_num_threads() == wanted
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), thread_limit(wanted):
        raise RuntimeError("the block fails")
    assert torch.get_num_threads() == before
    with thread_limit(None):
        assert torch.get_num_threads() == before


def test_interleaved_times_warm_up_once_then_alternate_the_order_every_round():
    from headkit.evaluation.timing import interleaved_times

    order: list[str] = []
    times = interleaved_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=3)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then a-first, b-first, a-first
    assert {name: len(seconds) for name, seconds in times.items()} == {"a": 3, "b": 3}
    assert all(second >= 0 for seconds in times.values() for second in seconds)


def test_read_bandwidth_is_the_bytes_summed_over_the_median_time(monkeypatch):
    import headkit.evaluation.timing as timing

    times = iter([0.5, 0.25, 1.0])
    monkeypatch.setattr(timing, "timed_call", lambda fn, device: (fn(), next(times)))
    assert read_bandwidth(megabytes=4, repeats=3) == 4 * 2**20 / 0.5
    monkeypatch.undo()
    assert 0 < read_bandwidth(megabytes=1, repeats=1) < float("inf")  # the real clock


@pytest.mark.parametrize(("kwargs", "name"), [({"megabytes": 0}, "megabytes"), ({"repeats": 0}, "repeats")])
def test_read_bandwidth_rejects_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        read_bandwidth(**kwargs)
