"""Checks of benchmark settings, worded as the command-line options they come from (``steps`` → ``--steps``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from headkit.errors import HeadkitError


def check_positive_option(name: str, value: Any) -> None:
    """``value`` must be an int > 0 (bool is refused); the error names the option ``--name-with-dashes``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HeadkitError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def check_positive_options(config: Any, names: Iterable[str]) -> None:
    """Each of ``config``'s attributes ``names`` must be a positive integer (see :func:`check_positive_option`)."""
    for name in names:
        check_positive_option(name, getattr(config, name))
