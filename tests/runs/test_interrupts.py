"""A Ctrl-C or SIGTERM swallowed on its way (by a finalizer) is raised again at the next check."""

from __future__ import annotations

import gc
import signal
import sys

import pytest

from headkit.runs.interrupts import Terminated, handling_interrupts, interrupted_by, raise_if_interrupted


class _SwallowsInFinalizer:
    """Python drops an exception raised inside ``__del__`` (it reports it to ``sys.unraisablehook``)."""

    def __init__(self, signum):
        self.signum = signum

    def __del__(self):
        signal.raise_signal(self.signum)


@pytest.mark.parametrize(
    ("signum", "raised"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)]
)
def test_a_signal_swallowed_by_a_finalizer_is_raised_again_at_the_next_check(signum, raised, monkeypatch):
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_type))
    before = signal.getsignal(signum)
    with pytest.raises(raised) as caught:
        with handling_interrupts():
            raise_if_interrupted()  # nothing pending yet
            _SwallowsInFinalizer(
                signum
            )  # dropped at once: its __del__ raises, and Python drops the exception
            gc.collect()
            assert swallowed == [raised]
            raise_if_interrupted()
    assert interrupted_by(caught.value) == signum
    assert signal.getsignal(signum) is before  # restored
    raise_if_interrupted()  # and nothing pending outside the block
