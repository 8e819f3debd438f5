"""Command-line options declared once, on the fields of the settings dataclasses (the surgeries' configs, the
recipes' settings, the benchmarks'): ``headkit linearize``, ``prune``, ``compress`` and every ``headkit bench``
command are generated from them, so a field with help is an option with no other edit.

A field is an option when its ``metadata`` has ``help``; the vocabulary (every key optional but ``help``)::

    help        the option's help; "(default D; Q with --quick)." is appended from the declaration unless it
                words its default itself (contains "(default")
    flag        its name: "--name", or "--on/--off" for a switch (default: --field-name-with-dashes, a bool
                --x/--no-x)
    removed     old names: hidden options that refuse in one line, "--old was removed: use --new" (exit 2)
    quick       its value under --quick (:meth:`headkit.recipes.settings.QuickSettings.quick`)
    parse       parse(flag, text): a list option's value from its text (default: comma-separated values of the
                tuple's type, integers each ≥ ``min``, or 1)
    repeat      a tuple of text given once per value (``--set A=1 --set B=2``), for values that hold commas
    convert     convert(value): the field's value from the option's (e.g. --lora-rank 0 → None), applied by
                :func:`settings_from`
    min         the lowest value the command line accepts (and a benchmark's checks, headkit.bench.registry)
    default_help  the words for a default the recipe computes (a None default): "(default WORDS)." is appended
                to the help — what a recipe's redeclaration of a config's field adds to the config's help
    max, distinct, positive, choices, check
                further checks of the value, which :func:`check_options` makes (with ``min``) for the command
                line and the library alike
    argument    a positional argument instead of an option
    saves       an option of the commands that save a model only (--resume): a benchmark's settings made from a
                recipe's (``with_fields_of(..., unset=True)``) leave it out

Plain ``dataclasses.field(metadata={...})`` declares one (a surgery's config, beneath the recipes, does so);
:func:`option` is the short form. :func:`with_fields_of` gives a settings class the fields of another (a
recipe's settings the fields of its surgery's config; a benchmark's settings the options of its recipe),
:func:`command_parameters` makes the typer parameters of a class's options and :func:`given_options` reads them
back; :func:`settings_command` does both around a command function.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from headkit.errors import HeadkitError


def quick_preset(help: str) -> Any:
    """The ``quick`` classmethod of a settings class: the short run, each field's ``quick`` value over the full
    run's default (and the caller's overrides over both); ``help`` is the help of ``--quick``."""

    def quick(cls: type, **overrides: Any) -> Any:
        values = {field.name: field.metadata.get("quick", MISSING) for field in fields(cls)}
        return cls(**({name: value for name, value in values.items() if value is not MISSING} | overrides))

    quick.__doc__ = help
    return classmethod(quick)


def stated_defaults(help: str, default: Any, quick: Any = MISSING) -> str:
    """``help`` ending with the values it defaults to: "(default D; Q with --quick)." (Q where it differs)."""
    quick_value = "" if quick is MISSING or quick == default else f"; {shown_value(quick)} with --quick"
    return f"{help.removesuffix('.')} (default {shown_value(default)}{quick_value})."


def shown_value(value: Any) -> str:
    """A setting's value as its help and the command line write it: a tuple comma-separated, a float short."""
    if isinstance(value, tuple):
        return ",".join(map(shown_value, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


NO_QUICK = MISSING  # a field whose quick value is its default
# What check_options reads: one declaration for the command line and the library alike.
CHECKS = ("min", "max", "distinct", "positive", "choices", "check")
VOCABULARY = frozenset(
    {
        "help",
        "flag",
        "removed",
        "quick",
        "parse",
        "convert",
        "argument",
        "default_help",
        "repeat",
        "saves",
        *CHECKS,
    }
)


def option(default: Any, help: str, **declared: Any) -> Any:
    """A settings field that is a command-line option: ``default``, ``help`` and the rest of the vocabulary."""
    unknown = set(declared) - VOCABULARY
    if unknown:
        raise TypeError(f"unknown option declarations: {sorted(unknown)}")
    return dataclasses.field(default=default, metadata={"help": help, **declared})


def option_fields(settings: type | Any) -> list[dataclasses.Field]:
    """The fields of a settings class that are command-line options (those with help), in declaration order."""
    return [field for field in dataclasses.fields(settings) if field.metadata.get("help")]


def option_name(field: dataclasses.Field) -> str:
    """The command-line spelling of a settings field: ``--flag`` (its first name) or ``--name-with-dashes``."""
    flag = field.metadata.get("flag") or f"--{field.name.replace('_', '-')}"
    return flag.split("/")[0]


def field_types(settings: type) -> dict[str, Any]:
    """Each field's type with ``None`` taken out of optional ones (``int | None`` → int)."""
    hints = {}
    for name, hint in typing.get_type_hints(settings).items():
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1
        hints[name] = args[0] if optional else hint
    return hints


def quick_value(field: dataclasses.Field) -> Any:
    """A field's value under --quick (its default where it declares none)."""
    quick = field.metadata.get("quick", NO_QUICK)
    return field.default if quick is NO_QUICK else quick


def stated_help(field: dataclasses.Field, *, always: bool = False) -> str:
    """An option's help, ending with its default and --quick's value where --quick changes it (or ``always``,
    where its default is not None), unless the help words its default itself; otherwise the command line shows
    the default ("[default: …]")."""
    help, quick = field.metadata["help"], field.metadata.get("quick", NO_QUICK)
    if "default_help" in field.metadata:
        return f"{help.removesuffix('.')} (default {field.metadata['default_help']})."
    if "(default" in help or field.default in (dataclasses.MISSING, None):
        return help
    if quick is NO_QUICK and not always:
        return help
    return stated_defaults(help, field.default, quick)


def parse_list(flag: str, text: str, kind: type = int, *, minimum: int = 1) -> tuple:
    """A comma-separated option as a tuple of ``kind``: integers ≥ ``minimum``, numbers or non-empty names."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if kind is str:
        if not parts:
            raise HeadkitError(f"{flag} must name at least one, got {text!r}")
        return tuple(parts)
    word = "integers" if kind is int else "numbers"
    try:
        values = tuple(kind(part) for part in parts)
    except ValueError:
        raise HeadkitError(f"{flag} must be comma-separated {word}, got {text!r}") from None
    if not values or (kind is int and any(value < minimum for value in values)):
        adjective = "positive" if minimum == 1 else f"≥ {minimum}"
        raise HeadkitError(f"{flag} must be {adjective} {word}, got {text!r}")
    return values


def parse_option(field: dataclasses.Field, kind: Any, text: str) -> Any:
    """The value of a list option given as text on the command line."""
    parse = field.metadata.get("parse")
    if parse is not None:
        return parse(option_name(field), text)
    minimum = field.metadata.get("min")
    return parse_list(
        option_name(field), text, typing.get_args(kind)[0], minimum=1 if minimum is None else minimum
    )


def is_list(kind: Any) -> bool:
    return typing.get_origin(kind) is tuple


# -- settings classes made of others' fields --------------------------------------------------------------------


def with_fields_of(
    source: type, *, unset: bool = False, names: tuple[str, ...] | None = None
) -> Callable[[type], type]:
    """Class decorator, beneath ``@dataclass``: the class gains the fields of ``source`` it does not declare (of
    `names` only, where given: a recipe whose own field of the same name means something else).

    By default every field of ``source`` (a recipe's settings take its surgery's config whole: a field added to
    the config is a setting and, with help, an option), each field the class redeclares keeping the source's
    metadata beneath its own (a recipe's other default and quick value, the config's help). With ``unset``, only
    the source's options, each None by default ("the source's default, full or quick": a benchmark running a
    recipe), its help stating the source's defaults and its ``quick`` left to the source."""

    def decorate(cls: type) -> type:
        hints = typing.get_type_hints(source)
        sources = (
            [field for field in option_fields(source) if not field.metadata.get("saves")]
            if unset
            else dataclasses.fields(source)
        )
        if names is not None:
            sources = [field for field in sources if field.name in names]
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for field in sources:
            metadata = dict(field.metadata)
            if unset:
                metadata.pop("quick", None)
                metadata["help"] = stated_help(field, always=True)
            declared = cls.__dict__.get(field.name)
            if field.name in annotations:
                if isinstance(declared, dataclasses.Field):
                    declared.metadata = types.MappingProxyType(metadata | dict(declared.metadata))
                elif metadata:
                    default = dataclasses.MISSING if field.name not in cls.__dict__ else declared
                    setattr(cls, field.name, dataclasses.field(default=default, metadata=metadata))
                continue
            annotations[field.name] = hints[field.name] | None if unset else hints[field.name]
            if unset:
                made = dataclasses.field(default=None, metadata=metadata)
            elif field.default_factory is not dataclasses.MISSING:
                made = dataclasses.field(default_factory=field.default_factory, metadata=metadata)
            else:
                made = dataclasses.field(default=field.default, metadata=metadata)
            setattr(cls, field.name, made)
        cls.__annotations__ = annotations
        return cls

    return decorate


def settings_from(settings_class: type, quick: bool = False, given: dict[str, Any] | None = None) -> Any:
    """The settings of a run: ``given`` (each passed through its field's ``convert``) over the quick preset
    (``quick``) or the full run's defaults."""
    given = dict(given or {})
    for field in dataclasses.fields(settings_class):
        convert = field.metadata.get("convert")
        if convert is not None and field.name in given:
            given[field.name] = convert(given[field.name])
    return settings_class.quick(**given) if quick else settings_class(**given)


# -- typer parameters ------------------------------------------------------------------------------------------


def _old_name(field: dataclasses.Field, index: int) -> str:
    return f"{field.name}__removed_{index}"


def command_parameters(settings_class: type) -> list[inspect.Parameter]:
    """One keyword-only typer parameter per option of ``settings_class`` (see the module docstring), defaults
    the full run's, and a hidden one per removed name (which refuses, naming the new one)."""
    import typer
    from rich.markup import escape

    kinds = field_types(settings_class)
    parameters = []
    # The options every saving command shares (--resume) after the recipe's own, which its help is about.
    for field in sorted(option_fields(settings_class), key=lambda field: bool(field.metadata.get("saves"))):
        kind, default, meta = kinds[field.name], field.default, field.metadata
        if default is dataclasses.MISSING:
            default = ... if field.default_factory is dataclasses.MISSING else field.default_factory()
        if meta.get("repeat"):
            # given once per value (a value may hold commas: --set KEY=[1,2])
            kind, default = list[str], None
        elif is_list(kind):
            # a list option: comma-separated text
            kind, default = str, ",".join(map(str, default)) if default else ""
        # Help is rich markup: "headkit[eval]" would lose its "[eval]" as a tag.
        help = escape(stated_help(field))
        # Help that states its defaults (full and quick) says it best: no second [default: …] after it.
        shown = "(default" not in help and default is not None
        if meta.get("argument"):
            declared = typer.Argument(default, help=help, show_default=shown, metavar=field.name.upper())
        else:
            flag = meta.get("flag") or option_name(field)
            if kind is bool and "/" not in flag:
                flag = f"{flag}/--no-{flag[2:]}"
            # a list's minimum is of each of its numbers
            minimum = None if kind in (str, list[str]) else meta.get("min")
            declared = typer.Option(default, flag, help=help, min=minimum, show_default=shown)
        parameters.append(
            inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=declared, annotation=kind)
        )
        for index, old in enumerate(meta.get("removed") or ()):
            hidden = typer.Option(None, old, hidden=True)
            parameters.append(
                inspect.Parameter(
                    _old_name(field, index), inspect.Parameter.KEYWORD_ONLY, default=hidden, annotation=kind
                )
            )
    return parameters


def given_options(settings_class: type, ctx: Any, values: dict[str, Any]) -> dict[str, Any]:
    """The options of ``settings_class`` the command line gave (not their defaults: those are the chosen mode's,
    full or --quick), lists parsed; an old name given wins over the new one, and says so with one line."""
    kinds = field_types(settings_class)
    given = {}
    for field in option_fields(settings_class):
        kind = kinds[field.name]
        source = ctx.get_parameter_source(field.name)
        names = [field.name] if source is not None and source.name != "DEFAULT" else []
        for index, old in enumerate(field.metadata.get("removed") or ()):
            if values.get(_old_name(field, index)) is not None:
                raise HeadkitError(f"{old} was removed: use {option_name(field)}")
        if names:
            value = values[names[0]]
            if field.metadata.get("repeat"):
                value = tuple(value or ())
            elif is_list(kind):
                value = parse_option(field, kind, value)
            given[field.name] = value
    return given


def settings_command(
    settings_class: type,
) -> Callable[[Callable], Callable]:
    """Decorator of a command function whose own parameters are the options not in ``settings_class`` and which
    takes ``**options``: the command gains an option per option field of ``settings_class``
    (:func:`command_parameters`), and the function receives those the command line gave
    (:func:`given_options`) as ``options``."""
    import typer

    def decorate(command: Callable) -> Callable:
        hints = typing.get_type_hints(command)
        own = [
            parameter.replace(annotation=hints.get(name, parameter.annotation))
            for name, parameter in inspect.signature(command).parameters.items()
            if parameter.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        context = inspect.Parameter("_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        generated = command_parameters(settings_class)
        names = [parameter.name for parameter in own]
        clash = set(names) & {parameter.name for parameter in generated}
        if clash:
            raise TypeError(
                f"{command.__name__} declares options of {settings_class.__name__}: {sorted(clash)}"
            )

        @functools.wraps(command)
        def wrapper(_ctx: Any, **values: Any) -> Any:
            given = given_options(settings_class, _ctx, values)
            return command(**{name: values[name] for name in names}, **given)

        # The command's arguments, the settings' options, then its own options (all passed by keyword).
        own = [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY) for parameter in own]
        arguments = [
            parameter for parameter in own if isinstance(parameter.default, typer.models.ArgumentInfo)
        ]
        rest = [parameter for parameter in own if parameter not in arguments]
        parameters = [*arguments, *generated, *rest, context]
        wrapper.__signature__ = inspect.Signature(parameters)
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
        del wrapper.__wrapped__
        return wrapper

    return decorate


# -- checks the fields declare --------------------------------------------------------------------------------


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


def check_choice(flag: str, value: Any, valid: Iterable[str]) -> None:
    """``value`` is one of ``valid``, else an error naming ``flag`` and the valid values."""
    valid = tuple(valid)
    if value not in valid:
        raise HeadkitError(f"{flag} must be one of {', '.join(valid)}, got {value!r}")


def existing_path(flag: str) -> Callable[[Any], None]:
    """A field's ``check``: the path given, if any, exists (else an error naming ``flag``)."""

    def check(path: Any) -> None:
        if path is not None and not Path(path).exists():
            raise HeadkitError(f"{flag} {str(path)!r} does not exist")

    return check


def check_options(settings: Any) -> None:
    """The checks that fields declare (:func:`option`, :func:`setting`), one declaration for the command line and
    the library alike, each failure a HeadkitError naming the field as an option (``--name``): ``min`` and
    ``max`` of an integer or a (finite) number; ``min``, ``max`` and ``distinct`` of a non-empty tuple of integers;
    ``positive``: a finite number > 0; ``choices()``: the valid names of a tuple of names, ``distinct`` if no
    name may be repeated (the tuple may be empty only where the full run's default is: "the benchmark's
    choice"); ``check(value)``: anything else. A field whose full run's default is None may be None."""
    hints = field_types(type(settings))
    for field in dataclasses.fields(settings):
        value, declared, flag = getattr(settings, field.name), field.metadata, option_name(field)
        kind, minimum, distinct = hints[field.name], declared.get("min"), bool(declared.get("distinct"))
        if value is None and field.default is None:
            continue
        if minimum is not None and kind in (int, float):
            accepted = int if kind is int else (int, float)
            if isinstance(value, bool) or not isinstance(value, accepted) or not minimum <= value < math.inf:
                integer = {0: "a non-negative integer", 1: "a positive integer"}.get(
                    minimum, f"an integer ≥ {minimum}"
                )
                wording = integer if kind is int else f"a number ≥ {minimum}"
                raise HeadkitError(f"{flag} must be {wording}, got {value!r}")
        maximum = declared.get("max")
        if maximum is not None and kind in (int, float) and not value <= maximum:
            raise HeadkitError(f"{flag} must be at most {maximum}, got {value!r}")
        integers = typing.get_args(kind)[:1] == (int,)  # tuple[int, ...]
        if integers and (minimum is not None or maximum is not None or distinct):
            check_integers(flag, value, 1 if minimum is None else minimum, maximum, distinct=distinct)
        if declared.get("positive"):
            check_positive(flag, value)
        if declared.get("choices") and (value or field.default):
            check_names(flag, value, declared["choices"](), distinct=distinct)
        if declared.get("check"):
            declared["check"](value)
