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
through :func:`~headkit.recipes.distill.distill`, on every weight or on LoRA adapters (``lora_rank``) merged
afterwards — LLM-Pruner's recipe (Ma, Fang & Wang 2023: structural pruning, then LoRA recovery).
The report holds parameters, KV-cache bytes per token, held-out perplexity (original, pruned, recovered), prefill
and decode times relative to the original and greedy samples; the folder is written atomically.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.analysis.importance import head_importance
from headkit.errors import HeadkitError
from headkit.evaluation.memory import kv_cache_bytes_per_token
from headkit.evaluation.quality import agreement, embedding_cosine, last_hidden_states, perplexity
from headkit.evaluation.sampling import greedy_sample
from headkit.evaluation.tasks import check_recipe_tasks, with_task_table
from headkit.evaluation.timing import compare_speed, time_call
from headkit.export.gguf import check_export_target, export_gguf
from headkit.recipes.distill import distill_run, encoder_finetune
from headkit.recipes.gates import GateTrainingLog, train_gates_to_budget
from headkit.recipes.options import option, option_name, with_fields_of
from headkit.recipes.settings import QuickSettings, RecipeResult, check_count, check_data
from headkit.recipes.steps import Recipe, Steps, run_settings
from headkit.runs.models import (
    CAUSAL_LM,
    ENCODER,
    LoadedModel,
    default_encoder_path,
    model_kind,
)
from headkit.runs.objectives import CausalLMObjective, EncoderObjective
from headkit.runs.text import (
    calibration_batches,
    lm_windows,
    load_text,
    text_chunks,
    tokenize_batches,
    window_batches,
)
from headkit.surgery.adapters import count_parameters, get_adapter
from headkit.surgery.apply import apply_
from headkit.surgery.families import PRUNE, DecoderFamily, get_family, text_config
from headkit.surgery.gating import (
    GateConfig,
    gate_values,
    head_gates,
    remove_head_gates,
)
from headkit.surgery.pruning import (
    PruneConfig,
    check_prunable,
    heads_per_layer,
    kv_heads_per_layer,
    query_to_kv_heads,
    to_stock_architecture,
)
from headkit.surgery.repair import (
    output_statistics,
    refit_error_scores,
    refit_output_projections,
)

METHODS = ("importance", "l0", "refit")
SAMPLE_PROMPT = "def fibonacci(n):\n"


@dataclass
@with_fields_of(PruneConfig, names=("unit", "uniform"))
class PruneSettings(QuickSettings):
    """Settings of one pruning run (``headkit prune --help`` documents each)."""

    model: Path | None = None
    out: Path = Path("results/pruned-model")
    heads: int | None = option(None, "Query heads to keep in all (default: half of them).")
    # unit, uniform: PruneConfig's fields (with_fields_of), recorded with the pruning
    # None: "l0" for encoders; for causal LMs "refit" with the repair, "importance" without (--no-repair)
    method: str | None = option(
        None,
        "Head ranking: 'refit' (causal LMs, the default with the repair: the error each removal leaves after the "
        "least-squares repair, weighed token by token by the loss's gradient, chooses the heads and how many each "
        "layer gives up), 'importance' (gradient importance; the default for causal LMs with --no-repair) or "
        "'l0' gates (encoders).",
    )
    data: Path | None = option(
        None, "Text to train and measure on: a file, a folder of them, or JSONL with a 'text' field."
    )
    gate_steps: int = option(300, "Gate training steps.", flag="--steps", min=0, quick=60)
    recovery_steps: int = option(
        100, "Distillation steps after removal.", min=0, removed=("--finetune-steps",), quick=20
    )
    lora_rank: int | None = option(None, "Recover through LoRA of this rank (PEFT), merged after.", min=1)
    # None: 1e-4 full fine-tuning, 1e-3 LoRA
    lr: float | None = option(None, "Recovery learning rate (default 1e-4; 1e-3 with LoRA).", min=0.0)
    gate_lr: float = option(0.1, "Learning rate of the gates' log alpha.", min=0.0)
    batch_size: int = option(16, "Texts or windows per step.", min=1, quick=8)
    gradient_accumulation_steps: int = option(
        1, "Forwards per optimizer step.", flag="--gradient-accumulation", min=1
    )
    # tokens per text (encoders)
    max_length: int = field(default=64, metadata={"quick": 48})
    # tokens per window (causal LMs)
    window: int = option(256, "Tokens per causal-LM window.", min=2, quick=128)
    # encoder texts, or causal-LM windows
    train_texts: int = option(1024, "Training texts or windows.", min=1, quick=128)
    # None: 256 encoder texts, 64 causal-LM windows
    held_out_texts: int | None = option(
        None,
        "Held-out texts or windows measured on (default 256 texts / 64 windows; 16 with --quick).",
        flag="--held-out",
        min=1,
        quick=16,
    )
    importance_batches: int = field(default=8, metadata={"quick": 2})
    temperature: float = option(1.0, "Distillation temperature of the causal-LM objective, > 0.")
    hidden_weight: float = 0.0
    seed: int = option(0, "Seed of the sampling, the gate noise and the training order.")
    overwrite: bool = False
    # also write the result as a GGUF file for llama.cpp (export.gguf)
    export_gguf: Path | None = option(
        None, "Also write the result as a GGUF file for llama.cpp (see `headkit export`)."
    )
    export_type: str = option("f16", "Weight type of --export-gguf: f32, f16, bf16 or q8_0.")
    timing_rounds: int = field(default=3, metadata={"quick": 2})
    decode_context: int = field(default=512, metadata={"quick": 128})
    repair: bool = option(
        True,
        "Refit each pruned layer's output projection (and its bias, where it has one) by least squares on "
        "calibration text before recovery; encoders: on the original's weights, kept where closer than the gated "
        "ones (--no-repair keeps the sliced projections, to compare).",
    )
    # lm-evaluation-harness tasks scored on the original and the result (headkit.evaluation.tasks): none by default.
    eval_tasks: tuple[str, ...] = ()
    eval_include_path: Path | None = None


class PruneResult(RecipeResult):
    """What :func:`prune` did and measured; ``report`` is what report.json holds."""

    def __str__(self) -> str:
        return with_task_table(format_report(self.report), self.report)


# -- choosing heads ----------------------------------------------------------------------------------------------


def plan_pruning(
    scores: list[torch.Tensor],
    kv_of_query: list[list[int]],
    keep: int,
    *,
    unit: str = "query",
    uniform: bool = False,
) -> dict[int, list[int]]:
    """``{layer: [query heads to remove]}`` keeping `keep` query heads in all, by descending score.

    `scores[l][h]` ranks query head h of layer l (larger: more important; comparable across layers);
    `kv_of_query[l][h]` is the key/value head it reads. ``unit="group"`` scores a key/value group by its query
    heads' mean and removes whole groups. ``uniform`` keeps ``keep / layers`` heads in every layer, as many in
    each key/value group. Ties go to the lower layer and head. Invalid counts raise HeadkitError."""
    PruneConfig(unit=unit, uniform=uniform)  # the config checks its own fields
    layers = len(scores)
    total = sum(len(s) for s in scores)
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= total:
        raise HeadkitError(
            f"--heads must be in [1, {total}] (the model has {total} query heads), got {keep!r}"
        )
    groups = [_groups(kv) for kv in kv_of_query]
    if uniform:
        shapes = {(len(s), len(g)) for s, g in zip(scores, groups, strict=True)}
        if len(shapes) != 1:
            raise HeadkitError(
                f"--uniform needs the same heads in every layer, the model has {sorted(shapes)}"
            )
        heads, kv_heads = shapes.pop()
        group_size = heads // kv_heads
        if any(len(members) != group_size for layer in groups for members in layer.values()):
            raise HeadkitError(
                "--uniform needs every key/value group to serve as many query heads; this model's groups are "
                "unequal (pruned before?)"
            )
        if keep % layers:
            raise HeadkitError(
                f"--uniform: --heads {keep} is not the same number in each of the {layers} layers"
            )
        per_layer = keep // layers
        if unit == "group" and per_layer % group_size:
            raise HeadkitError(
                f"--unit group --uniform: {per_layer} heads per layer is not a whole number of key/value groups "
                f"of {group_size} query heads (use a multiple of {group_size * layers})"
            )
        if unit == "query" and per_layer % kv_heads:
            if group_size == 1:  # multi-head attention: a query head is a whole key/value group
                raise HeadkitError(
                    f"--uniform: every query head has its own key/value head in this model, so keeping {per_layer} "
                    f"of {heads} per layer removes whole groups: pass --unit group"
                )
            raise HeadkitError(
                f"--uniform: {per_layer} query heads per layer cannot be spread evenly over {kv_heads} key/value "
                f"groups (use a multiple of {kv_heads * layers}, or --unit group)"
            )
    elif unit == "group":
        sizes = {len(members) for layer in groups for members in layer.values()}
        if len(sizes) == 1 and keep % sizes.pop():
            raise HeadkitError(f"--unit group: --heads {keep} is not a whole number of key/value groups")

    plan: dict[int, list[int]] = {}
    if unit == "group":
        ranked = sorted(
            (-float(scores[layer][members].mean()), layer, kv)
            for layer, layer_groups in enumerate(groups)
            for kv, members in layer_groups.items()
        )
        if uniform:
            keep_groups = (keep // layers) // group_size
            for layer in range(layers):
                dropped = [kv for _, lay, kv in ranked if lay == layer][keep_groups:]
                plan[layer] = sorted(h for kv in dropped for h in groups[layer][kv].tolist())
        else:
            kept = 0
            for _, layer, kv in ranked:
                members = groups[layer][kv].tolist()
                if kept + len(members) <= keep:
                    kept += len(members)
                else:
                    plan.setdefault(layer, []).extend(members)
            if kept != keep:
                raise HeadkitError(
                    f"--unit group: no set of whole key/value groups holds exactly {keep} heads"
                )
    elif uniform:
        per_group = (keep // layers) // len(groups[0])
        for layer, layer_groups in enumerate(groups):
            for members in layer_groups.values():
                order = sorted(members.tolist(), key=lambda h, layer=layer: (-float(scores[layer][h]), h))
                plan.setdefault(layer, []).extend(order[per_group:])
    else:
        ranked = sorted(
            (-float(score), layer, head)
            for layer, s in enumerate(scores)
            for head, score in enumerate(s.tolist())
        )
        for _, layer, head in ranked[keep:]:
            plan.setdefault(layer, []).append(head)
    plan = {layer: sorted(heads) for layer, heads in sorted(plan.items()) if heads}
    kept = total - sum(len(heads) for heads in plan.values())
    if kept != keep:  # a guard: every branch above must keep exactly `keep`
        raise HeadkitError(f"the plan would keep {kept} query heads, not the {keep} asked for")
    return plan


def _groups(kv_of_query: list[int]) -> dict[int, torch.Tensor]:
    found: dict[int, list[int]] = {}
    for head, kv in enumerate(kv_of_query):
        found.setdefault(kv, []).append(head)
    return {kv: torch.tensor(heads) for kv, heads in sorted(found.items())}


def train_head_gates(
    teacher: nn.Module,
    batches: list[dict],
    objective: Callable,
    keep: int,
    *,
    weight_lr: float = 0.0,
    seed: int = 0,
    adapter: Any = None,
    **training: Any,
) -> tuple[nn.Module, GateTrainingLog]:
    """A copy of `teacher` with Hard Concrete gates on every head, trained (and its weights when `weight_lr` > 0)
    towards `keep` open heads under the L0 constraint with ``objective(student, teacher, batch)`` on `batches` as
    the task loss (:func:`headkit.recipes.gates.train_gates_to_budget`, which takes the other ``training``
    options: steps, gate_lr, log_every, …); returns (the gated copy, the log)."""
    training["log_every"] = training.get("log_every") or max(1, training["steps"] // 6)
    torch.manual_seed(seed)  # the gates' noise
    student = copy.deepcopy(teacher)
    student.requires_grad_(weight_lr > 0)
    apply_(student, GateConfig(kind="hard_concrete"), adapter=adapter)
    log = train_gates_to_budget(
        student,
        lambda model, batch: objective(model, teacher, batch),
        batches,
        target_heads=keep,
        weight_lr=weight_lr,
        seed=seed,
        companions=[teacher],
        **{"log_every": max(1, training["steps"] // 6)}
        | {k: v for k, v in training.items() if v is not None},
    )
    return student, log


def _gate_log(log: GateTrainingLog) -> dict[str, Any]:
    """The report's record of a gate training: steps, losses, expected heads and gate values at the end."""
    return {
        "steps": log.steps[-1],
        "losses": log.task_losses,
        "expected_heads_at_end": log.expected_heads[-1],
        "gate_values": [values for _, values in sorted(log.gate_values[-1].items())],
    }


def echo_gate_progress(
    echo: Callable[[str], None], steps: int, every: int = 1
) -> Callable[[int, GateTrainingLog], None]:
    """A :func:`train_gates_to_budget` callback that echoes the loss and the expected heads at logged steps that
    are multiples of `every`."""

    def report(step: int, log: GateTrainingLog) -> None:
        if step % every:
            return
        echo(
            f"  gate step {step}/{steps}: loss {log.task_losses[-1]:.4f}, expected heads "
            f"{log.expected_heads[-1]:.1f} (target {log.targets[-1]:.1f})"
        )

    return report


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

    ``method="l0"``: Hard Concrete gates trained under the L0 constraint (:func:`train_head_gates`, with
    :class:`~headkit.runs.objectives.EncoderObjective` on `batches`; the weights too when `weight_lr` > 0), the
    top heads by log α kept, the gates then folded into the weights (`fold`) or dropped. ``method="importance"``:
    the top heads of `importance` (:class:`headkit.analysis.importance.HeadImportance`). Recovery is the
    caller's next step (:func:`headkit.recipes.distill.encoder_finetune`), after it measured the pruned model."""
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


def heads_to_keep(
    heads: dict[int, int], kv_heads: dict[int, int], unit: str, fraction: float, uniform: bool
) -> int:
    """Query heads kept when `fraction` of them is pruned, as :func:`plan_pruning` can keep them: whole
    key/value groups for ``unit="group"``, the same count in every layer under `uniform` (rounded to whole
    groups, or to as many per group)."""
    layers, total = len(heads), sum(heads.values())
    per_layer, kv = max(heads.values()), max(kv_heads.values())
    group = per_layer // kv
    if unit == "group":
        groups_kept = max(1, round(kv * (1 - fraction)))
        return (
            layers * groups_kept * group
            if uniform
            else max(group, round(total * (1 - fraction) / group) * group)
        )
    if uniform:
        return layers * kv * max(1, round(per_layer * (1 - fraction) / kv))
    return max(1, round(total * (1 - fraction)))


def _weight_lr(settings: PruneSettings) -> float:
    if settings.lr is not None:
        return settings.lr
    return 1e-3 if settings.lora_rank else 1e-4


# -- the recipe ------------------------------------------------------------------------------------------------


def _option(name: str) -> str:
    """A setting's command-line option (its field declares a name other than --name-with-dashes)."""
    return option_name(next(field for field in fields(PruneSettings) if field.name == name))


def check_settings(settings: PruneSettings) -> None:
    """Every option checked before any work (a bad one names itself)."""
    PruneConfig(unit=settings.unit, uniform=settings.uniform)  # the config checks its own fields
    if settings.method is not None and settings.method not in METHODS:
        raise HeadkitError(f"--method must be one of {', '.join(METHODS)}, got {settings.method!r}")
    positive = ["batch_size", "max_length", "window", "train_texts", "importance_batches"]
    positive += ["gradient_accumulation_steps", "timing_rounds", "decode_context"]
    positive += [] if settings.held_out_texts is None else ["held_out_texts"]
    positive += [] if settings.lora_rank is None else ["lora_rank"]
    for name in positive:
        check_count(_option(name), getattr(settings, name), 2 if name in ("window", "max_length") else 1)
    for name in ("gate_steps", "recovery_steps"):
        check_count(_option(name), getattr(settings, name), 0)
    if settings.lr is not None and not (
        isinstance(settings.lr, (int, float)) and math.isfinite(settings.lr) and settings.lr >= 0
    ):
        raise HeadkitError(f"--lr must be a non-negative number, got {settings.lr!r}")
    if not settings.temperature > 0:
        raise HeadkitError(f"--temperature must be positive, got {settings.temperature!r}")
    check_data(settings.data)
    check_recipe_tasks(settings, default_is_causal_lm=False)


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


DEFAULT_HELD_OUT = {ENCODER: 256, CAUSAL_LM: 64}  # encoder texts, causal-LM windows


def held_out_count(settings: PruneSettings, kind: str) -> int:
    """How many held-out texts (encoders) or windows (causal LMs) measure the model: --held-out, or the default
    of the model's kind."""
    return DEFAULT_HELD_OUT[kind] if settings.held_out_texts is None else settings.held_out_texts


def preflight(settings: PruneSettings, model_path: Path, config: Any | None, out: Path | None) -> None:
    """Before any weight is loaded: --heads against MODEL's 🤗 config (layers × heads; a folder's config.json or a
    GGUF file's metadata), and --export-gguf's target when the result is saved. A model after headkit surgery
    (its heads no longer what the config states), or one without such a config, is checked once loaded; so is an
    encoder, which may share a layer (ALBERT)."""
    if out is not None and settings.export_gguf is not None:
        check_export_target(model_path, settings.export_gguf, settings.export_type, settings.overwrite)
    if settings.heads is None or config is None or getattr(config, "headkit_surgery", None):
        return
    if model_kind(model_path) != CAUSAL_LM:
        return
    text = text_config(config)
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    if isinstance(layers, int) and isinstance(heads, int):
        _total_target(layers * heads, settings)


def _total_target(total: int, settings: PruneSettings) -> int:
    keep = total // 2 if settings.heads is None else settings.heads
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= total:
        raise HeadkitError(
            f"--heads must be in [1, {total}] (the model has {total} query heads), got {keep!r}"
        )
    return keep


class _PruneSteps(Steps):
    """What both kinds of model share: the checks of the loaded model, the kept count and the export extra."""

    result_name = "pruned"

    def check(self) -> None:
        if self.loaded.is_causal_lm:  # an unsupported decoder family fails here, in one line, before any work
            get_family(self.teacher, PRUNE)
        self.adapter = get_adapter(self.teacher)  # so does any other unsupported architecture
        check_prunable(self.adapter.sites(self.teacher))  # so does a layer that earlier surgery replaced
        self.heads_before = heads_per_layer(self.teacher, self.adapter)
        self.keep = _total_target(sum(self.heads_before.values()), self.settings)

    def extras(self) -> list[Callable[[Path, dict[str, Any]], None]]:
        settings, model_path = self.settings, self.model_path
        if settings.export_gguf is None:
            return []

        # Inside the staging: a failed export leaves no folder either.
        def export(staging: Path, report: dict[str, Any]) -> None:
            report["gguf"] = export_gguf(
                self.student,
                settings.export_gguf,
                type=settings.export_type,
                overwrite=settings.overwrite,
                tokenizer=self.tokenizer,
                tokenizer_from=model_path if model_path.is_file() else None,
            ).to_dict()
            self.echo(f"wrote {settings.export_gguf} ({report['gguf']['arch']}, {settings.export_type})")

        return [export]


class CausalLMPruneSteps(_PruneSteps):
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
            selection["gates"] = _gate_log(log)
        selection["scores"] = [s.tolist() for s in scores]
        selection["seconds"] = time.perf_counter() - selection_started
        self.selection = selection
        self.plan = plan_pruning(
            scores, self.kv_of_query, self.keep, unit=settings.unit, uniform=settings.uniform
        )

        self.student = copy.deepcopy(teacher)
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
        self.echo(
            f"recovery: {settings.recovery_steps} distillation steps"
            + (f" (LoRA rank {settings.lora_rank})" if settings.lora_rank else "")
        )
        self.recovery = distill_run(
            self.student,
            self.teacher,
            self.windows.train,
            self.objective,
            settings,
            steps=settings.recovery_steps,
            lr=_weight_lr(settings),
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
            "notes": _family_notes(family),
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


def _family_notes(family: DecoderFamily) -> list[str]:
    """What the report must say about pruning this family beyond the numbers."""
    if family.head_norm == "across_heads":
        return [
            f"{family.model_type} normalises queries and keys over all heads together (q_norm / k_norm): their "
            "weights were sliced to the kept heads, but the kept heads' normalisation changed (its statistic now "
            "spans fewer heads), so the pruned model is not exactly the original with those heads zeroed; "
            "recovery absorbs the change"
        ]
    return []


class EncoderPruneSteps(_PruneSteps):
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
            weight_lr=_weight_lr(settings),
            fold=True,
            seed=settings.seed,
            gradient_accumulation_steps=settings.gradient_accumulation_steps,
            callback=echo_gate_progress(self.echo, settings.gate_steps),
            adapter=self.adapter,
        )
        self.student, self.plan = pruning.model, pruning.plan
        self.selection = {"method": self.method, "gates": _gate_log(pruning.gate_log)}
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
        self.recovery = encoder_finetune(
            self.student,
            self.teacher,
            self.train,
            steps=settings.recovery_steps,
            lr=_weight_lr(settings),
            lora_rank=settings.lora_rank,
            seed=settings.seed,
            echo=self.echo,
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


def _steps(
    settings: PruneSettings, model_path: Path, loaded: LoadedModel, echo: Callable[[str], None]
) -> Steps:
    steps = CausalLMPruneSteps if loaded.is_causal_lm else EncoderPruneSteps
    return steps(settings, model_path, loaded, echo)


RECIPE = Recipe(preflight, _steps, PruneSettings, check_settings, default_encoder_path)


@torch.no_grad()
def _forward(model: nn.Module, batch: dict) -> Any:
    return model(**batch)


def format_report(report: dict[str, Any]) -> str:
    """The printed table of a pruning report."""
    before, after = sum(report["heads_before"].values()), sum(report["heads_after"].values())
    lines = [f"heads kept: {after}/{before}"]
    lines.append(
        f"parameters: {report['parameters_before']:,} -> {report['parameters_after']:,} "
        f"({report['parameters_after'] / report['parameters_before']:.1%})"
    )
    if report["kind"] == "causal_lm":
        original = report["perplexity_original"]
        speed = report["speed"]
        kv_b, kv_a = report["kv_cache_bytes_per_token_before"], report["kv_cache_bytes_per_token_after"]
        lines += [
            f"KV cache per token: {kv_b:,.0f} -> {kv_a:,.0f} bytes"
            + (f" ({kv_a / kv_b - 1:+.0%})" if kv_b else " (a constant-size recurrent state, no KV cache)"),
            f"held-out perplexity: original {original:.3f}, pruned {report['perplexity_pruned']:.3f} "
            f"({report['perplexity_pruned'] / original:.2f}x), "
            + (
                f"repaired {report['repair']['perplexity']:.3f} ({report['repair']['perplexity'] / original:.2f}x), "
                if report.get("repair")
                else ""
            )
            + f"recovered {report['perplexity_recovered']:.3f} ({report['perplexity_recovered'] / original:.2f}x)",
            f"top-1 next-token agreement with the original: {report['top1_agreement']:.1%}",
            f"prefill ({speed['prefill_tokens']} tokens): {speed['prefill_ratio']:.2f}x the original; decode per "
            f"token at {speed['decode_context']}: {speed['decode_ratio']:.2f}x",
            f"stock architecture: {'yes (loads in plain transformers)' if report['stock_architecture'] else 'no (load with headkit.from_pretrained)'}",
            *(f"note: {note}" for note in report.get("notes", [])),
            f"sample before: {report['sample_original']!r}",
            f"sample after:  {report['sample_recovered']!r}",
        ]
    else:
        lines += [
            f"fidelity on held-out text: mean cosine {report['fidelity_mean_cosine_pruned']:.4f} pruned, "
            f"{report['fidelity_mean_cosine']:.4f} after recovery (min {report['fidelity_min_cosine']:.4f})",
            f"forward time: {report['forward_ms_before']:.1f} ms -> {report['forward_ms_after']:.1f} ms "
            f"({report['forward_ms_after'] / report['forward_ms_before']:.2f}x)",
        ]
    if "out" in report:
        lines.append(
            f"saved to {report['out']}" + (f" in {report['seconds']:.0f} s" if "seconds" in report else "")
        )
    return "\n".join(lines)


def keep_top_gated_heads(model: nn.Module, keep: int, adapter: Any = None) -> dict[int, list[int]]:
    """``{layer: heads to remove}`` keeping the `keep` heads whose Hard Concrete gates have the largest log α
    over all layers (ties: lower layer, head); layers may empty."""
    adapter = get_adapter(model, adapter)
    gates = head_gates(model, adapter)
    scores = [
        gates[i].log_alpha.detach() if i in gates else torch.zeros(0)
        for i in range(len(adapter.sites(model)))
    ]
    return plan_pruning(scores, [query_to_kv_heads(site) for site in adapter.sites(model)], keep)
