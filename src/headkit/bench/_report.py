"""Writing benchmark results: JSON, Markdown tables, PNG figures, each written atomically.

A benchmark that is interrupted (Ctrl-C, out of memory, a crash in the plot) must never leave a half-written
``results.json`` next to a plot from an older run. Every file is therefore written to a temporary file in the
destination folder and moved over the destination with :func:`os.replace`, which is atomic on POSIX and
Windows when both paths are on the same file system.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """Create ``path`` (and its folder) by calling ``write`` on a temporary file, then moving it into place.

    If ``write`` raises, the temporary file is removed and an existing ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); results are ordinary files, readable like any other.
        os.chmod(tmp_name, regular_file_mode())
        with os.fdopen(fd, "wb") as tmp:
            write(tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    return path


def regular_file_mode() -> int:
    """The permissions ``open(path, "w")`` would give a new file: 0666 minus the process umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` as UTF-8 to ``path`` atomically."""
    return write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically.

    NaN and infinity are refused (``allow_nan=False``): they are not JSON, and a missing measurement is
    written as ``null`` instead.
    """
    # Serialise before touching the disk, so a value that is not JSON fails without creating a temp file.
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    return write_text_atomic(path, text)


def save_figure_atomic(figure: Any, path: str | os.PathLike[str], *, dpi: int = 120) -> Path:
    """Render a :class:`matplotlib.figure.Figure` to PNG at ``path`` atomically, with the Agg backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    # Binding the canvas explicitly renders with Agg without switching pyplot's global backend.
    FigureCanvasAgg(figure)
    return write_atomic(path, lambda f: figure.savefig(f, format="png", dpi=dpi, bbox_inches="tight"))


RESULTS_FILE, TABLE_FILE = "results.json", "table.md"


def write_results(
    out_dir: str | os.PathLike[str], results: Any, markdown: str, figure: Any, plot_file: str
) -> None:
    """A benchmark's three outputs, each written atomically: results.json, table.md and its plot."""
    out_dir = Path(out_dir)
    write_json_atomic(out_dir / RESULTS_FILE, results)
    write_text_atomic(out_dir / TABLE_FILE, markdown)
    save_figure_atomic(figure, out_dir / plot_file)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; ``|`` inside a cell is escaped."""
    for index, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"rows[{index}] has {len(row)} cells, expected {len(headers)} like headers")

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(row) for row in rows)]) + "\n"


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
