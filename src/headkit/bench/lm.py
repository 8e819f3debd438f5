"""``headkit bench lm``: same-size byte-level causal language models, one per attention mechanism.

The Additive-Attention LM project's comparison (additive, convolutional additive and full attention as
character-level LMs, in bits per character) widened to every registered mechanism: softmax (RoPE), additive
(Wu et al. 2021, Fastformer, arXiv:2108.09084, causal; global or windowed, with or without a depthwise causal
convolution), linear (Katharopoulos et al. 2020, arXiv:2006.16236), CoCA (Zhu et al. 2023, arXiv:2309.08646) and
collaborative heads (Cordonnier et al. 2020, arXiv:2006.16362). Each is trained by
:func:`headkit.train.train_causal_lm` with the same budget, batches and seed; held-out bits per byte is recorded
against steps and training seconds. Mechanisms without positions of their own get learned absolute positions.
Method and results: docs/from-scratch.md.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headkit.bench._options import check_corpus, check_head_width
from headkit.bench._report import column_table, figure_axes, plot_series
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.data import ByteTokenizer
from headkit.errors import HeadkitError
from headkit.layers import attention_classes, get_attention_class
from headkit.models import HeadkitForCausalLM
from headkit.train import default_config, train_causal_lm

# Mechanisms with options of this benchmark come as several variants, named "<mechanism>[_<option>…]": additive
# global or windowed, each with or without the causal convolution. Every other registered mechanism is one variant.
MECHANISM_VARIANTS = {
    "additive": ("additive", "additive_window", "additive_conv", "additive_window_conv"),
}
# The order of the default run (the baseline first); registered mechanisms not named here follow.
VARIANT_ORDER = ("softmax", "additive", "linear", "coca", "collaborative")


def variants(compared_only: bool = False) -> tuple[str, ...]:
    """Every variant of the registered attention mechanisms (the default run's: those ``compared``)."""
    layers = attention_classes()
    names = [name for name in VARIANT_ORDER if name in layers]
    names += [name for name in layers if name not in VARIANT_ORDER]
    chosen = [name for name in names if layers[name].compared or not compared_only]
    return tuple(variant for name in chosen for variant in MECHANISM_VARIANTS.get(name, (name,)))


VARIANTS = variants(compared_only=True)
PLOT_FILE = "lm_curves.png"


@dataclass
class LMBenchConfig:
    """Settings of one ``headkit bench lm`` run (see the command's --help)."""

    out: Path = option(Path("results/lm"), "Output directory for results.json, table, curves.")
    variants: tuple[str, ...] = option(
        VARIANTS,
        f"Comma-separated variants (default: {','.join(VARIANTS)}); any of {', '.join(variants())} "
        "or of a mechanism registered since.",
        choices=variants,
        distinct=True,
    )
    corpus: Path | None = option(
        None,
        "A text file or a folder of text files (default: this Python's standard-library source).",
        check=check_corpus,
    )
    corpus_bytes: int | None = option(
        None, "Read at most this many corpus bytes (default all; 2 MB with --quick).", min=1, quick=2_000_000
    )
    # Sized by measurement (threads=1, AMD EPYC): hidden 192 × 4 layers at batch 8 × 256 bytes costs 0.5–0.75 s
    # of CPU per step depending on the mechanism, so 8 variants × 500 steps plus evaluations take ≈ 30–45 min
    # on two cores. Hidden 256 at batch 16 costs ~3 s per step: too few steps would fit in the same time.
    steps: int = option(500, "Training steps per variant.", min=1, quick=120)
    batch_size: int = option(8, "Windows per step.", min=1)
    seq_len: int = option(256, "Bytes per training window.", min=2, quick=128)
    hidden_size: int = option(192, "Model width.", min=1, quick=64)
    layers: int = option(4, "Decoder layers.", min=1, quick=2)
    heads: int = option(4, "Attention heads per layer.", min=1)
    lr: float = option(2e-3, "Peak learning rate.", positive=True, quick=3e-3)
    eval_every: int = option(50, "Steps between held-out evaluations.", min=1, quick=20)
    eval_tokens: int = option(32_768, "Held-out bytes evaluated.", min=1, quick=4_096)
    additive_window: int = option(32, "Window of the windowed additive variants.", min=1, quick=16)
    conv_kernel_size: int = setting(3, min=1)
    collaborative_dim: int | None = option(
        None, "Shared query/key width of collaborative heads (default: the hidden size).", min=1
    )
    seed: int = option(0, "Seed of the initialisation and the training batches.")
    threads: int = option(2, "torch threads.", min=1, quick=1)

    quick = quick_preset("Tiny models, 120 steps, 2 MB of corpus (< 3 minutes).")


def variant_fields(variant: str, config: LMBenchConfig) -> dict[str, Any]:
    """The HeadkitConfig fields that make ``variant``: its mechanism, its options and its positions."""
    valid = variants()
    if variant not in valid:
        raise HeadkitError(f"--variants: unknown variant {variant!r}; choose from {', '.join(valid)}")
    attention = next(name for name in attention_classes() if variant in MECHANISM_VARIANTS.get(name, (name,)))
    fields: dict[str, Any] = {
        "attention": attention,
        "position_embedding_type": "rope" if get_attention_class(attention).rotary else "learned",
    }
    if attention == "additive":
        fields["additive_window"] = config.additive_window if "window" in variant else None
        fields["convolve"] = variant.endswith("conv")
        if fields["convolve"]:
            fields["conv_kernel_size"] = config.conv_kernel_size
            fields["conv_groups"] = config.hidden_size  # depthwise: the size budget stays that of the others
    elif attention == "linear":
        fields["feature_map"] = "elu"
    elif attention == "collaborative":
        fields["dim_shared_query_key"] = config.collaborative_dim or config.hidden_size
    return fields


def describe_variant(variant: str, config: LMBenchConfig) -> str:
    """A short human description of the variant, e.g. "additive, window 32, depthwise conv k=3"."""
    fields = variant_fields(variant, config)
    parts = [fields["attention"]]
    if fields.get("additive_window") is not None:
        parts.append(f"window {fields['additive_window']}")
    elif fields["attention"] == "additive":
        parts.append("global")
    if fields.get("convolve"):
        parts.append(f"depthwise conv k={fields['conv_kernel_size']}")
    if "feature_map" in fields:
        parts.append(f"{fields['feature_map']} + 1 features")
    if "dim_shared_query_key" in fields:
        width = fields["dim_shared_query_key"]
        parts.append(f"shared D̃={width}" + (" (full)" if width == config.hidden_size else ""))
    return ", ".join(parts)


def model_config(variant: str, config: LMBenchConfig) -> Any:
    """The HeadkitConfig of ``variant``: the shared sizes (byte vocabulary, width, layers, heads, MLP) + its own."""
    try:
        return default_config(
            ByteTokenizer(),
            hidden_size=config.hidden_size,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            intermediate_size=4 * config.hidden_size,
            max_position_embeddings=config.seq_len,
            **variant_fields(variant, config),
        )
    except HeadkitError:
        raise
    except ValueError as exc:  # HeadkitConfig's own checks name the field, not the option
        raise HeadkitError(f"variant {variant!r}: {exc}") from None


def count_parameters(variant: str, config: LMBenchConfig) -> int:
    """Parameters of ``variant``'s model (built on the meta device: no memory, no initialisation)."""
    with torch.device("meta"):
        model = HeadkitForCausalLM(model_config(variant, config))
    return sum(parameter.numel() for parameter in model.parameters())


def check_settings(config: LMBenchConfig) -> None:
    """The rules that relate settings (each field's own are declared on it), before anything is loaded."""
    check_head_width(config.hidden_size, config.heads, even=True)
    for variant in config.variants:
        model_config(variant, config)  # the config's own checks, before any training


def _finite_or_none(value: Any) -> Any:
    """``value`` with every number that is not finite, in every list and dict it holds, made None: a diverged
    model is a result worth keeping next to the others, and JSON has no NaN (null instead)."""
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def render_markdown(report: dict[str, Any]) -> str:
    """One row per variant, in the order run: size, speed and final held-out bits per byte."""
    columns = {
        "variant": lambda v: v["variant"],
        "attention": lambda v: v["description"],
        "positions": lambda v: v["position_embedding_type"],
        "parameters": lambda v: f"{v['parameters']:,}",
        "median ms/step": lambda v: f"{v['median_step_ms']:.1f}",
        "train s": lambda v: f"{v['train_seconds']:.1f}",
        "held-out bits/byte": lambda v: (
            "diverged" if v["final_bits_per_byte"] is None else f"{v['final_bits_per_byte']:.3f}"
        ),
    }
    settings, machine, corpus = report["settings"], report["machine"], report["corpus"]
    return (
        f"Byte-level causal LMs, hidden {settings['hidden_size']}, {settings['layers']} layers, "
        f"{settings['heads']} heads, {settings['steps']} steps of {settings['batch_size']} × "
        f"{settings['seq_len']} bytes (lr {settings['lr']:g}, seed {settings['seed']}); corpus "
        f"{corpus['train_bytes']:,} training / {corpus['held_out_bytes']:,} held-out bytes, bits/byte on "
        f"{settings['eval_tokens']:,} held-out bytes spread over the split (untrained ≈ {math.log2(259):.2f}). "
        f"{machine['cpu_model']}, {machine['torch_threads']} torch threads, torch {machine['torch_version']}. "
        "Train s: optimiser steps only, evaluations excluded.\n\n" + column_table(columns, report["variants"])
    )


def plot_curves(report: dict[str, Any]) -> Any:
    """Two panels: held-out bits/byte against steps and against training seconds, one line per variant."""
    from matplotlib.ticker import FuncFormatter

    figure, (by_step, by_seconds) = figure_axes((12, 4.8), 1, 2, sharey=True)
    points = [
        {"variant": result["variant"]} | point for result in report["variants"] for point in result["curve"]
    ]
    rope = {result["variant"]: result["position_embedding_type"] == "rope" for result in report["variants"]}
    styles = {variant: {"linestyle": "--" if rotary else "-"} for variant, rotary in rope.items()}
    for axis, x in ((by_step, "step"), (by_seconds, "train_seconds")):
        plot_series(axis, points, x, "bits_per_byte", "variant", markersize=3, style=styles.get)
        axis.grid(True, which="both", alpha=0.3)
    # Untrained models start near 8 bits/byte; a log axis keeps the trained end readable next to it.
    by_step.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    by_step.yaxis.set_major_formatter(plain)
    by_step.yaxis.set_minor_formatter(plain)
    by_step.set(xlabel="training step", ylabel="held-out bits per byte")
    by_seconds.set_xlabel("training seconds (evaluation excluded)")
    by_seconds.legend(fontsize="small")
    settings = report["settings"]
    figure.suptitle(
        f"byte-level LMs per attention mechanism: hidden {settings['hidden_size']}, {settings['layers']} layers, "
        f"seq {settings['seq_len']} (dashed: rotary positions)"
    )
    return figure


@register_benchmark(
    "lm", LMBenchConfig, check=check_settings, render=render_markdown, plots={PLOT_FILE: plot_curves}
)
def run_lm_benchmark(config: LMBenchConfig, console: Any) -> dict[str, Any]:
    """Same-size byte-level causal LMs, one per attention mechanism, trained alike on the same batches:
    held-out bits per byte against steps and training seconds, time per step, parameters.

    See the module docstring; returns the dictionary written to ``results.json``."""
    from headkit.data import load_corpus  # here: the tests see that it is not called before the checks

    model_configs = {variant: model_config(variant, config) for variant in config.variants}
    corpus = load_corpus(config.corpus, max_bytes=config.corpus_bytes)
    if corpus.num_bytes("train") <= config.seq_len:
        raise HeadkitError(
            f"--corpus: {corpus.num_bytes('train')} training bytes, not enough for one window of "
            f"--seq-len {config.seq_len}"
        )
    summary = corpus.summary()
    console.print(
        f"lm: {summary['train_bytes']:,} training / {summary['held_out_bytes']:,} held-out bytes "
        f"from {summary['source']}; {len(config.variants)} variants × {config.steps} steps",
        highlight=False,
    )

    # The settings of train_causal_lm that are options of this benchmark, under the same names.
    names = ("steps", "batch_size", "seq_len", "lr", "eval_tokens", "eval_every", "seed")
    training = {name: getattr(config, name) for name in names}
    results: list[dict[str, Any]] = []
    for index, variant in enumerate(config.variants, start=1):
        description = describe_variant(variant, config)
        console.rule(f"[{index}/{len(config.variants)}] {variant}: {description}")
        trained = train_causal_lm(
            model_configs[variant], corpus, console=console, progress_label=variant, **training
        )
        # What the variant achieved, bits per byte None where not finite (the model diverged); the curve holds
        # {step, train_seconds, bits_per_byte} from step 0 on.
        curve = [
            {
                "step": int(point["step"]),
                "train_seconds": point["train_seconds"],
                "bits_per_byte": point["held_out_bits_per_byte"],
            }
            for point in trained.history
        ]
        result = {
            "variant": variant,
            "description": description,
            "attention": model_configs[variant].attention,
            "position_embedding_type": model_configs[variant].position_embedding_type,
            "parameters": sum(parameter.numel() for parameter in trained.model.parameters()),
            "median_step_ms": 1000 * statistics.median(trained.step_seconds),
            "train_seconds": sum(trained.step_seconds),
            "initial_bits_per_byte": trained.initial_bits_per_byte,
            "final_bits_per_byte": trained.held_out_bits_per_byte,
        }
        results.append(_finite_or_none(result | {"curve": curve, "losses": trained.losses}))
        if results[-1]["final_bits_per_byte"] is None:
            console.print(f"[bold red]{variant} diverged[/] (non-finite loss); try a lower --lr")
        del trained  # the next model need not share memory with this one

    positions = {
        kind: [v for v in config.variants if model_configs[v].position_embedding_type == kind]
        for kind in ("rope", "learned")
    }
    return {"corpus": summary, "positions": positions, "variants": results}
