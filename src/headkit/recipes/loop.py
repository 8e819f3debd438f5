"""The one training loop of headkit, on 🤗 ``Trainer``: every training in the library runs through :func:`train_loop`.

- :func:`headkit.recipes.distill.distill` (recovery after surgery: teacher → student), with LoRA through PEFT;
- :func:`headkit.recipes.gates.train_gates_to_budget` (Hard Concrete head gates under an L0 budget);
- :func:`headkit.train.train_causal_lm` (``headkit train``: a causal LM from scratch);
- the from-scratch benchmarks (``headkit bench lm``, ``digits``, ``extrapolate``, ``lora``).

``Trainer`` brings what a hand-written loop lacks: the same call runs unchanged under ``torchrun`` /
``accelerate launch`` (DDP: gloo on CPU, nccl on GPUs) and FSDP, with gradient accumulation, seeding, gradient
clipping, schedules, and checkpoints to resume from. What each caller brings is a loss: ``loss_fn(model, batch,
step)``, computed in :meth:`Trainer.compute_loss`, with its own parameter groups (each with its own learning
rate: weights, gates, the L0 multipliers) and optionally its own schedule (a factor per step).

Data. Either single examples (dicts of equal-shape tensors), which Trainer's sampler shuffles (seeded) and
stacks into batches of ``batch_size`` per device, or, with ``batch_size=None``, items that are whole batches
already (any structure the loss understands), one per step per device. A stream drawn at random per step (the
from-scratch benchmarks' windows) is an :class:`IndexedBatches`: batch ``i`` is a pure function of ``i`` and
the seed, so every process of a distributed run draws its own, and a rerun draws the same.

Checkpoints. With ``output_dir`` (or inside :func:`checkpointing`, how a recipe that saves gives every training of
a stage its own folder in the run's work folder, :mod:`headkit.recipes.work`), Trainer writes a checkpoint every
``save_steps`` and at the last step (the model or adapters, optimizer, scheduler, RNG states, its state), the last
two kept; each is sealed by a record of its files' SHA-256 written after them (:data:`CHECKPOINT_RECORD`). A
resumed training starts from the newest sealed checkpoint whose files match their record; a damaged one is said so
in one line and removed, and the one before is used. Trainer's ``resume_from_checkpoint`` restores the rest, the
data order included, so the resumed training ends where an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    PreTrainedModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)

from headkit.errors import HeadkitError
from headkit.files import write_atomic, write_json_atomic
from headkit.runs.faults import fault_point
from headkit.runs.interrupts import raise_if_interrupted
from headkit.runs.processes import process_rank_and_count
from headkit.runs.resident import release_free_memory

LossFn = Callable[[nn.Module, Any, int], torch.Tensor]
# on_step(steps done, that step's loss, that step's seconds)
StepCallback = Callable[[int, float, float], None]


@dataclass
class LoopResult:
    """What :func:`train_loop` did: optimizer steps taken, the training loss of each (the mean over its
    gradient-accumulation forwards, on this process), the whole run's seconds, and each step's seconds alone
    (data, forward, backward, update; ``on_step`` callbacks excluded)."""

    steps: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)


class ExampleDataset(torch.utils.data.Dataset):
    """A list of items as a Dataset (Trainer's DataLoader draws from it)."""

    def __init__(self, examples: Sequence[Any]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Any:
        return self.examples[index]


class IndexedBatches(torch.utils.data.Dataset):
    """``count`` batches, batch ``i`` being ``make(i, generator)`` with a generator seeded by ``(seed, i)``: a
    stream of random batches that any process can draw any part of, the same on every run."""

    def __init__(self, count: int, make: Callable[[int, torch.Generator], Any], seed: int = 0) -> None:
        self.count, self.make, self.seed = count, make, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        # Distinct streams per index: the seed and the index mixed, never colliding for non-negative seeds.
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2**63))
        return self.make(index, generator)


#: The file, inside a Trainer checkpoint, that seals it: each of its files' SHA-256, written once they are all there.
CHECKPOINT_RECORD = "headkit-checkpoint.json"
#: The file, inside a Trainer checkpoint, of the trained parameters outside the model (an L0 controller's
#: multipliers), which Trainer's own files leave out.
OUTSIDE_FILE = "headkit-outside-parameters.pt"
#: The files of a Trainer checkpoint this module reads: the weights (a model's or a wrapper's state dict) and state.
SAFE_WEIGHTS_NAME, TRAINER_STATE_NAME = "model.safetensors", "trainer_state.json"
#: Trainer's checkpoint interval where a caller gives none.
SAVE_STEPS = 50


@dataclass
class Checkpointing:
    """Where the trainings of one recipe stage keep their checkpoints (:func:`checkpointing`): the ``i``-th
    training the stage runs in ``folder/train-i``, every ``every`` steps, resuming from the newest there;
    ``resumed`` lists the checkpoints a training started from, ``echo`` says so."""

    folder: Path
    stage: str
    every: int = SAVE_STEPS
    echo: Callable[[str], None] = print
    count: int = 0
    resumed: list[str] = field(default_factory=list)

    def next_folder(self) -> tuple[int, Path]:
        index, self.count = self.count, self.count + 1
        return index, self.folder / f"train-{index}"


_CHECKPOINTING: ContextVar[Checkpointing | None] = ContextVar("headkit_checkpointing", default=None)


@contextlib.contextmanager
def checkpointing(where: Checkpointing) -> Iterator[Checkpointing]:
    """Within it, every :func:`train_loop` without an ``output_dir`` checkpoints in ``where``'s folders and resumes
    from them: the recipes' trainings (distillation, gates) gain checkpoints without each passing a folder."""
    token = _CHECKPOINTING.set(where)
    try:
        yield where
    finally:
        _CHECKPOINTING.reset(token)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def seal_checkpoint(folder: Path) -> None:
    """Write ``folder``'s :data:`CHECKPOINT_RECORD`: the SHA-256 of every file Trainer wrote there."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKPOINT_RECORD)
    record = {str(p.relative_to(folder)): _file_digest(p) for p in files}
    write_json_atomic(folder / CHECKPOINT_RECORD, {"files": record})


def checkpoint_fault(folder: Path) -> str | None:
    """What is wrong with the Trainer checkpoint ``folder`` (None: it is whole): unsealed (interrupted while
    written), a file missing or not matching its record."""
    try:
        record = json.loads((folder / CHECKPOINT_RECORD).read_text())["files"]
    except FileNotFoundError:
        return "it was not finished"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its record {CHECKPOINT_RECORD} is unreadable ({exc})"
    for name, digest in record.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if _file_digest(path) != digest:
            return f"{name} does not match its record (damaged)"
    return None


def newest_checkpoint(folder: Path, echo: Callable[[str], None] = print) -> Path | None:
    """The newest whole checkpoint in ``folder`` (Trainer's ``checkpoint-<step>``), None where there is none;
    each newer one that is not whole is said so in one line and removed, so that Trainer's rotation never
    counts it."""
    found = [p for p in folder.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    for candidate in sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True):
        fault = checkpoint_fault(candidate)
        if fault is None:
            return candidate
        echo(f"skipping checkpoint {candidate}: {fault}; trying the one before")
        shutil.rmtree(candidate, ignore_errors=True)
    return None


WHOLE = "batch"  # where a whole-batch item rides through Trainer, which wants a non-empty dict


def _whole_batch(items: list[Any]) -> dict[str, Any]:
    return {WHOLE: items[0]}


def check_count(name: str, value: Any, *, low: int = 1) -> int:
    """``value`` must be an integer ≥ ``low``, else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "positive" if low == 1 else f"≥ {low}"
        raise HeadkitError(f"{name} must be a {kind} integer, got {value!r}")
    return value


def train_loop(
    model: nn.Module,
    loss_fn: LossFn,
    data: Sequence[Any] | torch.utils.data.Dataset,
    *,
    steps: int,
    param_groups: list[dict[str, Any]],
    batch_size: int | None = None,
    lr: float = 1e-3,
    optimizer_options: dict[str, Any] | None = None,
    schedule: str | Callable[[int], float] = "constant",
    warmup_steps: int = 0,
    max_grad_norm: float = 0.0,
    gradient_accumulation_steps: int = 1,
    dropout: bool = False,
    seed: int = 0,
    output_dir: str | Path | None = None,
    resume: bool = False,
    on_step: StepCallback | None = None,
    on_log: Callable[[int, float], None] | None = None,
    log_every: int = 1,
    use_cpu: bool | None = None,
    ddp_backend: str | None = None,
    progress_bar: bool = False,
    companions: Sequence[nn.Module] = (),
) -> LoopResult:
    """``steps`` AdamW steps (Loshchilov & Hutter 2019) of ``loss_fn(model, batch, step)`` on ``data``.

    Args:
        model: trained in place; Trainer may move it to an accelerator (it is left there, in evaluation mode).
        loss_fn: the scalar loss of one batch; ``step`` is the optimizer steps done so far.
        data: single examples, stacked by Trainer into batches of ``batch_size`` — the global batch: under
            ``torchrun`` / ``accelerate launch`` each of N processes takes ``batch_size / N`` of every batch, so N
            processes take the same optimizer steps as one (up to reduction order); or with ``batch_size=None``
            whole batches (one per forward and process). Shuffled with ``seed``, cycled as needed.
        param_groups: AdamW's parameter groups, each with its own ``lr`` (and ``weight_decay``, else 0).
        lr: the learning rate of groups without one.
        optimizer_options: more AdamW options (``betas``, ``foreach``, ``maximize`` per group goes in the group).
        schedule: Trainer's ``lr_scheduler_type`` ("constant", "linear", "cosine", …) with ``warmup_steps``, or a
            function of the step giving the factor on every group's learning rate (``LambdaLR``).
        max_grad_norm: clip the gradients' global norm to this (0: no clipping).
        dropout: train in training mode (dropout on); False keeps the model in evaluation mode while it trains
            (distillation: the target is the teacher's deterministic output).
        output_dir: where Trainer writes checkpoints (one per 50 steps, the last two kept); with ``resume=True``
            a run picks up from the newest there. None: a temporary folder, no checkpoints.
        on_step: called as ``on_step(steps done, loss, the step's seconds)`` after every optimizer step, on every
            process.
        on_log: called as ``on_log(steps done, logged loss)`` every ``log_every`` steps, on the main process.
        use_cpu: train on the CPU even where an accelerator is there (None: the CPU only without CUDA).
        ddp_backend: Trainer's ``ddp_backend`` for multi-process runs (e.g. "gloo" on CPU); None: Trainer's choice.
        progress_bar: Trainer's own progress bar.
        companions: modules the loss calls beside the model (a frozen teacher): moved to the device Trainer trains
            on (and left there: the caller moves them back).

    Returns:
        :class:`LoopResult`.

    Raises:
        HeadkitError: bad counts, no data, no trainable parameter.
    """
    check_count("steps", steps, low=0)
    check_count("log_every", log_every)
    check_count("gradient_accumulation_steps", gradient_accumulation_steps)
    if batch_size is not None:
        check_count("batch_size", batch_size)
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr >= 0):
        raise HeadkitError(f"lr must be a non-negative number, got {lr!r}")
    if steps == 0:
        return LoopResult(0)
    _join_process_group()
    per_process_batch = _per_process_batch(batch_size)
    dataset = data if isinstance(data, torch.utils.data.Dataset) else ExampleDataset(data)
    if len(dataset) == 0:
        raise HeadkitError("the training data holds no example, got none")
    if not any(p.requires_grad for group in param_groups for p in group["params"]):
        raise HeadkitError("nothing to train: no parameter group holds a trainable parameter")
    ambient = _CHECKPOINTING.get() if output_dir is None else None
    save_steps, fault_names = SAVE_STEPS, ("",)
    if ambient is not None:
        index, output_dir = ambient.next_folder()
        resume, save_steps = True, ambient.every
        # HEADKIT_FAULT_AT=<stage>:<step> in a stage's first training, <stage>.<i>:<step> in its i-th
        fault_names = (f"{ambient.stage}.{index}", *((ambient.stage,) if index == 0 else ()))

    with tempfile.TemporaryDirectory(prefix="headkit-train-") as scratch:
        directory = Path(output_dir) if output_dir is not None else Path(scratch)
        arguments = TrainingArguments(
            output_dir=str(directory),
            per_device_train_batch_size=per_process_batch,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_steps=steps,
            learning_rate=lr if lr > 0 else 1e-3,  # Trainer refuses 0; every group carries its own rate
            lr_scheduler_type=schedule if isinstance(schedule, str) else "constant",
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            logging_steps=log_every,
            logging_strategy="steps",
            save_strategy="steps" if output_dir is not None else "no",
            save_steps=save_steps,
            save_total_limit=2,
            report_to="none",
            disable_tqdm=not progress_bar,
            remove_unused_columns=False,
            dataloader_drop_last=batch_size is not None and len(dataset) >= batch_size,
            dataloader_num_workers=0,
            seed=seed,
            data_seed=seed,
            use_cpu=(not torch.cuda.is_available()) if use_cpu is None else use_cpu,
            ddp_backend=ddp_backend,
            log_level="warning",
        )
        inside = {id(p) for p in model.parameters()}
        # The optimizer steps them and Trainer restores their moments, but only the model's weights are saved.
        outside = [p for group in param_groups for p in group["params"] if id(p) not in inside]
        recorder = _StepRecorder(on_step, on_log, fault_names)
        trainer = _LoopTrainer(
            loss_fn=loss_fn,
            dropout=dropout,
            recorder=recorder,
            optimizer_groups=param_groups,
            optimizer_options=optimizer_options or {},
            schedule=None if isinstance(schedule, str) else schedule,
            companions=list(companions),
            model=model,
            args=arguments,
            train_dataset=dataset,
            data_collator=_whole_batch if batch_size is None else None,
            callbacks=[recorder, _CheckpointSeal(outside)] if output_dir is not None else [recorder],
        )
        trainer.remove_callback(PrinterCallback)  # its raw log dicts; callers print what they want via on_log
        echo = ambient.echo if ambient is not None else print
        checkpoint = newest_checkpoint(Path(output_dir), echo) if resume and output_dir is not None else None
        if checkpoint is not None:
            echo(f"resuming the training from {checkpoint} (of {steps} steps)")
            if ambient is not None:
                ambient.resumed.append(f"{ambient.stage}/{Path(output_dir).name}/{checkpoint.name}")
        if checkpoint is not None and outside:
            with torch.no_grad():
                for parameter, value in zip(outside, torch.load(checkpoint / OUTSIDE_FILE), strict=True):
                    parameter.copy_(value)
        if checkpoint is not None and int(checkpoint.name.split("-")[-1]) >= steps:
            # Finished before: Trainer, resumed at its last step, would take one step more.
            model.eval()
            return _finished_training(model, checkpoint, recorder)
        with _quiet_tied_weights(model, checkpoint):
            output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    model.eval()
    return LoopResult(
        steps=int(output.global_step),
        losses=recorder.losses,
        seconds=float(output.metrics.get("train_runtime", 0.0)),
        step_seconds=recorder.step_seconds,
    )


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


@contextlib.contextmanager
def _quiet_tied_weights(model: nn.Module, checkpoint: Path | None) -> Iterator[None]:
    """Trainer, resuming, warns of "missing keys" when the checkpoint leaves out a tied weight (save_pretrained
    writes it once): nothing is missing then, and the warning is dropped; any other missing key is still said."""
    weights = checkpoint / SAFE_WEIGHTS_NAME if checkpoint is not None else None
    if weights is None or not weights.is_file():
        yield
        return
    with safetensors.safe_open(str(weights), framework="pt") as handle:
        saved = set(handle.keys())
    owners: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owners.setdefault(id(tensor), []).append(name)
    tied = {name for names in owners.values() if len(names) > 1 for name in names}
    missing = {name for names in owners.values() for name in names} - saved
    if not missing or not missing <= tied:
        yield
        return
    logger = logging.getLogger("transformers.trainer")
    quiet = _DropMessage("There were missing keys in the checkpoint model loaded")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _finished_training(model: nn.Module, checkpoint: Path, recorder: _StepRecorder) -> LoopResult:
    """The end of a training that finished before, from its last checkpoint: the trained weights (or adapters),
    the RNG states as they were after its last step, and its logged losses replayed to the caller."""
    if hasattr(model, "peft_config"):
        model.load_adapter(str(checkpoint), adapter_name=model.active_adapter, is_trainable=True)
    else:
        # A model saved by save_pretrained leaves a tied weight out: it is the weight it is tied to.
        model.load_state_dict(safetensors.torch.load_file(checkpoint / SAFE_WEIGHTS_NAME), strict=False)
    rank, _ = process_rank_and_count()
    rng_file = checkpoint / f"rng_state_{rank}.pth"
    rng = torch.load(rng_file if rng_file.is_file() else checkpoint / "rng_state.pth", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.random.set_rng_state(rng["cpu"])
    if torch.cuda.is_available() and "cuda" in rng:
        # Trainer keeps every device's state in a launched run, the current device's in one process.
        if isinstance(rng["cuda"], (list, tuple)):
            torch.cuda.set_rng_state_all(rng["cuda"])
        else:
            torch.cuda.set_rng_state(rng["cuda"])
    state = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE_NAME))
    if recorder.on_logged is not None and rank == 0:
        for entry in state.log_history:
            if "loss" in entry and "step" in entry:
                recorder.on_logged(int(entry["step"]), float(entry["loss"]))
    return LoopResult(steps=int(state.global_step))


def _join_process_group() -> None:
    """A process group the caller initialised (``torch.distributed.init_process_group`` without ``torchrun``) is
    the one Trainer joins: accelerate reads the rank and size from the environment, where ``torchrun`` puts them."""
    if not (dist.is_available() and dist.is_initialized()) or "LOCAL_RANK" in os.environ:
        return
    rank, size = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, WORLD_SIZE=size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=size)


def _per_process_batch(batch_size: int | None) -> int:
    """Each process's share of the global `batch_size` (1 whole batch when None), refused when the processes
    cannot share it evenly."""
    if batch_size is None:
        return 1
    _, processes = process_rank_and_count()
    if batch_size % processes:
        raise HeadkitError(
            f"batch_size (the global batch) must be a multiple of the {processes} processes, got {batch_size}"
        )
    return batch_size // processes


class _CheckpointSeal(TrainerCallback):
    """Completes each checkpoint once Trainer has written it, on the main process: the trained parameters
    outside the model (:data:`OUTSIDE_FILE`), then the seal (:func:`seal_checkpoint`). A checkpoint interrupted
    while written has no seal, and a resumed training passes it by."""

    def __init__(self, outside: Sequence[torch.Tensor] = ()) -> None:
        self.outside = list(outside)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every process's RNG state is in the checkpoint before it is sealed
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if self.outside:
                values = [p.detach().cpu().clone() for p in self.outside]
                write_atomic(folder / OUTSIDE_FILE, lambda handle: torch.save(values, handle))
            seal_checkpoint(folder)


class _StepRecorder(TrainerCallback):
    """Each step's loss (from the loop's forwards) and wall clock; the callers' per-step and per-log hooks."""

    def __init__(
        self,
        on_step: StepCallback | None,
        on_log: Callable[[int, float], None] | None,
        fault_names: Sequence[str] = ("",),
    ) -> None:
        self.on_step_done, self.on_logged = on_step, on_log
        self.fault_names = fault_names
        self.losses: list[float] = []
        self.step_seconds: list[float] = []
        self.pending: list[torch.Tensor] = []
        self.started = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Resumed from a checkpoint: the logs of the steps before it, restored with Trainer's state, reach the
        # caller as they did the first time, so a resumed recovery reports every logged loss.
        if self.on_logged is not None and state.global_step > 0 and state.is_world_process_zero:
            for entry in state.log_history:
                if "loss" in entry and "step" in entry:
                    self.on_logged(int(entry["step"]), float(entry["loss"]))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # float() waits for an accelerator, so the step's clock is complete.
        loss = float(torch.stack(self.pending).float().mean()) if self.pending else math.nan
        self.pending.clear()
        self.step_seconds.append(time.perf_counter() - self.started)
        self.losses.append(loss)
        if self.on_step_done is not None:
            self.on_step_done(state.global_step, loss, self.step_seconds[-1])
        for name in self.fault_names:
            if name:
                fault_point(f"{name}:{state.global_step}")
        raise_if_interrupted()  # a Ctrl-C that a finalizer swallowed during the step

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if self.on_logged is not None and logs and "loss" in logs and state.is_world_process_zero:
            self.on_logged(state.global_step, float(logs["loss"]))


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict as safetensors can write it: every key; each tensor itself where it is contiguous and
    the first to hold its storage, else a contiguous copy (a tied weight's second name)."""
    state: dict[str, torch.Tensor] = {}
    held: set[tuple[torch.device, int]] = set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        where = (tensor.device, tensor.untyped_storage().data_ptr())
        if where in held and tensor.numel():
            tensor = tensor.clone()
        held.add(where)
        state[name] = tensor.contiguous()
    return state


class _LoopTrainer(Trainer):
    """Trainer whose loss is the caller's, whose optimizer is AdamW on the caller's groups, and whose schedule
    may be the caller's factor per step."""

    def __init__(
        self,
        *,
        loss_fn: LossFn,
        dropout: bool,
        recorder: _StepRecorder,
        optimizer_groups: list[dict[str, Any]],
        optimizer_options: dict[str, Any],
        schedule: Callable[[int], float] | None,
        companions: list[nn.Module],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.companions = companions
        self.loss_fn, self.dropout, self.recorder = loss_fn, dropout, recorder
        self.optimizer_groups, self.optimizer_options = optimizer_groups, optimizer_options
        self.schedule = schedule

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        # Built here, not passed in: Trainer refuses a ready-made optimizer under FSDP.
        if self.optimizer is None:
            groups = [{"weight_decay": 0.0} | group for group in self.optimizer_groups]
            self.optimizer = torch.optim.AdamW(groups, lr=self.args.learning_rate, **self.optimizer_options)
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        if self.schedule is not None and self.lr_scheduler is None:
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, self.schedule)
        return super().create_scheduler(num_training_steps, optimizer)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if (
            isinstance(model, PreTrainedModel)
            or hasattr(model, "peft_config")
            or self.is_fsdp_enabled
            or self.is_deepspeed_enabled
        ):
            super().save_model(output_dir, _internal_call)
            return
        # A module around the model (an objective's forward) whose state dict names a tied weight twice: Trainer's
        # safetensors.save_file refuses shared tensors, so a name whose storage an earlier name already holds gets a
        # copy, every key stays there for Trainer's resume to load, and the tied weight gets the same values twice.
        # Only those are copied: safetensors writes the others from their own memory (a copy of every tensor held
        # a whole second model at the training's end: +4.6 GiB on Llama-3.2-1B's shape, docs/memory.md).
        if self.args.should_save:
            directory = Path(output_dir if output_dir is not None else self.args.output_dir)
            directory.mkdir(parents=True, exist_ok=True)
            safetensors.torch.save_file(
                checkpoint_state(model), str(directory / SAFE_WEIGHTS_NAME), metadata={"format": "pt"}
            )

    def floating_point_ops(self, inputs: Any) -> int:
        # Items may be any structure the loss understands (not a model's input dict): no FLOP estimate.
        return 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        device = next(model.parameters()).device
        for companion in self.companions:
            if next(companion.parameters()).device != device:
                companion.to(device)
        if not self.dropout:
            model.eval()  # Trainer switched to training mode: dropout would make a distillation target noisy
            # 🤗's checkpointed decoder layers recompute only in training mode: the layers alone are put in it,
            # what they hold (dropout, attention) stays in evaluation mode
            for module in model.modules():
                if getattr(module, "gradient_checkpointing", False) is True:
                    module.training = True
        # The last forward's and backward's buffers are free but their pages stay in glibc's heap, fragmented, and
        # the next forward grows the heap past them (SmolLM2, LoRA distillation in forwards of 4 × 256 tokens: the
        # peak 3.21 → 2.48 GiB, each forward about 5 % slower; docs/memory.md).
        release_free_memory()
        batch = inputs[WHOLE] if self.data_collator is _whole_batch else inputs
        loss = self.loss_fn(model, batch, self.state.global_step)
        self.recorder.pending.append(loss.detach())
        return (loss, None) if return_outputs else loss
