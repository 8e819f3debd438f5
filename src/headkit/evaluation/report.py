"""``headkit eval``: every measure of this package on one model (and its reference) — held-out perplexity and
agreement, passkey retrieval, decode time and decoding-state bytes, lm-eval task scores — as one report
(:func:`evaluate`), written as report.json with the passkey heat map, and printed as tables
(:func:`format_eval_table`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from headkit.analysis.plots import plot_passkey_heatmap
from headkit.errors import HeadkitError
from headkit.evaluation.memory import cache_bytes
from headkit.evaluation.quality import agreement, perplexity
from headkit.evaluation.retrieval import (
    min_passkey_length,
    passkey_trials,
    prose_sentences,
    retrieve_passkeys,
    score_passkeys,
    uses_chat_template,
)
from headkit.evaluation.settings import EvalSettings, check_eval_settings
from headkit.evaluation.tasks import (
    LoadedTasks,
    format_task_table,
    load_tasks,
    measure_tasks,
)
from headkit.evaluation.timing import decode_seconds_per_token, thread_limit
from headkit.files import write_json_atomic
from headkit.surgery.linearize import max_context

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
DEFAULT_PASSKEY_LENGTHS = (512, 1024, 2048, 4096)
DEFAULT_DECODE_CONTEXTS = (256, 1024, 4096)
REPORT_FILE, PLOT_FILE = "report.json", "passkey.png"


def _lengths(
    option: str, given: tuple[int, ...] | None, default: tuple[int, ...], context: int | None
) -> list[int]:
    if given is None:
        return [n for n in default if context is None or n <= context]
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in given):
        raise HeadkitError(f"{option} must be integers ≥ 2, got {list(given)}")
    beyond = [n for n in given if context is not None and n > context]
    if beyond:
        raise HeadkitError(
            f"{option} {', '.join(map(str, beyond))} beyond the model's context of {context} tokens "
            "(max_position_embeddings)"
        )
    return sorted(set(given))


def evaluate(
    settings: EvalSettings,
    *,
    loaded: Any = None,
    reference: Any = None,
    tasks: LoadedTasks | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Everything ``headkit eval`` measures on `settings.model` (and `settings.reference` beside it): held-out
    perplexity at each length; top-1 agreement and KL against the reference; passkey retrieval by length and
    depth (exact match, Wilson 95% intervals); per-token decode time (batch 1) and decoding-state bytes at each
    context; lm-eval task scores (`settings.tasks`). `loaded` / `reference`: models already loaded
    (:class:`headkit.runs.models.LoadedModel`); `tasks`: the tasks already loaded (:func:`load_tasks`, which
    runs here, before any model loads, when None). Writes report.json and the passkey heat map to `settings.out`
    (atomically) and returns the report."""
    check_eval_settings(settings)
    if settings.tasks and tasks is None:
        tasks = load_tasks(settings.task_settings)
    with thread_limit(settings.threads):
        return _evaluate(settings, loaded, reference, echo, tasks)


def _evaluate(
    settings: EvalSettings,
    loaded: Any,
    reference: Any,
    echo: Callable[[str], None],
    tasks: LoadedTasks | None = None,
) -> dict[str, Any]:
    from headkit.runs.models import CAUSAL_LM, load_model
    from headkit.runs.text import lm_windows, load_text

    started = time.perf_counter()
    loaded = loaded or load_model(settings.model, kind=CAUSAL_LM, dtype=settings.dtype)
    if settings.reference is not None and reference is None:
        reference = load_model(settings.reference, kind=CAUSAL_LM, dtype=settings.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    if reference is not None and reference.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise HeadkitError(f"--reference {str(settings.reference)!r} has another tokenizer than MODEL")
    context = max_context(model)
    # With tasks, the defaults are no measurement: only the lengths given run beside them.
    alone = bool(settings.tasks)
    lengths = _lengths("--lengths", settings.lengths, () if alone else DEFAULT_LENGTHS, context)
    passkey_lengths = _lengths(
        "--passkey-lengths", settings.passkey_lengths, () if alone else DEFAULT_PASSKEY_LENGTHS, context
    )
    decode_contexts = _lengths(
        "--decode-contexts", settings.decode_contexts, () if alone else DEFAULT_DECODE_CONTEXTS, context
    )
    shortest = min_passkey_length(tokenizer) + settings.max_new_tokens
    if passkey_lengths and passkey_lengths[0] < shortest:
        raise HeadkitError(
            f"--passkey-lengths: {passkey_lengths[0]} tokens cannot hold the key sentence and the question with "
            f"this tokenizer ({shortest} tokens without filler, with a {settings.max_new_tokens}-token answer): "
            f"use lengths of at least {shortest}"
        )
    models = {"model": model} | ({"reference": reference.model} if reference is not None else {})
    # Tasks alone read no text: the corpus is for perplexity and passkey filler.
    corpus = load_text(settings.data) if lengths or passkey_lengths or not settings.tasks else None
    echo(f"eval: {settings.model}" + (f" against {settings.reference}" if reference is not None else ""))

    perplexities = []
    for length in lengths:
        windows = lm_windows(
            tokenizer,
            corpus,
            length=length,
            train_windows=0,
            held_out_windows=max(1, settings.eval_tokens // length),
            seed=settings.seed,
        ).held_out
        batch = max(1, settings.batch_tokens // length)
        point: dict[str, Any] = {"length": length, "windows": int(windows.shape[0])}
        for name, network in models.items():
            point[f"{name}_perplexity"] = perplexity(network, windows, batch)
        if reference is not None:
            measured = agreement(model, reference.model, windows, batch)
            point |= {"top1_agreement": measured.top1, "kl": measured.kl}
        perplexities.append(point)
        echo(_point_line(point, PERPLEXITY_LINE))

    passkey: dict[str, Any] = {}
    if passkey_lengths:
        sentences = prose_sentences(corpus, seed=settings.seed)
        trials = [
            trial
            for length in passkey_lengths
            for trial in passkey_trials(
                tokenizer,
                sentences,
                length,
                settings.trials,
                settings.depths,
                seed=settings.seed,
                answer_tokens=settings.max_new_tokens,
            )
        ]
        passkey = {
            "chat_template": uses_chat_template(tokenizer),
            "example_prompt": tokenizer.decode(list(trials[0].input_ids)),
            "keys": [t.key for t in trials],
        }
        for name, network in models.items():
            answers = []
            for length in passkey_lengths:
                of_length = [t for t in trials if t.length == length]
                answers += retrieve_passkeys(
                    network,
                    tokenizer,
                    of_length,
                    max_new_tokens=settings.max_new_tokens,
                    batch_tokens=settings.batch_tokens,
                )
                scores = score_passkeys(of_length, answers[-len(of_length) :])["by_length"][0]
                echo(f"passkey ({name}) at {length}: {_accuracy(scores)}")
            passkey[name] = score_passkeys(trials, answers) | {"answers": answers}
            del passkey[name]["correct"]

    decode = []
    for context_length in decode_contexts:
        point = {"context": context_length}
        for name, network in models.items():
            point[f"{name}_ms_per_token"] = 1000 * decode_seconds_per_token(
                network, context_length, settings.decode_steps
            )
            point[f"{name}_state_bytes"] = cache_bytes(network, context_length)
        decode.append(point)
        echo(_point_line(point, DECODE_LINE))

    task_report = None
    if settings.tasks:
        tokenizers = {"model": tokenizer} | (
            {"reference": reference.tokenizer} if reference is not None else {}
        )
        task_report = measure_tasks(
            {name: (network, tokenizers[name]) for name, network in models.items()},
            settings.task_settings,
            reference="reference" if reference is not None else None,
            tasks=tasks,
            echo=echo,
        )

    report = {
        "model": str(settings.model),
        "reference": None if settings.reference is None else str(settings.reference),
        "data": None if corpus is None else corpus.source,
        "context": context,
        "settings": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in dataclasses.asdict(settings).items()
        }
        | {"lengths": lengths, "passkey_lengths": passkey_lengths, "decode_contexts": decode_contexts},
        "perplexity": perplexities,
        "passkey": passkey,
        "decode": decode,
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started,
    }
    if task_report is not None:
        report["tasks"] = task_report
    if settings.out is not None:
        out = Path(settings.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / REPORT_FILE, report)
        if passkey:
            plot_passkey_heatmap(
                {name: passkey[name]["by_depth"] for name in models},
                out / PLOT_FILE,
                title=Path(settings.model).name,
            )
    return report


# How a perplexity or decode point prints: its own part, then the reference's where it was measured against one.
PERPLEXITY_LINE = (
    "perplexity at {length} ({windows} windows): {model_perplexity:.3f}",
    ", reference {reference_perplexity:.3f}; top-1 agreement {top1_agreement:.1%}, KL {kl:.4f}",
)
DECODE_LINE = (
    "decode at {context}: {model_ms_per_token:.2f} ms/token, state {model_state_mib:.2f} MiB",
    "; reference {reference_ms_per_token:.2f} ms/token, {reference_state_mib:.2f} MiB",
)


def _point_line(point: dict[str, Any], line: tuple[str, str]) -> str:
    fields = point | {
        key.removesuffix("_bytes") + "_mib": value / 2**20
        for key, value in point.items()
        if key.endswith("_bytes")
    }
    own, reference = line
    return own.format(**fields) + (
        reference.format(**fields) if any(k.startswith("reference_") for k in point) else ""
    )


def _accuracy(cell: dict[str, Any]) -> str:
    low, high = cell["ci95"]
    return f"{cell['accuracy']:.0%} ({cell['correct']}/{cell['trials']}, 95% CI {low:.0%}–{high:.0%})"


def format_eval_table(report: dict[str, Any]) -> str:
    """The report as Markdown tables: perplexity (and agreement), passkey accuracy by length, decoding."""
    names = ["model"] + (["reference"] if report["reference"] else [])
    lines = []
    if report["perplexity"]:
        header = ["length", "windows"] + [f"{n} perplexity" for n in names]
        header += ["top-1 agreement", "KL (nats)"] if report["reference"] else []
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in report["perplexity"]:
            row = [str(p["length"]), str(p["windows"])] + [f"{p[f'{n}_perplexity']:.3f}" for n in names]
            row += [f"{p['top1_agreement']:.1%}", f"{p['kl']:.4f}"] if report["reference"] else []
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if report["passkey"]:
        header = ["passkey length"] + [f"{n} accuracy (95% CI)" for n in names]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for index, cell in enumerate(report["passkey"]["model"]["by_length"]):
            row = [str(cell["length"])] + [_accuracy(report["passkey"][n]["by_length"][index]) for n in names]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if report["decode"]:
        header = ["context"] + [f"{n} {what}" for n in names for what in ("ms/token", "state MiB")]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in report["decode"]:
            row = [str(p["context"])] + [
                value
                for n in names
                for value in (f"{p[f'{n}_ms_per_token']:.2f}", f"{p[f'{n}_state_bytes'] / 2**20:.2f}")
            ]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if report.get("tasks"):
        lines.append(format_task_table(report["tasks"]))
    return "\n".join(lines).rstrip() + "\n"
