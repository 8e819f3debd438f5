"""One training loop for every recovery after surgery: teacher → student distillation on 🤗 ``Trainer``.

:func:`distill` runs ``transformers.Trainer`` with its ``compute_loss`` overridden by an objective
(:mod:`headkit.recipes.objectives`) that calls the frozen teacher and the student on the same batch. Trainer
brings what a hand-written loop lacks: the same call runs unchanged under ``torchrun`` / ``accelerate launch``
(DDP, gloo on CPU or nccl on GPUs) and FSDP, with gradient accumulation, seeding, a progress bar, logging and
checkpoints to resume from.

Extra trainable terms ride along through a :class:`Regularizer` (e.g. the L0 constraint of Hard Concrete head
gates): its parameter groups join the optimizer, its loss is added to the objective's at every step.

With ``lora_rank`` the student's linear layers are adapted by LoRA through PEFT (Hu et al. 2022) instead of
trained in full, and the adapters are merged back into the weights before the student is returned — the saved
model is a plain model of its class.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

from headkit.errors import HeadkitError

Objective = Callable[[nn.Module, nn.Module, dict[str, Any]], torch.Tensor]


class Regularizer(Protocol):
    """A trainable term added to the objective (see :class:`headkit.recipes.prune.L0Regularizer`)."""

    def param_groups(self) -> list[dict[str, Any]]: ...

    def loss(self, model: nn.Module, step: int) -> torch.Tensor: ...

    # Optional: ``before_forward(model, step)``, called before each forward (e.g. to put gates in sampling mode).


@dataclass
class DistillResult:
    """What :func:`distill` did. ``model`` is the trained student (with LoRA: the merged one)."""

    model: nn.Module
    steps: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    lora_rank: int | None = None
    trainable_parameters: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Every field but the model."""
        return {name: value for name, value in vars(self).items() if name != "model"}


class _ExampleDataset(torch.utils.data.Dataset):
    """Examples (dicts of equal-shape tensors) for Trainer's DataLoader, which stacks them into batches."""

    def __init__(self, examples: Sequence[dict[str, torch.Tensor]]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.examples[index]


def split_batches(batches: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Batches {name: [B, …]} → examples {name: […]} (Trainer batches them again at its batch size)."""
    examples = []
    for batch in batches:
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        size = len(next(iter(tensors.values())))
        examples += [{k: v[i] for k, v in tensors.items()} for i in range(size)]
    return examples


def lora_target_modules(model: nn.Module) -> list[str]:
    """Names of the student's linear layers (nn.Linear and GPT-2's Conv1D) that LoRA may wrap: inside the
    transformer blocks, not the embeddings or the LM head, and not a projection with a forward hook (a pruned
    layer's key/value gather, a gate), whose output a LoRA delta of the un-hooked width could not be added to."""
    names = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind not in ("Linear", "Conv1D") or module._forward_hooks or module._forward_pre_hooks:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("lm_head", "score", "classifier") or "embed" in leaf:
            continue
        if getattr(module, "weight", None) is None or module.weight.numel() == 0:
            continue
        names.append(name)
    return names


def distill(
    student: nn.Module,
    teacher: nn.Module,
    examples: Sequence[dict[str, torch.Tensor]],
    *,
    objective: Objective,
    steps: int,
    lr: float = 1e-4,
    batch_size: int = 8,
    gradient_accumulation_steps: int = 1,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    regularizer: Regularizer | None = None,
    scheduler: str = "constant",
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    output_dir: str | Path | None = None,
    resume: bool = False,
    log_every: int = 1,
    echo: Callable[[str], None] | None = None,
    progress_bar: bool = False,
    ddp_backend: str | None = None,
) -> DistillResult:
    """Train `student` to reproduce `teacher` on `examples` for `steps` optimizer steps; return the student.

    Args:
        student: the model after surgery; trained in place (every parameter with ``requires_grad``), or through
            LoRA adapters merged back at the end (``lora_rank``). Dropout stays off: the target is the teacher's
            deterministic output.
        teacher: the frozen reference (its parameters are never updated).
        examples: single examples ({"input_ids": [T], "attention_mask": [T]}, equal shapes), e.g.
            :func:`split_batches` of fixed-shape batches; shuffled by Trainer with `seed`, cycled as needed.
        objective: ``objective(student, teacher, batch) -> loss`` (:mod:`headkit.recipes.objectives`).
        steps: optimizer steps (0 returns the student unchanged).
        lr: learning rate of the student's weights (AdamW, or of the LoRA adapters).
        batch_size: examples per device per forward; ``gradient_accumulation_steps`` forwards per step.
        lora_rank: LoRA rank (PEFT) on :func:`lora_target_modules`; None trains the weights themselves.
        regularizer: extra parameter groups and loss term, e.g. Hard Concrete gates under an L0 constraint.
        scheduler: Trainer's ``lr_scheduler_type`` ("constant", "linear", "cosine", …).
        output_dir: where Trainer writes checkpoints (one per 50 steps, the last two kept) when given; with
            ``resume=True`` a run picks up from the newest checkpoint there. None: a temporary folder, no
            checkpoints.
        echo: called with a progress line at every logged step (every `log_every` steps).
        ddp_backend: Trainer's ``ddp_backend`` for multi-process runs (e.g. "gloo" on CPU); None: Trainer's choice.
    """
    for name, value in (("steps", steps), ("batch_size", batch_size), ("log_every", log_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "steps" else 1):
            raise HeadkitError(
                f"{name} must be a {'non-negative' if name == 'steps' else 'positive'} integer, got {value!r}"
            )
    if (
        isinstance(gradient_accumulation_steps, bool)
        or not isinstance(gradient_accumulation_steps, int)
        or gradient_accumulation_steps < 1
    ):
        raise HeadkitError(
            f"gradient_accumulation_steps must be a positive integer, got {gradient_accumulation_steps!r}"
        )
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise HeadkitError(f"lr must be a non-negative number, got {lr!r}")
    if lora_rank is not None and (
        isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1
    ):
        raise HeadkitError(f"lora_rank must be a positive integer or None, got {lora_rank!r}")
    if steps == 0:
        return DistillResult(student, 0, lora_rank=lora_rank)
    if not examples:
        raise HeadkitError("examples must hold at least one training example, got none")

    teacher.requires_grad_(False)
    teacher.eval()
    config = getattr(student, "config", None)
    use_cache = getattr(config, "use_cache", None)
    model = student
    if lora_rank is not None:
        model = _with_lora(student, lora_rank, lora_alpha)
    model.eval()  # no dropout; Trainer calls model.train() each step, so an eval-mode wrapper keeps it off
    trainable = [p for p in model.parameters() if p.requires_grad]
    extra_groups = regularizer.param_groups() if regularizer is not None else []
    extra_ids = {id(p) for group in extra_groups for p in group["params"]}
    weights = [p for p in trainable if id(p) not in extra_ids]
    groups = (
        [{"params": weights, "lr": lr, "weight_decay": weight_decay}] if weights and lr > 0 else []
    ) + extra_groups
    if not groups:
        raise HeadkitError(
            "nothing to train: the student has no trainable parameter (and lr is 0 or no regularizer)"
        )
    # Trainer may move both models to an accelerator; the caller gets them back where they were.
    student_device = next(student.parameters()).device
    teacher_device = next(teacher.parameters()).device

    with tempfile.TemporaryDirectory(prefix="headkit-distill-") as scratch:
        directory = Path(output_dir) if output_dir is not None else Path(scratch)
        arguments = TrainingArguments(
            output_dir=str(directory),
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_steps=steps,
            learning_rate=lr if lr > 0 else 1e-3,
            lr_scheduler_type=scheduler,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            logging_steps=log_every,
            logging_strategy="steps",
            save_strategy="steps" if output_dir is not None else "no",
            save_steps=50,
            save_total_limit=2,
            report_to="none",
            disable_tqdm=not progress_bar,
            remove_unused_columns=False,
            dataloader_drop_last=len(examples) >= batch_size,
            dataloader_num_workers=0,
            seed=seed,
            data_seed=seed,
            use_cpu=not torch.cuda.is_available(),
            ddp_backend=ddp_backend,
            log_level="warning",
        )
        recorder = _LossRecorder(echo, steps)
        trainer = _DistillationTrainer(
            teacher=teacher,
            objective=objective,
            regularizer=regularizer,
            model=model,
            args=arguments,
            train_dataset=_ExampleDataset(examples),
            callbacks=[recorder],
            optimizer_groups=groups,
        )
        trainer.remove_callback(PrinterCallback)  # its raw log dicts; _LossRecorder prints a line per log
        checkpoint = resume and output_dir is not None and any(Path(output_dir).glob("checkpoint-*"))
        output = trainer.train(resume_from_checkpoint=True if checkpoint else None)
    if lora_rank is not None:
        model = model.merge_and_unload()
    if use_cache is not None:  # Trainer turns the cache off for training; generation wants it back
        model.config.use_cache = use_cache
    model.to(student_device).eval()
    teacher.to(teacher_device)
    return DistillResult(
        model=model,
        steps=int(output.global_step),
        losses=recorder.losses,
        seconds=float(output.metrics.get("train_runtime", 0.0)),
        lora_rank=lora_rank,
        trainable_parameters=sum(p.numel() for p in trainable),
    )


def _with_lora(student: nn.Module, rank: int, alpha: float | None) -> nn.Module:
    targets = lora_target_modules(student)
    if not targets:
        raise HeadkitError(f"lora_rank: found no linear layer in {type(student).__name__} that LoRA can wrap")
    return with_lora(student, targets, rank=rank, alpha=alpha, option="lora_rank")


def with_lora(
    model: nn.Module, targets: list[str], *, rank: int, alpha: float | None = None, option: str = "lora_rank"
) -> nn.Module:
    """``model`` wrapped by PEFT with rank-``rank`` LoRA factors (α = 2·rank unless given, no dropout) on the
    modules named ``targets``; only the factors train. ``option``: the setting to name if PEFT is missing."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise HeadkitError(f"{option} needs PEFT: pip install 'headkit[peft]'") from None
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        lora_dropout=0.0,
        target_modules=targets,
        fan_in_fan_out=any(type(model.get_submodule(name)).__name__ == "Conv1D" for name in targets),
    )
    with warnings.catch_warnings():
        # PEFT (≤ 0.21) reads transformers 5's deprecated `is_gradient_checkpointing` alias: a warning the user
        # can do nothing about.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(model, config)


class _LossRecorder(TrainerCallback):
    """Records each logged loss and echoes a progress line (on the main process only)."""

    def __init__(self, echo: Callable[[str], None] | None, steps: int) -> None:
        self.echo, self.steps = echo, steps
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            if self.echo is not None and state.is_world_process_zero:
                self.echo(f"  step {state.global_step}/{self.steps}: loss {logs['loss']:.5f}")


class _DistillationTrainer(Trainer):
    """Trainer whose loss is the objective against ``self.teacher`` (plus the regularizer's term)."""

    def __init__(
        self,
        *,
        teacher: nn.Module,
        objective: Objective,
        regularizer: Regularizer | None,
        optimizer_groups: list[dict[str, Any]],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.teacher, self.objective, self.regularizer = teacher, objective, regularizer
        self.optimizer_groups = optimizer_groups

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        # Built here, not passed in: Trainer refuses a ready-made optimizer under FSDP. Each group carries its own
        # learning rate (weights, gates, the L0 multipliers).
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.optimizer_groups, lr=self.args.learning_rate)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        model.eval()  # Trainer switched to train mode: dropout would make the target noisy
        device = next(model.parameters()).device
        if next(self.teacher.parameters()).device != device:
            self.teacher = self.teacher.to(device)
        if self.regularizer is not None and hasattr(self.regularizer, "before_forward"):
            self.regularizer.before_forward(model, self.state.global_step)
        loss = self.objective(model, self.teacher, inputs)
        if self.regularizer is not None:
            loss = loss + self.regularizer.loss(model, self.state.global_step)
        return (loss, None) if return_outputs else loss
