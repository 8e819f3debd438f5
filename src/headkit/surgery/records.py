"""The record of surgery on a model: the ops that can be re-applied, and the entries in its config.

Every surgery op records itself in ``config.headkit_surgery`` (:func:`record_surgery`) and registers a *re-apply*
function (:func:`register_surgery_op`) that :func:`headkit.surgery.io.from_pretrained` calls to rebuild the same
structure on a freshly built model. The op modules import this module; the loader imports them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from torch import nn

from headkit.errors import HeadkitError

SURGERY_KEY = "headkit_surgery"

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
