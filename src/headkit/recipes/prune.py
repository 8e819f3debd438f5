"""The pruning recipe (``headkit prune``): choose heads, remove them physically, recover by distillation.

Sentence encoders (the default, all-MiniLM-L6-v2): Hard Concrete gates on every head trained with the weights
under a Lagrangian L0 constraint towards ``heads`` open heads (Voita et al. 2019; Wang, Wohlwend & Lei 2020,
Eq. 4), the top heads by log α kept, the gates folded in, and a short distillation of embeddings.

Causal LMs (every decoder family of :mod:`headkit.surgery.families`: LLaMA, Mistral, Qwen 2/3, Gemma 2/3, OLMo 2,
Phi-3, GPT-NeoX, GPT-2, …; a folder or a GGUF file): heads are ranked by what removing them costs the loss
after the closed-form repair (the default with the repair: the refit's error weighed token by token by the loss's
gradient, :func:`headkit.surgery.repair.refit_error_scores`, one forward and backward pass over the calibration
batches), by gradient importance of the language-model loss (Michel, Levy & Neubig 2019; the default with
``repair=False``) or by Hard Concrete gates trained alone under the L0 constraint with the distillation
objective, then

- ``unit="query"`` removes query heads (a key/value head goes with the last query head that reads it);
  ``unit="group"`` removes whole key/value groups — a KV head and every query head reading it — which shrinks
  the KV cache;
- ``uniform=True`` removes the same number from every layer, evenly across groups, so the result is the
  *stock* architecture (e.g. ``LlamaConfig`` with fewer heads, ``head_dim`` kept) that plain transformers loads;
  otherwise the most important heads over all layers are kept (layers may empty) and the model reloads with
  :func:`headkit.from_pretrained`.

Recovery: KL(teacher ‖ student) on next-token distributions (:class:`~headkit.runs.objectives.CausalLMObjective`)
through :func:`~headkit.recipes.distill.distill`, on LoRA adapters merged afterwards (a causal LM's default, rank
16: ``lora_rank``) or on every weight (an encoder's default; ``lora_rank=0``) — LLM-Pruner's recipe (Ma, Fang &
Wang 2023: structural pruning, then LoRA recovery).
The report holds parameters, KV-cache bytes per token, held-out perplexity (original, pruned, recovered), prefill
and decode times relative to the original and greedy samples; the folder is written atomically.

The recipe in modules: its settings and their checks (:mod:`headkit.recipes.prune_settings`), choosing the heads
(:mod:`headkit.recipes.prune_plan`), Hard Concrete gate training (:mod:`headkit.recipes.prune_gates`), the steps
both kinds of model share (:mod:`headkit.recipes.prune_steps`), a causal LM's (:mod:`headkit.recipes.prune_causal`)
and an encoder's (:mod:`headkit.recipes.prune_encoder`), the printed report (:mod:`headkit.recipes.prune_report`).
This module runs it: :func:`prune` and :func:`run`, the preflight, and which steps a model takes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from headkit.evaluation.tasks import with_task_table
from headkit.recipes.prune_causal import CausalLMPruneSteps
from headkit.recipes.prune_encoder import EncoderPruneSteps
from headkit.recipes.prune_report import format_report
from headkit.recipes.prune_settings import PruneSettings, check_settings, preflight
from headkit.recipes.settings import RecipeResult
from headkit.recipes.steps import Recipe, Steps, run_settings
from headkit.runs.models import LoadedModel, default_encoder_path


class PruneResult(RecipeResult):
    """What :func:`prune` did and measured; ``report`` is what report.json holds."""

    def __str__(self) -> str:
        return with_task_table(format_report(self.report), self.report)


def prune(
    settings: PruneSettings | None = None,
    echo: Callable[[str], None] = print,
    *,
    loaded: LoadedModel | None = None,
    **overrides: Any,
) -> PruneResult:
    """Run the recipe (see the module docstring); the result's model is the pruned, recovered student, also saved
    with its tokenizer and report.json to ``settings.out``. Nothing is written when any step fails. `loaded`: the
    model already loaded from ``settings.model`` (left unchanged), to spare loading it again."""
    return PruneResult(*run_settings(RECIPE, settings, overrides, echo, loaded=loaded, save=True))


def run(
    settings: PruneSettings | None = None,
    echo: Callable[[str], None] = print,
    *,
    loaded: LoadedModel | None = None,
    **overrides: Any,
) -> PruneResult:
    """Prune, recover and measure like :func:`prune`, but write nothing (``settings.out`` is unused).
    `loaded`: the model already loaded from ``settings.model`` (left unchanged), to spare loading it again."""
    return PruneResult(*run_settings(RECIPE, settings, overrides, echo, loaded=loaded))


def _steps(
    settings: PruneSettings, model_path: Path, loaded: LoadedModel, echo: Callable[[str], None]
) -> Steps:
    steps = CausalLMPruneSteps if loaded.is_causal_lm else EncoderPruneSteps
    return steps(settings, model_path, loaded, echo)


RECIPE = Recipe(preflight, _steps, PruneSettings, check_settings, default_encoder_path)


__all__ = [
    "PruneResult",
    "PruneSettings",
    "preflight",
    "prune",
    "run",
]
