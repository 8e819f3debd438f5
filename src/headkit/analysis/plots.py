"""Heatmaps of per-head scores (layer × head): importance, confidence, gate values, and gates over training; and
of passkey accuracy (key depth × prompt length).

Figures are drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas (pyplot's global backend is
never touched) and written atomically (a temporary file moved into place), so an interrupted run never
leaves a half-written PNG. Layers with fewer heads than the widest one (after pruning) show blank cells.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from headkit.analysis.importance import pad_to_matrix
from headkit.errors import HeadkitError
from headkit.files import save_figure_atomic

PerLayer = torch.Tensor | Sequence[torch.Tensor] | Mapping[int, torch.Tensor]


def as_layer_head_matrix(values: PerLayer) -> torch.Tensor:
    """[layers, heads] float tensor from a 2D tensor, a list of per-layer vectors or ``{layer: vector}`` (NaN
    where a layer has fewer heads, and for layers missing from a mapping)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 2:
            raise HeadkitError(f"values must be a [layers, heads] tensor, got shape {tuple(values.shape)}")
        return values.detach().float().cpu()
    if isinstance(values, Mapping):
        if not values:
            raise HeadkitError("values must name at least one layer, got an empty mapping")
        layers = max(int(layer) for layer in values) + 1
        rows = [torch.as_tensor(values.get(layer, [])) for layer in range(layers)]
        return pad_to_matrix([torch.as_tensor(row, dtype=torch.float32) for row in rows])
    rows = [torch.as_tensor(row, dtype=torch.float32) for row in values]
    if not rows or any(row.dim() != 1 for row in rows):
        raise HeadkitError("values must be a non-empty sequence of per-layer vectors [heads]")
    return pad_to_matrix(rows)


def plot_head_heatmap(
    values: PerLayer,
    path: str | os.PathLike[str],
    *,
    title: str = "",
    colorbar_label: str = "",
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool | None = None,
) -> Path:
    """Write a layer × head heatmap of `values` to the PNG `path` and return the path.

    Args:
        values: [layers, heads] tensor, per-layer vectors, or ``{layer: vector}``.
        annotate: print each cell's value; by default when there are at most 16 × 16 cells.
    """
    from matplotlib.figure import Figure

    matrix = as_layer_head_matrix(values)
    layers, heads = matrix.shape
    figure = Figure(figsize=(max(3.0, 0.45 * heads + 1.8), max(2.2, 0.4 * layers + 1.2)))
    axes = figure.add_subplot()
    image = _draw(axes, matrix, cmap, vmin, vmax)
    if annotate if annotate is not None else layers * heads <= 256:
        _annotate(axes, matrix, image)
    axes.set_title(title)
    figure.colorbar(image, ax=axes, label=colorbar_label)
    return save_figure_atomic(figure, path)


def plot_gate_history(
    gate_values: Sequence[Mapping[int, Sequence[float]]],
    steps: Sequence[int],
    path: str | os.PathLike[str],
    *,
    snapshots: int = 6,
    title: str = "gate values over training",
) -> Path:
    """Write a row of layer × head heatmaps of the evaluation gate values at up to `snapshots` evenly spaced
    logged steps (first and last included), on one [0, 1] colour scale. `gate_values` / `steps` are
    :class:`headkit.recipes.gates.GateTrainingLog`'s fields of the same names."""
    from matplotlib.figure import Figure

    if len(gate_values) != len(steps) or not steps:
        raise HeadkitError(
            f"gate_values and steps must be non-empty and of equal length, got {len(gate_values)} and {len(steps)}"
        )
    if isinstance(snapshots, bool) or not isinstance(snapshots, int) or snapshots < 1:
        raise HeadkitError(f"snapshots must be a positive int, got {snapshots!r}")
    count = min(snapshots, len(steps))
    chosen = sorted({round(i * (len(steps) - 1) / max(count - 1, 1)) for i in range(count)})
    matrices = [as_layer_head_matrix({int(k): v for k, v in gate_values[i].items()}) for i in chosen]
    layers, heads = matrices[0].shape
    panel_width = max(2.0, 0.3 * heads + 0.8)
    figure = Figure(figsize=(panel_width * len(chosen) + 1.2, max(2.2, 0.35 * layers + 1.4)))
    grid = figure.subplots(1, len(chosen), squeeze=False)[0]
    image = None
    for axes, index, matrix in zip(grid, chosen, matrices, strict=True):
        image = _draw(axes, matrix, "magma", 0.0, 1.0)
        axes.set_title(f"step {steps[index]}", fontsize=9)
    for axes in grid[1:]:
        axes.set_ylabel("")
    figure.suptitle(title)
    figure.colorbar(image, ax=list(grid), label="gate (eval)")
    return save_figure_atomic(figure, path)


def _draw(axes, matrix: torch.Tensor, cmap: str, vmin: float | None, vmax: float | None):
    import numpy as np

    data = np.ma.masked_invalid(matrix.numpy())  # NaN cells (missing heads) stay blank
    image = axes.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    layers, heads = matrix.shape
    axes.set_xlabel("head")
    axes.set_ylabel("layer")
    axes.set_xticks(range(heads))
    axes.set_yticks(range(layers))
    axes.tick_params(labelsize=7)
    return image


def _annotate(axes, matrix: torch.Tensor, image) -> None:
    low, high = image.get_clim()
    middle = (low + high) / 2
    for (layer, head), value in zip(
        ((layer, head) for layer in range(matrix.shape[0]) for head in range(matrix.shape[1])),
        matrix.flatten().tolist(),
        strict=True,
    ):
        if math.isnan(value):
            continue
        axes.text(
            head,
            layer,
            f"{value:.2f}",
            ha="center",
            va="center",
            fontsize=6,
            color="white" if value < middle else "black",
        )


def plot_passkey_heatmap(
    panels: Mapping[str, Sequence[Mapping[str, float]]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
) -> Path:
    """Write the needle-in-a-haystack heat map of passkey accuracy — depth of the key (rows) by prompt length
    (columns), one panel per model of `panels` (``{name: [{"length", "depth", "accuracy"}, …]}``), on one
    [0, 1] colour scale — to the PNG `path` and return the path."""
    from matplotlib.figure import Figure

    if not panels or any(not cells for cells in panels.values()):
        raise HeadkitError("panels must map each model to at least one passkey cell")
    figure = Figure(figsize=(4.2 * len(panels) + 1.2, 3.6), layout="constrained")
    grid = figure.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for axes, (name, cells) in zip(grid, panels.items(), strict=True):
        lengths = sorted({int(cell["length"]) for cell in cells})
        depths = sorted({float(cell["depth"]) for cell in cells})
        matrix = torch.full((len(depths), len(lengths)), float("nan"))
        for cell in cells:
            matrix[depths.index(float(cell["depth"])), lengths.index(int(cell["length"]))] = cell["accuracy"]
        image = axes.imshow(matrix.numpy(), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for row in range(len(depths)):
            for column in range(len(lengths)):
                value = float(matrix[row, column])
                if not math.isnan(value):
                    axes.text(column, row, f"{value:.0%}", ha="center", va="center", fontsize=8)
        axes.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        axes.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        axes.set_xlabel("prompt length (tokens)")
        axes.set_ylabel("key depth")
        axes.set_title(name)
    figure.suptitle(f"passkey retrieval{': ' + title if title else ''}")
    figure.colorbar(image, ax=list(grid), label="exact-match accuracy")
    return save_figure_atomic(figure, path)
