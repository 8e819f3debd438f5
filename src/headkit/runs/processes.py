"""One run in several processes: what makes a command correct when ``torchrun`` or ``accelerate launch`` starts it
in several processes.

Under a launcher every process runs the whole command: the same checks, the same seeded data and the same
measurements (evaluation is replicated, not sharded: every rank measures the same held-out windows and gets the
same figures, so that the report needs no reduction), while training runs data-parallel through 🤗 ``Trainer``.
Only the main process prints (:func:`main_process_echo`), and only it writes (:func:`on_main_process`: the save
step of :mod:`headkit.recipes.skeleton`, a benchmark's report, an lm-evaluation-harness run), while the others
wait. What it returns, or the error it met, is broadcast, so every process ends with the same report or the same
one-line error and exit status (:class:`ReplicatedError`) — never a second writer racing for a folder, never a
rank left waiting in a barrier. That only the main process writes can be observed: with ``HEADKIT_WRITE_LOG``
naming a folder, each process lists there every path headkit's writers create or move into place
(:func:`headkit.files.record_write`; nothing is recorded when it is unset).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from headkit.errors import HeadkitError

T = TypeVar("T")


class ReplicatedError(HeadkitError):
    """An error the main process met in work done for every process, raised again on the others: the main process
    has said it already, so they exit with its status without printing it a second time."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def process_rank_and_count() -> tuple[int, int]:
    """(this process's rank, the number of processes) of a distributed run — initialised, or launched by
    ``torchrun`` / ``accelerate launch`` and about to be — else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _process_state() -> Any | None:
    """accelerate's state of this process when a launcher started several of them (or a process group exists),
    else None: a single process never initialises a process group for nothing."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not launched and not (dist.is_available() and dist.is_initialized()):
        return None
    from accelerate import PartialState

    # The device choice train_loop gives Trainer (the CPU without CUDA): accelerate's state is one per process,
    # and without cpu=True it does not see the processes of a CPU-only launch.
    return PartialState(cpu=not torch.cuda.is_available())


def is_main_process() -> bool:
    """True in a single process, and in the main process (rank 0) of a distributed run.

    :func:`process_rank_and_count` answers without creating the process group (the launcher's ``RANK`` until it
    exists): creating it this early would change how transformers loads the weights (with FSDP's
    ``cpu_ram_efficient_loading`` only the main process would get them), while every process of a recipe converts
    its own full copy of the model."""
    rank, _ = process_rank_and_count()
    return rank == 0


def main_process_echo(echo: Callable[[str], None]) -> Callable[[str], None]:
    """`echo` on the main process, a no-op on the others: a report line is printed once, not once per rank."""
    return echo if is_main_process() else (lambda text: None)


def on_main_process(work: Callable[[], T]) -> T:
    """``work()`` on the main process while the others wait; its result is returned on every process (it must be
    picklable), and an error it raises is raised on every process: the original on the main one, a
    :class:`ReplicatedError` with the same message and exit status (2 for a user error, 1 otherwise) on the
    others."""
    state = _process_state()
    if state is None or state.num_processes == 1:
        return work()
    from accelerate.utils import broadcast_object_list

    outcome: list[Any] = [None]
    failure: BaseException | None = None
    if state.is_main_process:
        try:
            outcome = [("done", work())]
        except BaseException as exc:  # broadcast first, so no rank waits for a result that never comes
            failure = exc
            user_error = isinstance(exc, (ValueError, FileNotFoundError, NotADirectoryError))
            outcome = [
                ("failed", f"{exc}" if user_error else f"{type(exc).__name__}: {exc}", 2 if user_error else 1)
            ]
    broadcast_object_list(outcome, from_process=0)
    if failure is not None:
        raise failure
    if outcome[0][0] == "failed":
        raise ReplicatedError(outcome[0][1], outcome[0][2])
    return outcome[0][1]
