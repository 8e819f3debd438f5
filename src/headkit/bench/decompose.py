"""``headkit bench decompose``: headkit's factored CP-ALS against tensorly's ``parafac`` on trained weights.

Collaborative heads (Cordonnier, Loukas & Jaggi 2020, Sec. 4) rest on a rank-D̃ CP decomposition of
T[:, h, :] = W_{Q,h} W_{K,h}ᵀ (:func:`headkit.surgery.decompose.decompose_query_key`). Per layer of a BERT-style
checkpoint (default: the bundled all-MiniLM-L6-v2) and per D̃, both methods get the same rank and sweeps (tol 0:
every sweep runs); recorded are the relative error ‖T − T̂‖_F / ‖T‖_F from the dense tensor and the wall time of
the call. Method and results: docs/collaborative.md. Writes results.json, table.md and decompose.png.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headkit.bench._report import figure_axes, markdown_table, plot_series
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.errors import HeadkitError
from headkit.runs.models import default_encoder_path
from headkit.surgery.decompose import decompose_query_key

PLOT_FILE = "decompose.png"
METHODS = ("headkit", "tensorly")

# BERT, RoBERTa, MiniLM and friends name a layer's projections encoder.layer.<i>.attention.self.{query,key}.
_PROJECTION = re.compile(r"(?:^|\.)layer\.(\d+)\.attention\.self\.(query|key)\.weight$")


@dataclass
class DecomposeSettings:
    """Settings of one ``headkit bench decompose`` run."""

    model: Path | None = option(
        None, "A local 🤗 model directory (default: the bundled all-MiniLM-L6-v2).", argument=True
    )
    dims: tuple[int, ...] = option(
        (64, 128, 192, 256, 384),
        "Comma-separated shared widths D̃.",
        min=1,
        quick=(64, 384),
    )
    max_iter: int = option(100, "ALS sweeps per decomposition.", min=1, quick=10)
    include_tensorly: bool = option(
        True, "Also time tensorly's parafac on the same tensors.", flag="--tensorly"
    )
    threads: int | None = option(1, "torch threads for both libraries.", min=1)
    seed: int = option(0, "Seed of the decompositions.")
    out: Path = option(Path("results/decompose"), "Output directory for results.json, table, plot.")
    layers: tuple[int, ...] | None = setting(None, min=0, quick=(0,))  # layer indices; None: all
    tol: float = 0.0  # stopping tolerance of both methods; 0 runs every sweep, so both do the same number

    quick = quick_preset("One layer, two widths, 10 sweeps.")


def headkit_fit(w_q: torch.Tensor, w_k: torch.Tensor, heads: int, dim: int, settings: Any) -> Any:
    """headkit's rank-``dim`` fit as a dense tensor, the seconds of the call, and its sweeps and start."""
    sweeps = {"max_iter": settings.max_iter, "tol": settings.tol, "seed": settings.seed}
    start = time.perf_counter()
    *factors, info = decompose_query_key(w_q, w_k, heads, dim, **sweeps, return_info=True)
    seconds = time.perf_counter() - start
    fit = torch.einsum("ri,hr,rj->ihj", *(factor.double() for factor in factors))
    return fit, seconds, {"iterations": info.iterations, "start": info.start}


def tensorly_fit(parafac: Any, dense: torch.Tensor, dim: int, settings: DecomposeSettings) -> Any:
    """tensorly's rank-``dim`` fit of ``dense`` from its "svd" start, and the seconds of the call."""
    numpy_dense = dense.numpy()
    options = {"n_iter_max": settings.max_iter, "tol": settings.tol, "random_state": settings.seed}
    start = time.perf_counter()
    with warnings.catch_warnings():
        # D̃ > heads: tensorly warns that it pads its head factor with random columns, as intended.
        warnings.simplefilter("ignore", UserWarning)
        weights, factors = parafac(numpy_dense, dim, init="svd", **options)
    seconds = time.perf_counter() - start
    fit = torch.einsum("r,ir,hr,jr->ihj", *(torch.from_numpy(x) for x in (weights, *factors)))
    return fit, seconds, {"iterations": None, "start": "svd"}


def head_forms(w_q: torch.Tensor, w_k: torch.Tensor, heads: int) -> torch.Tensor:
    """The dense [hidden, heads, hidden] tensor T[:, h, :] = W_{Q,h} W_{K,h}ᵀ in float64."""
    rows, hidden = w_q.shape
    per_head = (w.detach().double().reshape(heads, rows // heads, hidden) for w in (w_q, w_k))
    return torch.einsum("hdi,hdj->ihj", *per_head)


def load_query_key_weights(model_dir: str | Path) -> tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """(heads, {layer: (w_q, w_k)}) from a BERT-style folder: config.json and model.safetensors."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config_file, weights_file = model_dir / "config.json", model_dir / "model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise HeadkitError(
            f"{model_dir} must hold config.json and model.safetensors (a BERT-style checkpoint)"
        )
    heads = json.loads(config_file.read_text(encoding="utf-8")).get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise HeadkitError(
            f"{config_file} must give num_attention_heads as a positive integer, got {heads!r}"
        )
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(weights_file).items():
        if match := _PROJECTION.search(name):
            found.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    weights = {layer: (pair["query"], pair["key"]) for layer, pair in found.items() if len(pair) == 2}
    if not weights:
        raise HeadkitError(
            f"no layer.<i>.attention.self.query/key.weight pairs in {weights_file} (a BERT-style checkpoint)"
        )
    return heads, weights


def summarise(points: list[dict[str, Any]], dims: list[int]) -> list[dict[str, Any]]:
    """Per D̃, each method's mean error and total seconds over the layers (None where it did not run), and
    headkit's speed-up over tensorly."""
    rows = []
    for dim in dims:
        row: dict[str, Any] = {"dim": dim}
        for method in METHODS:
            chosen = [p for p in points if p["dim"] == dim and p["method"] == method]
            errors, seconds = [p["relative_error"] for p in chosen], [p["seconds"] for p in chosen]
            row[f"{method}_error"] = sum(errors) / len(errors) if chosen else None
            row[f"{method}_seconds"] = sum(seconds) if chosen else None
        both = row["headkit_seconds"] and row["tensorly_seconds"]
        row["speedup"] = row["tensorly_seconds"] / row["headkit_seconds"] if both else None
        rows.append(row)
    return rows


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def render_markdown(results: dict[str, Any]) -> str:
    """The settings, then per D̃ the mean over layers and per layer × D̃ each method's error."""
    config = results["config"]
    headers = ["D̃", *(f"{m} error (mean)" for m in METHODS), *(f"{m} s (total)" for m in METHODS), "speed-up"]
    summary = [
        [row["dim"], *(_fmt(row[f"{m}_error"], ".4f") for m in METHODS)]
        + [*(_fmt(row[f"{m}_seconds"], ".2f") for m in METHODS), _fmt(row["speedup"], ".1f", "×")]
        for row in results["summary"]
    ]
    by_point = {(p["layer"], p["dim"], p["method"]): p for p in results["points"]}
    detail = []
    for layer in config["layers"]:
        for dim in config["dims"]:
            headkit, tensorly = (by_point.get((layer, dim, method), {}) for method in METHODS)
            errors = [_fmt(point.get("relative_error"), ".4f") for point in (headkit, tensorly)]
            detail.append([layer, dim, errors[0], headkit.get("start", "—"), errors[1]])
    detail_headers = ["layer", "D̃", "headkit error", "headkit start", "tensorly error"]
    return (
        f"# CP decomposition of query/key weights: headkit vs tensorly\n\n"
        f"{config['model']}: {len(config['layers'])} layers, {config['heads']} heads × {config['head_dim']}, "
        f"hidden {config['hidden']}; same rank and {config['max_iter']} sweeps (tol {config['tol']}) for both.\n"
        f"Error: {config['error']}. Time: {config['time']}.\n\n"
        f"## Mean over layers\n\n{markdown_table(headers, summary)}\n"
        f"## Per layer\n\n{markdown_table(detail_headers, detail)}"
    )


def plot_results(results: dict[str, Any]) -> Any:
    """Relative error (left) and total time (right, log scale) against D̃, one line per method."""
    figure, (error_axis, time_axis) = figure_axes((10, 4), 1, 2, layout="constrained")
    for method in METHODS:  # a line per method that ran
        ran = [row for row in results["summary"] if row[f"{method}_error"] is not None]
        plot_series(error_axis, ran, "dim", f"{method}_error", (), label=method)
        plot_series(time_axis, ran, "dim", f"{method}_seconds", (), label=method)
    error_axis.set(xlabel="shared width D̃", ylabel="relative error (mean over layers)", ylim=(0, None))
    time_axis.set(xlabel="shared width D̃", ylabel="seconds (all layers)", yscale="log")
    for axis in (error_axis, time_axis):
        axis.grid(True, alpha=0.3)
        axis.legend()
    config = results["config"]
    figure.suptitle(
        f"{'/'.join(Path(config['model']).parts[-2:])}: {config['heads']} heads × {config['head_dim']}, "
        f"{config['max_iter']} sweeps"
    )
    return figure


@register_benchmark("decompose", DecomposeSettings, render=render_markdown, plots={PLOT_FILE: plot_results})
def run_decompose_benchmark(settings: DecomposeSettings, console: Any) -> dict[str, Any]:
    """Query/key CP decomposition of a pretrained model: relative error and time per D̃, headkit vs tensorly.

    ``settings.model`` is a folder with config.json and model.safetensors; widths above heads·head_dim are
    dropped; tensorly is recorded as unavailable when it is not installed. Returns what results.json holds."""
    model_dir = Path(settings.model) if settings.model is not None else default_encoder_path()
    heads, weights = load_query_key_weights(model_dir)
    rows, hidden = next(iter(weights.values()))[0].shape
    layers = list(settings.layers) if settings.layers is not None else sorted(weights)
    if missing := sorted(set(layers) - set(weights)):
        raise HeadkitError(f"layers {missing} are not in the checkpoint, which has layers {sorted(weights)}")
    dims = [dim for dim in settings.dims if dim <= rows] or [rows]
    tensorly: bool | str = settings.include_tensorly
    parafac = None
    if tensorly:
        try:
            from tensorly.decomposition import parafac
        except ImportError:
            tensorly = "unavailable"
    points = []
    for layer in layers:
        w_q, w_k = weights[layer]
        dense = head_forms(w_q, w_k, heads)
        for dim in dims:
            fits = {"headkit": headkit_fit(w_q, w_k, heads, dim, settings)}
            if parafac is not None:
                fits["tensorly"] = tensorly_fit(parafac, dense, dim, settings)
            for method, (fit, seconds, extra) in fits.items():
                error = float(torch.linalg.vector_norm(dense - fit) / torch.linalg.vector_norm(dense))
                point = {"dim": dim, "method": method, "relative_error": error, "seconds": seconds}
                points.append({"layer": layer} | point | extra)
    shape = {"heads": heads, "head_dim": rows // heads, "hidden": hidden, "layers": layers, "dims": dims}
    sweeps = {"max_iter": settings.max_iter, "tol": settings.tol, "seed": settings.seed}
    config = {"model": str(model_dir)} | shape | sweeps | {"tensorly": tensorly, "threads": settings.threads}
    config["error"] = "relative Frobenius error of the [hidden, heads, hidden] tensor, from the dense tensor"
    config["time"] = "wall seconds of one call; tensorly's excludes forming the dense tensor"
    return {"config": config, "points": points, "summary": summarise(points, dims)}
