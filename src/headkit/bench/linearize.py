"""``headkit bench linearize``: a linearized causal LM (SmolLM2-135M by default) against its original.

Runs the recipe of :mod:`headkit.recipes.linearize` (conversion, attention transfer, LoRA) without saving the model
and writes ``results.json`` (the recipe's report, the machine and the command), ``table.md`` (perplexity per
stage and length, top-1 agreement, decode time and decoding memory per context) and ``linearize.png`` to
``--out``, each atomically. Timings are taken with ``--threads`` torch threads, the two models stepping in
alternation so that load drifting on shared cores slows both alike.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from headkit.bench._measure import thread_limit
from headkit.bench._options import check_positive_option
from headkit.bench._report import command_line, machine_info, markdown_table, write_results
from headkit.errors import HeadkitError
from headkit.recipes.linearize import PLOT_FILE, LinearizeSettings, check_settings, plot_report, run


def run_linearize_benchmark(
    settings: LinearizeSettings | None = None,
    *,
    out: str | Path = Path("results/linearize"),
    threads: int = 2,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the benchmark; returns the dictionary written to ``results.json``."""
    settings = settings or LinearizeSettings()
    check_positive_option("threads", threads)
    check_settings(settings)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HeadkitError(f"--out {str(out)!r} exists and is not a folder")
    with thread_limit(threads):
        result = run(settings, echo=echo)
    report = result.report | {"command": command_line(), "machine": machine_info("cpu")}
    write_results(out, report, results_table(report), plot_report(report), PLOT_FILE)
    echo(f"wrote {out / 'results.json'}, {out / 'table.md'} and {out / PLOT_FILE}")
    return report


def results_table(report: dict[str, Any]) -> str:
    """table.md: perplexity per stage and length, agreement, then decode time and memory per context."""
    conversion, stages = report["conversion"], report["perplexity_stages"]
    original = stages["original"]
    quality = markdown_table(
        ["model", f"perplexity at {stages['length']} tokens", "× original"],
        [
            ["original", f"{original:.3f}", "1.00"],
            *[
                [label, f"{stages[key]:.3f}", f"{stages[key] / original:.2f}"]
                for key, label in (
                    ("converted", "converted (no training)"),
                    ("after_transfer", f"+ attention transfer ({report['transfer']['steps']} steps)"),
                    ("after_lora", f"+ LoRA ({report['recovery']['steps']} steps)"),
                )
            ],
        ],
    )
    lengths = markdown_table(
        ["held-out window", "original", "linearized", "ratio"],
        [
            [
                f"{n} tokens",
                f"{report['perplexity_original'][n]:.3f}",
                f"{v:.3f}",
                f"{report['perplexity_ratio'][n]:.2f}",
            ]
            for n, v in report["perplexity_linearized"].items()
        ],
    )
    decode = markdown_table(
        ["context", "original ms/token", "linearized ms/token", "speed-up", "KV cache", "linearized state"],
        [
            [
                p["context"],
                f"{p['original_ms_per_token']:.2f}",
                f"{p['linearized_ms_per_token']:.2f}",
                f"{p['original_ms_per_token'] / p['linearized_ms_per_token']:.2f}×",
                f"{p['original_cache_bytes'] / 2**20:.2f} MiB",
                f"{p['linearized_cache_bytes'] / 2**20:.2f} MiB",
            ]
            for p in report["decode"]
        ],
    )
    header = (
        f"{report['model']}: {len(conversion['layers'])} of {len(conversion['layers']) + len(conversion['softmax_layers'])} "
        f"layers linearized (window {conversion['window']}, {conversion['feature_map']} features); top-1 next-token "
        f"agreement with the original {report['top1_agreement']:.1%}; {report['threads']} torch thread(s), batch 1."
    )
    return "\n".join([header, "", quality, lengths, decode])
