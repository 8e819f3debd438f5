"""The one skeleton of prune, linearize and compress (:func:`run_recipe`), written once: the settings checked
against MODEL's 🤗 config (a folder's config.json or a GGUF file's metadata) before any weight or text is read (the
recipe's ``preflight``), then ``load`` → ``check`` → ``data`` → ``convert`` → ``repair`` → ``recover`` →
``measure`` (each recipe's :class:`Steps`), the report, and the save step
(:func:`headkit.recipes.skeleton.save_result`). Each stage's seconds are in the report (``stage_seconds``), and
its peak resident memory (``peak_memory``: the run's peak, the stage that reached it, every stage's;
:mod:`headkit.runs.resident`);
``repair`` is the fix between the surgery and any training through the model (prune's closed-form refit,
compress's layer-local reconstruction), a no-op (the report's ``"repair": null``) where a surgery has none.

A run that saves keeps each finished stage in its work folder beside ``--out`` and, with ``--resume``, skips the
stages an interrupted run finished and resumes its training from the newest checkpoint (:mod:`headkit.recipes.work`;
the report's ``resumed``); SIGINT / SIGTERM leave the folder resumable and exit with 130 / 143.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.evaluation.tasks import recipe_tasks
from headkit.recipes.settings import check_before_loading, with_overrides
from headkit.recipes.skeleton import save_result
from headkit.recipes.work import RunWork, interruptible
from headkit.runs.faults import fault_point
from headkit.runs.interrupts import raise_if_interrupted
from headkit.runs.models import (
    LoadedModel,
    load_model,
    release_weights,
    share_unchanged_weights,
    unshare_weights,
)
from headkit.runs.processes import ReplicatedError, main_process_echo
from headkit.runs.resident import Peak, stage_peaks, tracking_peak

T = TypeVar("T")
STAGES = ("load", "check", "data", "convert", "repair", "recover", "measure")


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
        """The fix of the student before any training through the model, and what it did (the report's
        ``repair``); None where the surgery has none (or it is switched off)."""
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
    model. For :func:`run_settings`, also its settings class, ``check`` (the settings' own validation) and
    ``default_model``, the MODEL path when ``settings.model`` is None."""

    preflight: Callable[[Any, Path, Any | None, Path | None], None]
    steps: Callable[[Any, Path, LoadedModel, Callable[[str], None]], Steps]
    settings_class: type | None = None
    check: Callable[[Any], None] | None = None
    default_model: Callable[[], Path] | None = None


def run_settings(
    recipe: Recipe,
    settings: Any,
    overrides: dict[str, Any],
    echo: Callable[[str], None],
    *,
    loaded: LoadedModel | None = None,
    save: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """A recipe's entry point, written once: ``settings`` (``recipe.settings_class``'s defaults when None) with
    ``overrides``, checked by ``recipe.check``, run by :func:`run_recipe` on ``settings.model`` (or
    ``recipe.default_model()``), saved to ``settings.out`` when `save`; returns (the result's model, the report)."""
    started = time.perf_counter()
    settings = with_overrides(recipe.settings_class, settings, overrides, recipe.check)
    model_path = Path(settings.model) if settings.model is not None else recipe.default_model()
    out = Path(settings.out) if save else None
    steps, report = run_recipe(recipe, settings, model_path, echo, loaded=loaded, out=out, started=started)
    return steps.student, report


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
    estimate = check_before_loading(recipe.preflight, settings, model_path, out)
    work = None if out is None else RunWork.open(settings, model_path, out, echo)
    with interruptible(work) if work is not None else contextlib.nullcontext():
        return _run_stages(recipe, settings, model_path, echo, loaded, out, started, work, estimate)


def _run_stages(
    recipe: Recipe,
    settings: Any,
    model_path: Path,
    echo: Callable[[str], None],
    loaded: LoadedModel | None,
    out: Path | None,
    started: float,
    work: RunWork | None,
    estimate: Any = None,
) -> tuple[Steps, dict[str, Any]]:
    seconds: dict[str, float] = {}
    peaks: dict[str, Peak] = {}

    def peak_memory() -> dict[str, Any]:
        # the preflight's estimate beside what was measured (headkit.recipes.memory)
        summary = stage_peaks(peaks)
        if summary and hasattr(estimate, "to_dict"):
            summary["estimate"] = estimate.to_dict()
        return summary

    def timed(stage: str, work: Callable[[], T]) -> T:
        stage_started = time.perf_counter()
        with tracking_peak() as peaks[stage]:
            result = work()
        seconds[stage] = time.perf_counter() - stage_started
        return result

    torch.manual_seed(settings.seed)
    owns_teacher = (
        loaded is None
    )  # a model the caller loaded is theirs: never shares a tensor with the result
    loaded = timed("load", lambda: loaded or load_model(model_path, dtype=settings.dtype))
    steps = timed("check", lambda: _checked_steps(recipe, settings, model_path, loaded, echo))
    stages = STAGES[2:] + (("tasks",) if settings.eval_tasks else ())
    done, kept = work.restore(steps, stages) if work is not None else (None, {})
    # The stages taken from the work folder keep the seconds and peaks they took the first time.
    seconds |= {k: v for k, v in kept.get("seconds", {}).items() if k not in seconds}
    peaks |= {k: v for k, v in kept.get("peaks", {}).items() if k not in peaks}
    for stage in stages[stages.index(done) + 1 :] if done is not None else stages:
        if stage == "measure" and owns_teacher and steps.student is not None:
            # Nothing trains from here on: what the conversion left unchanged is held once for both models
            # through the measurement and the save.
            share_unchanged_weights(steps.student, steps.teacher)
        try:
            with work.stage(stage) if work is not None else contextlib.nullcontext():
                outcome = timed(stage, lambda stage=stage: _run_stage(steps, stage, settings, echo))
            if stage == "repair":
                steps.report["repair"] = outcome
            elif stage == "tasks":
                steps.report["tasks"] = outcome
            fault_point(stage)
            raise_if_interrupted()  # never recorded as done: a Ctrl-C swallowed inside the stage stops it
            if work is not None:
                # Writing the snapshot is the stage's too: its memory counts in the stage's peak.
                with tracking_peak() as snapshot:
                    work.persist(stage, steps, {"seconds": dict(seconds), "peaks": dict(peaks)})
                peaks[stage].fold(snapshot)
        except OSError as exc:
            if work is None or not work.holds(exc.filename):
                raise
            # A checkpoint or snapshot the disk refused: what is kept so far stays resumable.
            raise HeadkitError(
                f"cannot write {exc.filename}: {exc.strerror or exc}; the finished stages are kept in "
                f"{work.folder}: free some space and add --resume"
            ) from exc
    if not owns_teacher and steps.student is not None:
        # The caller's model and the result share no tensor (a conversion held them once while it ran).
        unshare_weights(steps.student, steps.teacher)
    report = steps.report
    report["model"] = str(model_path)
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()}
    report["stage_seconds"] = seconds
    report["peak_memory"] = peak_memory()
    if out is None:
        report["seconds"] = time.perf_counter() - started
        return steps, report
    if owns_teacher and steps.student is not None:
        # Nothing reads the original after the measurement: its own weights go before the save step loads the
        # result a second time (the reload check).
        release_weights(steps.teacher, steps.student)
    report["out"] = str(out)
    report["resumed"] = work.resumed if work is not None else []
    report["resumed_checkpoints"] = work.checkpoints if work is not None else []
    try:
        with tracking_peak() as peaks["save"]:
            save_result(
                out,
                steps.student,
                steps.tokenizer,
                report,
                started=started,
                stock=steps.stock,
                extras=steps.extras(),
                peaks=peaks,
            )
    except HeadkitError as exc:
        # Another process's copy of the main one's error (already printed with the hint) goes as it is.
        if work is None or isinstance(exc, ReplicatedError) or not work.resumable():
            raise
        raise HeadkitError(
            f"{exc}; the finished stages are kept in {work.folder}: fix it and add --resume"
        ) from exc
    if work is not None:
        work.finish()
    report["peak_memory"] = peak_memory()
    return steps, report


def _run_stage(steps: Steps, stage: str, settings: Any, echo: Callable[[str], None]) -> Any:
    if stage == "tasks":
        return recipe_tasks(settings, steps.teacher, steps.student, steps.tokenizer, steps.result_name, echo)
    return getattr(steps, stage)()


def _checked_steps(
    recipe: Recipe, settings: Any, model_path: Path, loaded: LoadedModel, echo: Callable[[str], None]
) -> Steps:
    steps = recipe.steps(settings, model_path, loaded, echo)
    steps.check()
    return steps
