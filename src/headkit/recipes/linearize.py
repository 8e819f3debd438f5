"""The linearizing recipe (``headkit linearize``): a pretrained causal LM → sliding-window + linear attention,
recovered in two stages, measured and saved.

1. **Conversion** (:func:`headkit.linearize`) of a copy of the model: each chosen softmax attention becomes exact
   softmax over the last ``window`` keys plus Hedgehog linear attention over the earlier ones (LoLCATs, Zhang et
   al. 2024, arXiv:2410.10254), reusing the pretrained projections.
2. **Attention transfer** (LoLCATs stage 1): only the feature maps and the per-head balances train, all layers at
   once, to reproduce each layer's softmax attention output. The teacher (the original model) runs its own forward;
   hooks on its attention modules capture every module's call (hidden states, rotary ``(cos, sin)``, mask) and
   output, and each converted module is run on the *teacher's* inputs, so one layer's error does not feed the
   next one's target. Loss: the mean over layers of the MSE between the two outputs
   (:class:`AttentionTransferObjective`).
3. **LoRA** (LoLCATs stage 2): low-rank adapters (PEFT) on the converted layers' attention projections (query,
   key, value, output), trained with the KL distillation objective on next-token distributions
   (:class:`~headkit.runs.objectives.CausalLMObjective`) and merged afterwards; with ``lora_rank=None`` those
   projections are trained in full instead.

Both stages run on :func:`headkit.recipes.distill.distill` (🤗 ``Trainer``). The report holds held-out perplexity
of the original and the converted model at each of ``eval_lengths`` tokens, what each stage buys (perplexity at
the longest length after conversion, after transfer, after LoRA, and the loss curves), top-1 next-token agreement,
per-token decoding time at each of ``decode_contexts`` for both (timed in alternation, step by step), and the
decoding memory (the converted model's fixed-size states against the original's KV cache) at each context; plus a
plot. The model, its tokenizer, report.json and the plot are written atomically (nothing on any failure); the
saved model reloads with :func:`headkit.from_pretrained`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.errors import HeadkitError
from headkit.evaluation.quality import agreement, perplexity
from headkit.evaluation.sampling import greedy_sample
from headkit.evaluation.tasks import with_task_table
from headkit.evaluation.timing import decode_profile, prefill_tokens
from headkit.files import save_figure_atomic
from headkit.recipes.distill import distill, merge_lora, with_lora
from headkit.recipes.linearize_settings import (  # noqa: F401  (the names the recipe has always offered)
    MODEL_HELP,
    LinearizeSettings,
    check_context,
    check_settings,
    preflight,
    quick_budget,
)
from headkit.recipes.retrieval_heads import chosen_retrieval_heads
from headkit.recipes.settings import RecipeResult, training_forwards
from headkit.recipes.steps import Recipe, Steps, run_settings
from headkit.runs.models import LoadedModel, shared_copy, smollm2_gguf_path
from headkit.runs.objectives import CausalLMObjective
from headkit.runs.text import held_out_by_length, lm_windows, load_text
from headkit.surgery.adapters import AttentionAdapter, get_adapter
from headkit.surgery.apply import apply_
from headkit.surgery.attention import MECHANISM
from headkit.surgery.families import LINEARIZE, get_family
from headkit.surgery.linearize import (
    converted_attention_modules,
    linearized_parameters,
    max_context,
)

SAMPLE_PROMPT = "def fibonacci(n):\n"
PLOT_FILE = "linearize.png"


class LinearizeResult(RecipeResult):
    """What :func:`linearize` did and measured; ``report`` is what report.json holds."""

    def __str__(self) -> str:
        return with_task_table(format_report(self.report), self.report)


@dataclass
class AttentionTransferObjective:
    """Attention transfer: mean over the converted layers of MSE(converted output, softmax output).

    The teacher runs its whole forward once under ``no_grad``; forward hooks on its attention modules capture
    each module's call and output. Each converted module of the student is then called with the teacher's
    arguments for its layer, so only the converted attention (its feature maps and balances, when nothing else
    trains) is in the graph — the student's full forward never runs."""

    adapter: AttentionAdapter
    name: str = "attention_transfer"
    # It calls the converted modules, not the student's forward: distill runs it inside one (ObjectiveForward).
    calls_student_forward = False

    def __call__(self, student: nn.Module, teacher: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        targets = converted_attention_modules(student)
        if not targets:
            raise HeadkitError("attention transfer needs a student with linearized layers")
        sources = {
            site.layers[0]: site.module for site in self.adapter.sites(teacher) if site.layers[0] in targets
        }
        captured: dict[int, tuple[tuple, dict, torch.Tensor]] = {}

        def capture(index: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                captured[index] = (args, kwargs, output[0] if isinstance(output, tuple) else output)

            return hook

        handles = [
            module.register_forward_hook(capture(i), with_kwargs=True) for i, module in sources.items()
        ]
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask") if key in batch}
        try:
            with torch.no_grad():
                teacher(**inputs, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        losses = []
        for index, module in targets.items():
            args, kwargs, expected = captured[index]
            got = module(*args, **kwargs)[0]
            losses.append(F.mse_loss(got.float(), expected.float()))
        return torch.stack(losses).mean()


# -- the recipe --------------------------------------------------------------------------------------------------


def linearize(
    settings: LinearizeSettings | None = None, echo: Callable[[str], None] = print, **overrides: Any
) -> LinearizeResult:
    """Run the recipe (see the module docstring); the result's model is the converted, recovered student, also
    saved with its tokenizer, report.json and the plot to ``settings.out``. Nothing is written when any step
    fails, and an existing ``out`` is only replaced (with ``overwrite``) once everything succeeded."""
    return LinearizeResult(*run_settings(RECIPE, settings, overrides, echo, save=True))


def run(
    settings: LinearizeSettings | None = None,
    echo: Callable[[str], None] = print,
    *,
    loaded: LoadedModel | None = None,
    **overrides: Any,
) -> LinearizeResult:
    """Convert, recover and measure like :func:`linearize`, but write nothing (``settings.out`` is unused).
    `loaded`: the model already loaded from ``settings.model`` (left unchanged), to spare loading it again."""
    return LinearizeResult(*run_settings(RECIPE, settings, overrides, echo, loaded=loaded))


class LinearizeSteps(Steps):
    """Conversion, then attention transfer and LoRA (the two recovery stages); no closed-form repair yet."""

    result_name = "linearized"

    def check(self) -> None:
        settings, teacher = self.settings, self.teacher
        if not self.loaded.is_causal_lm:
            raise HeadkitError(
                f"MODEL {str(self.model_path)!r} is not a causal LM (*ForCausalLM or a GGUF file)"
            )
        get_family(teacher, LINEARIZE)  # an unsupported family: one line, before the copy and any work
        self.adapter = get_adapter(teacher)
        self.config = settings.conversion
        self.config.check(teacher)
        self.context = max_context(teacher)
        self.eval_lengths = check_context(settings, self.context)

    def data(self) -> None:
        settings, tokenizer, echo = self.settings, self.tokenizer, self.echo
        self.corpus = corpus = load_text(settings.data)
        self.windows = lm_windows(
            tokenizer,
            corpus,
            length=settings.train_length,
            train_windows=settings.train_windows,
            held_out_windows=1,
            seed=settings.seed,
        )
        self.held_out = held_out_by_length(
            tokenizer, corpus, self.eval_lengths, settings.held_out_windows, settings.seed
        )
        skipped = sorted(set(settings.eval_lengths) - set(self.eval_lengths))
        if skipped:
            echo(f"perplexity at {skipped} tokens skipped: longer than the model's context of {self.context}")
        # Stages and agreement at the longest window: a short one may lie wholly inside the softmax window, where
        # the linear term is never used and the converted model equals the original.
        self.longest = max(self.eval_lengths)
        self.eval_batch = max(1, min(settings.batch_size, 4))
        echo(
            f"{self.loaded.source}: {len(self.windows.train)} training windows of {settings.train_length} tokens, "
            "held-out windows "
            + ", ".join(f"{len(self.held_out[n])} × {n}" for n in self.eval_lengths)
            + f" ({corpus.source})"
        )
        self.perplexity_original = {
            n: perplexity(self.teacher, self.held_out[n], self.eval_batch) for n in self.eval_lengths
        }
        echo("held-out perplexity of the original: " + _by_length(self.perplexity_original))

    def convert(self) -> None:
        settings, teacher = self.settings, self.teacher
        if settings.retrieval_head_count:
            heads = chosen_retrieval_heads(
                teacher, self.tokenizer, self.corpus, self.config.layers_to_convert(teacher),
                settings.retrieval_head_count, seed=settings.seed, echo=self.echo,
            )  # fmt: skip
            self.config = replace(self.config, retrieval_heads=heads)
        # Held once until a training gives the student copies of what it changes (headkit.recipes.distill).
        self.student = shared_copy(teacher)
        self.conversion = apply_(self.student, self.config, adapter=self.adapter)
        teacher.requires_grad_(False)
        self.echo(str(self.conversion))
        self.stages = {"converted": perplexity(self.student, self.held_out[self.longest], self.eval_batch)}
        self.echo(f"after conversion: perplexity {self.stages['converted']:.3f} at {self.longest} tokens")

    def recover(self) -> None:
        settings, teacher, echo, longest = self.settings, self.teacher, self.echo, self.longest
        student, stages = self.student, self.stages
        transfer_steps, recovery_steps = settings.transfer_steps, settings.recovery_steps
        if not self.config.fold:
            # The compressed-cache baseline is the original model's attention over fewer keys: nothing to train.
            transfer_steps = recovery_steps = 0
            echo("--drop: the original model with a compressed cache, no training")
        per_forward, forwards = training_forwards(settings, settings.train_length)
        # (a) attention transfer: only the feature maps and balances train.
        student.requires_grad_(False)
        for parameter in linearized_parameters(student):
            parameter.requires_grad_(True)
        echo(f"attention transfer: {transfer_steps} steps on the feature maps and balances")
        self.transfer = distill(
            student,
            teacher,
            self.windows.train,
            objective=AttentionTransferObjective(self.adapter),
            steps=transfer_steps,
            lr=settings.transfer_lr,
            batch_size=per_forward,
            gradient_accumulation_steps=forwards,
            seed=settings.seed,
            log_every=max(1, transfer_steps // 10),
            echo=echo,
        )
        student = self.transfer.model
        stages["after_transfer"] = perplexity(student, self.held_out[longest], self.eval_batch)
        echo(f"after attention transfer: perplexity {stages['after_transfer']:.3f} at {longest} tokens")

        # (b) LoRA (or full training) of the converted layers' attention projections, with the KL objective.
        student.requires_grad_(False)
        trained = student
        if recovery_steps > 0:
            if settings.lora_rank is not None:
                trained = attention_lora(student, settings.lora_rank)
            else:
                for parameter in attention_projection_parameters(student):
                    parameter.requires_grad_(True)
        echo(
            f"{'LoRA' if settings.lora_rank else 'fine-tuning'}: {recovery_steps} steps on the converted layers' "
            "attention projections" + (f" (rank {settings.lora_rank})" if settings.lora_rank else "")
        )
        self.recovery = distill(
            trained,
            teacher,
            self.windows.train,
            objective=CausalLMObjective(settings.temperature),
            steps=recovery_steps,
            lr=settings.lora_lr,
            batch_size=per_forward,
            gradient_accumulation_steps=forwards,
            scheduler="cosine" if recovery_steps >= 10 else "constant",
            seed=settings.seed,
            gradient_checkpointing=settings.gradient_checkpointing,
            log_every=max(1, recovery_steps // 10),
            echo=echo,
        )
        student = self.recovery.model
        if recovery_steps > 0 and settings.lora_rank is not None:
            student = merge_lora(student, teacher)
        student.eval()
        student.requires_grad_(False)
        self.student = student

    def measure(self) -> None:
        settings, teacher, student, echo = self.settings, self.teacher, self.student, self.echo
        longest, context = self.longest, self.context
        converted = {n: perplexity(student, self.held_out[n], self.eval_batch) for n in self.eval_lengths}
        self.stages["after_lora"] = converted[longest]
        echo("held-out perplexity of the linearized model: " + _by_length(converted))
        top1 = agreement(student, teacher, self.held_out[longest], self.eval_batch).top1
        echo(f"top-1 next-token agreement with the original at {longest} tokens: {top1:.1%}")

        decode, skipped_contexts = [], []
        for length in settings.decode_contexts:
            if context is not None and length > context:
                skipped_contexts.append(length)
                continue
            # A context at the model's limit is timed on the last steps before it: the prompt is shortened by the
            # steps.
            prompt = length if context is None else min(length, context - settings.decode_steps - 1)
            points = decode_profile(
                {"original": teacher, "linearized": student},
                prompt,
                settings.decode_steps,
                settings.seed,
                batch_sizes=settings.decode_batch_sizes,
                prefill_tokens=prefill_tokens(self.config),
            )
            for point in points:
                decode.append(
                    {
                        "context": length,
                        "prompt_tokens": prompt,
                        "batch_size": point["batch_size"],
                        "original_ms_per_token": point["original"]["ms_per_token"],
                        "linearized_ms_per_token": point["linearized"]["ms_per_token"],
                        "original_cache_bytes": point["original"]["cache_bytes"],
                        "linearized_cache_bytes": point["linearized"]["cache_bytes"],
                    }
                )
                echo(_decode_line(decode[-1]))
        if skipped_contexts:
            echo(f"decoding at {skipped_contexts} skipped: beyond the model's context of {context}")

        original = self.perplexity_original
        self.report |= {
            "architecture": self.adapter.name,
            "conversion": self.conversion.to_dict(),
            "perplexity_original": {str(n): v for n, v in original.items()},
            "perplexity_linearized": {str(n): v for n, v in converted.items()},
            "perplexity_ratio": {str(n): converted[n] / original[n] for n in self.eval_lengths},
            "perplexity_stages": {"length": longest, "original": original[longest], **self.stages},
            "top1_agreement": top1,
            "top1_length": longest,
            "decode": decode,
            "decode_steps": settings.decode_steps,
            "threads": torch.get_num_threads(),
            "transfer": self.transfer.to_dict(),
            "recovery": self.recovery.to_dict(),
            "sample_prompt": SAMPLE_PROMPT,
            "sample_original": greedy_sample(teacher, self.tokenizer, SAMPLE_PROMPT),
            "sample_linearized": greedy_sample(student, self.tokenizer, SAMPLE_PROMPT),
            "data": self.windows.summary()
            | {"held_out": {str(n): int(self.held_out[n].shape[0]) for n in self.eval_lengths}},
        }

    def extras(self) -> list[Callable[[Path, dict[str, Any]], None]]:
        def plot(staging: Path, report: dict[str, Any]) -> None:
            save_figure_atomic(plot_report(report), staging / PLOT_FILE)

        return [plot]


RECIPE = Recipe(preflight, LinearizeSteps, LinearizeSettings, check_settings, smollm2_gguf_path)


def _by_length(values: dict[int, float]) -> str:
    return ", ".join(f"{value:.3f} at {length} tokens" for length, value in values.items())


# -- the attention projections of the converted layers -----------------------------------------------------------


def attention_projection_names(model: nn.Module) -> list[str]:
    """Qualified names of the converted layers' projections: the stock attention module's own linear children
    (query/key/value/output, fused or not), not its norms nor the headkit mechanism."""
    converted = {id(m) for m in converted_attention_modules(model).values()}
    names = []
    for name, module in model.named_modules():
        if id(module) in converted:
            names += [
                f"{name}.{child_name}"
                for child_name, child in module.named_children()
                if child_name != MECHANISM
                and isinstance(getattr(child, "weight", None), torch.Tensor)
                and child.weight.dim() == 2
            ]
    return names


def attention_projection_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name in attention_projection_names(model) for p in model.get_submodule(name).parameters()]


def attention_lora(model: nn.Module, rank: int, alpha: float | None = None) -> nn.Module:
    """`model` with LoRA adapters (PEFT) of `rank` on the converted layers' attention projections only (LoLCATs'
    stage 2); train it, then ``merge_and_unload()``."""
    return with_lora(model, attention_projection_names(model), rank=rank, alpha=alpha, option="--lora-rank")


# -- measurements ------------------------------------------------------------------------------------------------


def _decode_line(point: dict[str, Any]) -> str:
    prompt = f" (prompt {point['prompt_tokens']})" if point["prompt_tokens"] != point["context"] else ""
    return (
        f"decode at {point['context']}{prompt}, batch {point['batch_size']}: original "
        f"{point['original_ms_per_token']:.2f} ms/token ({point['original_cache_bytes'] / 2**20:.2f} MiB cache), "
        f"linearized {point['linearized_ms_per_token']:.2f} ms/token "
        f"({point['linearized_cache_bytes'] / 2**20:.2f} MiB); "
        f"{point['original_ms_per_token'] / point['linearized_ms_per_token']:.2f}x"
    )


# -- report ------------------------------------------------------------------------------------------------------


def format_report(report: dict[str, Any]) -> str:
    """The printed summary of a linearizing report."""
    conversion = report["conversion"]
    stages = report["perplexity_stages"]
    lines = [
        f"linearized {len(conversion['layers'])} layers of {report['architecture']} (window {conversion['window']}"
        + (
            f", {conversion['sinks']} sinks, budget {conversion['budget']}"
            if conversion.get("sinks") or conversion.get("budget")
            else ""
        )
        + f", {conversion['feature_map']} features; decoding state "
        f"{conversion.get('state_bytes', 0) / 2**20:.2f} MiB per sequence at any context)",
        "held-out perplexity (original -> linearized): "
        + ", ".join(
            f"{n} tokens {report['perplexity_original'][n]:.3f} -> {v:.3f} ({report['perplexity_ratio'][n]:.2f}x)"
            for n, v in report["perplexity_linearized"].items()
        ),
        f"at {stages['length']} tokens: converted {stages['converted']:.3f}, after transfer "
        f"{stages['after_transfer']:.3f}, after LoRA {stages['after_lora']:.3f} (original {stages['original']:.3f})",
        f"top-1 next-token agreement with the original at {report.get('top1_length', stages['length'])} tokens: "
        f"{report['top1_agreement']:.1%}",
    ]
    lines += [_decode_line(point) for point in report["decode"]]
    lines += [
        f"sample before: {report['sample_original']!r}",
        f"sample after:  {report['sample_linearized']!r}",
    ]
    if "out" in report:
        lines.append(
            f"saved to {report['out']}" + (f" in {report['seconds']:.0f} s" if "seconds" in report else "")
        )
    return "\n".join(lines)


def plot_report(report: dict[str, Any]) -> Any:
    """Decode time and decoding memory against context, original vs linearized, and the two stages' losses."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 3.8), layout="constrained")
    speed, memory, losses = figure.subplots(1, 3)
    for batch_size in sorted({p["batch_size"] for p in report["decode"]}):
        points = [p for p in report["decode"] if p["batch_size"] == batch_size]
        contexts = [p["context"] for p in points]
        for key, label, marker in (
            ("original", "original (KV cache)", "o"),
            ("linearized", "linearized", "s"),
        ):
            label = f"{label}, batch {batch_size}"
            speed.plot(contexts, [p[f"{key}_ms_per_token"] for p in points], marker=marker, label=label)
            memory.plot(
                contexts, [p[f"{key}_cache_bytes"] / 2**20 for p in points], marker=marker, label=label
            )
    for axis, title, unit in ((speed, "decode time per token", "ms"), (memory, "decoding memory", "MiB")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("context (tokens)")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.legend()
    memory.set_yscale("log")
    for key, label in (("transfer", "attention transfer (MSE)"), ("recovery", "LoRA (KL)")):
        values = report[key]["losses"]
        if values:
            losses.plot(range(1, len(values) + 1), values, marker=".", label=label)
    losses.set_yscale("log")
    losses.set_xlabel("logged step")
    losses.set_title("training loss")
    if report["transfer"]["losses"] or report["recovery"]["losses"]:
        losses.legend()
    return figure


__all__ = [
    "AttentionTransferObjective",
    "LinearizeResult",
    "LinearizeSettings",
    "attention_lora",
    "attention_projection_names",
    "check_settings",
    "quick_budget",
    "format_report",
    "linearize",
    "plot_report",
    "run",
]
