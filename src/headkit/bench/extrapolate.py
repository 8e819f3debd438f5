"""``headkit bench extrapolate``: RoPE against CoCA beyond the trained context — perplexity and passkey retrieval.

The length-extrapolation experiment of Zhu et al. 2023, "CoCA: Collinear Constrained Attention" (arXiv:2309.08646,
§4), at laptop scale: a softmax (RoPE) and a CoCA byte-level LM trained alike at 128 bytes, on corpus windows
mixed with passkey documents (Mohtashami & Jaggi 2023, arXiv:2305.16300, §4.2), are evaluated at longer lengths
as they are, under linear position interpolation (Chen et al. 2023, arXiv:2306.15595) and under dynamic NTK
scaling (transformers' ``rope_type="dynamic"``), rebuilt from a config with other ``rope_parameters`` and the
same weights: held-out bits per byte and passkey accuracy. Results: docs/from-scratch.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headkit.bench._options import check_corpus, check_head_width
from headkit.bench._report import (
    TABLE_FILE,
    figure_axes,
    grid_rows,
    markdown_table,
    plot_series,
    quiet_transformers,
)
from headkit.bench._training import train_each
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.data import (
    ByteTokenizer,
    encode_corpus,
    evaluation_windows,
    load_corpus,
    sample_batch,
    special_token_ids,
)
from headkit.errors import HeadkitError
from headkit.evaluation import retrieval as evaluate
from headkit.evaluation.quality import held_out_bits_per_byte
from headkit.models import HeadkitConfig, HeadkitForCausalLM
from headkit.runs.options import check_integers
from headkit.train import default_config, lm_optimization

MODELS = ("softmax", "coca")
SCALINGS = ("none", "linear", "dynamic")
KEY_DIGITS = evaluate.KEY_DIGITS
# The evaluator's passkey prompt as plain bytes, the layout the models train on: filler with the key sentence
# inside, then " What is the pass key? The pass key is " and the key.
PASSKEY_FORMAT = evaluate.PasskeyFormat(
    key_sentence="The pass key is {key}. Remember it. {key} is the pass key.",
    instruction="",
    question=" What is the pass key?",
    answer_prefix="The pass key is ",
    chat=False,
    separator="",
)
FILLER_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
# Bytes of a passkey document that are not filler (key sentence, question, answer): the shortest document.
MIN_DOCUMENT_LENGTH = (
    len(f" {PASSKEY_FORMAT.key_sentence.format(key='0' * KEY_DIGITS)}")
    + len(f"{PASSKEY_FORMAT.question} {PASSKEY_FORMAT.answer_prefix}")
    + KEY_DIGITS
)
MAX_LENGTH = 65_536
# Rows × length per forward pass in evaluation: bounds the memory of the longest windows.
EVAL_BATCH_TOKENS = 16_384
PERPLEXITY_PLOT, PASSKEY_PLOT = "perplexity.png", "passkey.png"
# Document separators are not text: they are neither predicted nor counted.
SPECIAL_IDS = torch.tensor(special_token_ids(ByteTokenizer()), dtype=torch.long)


@dataclass
class ExtrapolateConfig:
    """Settings of one ``headkit bench extrapolate`` run."""

    out: Path = option(
        Path("results/extrapolate"), "Output directory for results.json, table.md and the plots."
    )
    steps: int = option(2000, "Training steps per model.", min=1, quick=500)
    batch_size: int = option(32, "Windows per step.", min=2, quick=16)
    lr: float = setting(2e-3, positive=True)
    hidden_size: int = option(128, "Model width.", min=2, quick=64)
    layers: int = option(4, "Decoder layers.", min=1, quick=2)
    heads: int = setting(4, min=1, quick=2)
    train_length: int = setting(128, min=MIN_DOCUMENT_LENGTH)  # at least a passkey document
    lengths: tuple[int, ...] = option(
        (128, 256, 512, 1024, 2048),
        "Comma-separated evaluation lengths ≥ 128, the trained one.",
    )
    passkey_fraction: float = 0.5  # share of each training batch that is passkey documents
    passkey_trials: int = option(50, "Passkey documents per length.", min=1, quick=10)
    eval_tokens: int = setting(32_768, min=1, quick=8192)  # held-out tokens scored at every length
    dynamic_factor: float | None = setting(None, min=1)  # None: max(lengths) / train_length
    rope_theta: float = 10000.0
    corpus: Path | None = option(
        None, "Text file or folder to train on (default: the Python stdlib).", check=check_corpus
    )
    # Read at most this many corpus bytes; None: all.
    corpus_bytes: int | None = setting(None, min=1, quick=8_000_000)
    seed: int = option(0, "Seed of the initialisation, batches and passkey documents.")
    # Small models: a second thread mostly adds synchronisation on a shared two-core machine.
    threads: int = option(1, "torch threads (small models: 1 is fastest on 2 cores).", min=1)

    quick = quick_preset("Small models, short training, 10 passkey trials (< 3 minutes).")

    def resolved_dynamic_factor(self) -> float:
        if self.dynamic_factor is not None:
            return float(self.dynamic_factor)
        return max(1.0, max(self.lengths) / self.train_length)


@functools.cache
def byte_tokenizer() -> Any:
    """The byte tokenizer as a 🤗 tokenizer, the form the evaluator's passkey generator reads."""
    return ByteTokenizer().to_transformers()


def _filler(length: int, rng: np.random.Generator) -> list[str]:
    """Random :data:`FILLER_SENTENCES`, enough to fill `length` bytes (each is at least 11 bytes and a space)."""
    return [FILLER_SENTENCES[int(i)] for i in rng.integers(len(FILLER_SENTENCES), size=length // 12 + 1)]


def passkey_documents(
    length: int, count: int, depths: list[float], rng: np.random.Generator
) -> list[evaluate.PasskeyTrial]:
    """`count` passkey prompts of ``length`` − :data:`KEY_DIGITS` bytes (the key completes the document) from
    :func:`headkit.evaluation.retrieval.passkey_trials`, on random filler sentences, at `depths`."""
    return evaluate.passkey_trials(
        byte_tokenizer(),
        _filler(length, rng),
        length,
        count,
        depths,
        seed=int(rng.integers(2**32)),
        answer_tokens=KEY_DIGITS,
        format=PASSKEY_FORMAT,
    )


def passkey_batch(count: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    """``count`` whole passkey documents (prompt and answer) of ``length`` bytes at uniform depths: [count, L]."""
    if count == 0:
        return torch.empty(0, length, dtype=torch.long)
    documents = passkey_documents(length, count, [float(rng.random()) for _ in range(count)], rng)
    rows = [list(document.input_ids) + list(document.key.encode("ascii")) for document in documents]
    return torch.tensor(rows, dtype=torch.long).reshape(count, length)


def passkey_trials(length: int, trials: int, seed: int) -> list[evaluate.PasskeyTrial]:
    """The evaluation documents of one length: seeded by (seed, length), depths stratified over [0, 1]."""
    rng = np.random.default_rng([seed, length])
    return passkey_documents(
        length, trials, [min(1.0, (t + rng.random()) / trials) for t in range(trials)], rng
    )


def model_config(
    attention: str, config: ExtrapolateConfig, scaling: str = "none", length: int = 0
) -> HeadkitConfig:
    """The config of a model with ``attention``, its rotary positions scaled by ``scaling`` for inputs of
    ``length`` tokens (the trained length, 128, is ``max_position_embeddings``: dynamic NTK's L₀)."""
    return default_config(
        ByteTokenizer(),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        attention=attention,
        position_embedding_type="rope",
        max_position_embeddings=config.train_length,
        rope_parameters=rope_parameters(scaling, length, config),
    )


def rope_parameters(scaling: str, length: int, config: ExtrapolateConfig) -> dict[str, Any]:
    """transformers' ``rope_parameters`` of ``scaling`` for inputs of ``length`` tokens."""
    theta = {"rope_theta": float(config.rope_theta)}
    # Position interpolation squeezes L positions into the trained range; shorter inputs need nothing.
    factors = {"linear": max(1.0, length / config.train_length), "dynamic": config.resolved_dynamic_factor()}
    if scaling == "none":
        return {"rope_type": "default"} | theta
    if scaling not in factors:
        raise HeadkitError(f"scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    return {"rope_type": scaling, "factor": factors[scaling]} | theta


def build_model(attention: str, config: ExtrapolateConfig) -> HeadkitForCausalLM:
    """A fresh model; the same initialisation seed for every mechanism."""
    torch.manual_seed(config.seed)
    return HeadkitForCausalLM(model_config(attention, config))


def scaled_model(
    model: HeadkitForCausalLM, scaling: str, length: int, config: ExtrapolateConfig
) -> HeadkitForCausalLM:
    """``model``'s weights in a model whose rotary positions are scaled by ``scaling`` for ``length`` tokens."""
    state = model.state_dict()
    rotary = [name for name in state if "rotary" in name or "inv_freq" in name]
    if rotary:
        # A saved rotary table would carry the trained scaling into the new model, silently.
        raise HeadkitError(f"the state dict holds rotary buffers {rotary}; cannot rescale by config")
    scaled = HeadkitForCausalLM(model_config(model.config.attention, config, scaling, length))
    scaled.load_state_dict(state, strict=True)
    return scaled.eval()


def lm_training(
    model: HeadkitForCausalLM, train_stream: torch.Tensor, config: ExtrapolateConfig
) -> dict[str, Any]:
    """How a model trains (:func:`headkit.train.train_on_batches`' options but the step count): batches of
    corpus windows and passkey documents, seeded (every mechanism sees the same batches); AdamW warmed up for
    5 % of the steps, then a cosine decay to a tenth of ``config.lr``, gradients clipped to norm 1."""
    passkey_rows = round(config.passkey_fraction * config.batch_size)
    corpus_rows = config.batch_size - passkey_rows

    def draw(index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        windows = sample_batch(train_stream, corpus_rows, config.train_length, generator)
        rng = np.random.default_rng([config.seed + 1, index])
        batch = torch.cat([windows, passkey_batch(passkey_rows, config.train_length, rng)])
        return {"input_ids": batch, "labels": batch.masked_fill(torch.isin(batch, SPECIAL_IDS), -100)}

    warmup = max(1, config.steps // 20)
    optimization = lm_optimization(model, config.lr, 0.01, config.steps, warmup=warmup)
    return {"draw": draw, "seed": config.seed, "max_grad_norm": 1.0} | optimization


def held_out_windows(held_out_stream: torch.Tensor, length: int, eval_tokens: int) -> torch.Tensor:
    """The evaluation windows of one length: the first ``eval_tokens`` held-out tokens cut into [N, length]."""
    if held_out_stream.numel() < max(eval_tokens, length):
        raise HeadkitError(
            f"the held-out corpus holds {held_out_stream.numel()} tokens, fewer than eval_tokens={eval_tokens} "
            f"or length={length}: use a larger --corpus"
        )
    return evaluation_windows(held_out_stream, length, eval_tokens)


def retrieve_passkeys(model: HeadkitForCausalLM, documents: list[evaluate.PasskeyTrial]) -> list[str]:
    """The model's greedy 5-byte answers to the documents' prompts (:func:`headkit.evaluation.retrieval.
    retrieve_passkeys`), each padded with "?" to 5 characters (a special token is never a digit)."""
    if not documents:
        return []
    with quiet_transformers():  # the input exceeds max_position_embeddings: that is the point
        answers = evaluate.retrieve_passkeys(
            model, byte_tokenizer(), documents, max_new_tokens=KEY_DIGITS, batch_tokens=EVAL_BATCH_TOKENS
        )
    return [answer.ljust(KEY_DIGITS, "?")[:KEY_DIGITS] for answer in answers]


def score_answers(answers: list[str], keys: list[str]) -> tuple[float, float]:
    """(exact-match accuracy, per-digit accuracy) of ``answers`` against ``keys``."""
    if len(answers) != len(keys) or not keys:
        raise HeadkitError(f"need as many answers as keys (≥ 1), got {len(answers)} and {len(keys)}")
    exact = sum(answer == key for answer, key in zip(answers, keys, strict=True)) / len(keys)
    digits = sum(
        a == k for answer, key in zip(answers, keys, strict=True) for a, k in zip(answer, key, strict=True)
    ) / (len(keys) * KEY_DIGITS)
    return exact, digits


def check_settings(config: ExtrapolateConfig) -> None:
    """The rules that relate settings, and the passkey fraction's range (each field's other checks are declared
    on it), before any corpus is read."""
    check_head_width(config.hidden_size, config.heads, even=True)
    check_integers("--lengths", config.lengths, config.train_length, MAX_LENGTH, distinct=True)
    if not 0.0 <= config.passkey_fraction < 1.0:
        raise HeadkitError(f"passkey_fraction must be in [0, 1), got {config.passkey_fraction!r}")
    if round(config.passkey_fraction * config.batch_size) >= config.batch_size:
        raise HeadkitError(
            f"--batch-size {config.batch_size} leaves no corpus window beside the passkey documents"
        )


def render_markdown(report: dict[str, Any]) -> str:
    """Two tables: bits per byte (perplexity) and passkey accuracy, per model × scaling (rows) and length."""
    lengths = sorted({row["length"] for row in report["perplexity"]})
    groups = [
        {"attention": a, "scaling": s}
        for a, s in dict.fromkeys((row["attention"], row["scaling"]) for row in report["perplexity"])
    ]
    headers = ["attention", "RoPE scaling", *(f"L = {length}" for length in lengths)]

    def by_length(records: list[dict[str, Any]], cell: Callable[[dict[str, Any]], str]) -> str:
        return markdown_table(headers, grid_rows(records, groups, "length", lengths, cell))

    settings, machine = report["settings"], report["machine"]
    model_rows = [
        [m["attention"], f"{m['parameters']:,}", f"{m['train_seconds']:.1f}", f"{m['final_train_loss']:.3f}"]
        for m in report["models"]
    ]
    windows = {row["length"]: row["windows"] for row in report["perplexity"]}  # the same for every model
    return (
        f"Length extrapolation: trained at {settings['train_length']} bytes ({settings['steps']} steps × "
        f"{settings['batch_size']} windows, {settings['passkey_fraction']:.0%} passkey documents), hidden "
        f"{settings['hidden_size']}, {settings['layers']} layers, {settings['heads']} heads; dynamic NTK factor "
        f"{report['dynamic_factor']:g}. {machine['cpu_model']}, {machine['torch_threads']} torch threads, "
        f"torch {machine['torch_version']}.\n\n"
        + markdown_table(["attention", "parameters", "train s", "final train loss"], model_rows)
        + f"\nHeld-out bits per byte (per-byte perplexity), the same {settings['eval_tokens']:,} tokens at every "
        f"length (windows: {', '.join(f'{n}: {windows[n]}' for n in lengths)}):\n\n"
        + by_length(report["perplexity"], lambda r: f"{r['bits_per_byte']:.3f} ({r['perplexity']:.2f})")
        + f"\nPasskey retrieval, {settings['passkey_trials']} documents per length: exact-match accuracy / "
        "per-digit accuracy (chance 0.00001 / 0.1):\n\n"
        + by_length(report["passkey"], lambda r: f"{r['accuracy']:.2f} / {r['digit_accuracy']:.2f}")
    )


_COLOURS = {"softmax": "tab:blue", "coca": "tab:red"}
_STYLES = {"none": "-", "linear": "--", "dynamic": ":"}


def plot_perplexity(report: dict[str, Any]) -> Any:
    """Held-out bits per byte against length (log x), a line per model × scaling."""
    figure, axis = figure_axes((7, 4.5))
    _plot_lines(axis, report["perplexity"], "bits_per_byte", report["settings"]["train_length"])
    axis.set(xlabel="context length (bytes)", ylabel="held-out bits per byte")
    axis.set_title("perplexity beyond the trained length (grey line)")
    axis.legend(fontsize=8)
    return figure


def plot_passkey(report: dict[str, Any]) -> Any:
    """Passkey accuracy (exact, per-digit) against length (log x), a line per model × scaling."""
    figure, axes = figure_axes((11, 4.2), 1, 2)
    for axis, metric, title, chance in (
        (axes[0], "accuracy", "all 5 digits right", 1e-5),
        (axes[1], "digit_accuracy", "per digit", 0.1),
    ):
        # Accuracies often coincide (all 0, all 1): a small sideways shift keeps every line visible.
        _plot_lines(axis, report["passkey"], metric, report["settings"]["train_length"], spread=0.04)
        axis.axhline(chance, color="grey", linewidth=0.8, linestyle="--")
        axis.set(ylim=(-0.03, 1.03), xlabel="document length (bytes)", ylabel="accuracy")
        axis.set_title(f"passkey retrieval: {title}")
    axes[1].legend(fontsize=8)
    figure.suptitle(
        "trained length: grey line; lines shifted sideways where they coincide", fontsize=9, y=-0.02, va="top"
    )
    return figure


def _plot_lines(
    axis: Any, records: list[dict[str, Any]], metric: str, train_length: int, spread: float = 0.0
) -> None:
    """`metric` against length on log₂ x, a line per model × scaling, the trained length as a grey line."""

    def style(attention: str, scaling: str) -> dict[str, Any]:
        return {"color": _COLOURS.get(attention), "linestyle": _STYLES.get(scaling, "-")}

    plot_series(
        axis, records, "length", metric, ("attention", "scaling"), label="{}, {}", style=style, spread=spread
    )
    axis.axvline(train_length, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.grid(alpha=0.3)


@register_benchmark(
    "extrapolate",
    ExtrapolateConfig,
    check=check_settings,
    render=render_markdown,
    files={name: name for name in (TABLE_FILE, PERPLEXITY_PLOT, PASSKEY_PLOT)},
    plots={PERPLEXITY_PLOT: plot_perplexity, PASSKEY_PLOT: plot_passkey},
)
def run_extrapolate_benchmark(config: ExtrapolateConfig, console: Any) -> dict[str, Any]:
    """RoPE (softmax) vs CoCA trained at 128 bytes: held-out perplexity and passkey retrieval at longer
    contexts, with no, linear (position interpolation) and dynamic-NTK rotary scaling.

    See the module docstring; returns the dictionary written to ``results.json``."""
    corpus = load_corpus(config.corpus, max_bytes=config.corpus_bytes)
    train_stream, held_out_stream = (
        encode_corpus(part, ByteTokenizer()) for part in (corpus.train, corpus.held_out)
    )
    windows = {n: held_out_windows(held_out_stream, n, config.eval_tokens) for n in config.lengths}
    documents = {n: passkey_trials(n, config.passkey_trials, config.seed) for n in config.lengths}
    if train_stream.numel() < config.train_length:
        raise HeadkitError(
            f"the training corpus holds {train_stream.numel()} tokens, fewer than one {config.train_length}-token "
            "window: use a larger --corpus"
        )
    console.print(
        f"extrapolate: {corpus.source}, {train_stream.numel():,} training / {held_out_stream.numel():,} held-out "
        f"tokens; trained at {config.train_length}, evaluated at {', '.join(map(str, config.lengths))}"
    )

    # Per model how it trained; per model, scaling and length its bits per byte (perplexity: 2 ** bits per
    # byte) and its passkey retrieval (accuracy: all digits right; answers: the generated keys).
    perplexities, passkeys = [], []

    def evaluate_model(
        attention: str, model: HeadkitForCausalLM, trained: dict, update: Callable
    ) -> dict[str, Any]:
        update(description=f"evaluating {attention}", completed=0, total=len(SCALINGS) * len(config.lengths))
        bpb, accuracy = {}, {}  # (scaling, length) -> this model's measure, for the console
        for scaling in SCALINGS:
            for n in config.lengths:
                scaled = scaled_model(model, scaling, n, config)
                batch = max(1, EVAL_BATCH_TOKENS // n)
                bits = held_out_bits_per_byte(scaled, windows[n], ByteTokenizer(), SPECIAL_IDS, batch)
                point = {"attention": attention, "scaling": scaling, "length": n}
                sizes = {"windows": len(windows[n]), "tokens": windows[n].numel()}
                perplexities.append(point | {"bits_per_byte": bits, "perplexity": 2.0**bits} | sizes)
                answers = retrieve_passkeys(scaled, documents[n])
                exact, digits = score_answers(answers, [doc.key for doc in documents[n]])
                scores = {"trials": len(answers), "accuracy": exact, "digit_accuracy": digits}
                passkeys.append(point | scores | {"answers": answers})
                bpb[scaling, n], accuracy[scaling, n] = bits, exact
                update(advance=1)
        short, long = min(config.lengths), max(config.lengths)
        console.print(
            f"{attention}: {bpb['none', short]:.3f} bits/byte at {short}, at {long}: "
            + ", ".join(f"{s} {bpb[s, long]:.3f}" for s in SCALINGS)
            + f"; passkey at {short} {accuracy['none', short]:.2f}, at {long}: "
            + ", ".join(f"{s} {accuracy[s, long]:.2f}" for s in SCALINGS),
            highlight=False,
        )
        return {"attention": attention} | trained

    build = partial(build_model, config=config)
    train = partial(lm_training, train_stream=train_stream, config=config)
    models = train_each(console, MODELS, build, train, config.steps, evaluate_model)
    return {
        "dynamic_factor": config.resolved_dynamic_factor(),
        "corpus": corpus.summary(),
        "models": models,
        "perplexity": perplexities,
        "passkey": passkeys,
        "passkey_keys": {str(n): [doc.key for doc in docs] for n, docs in documents.items()},
    }
