"""A command line run as the program (``headkit …``, ``python -m headkit.bench.<module>``): what its errors
become, and which process prints them when a launcher started several.

A user error (a :class:`~headkit.errors.HeadkitError`, a missing file or folder) is one line on stderr and exit
status 2; so is a usage error (an option out of its declared range, an unknown option), with typer's wording. Under ``torchrun`` / ``accelerate launch`` every
process runs the command (:mod:`headkit.runs.processes`) and only the main one prints: the others' standard output
is discarded, and a user error — the same on every process, or met by the main process and replicated — is
printed once, by the main process, while every process exits with its status.
"""

from __future__ import annotations

import contextlib
import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

from headkit.runs.processes import ReplicatedError, is_main_process


def run_command_line(app: typer.Typer, argv: list[str] | None = None) -> None:
    """Run `app` on `argv` (None: this process's arguments), its errors made one line and an exit status (see the
    module docstring)."""
    err_console = Console(stderr=True)
    main_process = is_main_process()
    try:
        with contextlib.ExitStack() as stack:
            if not main_process:
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            app(args=argv, standalone_mode=False)
    except ReplicatedError as exc:  # the main process printed it
        sys.exit(exc.exit_code)
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:  # HeadkitError is a ValueError
        if main_process:
            # The message is text, not markup: "headkit[eval]" keeps its brackets.
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(1)
    except Exception as exc:
        # Errors of the click that typer vendors (an option out of its declared range, an unknown option): one
        # line like every other refusal, naming the help to read, with click's exit status (2 for usage).
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            if main_process:
                context = getattr(exc, "ctx", None)
                where = f" (see {context.command_path} --help)" if context is not None else ""
                message = " ".join(exc.format_message().split())
                err_console.print(
                    f"[bold red]error:[/] {escape(message)}{where}", highlight=False, soft_wrap=True
                )
            sys.exit(exc.exit_code)
        raise
