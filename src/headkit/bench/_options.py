"""Checks of benchmark settings, worded as the command-line options they come from (``steps`` → ``--steps``)."""

from __future__ import annotations

from pathlib import Path

from headkit.errors import HeadkitError


def check_corpus(corpus: str | Path) -> None:
    """A corpus given must exist, else an error naming ``--corpus``."""
    if not Path(corpus).exists():
        raise HeadkitError(f"--corpus {str(corpus)!r} does not exist")


def check_out_dir(out: str | Path) -> None:
    """The output folder of a run must be a folder or not exist yet, else an error naming ``--out``."""
    if Path(out).exists() and not Path(out).is_dir():
        raise NotADirectoryError(f"--out {str(out)!r} exists and is not a directory")


def check_head_width(hidden_size: int, heads: int, *, even: bool) -> None:
    """``hidden_size`` must split into ``heads`` heads (of an even width where ``even``: rotary pairs)."""
    if hidden_size % heads or (even and (hidden_size // heads) % 2):
        width = " into an even head width (rotary pairs)" if even else ""
        raise HeadkitError(f"--hidden-size {hidden_size} must be divisible by --heads {heads}{width}")
