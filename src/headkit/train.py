"""Train a headkit causal language model on a text corpus: the loop behind ``headkit train``.

:func:`train_causal_lm` takes a :class:`~headkit.models.HeadkitConfig` (or a model), a corpus
(:func:`headkit.data.load_corpus`: a file, a directory, or the embedded standard-library corpus) and a tokenizer
(byte-level by default), and runs AdamW (Loshchilov & Hutter 2019) on random windows of the training stream with
a linear warm-up and cosine decay of the learning rate and gradient-norm clipping, under a rich progress bar.
It reports bits per byte on the held-out split:

    bits/byte = Σ_t −ln p(x_t | x_<t) / (ln 2 · number of UTF-8 bytes the predicted tokens encode),

over non-overlapping held-out windows spaced evenly across the held-out documents (document separators and other special tokens are neither predicted nor
counted), the tokenizer-independent measure of compression (8 bits/byte = no better than raw bytes). The model
and its tokenizer are saved with ``save_pretrained`` next to ``training_report.json``: the folder loads with
``AutoModelForCausalLM`` (after ``import headkit``) and ``AutoTokenizer`` (the byte tokenizer is a stock
``tokenizer.json``), and ``headkit generate FOLDER --prompt …`` talks to it.

The steps run on headkit's one training loop (:func:`headkit.recipes.loop.train_loop`, 🤗 ``Trainer``), so the
same call trains data-parallel under ``torchrun`` / ``accelerate launch`` (DDP: gradients averaged across
processes after every backward; FSDP through accelerate's config) or in a process group the caller initialised:
each rank draws its own batches, and only rank 0 shows progress, evaluates and saves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from headkit.data import (
    ByteTokenizer,
    Corpus,
    encode_corpus,
    evaluation_windows,
    load_corpus,
    load_tokenizer,
    sample_batch,
    special_token_ids,
)
from headkit.devices import check_device
from headkit.errors import HeadkitError
from headkit.evaluation.quality import held_out_bits_per_byte
from headkit.files import check_output_folder, staged_folder
from headkit.layers import attention_classes
from headkit.models import HeadkitConfig, HeadkitForCausalLM
from headkit.ops._validation import check_positive_int
from headkit.recipes.loop import IndexedBatches, LoopResult, StepCallback, train_loop
from headkit.runs.options import check_names, check_options, existing_path, option, parse_list, quick_preset
from headkit.runs.processes import process_rank_and_count

REPORT_FILE = "training_report.json"


@dataclass
class TrainResult:
    """What a run produced: the trained model (unwrapped), its tokenizer, and the measurements.

    ``seconds`` is the whole loop's wall clock, evaluations included; ``step_seconds`` the wall clock of each
    optimiser step alone (batch, forward, backward, update). Each ``history`` entry holds the step, the held-out
    bits per byte there and ``train_seconds``, the sum of ``step_seconds`` up to that step (evaluation excluded).
    """

    model: HeadkitForCausalLM
    tokenizer: Any
    losses: list[float]
    held_out_bits_per_byte: float | None
    initial_bits_per_byte: float | None
    seconds: float
    tokens_seen: int
    out_dir: Path | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)


def default_config(tokenizer: Any, **overrides: Any) -> HeadkitConfig:
    """A small causal LM for ``tokenizer``: hidden 256, 4 layers, 4 heads, linear attention; any field overridable."""
    settings: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        attention="linear",
        max_position_embeddings=2048,
        pad_token_id=getattr(tokenizer, "pad_token_id", None),
        bos_token_id=getattr(tokenizer, "bos_token_id", None),
        eos_token_id=getattr(tokenizer, "eos_token_id", None),
    )
    settings.update(overrides)
    return HeadkitConfig(**settings)


def train_causal_lm(
    config_or_model: HeadkitConfig | HeadkitForCausalLM | Mapping[str, Any],
    corpus: Corpus | str | os.PathLike[str] | None = None,
    *,
    steps: int = 200,
    batch_size: int = 8,
    seq_len: int = 256,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    warmup_steps: int | None = None,
    max_grad_norm: float = 1.0,
    tokenizer: Any = None,
    eval_tokens: int = 65_536,
    eval_batch_size: int = 8,
    eval_every: int | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
    show_progress: bool = True,
    console: Console | None = None,
    progress_label: str | None = None,
) -> TrainResult:
    """Train a causal LM on ``corpus`` and report held-out bits per byte.

    Args:
        config_or_model: a HeadkitConfig (a fresh model is built, seeded with ``seed``), a dict of HeadkitConfig
            fields (completed by :func:`default_config`), or a HeadkitForCausalLM to continue training.
        corpus: a :class:`~headkit.data.Corpus`, a text file or directory, or None for the standard library.
        steps, batch_size, seq_len: optimiser steps, windows per step, tokens per window.
        lr, weight_decay, warmup_steps, max_grad_norm: AdamW settings; warm-up defaults to min(100, steps/10)
            steps, then cosine decay to lr/10.
        tokenizer: a tokenizer object, a local folder, or None for :class:`~headkit.data.ByteTokenizer`.
        eval_tokens: held-out tokens evaluated (windows spread over the held-out stream); 0 skips evaluation,
            else at least 2 (one predicted token).
        eval_every: also evaluate every this many steps (None: before and after training only).
        out_dir: where to save the model, tokenizer and report; None saves nothing. The folder is written
            atomically (:func:`headkit.files.staged_folder`): it appears, or replaces an existing one, only when
            complete; a failure leaves what was there untouched.
        overwrite: replace a non-empty ``out_dir`` (an existing file is never replaced).
        seed: model initialisation and batch sampling (each distributed rank adds its rank).
        device: where to train: cpu or an existing CUDA device (checked first).
        show_progress, console: the rich progress bar and where it goes.
        progress_label: the run's name on the progress bar (default: its attention mechanisms).

    Raises:
        HeadkitError (a ValueError): bad settings, a device that is not there, an ``out_dir`` that is a file
        (or a non-empty folder without ``overwrite``), a vocabulary smaller than the tokenizer's, a corpus
        shorter than one window, learned positions shorter than ``seq_len``.
    """
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        check_positive_int(name, value)
    for name, value in (("lr", lr), ("max_grad_norm", max_grad_norm)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise HeadkitError(f"{name} must be a positive number, got {value!r}")
    if eval_every is not None:
        check_positive_int("eval_every", eval_every)
    check_eval_tokens(eval_tokens, flag="eval_tokens")
    device = check_device(device)
    rank, world_size = process_rank_and_count()
    is_main = rank == 0
    if out_dir is not None and is_main:
        inputs = {"--corpus": corpus, "--tokenizer": tokenizer}
        check_output_folder(
            out_dir,
            overwrite,
            {flag: path for flag, path in inputs.items() if isinstance(path, (str, os.PathLike))},
        )
    console = console or Console()
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus)
    model = _build_model(config_or_model, tokenizer, seq_len, seed).to(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the accelerator Trainer trains on is the current one

    train_stream = encode_corpus(corpus.train, tokenizer)
    held_out_stream = encode_corpus(corpus.held_out, tokenizer)
    evaluate = eval_tokens > 0 and is_main
    windows = evaluation_windows(held_out_stream, seq_len, eval_tokens, spread=True) if evaluate else None
    ignored_ids = torch.tensor(special_token_ids(tokenizer), dtype=torch.long)

    warmup = min(100, steps // 10) if warmup_steps is None else warmup_steps
    warmup = min(100, steps // 10) if warmup_steps is None else warmup_steps
    history: list[dict[str, float]] = []
    initial_bpb = (
        held_out_bits_per_byte(model, windows, tokenizer, ignored_ids, eval_batch_size) if evaluate else None
    )
    if initial_bpb is not None:
        history.append({"step": 0, "held_out_bits_per_byte": initial_bpb, "train_seconds": 0.0})

    progress = Progress(
        TextColumn("[bold]train[/] {task.fields[mechanism]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[bpb]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not (show_progress and is_main),
    )
    clock = {"train_seconds": 0.0}
    started = time.perf_counter()
    with progress:
        task = progress.add_task(
            "train",
            total=steps,
            loss=float("nan"),
            bpb=_bpb_label(initial_bpb),
            mechanism=progress_label or _mechanisms(model),
        )

        def after_step(step: int, loss: float, seconds: float) -> None:
            clock["train_seconds"] += seconds
            if evaluate and eval_every is not None and step % eval_every == 0 and step < steps:
                bpb = held_out_bits_per_byte(model, windows, tokenizer, ignored_ids, eval_batch_size)
                history.append(
                    {"step": step, "held_out_bits_per_byte": bpb, "train_seconds": clock["train_seconds"]}
                )
                progress.update(task, bpb=_bpb_label(bpb))
            progress.update(task, advance=1, loss=loss)

        loop = train_on_batches(
            model,
            lambda index, generator: _lm_batch(
                sample_batch(train_stream, batch_size, seq_len, generator), ignored_ids
            ),
            steps=steps,
            seed=seed,
            on_step=after_step,
            max_grad_norm=max_grad_norm,
            use_cpu=device.type == "cpu",
            **lm_optimization(model, lr, weight_decay, steps, warmup, foreach=True),
        )
        losses = loop.losses
        final_bpb = (
            held_out_bits_per_byte(model, windows, tokenizer, ignored_ids, eval_batch_size)
            if evaluate
            else None
        )
        if final_bpb is not None:
            history.append(
                {"step": steps, "held_out_bits_per_byte": final_bpb, "train_seconds": clock["train_seconds"]}
            )
            progress.update(task, bpb=_bpb_label(final_bpb))
    seconds = time.perf_counter() - started
    model.eval()

    result = TrainResult(
        model=model,
        tokenizer=tokenizer,
        losses=losses,
        held_out_bits_per_byte=final_bpb,
        initial_bits_per_byte=initial_bpb,
        seconds=seconds,
        tokens_seen=steps * batch_size * seq_len * world_size,
        history=history,
        step_seconds=loop.step_seconds,
    )
    if out_dir is not None and is_main:
        result.out_dir = _save(
            result,
            Path(out_dir),
            corpus,
            dict(
                steps=steps,
                batch_size=batch_size,
                seq_len=seq_len,
                lr=lr,
                weight_decay=weight_decay,
                warmup_steps=warmup,
                max_grad_norm=max_grad_norm,
                eval_tokens=eval_tokens,
                seed=seed,
                world_size=world_size,
                device=str(device),
            ),
        )
    if is_main:
        summary = f"trained {steps} steps in {seconds:.1f} s, final loss {losses[-1]:.4f}"
        if final_bpb is not None:
            summary += f", held-out {final_bpb:.4f} bits/byte (from {initial_bpb:.4f})"
        console.print(summary, highlight=False)
        if result.out_dir is not None:
            console.print(f"saved to {result.out_dir}", highlight=False)
    return result


MIN_EVAL_TOKENS = 2  # a window of 2 tokens predicts 1


def check_eval_tokens(eval_tokens: Any, *, flag: str = "--eval-tokens") -> None:
    """``eval_tokens`` must be 0 (no evaluation) or an integer ≥ 2, else an error naming ``flag``."""
    if (
        isinstance(eval_tokens, bool)
        or not isinstance(eval_tokens, int)
        or not (eval_tokens == 0 or eval_tokens >= MIN_EVAL_TOKENS)
    ):
        raise HeadkitError(
            f"{flag} must be 0 (no evaluation) or at least {MIN_EVAL_TOKENS} (one predicted token), "
            f"got {eval_tokens!r}"
        )


def _config_field(item: str) -> tuple[str, Any]:
    """One ``--set KEY=VALUE``: the key and its JSON value (the text itself where it is not JSON)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise HeadkitError(f"--set takes KEY=VALUE, got {item!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _check_attention(name: str) -> None:
    check_names("--attention", [name], attention_classes())


def _check_layer_types(names: tuple[str, ...]) -> None:
    if names:
        check_names("--layer-types", names, attention_classes())


def _check_set_fields(items: tuple[str, ...]) -> None:
    check_config_fields(dict(map(_config_field, items)))


@dataclass
class TrainSettings:
    """One ``headkit train`` run: each field with help is an option of the command (headkit.runs.options),
    checked where it is declared (:func:`~headkit.runs.options.check_options`); ``quick`` is its value under
    --quick (a small model and a short run, well under a minute on 2 CPU cores)."""

    attention: str = option(
        "linear",
        f"Mechanism of every layer, one of those registered: {', '.join(attention_classes())}.",
        check=_check_attention,
    )
    layer_types: tuple[str, ...] = option(
        (),
        "Comma-separated mechanism per layer, for a hybrid (sets the layer count; overrides --attention).",
        parse=lambda flag, text: parse_list(flag, text, str),
        check=_check_layer_types,
    )
    corpus: Path | None = option(
        None,
        "A text file or a folder of text files (default: this Python's standard-library source).",
        check=existing_path("--corpus"),
    )
    tokenizer: Path | None = option(
        None,
        "A tokenizer saved in a local folder (default: byte-level).",
        check=existing_path("--tokenizer"),
    )
    steps: int = option(300, "Optimiser steps.", min=1, quick=100)
    batch_size: int = option(8, "Windows per step.", min=1)
    seq_len: int = option(256, "Tokens per window.", min=2, quick=128)
    lr: float = option(1e-3, "Peak learning rate (AdamW, warm-up then cosine decay).", min=0.0)
    hidden_size: int = option(256, "Model width.", min=1, quick=64)
    layers: int = option(4, "Decoder layers.", min=1, quick=2)
    heads: int = option(4, "Attention heads per layer.", min=1)
    set_fields: tuple[str, ...] = option(
        (),
        "Any HeadkitConfig field as KEY=VALUE (JSON value), e.g. --set additive_window=64; an unknown field is "
        "an error.",
        flag="--set",
        repeat=True,
        check=_check_set_fields,
    )
    eval_tokens: int = option(
        65_536,
        "Held-out tokens for bits per byte (0 = none, else ≥ 2).",
        min=0,
        quick=8_192,
        check=check_eval_tokens,
    )
    max_corpus_bytes: int | None = option(
        None,
        "Read at most this many bytes of the corpus (default all; 2 MB with --quick).",
        min=1,
        quick=2_000_000,
    )
    seed: int = option(0, "Seed of the initialisation and the batch sampling.")
    device: str = option("cpu", "Device to train on: cpu or cuda (or cuda:N).", check=check_device)
    out: Path = option(Path("results/train"), "Output folder: model, tokenizer, training_report.json.")
    overwrite: bool = option(
        False, "Replace a non-empty output folder (whole, once the new one is complete)."
    )

    quick = quick_preset("A small model and a short run (well under a minute on 2 CPU cores).")


def check_train_settings(settings: TrainSettings) -> None:
    """Every setting, before anything is loaded or trained: the checks its field declares, then the output
    folder against the inputs."""
    check_options(settings)
    inputs = {"--corpus": settings.corpus, "--tokenizer": settings.tokenizer}
    check_output_folder(
        settings.out, settings.overwrite, {name: path for name, path in inputs.items() if path is not None}
    )


def train_from_settings(settings: TrainSettings, **keywords: Any) -> TrainResult:
    """``headkit train``: a fresh model of the settings' shape trained on their corpus (:func:`train_causal_lm`,
    which `keywords` reach), checked whole first (:func:`check_train_settings`)."""
    check_train_settings(settings)
    tokenizer = load_tokenizer(settings.tokenizer)
    fields: dict[str, Any] = dict(
        attention=settings.attention,
        hidden_size=settings.hidden_size,
        num_hidden_layers=len(settings.layer_types) or settings.layers,
        num_attention_heads=settings.heads,
        max_position_embeddings=max(2048, settings.seq_len),
        **({"layer_types": list(settings.layer_types)} if settings.layer_types else {}),
    )
    fields.update(dict(map(_config_field, settings.set_fields)))
    return train_causal_lm(
        default_config(tokenizer, **fields),
        load_corpus(settings.corpus, max_bytes=settings.max_corpus_bytes),
        steps=settings.steps,
        batch_size=settings.batch_size,
        seq_len=settings.seq_len,
        lr=settings.lr,
        tokenizer=tokenizer,
        eval_tokens=settings.eval_tokens,
        out_dir=settings.out,
        overwrite=settings.overwrite,
        seed=settings.seed,
        device=settings.device,
        **keywords,
    )


def config_fields() -> list[str]:
    """The fields of :class:`~headkit.models.HeadkitConfig` (its own and PreTrainedConfig's) ``--set`` takes."""
    return [f.name for f in dataclasses.fields(HeadkitConfig) if f.init and f.name != "transformers_version"]


def check_config_fields(names: Iterable[str], *, flag: str = "--set") -> None:
    """Each name must be a HeadkitConfig field, else an error naming it and ``flag``."""
    valid = config_fields()
    for name in names:
        if name not in valid:
            raise HeadkitError(
                f"{flag}: unknown HeadkitConfig field {name!r}; valid fields: {', '.join(valid)}"
            )


def _build_model(config_or_model: Any, tokenizer: Any, seq_len: int, seed: int) -> HeadkitForCausalLM:
    """The model to train: the one given, or a fresh one from the config (checked before it is built)."""
    if isinstance(config_or_model, HeadkitForCausalLM):
        _check_model_fits(config_or_model.config, tokenizer, seq_len)
        return config_or_model
    if isinstance(config_or_model, Mapping):
        config_or_model = default_config(tokenizer, **config_or_model)
    if not isinstance(config_or_model, HeadkitConfig):
        raise HeadkitError(
            "config_or_model must be a HeadkitConfig, a dict of its fields or a HeadkitForCausalLM, got "
            f"{type(config_or_model).__name__}"
        )
    if not config_or_model.causal:
        raise HeadkitError("a causal language model needs config.causal=True")
    _check_model_fits(config_or_model, tokenizer, seq_len)
    torch.manual_seed(seed)
    return HeadkitForCausalLM(config_or_model)


def _check_model_fits(config: HeadkitConfig, tokenizer: Any, seq_len: int) -> None:
    if config.vocab_size < len(tokenizer):
        raise HeadkitError(
            f"the model's vocab_size ({config.vocab_size}) is smaller than the tokenizer's ({len(tokenizer)})"
        )
    if config.position_embedding_type == "learned" and seq_len > config.max_position_embeddings:
        raise HeadkitError(
            f"seq_len={seq_len} exceeds max_position_embeddings={config.max_position_embeddings} "
            "(learned positions cannot extrapolate)"
        )


def _mask_special(ids: torch.Tensor, ignored_ids: torch.Tensor) -> torch.Tensor:
    """Labels: the ids, with special tokens (document separators) set to −100 (not predicted)."""
    if ignored_ids.numel() == 0:
        return ids
    return ids.masked_fill(torch.isin(ids, ignored_ids.to(ids.device)), -100)


def lm_optimization(
    model: torch.nn.Module, lr: float, weight_decay: float, steps: int, warmup: int, **adamw: Any
) -> dict[str, Any]:
    """The optimisation of a language model from scratch, as :func:`headkit.recipes.loop.train_loop`'s
    ``param_groups``, ``optimizer_options`` and ``schedule``: AdamW (betas 0.9, 0.95; ``adamw`` its other options)
    with ``weight_decay`` on the matrices of ``model``'s trained parameters at learning rate ``lr``, a linear
    warm-up over ``warmup`` steps and a cosine decay to lr/10 at ``steps``."""
    # Weight decay on matrices only: decaying norm gains and biases towards 0 only fights the model.
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": matrices, "lr": lr, "weight_decay": weight_decay},
        {"params": vectors, "lr": lr, "weight_decay": 0.0},
    ]
    return {
        "param_groups": groups,
        "optimizer_options": {"betas": (0.9, 0.95)} | adamw,
        "schedule": partial(_lr_factor, warmup=warmup, total=steps),
    }


def _lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from 1 to 0.1 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_on_batches(
    model: torch.nn.Module,
    draw: Callable[[int, torch.Generator], dict[str, torch.Tensor]],
    *,
    steps: int,
    seed: int = 0,
    on_step: StepCallback | None = None,
    **optimization: Any,
) -> LoopResult:
    """``steps`` steps of a model's own loss (``model(**batch).loss``: next-token cross-entropy given ``labels``)
    in training mode, on headkit's one loop (:func:`headkit.recipes.loop.train_loop`, which takes
    ``optimization``: parameter groups, schedule, clipping, …). Batch i is ``draw(i, generator)`` with a generator
    seeded from (``seed`` + 1, i) (:class:`~headkit.recipes.loop.IndexedBatches`): every process of a distributed
    run draws its own ``steps`` batches, and a rerun, or another model trained alike, the same ones."""
    _, processes = process_rank_and_count()
    return train_loop(
        model,
        _causal_lm_loss,
        IndexedBatches(steps * processes, draw, seed=seed + 1),
        steps=steps,
        dropout=True,
        seed=seed,
        on_step=on_step,
        **optimization,
    )


def _lm_batch(ids: torch.Tensor, ignored_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": _mask_special(ids, ignored_ids)}


def _causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    """The next-token cross-entropy of ``batch`` (its ``input_ids`` and ``labels``, special tokens −100)."""
    return model(**batch, use_cache=False).loss


def _mechanisms(model: HeadkitForCausalLM) -> str:
    config = model.config
    names = config.layer_types if config.layer_types is not None else [config.attention]
    return "+".join(dict.fromkeys(names))


def _bpb_label(bpb: float | None) -> str:
    return "" if bpb is None else f"held-out {bpb:.3f} bits/byte"


def _save(result: TrainResult, out_dir: Path, corpus: Corpus, settings: dict[str, Any]) -> Path:
    """Write the model, tokenizer and report into a staging folder that becomes ``out_dir`` when complete."""
    with staged_folder(out_dir) as staging:
        _write_run(result, staging, corpus, settings)
    return out_dir


def _write_run(result: TrainResult, folder: Path, corpus: Corpus, settings: dict[str, Any]) -> None:
    result.model.save_pretrained(folder)
    result.tokenizer.save_pretrained(folder)
    report = {
        "settings": settings,
        "corpus": corpus.summary(),
        "tokenizer": "bytes"
        if isinstance(result.tokenizer, ByteTokenizer)
        else type(result.tokenizer).__name__,
        "parameters": sum(p.numel() for p in result.model.parameters()),
        "seconds": result.seconds,
        "tokens_seen": result.tokens_seen,
        "final_loss": result.losses[-1],
        "initial_held_out_bits_per_byte": result.initial_bits_per_byte,
        "held_out_bits_per_byte": result.held_out_bits_per_byte,
        "history": result.history,
        "losses": result.losses,
    }
    (folder / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


__all__ = [
    "MIN_EVAL_TOKENS",
    "REPORT_FILE",
    "TrainResult",
    "check_config_fields",
    "check_eval_tokens",
    "config_fields",
    "default_config",
    "held_out_bits_per_byte",
    "lm_optimization",
    "train_causal_lm",
    "train_on_batches",
]
