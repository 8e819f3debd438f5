"""``headkit bench linearize``: a linearized causal LM (SmolLM2-135M by default) against its original.

Runs :mod:`headkit.recipes.linearize` (conversion, attention transfer, LoRA) without saving the model and writes
``results.json`` (the recipe's report, the machine, the command), ``table.md`` and ``linearize.png`` to ``--out``.
Method and results: docs/linearize.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headkit.bench._options import check_out_dir
from headkit.bench._report import column_table, markdown_table
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.recipes.linearize import (
    MODEL_HELP,
    PLOT_FILE,
    LinearizeSettings,
    check_settings,
    plot_report,
    quick_budget,
    run,
)
from headkit.runs.options import option_fields, settings_from, with_fields_of


@dataclass
@with_fields_of(LinearizeSettings, unset=True)
class LinearizeBenchSettings:
    """Settings of one ``headkit bench linearize`` run: the benchmark's own, then every option of the recipe
    (:class:`LinearizeSettings`, its surgery's config's included; None: the recipe's default, full or quick)."""

    model: Path | None = option(None, MODEL_HELP)
    threads: int = option(2, "torch threads.", min=1)
    seed: int = option(0, "Seed of the sampling and the training order.")
    out: Path = option(
        Path("results/linearize"), "Output directory for results.json, table, plot.", check=check_out_dir
    )
    quick_recipe: bool = setting(False, quick=True)  # the recipe's quick preset under the settings above

    quick = quick_preset(quick_budget())

    def recipe_settings(self) -> LinearizeSettings:
        """The recipe's settings: the ones given here over its full or quick preset."""
        recipe = [field.name for field in option_fields(LinearizeSettings) if not field.metadata.get("saves")]
        names = ["model", *recipe]
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return settings_from(LinearizeSettings, self.quick_recipe, given)


def results_table(report: dict[str, Any]) -> str:
    """table.md: perplexity per stage and length, agreement, then decode time and memory per context."""
    conversion, stages = report["conversion"], report["perplexity_stages"]
    stage_labels = {
        "original": "original",
        "converted": "converted (no training)",
        "after_transfer": f"+ attention transfer ({report['transfer']['steps']} steps)",
        "after_lora": f"+ LoRA ({report['recovery']['steps']} steps)",
    }
    quality = [
        [label, f"{stages[key]:.3f}", f"{stages[key] / stages['original']:.2f}"]
        for key, label in stage_labels.items()
    ]
    original, ratio = report["perplexity_original"], report["perplexity_ratio"]
    lengths = [
        [f"{n} tokens", f"{original[n]:.3f}", f"{v:.3f}", f"{ratio[n]:.2f}"]
        for n, v in report["perplexity_linearized"].items()
    ]
    decode = {
        "context": lambda p: p["context"],
        "batch": lambda p: p.get("batch_size", 1),
        "original ms/token": lambda p: f"{p['original_ms_per_token']:.2f}",
        "linearized ms/token": lambda p: f"{p['linearized_ms_per_token']:.2f}",
        "speed-up": lambda p: f"{p['original_ms_per_token'] / p['linearized_ms_per_token']:.2f}×",
        "KV cache": lambda p: f"{p['original_cache_bytes'] / 2**20:.2f} MiB",
        "linearized state": lambda p: f"{p['linearized_cache_bytes'] / 2**20:.2f} MiB",
    }
    layers = len(conversion["layers"])
    header = (
        f"{report['model']}: {layers} of {layers + len(conversion['softmax_layers'])} layers linearized (window "
        f"{conversion['window']}, {conversion.get('sinks', 0)} sinks, budget {conversion.get('budget', 0)}, "
        f"{conversion['feature_map']} features); top-1 next-token agreement with the "
        f"original {report['top1_agreement']:.1%}; {report['threads']} torch thread(s), batch 1."
    )
    return "\n".join(
        [
            f"{header}\n",
            markdown_table(["model", f"perplexity at {stages['length']} tokens", "× original"], quality),
            markdown_table(["held-out window", "original", "linearized", "ratio"], lengths),
            column_table(decode, report["decode"]),
        ]
    )


@register_benchmark(
    "linearize",
    LinearizeBenchSettings,
    check=lambda settings: check_settings(settings.recipe_settings()),
    render=results_table,
    plots={PLOT_FILE: plot_report},
)
def run_linearize_benchmark(settings: LinearizeBenchSettings, console: Any) -> dict[str, Any]:
    """Linearized SmolLM2-135M against the original: held-out perplexity per stage and length, top-1 agreement, decode
    ms/token and decoding memory against context.

    Returns the dictionary written to ``results.json``."""

    def echo(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    return run(settings.recipe_settings(), echo=echo).report
