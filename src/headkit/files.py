"""Writing files atomically: a result, a report or a whole model folder is either all there or not at all.

Every file is written to a temporary file in the destination folder and moved over the destination with
:func:`os.replace`, which is atomic on POSIX and Windows when both paths are on the same file system; a folder is
built under a temporary name beside its destination and renamed into place (:func:`move_into_place`). An
interrupted run (Ctrl-C, out of memory, a crash in a plot) never leaves a half-written file or folder.

Which process writes can be observed (:func:`record_write`): with ``HEADKIT_WRITE_LOG`` naming a folder, every path
these writers create or move into place is appended to that process's list there — how the tests see that only
the main process of a ``torchrun`` run writes (:mod:`headkit.runs.processes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from headkit.errors import HeadkitError

#: The environment variable naming a folder where each process lists the paths it writes (:func:`record_write`).
WRITE_LOG_ENVIRONMENT = "HEADKIT_WRITE_LOG"


def record_write(path: str | os.PathLike[str]) -> None:
    """Append `path` (a file or folder just created or moved into place) to ``rank-<RANK>.paths`` in the folder
    ``$HEADKIT_WRITE_LOG`` names, one path a line: a test's view of which process of a launched run wrote what
    (``RANK``: the rank ``torchrun`` / ``accelerate launch`` gave the process, 0 in a single process). Unset, as
    in every ordinary run, it does nothing: one look-up in the environment, no file touched."""
    folder = os.environ.get(WRITE_LOG_ENVIRONMENT)
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(folder, f"rank-{rank}.paths"), "a", encoding="utf-8") as log:
        log.write(f"{os.fspath(path)}\n")


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
    record_write(path)
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


def move_into_place(staging: Path, out: Path) -> None:
    """Rename the finished folder `staging` to `out`; an existing `out` is swapped out first and deleted last,
    so `out` is never half-written (and is restored if the rename fails)."""
    os.chmod(staging, 0o755)
    if not out.exists():
        os.replace(staging, out)
        record_write(out)
        return
    retired = out.parent / f".{out.name}.old-{os.getpid()}"
    os.replace(out, retired)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(retired, out)
        raise
    record_write(out)
    shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike[str]) -> Iterator[Path]:
    """``with staged_folder(out) as staging:`` write everything into `staging`; on success it becomes `out`
    (replacing an existing one), on any error it is deleted and `out` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        record_write(staging)
        yield staging
        move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_output_folder(
    out: str | os.PathLike[str],
    overwrite: bool,
    inputs: Mapping[str, str | os.PathLike[str]] | None = None,
) -> None:
    """Check, before any work, the folder a run writes at its end (through :func:`staged_folder`), named as
    ``--out``: never one of ``inputs`` (how a message names it → path: "model", "--corpus", …), inside or
    around it (a file input may have a new folder beside it); never an existing file, even with ``overwrite``;
    a non-empty folder only with ``overwrite`` (it is replaced whole); and its nearest existing parent must be
    a writable folder, so that the save at the end cannot fail on it."""
    target = Path(out).resolve()
    for name, path in (inputs or {}).items():
        source = Path(path).resolve()
        if source.is_file():
            if target == source or target in source.parents:
                raise HeadkitError(f"--out {str(out)!r} must not be the {name} file {str(path)!r} or hold it")
        elif target == source or source in target.parents or target in source.parents:
            raise HeadkitError(
                f"--out {str(out)!r} must not be the {name} folder {str(path)!r}, inside or around it"
            )
    if target.exists() and not target.is_dir():
        raise HeadkitError(f"--out {str(out)!r} exists and is not a folder; name a folder to create")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise HeadkitError(f"--out {str(out)!r} is not empty; pass --overwrite to replace it")
    parent = next(p for p in target.parents if p.exists())
    if not parent.is_dir():
        raise HeadkitError(f"--out {str(out)!r} cannot be made: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HeadkitError(f"--out {str(out)!r} cannot be made: {str(parent)!r} is not writable")
