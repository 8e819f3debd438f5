"""The record of surgery on a model: the ops that can be re-applied, and the entries in its config.

Every surgery op records itself in ``config.headkit_surgery`` (:func:`record_surgery`) and registers a *re-apply*
function (:func:`register_surgery_op`) that :func:`headkit.surgery.io.from_pretrained` calls to rebuild the same
structure on a freshly built model. The op modules import this module; the loader imports them.

An op takes its config as ``config=`` (some also in the place of a positional argument) or its fields as keywords,
not both: :func:`config_in_place_of` and :func:`given_config` check that once for every op.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

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
