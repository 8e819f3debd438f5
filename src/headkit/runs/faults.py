"""A test hook: kill this process at a named point of a run, the way a machine's crash or the out-of-memory
killer would, so that the tests of ``--resume`` interrupt a real process at a known moment.

``HEADKIT_FAULT_AT=<point>`` (unset in every ordinary run: one look-up in the environment, nothing else) makes
:func:`fault_point` send this process SIGKILL when it reaches ``<point>``: a stage's name (``convert``,
``repair``, ``recover``, ``measure``, …: its work done, before the work folder records it), ``<stage>:<step>``
(a training in that stage, once optimizer step ``<step>`` is done: between checkpoints unless a checkpoint
falls on it), or ``save`` (the result written in its staging folder, before the folder becomes ``--out``).
``HEADKIT_FAULT_SIGNAL`` names another signal to send (``SIGINT``, ``SIGTERM``: Ctrl-C, a scheduler's stop).
Not an option and not for users: nothing is cleaned up, which is the point.
"""

from __future__ import annotations

import os
import signal

FAULT_ENVIRONMENT = "HEADKIT_FAULT_AT"
SIGNAL_ENVIRONMENT = "HEADKIT_FAULT_SIGNAL"


def fault_point(point: str) -> None:
    """Send this process ``$HEADKIT_FAULT_SIGNAL`` (SIGKILL by default) when ``$HEADKIT_FAULT_AT`` is `point`."""
    if os.environ.get(FAULT_ENVIRONMENT) != point:
        return
    # raise() signals this thread and runs Python's handler before returning: os.kill to the process could reach
    # another thread, and the main thread then meet the KeyboardInterrupt at a random point (inside a finalizer,
    # where it is swallowed: a flaky test under load).
    signal.raise_signal(getattr(signal, os.environ.get(SIGNAL_ENVIRONMENT, "SIGKILL")))
