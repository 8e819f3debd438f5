"""What every recipe shares, written once: the save step (staging folder, reload check, report, atomic move),
which :func:`headkit.recipes.steps.run_recipe` ends with, and what makes a recipe correct when ``torchrun`` or
``accelerate launch`` starts it in several processes.

Under a launcher every process runs the whole recipe: the same checks, the same seeded data and the same
measurements (evaluation is replicated, not sharded: every rank measures the same held-out windows and gets the
same figures, so that the report needs no reduction), while training runs data-parallel through 🤗 ``Trainer``.
Only the main process prints, and only it writes: it builds the staging folder, reloads the result, writes the
report and moves the folder into place, while the others wait. What it returns, or the error it met, is broadcast,
so every process ends with the same report or the same one-line error and exit status — never a second writer
racing for the folder, never a rank left waiting in a barrier.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.files import staged_folder, write_json_atomic

T = TypeVar("T")
REPORT_FILE = "report.json"
# An input every model of any vocabulary can embed (ids below 100), for the reload check.
RELOAD_CHECK_IDS = torch.arange(1, 17)[None] % 100


class ReplicatedError(HeadkitError):
    """An error the main process met in work done for every process, raised again on the others: the main process
    has said it already, so they exit with its status without printing it a second time."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _process_state() -> Any | None:
    """accelerate's state of this process when a launcher started several of them (or a process group exists),
    else None: a single process never initialises a process group for nothing."""
    import torch.distributed as dist

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not launched and not (dist.is_available() and dist.is_initialized()):
        return None
    from accelerate import PartialState

    # The device choice train_loop gives Trainer (the CPU without CUDA): accelerate's state is one per process,
    # and without cpu=True it does not see the processes of a CPU-only launch.
    return PartialState(cpu=not torch.cuda.is_available())


def is_main_process() -> bool:
    """True in a single process, and in the main process (rank 0) of a distributed run.

    :func:`~headkit.recipes.loop.process_rank_and_count` answers without creating the process group (the launcher's
    ``RANK`` until it exists): creating it this early would change how transformers loads the weights (with FSDP's
    ``cpu_ram_efficient_loading`` only the main process would get them), while every process of a recipe converts
    its own full copy of the model."""
    # Imported here: recipes.loop imports Trainer, and this runs first in every command.
    from headkit.recipes.loop import process_rank_and_count

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


@torch.no_grad()
def reload_difference(folder: Path, model: nn.Module, *, stock: bool = False) -> float:
    """Max |Δ| of the outputs (logits, or an encoder's last hidden state) of `model` and its copy saved in
    `folder`, reloaded the way a user would: plain transformers for a stock causal LM (`stock`),
    :func:`headkit.from_pretrained` otherwise."""
    from headkit.surgery.io import from_pretrained

    if stock:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=model.dtype)
    else:
        reloaded = from_pretrained(folder)
    first, second = model(input_ids=RELOAD_CHECK_IDS), reloaded.eval()(input_ids=RELOAD_CHECK_IDS)
    name = "logits" if getattr(first, "logits", None) is not None else "last_hidden_state"
    return float((getattr(first, name) - getattr(second, name)).abs().max())


def save_result(
    out: str | Path,
    model: nn.Module,
    tokenizer: Any,
    report: dict[str, Any],
    *,
    started: float,
    stock: bool = False,
    extras: Iterable[Callable[[Path, dict[str, Any]], None]] = (),
) -> dict[str, Any]:
    """The save step of every recipe, on the main process only (:func:`on_main_process`): the model and its
    tokenizer into a staging folder beside `out`, ``reload_max_abs_diff`` (:func:`reload_difference`), each of
    `extras` (``extra(staging, report)``: a plot, a GGUF export — inside the staging, so a failure leaves no
    folder), ``seconds`` since `started`, ``report.json``; then the staging folder becomes `out` atomically. The
    report, completed, is returned on every process (and `report` updated in place)."""

    def write() -> dict[str, Any]:
        save_started = time.perf_counter()
        with staged_folder(out) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            report["reload_max_abs_diff"] = reload_difference(staging, model, stock=stock)
            for extra in extras:
                extra(staging, report)
            if "stage_seconds" in report:
                report["stage_seconds"]["save"] = time.perf_counter() - save_started
            report["seconds"] = time.perf_counter() - started
            write_json_atomic(staging / REPORT_FILE, report)
        return report

    report.update(on_main_process(write))
    return report
