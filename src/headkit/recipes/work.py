"""A recipe run that survives being killed: its work folder beside ``--out`` and ``--resume``.

A run that saves (``headkit prune``, ``compress``, ``linearize``) keeps what each stage produced in
``<out>.partial/`` (:func:`work_folder`) until its result is in place:

- ``run.json``: what the run is — the settings (those that change the result: not ``--resume``,
  ``--overwrite``, ``--checkpoint-steps``, nor ``--out``, which the folder's place says), paths resolved; the input's identity (MODEL's and ``--data``'s files: name, size,
  modification time) and their SHA-256, the fingerprint every other file is checked against;
- ``stage-<name>.pt``: the recipe's state after its newest finished stage (``data``, ``convert``, ``repair``,
  ``recover``, ``measure``, ``tasks``): the student whole (its architecture after surgery included), every figure
  measured so far, the report, each stage's seconds and peak memory, and the RNG states (every recipe's figures
  depend on what consumed them, in order). The loaded original is not in it: the snapshot refers to it (and to its
  modules and parameters, which a student may share) by name, and a resumed run loads it again. One snapshot is
  kept, written atomically before the previous one is removed;
- ``<stage>/train-<i>/checkpoint-<step>``: Trainer's checkpoints of the stage's ``i``-th training
  (:func:`headkit.recipes.loop.checkpointing`), every ``--checkpoint-steps`` and at its end, removed once the
  stage's snapshot is written.

``--resume`` skips every stage the snapshot holds and resumes a training from its newest whole checkpoint; the
result equals an uninterrupted run's. Resuming with other settings or another input is refused in one line naming
what differs; with nothing to resume it says so and starts afresh. Without ``--resume`` a leftover work folder is
announced in one line and replaced once this run's first stage is done (until then, a Ctrl-C keeps it). Once the
result is in place the work folder is deleted. Only the main process of a launched run writes it
(:func:`headkit.runs.processes.on_main_process`).

SIGINT (Ctrl-C) and SIGTERM abandon the stage under way (its partial work is never recorded: every file is written
atomically and a checkpoint is sealed last), print one line saying how to resume and exit with 130 / 143
(:func:`interruptible`); ``--out`` is only ever moved into place whole (:func:`headkit.files.staged_folder`).

The snapshot is written by ``torch.save`` (its tensors written from their own memory, not copied first) and holds a
pickle: it is this run's own file, read back only by a run whose settings and input match the
folder's ``run.json`` (and the fingerprint the snapshot carries). Disk: one copy of
the student, plus during a training two checkpoints (the trained weights and twice as many optimizer moments).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headkit.errors import HeadkitError
from headkit.files import write_atomic, write_json_atomic
from headkit.recipes.loop import Checkpointing, checkpointing
from headkit.runs.interrupts import Terminated, handling_interrupts, interrupted_by
from headkit.runs.processes import is_main_process, on_main_process

WORK_SUFFIX = ".partial"
RUN_FILE = "run.json"
SNAPSHOT_SUFFIX = ".pt"
#: Settings that change how a run goes, not what it computes: a resumed run may change them.
UNRECORDED = ("resume", "overwrite", "checkpoint_steps", "out")
#: The attributes of a recipe's steps that come from this process (the loaded original, the settings, the printer),
#: never from a snapshot.
LIVE = ("settings", "model_path", "loaded", "echo", "teacher", "tokenizer")
#: At most this many of a folder input's files are listed in its identity (the rest are counted).
LISTED_FILES = 10_000
INTERRUPTED_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


def work_folder(out: str | os.PathLike[str]) -> Path:
    """The work folder of a run that saves to `out`: ``<out>.partial`` beside it."""
    out = Path(out)
    return out.parent / f"{out.name}{WORK_SUFFIX}"


def settings_record(settings: Any) -> dict[str, Any]:
    """The settings a run's result depends on, as JSON values (paths as text)."""
    values = asdict(settings)
    return {name: _json_value(value) for name, value in sorted(values.items()) if name not in UNRECORDED}


def _json_value(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value.resolve())  # "model" and "./model" are one input
    if isinstance(value, (tuple, list)):
        return [_json_value(item) for item in value]
    return value


def path_identity(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """What identifies an input without reading it whole: a file's resolved path, size and modification time; a
    folder's files' (relative name, size, modification time), summed up by their SHA-256."""
    if path is None:
        return None
    path = Path(path).resolve()
    if path.is_file():
        stat = path.stat()
        return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if not path.is_dir():
        return {"path": str(path), "missing": True}
    digest, count = hashlib.sha256(), 0
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        count += 1
        if count <= LISTED_FILES:
            stat = file.stat()
            digest.update(f"{file.relative_to(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"path": str(path), "files": count, "sha256": digest.hexdigest()}


def run_record(settings: Any, model_path: Path) -> dict[str, Any]:
    """``run.json``: the recipe (its settings' class), the settings, the input, and their fingerprint."""
    record = {
        "recipe": type(settings).__name__,
        "settings": settings_record(settings),
        "input": {"model": path_identity(model_path), "data": path_identity(getattr(settings, "data", None))},
    }
    text = json.dumps(record, sort_keys=True, allow_nan=False)
    return record | {"fingerprint": hashlib.sha256(text.encode()).hexdigest()}


def _remove_stale_staging(out: Path) -> None:
    """The staging folders of an earlier save to `out` that a SIGKILL left (headkit.files.staged_folder names
    them ``.<out>.<random>.tmp``; it removes its own on any error it lives through)."""
    for stale in out.parent.glob(f".{out.name}.*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _differences(stored: dict[str, Any], record: dict[str, Any]) -> str | None:
    """In words, how `record` differs from the `stored` one (None: the same run)."""
    if stored.get("fingerprint") == record["fingerprint"]:
        return None
    if stored.get("recipe") != record["recipe"]:
        return f"it is a run of another command ({stored.get('recipe')})"
    old, new = stored.get("settings", {}), record["settings"]
    changed = [name for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
    if changed:
        shown = ", ".join(
            f"{_option(name)} {_shown(new.get(name))} (was {_shown(old.get(name))})" for name in changed
        )
        return f"other settings: {shown}"
    for name, identity in record["input"].items():
        if stored.get("input", {}).get(name) != identity:
            where = (identity or {}).get("path") or (stored["input"].get(name) or {}).get("path")
            label = "MODEL" if name == "model" else "--data"
            return f"another input: {label} {where!r} changed since"
    return "another fingerprint"


def _option(name: str) -> str:
    return "MODEL" if name == "model" else f"--{name.replace('_', '-')}"


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _live_object(name: str) -> Any:
    """What a snapshot names a live object by; its reader (:func:`_snapshot_pickling`) resolves the name itself,
    so this is never called by a run that reads a snapshot."""
    raise pickle.UnpicklingError(f"the snapshot refers to {name!r}, which only the run reading it has")


def _snapshot_pickling(*, live_ids: dict[int, str] | None = None, live: dict[str, Any] | None = None) -> Any:
    """The pickle module torch.save / torch.load use for a snapshot: every live object (the original, its modules,
    parameters and buffers, the tokenizer, the settings, the printer) by name — never copied, and the same object
    again when read back. torch.save writes every other tensor's storage from its own memory into the zip file:
    a plain pickle holds each storage's bytes until the whole dump is done, a second copy of the student
    (15.8 GiB beside 11.3 on Llama-3.2-1B's latent shape, docs/memory.md)."""
    named = live_ids or {}
    objects = live or {}

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            name = named.get(id(obj))
            return NotImplemented if name is None else (_live_object, (name,))

    def resolve(name: str) -> Any:
        try:
            return objects[name]
        except KeyError:
            raise pickle.UnpicklingError(f"it refers to {name!r}, which this run does not have") from None

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == __name__ and name == _live_object.__name__:
                return resolve
            return super().find_class(module, name)

    pickling = types.ModuleType("headkit_snapshot_pickle")
    pickling.Pickler, pickling.Unpickler = Pickler, Unpickler
    pickling.load, pickling.loads, pickling.dump = pickle.load, pickle.loads, pickle.dump
    return pickling


def live_objects(steps: Any) -> dict[str, Any]:
    """Name → object of what a snapshot refers to instead of holding: the steps' live attributes (:data:`LIVE`)
    and every module, parameter and buffer of the loaded original."""
    live: dict[str, Any] = {name: getattr(steps, name) for name in LIVE if hasattr(steps, name)}
    teacher = getattr(steps, "teacher", None)
    if isinstance(teacher, torch.nn.Module):
        for name, module in teacher.named_modules(remove_duplicate=False):
            live.setdefault(f"teacher.module:{name}", module)
        for name, parameter in teacher.named_parameters(remove_duplicate=False):
            live.setdefault(f"teacher.parameter:{name}", parameter)
        for name, buffer in teacher.named_buffers(remove_duplicate=False):
            live.setdefault(f"teacher.buffer:{name}", buffer)
    return live


def rng_states() -> dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RunWork:
    """The work folder of one run (see the module docstring): opened by :meth:`open`, which refuses a resume
    that does not match; :meth:`restore` puts the newest snapshot's state back, :meth:`stage` runs a stage with
    its trainings checkpointed, :meth:`persist` records it, :meth:`finish` removes the folder."""

    def __init__(
        self, folder: Path, record: dict[str, Any], echo: Callable[[str], None], *, fresh: bool
    ) -> None:
        self.folder, self.record, self.echo = folder, record, echo
        self.every = 50
        # A leftover folder this run replaces: only once this run has something of its own to keep.
        self.replace_pending = fresh
        self.resumed: list[str] = []
        self.checkpoints: list[str] = []

    @classmethod
    def open(cls, settings: Any, model_path: Path, out: Path, echo: Callable[[str], None]) -> RunWork:
        """The work folder of a run saving to `out`: with ``settings.resume`` the interrupted run's, refused
        (HeadkitError, before any work) when it is another run; else a new one."""
        folder, record = work_folder(out), run_record(settings, model_path)
        stored_file = folder / RUN_FILE
        if not settings.resume:
            if folder.exists():
                echo(
                    f"an interrupted run of this command is in {folder}; add --resume to continue it "
                    "(this run replaces it once its first stage is done)"
                )
            work = cls(folder, record, echo, fresh=True)
        elif not stored_file.is_file():
            echo(f"--resume: no interrupted run in {folder}; starting afresh")
            work = cls(folder, record, echo, fresh=True)
        else:
            try:
                stored = json.loads(stored_file.read_text())
            except (OSError, ValueError) as exc:
                raise HeadkitError(
                    f"--resume: {stored_file} is unreadable ({exc}); delete {folder} to start afresh"
                ) from None
            difference = _differences(stored, record)
            if difference is not None:
                raise HeadkitError(
                    f"--resume: the interrupted run in {folder} is not this one: {difference}; run without "
                    "--resume to start afresh (replacing it)"
                )
            work = cls(folder, record, echo, fresh=False)
        work.every = settings.checkpoint_steps
        # Rank 0 alone and without a barrier: this runs before the model loads, and creating the process group
        # that early changes how transformers loads the weights (is_main_process); nothing else reads the staging
        # folders before the save step, which waits for rank 0.
        if is_main_process():
            _remove_stale_staging(out)
        return work

    # -- the stages ------------------------------------------------------------------------------------------

    def snapshot_path(self, stage: str) -> Path:
        return self.folder / f"stage-{stage}{SNAPSHOT_SUFFIX}"

    def restore(self, steps: Any, stages: tuple[str, ...]) -> tuple[str | None, dict[str, Any]]:
        """The newest finished stage of `stages` the folder holds and what the skeleton kept with it (each stage's
        seconds and peaks), its state put back into `steps` and the RNG states restored; (None, {}) when there is
        none (a damaged snapshot is said so in one line: its stages run again)."""
        if self.replace_pending:
            return None, {}
        for stage in reversed(stages):
            path = self.snapshot_path(stage)
            if not path.is_file():
                continue
            try:
                payload = torch.load(
                    path, pickle_module=_snapshot_pickling(live=live_objects(steps)), weights_only=False
                )
                if payload.get("fingerprint") != self.record["fingerprint"]:
                    raise ValueError("it belongs to another run")
            except Exception as exc:  # a damaged file raises anything its bytes make pickle do
                self.echo(
                    f"--resume: {path} is damaged ({type(exc).__name__}: {exc}); running its stages again"
                )
                on_main_process(lambda path=path: path.unlink(missing_ok=True))
                continue
            for name, value in payload["state"].items():
                setattr(steps, name, value)
            set_rng_states(payload["rng"])
            self.resumed = list(stages[: stages.index(stage) + 1])
            self.echo(f"--resume: {', '.join(self.resumed)} done before, taken from {path}")
            return stage, payload["kept"]
        return None, {}

    @contextlib.contextmanager
    def stage(self, stage: str) -> Iterator[Checkpointing]:
        """Run a stage: the trainings in it checkpoint in ``<work>/<stage>/`` (and resume from there)."""
        folder = self.folder / stage
        if self.replace_pending:
            # A leftover run's checkpoints must not be taken for this run's.
            on_main_process(lambda: shutil.rmtree(folder, ignore_errors=True))
        where = Checkpointing(folder, stage, every=self.every, echo=self.echo)
        with checkpointing(where):
            yield where
        self.checkpoints += where.resumed

    def persist(self, stage: str, steps: Any, kept: dict[str, Any]) -> None:
        """Record `stage` as done: the steps' state (all but :data:`LIVE`), `kept` and the RNG states, atomically;
        then the previous snapshot and the stage's checkpoints go."""
        state = {name: value for name, value in vars(steps).items() if name not in LIVE}
        payload = {
            "fingerprint": self.record["fingerprint"],
            "stage": stage,
            "state": state,
            "kept": kept,
            "rng": rng_states(),
        }
        live = {id(value): name for name, value in live_objects(steps).items()}

        def write() -> None:
            if self.replace_pending:
                shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True, exist_ok=True)
            # Before the snapshot: the snapshot's fingerprint names this record, never a leftover's.
            write_json_atomic(self.folder / RUN_FILE, self.record)
            pickling = _snapshot_pickling(live_ids=live)
            write_atomic(
                self.snapshot_path(stage),
                lambda handle: torch.save(
                    payload, handle, pickle_module=pickling, pickle_protocol=pickle.HIGHEST_PROTOCOL
                ),
            )
            for old in self.folder.glob(f"stage-*{SNAPSHOT_SUFFIX}"):
                if old.name != self.snapshot_path(stage).name:
                    old.unlink(missing_ok=True)
            shutil.rmtree(self.folder / stage, ignore_errors=True)

        on_main_process(write)
        self.replace_pending = False

    def finish(self) -> None:
        """The result is in place: the work folder goes."""
        on_main_process(lambda: shutil.rmtree(self.folder, ignore_errors=True))

    def holds(self, path: str | os.PathLike[str] | None) -> bool:
        """Whether `path` (an OSError's file) is in the work folder."""
        if not path:
            return False
        return Path(path).resolve().is_relative_to(self.folder.resolve())

    def resumable(self) -> bool:
        """Whether the folder holds this run's record (something to resume)."""
        try:
            stored = json.loads((self.folder / RUN_FILE).read_text())
        except (OSError, ValueError):
            return False
        return stored.get("fingerprint") == self.record["fingerprint"]


@contextlib.contextmanager
def interruptible(work: RunWork) -> Iterator[None]:
    """SIGINT and SIGTERM abandon the stage under way and exit with 130 / 143 after one line on stderr saying how to
    resume (or that nothing was kept); both are handled so while it runs
    (:func:`headkit.runs.interrupts.handling_interrupts`: one that a finalizer swallowed is raised again at the
    next training step or stage end)."""
    try:
        with handling_interrupts():
            yield
    except (KeyboardInterrupt, Terminated) as exc:
        if is_main_process():
            if work.resumable():
                line = f"interrupted; the run so far is in {work.folder}: add --resume to the same command to continue"
            else:
                line = "interrupted before any stage was done: nothing to resume"
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_STATUS[interrupted_by(exc)]) from None
