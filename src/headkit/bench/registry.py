"""The benchmark registry: one entry per ``headkit bench`` command, and the command generated from it.

A benchmark is a settings dataclass (fields made by :func:`option` are command-line options, by :func:`setting`
library settings, each checked as it declares: :func:`check_options`; ``quick = quick_preset(help)`` is the
short run, each field's ``quick`` value) and a body decorated with :func:`register_benchmark`, in a module of
``headkit.bench`` (found by :func:`headkit.bench.load_benchmarks`)::

    @dataclass
    class WidgetSettings:
        out: Path = option(Path("results/widget"), "Output directory for results.json, table.md, widget.png.")
        steps: int = option(100, "Training steps.", min=1, quick=10)
        quick = quick_preset("Ten steps (seconds).")


    @register_benchmark("widget", WidgetSettings, render=widget_table, plots={"widget.png": plot_widgets})
    def run_widget_benchmark(settings: WidgetSettings, console: Console) -> dict[str, Any]:
        \"\"\"What the widget benchmark measures (the command's help).\"\"\"

The body returns the sections of its report; the run writes them to ``settings.out`` with the header every
benchmark shares (results.json), ``widget_table(report)`` (table.md) and ``plot_widgets(report)``.

:func:`add_command` makes ``headkit bench widget [--steps N] [--quick] [--out DIR]`` of it (:mod:`headkit.app`
adds every benchmark's): ``--name-with-dashes`` (or ``flag``) per option, a tuple a comma-separated list (``parse``
reads the text), a bool a ``--x/--no-x`` switch, ``argument=True`` a positional argument. :func:`run_as_script`
runs the same command as ``python -m headkit.bench.widget``, without the command line's module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from headkit.runs.options import (
    CHECKS,
    NO_QUICK,
    check_options,
    command_parameters,
    field_types,
    given_options,
    option_fields,
    option_name,
    parse_list,
    parse_option,
    quick_preset,
    stated_defaults,
)

# Re-exported: the benchmarks' modules and tests read the option vocabulary's helpers here.
__all__ = ["NO_QUICK", "field_types", "option_name", "parse_list", "parse_option", "quick_preset"]

# The order in which `headkit bench --help` lists headkit's own benchmarks (modules); a module not named here is
# found all the same and listed after them.
BUILTIN_BENCHMARKS = tuple(
    "speed decode digits lora decompose lm extrapolate compress prune_curves linearize retrieval frontier export "
    "memory".split()
)


@dataclass(frozen=True)
class Benchmark:
    """One registered benchmark: its command name, settings class, run function and command help."""

    name: str
    settings: type
    run: Callable[..., dict[str, Any]]
    help: str

    def options(self) -> list[dataclasses.Field]:
        """The settings fields that are command-line options (those with help), in declaration order."""
        return option_fields(self.settings)

    def make_settings(self, quick: bool = False, **given: Any) -> Any:
        """The settings of a run: ``given`` over the quick preset (``quick``) or over the full run's defaults."""
        return self.settings.quick(**given) if quick else self.settings(**given)

    def quick_help(self) -> str:
        """The help of ``--quick``: the first paragraph of the quick preset's docstring."""
        return (self.settings.quick.__doc__ or "The short run.").strip().split("\n\n")[0]


BENCHMARKS: dict[str, Benchmark] = {}


def register_benchmark(
    name: str,
    settings: type,
    *,
    check: Callable[[Any], None] | None = None,
    render: Callable[[dict[str, Any]], str] | None = None,
    files: Mapping[str, str] | None = None,
    plots: Mapping[str, Callable[[dict[str, Any]], Any]] | None = None,
    tables: Callable[[dict[str, Any]], Sequence[Any]] | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator of a benchmark's body ``body(settings, console, **extra)``: make it ``headkit bench <name>``,
    whose help is the first paragraph of the body's docstring.

    Returns the run function, the body inside the steps every benchmark shares: ``settings`` default to the
    full run's, the checks its fields declare (:func:`check_options`) and ``check(settings)`` raise HeadkitError
    naming the option before anything is loaded, the body runs with ``settings.threads`` torch threads (where
    the settings have them; restored after) and prints to
    ``console`` (stdout by default). Given ``render``, the body returns the sections of its report and the run
    ends it (:func:`headkit.bench._report.finish_report`): ``files`` (results.json's key: file name under
    ``settings.out``; by default "table" and "plot", the one plot's), table.md ``render(report)``, each of
    ``plots`` (file name: plot of the report; a plot that returns None is no file) and the console's rich
    ``tables(report)``; it returns the report."""
    from headkit.bench._report import TABLE_FILE

    if files is None:  # results.json names table.md "table" and the one plot "plot"
        if len(plots or ()) > 1:
            raise TypeError(f"benchmark {name!r}: name the files of its plots")
        files = dict(zip(("table", "plot"), (TABLE_FILE, *(plots or ())), strict=False))
    if not dataclasses.is_dataclass(settings) or not callable(getattr(settings, "quick", None)):
        raise TypeError(f"benchmark {name!r}: settings must be a dataclass with a quick() classmethod")

    def register(body: Callable) -> Callable:
        existing = BENCHMARKS.get(name)
        if existing is not None and existing.run.__qualname__ != body.__qualname__:
            raise ValueError(f"benchmark {name!r} is already registered to {existing.run.__module__}")

        @functools.wraps(body)
        def run(config: Any = None, console: Any = None, **extra: Any) -> dict[str, Any]:
            from rich.console import Console

            from headkit.bench._report import finish_report
            from headkit.evaluation.timing import thread_limit
            from headkit.runs.processes import on_main_process

            config = settings() if config is None else config
            check_options(config)
            if check is not None:
                check(config)
            started, console = time.perf_counter(), console or Console()
            with thread_limit(getattr(config, "threads", None)):
                sections = body(config, console, **extra)
                if render is None:
                    return sections
                # Written once under torchrun / accelerate launch: by the main process, the others waiting.
                return on_main_process(
                    lambda: finish_report(
                        name, config, started, sections, files, render, plots, console, tables
                    )
                )

        help = (inspect.getdoc(body) or "").split("\n\n")[0].replace("\n", " ")
        BENCHMARKS[name] = Benchmark(name, settings, run, help)
        return run

    return register


def add_command(app: Any, benchmark: Benchmark) -> None:
    """Add ``<name> [options] [--quick]`` of `benchmark` to the typer `app`: an option per settings field with help
    (:mod:`headkit.runs.options`), and ``--quick``."""
    import typer

    parameters = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
    parameters += command_parameters(benchmark.settings)
    quick_option = typer.Option(False, "--quick/--no-quick", help=benchmark.quick_help())
    parameters.append(inspect.Parameter("quick", inspect.Parameter.KEYWORD_ONLY, default=quick_option))

    def command(ctx: typer.Context, quick: bool = False, **values: Any) -> None:
        # the options given; the others take the chosen mode's value (full or --quick)
        given = given_options(benchmark.settings, ctx, values)
        registered = BENCHMARKS[benchmark.name]  # looked up when run: the registry's entry is the benchmark
        registered.run(registered.make_settings(quick, **given))

    command.__signature__ = inspect.Signature(parameters)
    command.__annotations__ = {p.name: p.annotation for p in parameters} | {"quick": bool, "return": None}
    command.__doc__ = benchmark.help
    command.__name__ = f"bench_{benchmark.name}"
    app.command(benchmark.name)(command)


def run_as_script(name: str) -> None:
    """``python -m headkit.bench.<module>``: the command of the benchmark registered as `name` with this process's
    arguments, as ``headkit bench <name>`` runs it (the same options, errors and exit statuses:
    :func:`headkit.runs.command_line.run_command_line`). Called from the benchmark module's ``__main__`` block,
    which runs only as the program and is imported by nothing."""
    import typer

    from headkit.runs.command_line import run_command_line

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    add_command(app, BENCHMARKS[name])  # one command: the program is that command, no name to give
    run_command_line(app, sys.argv[1:])


def option(
    default: Any, help: str, *, flag: str | None = None, argument: bool = False, **declared: Any
) -> Any:
    """A settings field that is also a command-line option (see the module docstring): a :func:`setting` with
    its ``help``, ``flag``, ``argument`` and ``parse(flag, text)``, a function that reads a list's text.

    The help of an option that ``--quick`` changes ends with both values, "(default 100; 10 with --quick).",
    written here from the declaration (unless the help words them itself, e.g. a default of None); any other
    option's help is followed by the command line's own "[default: …]"."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("option defaults must be immutable (use a tuple)")
    quick = declared.get("quick", NO_QUICK)
    if quick is not NO_QUICK and "(default" not in help:
        help = stated_defaults(help, default, quick)
    return setting(default, help=help, flag=flag, argument=argument, **declared)


def setting(default: Any, *, quick: Any = NO_QUICK, **declared: Any) -> Any:
    """A settings field, with its value in the short run (``quick``) and its ``CHECKS`` (:func:`check_options`)
    — checked like an option, named like one in errors, whether or not it is one."""
    unknown = set(declared) - {*CHECKS, "help", "flag", "argument", "parse", "removed"}
    if unknown:
        raise TypeError(f"unknown settings field declarations: {sorted(unknown)}")
    return dataclasses.field(default=default, metadata=dict.fromkeys(CHECKS) | declared | {"quick": quick})
