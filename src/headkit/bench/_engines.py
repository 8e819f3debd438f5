"""``headkit bench decode --smollm2``: SmolLM2-135M-Instruct decoded by the engines a CPU user compares, side by
side in one run — llama.cpp (the Q4_1 GGUF, through llama-cpp-python in a child process) and headkit's fast path
(:class:`headkit.runtime.fast.FastDecoder`: compiled step, fixed-size caches) on the original model and on a
linearized one (``--linearized``), at several contexts and batch sizes; per-token time, decoding-state bytes,
compile time per shape bucket, held-out perplexity per weight format, and the issue's targets.

Engines alternate inside every round (same threads, same moment of the machine's load); ratios are read from one
run. llama.cpp decodes one sequence (llama-cpp-python's ``Llama``): its rows are batch 1 only. Its Q4_1 prompt is
fed one token at a time (:data:`headkit.export.llamacpp.QUANTIZED_PP_SKIPPED`), so its prompt time is not
compared; its per-token time is the mean over the timed steps, headkit's the median step (both reported).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from headkit.errors import HeadkitError
from headkit.evaluation.quality import perplexity
from headkit.export.gguf import export_gguf
from headkit.export.llamacpp import llama_cpp_speed
from headkit.runs.models import load_model, smollm2_gguf_path
from headkit.runs.text import lm_windows, load_text
from headkit.runtime.fast import WEIGHTS, FastDecoder
from headkit.surgery.io import from_pretrained
from headkit.surgery.linearize import decoding_state_bytes

LLAMA_CPP = "llama.cpp Q4_1"
LLAMA_CPP_FLASH = "llama.cpp Q4_1 flash"
PRUNED_LLAMA_CPP = "pruned, llama.cpp Q4_1"
# The reference row decodes without llama.cpp's flash attention (llama-cpp-python's default), which is 1.5-2.3x
# faster for one-token steps on this CPU than with it (the default of llama.cpp's own tools, the second row): the
# targets are read against the faster. The pruned export keeps it on: its per-layer KV widths need it.
FLASH_ATTENTION = {LLAMA_CPP: False, LLAMA_CPP_FLASH: True, PRUNED_LLAMA_CPP: True}
ENGINES = (
    LLAMA_CPP,
    LLAMA_CPP_FLASH,
    *(f"fast {weights}" for weights in WEIGHTS),
    *(f"linearized {weights}" for weights in WEIGHTS),
    PRUNED_LLAMA_CPP,
)
DEFAULT_ENGINES = (
    LLAMA_CPP,
    "fast float32",
    "fast bfloat16",
    "fast int8",
    "linearized bfloat16",
    "linearized int8",
)
PERPLEXITY_WINDOW = 256
SEED = 0


def engine_names() -> tuple[str, ...]:
    return ENGINES


def _echo(console: Any, text: str) -> None:
    console.print(text, highlight=False, markup=False, soft_wrap=True)


def _prompt(tokens: list[int], length: int) -> list[int]:
    return (tokens * (length // len(tokens) + 1))[:length]


def run_engines(settings: Any, console: Any) -> dict[str, Any]:
    """Every engine × context × batch point of the SmolLM2 comparison (see the module docstring)."""
    engines = list(dict.fromkeys(settings.engines))
    wanted_llama = [name for name in engines if "llama.cpp" in name]
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    skipped: dict[str, str] = {}
    if wanted_llama and not have_llama:
        for name in wanted_llama:
            skipped[name] = "llama-cpp-python is not installed (pip install 'headkit[llamacpp]')"
        engines = [name for name in engines if name not in wanted_llama]
    if any(name.startswith("linearized") for name in engines) and settings.linearized is None:
        raise HeadkitError("--engines lists a linearized engine: give its folder with --linearized")
    if PRUNED_LLAMA_CPP in engines and settings.pruned is None:
        raise HeadkitError(f"--engines lists {PRUNED_LLAMA_CPP!r}: give the pruned folder with --pruned")
    threads = settings.threads or torch.get_num_threads()
    torch.set_num_threads(threads)

    gguf = smollm2_gguf_path()
    original = load_model(gguf, kind="causal_lm", dtype="float32")
    tokenizer = original.tokenizer
    windows = lm_windows(
        tokenizer,
        load_text(None),
        length=PERPLEXITY_WINDOW,
        train_windows=0,
        held_out_windows=settings.perplexity_windows,
        seed=SEED,
    ).held_out
    tokens = windows.reshape(-1).tolist()
    sources = {"fast": original.model}
    if settings.linearized is not None:
        sources["linearized"] = from_pretrained(Path(settings.linearized)).eval()
    gguf_files = {LLAMA_CPP: gguf, LLAMA_CPP_FLASH: gguf}
    if PRUNED_LLAMA_CPP in engines:
        report = export_gguf(
            Path(settings.pruned),
            Path(settings.out) / "gguf" / "pruned-q4_1.gguf",
            type="q4_1",
            overwrite=True,
        )
        gguf_files[PRUNED_LLAMA_CPP] = report.out

    decoders: dict[str, FastDecoder] = {}
    quality: dict[str, dict[str, Any]] = {}
    for name in engines:
        if name in gguf_files:
            continue
        source, weights = name.split(" ")
        started = time.perf_counter()
        try:
            decoders[name] = FastDecoder(sources[source], weights=weights, compile=settings.engine_compile)
        except HeadkitError as error:  # e.g. int4 on shapes its groups do not fit: one row lost, not the run
            skipped[name] = str(error)
            _echo(console, f"{name}: skipped: {error}")
            continue
        prepare_s = time.perf_counter() - started
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            value = perplexity(decoders[name].model, windows)
        quality[name] = {"perplexity": value, "prepare_s": prepare_s}
        _echo(console, f"{name}: held-out perplexity {value:.4f} (weights prepared in {prepare_s:.1f} s)")
        gc.collect()

    points_wanted = [
        (batch, context)
        for batch in settings.engine_batches
        for context in settings.contexts
        if batch * context <= settings.max_batch_tokens
    ]
    skipped_points = [
        {
            "batch": batch,
            "context": context,
            "reason": f"batch × context > --max-batch-tokens {settings.max_batch_tokens}",
        }
        for batch in settings.engine_batches
        for context in settings.contexts
        if batch * context > settings.max_batch_tokens
    ]
    prompts = {
        (batch, context): torch.tensor(
            [_prompt(tokens[row * 97 :] + tokens, context) for row in range(batch)]
        )
        for batch, context in points_wanted
    }
    # A bucket's first step compiles; generate() leaves it out of the step times, and it is reported apart.
    compile_rows: list[dict[str, Any]] = []
    samples: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for round_index in range(settings.engine_repeats):
        for batch, context in points_wanted:
            for name in engines:
                if name in gguf_files:
                    if batch != 1:
                        continue
                    measured = llama_cpp_speed(
                        gguf_files[name],
                        _prompt(tokens, context),
                        steps=settings.engine_tokens,
                        quantized=True,
                        threads=threads,
                        flash_attn=FLASH_ATTENTION[name],
                    )
                    if "error" in measured:
                        sample = {"error": measured["error"]}
                    else:
                        sample = {
                            "token_s": 1 / measured["gen_tokens_per_s"],
                            "state_bytes": measured.get("state_bytes"),
                        }
                else:
                    decoder, steps = decoders[name], []
                    started = time.perf_counter()
                    decoder.generate(
                        prompts[batch, context], max_new_tokens=settings.engine_tokens, step_seconds=steps
                    )
                    total = time.perf_counter() - started
                    bucket = decoder.bucket(batch, context + settings.engine_tokens)
                    row = {"engine": name, "batch": batch, "cache": bucket[1]}
                    if bucket in decoder.compile_seconds and not any(
                        row.items() <= r.items() for r in compile_rows
                    ):
                        how = decoder.step_sources.get(
                            bucket, "compiled in process" if decoder.compiled else "eager"
                        )
                        compile_rows.append(
                            row | {"first_step_s": decoder.compile_seconds[bucket], "step": how}
                        )
                    sample = {
                        "token_s": statistics.median(steps),
                        "min_token_s": min(steps),
                        "prefill_and_decode_s": total,
                        "state_bytes": decoding_state_bytes(decoder._caches[bucket]),
                    }
                samples.setdefault((name, batch, context), []).append(sample)
                shown = sample.get("error") or f"{sample['token_s'] * 1e3:.1f} ms/token"
                _echo(console, f"round {round_index + 1}: {name}, batch {batch}, context {context}: {shown}")

    points = []
    for (name, batch, context), measured in samples.items():
        good = [sample for sample in measured if "error" not in sample]
        point = {"engine": name, "batch": batch, "context": context, "rounds": len(measured)}
        if good:
            point["token_s"] = statistics.median(sample["token_s"] for sample in good)
            point["state_bytes"] = good[-1].get("state_bytes")
            if "min_token_s" in good[0]:
                point["min_token_s"] = min(sample["min_token_s"] for sample in good)
        else:
            point["error"] = measured[-1]["error"]
        points.append(point)
    first_token = first_token_rows(settings, threads, gguf)
    for row in first_token:
        shown = (
            row.get("error") or f"model loaded in {row['load_s']:.1f} s, ready {row['ready_s']:.1f} s later"
        )
        _echo(console, f"first token in a fresh process: {row['engine']}, {row.get('start', '')}: {shown}")
    return {
        "model": str(gguf),
        "first_token": first_token,
        "linearized": None if settings.linearized is None else str(settings.linearized),
        "threads": threads,
        "new_tokens": settings.engine_tokens,
        "engines": engines,
        "skipped_engines": skipped,
        "skipped_points": skipped_points,
        "points": points,
        "compile": compile_rows,
        "perplexity": {"windows": int(windows.shape[0]), "window": PERPLEXITY_WINDOW, "by_engine": quality},
        "targets": engine_targets(points, quality, settings.contexts, first_token),
        "statistic": "headkit: median decoding step (min beside); llama.cpp: mean over the timed steps",
    }


FIRST_TOKEN_PROMPT = "The capital of France is"
READY = re.compile(r"model loaded in ([\d.]+) s; ready ([\d.]+) s later")


def fresh_process_first_token(
    model: Path, weights: str, threads: int, folder: Path, timeout: float = 3600
) -> dict[str, Any]:
    """``headkit generate --fast`` in a new process, as a user runs it: the seconds it reports from the model
    loaded to the first token out of the decoding step (and the load itself), with ``folder`` as its
    compiled-step cache. An error row when the child fails or reports no time."""
    environment = os.environ | {"HEADKIT_CACHE": str(folder), "OMP_NUM_THREADS": str(threads)}
    command = [
        sys.executable, "-m", "headkit", "generate", str(model), "--fast", "--weights", weights,
        "--prompt", FIRST_TOKEN_PROMPT, "--max-new-tokens", "4",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no first token within {timeout:.0f} s"}
    found = READY.search(done.stderr)
    if done.returncode or found is None:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"error": f"headkit generate failed (exit {done.returncode}): {tail[0][:200]}"}
    source = "loaded" if " loaded from " in done.stderr else "compiled"
    return {"load_s": float(found.group(1)), "ready_s": float(found.group(2)), "step": source}


def first_token_rows(settings: Any, threads: int, gguf: Path) -> list[dict[str, Any]]:
    """Cold (an empty compiled-step folder: the child compiles) and warm (the next child loads what the first
    saved) first-token latencies of each ``--first-token`` engine, in fresh processes."""
    from headkit.runtime.packaged import clear_artifacts

    rows = []
    folder = Path(settings.out) / "first-token-cache"
    for name in settings.first_token:
        source, weights = name.split(" ")
        model = gguf if source == "fast" else settings.linearized
        if model is None:
            rows.append({"engine": name, "error": "give the linearized folder with --linearized"})
            continue
        clear_artifacts(folder)
        for start in ("cold", "warm"):
            rows.append(
                {"engine": name, "start": start} | fresh_process_first_token(model, weights, threads, folder)
            )
        clear_artifacts(folder)
    return rows


def _time(points: list[dict[str, Any]], engine: str, context: int, batch: int = 1) -> float | None:
    for point in points:
        if (point["engine"], point["context"], point["batch"]) == (engine, context, batch):
            return point.get("token_s")
    return None


def engine_targets(
    points: list[dict[str, Any]],
    quality: dict[str, dict[str, Any]],
    contexts: tuple[int, ...],
    first_token: list[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The issue's targets (SmolLM2, batch 1): each with its measured ratio, requirement and verdict (None
    where a side was not measured)."""
    short, long = min(contexts), max(contexts)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    def ppl(engine: str) -> float | None:
        return quality.get(engine, {}).get("perplexity")

    rows = []
    for linearized in ("linearized bfloat16", "linearized int8"):
        rows += [
            (
                f"{linearized} @{long} vs llama.cpp Q4_1 @{long} (aim ≤ 0.5)",
                ratio(_time(points, linearized, long), _time(points, LLAMA_CPP, long)),
                "≤",
                1.0,
            ),
            (
                f"{linearized} flat: @{long} / @{short}",
                # one context measured: no flatness to judge
                None
                if short == long
                else ratio(_time(points, linearized, long), _time(points, linearized, short)),
                "≤",
                1.1,
            ),
        ]
    rows += [
        (
            f"fast int8 @{short} vs llama.cpp Q4_1 @{short}",
            ratio(_time(points, "fast int8", short), _time(points, LLAMA_CPP, short)),
            "≤",
            2.0,
        ),
        (
            f"fast bfloat16 speed-up over fast float32 @{short}",
            ratio(_time(points, "fast float32", short), _time(points, "fast bfloat16", short)),
            "≥",
            1.0,
        ),
        (
            f"fast bfloat16 speed-up over fast float32 @{long}",
            None
            if short == long
            else ratio(_time(points, "fast float32", long), _time(points, "fast bfloat16", long)),
            "≥",
            1.6,
        ),
        *(
            (
                f"{row['engine']}: a second process, model loaded → first token from the step (s)",
                row["ready_s"],
                "≤",
                5.0,
            )
            for row in first_token
            if row.get("start") == "warm" and "ready_s" in row
        ),
        (
            "bfloat16 held-out perplexity / float32",
            ratio(ppl("fast bfloat16"), ppl("fast float32")),
            "≤",
            1.01,
        ),
        ("int8 held-out perplexity / float32", ratio(ppl("fast int8"), ppl("fast float32")), "≤", 1.02),
    ]
    targets = []
    for description, measured, sense, required in rows:
        passed = (
            None if measured is None else (measured <= required if sense == "≤" else measured >= required)
        )
        targets.append(
            {
                "description": description,
                "measured": measured,
                "required": f"{sense} {required:g}",
                "passed": passed,
            }
        )
    return targets
