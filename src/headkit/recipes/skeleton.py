"""What every recipe shares, written once: the driver that runs a recipe's steps in order, the save step (staging
folder, reload check, report, atomic move) and what makes a recipe correct when ``torchrun`` or ``accelerate
launch`` starts it in several processes.

:func:`run_recipe` is the one skeleton of prune, linearize and compress: the settings are checked against MODEL's
🤗 config (a folder's config.json or a GGUF file's metadata) before any weight or text is read (the recipe's
``preflight``), then ``load`` → ``check`` → ``data`` → ``convert`` → ``repair`` → ``recover`` → ``measure`` (each
recipe's :class:`Steps`), the report, and the save step. Each stage's seconds are in the report
(``stage_seconds``); ``repair`` is the closed-form fix between the surgery and any training, a no-op (the report's
``"repair": null``) where a surgery has none yet.

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
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.evaluation.tasks import recipe_tasks
from headkit.files import staged_folder, write_json_atomic
from headkit.recipes.models import LoadedModel, check_output_folder, load_model, read_model_config

T = TypeVar("T")
REPORT_FILE = "report.json"
STAGES = ("load", "check", "data", "convert", "repair", "recover", "measure")
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


class Steps(ABC):
    """A recipe's steps on one loaded model, which :func:`run_recipe` calls in the order of :data:`STAGES`. Each
    records its figures in :attr:`report` as it goes; ``convert`` sets :attr:`student`, which the later steps
    change in place or replace."""

    #: The result's name in the task table ("pruned", "linearized", "compressed").
    result_name: str = "result"

    def __init__(
        self, settings: Any, model_path: Path, loaded: LoadedModel, echo: Callable[[str], None]
    ) -> None:
        self.settings, self.model_path, self.loaded, self.echo = settings, model_path, loaded, echo
        self.teacher, self.tokenizer = loaded.model, loaded.tokenizer
        self.student: nn.Module | None = None
        self.report: dict[str, Any] = {}

    @abstractmethod
    def check(self) -> None:
        """Everything that can refuse the run against the loaded model (the surgery config's ``check``), before
        any text is read or any weight changed."""

    @abstractmethod
    def data(self) -> None:
        """Read the text: training and held-out windows or texts, and the original's figures on them."""

    @abstractmethod
    def convert(self) -> None:
        """The surgery, on a copy of the original: :attr:`student`."""

    def repair(self) -> dict[str, Any] | None:
        """The closed-form fix of the student before any training, and what it did (the report's ``repair``);
        None where the surgery has none (or it is switched off)."""
        return None

    @abstractmethod
    def recover(self) -> None:
        """Train the student back towards the original."""

    @abstractmethod
    def measure(self) -> None:
        """The result's figures against the original's."""

    @property
    def stock(self) -> bool:
        """Whether the result reloads in plain transformers (how the save step's reload check loads it)."""
        return False

    def extras(self) -> list[Callable[[Path, dict[str, Any]], None]]:
        """What the save step writes beside the model (:func:`save_result`'s `extras`)."""
        return []


@dataclass(frozen=True)
class Recipe:
    """What a recipe supplies the skeleton: ``preflight(settings, model_path, config, out)``, its settings checked
    against MODEL's 🤗 config (None where none could be read: the loaded model is checked instead) and, when it
    saves, against `out`; and ``steps(settings, model_path, loaded, echo)``, the :class:`Steps` that fit the loaded
    model."""

    preflight: Callable[[Any, Path, Any | None, Path | None], None]
    steps: Callable[[Any, Path, LoadedModel, Callable[[str], None]], Steps]


def run_recipe(
    recipe: Recipe,
    settings: Any,
    model_path: Path,
    echo: Callable[[str], None],
    *,
    loaded: LoadedModel | None = None,
    out: Path | None = None,
    started: float | None = None,
) -> tuple[Steps, dict[str, Any]]:
    """Run `recipe` on MODEL (`model_path`; `loaded`: already loaded from it, left unchanged) and return its steps
    (the result is ``steps.student``) and the report; with `out`, save the result there (:func:`save_result`),
    refused before any work where it would overwrite the model or, without ``settings.overwrite``, a result.

    Every check that MODEL's 🤗 config can answer runs first, so a refused setting costs one line and no weight or
    text read; then the stages, each timed, with the global RNG seeded once before loading (every recipe's figures
    depend on what consumes it, in this order)."""
    started = time.perf_counter() if started is None else started
    echo = main_process_echo(echo)
    if out is not None:
        check_output_folder(model_path, out, settings.overwrite)
    recipe.preflight(settings, model_path, read_model_config(model_path), out)
    seconds: dict[str, float] = {}

    def timed(stage: str, work: Callable[[], T]) -> T:
        stage_started = time.perf_counter()
        result = work()
        seconds[stage] = time.perf_counter() - stage_started
        return result

    torch.manual_seed(settings.seed)
    loaded = timed("load", lambda: loaded or load_model(model_path, dtype=settings.dtype))
    steps = timed("check", lambda: _checked_steps(recipe, settings, model_path, loaded, echo))
    for stage in STAGES[2:]:
        outcome = timed(stage, getattr(steps, stage))
        if stage == "repair":
            steps.report["repair"] = outcome
    report = steps.report
    if settings.eval_tasks:
        report["tasks"] = timed(
            "tasks",
            lambda: recipe_tasks(
                settings, steps.teacher, steps.student, steps.tokenizer, steps.result_name, echo
            ),
        )
    report["model"] = str(model_path)
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()}
    report["stage_seconds"] = seconds
    if out is None:
        report["seconds"] = time.perf_counter() - started
        return steps, report
    report["out"] = str(out)
    save_result(
        out, steps.student, steps.tokenizer, report, started=started, stock=steps.stock, extras=steps.extras()
    )
    return steps, report


def _checked_steps(
    recipe: Recipe, settings: Any, model_path: Path, loaded: LoadedModel, echo: Callable[[str], None]
) -> Steps:
    steps = recipe.steps(settings, model_path, loaded, echo)
    steps.check()
    return steps
