"""Checks of benchmark settings, worded as the command-line options they come from (``steps`` → ``--steps``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from headkit.errors import HeadkitError


def check_names(
    flag: str, names: Iterable[str], valid: Iterable[str], *, distinct: bool = False
) -> list[str]:
    """``names`` without repeats (an error where ``distinct``), each one of ``valid`` (e.g. registered
    mechanisms), else an error naming ``flag`` and what it names (``--mechanisms``: mechanisms)."""
    valid, given = list(valid), [name.strip() for name in names]
    names = list(dict.fromkeys(given))
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        what = flag.lstrip("-").replace("-", " ")
        raise HeadkitError(
            f"{flag}: unknown {what} {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"valid names: {', '.join(valid)}"
        )
    if distinct and len(names) != len(given):
        raise HeadkitError(f"{flag} names a value twice: {tuple(given)!r}")
    return names


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


def check_positive(flag: str, value: Any) -> None:
    """``value`` must be a finite number > 0 (bool is refused), else an error naming ``flag``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise HeadkitError(f"{flag} must be a positive number, got {value!r}")


def check_integers(
    flag: str, values: Any, low: int = 1, high: int | None = None, *, distinct: bool = False
) -> None:
    """``values`` must be a non-empty tuple or list of integers in [low, high] (bool is refused), none repeated
    where ``distinct``, else an error naming ``flag``."""
    bounds = f"≥ {low}" if high is None else f"in [{low}, {high}]"
    if (
        not isinstance(values, (tuple, list))
        or not values
        or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values)
        or (high is not None and max(values) > high)
    ):
        raise HeadkitError(f"{flag} must be one or more integers {bounds}, got {values!r}")
    if distinct and len(set(values)) != len(values):
        raise HeadkitError(f"{flag} names a value twice: {values!r}")
