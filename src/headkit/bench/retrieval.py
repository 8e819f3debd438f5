"""``headkit bench retrieval``: what a constant decoding state remembers, against a compressed cache of the same size.

For each point of a budget grid — G exact keys per layer and key/value head chosen by the prompt's question
(SnapKV), R retrieval heads kept softmax with a full cache (DuoAttention) — it measures, side by side in one run:

* **the linearized model** (``--linearized``, a ``headkit linearize`` output of MODEL), reconfigured in place to
  the point (:func:`headkit.surgery.linearize.reconfigure`: none of G, R or the selection has parameters);
* **the honest baseline**: MODEL itself with the same mechanism and no linear state (``fold=False``: what leaves
  the exact sets is dropped), its budget the largest whose state at ``--state-context`` tokens is no larger than
  the linearized point's — the original with a SnapKV-style compressed cache of equal bytes;
* **the original** with its full key/value cache, once;
* with ``--kvpress-python``, **NVIDIA kvpress' ``SnapKVPress``** on the original beside each baseline without
  retrieval heads, keeping as many tokens per key/value head as that baseline (equal bytes): the reference
  implementation users know, run in a child process of its own venv (kvpress pins ``transformers<5.3``;
  :mod:`headkit.bench._kvpress_reference`). Passkey rows only: kvpress compresses a prefill, so neither the second
  turn nor a cached perplexity has its counterpart there.

Each gets: passkey accuracy on prompts whose key has left the window (Wilson 95% intervals), the same key asked
for in a second turn (the key's turn prefilled first, then ``--second-turn-gap`` tokens of other text and the
question), held-out perplexity at ``--perplexity-length`` (causal: without a cache no question has been asked,
so the budget holds the first keys that left the window), and the decoding state's bytes at
``--state-context`` tokens, batch 1. Method and results: docs/linearize.md.
"""

from __future__ import annotations

import copy
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from headkit.analysis.retrieval import top_heads
from headkit.bench._options import check_out_dir
from headkit.bench._report import markdown_table
from headkit.bench.registry import option, quick_preset, register_benchmark
from headkit.errors import HeadkitError
from headkit.evaluation.memory import cache_bytes
from headkit.evaluation.quality import perplexity
from headkit.evaluation.retrieval import (
    key_beyond_window,
    passkey_answer,
    passkey_retrieval_scores,
    passkey_trials,
    prose_sentences,
    retrieve_passkeys,
    second_turn_passkeys,
    wilson_interval,
)
from headkit.runs.models import CAUSAL_LM, load_model, smollm2_gguf_path
from headkit.runs.text import lm_windows, load_text
from headkit.surgery.apply import apply_
from headkit.surgery.linearize import (
    LinearizeConfig,
    linearized_modules,
    max_context,
    reconfigure,
)

# Depths whose keys leave a 256-token window at 1,024 tokens and beyond (0: the key first).
BEYOND_DEPTHS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
ANSWER_TOKENS = 8


@dataclass
class RetrievalBenchSettings:
    model: Path | None = option(None, "The original causal LM (default: SmolLM2-135M-Instruct's GGUF).")
    linearized: Path | None = option(
        None,
        "A linearized model of MODEL (a `headkit linearize` output folder), reconfigured to each point; none: "
        "the original and its compressed-cache baseline alone.",
    )
    lengths: tuple[int, ...] = option((1024, 2048), "Passkey prompt lengths.", quick=(512,))
    trials: int = option(20, "Passkey prompts per length, every key beyond the window.", min=1, quick=4)
    budgets: tuple[int, ...] = option(
        (32, 128, 512), "Exact keys per layer and key/value head (G), chosen by the question.", quick=(16,)
    )
    retrieval_head_counts: tuple[int, ...] = option(
        (0, 4, 8, 16), "Retrieval heads kept softmax with a full cache (R).", min=0, quick=(0, 2)
    )
    window: int = option(256, "Window of the baseline when no linearized model is given.", quick=64)
    sinks: int | None = option(
        None, "Sinks kept exact (default: the linearized model's own; 4 without one).", min=0
    )
    observation: int = option(32, "Queries at the end of a prompt that choose its keys.", quick=8)
    second_turn_gap: int = option(
        512, "Tokens of other text between the key's turn and the question's (the second turn).", quick=128
    )
    perplexity_length: int = option(4096, "Held-out window length for perplexity.", min=2, quick=512)
    held_out_windows: int = option(2, "Held-out windows for perplexity.", min=1, quick=1)
    state_context: int = option(8192, "Context at which the decoding state's bytes are counted.", min=1)
    data: Path | None = option(None, "Text for filler and perplexity (default: the Python standard library).")
    kvpress_python: Path | None = option(
        None,
        "A Python interpreter with NVIDIA's kvpress installed (`make kvpress` makes .venv-kvpress/bin/python; "
        "kvpress pins transformers<5.3, so it lives in a venv of its own): adds kvpress' SnapKVPress, keeping "
        "the tokens per head of each baseline without retrieval heads, as a reference row (passkey only).",
    )
    threads: int = option(2, "torch threads.", min=1)
    seed: int = option(0, "Seed of the prompts and keys.")
    out: Path = option(
        Path("results/retrieval"), "Output directory for results.json and table.md.", check=check_out_dir
    )

    quick = quick_preset("One budget, R ∈ {0, 2}, 4 prompts of 512 tokens (a smoke test of the grid).")


def _check(settings: RetrievalBenchSettings) -> None:
    for name in ("lengths", "budgets", "retrieval_head_counts"):
        if not getattr(settings, name):
            raise HeadkitError(f"--{name.replace('_', '-')} must list at least one value")
    if settings.observation >= min(settings.lengths):
        raise HeadkitError(
            f"--observation must be shorter than the shortest prompt ({min(settings.lengths)} tokens), got "
            f"{settings.observation}"
        )
    for path, flag in ((settings.model, "MODEL"), (settings.linearized, "--linearized")):
        if path is not None and not Path(path).exists():
            raise HeadkitError(f"{flag} {str(path)!r} does not exist")
    if settings.kvpress_python is not None:
        check_kvpress(Path(settings.kvpress_python))


KVPRESS_CHILD = Path(__file__).with_name("_kvpress_reference.py")


def check_kvpress(python: Path) -> None:
    """--kvpress-python runs and imports kvpress, transformers and torch: refused before any work otherwise."""
    if not python.is_file():
        raise HeadkitError(
            f"--kvpress-python must be a Python interpreter with kvpress installed (make kvpress), got "
            f"{str(python)!r}, which is not a file"
        )
    try:
        probe = subprocess.run(
            [str(python), "-c", "import kvpress, transformers, torch"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except OSError as error:
        raise HeadkitError(f"--kvpress-python {str(python)!r} does not run: {error}") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise HeadkitError(f"--kvpress-python {str(python)!r} cannot import kvpress: {last}")


def beyond_window_trials(
    tokenizer: Any,
    sentences: list[str],
    lengths: tuple[int, ...],
    count: int,
    window: int,
    gap: int,
    seed: int,
) -> tuple[list[Any], list[Any]]:
    """`count` passkey prompts per length whose key has left a `window`-token window by the question, and those
    of the longest length that a second turn of `gap` tokens can ask (the key before the turn)."""
    trials = []
    for length in lengths:
        made = passkey_trials(
            tokenizer, sentences, length, count * 4, BEYOND_DEPTHS, seed=seed, answer_tokens=ANSWER_TOKENS
        )
        beyond = [t for t in made if key_beyond_window(t, window)]
        if len(beyond) < count:
            raise HeadkitError(
                f"too few passkey prompts of {length} tokens hold their key beyond the window {window}"
            )
        trials += beyond[:count]
    second_turn = [t for t in trials if t.length == max(lengths) and key_beyond_window(t, gap)]
    return trials, second_turn


def kvpress_answers(
    python: Path, model: Path, prompts: list[tuple[int, ...]], kept: int, observation: int, threads: int
) -> dict[str, Any]:
    """kvpress' SnapKVPress's greedy answer ids ({"answers", "seconds", "versions"}) to `prompts`, each prompt's
    cache compressed to `kept` tokens per key/value head, from a child process of `python`
    (:mod:`headkit.bench._kvpress_reference`)."""
    with tempfile.TemporaryDirectory(prefix="headkit-kvpress-") as folder:
        request, answer = Path(folder) / "request.json", Path(folder) / "answer.json"
        request.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "prompts": [list(p) for p in prompts],
                    "kept": kept,
                    "observation": observation,
                    "max_new_tokens": ANSWER_TOKENS,
                    "threads": threads,
                }
            )
        )
        done = subprocess.run(
            [str(python), str(KVPRESS_CHILD), str(request), str(answer)], capture_output=True, text=True
        )
        if done.returncode != 0 or not answer.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise HeadkitError(f"the kvpress reference run failed (exit {done.returncode}):\n{tail}")
        return json.loads(answer.read_text())


def _state_bytes(model: nn.Module, context: int) -> int:
    """Decoding-state bytes at `context` tokens, batch 1: the converted layers' (their exact heads' cache
    included) plus the key/value cache of layers left softmax."""
    modules = linearized_modules(model)
    converted = sum(module.state_bytes(context) for module in modules)
    layers = model.config.get_text_config().num_hidden_layers
    if len(modules) == layers:
        return converted
    per_layer = cache_bytes(model, 16) / 16 / layers  # every layer's KV per token, measured on a short prompt
    return converted + int(per_layer * context * (layers - len(modules)))


def _equal_budget(model: nn.Module, target: int, context: int) -> int:
    """The largest budget G′ whose state at `context` tokens (every converted layer, its window, sinks and exact
    heads as they are) is at most `target` bytes: the state is affine in G′."""
    probes = [copy.deepcopy(module) for module in linearized_modules(model)]

    def total(budget: int) -> int:
        for probe in probes:
            probe.configure(
                sinks=probe.sinks, budget=budget, selection=probe.selection, observation=probe.observation,
                exact_heads=probe.exact_heads,
            )  # fmt: skip
        return sum(probe.state_bytes(context) for probe in probes)

    base = total(0)
    return max(0, (target - base) // max(total(1) - base, 1))


def retrieval_rates(
    model: nn.Module, tokenizer: Any, trials: Any, turns: Any, settings: Any, *, batch_tokens: int = 8192
) -> dict[str, Any]:
    """A model's passkey columns: its rates at each of ``settings.lengths`` and the same keys asked in a second
    turn ``settings.second_turn_gap`` tokens later (the retrieval and frontier benchmarks' shared columns);
    prompts of equal length decoded together, about `batch_tokens` prompt tokens a batch."""
    answers = retrieve_passkeys(
        model, tokenizer, trials, max_new_tokens=ANSWER_TOKENS, batch_tokens=batch_tokens
    )
    rates = passkey_rates(answers, trials, settings.lengths)
    if not turns:  # no prompt of the longest length holds its key before a second turn of that many tokens
        return rates | {"second_turn": None}
    answers = second_turn_passkeys(
        model, tokenizer, turns, gap=settings.second_turn_gap, max_new_tokens=ANSWER_TOKENS,
        batch_tokens=batch_tokens,
    )  # fmt: skip
    return rates | {"second_turn": scored_answers(answers, turns)}


def _measure(
    name: str, model: nn.Module, settings: RetrievalBenchSettings, shared: dict[str, Any], echo: Any
) -> dict[str, Any]:
    started = time.perf_counter()
    tokenizer, trials, window = shared["tokenizer"], shared["trials"], shared["window"]
    point: dict[str, Any] = {"model": name, "state_bytes": _state_bytes(model, settings.state_context)}
    point |= retrieval_rates(model, tokenizer, trials, shared["second_turn"], settings)
    point["perplexity"] = perplexity(model, shared["held_out"], 1)
    point["seconds"] = time.perf_counter() - started
    echo(_line(point, settings, window))
    return point


def _measure_kvpress(
    kept: int, model_path: Path, settings: RetrievalBenchSettings, shared: dict[str, Any], echo: Any
) -> dict[str, Any]:
    """kvpress' SnapKVPress on the original, `kept` tokens per key/value head: passkey rows and its cache's bytes
    (`kept` tokens of the original's key/value cache, whatever the context)."""
    trials, tokenizer = shared["trials"], shared["tokenizer"]
    run = kvpress_answers(
        Path(settings.kvpress_python), model_path, [t.input_ids for t in trials], kept, settings.observation,
        settings.threads,
    )  # fmt: skip
    versions = run["versions"]
    point: dict[str, Any] = {
        "model": f"kvpress {versions['kvpress']} SnapKVPress, {kept} tokens per head (equal bytes)",
        "state_bytes": round(shared["kv_bytes_per_token"] * kept),
        "kept_tokens": kept,
        "versions": versions,
        "second_turn": None,
        "perplexity": None,
        "seconds": run["seconds"],
    }
    answers = [tokenizer.decode(ids, skip_special_tokens=True) for ids in run["answers"]]
    point |= passkey_rates(answers, trials, settings.lengths)
    echo(_line(point, settings, shared["window"]))
    return point


def scored_answers(answers: list[str], trials: list[Any]) -> dict[str, Any]:
    """The share of `answers` that hold their trial's key, with its Wilson interval."""
    return _rate(sum(passkey_answer(a) == t.key for a, t in zip(answers, trials, strict=True)), len(trials))


def passkey_rates(answers: list[str], trials: list[Any], lengths: tuple[int, ...]) -> dict[str, Any]:
    """``passkey_<length>``: each length's share of `answers` (in the trials' order) that hold their key."""
    return {
        f"passkey_{length}": scored_answers(
            [a for a, t in zip(answers, trials, strict=True) if t.length == length],
            [t for t in trials if t.length == length],
        )
        for length in lengths
    }


def _rate(hits: int, trials: int) -> dict[str, Any]:
    low, high = wilson_interval(hits, trials)
    return {"correct": hits, "trials": trials, "accuracy": hits / trials, "wilson_95": [low, high]}


def _line(point: dict[str, Any], settings: RetrievalBenchSettings, window: int) -> str:
    passkeys = ", ".join(
        f"{point[f'passkey_{n}']['correct']}/{point[f'passkey_{n}']['trials']} at {n}"
        for n in settings.lengths
    )
    turn, ppl = point["second_turn"], point["perplexity"]
    turn = "not measured" if turn is None else f"{turn['correct']}/{turn['trials']}"
    ppl = "not measured" if ppl is None else f"{ppl:.3f} at {settings.perplexity_length}"
    return (
        f"{point['model']}: state {point['state_bytes'] / 2**20:.1f} MiB at {settings.state_context}; passkey "
        f"beyond a {window}-token window {passkeys}; second turn {turn}; perplexity {ppl} "
        f"({point['seconds']:.0f} s)"
    )


def results_table(report: dict[str, Any]) -> str:
    """table.md: one row per model and point."""
    lengths = report["lengths"]
    original = report["points"][0]
    rows = []
    for point in report["points"]:
        cells = [
            point["model"],
            f"{point['state_bytes'] / 2**20:.1f} MiB",
            f"1/{original['state_bytes'] / point['state_bytes']:.1f}",
        ]
        for length in lengths:
            cell = point[f"passkey_{length}"]
            low, high = cell["wilson_95"]
            cells.append(f"{cell['accuracy']:.0%} [{low:.0%}, {high:.0%}]")
        turn, ppl = point["second_turn"], point["perplexity"]
        cells.append("—" if turn is None else f"{turn['accuracy']:.0%} ({turn['correct']}/{turn['trials']})")
        cells.append("—" if ppl is None else f"{ppl / original['perplexity']:.2f}×")
        rows.append(cells)
    header = (
        f"{report['model']}: passkey with the key beyond a {report['window']}-token window "
        f"({report['trials']} prompts per length), second turn after {report['second_turn_gap']} tokens, "
        f"perplexity at {report['perplexity_length']} tokens; state at {report['state_context']} tokens, batch 1."
    )
    columns = [
        "model",
        "state",
        "of the KV cache",
        *(f"passkey @{n}" for n in lengths),
        "second turn",
        "perplexity",
    ]
    return f"{header}\n\n" + markdown_table(columns, rows)


@register_benchmark("retrieval", RetrievalBenchSettings, check=_check, render=results_table)
def run_retrieval_benchmark(settings: RetrievalBenchSettings, console: Any) -> dict[str, Any]:
    """Passkey (key beyond the window, and asked in a second turn), perplexity and decoding-state bytes of a
    linearized model over a budget grid (G question-chosen exact keys, R retrieval heads), beside the original
    with a compressed cache of equal bytes and the original itself.

    Returns the dictionary written to ``results.json``."""

    def echo(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    model_path = Path(settings.model) if settings.model is not None else smollm2_gguf_path()
    loaded = load_model(model_path, kind=CAUSAL_LM)
    original, tokenizer = loaded.model, loaded.tokenizer
    trained = None
    if settings.linearized is not None:
        trained = load_model(settings.linearized, kind=CAUSAL_LM).model
        if not linearized_modules(trained):
            raise HeadkitError(f"--linearized {str(settings.linearized)!r} has no linearized layer")
    reference = linearized_modules(trained)[0] if trained is not None else None
    window = reference.window if reference is not None else settings.window
    sinks = (
        settings.sinks if settings.sinks is not None else (reference.sinks if reference is not None else 4)
    )
    context = max_context(original)
    longest = max([*settings.lengths, settings.perplexity_length])
    if context is not None and longest > context:
        raise HeadkitError(f"lengths must be at most the model's context of {context}, got {longest}")

    corpus = load_text(settings.data)
    sentences = prose_sentences(corpus, seed=settings.seed)
    trials, second_turn = beyond_window_trials(
        tokenizer,
        sentences,
        settings.lengths,
        settings.trials,
        window,
        settings.second_turn_gap,
        settings.seed,
    )
    held_out = lm_windows(
        tokenizer, corpus, length=settings.perplexity_length, train_windows=1,
        held_out_windows=settings.held_out_windows, seed=settings.seed,
    ).held_out  # fmt: skip
    shared = {
        "tokenizer": tokenizer,
        "trials": trials,
        "window": window,
        "second_turn": second_turn,
        "held_out": held_out,
        "kv_bytes_per_token": cache_bytes(original, 16) / 16,  # every layer's keys and values, one sequence
    }

    scores, _ = passkey_retrieval_scores(original, tokenizer, sentences, context=context, seed=settings.seed)
    echo(
        "retrieval heads (best 16): "
        + ", ".join(
            f"{layer}:{head} {float(scores[layer, head]):.2f}"
            for layer, head in top_heads(scores, min(16, scores.numel()))
        )
    )

    points = [_measure("original (full KV cache)", original, settings, shared, echo)]
    for count in settings.retrieval_head_counts:
        heads = top_heads(scores, count)
        for budget in settings.budgets:
            label = f"G={budget} R={count}"
            target = None
            if trained is not None:
                reconfigure(
                    trained,
                    sinks=sinks,
                    budget=budget,
                    selection="question",
                    observation=settings.observation,
                    retrieval_heads=heads,
                )
                linear = _measure(f"linearized {label}", trained, settings, shared, echo)
                points.append(linear)
                target = linear["state_bytes"]
            baseline = copy.deepcopy(original)
            config = LinearizeConfig(
                window=window, sinks=sinks, budget=budget, selection="question",
                observation=settings.observation, fold=False, retrieval_heads=heads,
            )  # fmt: skip
            apply_(baseline, config)
            if target is not None:
                equal = _equal_budget(baseline, target, settings.state_context)
                reconfigure(baseline, budget=equal)
                label = f"G′={equal} R={count} (equal bytes)"
            points.append(_measure(f"compressed cache {label}", baseline, settings, shared, echo))
            if settings.kvpress_python is not None and not count:
                module = linearized_modules(baseline)[0]
                kept = module.sinks + module.window + module.budget
                points.append(_measure_kvpress(kept, model_path, settings, shared, echo))
            del baseline
    return {
        "model": str(model_path),
        "linearized": None if settings.linearized is None else str(settings.linearized),
        "window": window,
        "sinks": sinks,
        "lengths": list(settings.lengths),
        "trials": settings.trials,
        "second_turn_gap": settings.second_turn_gap,
        "second_turn_trials": len(second_turn),
        "perplexity_length": settings.perplexity_length,
        "state_context": settings.state_context,
        "retrieval_head_scores": scores.tolist(),
        "points": points,
    }
