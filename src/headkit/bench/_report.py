"""Writing benchmark results (JSON, Markdown tables, PNG figures, each atomically: an interrupted run never
leaves a half-written ``results.json`` beside a plot of an older run) and the pieces of their tables and plots."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from headkit.files import save_figure_atomic, write_json_atomic, write_text_atomic

RESULTS_FILE, TABLE_FILE = "results.json", "table.md"


def finish_report(
    name: str,
    settings: Any,
    started: float,
    sections: Mapping[str, Any],
    files: Mapping[str, str],
    render: Callable[[dict[str, Any]], str],
    plots: Mapping[str, Callable[[dict[str, Any]], Any]] | None,
    console: Any,
    tables: Callable[[dict[str, Any]], Sequence[Any]] | None = None,
) -> dict[str, Any]:
    """Write and return a run's report: the benchmark, command line, machine (``settings.device``, else the CPU)
    and settings (as JSON reads them back: paths as strings, tuples as lists), then ``sections`` (over the
    settings, where they hold their own), the seconds since ``started`` (a ``time.perf_counter()``) and
    ``files`` (each key's file name, as its path under ``settings.out``; a plot's file only where it drew one).
    Each plot (file name: plot of the report, or None where there is nothing to plot), table.md
    ``render(report)`` and results.json are written atomically, in that order; the console shows
    ``tables(report)`` (rich tables) or else table.md, and the files written."""
    out, machine = Path(settings.out), machine_info(getattr(settings, "device", "cpu"))
    values = {
        k: str(v) if isinstance(v, os.PathLike) else list(v) if isinstance(v, tuple) else v
        for k, v in dataclasses.asdict(settings).items()
    }
    report = {"benchmark": name, "command": command_line(), "machine": machine, "settings": values} | dict(
        sections
    )
    report["seconds"] = time.perf_counter() - started
    plots = plots or {}
    figures = {file: plot(report) for file, plot in plots.items()}
    figures = {file: figure for file, figure in figures.items() if figure is not None}
    report["files"] = {k: str(out / f) for k, f in files.items() if f not in plots or f in figures}
    markdown = render(report)
    for file, figure in figures.items():
        save_figure_atomic(figure, out / file)
    write_text_atomic(out / TABLE_FILE, markdown)
    write_json_atomic(out / RESULTS_FILE, report)
    if tables is None:
        console.print(markdown, highlight=False, markup=False, soft_wrap=True)  # wrapped tables read badly
    for table in tables(report) if tables else ():
        console.print(table)
    *written, last = [RESULTS_FILE, TABLE_FILE, *figures]
    console.print(f"wrote {', '.join(written)} and {last} to {out}", highlight=False, markup=False)
    return report


def find_point(points: Iterable[Mapping[str, Any]], **keys: Any) -> Any:
    """The first of ``points`` whose values at ``keys`` are those given, or None."""
    return next((point for point in points if all(point[k] == v for k, v in keys.items())), None)


def grid_rows(
    points: Sequence[Mapping[str, Any]],
    rows: Iterable[Mapping[str, Any]],
    column: str,
    columns: Iterable[Any],
    cell: Callable[[Any], str],
) -> list[list[Any]]:
    """Table rows of ``points``: per entry of ``rows`` (keys to match), its values, then ``cell`` of the point at
    each of ``columns`` (the value at key ``column``; the point is None where there is none)."""
    columns = list(columns)
    return [
        [*row.values(), *(cell(find_point(points, **row, **{column: value})) for value in columns)]
        for row in rows
    ]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; ``|`` inside a cell is escaped."""
    for index, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"rows[{index}] has {len(row)} cells, expected {len(headers)} like headers")

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(row) for row in rows)]) + "\n"


def column_rows(
    columns: Mapping[str, Callable[[Any], object]], items: Iterable[Any]
) -> tuple[list[str], list[list[object]]]:
    """The headers and rows of a table declared by its columns (header: formatter of an item), a row per item."""
    return list(columns), [[cell(item) for cell in columns.values()] for item in items]


def column_table(
    columns: Mapping[str, Callable[[Any], object]],
    items: Iterable[Any],
    *,
    first: Sequence[Sequence[object]] = (),
    last: Sequence[Sequence[object]] = (),
) -> str:
    """A Markdown table with a row per item of ``items``, its cell under each header of ``columns`` (header:
    formatter of an item), between the rows ``first`` and ``last`` given as they are."""
    headers, rows = column_rows(columns, items)
    return markdown_table(headers, [*first, *rows, *last])


def markdown_page(title: str, intro: str, command: Sequence[str], sections: Iterable[tuple[str, Any]]) -> str:
    """A report's table.md: the title, an intro paragraph and the command that ran, then each section's heading
    and body: a table (headers, rows) or Markdown text; a section whose text is empty is left out."""
    parts = [f"# {title}\n", f"{intro}\n", f"Command: `{shlex.join(command)}`\n"]
    for heading, body in sections:
        if body:
            parts += [f"## {heading}\n", body if isinstance(body, str) else markdown_table(*body)]
    return "\n".join(parts)


def bullet_list(lines: Iterable[str]) -> str:
    """Markdown bullets, one per line ("" where there are none)."""
    return "".join(f"- {line}\n" for line in lines)


def machine_line(results: Mapping[str, Any]) -> str:
    """Where a report's numbers were measured: the device, CPU model, torch threads and torch version."""
    config, machine = results["config"], results["machine"]
    return (
        f"device {config['device']} ({machine['cpu_model']}, {machine['torch_threads']} torch threads), "
        f"torch {machine['torch_version']}"
    )


def machine_info(device: torch.device | str) -> dict[str, Any]:
    """What the numbers depend on: CPU model and cores, torch version and threads, the device measured."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "timestamp_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        info["cuda_device_name"] = torch.cuda.get_device_name(device)
        info["cuda_version"] = torch.version.cuda
    return info


def command_line() -> list[str]:
    """The command that started this process, as ``sys.argv`` holds it."""
    return list(sys.argv)


def _cpu_model() -> str:
    # /proc/cpuinfo names the model on Linux; platform.processor() is often empty there but not on macOS.
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def verdict(passed: bool | None) -> str:
    """A target's result as the tables write it."""
    return {True: "pass", False: "FAIL", None: "not measured"}[passed]


def rich_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> Any:
    """A rich table for the console: the first ``left`` columns left-aligned, the others right-aligned; a cell
    that is a verdict (pass, FAIL, not measured) is coloured."""
    from rich.table import Table

    styles = {"pass": "green", "FAIL": "bold red", "not measured": "dim"}
    table = Table(title=title)
    for index, header in enumerate(headers):
        table.add_column(header, justify="left" if index < left else "right")
    for row in rows:
        table.add_row(*(f"[{styles[cell]}]{cell}[/]" if cell in styles else str(cell) for cell in row))
    return table


def progress_bar(
    console: Any, show: bool = True, width: int | None = None, *, transient: bool = False
) -> Any:
    """A rich progress bar: the task's description (in ``width`` characters), bar, count, elapsed time;
    ``transient`` bars vanish when done."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    description = TextColumn("{task.description}" if width is None else f"{{task.description:<{width}}}")
    columns = (description, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console, disable=not show, transient=transient)


def figure_axes(
    size: tuple[float, float], rows: int = 1, columns: int = 1, layout: str | None = None, **grid: Any
) -> Any:
    """A matplotlib figure of ``size`` inches and its ``rows`` × ``columns`` axes (``grid``: subplots options)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout=layout)
    return figure, figure.subplots(rows, columns, **grid)


def plot_series(
    ax: Any,
    points: Sequence[Mapping[str, Any]],
    x: str,
    y: str,
    series: str | tuple[str, ...] = "mechanism",
    *,
    scale: float = 1.0,
    label: str = "{}",
    style: Callable[..., dict[str, Any]] | None = None,
    spread: float = 0.0,
    **options: Any,
) -> None:
    """``y`` (times ``scale``; None a gap) against ``x`` of ``points``, a line marked "o" per value of the key(s)
    ``series`` in order of appearance, labelled ``label.format(*values)`` and drawn with ``options`` and
    ``style(*values)``; line i of n is shifted sideways by 2^(spread·(i − (n−1)/2)), so that lines which coincide
    stay visible on a log₂ axis."""
    keys = (series,) if isinstance(series, str) else series
    groups = list(dict.fromkeys(tuple(point[key] for key in keys) for point in points))
    for index, values in enumerate(groups):
        line = [point for point in points if tuple(point[key] for key in keys) == values]
        line.sort(key=lambda point: point[x])
        shift = 2.0 ** (spread * (index - (len(groups) - 1) / 2))
        ys = [math.nan if point[y] is None else point[y] * scale for point in line]
        extra = options | (style(*values) if style else {})
        ax.plot([point[x] * shift for point in line], ys, marker="o", label=label.format(*values), **extra)


def log2_length_axis(ax: Any, lengths: Sequence[int], xlabel: str | None, ylabel: str, title: str) -> None:
    """Log-log axes over powers-of-two lengths, each length a labelled tick, with a light grid."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yscale("log")
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """🤗 transformers' warnings hidden for the duration (its errors still shown), the previous level restored:
    a benchmark that feeds a whole file to a tokenizer, or a model more positions than it was trained on, does
    so on purpose."""
    from transformers import logging

    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(previous)
