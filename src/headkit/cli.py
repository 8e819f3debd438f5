"""The ``headkit`` command run from the package (``python -m headkit``, tests): the console script's own entry
point, :func:`headkit_entry.main` (the list of commands from its table; anything else run by :mod:`headkit.app`)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """Run ``headkit`` with `argv` (default: the command line); user errors become one line on stderr and exit
    status 2, printed once under ``torchrun`` / ``accelerate launch``."""
    from headkit_entry import main as entry

    entry(argv)


__all__ = ["main"]
