"""Every recovery after surgery: teacher → student distillation on headkit's one training loop.

:func:`distill` runs :func:`headkit.recipes.loop.train_loop` (🤗 ``Trainer``) with an objective
(:mod:`headkit.runs.objectives`) that calls the frozen teacher and the student on the same batch as its loss,
so it runs unchanged under ``torchrun`` / ``accelerate launch`` (DDP, gloo on CPU or nccl on GPUs) and FSDP, with
gradient accumulation, seeding, logging and checkpoints to resume from.

With ``lora_rank`` the student's linear layers are adapted by LoRA through PEFT (Hu et al. 2022) instead of
trained in full, and the adapters are merged back into the weights before the student is returned — the saved
model is a plain model of its class.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.compat import set_activation_checkpointing
from headkit.errors import HeadkitError
from headkit.recipes.loop import train_loop
from headkit.recipes.settings import training_forwards
from headkit.runs.models import unshare_weights
from headkit.runs.objectives import EncoderObjective

Objective = Callable[[nn.Module, nn.Module, dict[str, Any]], torch.Tensor]


@dataclass
class DistillResult:
    """What :func:`distill` did. ``model`` is the trained student (with LoRA: the merged one)."""

    model: nn.Module
    steps: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    lora_rank: int | None = None
    trainable_parameters: int = 0
    # whether the decoder layers recomputed their activations in the backward
    gradient_checkpointing: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Every field but the model."""
        return {name: value for name, value in vars(self).items() if name != "model"}


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


class ObjectiveForward(nn.Module):
    """The student with an objective as its forward (``forward(batch)`` → the objective's loss), for objectives
    that call the student's submodules rather than its forward (attention transfer): wrapped by DDP, the
    objective then runs inside DDP's forward, which is what makes DDP average its gradients across processes.
    The teacher is held outside the module tree: it is neither trained, nor broadcast, nor saved."""

    def __init__(self, student: nn.Module, teacher: nn.Module, objective: Objective) -> None:
        super().__init__()
        self.student = student
        self.frozen = (teacher, objective)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        teacher, objective = self.frozen
        return objective(self.student, teacher, batch)


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
    gradient_checkpointing: bool | None = False,
) -> DistillResult:
    """Train `student` to reproduce `teacher` on `examples` for `steps` optimizer steps; return the student.

    Args:
        student: the model after surgery; trained in place (every parameter with ``requires_grad``), or through
            LoRA adapters merged back at the end (``lora_rank``). Dropout stays off: the target is the teacher's
            deterministic output.
        teacher: the frozen reference (its parameters are never updated).
        examples: single examples ({"input_ids": [T], "attention_mask": [T]}, equal shapes), e.g.
            :func:`split_batches` of fixed-shape batches; shuffled by Trainer with `seed`, cycled as needed.
        objective: ``objective(student, teacher, batch) -> loss`` (:mod:`headkit.runs.objectives`).
        steps: optimizer steps (0 returns the student unchanged).
        lr: learning rate of the student's weights (AdamW, or of the LoRA adapters).
        batch_size: examples per device per forward; ``gradient_accumulation_steps`` forwards per step.
        lora_rank: LoRA rank (PEFT) on :func:`lora_target_modules`; None trains the weights themselves.
        scheduler: Trainer's ``lr_scheduler_type`` ("constant", "linear", "cosine", …).
        output_dir: where Trainer writes checkpoints (one per 50 steps, the last two kept) when given; with
            ``resume=True`` a run picks up from the newest checkpoint there. None: a temporary folder, no
            checkpoints.
        echo: called with a progress line at every logged step (every `log_every` steps).
        ddp_backend: Trainer's ``ddp_backend`` for multi-process runs (e.g. "gloo" on CPU); None: Trainer's choice.
        gradient_checkpointing: recompute each decoder layer's activations in the backward instead of keeping
            them (🤗 ``gradient_checkpointing_enable``, non-reentrant; Chen et al. 2016): the same steps, about a
            third more compute, one layer's activations instead of every layer's. Turned off again afterwards.
            None: where the model supports it (True refuses a model that does not).
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
    if not any(gradient_checkpointing is choice for choice in (True, False, None)):  # 1 == True: identity
        raise HeadkitError(
            f"gradient_checkpointing must be True, False or None, got {gradient_checkpointing!r}"
        )
    checkpointed = (
        None
        if gradient_checkpointing is False
        else _checkpointed_model(student, required=gradient_checkpointing is True)
    )
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
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable or lr == 0:
        raise HeadkitError("nothing to train: the student has no trainable parameter (or lr is 0)")
    # A student made by headkit.runs.models.shared_copy holds the teacher's tensors where the surgery left them:
    # what trains gets a copy of its own first.
    unshare_weights(model, teacher, trainable)
    groups = [{"params": trainable, "lr": lr, "weight_decay": weight_decay}]
    # Trainer may move both models to an accelerator; the caller gets them back where they were.
    student_device = next(student.parameters()).device
    teacher_device = next(teacher.parameters()).device

    def loss_fn(model: nn.Module, batch: dict[str, Any], step: int) -> torch.Tensor:
        return objective(model, teacher, batch)

    trained: nn.Module = model
    if not getattr(objective, "calls_student_forward", True):
        # DDP synchronises gradients only of what ran through its forward: an objective that calls the student's
        # submodules directly runs inside one, or each process would step on its own share of the batch.
        trained = ObjectiveForward(model, teacher, objective)

        def loss_fn(model: nn.Module, batch: dict[str, Any], step: int) -> torch.Tensor:
            return model(batch)

    def print_log(step: int, loss: float) -> None:
        if echo is not None:
            echo(f"  step {step}/{steps}: loss {loss:.5f}")

    logged: list[float] = []
    if checkpointed is not None:
        set_activation_checkpointing(checkpointed, True)
    try:
        output = train_loop(
            trained,
            loss_fn,
            examples,
            steps=steps,
            param_groups=groups,
            batch_size=batch_size,
            lr=lr,
            schedule=scheduler,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            gradient_accumulation_steps=gradient_accumulation_steps,
            seed=seed,
            output_dir=output_dir,
            resume=resume,
            on_log=lambda step, loss: (logged.append(loss), print_log(step, loss)),
            log_every=log_every,
            ddp_backend=ddp_backend,
            progress_bar=progress_bar,
            companions=[teacher],
        )
    finally:
        if checkpointed is not None:
            set_activation_checkpointing(checkpointed, False)
    if lora_rank is not None:
        model = merge_lora(model, teacher)
    if use_cache is not None:  # Trainer turns the cache off for training; generation wants it back
        model.config.use_cache = use_cache
    model.to(student_device).eval()
    teacher.to(teacher_device)
    return DistillResult(
        model=model,
        steps=output.steps,
        losses=logged,
        seconds=output.seconds,
        lora_rank=lora_rank,
        trainable_parameters=sum(p.numel() for p in trainable),
        gradient_checkpointing=checkpointed is not None,
    )


def distill_run(
    student: nn.Module,
    teacher: nn.Module,
    examples: Sequence[dict[str, torch.Tensor]],
    objective: Objective,
    settings: Any,
    *,
    steps: int,
    lr: float,
    logs: int = 10,
    echo: Callable[[str], None] | None = None,
    **options: Any,
) -> DistillResult:
    """A recipe run's recovery: :func:`distill` of every weight of `student` (or LoRA adapters), with the run's
    ``batch_size`` (in forwards of ``micro_batch``: :func:`~headkit.recipes.settings.training_forwards`),
    ``lora_rank``, ``seed`` and, where it has one, ``gradient_accumulation_steps`` from `settings`, logged `logs` times; ``options``: :func:`distill`'s others. The result's model comes back
    frozen (no gradients), ready to be measured."""
    student.requires_grad_(True)
    per_forward, forwards = training_forwards(settings, _example_tokens(examples))
    result = distill(
        student,
        teacher,
        examples,
        objective=objective,
        steps=steps,
        lr=lr,
        batch_size=per_forward,
        gradient_accumulation_steps=forwards,
        # a recipe that resolves a default rank by the model's kind (prune) passes it
        lora_rank=options.pop("lora_rank", settings.lora_rank),
        seed=settings.seed,
        gradient_checkpointing=getattr(settings, "gradient_checkpointing", False),
        log_every=max(1, steps // logs),
        echo=echo,
        **options,
    )
    result.model.requires_grad_(False)
    return result


def _example_tokens(examples: Sequence[Any]) -> int:
    """Tokens of one training example (its first tensor's length; 1 for anything else), which sets the default
    examples per forward (:func:`~headkit.recipes.settings.default_micro_batch`)."""
    first = examples[0] if len(examples) else None
    tensors = [v for v in first.values() if isinstance(v, torch.Tensor)] if isinstance(first, dict) else []
    return int(tensors[0].shape[-1]) if tensors and tensors[0].dim() else 1


def _checkpointed_model(student: nn.Module, *, required: bool) -> nn.Module | None:
    """The 🤗 model whose decoder layers :func:`distill`'s ``gradient_checkpointing`` recomputes (a PEFT wrapper's
    base model); where it has none, None, or a refusal in one line when `required`."""
    model = student.get_base_model() if hasattr(student, "get_base_model") else student
    if not getattr(model, "supports_gradient_checkpointing", False) or not hasattr(
        model, "gradient_checkpointing_enable"
    ):
        if not required:
            return None
        raise HeadkitError(
            f"gradient_checkpointing: {type(model).__name__} does not support 🤗 gradient checkpointing"
        )
    return model


def _with_lora(student: nn.Module, rank: int, alpha: float | None) -> nn.Module:
    targets = lora_target_modules(student)
    if not targets:
        raise HeadkitError(f"lora_rank: found no linear layer in {type(student).__name__} that LoRA can wrap")
    return with_lora(student, targets, rank=rank, alpha=alpha, option="lora_rank")


def merge_lora(model: nn.Module, teacher: nn.Module) -> nn.Module:
    """PEFT's ``merge_and_unload`` of a LoRA-wrapped student: the adapters added into the weights they wrap,
    each of which first gets a copy of its own where it is still the teacher's tensor (a student made by
    :func:`headkit.runs.models.shared_copy`), so the merge leaves the teacher as it was."""
    wrapped = [
        parameter
        for module in model.modules()
        if hasattr(module, "lora_A") and hasattr(module, "get_base_layer")
        for parameter in module.get_base_layer().parameters()
    ]
    unshare_weights(model, teacher, wrapped)
    return model.merge_and_unload()


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


def encoder_finetune(
    student: nn.Module,
    teacher: nn.Module,
    batches: list[dict],
    *,
    steps: int,
    lr: float,
    lora_rank: int | None = None,
    batch_size: int | None = None,
    gradient_accumulation_steps: int = 1,
    seed: int = 0,
    echo: Callable[[str], None] | None = None,
    gradient_checkpointing: bool | None = False,
) -> DistillResult:
    """`steps` distillation steps of an encoder `student` (every weight, in place; or LoRA adapters of
    `lora_rank`, merged) against `teacher` on fixed-shape `batches` (re-batched at `batch_size`, default theirs)
    with :class:`~headkit.runs.objectives.EncoderObjective`, logged every steps/5; the result's model is the
    student (the same object unless LoRA merged it). No step when `steps` or `lr` is 0."""
    if steps <= 0 or lr <= 0:
        return DistillResult(student, 0, lora_rank=lora_rank)
    student.requires_grad_(True)
    return distill(
        student,
        teacher,
        split_batches(batches),
        objective=EncoderObjective(),
        steps=steps,
        lr=lr,
        batch_size=batch_size or (len(batches[0]["input_ids"]) if batches else 1),
        gradient_accumulation_steps=gradient_accumulation_steps,
        lora_rank=lora_rank,
        seed=seed,
        log_every=max(1, steps // 5),
        echo=echo,
        gradient_checkpointing=gradient_checkpointing,
    )
