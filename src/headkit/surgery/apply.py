"""One way to apply any surgery: ``headkit.apply_(model, config)``.

Every surgery has one frozen config (:class:`headkit.surgery.records.SurgeryConfig`: ``check``, ``record``,
``from_record``) and registers, beside it, the function that applies it (:func:`register_conversion`).
:func:`apply_` dispatches on the config's type — torchao's ``quantize_(model, Int8WeightOnlyConfig())`` is the
model: one entry point, one handler per config type — and a list of configs applies in order, each recorded in
``config.headkit_surgery``, so :func:`headkit.from_pretrained` replays the composition in the same order.

A composition is checked before any work: every config is of a registered type, every keyword reaches a step that
takes it, no step follows one that replaced the attention mechanism (collaborative, latent or linearized heads:
the others read the stock attention module) — but quantized storage may follow a compressed cache or a
linearization, once, as the last step — each step after the first against the model's 🤗 config as the steps
before it leave it (their records appended). What only a converted model's modules can answer is checked by each
step just before it runs.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

from torch import nn

# Each surgery module registers its config's conversion when imported.
import headkit.surgery.collaborative
import headkit.surgery.compressed_cache
import headkit.surgery.gating
import headkit.surgery.latent
import headkit.surgery.linearize
import headkit.surgery.pruning
import headkit.surgery.quantized_cache  # noqa: F401
from headkit.errors import HeadkitError
from headkit.surgery.gating import config_kv_bytes_per_token
from headkit.surgery.records import (
    CONVERSIONS,
    SURGERY_KEY,
    Conversion,
    config_after,
    conversion_of,
    recorded_configs,
)


def apply_(model: nn.Module, config: Any, **context: Any) -> Any:
    """Apply the surgery `config` describes to `model`, in place, and record it; return its report.

    Args:
        model: a 🤗 or headkit model the surgery supports.
        config: a surgery config (:class:`~headkit.surgery.PruneConfig`, :class:`~headkit.surgery.GateConfig`,
            :class:`~headkit.surgery.CollaborativeConfig`, :class:`~headkit.surgery.LatentKVConfig`,
            :class:`~headkit.surgery.LinearizeConfig`, :class:`~headkit.surgery.CompressedCacheConfig`,
            :class:`~headkit.surgery.QuantizedKVConfig`), or a list of them, applied in order.
        context: what a step needs beside its config, given to every step that takes it: ``adapter`` (the
            architecture's adapter), ``calibration`` and ``statistics`` (latent keys/values), ``generator``
            (Hard Concrete gates).

    Returns the step's report (:class:`~headkit.surgery.pruning.PruneReport`, …); for a list, the list of them.
    Raises :class:`HeadkitError`, before any work, for anything the checks above refuse.
    """
    configs = list(config) if isinstance(config, (list, tuple)) else [config]
    if not configs:
        raise HeadkitError("config must be a surgery config or a non-empty list of them, got an empty list")
    conversions = [conversion_of(step) for step in configs]
    _check_context(conversions, context)
    check_composition(configs)
    # The first step checks the model itself before it changes anything; the later ones are checked now.
    _check_later_steps(model.config, configs)
    reports = []
    for step, conversion in zip(configs, conversions, strict=True):
        given = {name: value for name, value in context.items() if name in conversion.context}
        reports.append(conversion.apply(model, step, **given))
    return reports if isinstance(config, (list, tuple)) else reports[0]


def check_steps(model_or_config: Any, configs: Sequence[Any]) -> None:
    """What :func:`apply_` checks of `configs` before any work, changing nothing: their order
    (:func:`check_composition`), the first step against the model (or its 🤗 config), each later one against the
    config the steps before it leave."""
    configs = list(configs)
    check_composition(configs)
    configs[0].check(model_or_config)
    _check_later_steps(
        model_or_config.config if isinstance(model_or_config, nn.Module) else model_or_config, configs
    )


def _check_later_steps(model_config: Any, configs: Sequence[Any]) -> None:
    """Each step after the first checked against the 🤗 config the steps before it leave."""
    simulated = model_config
    for previous, step in itertools.pairwise(configs):
        simulated = config_after(simulated, previous)
        step.check(simulated)


def check_composition(configs: Sequence[Any]) -> None:
    """Refuse, in one line, a sequence of surgeries that cannot be applied (or replayed) in that order: a step
    after one that replaced the attention mechanism (it would find no stock attention module to work on), unless
    the step's conversion names that one among those it follows (QuantizedKVConfig after a CompressedCacheConfig
    or a LinearizeConfig: it stores their keys and values) — and nothing after that step, which replaces the
    attention too."""
    for index, step in enumerate(configs[:-1]):
        if not conversion_of(step).replaces_attention:
            continue
        following = configs[index + 1]
        if isinstance(step, conversion_of(following).follows):
            continue
        later = ", ".join(type(c).__name__ for c in configs[index + 1 :])
        followers = [c.config_class.__name__ for c in CONVERSIONS.values() if isinstance(step, c.follows)]
        allowed = f" (or followed by {' or '.join(followers)} alone)" if followers else ""
        raise HeadkitError(
            f"config: {type(step).__name__} replaces the attention mechanism, so it must be the last step of a "
            f"composition{allowed}; got {later} after it"
        )


def bytes_per_token(
    model_config: Any, configs: Any = (), *, bytes_per_number: int = 2, context: int = 8192
) -> float | None:
    """The decoding cache's bytes per token of context of a model with the 🤗 `model_config`, after the surgeries
    it records and then `configs` (a config or a list, in order): the original's keys and values (2 · key/value
    heads · head width per layer, the pruning applied) until a step that changes the cache says what it keeps
    (its ``bytes_per_token``). `bytes_per_number`: 2 for bfloat16/float16 (what engines keep), 4 for float32;
    `context`: the sequence's length (a cache of constant size costs less per token of a longer one).
    None where the config does not state its widths, or a step replaces the attention without saying what it
    caches."""
    given = list(configs) if isinstance(configs, (list, tuple)) else [configs]
    steps = recorded_configs(model_config) + given
    check_composition(steps)
    current = copy.copy(model_config)
    setattr(current, SURGERY_KEY, [])
    value = config_kv_bytes_per_token(current, bytes_per_number)
    for step in steps:
        per_token, conversion = getattr(step, "bytes_per_token", None), conversion_of(step)
        if per_token is not None:
            value = per_token(current, bytes_per_number=bytes_per_number, context=context)
        elif conversion.bytes_per_token is not None:
            value = conversion.bytes_per_token(
                step, current, bytes_per_number=bytes_per_number, context=context
            )
        elif conversion.replaces_attention:
            value = None
        current = config_after(current, step)
    return value


def _check_context(conversions: list[Conversion], context: dict[str, Any]) -> None:
    accepted = set().union(*(conversion.context for conversion in conversions))
    unknown = sorted(set(context) - accepted)
    if unknown:
        raise HeadkitError(
            f"apply_ got keywords {unknown} that no step takes (they take: {', '.join(sorted(accepted)) or 'none'})"
        )


__all__ = ["apply_", "bytes_per_token", "check_composition", "check_steps"]
