"""Ctrl-C and SIGTERM that a swallowed exception cannot lose.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread is when its handler runs: inside a finalizer
(a ``__del__``, a weak reference's callback) the exception is printed as "ignored" and dropped, and the run goes
on as if nothing had happened. :func:`handling_interrupts` records each signal as it raises it; the training loop's
step end and a recipe's stage end call :func:`raise_if_interrupted`, which raises it again where it was lost, so a
run stops at the next step at the latest.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is (as Python raises KeyboardInterrupt for SIGINT)."""


_PENDING: list[int] = []  # the signal received while handled and not yet seen through (at most one)


def _interrupt_for(signum: int) -> BaseException:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _handle(signum: int, frame: Any) -> None:
    if not _PENDING:
        _PENDING.append(signum)
    raise _interrupt_for(signum)


@contextlib.contextmanager
def handling_interrupts() -> Iterator[None]:
    """Within the block, SIGINT raises KeyboardInterrupt and SIGTERM :class:`Terminated`, each recorded for
    :func:`raise_if_interrupted` (in the main thread only: a signal handler can be set nowhere else; elsewhere the
    block changes nothing). The previous handlers are restored after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _handle) for signum in (signal.SIGINT, signal.SIGTERM)}
    _PENDING.clear()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _PENDING.clear()


def interrupted_by(exc: BaseException) -> int:
    """The signal an interruption raised by :func:`handling_interrupts` stands for."""
    return signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT


def raise_if_interrupted() -> None:
    """Raise again the interruption of a signal received in :func:`handling_interrupts` whose exception was
    swallowed before it reached the recipe (nothing when no signal came)."""
    if _PENDING:
        raise _interrupt_for(_PENDING[0])


__all__ = ["Terminated", "handling_interrupts", "interrupted_by", "raise_if_interrupted"]
