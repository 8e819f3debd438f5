"""Pruning a sentence encoder: :func:`prune_encoder_heads`, the workflow ``headkit prune``, the demo and
``headkit bench prune`` share (L0 gates trained with the weights, or importance, then the heads removed
physically), and the recipe's steps for an encoder (:class:`EncoderPruneSteps`: the gated cut, the original's
weights refit in closed form where that is closer, a short distillation of embeddings, the measurements).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.evaluation.quality import embedding_cosine, last_hidden_states
from headkit.evaluation.timing import time_call
from headkit.recipes.distill import encoder_finetune
from headkit.recipes.gates import GateTrainingLog
from headkit.recipes.prune_gates import echo_gate_progress, gate_log, train_head_gates
from headkit.recipes.prune_plan import keep_top_gated_heads
from headkit.recipes.prune_settings import METHODS, held_out_count, recovery_lora_rank, recovery_lr
from headkit.recipes.prune_steps import PruneSteps
from headkit.recipes.settings import training_forwards
from headkit.runs.models import ENCODER
from headkit.runs.objectives import EncoderObjective
from headkit.runs.text import load_text, text_chunks, tokenize_batches
from headkit.surgery.adapters import count_parameters, get_adapter
from headkit.surgery.apply import apply_
from headkit.surgery.gating import gate_values, remove_head_gates
from headkit.surgery.pruning import PruneConfig, heads_per_layer
from headkit.surgery.repair import output_statistics, refit_output_projections


@dataclass
class EncoderHeadPruning:
    """What :func:`prune_encoder_heads` did: the pruned copy, the plan ({layer: heads removed}), the heads kept
    per layer, and for L0 gates their training log and their values before removal."""

    model: nn.Module
    plan: dict[int, list[int]]
    kept: dict[int, list[int]]
    gate_log: GateTrainingLog | None = None
    final_gates: dict[int, list[float]] | None = None


def prune_encoder_heads(
    teacher: nn.Module,
    batches: list[dict],
    keep: int,
    *,
    method: str = "l0",
    importance: Any = None,
    gate_steps: int = 300,
    gate_lr: float = 0.1,
    weight_lr: float = 0.0,
    fold: bool = True,
    seed: int = 0,
    gradient_accumulation_steps: int = 1,
    log_every: int | None = None,
    callback: Callable[[int, GateTrainingLog], None] | None = None,
    adapter: Any = None,
) -> EncoderHeadPruning:
    """The encoder prune workflow (``headkit prune``, the demo, ``headkit bench prune``): choose `keep` heads of a
    sentence encoder and remove the rest physically from a copy of `teacher` (layers may empty).

    ``method="l0"``: Hard Concrete gates trained under the L0 constraint
    (:func:`~headkit.recipes.prune_gates.train_head_gates`, with :class:`~headkit.runs.objectives.EncoderObjective`
    on `batches`; the weights too when `weight_lr` > 0), the top heads by log α kept, the gates then folded into the
    weights (`fold`) or dropped. ``method="importance"``: the top heads of `importance`
    (:class:`headkit.analysis.importance.HeadImportance`). Recovery is the caller's next step
    (:func:`headkit.recipes.distill.encoder_finetune`), after it measured the pruned model."""
    adapter = get_adapter(teacher, adapter)
    if method not in METHODS:
        raise HeadkitError(f"method must be one of {METHODS}, got {method!r}")
    log = final_gates = None
    if method == "l0":
        student, log = train_head_gates(
            teacher,
            batches,
            EncoderObjective(),
            keep,
            steps=gate_steps,
            gate_lr=gate_lr,
            weight_lr=weight_lr,
            seed=seed,
            gradient_accumulation_steps=gradient_accumulation_steps,
            log_every=log_every,
            callback=callback,
            adapter=adapter,
        )
        final_gates = gate_values(student, adapter)
        plan = keep_top_gated_heads(student, keep, adapter)
        # Off before the cut: folding scales whole heads' columns, so it commutes with removing heads, and a layer
        # the cut empties has no projection columns left to fold into.
        remove_head_gates(student, fold=fold, adapter=adapter)
    else:
        if importance is None:
            raise HeadkitError(
                "method='importance' needs the heads' importance (headkit.analysis.head_importance)"
            )
        student = copy.deepcopy(teacher)
        plan = importance.pruning_plan(keep, allow_empty_layers=True)
    pruned = apply_(student, PruneConfig(heads=plan, allow_empty_layers=True), adapter=adapter)
    return EncoderHeadPruning(student, plan, pruned.kept, log, final_gates)


class EncoderPruneSteps(PruneSteps):
    """Hard Concrete gates trained with the weights towards the kept count, folded in and cut; then the same heads
    cut from the original's weights with the output projections and biases refit in closed form, kept where that
    is closer to the original (:meth:`repair`); then a short distillation of embeddings."""

    def check(self) -> None:
        super().check()
        settings = self.settings
        if settings.unit != "query" or settings.uniform:
            raise HeadkitError("--unit group and --uniform are for causal LMs with grouped-query attention")
        self.method = settings.method or "l0"
        if self.method != "l0":
            raise HeadkitError(
                f"--method {self.method} is for causal LMs; encoders are pruned with L0 gates (--method l0)"
            )
        self.teacher.requires_grad_(False)

    def data(self) -> None:
        settings, tokenizer = self.settings, self.tokenizer
        train_texts, held_out_texts = text_chunks(
            load_text(settings.data), settings.train_texts, held_out_count(settings, ENCODER), settings.seed
        )
        self.train = tokenize_batches(tokenizer, train_texts, settings.batch_size, settings.max_length)
        self.held_out = tokenize_batches(tokenizer, held_out_texts, settings.batch_size, settings.max_length)
        if not self.train or not self.held_out:
            raise HeadkitError(
                "--batch-size is larger than --held-out or --train-texts: each needs at least one full batch of "
                "texts"
            )
        self.echo(
            f"{self.loaded.source}: {sum(self.heads_before.values())} heads in {len(self.heads_before)} layers; "
            f"keeping {self.keep}"
        )
        # once, for the pruned and the recovered student
        self.reference = last_hidden_states(self.teacher, self.held_out)

    def convert(self) -> None:
        settings = self.settings
        self.echo(
            f"training head gates and weights for {settings.gate_steps} steps towards {self.keep} heads"
        )
        pruning = prune_encoder_heads(
            self.teacher,
            self.train,
            self.keep,
            method=self.method,
            gate_steps=settings.gate_steps,
            gate_lr=settings.gate_lr,
            weight_lr=recovery_lr(settings, ENCODER),
            fold=True,
            seed=settings.seed,
            gradient_accumulation_steps=settings.gradient_accumulation_steps,
            callback=echo_gate_progress(self.echo, settings.gate_steps),
            adapter=self.adapter,
        )
        self.student, self.plan = pruning.model, pruning.plan
        self.selection = {"method": self.method, "gates": gate_log(pruning.gate_log)}
        self.cosine_pruned = embedding_cosine(self.student, self.reference, self.held_out)

    def repair(self) -> dict[str, Any] | None:
        """The original's weights with the gates' heads removed and the output projections (and their biases:
        FLAP's compensation) refit by least squares on the original's activations, in place of the weights the gates
        trained, where that is closer to the original on held-out texts (MiniLM, half of the heads: 0.940 against
        the gated weights' 0.850, measured). A refit of the gated weights themselves lowered it: the rest of their
        network had adapted to the cut."""
        settings = self.settings
        if not settings.repair:
            return None
        started = time.perf_counter()
        calibration = self.train[: settings.importance_batches]
        statistics = output_statistics(self.teacher, calibration, self.adapter)
        candidate = copy.deepcopy(self.teacher)
        apply_(candidate, PruneConfig(heads=self.plan, allow_empty_layers=True), adapter=self.adapter)
        repair = refit_output_projections(candidate, statistics, self.plan, self.adapter)
        repair.seconds = time.perf_counter() - started
        self.echo(str(repair))
        cosine = embedding_cosine(candidate, self.reference, self.held_out)
        report = repair.to_dict() | {
            "fidelity_mean_cosine": float(cosine.mean()),
            "fidelity_mean_cosine_gated": float(self.cosine_pruned.mean()),
        }
        if cosine.mean() > self.cosine_pruned.mean():
            self.student = candidate
        else:  # the gated weights are closer: kept, and said
            report["skipped"] = "the gated weights are closer to the original on held-out texts; kept"
        self.echo(
            f"held-out cosine: gated weights {report['fidelity_mean_cosine_gated']:.4f}, original's weights "
            f"refit {report['fidelity_mean_cosine']:.4f}"
            + (f" ({report['skipped']})" if "skipped" in report else "")
        )
        return report

    def recover(self) -> None:
        settings = self.settings
        per_forward, forwards = training_forwards(settings, settings.max_length)
        self.recovery = encoder_finetune(
            self.student,
            self.teacher,
            self.train,
            steps=settings.recovery_steps,
            lr=recovery_lr(settings, ENCODER),
            batch_size=per_forward,
            gradient_accumulation_steps=forwards,
            lora_rank=recovery_lora_rank(settings, ENCODER),
            seed=settings.seed,
            echo=self.echo,
            gradient_checkpointing=settings.gradient_checkpointing,
        )
        self.student = self.recovery.model
        self.student.requires_grad_(False)

    def measure(self) -> None:
        settings, teacher, student = self.settings, self.teacher, self.student
        cosine = embedding_cosine(student, self.reference, self.held_out)
        batch = self.held_out[0]
        repeats = 2 * settings.timing_rounds + 1
        forward_before = time_call(lambda: _forward(teacher, batch), repeats=repeats, warmup=0).median_s
        forward_after = time_call(lambda: _forward(student, batch), repeats=repeats, warmup=0).median_s
        self.report |= {
            "kind": self.loaded.kind,
            "architecture": self.adapter.name,
            "heads_before": self.heads_before,
            "heads_after": heads_per_layer(student, self.adapter),
            "target_heads": self.keep,
            "pruned": {str(k): v for k, v in self.plan.items()},
            "fidelity_mean_cosine_pruned": float(self.cosine_pruned.mean()),
            "fidelity_mean_cosine": float(cosine.mean()),
            "fidelity_min_cosine": float(cosine.min()),
            "parameters_before": count_parameters(teacher),
            "parameters_after": count_parameters(student),
            "forward_ms_before": 1000 * forward_before,
            "forward_ms_after": 1000 * forward_after,
            "selection": self.selection,
            "recovery": self.recovery.to_dict(),
        }


@torch.no_grad()
def _forward(model: nn.Module, batch: dict) -> Any:
    return model(**batch)


__all__ = [
    "EncoderHeadPruning",
    "EncoderPruneSteps",
    "prune_encoder_heads",
]
