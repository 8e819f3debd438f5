"""The peak resident memory of a stretch of work: what it allocated counted, stretches nested, the report's summary
and the line a command ends with."""

from __future__ import annotations

import sys

import pytest
import torch

from headkit.runs.resident import GIB, Peak, peak_memory_line, resident_bytes, stage_peaks, tracking_peak

LINUX = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the high-water mark is reset on Linux"
)
SIZE = 256 * 1024**2


def _allocate() -> None:
    block = torch.ones(SIZE // 4)  # touched, so resident
    del block


@LINUX
def test_a_stretch_sees_what_it_allocated_and_the_next_one_does_not():
    with tracking_peak() as first:
        _allocate()
    with tracking_peak() as second:
        pass
    assert first.resident >= resident_bytes() + SIZE * 0.9 > second.resident


@LINUX
def test_an_outer_stretch_keeps_the_peak_an_inner_one_reset():
    with tracking_peak() as outer:
        _allocate()  # before the inner stretch resets the mark
        with tracking_peak() as inner:
            pass
    assert outer.resident >= inner.resident + SIZE * 0.9


def test_the_summary_names_the_stage_that_reached_the_peak():
    summary = stage_peaks({"load": Peak(2 * GIB), "convert": Peak(3 * GIB), "save": Peak(GIB)})
    assert summary == {
        "resident_bytes": 3 * GIB,
        "stage": "convert",
        "stages": {"load": 2 * GIB, "convert": 3 * GIB, "save": GIB},
        "device_bytes": None,
    }
    assert peak_memory_line({"peak_memory": summary}) == "peak resident memory 3.00 GiB (stage convert)"
    assert peak_memory_line({}) is None and stage_peaks({}) == {}
    with_device = stage_peaks({"convert": Peak(GIB, GIB // 2)})
    assert peak_memory_line({"peak_memory": with_device}).endswith("; device 0.50 GiB")


@LINUX
def test_a_stage_does_not_count_what_an_earlier_one_freed_into_the_heap():
    """Small tensors freed stay in glibc's heap, resident, until malloc_trim gives them back: the next stretch
    starts without them."""
    from headkit.runs.resident import release_free_memory

    pieces = [torch.ones(1 << 14) for _ in range(SIZE // (1 << 16))]  # 64 KiB each: the heap, not mmap
    held = resident_bytes()
    del pieces
    with tracking_peak() as after:
        pass
    if not release_free_memory():
        pytest.skip("not glibc: no malloc_trim")
    assert after.resident < held - SIZE * 0.5
