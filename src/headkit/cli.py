"""The ``headkit`` command run from the package (``python -m headkit``, tests): the list of commands from
:mod:`headkit_entry`'s table, anything else run by the app (:mod:`headkit.app`), which declares each command's
options from the configs and settings it runs."""

from __future__ import annotations

import sys

from headkit_entry import top_level_help


def main(argv: list[str] | None = None) -> None:
    """Entry point: the list of commands without importing the app; anything else run by it (user errors become one
    line on stderr and exit status 2, printed once under ``torchrun`` / ``accelerate launch``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args == ["--help"]:
        print(top_level_help())
        return
    from headkit.app import main as run

    run(args)


__all__ = ["main"]
