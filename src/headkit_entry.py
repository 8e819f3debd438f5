"""The ``headkit`` console script: ``headkit --help`` answered without importing headkit.

Importing headkit registers its models with transformers; the app (:mod:`headkit.app`) declares each command's
options from the configs and settings it runs, which imports torch (seconds). The list of commands needs neither,
so this module — outside the package, so that the package's ``__init__`` does not run — prints it from
:data:`COMMANDS` (the first paragraph of each command's own help, which the tests hold equal to the app's) and
hands everything else to :func:`headkit.app.main`, after telling the package to defer the registration
(:data:`defer_models`): a command that refuses a bad option then imports its light settings, torch and the
model's config, not transformers' model code.
"""

from __future__ import annotations

import sys

# Set by :func:`main` before it imports the package: ``headkit/__init__`` then leaves the Auto-class registration
# (headkit.models: transformers' model code, seconds) to the paths that read a checkpoint, so that a command
# refusing a bad option imports only its settings and the model's config.
defer_models = False

USAGE = "Usage: headkit [OPTIONS] COMMAND [ARGS]..."
SUMMARY = "Engineering attention heads: efficient attention, collaborative heads, head pruning."
# (command, the first paragraph of its help), in the app's order.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("version", "Print headkit's version and those of torch and transformers."),
    (
        "demo",
        "The tour that `make demo` runs on embedded defaults: collaborative heads, compression, head pruning on all-MiniLM-L6-v2 (fidelity, size, speed), then SmolLM2-135M pruned and linearized (samples, perplexity, decode time); writes OUT/report.md.",
    ),  # noqa: E501
    (
        "prune",
        "Prune attention heads, repair, recover by distillation against the original, report and save (see headkit.recipes.prune).",
    ),  # noqa: E501
    (
        "compress",
        "Collaborative heads at --dim (or, on a rotary decoder, latent keys/values at --kv-rank), optionally distilled; fidelity (or perplexity), size and speed.",
    ),  # noqa: E501
    (
        "train",
        "Train a causal LM with any attention mechanism on a text corpus; report held-out bits per byte.",
    ),
    (
        "linearize",
        "Linearize a causal LM: softmax → sliding-window + Hedgehog linear attention, attention transfer, LoRA; report perplexity, agreement, decode speed and memory, and save (see headkit.recipes.linearize).",
    ),  # noqa: E501
    (
        "export",
        "Write MODEL as a GGUF file for llama.cpp: its own family's architecture (llama, Mistral as llama, qwen2, qwen3, gemma2, gemma3, phi3), or deci for LLaMA or Phi-3 pruned unevenly (see headkit.export.gguf).",
    ),  # noqa: E501
    (
        "eval",
        "Evaluate MODEL: held-out perplexity by length, agreement and KL against --reference, passkey retrieval by length and depth (exact match, 95% intervals), decode time per token and decoding-state size — or, with --tasks, lm-evaluation-harness task scores beside --reference's; prints a table, writes OUT/report.json (and the heat map OUT/passkey.png).",
    ),  # noqa: E501
    (
        "generate",
        "Continue PROMPT with MODEL, streaming the text as it comes; then tokens per second and the size of the decoding cache (key/value cache or recurrent state) in bytes. --fast decodes through a compiled step over fixed-size caches, in the weights --weights names (see headkit.runtime.generation).",
    ),  # noqa: E501
    (
        "cache",
        "The folder where `headkit generate --fast` keeps its compiled decoding steps (one per model, shape bucket, weight type, thread count, CPU and torch version; $HEADKIT_CACHE/compiled, else ~/.cache/headkit/compiled): what it holds, or --clear to empty it (the next --fast run compiles again).",
    ),  # noqa: E501
    ("bench", "Benchmarks: rerun the measurements behind the docs/ pages (docs/index.md)."),
)


def top_level_help() -> str:
    """What ``headkit --help`` prints."""
    width = max(len(name) for name, _ in COMMANDS)
    lines = [USAGE, "", SUMMARY, "", "Options:", "  --help  Show this message and exit.", "", "Commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS]
    lines += ["", "`headkit COMMAND --help` lists a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args == ["--help"]:
        print(top_level_help())
        return
    global defer_models
    defer_models = True
    from headkit.app import main as run

    run(args)


__all__ = ["COMMANDS", "main", "top_level_help"]
