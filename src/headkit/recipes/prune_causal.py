"""The pruning recipe's steps for a causal LM (:class:`CausalLMPruneSteps`): heads ranked by the repaired
removal's cost (the refit's error weighed by the loss's gradient), gradient importance or Hard Concrete gates
(:mod:`headkit.recipes.prune_plan`), removed as query heads or whole key/value groups (optionally to the stock
architecture), the output projections refit in closed form, recovered by distillation and measured: perplexity,
agreement, speed, KV-cache bytes, greedy samples.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from headkit.analysis.importance import head_importance
from headkit.errors import HeadkitError
from headkit.evaluation.memory import kv_cache_bytes_per_token
from headkit.evaluation.quality import agreement, perplexity
from headkit.evaluation.sampling import greedy_sample
from headkit.evaluation.timing import compare_speed
from headkit.recipes.distill import distill_run
from headkit.recipes.prune_gates import echo_gate_progress, gate_log, train_head_gates
from headkit.recipes.prune_plan import plan_pruning
from headkit.recipes.prune_report import family_notes
from headkit.recipes.prune_settings import held_out_count, recovery_lora_rank, recovery_lr
from headkit.recipes.prune_steps import PruneSteps
from headkit.runs.models import CAUSAL_LM, shared_copy
from headkit.runs.objectives import CausalLMObjective
from headkit.runs.text import calibration_batches, lm_windows, load_text, window_batches
from headkit.surgery.adapters import count_parameters
from headkit.surgery.apply import apply_
from headkit.surgery.families import PRUNE, get_family
from headkit.surgery.gating import head_gates
from headkit.surgery.pruning import (
    PruneConfig,
    heads_per_layer,
    kv_heads_per_layer,
    query_to_kv_heads,
    to_stock_architecture,
)
from headkit.surgery.repair import output_statistics, refit_error_scores, refit_output_projections

SAMPLE_PROMPT = "def fibonacci(n):\n"


class CausalLMPruneSteps(PruneSteps):
    """Heads ranked by the repaired removal's cost, importance or gates, removed, the output projections refit,
    recovered by distillation."""

    def check(self) -> None:
        super().check()
        settings = self.settings
        sites = self.adapter.sites(self.teacher)
        self.kv_of_query = [query_to_kv_heads(site) for site in sites]
        # Measured on SmolLM2 (docs/pruning.md), repaired, before any training: the loss-weighted refit ranking
        # 1.09× / 1.46× / 1.31× for a quarter of the query heads, half of them, one KV group per layer, against
        # importance's 1.20× / 2.20× / 1.61×. Without the repair there is no refit to rank by.
        self.method = settings.method or ("refit" if settings.repair else "importance")
        self.statistics = (
            None  # the repair's calibration statistics, once measured (the refit ranking needs them)
        )
        # Validate the plan's shape before any work: random scores exercise every count check.
        plan_pruning(
            [torch.zeros(len(kv)) for kv in self.kv_of_query],
            self.kv_of_query,
            self.keep,
            unit=settings.unit,
            uniform=settings.uniform,
        )
        self.teacher.requires_grad_(False)

    def data(self) -> None:
        settings, teacher = self.settings, self.teacher
        self.windows = lm_windows(
            self.tokenizer,
            load_text(settings.data),
            length=settings.window,
            train_windows=settings.train_texts,
            held_out_windows=held_out_count(settings, CAUSAL_LM),
            seed=settings.seed,
        )
        self.echo(
            f"{self.loaded.source}: {sum(self.heads_before.values())} query heads in {len(self.kv_of_query)} layers "
            f"({sum(len(set(kv)) for kv in self.kv_of_query)} key/value heads); keeping {self.keep} "
            f"({settings.unit} unit{', uniform' if settings.uniform else ''}), ranked by {self.method}; "
            f"{len(self.windows.train)} training and {len(self.windows.held_out)} held-out windows of "
            f"{settings.window} tokens"
        )
        self.objective = CausalLMObjective(settings.temperature, settings.hidden_weight)
        self.eval_batch = max(1, min(settings.batch_size, 8))
        self.perplexity_original = perplexity(teacher, self.windows.held_out, self.eval_batch)
        self.echo(f"held-out perplexity of the original: {self.perplexity_original:.3f}")

    def convert(self) -> None:
        settings, teacher, adapter, echo = self.settings, self.teacher, self.adapter, self.echo
        selection_started = time.perf_counter()
        selection: dict[str, Any] = {"method": self.method}
        if self.method == "importance":
            calibration = calibration_batches(
                self.windows.train, settings.batch_size, settings.importance_batches
            )
            importance = head_importance(teacher, calibration, attention_stats=False, adapter=adapter)
            scores = importance.importance
            selection["importance_batches"] = len(calibration)
        elif self.method == "refit":
            calibration = calibration_batches(
                self.windows.train, settings.batch_size, settings.importance_batches
            )
            # Each removal's error after the repair, weighed token by token by the loss's gradient: in the loss's
            # units, so it also sets how many heads each layer gives up.
            self.statistics = output_statistics(teacher, calibration, adapter, gradients=True)
            scores = refit_error_scores(
                self.statistics, self.kv_of_query, unit=settings.unit, weighting="loss"
            )
            selection["weighting"] = "loss"
            selection["importance_batches"] = len(calibration)
        else:
            echo(f"training head gates for {settings.gate_steps} steps towards {self.keep} heads")
            gated, log = train_head_gates(
                teacher,
                window_batches(self.windows.train, settings.batch_size),
                self.objective,
                self.keep,
                steps=settings.gate_steps,
                gate_lr=settings.gate_lr,
                seed=settings.seed,
                gradient_accumulation_steps=settings.gradient_accumulation_steps,
                callback=echo_gate_progress(echo, settings.gate_steps),
                adapter=adapter,
            )
            gates = head_gates(gated, adapter)
            # A layer without heads has no gate: its scores stay empty so that scores[i] is layer i's.
            scores = [
                gates[i].log_alpha.detach().clone() if i in gates else torch.zeros(0)
                for i in range(len(self.kv_of_query))
            ]
            selection["gates"] = gate_log(log)
        selection["scores"] = [s.tolist() for s in scores]
        selection["seconds"] = time.perf_counter() - selection_started
        self.selection = selection
        self.plan = plan_pruning(
            scores, self.kv_of_query, self.keep, unit=settings.unit, uniform=settings.uniform
        )

        # Held once: the surgery replaces the projections it cuts, so the rest stays the original's tensors until
        # a training (headkit.recipes.distill) gives the student copies of what it changes.
        self.student = shared_copy(teacher)
        config = PruneConfig(
            heads=self.plan,
            allow_empty_layers=not settings.uniform,
            unit=settings.unit,
            uniform=settings.uniform,
        )
        self.pruned = apply_(self.student, config, adapter=adapter)
        self.stock_config = None
        if settings.uniform:
            try:
                self.stock_config = to_stock_architecture(self.student, adapter)
            except HeadkitError as exc:
                echo(f"not the stock architecture ({exc}); reload with headkit.from_pretrained")
        echo(str(self.pruned))
        self.perplexity_pruned = perplexity(self.student, self.windows.held_out, self.eval_batch)
        echo(
            f"held-out perplexity after pruning: {self.perplexity_pruned:.3f} "
            f"({self.perplexity_pruned / self.perplexity_original:.2f}x)"
        )

    def repair(self) -> dict[str, Any] | None:
        """Closed form before any training: the projections see what the removed heads said."""
        settings = self.settings
        if not settings.repair:
            return None
        calibration = calibration_batches(
            self.windows.train, settings.batch_size, settings.importance_batches
        )
        started = time.perf_counter()
        # The refit ranking measured the same statistics already; its per-token samples are not needed after it.
        statistics = self.statistics or output_statistics(self.teacher, calibration, self.adapter)
        self.statistics = None
        repair = refit_output_projections(self.student, statistics, self.plan, self.adapter)
        repair.seconds = time.perf_counter() - started
        self.echo(str(repair))
        report = repair.to_dict() | {
            "perplexity": perplexity(self.student, self.windows.held_out, self.eval_batch)
        }
        self.echo(
            f"held-out perplexity after repair: {report['perplexity']:.3f} "
            f"({report['perplexity'] / self.perplexity_original:.2f}x)"
        )
        return report

    def recover(self) -> None:
        settings = self.settings
        self.sample_pruned = greedy_sample(self.student, self.tokenizer, SAMPLE_PROMPT)
        lora_rank = recovery_lora_rank(settings, CAUSAL_LM)
        self.echo(
            f"recovery: {settings.recovery_steps} distillation steps"
            + (f" (LoRA rank {lora_rank})" if lora_rank else " (every weight)")
        )
        self.recovery = distill_run(
            self.student,
            self.teacher,
            self.windows.train,
            self.objective,
            settings,
            steps=settings.recovery_steps,
            lr=recovery_lr(settings, CAUSAL_LM),
            lora_rank=lora_rank,
            echo=self.echo,
            scheduler="cosine" if settings.recovery_steps >= 10 else "constant",
            warmup_steps=min(10, settings.recovery_steps // 10),
        )
        self.student = self.recovery.model

    def measure(self) -> None:
        settings, teacher, student, adapter = self.settings, self.teacher, self.student, self.adapter
        held_out, original = self.windows.held_out, self.perplexity_original
        perplexity_recovered = perplexity(student, held_out, self.eval_batch)
        self.echo(
            f"held-out perplexity after recovery: {perplexity_recovered:.3f} "
            f"({perplexity_recovered / original:.2f}x)"
        )
        top1 = agreement(student, teacher, held_out, self.eval_batch).top1
        speed = compare_speed(
            teacher,
            student,
            prefill_ids=held_out[:1],
            decode_context=settings.decode_context,
            rounds=settings.timing_rounds,
        )
        family = get_family(teacher, PRUNE)
        self.report |= {
            "kind": self.loaded.kind,
            "architecture": adapter.name,
            "family": family.model_type,
            "notes": family_notes(family),
            "unit": settings.unit,
            "uniform": settings.uniform,
            "stock_architecture": self.stock,
            "stock_config": self.stock_config,
            "heads_before": self.heads_before,
            "heads_after": heads_per_layer(student, adapter),
            "kv_heads_before": self.pruned.kv_heads_before,
            "kv_heads_after": kv_heads_per_layer(student, adapter),
            "target_heads": self.keep,
            "pruned": {str(k): v for k, v in self.plan.items()},
            "parameters_before": count_parameters(teacher),
            "parameters_after": count_parameters(student),
            "kv_cache_bytes_per_token_before": kv_cache_bytes_per_token(teacher),
            "kv_cache_bytes_per_token_after": kv_cache_bytes_per_token(student),
            "perplexity_original": original,
            "perplexity_pruned": self.perplexity_pruned,
            "perplexity_recovered": perplexity_recovered,
            "top1_agreement": top1,
            "speed": speed,
            "sample_original": greedy_sample(teacher, self.tokenizer, SAMPLE_PROMPT),
            "sample_pruned": self.sample_pruned,
            "sample_recovered": greedy_sample(student, self.tokenizer, SAMPLE_PROMPT),
            "sample_prompt": SAMPLE_PROMPT,
            "data": self.windows.summary(),
            "selection": self.selection,
            "recovery": self.recovery.to_dict(),
        }

    @property
    def stock(self) -> bool:
        return self.stock_config is not None


__all__ = [
    "CausalLMPruneSteps",
    "SAMPLE_PROMPT",
]
