"""The record of surgery on a model: the ops that can be re-applied, the entries in its config, and the protocol
every surgery's config implements.

Every surgery op records itself in ``config.headkit_surgery`` (:func:`record_surgery`) and registers a *re-apply*
function (:func:`register_surgery_op`) that :func:`headkit.surgery.io.from_pretrained` calls to rebuild the same
structure on a freshly built model. A surgery with a config (:class:`SurgeryConfig`) registers it as a
*conversion* (:func:`register_conversion`): its config type, its op and the function that applies it, which
:func:`headkit.surgery.apply.apply_` dispatches on (torchao's ``quantize_(model, config)``: one entry point, one
handler per config type). The op modules import this module; the loader and ``apply_`` import them.

An op takes its config as ``config=`` (some also in the place of a positional argument) or its fields as keywords,
not both: :func:`config_in_place_of` and :func:`given_config` check that once for every op.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch import nn

from headkit.errors import HeadkitError

SURGERY_KEY = "headkit_surgery"

ConfigT = TypeVar("ConfigT")
ReapplyFunction = Callable[[nn.Module, dict[str, Any]], None]
SURGERY_OPS: dict[str, ReapplyFunction] = {}


def register_surgery_op(name: str, reapply: ReapplyFunction) -> None:
    """Make `reapply(model, entry)` the way :func:`from_pretrained` rebuilds entries ``{"op": name, ...}``.

    `reapply` must rebuild the structure only (the weights are loaded afterwards) and must not record again.
    """
    if not isinstance(name, str) or not name:
        raise HeadkitError(f"surgery op name must be a non-empty string, got {name!r}")
    existing = SURGERY_OPS.get(name)
    if existing is not None and existing is not reapply:
        raise HeadkitError(f"a surgery op named {name!r} is already registered")
    SURGERY_OPS[name] = reapply


@runtime_checkable
class SurgeryConfig(Protocol):
    """What every surgery's config is: a frozen dataclass that checks its types and ranges when built, and

    - ``check(model_or_config) -> None``: everything a model, or only its 🤗 config (before any weight is loaded),
      answers about this surgery; raises :class:`HeadkitError` naming the field, before any work;
    - ``record() -> dict``: its fields as JSON (``config.headkit_surgery`` keeps them under the op's name);
    - ``from_record(record)`` (a classmethod): the config a record was written from — a field the record
      predates takes its default, and keys that are not fields (what the op resolved: layers, sites) are ignored;
      ``from_record(c.record()) == c`` for every config ``c``.

    A config whose surgery changes the decoding cache also has ``bytes_per_token(config, ...)``: the cache's
    bytes per token of context for a model with that 🤗 config (:func:`headkit.surgery.apply.bytes_per_token`
    composes them).
    """

    def check(self, model_or_config: Any) -> None: ...

    def record(self) -> dict[str, Any]: ...

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Conversion:
    """A surgery applied through its config: `apply(model, config, **context)` changes `model` in place, records
    the op's entry (``{"op": op, **config.record(), ...what it resolved}``) and returns its report; `context` are
    the keyword-only arguments it takes beside the config (an adapter, calibration text); `follows`: the config
    types that replace the attention and that it may still come right after (it works on their mechanism)."""

    op: str
    config_class: type
    apply: Callable[..., Any]
    context: frozenset[str]
    replaces_attention: bool
    follows: tuple[type, ...] = ()
    # bytes_per_token(config, model_config, bytes_per_number=, context=) where the config's own module cannot
    # compute them (a linearization's state is measured on its mechanism, which imports the config's module)
    bytes_per_token: Callable[..., float | None] | None = None


CONVERSIONS: dict[type, Conversion] = {}


def register_conversion(
    config_class: type,
    op: str,
    apply: Callable[..., Any],
    reapply: ReapplyFunction,
    *,
    replaces_attention: bool = False,
    follows: tuple[type, ...] = (),
    bytes_per_token: Callable[..., float | None] | None = None,
) -> None:
    """Make `apply` the handler of `config_class` configs in :func:`headkit.surgery.apply.apply_` and `reapply`
    the way :func:`from_pretrained` rebuilds its entries ``{"op": op, ...}``.

    `replaces_attention`: the surgery gives its layers a mechanism of its own (collaborative, latent,
    linearized heads), after which no other surgery that reads the stock attention can follow it — except one
    whose `follows` names it (quantized storage of a compressed cache's keys and values). `bytes_per_token`:
    the decoding cache's bytes per token after the surgery, ``f(config, model_config, bytes_per_number=…,
    context=…)``, for a config without a ``bytes_per_token`` method of its own.
    """
    missing = [
        name for name in ("check", "record", "from_record") if not callable(getattr(config_class, name, None))
    ]
    if missing:
        raise HeadkitError(
            f"{config_class.__name__} does not implement the surgery config protocol: no {missing}"
        )
    parameters = inspect.signature(apply).parameters.values()
    context = frozenset(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)
    register_surgery_op(op, reapply)
    existing = CONVERSIONS.get(config_class)
    if existing is not None and existing.apply is not apply:
        raise HeadkitError(f"a conversion for {config_class.__name__} is already registered")
    CONVERSIONS[config_class] = Conversion(
        op, config_class, apply, context, replaces_attention, tuple(follows), bytes_per_token
    )


def conversion_of(config: Any) -> Conversion:
    """The registered conversion of `config`'s type; refused, naming the types there are, for any other."""
    conversion = CONVERSIONS.get(type(config))
    if conversion is None:
        known = ", ".join(sorted(c.__name__ for c in CONVERSIONS)) or "none registered"
        raise HeadkitError(f"config must be a surgery config ({known}), got {type(config).__name__}")
    return conversion


def fields_of_record(config_class: type, entry: dict[str, Any]) -> dict[str, Any]:
    """The entries of a record that are fields of `config_class` (a dataclass): what its ``from_record`` builds the
    config from — a field the record predates takes its default, and what the op resolved beside the fields (its
    sites, layers, ranks) is left out."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {name: value for name, value in entry.items() if name in names}


_DEPRECATIONS_SAID: set[str] = set()


def say_deprecated(old: str, config_class: type) -> None:
    """Say once per process that `old` (a surgery's own entry point) gives way to ``headkit.apply_``."""
    if old in _DEPRECATIONS_SAID:
        return
    _DEPRECATIONS_SAID.add(old)
    warnings.warn(
        f"{old}(model, ...) is deprecated and will be removed in the next release: use "
        f"headkit.apply_(model, {config_class.__name__}(...))",
        FutureWarning,
        stacklevel=3,
    )


def config_after(model_config: Any, config: Any) -> Any:
    """A copy of a 🤗 `model_config` whose surgery record ends with `config`'s (what the checks of a later step
    read: e.g. the heads an earlier pruning removed)."""
    candidate = copy.copy(model_config)
    entries = list(getattr(model_config, SURGERY_KEY, None) or [])
    setattr(candidate, SURGERY_KEY, entries + [{"op": conversion_of(config).op} | config.record()])
    return candidate


def recorded_configs(model_or_config: Any) -> list[Any]:
    """The configs of the conversions recorded on a model (or in its 🤗 config), oldest first (entries of ops
    without a config, such as removing gates, are left out)."""
    config = getattr(model_or_config, "config", model_or_config)
    by_op = {c.op: c.config_class for c in CONVERSIONS.values()}
    return [
        by_op[entry["op"]].from_record(entry)
        for entry in getattr(config, SURGERY_KEY, None) or []
        if isinstance(entry, dict) and entry.get("op") in by_op
    ]


def recorded_surgery(model: nn.Module) -> list[dict[str, Any]]:
    """The surgery entries recorded on `model` (a copy), oldest first."""
    return copy.deepcopy(list(getattr(model.config, SURGERY_KEY, None) or []))


def record_surgery(model: nn.Module, entry: dict[str, Any]) -> None:
    """Append `entry` (``{"op": registered name, ...}``, JSON-serialisable) to ``model.config.headkit_surgery``."""
    if not isinstance(entry, dict) or entry.get("op") not in SURGERY_OPS:
        raise HeadkitError(
            f"a surgery entry must be a dict whose 'op' is a registered surgery op "
            f"({', '.join(sorted(SURGERY_OPS)) or 'none registered'}), got {entry!r}"
        )
    try:
        entry = json.loads(json.dumps(entry))
    except (TypeError, ValueError) as exc:
        raise HeadkitError(f"a surgery entry must be JSON-serialisable: {exc}") from None
    setattr(model.config, SURGERY_KEY, recorded_surgery(model) + [entry])


def config_in_place_of(config_class: type, argument: Any, config: Any) -> tuple[Any, Any]:
    """(argument, config) of an op that also takes its `config_class` config positionally, in `argument`'s place:
    such a config moves to `config` (refused when ``config=`` is given too)."""
    if isinstance(argument, config_class):
        if config is not None:
            raise HeadkitError("pass the config once (positionally or as config=), not both")
        return None, argument
    return argument, config


def given_config(
    config_class: type[ConfigT], config: Any, options: dict[str, Any], fields_given: Iterable[str] = ()
) -> ConfigT | None:
    """An op's ``config=``, checked to be a `config_class` given without its fields as keywords (`options`, and
    `fields_given`, the other arguments given that are fields); None where none was given (the op then builds its
    config from the keywords)."""
    if config is None:
        return None
    if not isinstance(config, config_class):
        raise HeadkitError(f"config must be a {config_class.__name__}, got {type(config).__name__}")
    given = sorted([*options, *fields_given])
    if given:
        raise HeadkitError(f"pass the options in the config or as keywords, not both: got {given}")
    return config
