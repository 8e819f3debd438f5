"""Heads as a 🤗 config states them and as a config names them, without a model: ``{layer: [heads]}`` validated
(:func:`layer_heads`, :func:`check_layer_heads`), parsed from the command line (:func:`parse_layer_heads`), and
each layer's query heads, key/value groups and cache bytes from a config with the pruning it records applied.

No torch model code: the configs of pruning and gates (and the command line's options drawn from them) stand on
this module before any model is built; :mod:`headkit.surgery.gating` and :mod:`headkit.surgery.pruning` use it on
models.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable, Mapping
from typing import Any

from headkit.errors import HeadkitError
from headkit.surgery.records import SURGERY_KEY

# The ops whose entries say whether a model's config records head gates still on it (gating's).
GATES_OP = "gates"
REMOVE_GATES_OP = "remove_gates"


# ``{layer: [head indices]}`` as a config holds it: ((layer, (head, …)), …), layers and heads sorted.
LayerHeads = tuple[tuple[int, tuple[int, ...]], ...]


def layer_heads(argument: str, heads: Any) -> LayerHeads:
    """Validate ``{site index: [head indices]}`` without a model: a mapping (or its items, a tuple of ``(layer,
    heads)`` pairs, as a config holds it), every index a non-negative integer (a recorded plan's string keys read
    as integers), no layer named twice. Returns ((layer, (head, …)), …), heads sorted and de-duplicated; the
    ranges are the model's (:func:`check_layer_heads`)."""
    if isinstance(heads, tuple) and all(isinstance(item, tuple) and len(item) == 2 for item in heads):
        items = list(heads)
    elif isinstance(heads, Mapping):
        items = list(heads.items())
    else:
        raise HeadkitError(
            f"{argument} must be a mapping {{layer: [head indices]}}, got {type(heads).__name__}"
        )
    checked: dict[int, tuple[int, ...]] = {}
    for layer, heads_of_layer in items:
        layer_index = _as_index(argument, "layer index", layer)
        if layer_index < 0:
            raise HeadkitError(f"{argument} names layer {layer!r}, out of range: layer indices are ≥ 0")
        if layer_index in checked:
            raise HeadkitError(f"{argument} names layer {layer_index} twice")
        if isinstance(heads_of_layer, (str, bytes)) or not isinstance(heads_of_layer, Iterable):
            raise HeadkitError(
                f"{argument}[{layer!r}] must be an iterable of head indices, got {type(heads_of_layer).__name__}"
            )
        indices = set()
        for head in heads_of_layer:
            head_index = _as_index(argument, f"head index of layer {layer_index}", head)
            if head_index < 0:
                raise HeadkitError(
                    f"{argument}[{layer_index}] holds head {head!r}, out of range: head indices are ≥ 0"
                )
            indices.add(head_index)
        checked[layer_index] = tuple(sorted(indices))
    return tuple(sorted(checked.items()))


def check_layer_heads(argument: str, heads: LayerHeads, counts: list[int]) -> dict[int, list[int]]:
    """Check validated ``heads`` (:func:`layer_heads`) against the query heads of each site (`counts`); returns
    ``{site index: [head indices]}``."""
    checked: dict[int, list[int]] = {}
    for layer, heads_of_layer in heads:
        if layer >= len(counts):
            raise HeadkitError(
                f"{argument} names layer {layer!r}, out of range: the model has {len(counts)} attention layers "
                f"(0 … {len(counts) - 1})"
            )
        num_heads = counts[layer]
        outside = [head for head in heads_of_layer if head >= num_heads]
        if outside:
            raise HeadkitError(
                f"{argument}[{layer}] holds head {outside[0]!r}, out of range: layer {layer} has {num_heads} "
                f"heads (0 … {num_heads - 1})"
            )
        checked[layer] = list(heads_of_layer)
    return checked


def config_head_counts(config: Any) -> list[int] | None:
    """The query heads of each attention site as a model's 🤗 config states them, the pruning it records applied
    (what :meth:`AttentionAdapter.sites` finds once the model is built); None where the config does not say
    (a model without ``num_attention_heads`` / ``num_hidden_layers``)."""
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if getattr(config, "model_type", None) == "albert":
        # every layer runs the AlbertLayers of its group: one site per distinct layer
        layers = getattr(config, "num_hidden_groups", 1) * getattr(config, "inner_group_num", 1)
    if any(isinstance(value, bool) or not isinstance(value, int) or value < 0 for value in (heads, layers)):
        return None
    counts = [heads] * layers
    for entry in getattr(config, SURGERY_KEY, None) or []:
        # pruning's entries (headkit.surgery.pruning.PRUNE_OP): the heads each named layer lost
        if isinstance(entry, dict) and entry.get("op") == "prune":
            for index, removed in (entry.get("heads") or {}).items():
                if 0 <= int(index) < layers:
                    counts[int(index)] -= len(removed)
    return counts


def config_head_dim(config: Any) -> int | None:
    """The width of one attention head as a 🤗 config states it (``head_dim``, else hidden / heads)."""
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def kv_head_counts(config: Any) -> list[int] | None:
    """The key/value heads each layer keeps as a 🤗 config states them, the pruning it records applied: a
    key/value head stays while a query head of its group does; None where the config does not state its heads."""
    groups = config_query_groups(config)
    return None if groups is None else [len(set(layer)) for layer in groups]


def config_kv_bytes_per_token(config: Any, bytes_per_number: int = 2) -> int | None:
    """The stock key/value cache's bytes per token of a model with the 🤗 `config`, the pruning it records applied:
    a key and a value of head_dim numbers per key/value head and layer; None where the config does not say."""
    counts, head_dim = kv_head_counts(config), config_head_dim(config)
    return None if counts is None or head_dim is None else 2 * sum(counts) * head_dim * bytes_per_number


def config_query_groups(config: Any) -> list[list[int]] | None:
    """Per layer, the key/value group of each query head still there, as a 🤗 config states them with the pruning
    it records applied (query head h reads key/value head h // (H / G); each pruning entry indexes the heads as it
    found them); None where the config does not state its heads."""
    heads = config_head_counts(config)
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    total = getattr(config, "num_attention_heads", None)
    if heads is None or not isinstance(kv, int) or not isinstance(total, int) or kv <= 0 or total % kv:
        return None
    group = total // kv
    groups = [[head // group for head in range(total)] for _ in heads]
    for entry in getattr(config, SURGERY_KEY, None) or []:
        if isinstance(entry, dict) and entry.get("op") == "prune":
            for index, removed in (entry.get("heads") or {}).items():
                layer = int(index)
                if 0 <= layer < len(groups):
                    gone = set(removed)
                    groups[layer] = [g for h, g in enumerate(groups[layer]) if h not in gone]
    return groups


def config_prunes_unevenly(config: Any) -> list[int]:
    """The layers whose recorded pruning leaves their key/value groups with unequal numbers of query heads (the
    layer then gathers key/value heads per query head: no stock grouping expresses it)."""
    groups = config_query_groups(config) or []
    return [i for i, layer in enumerate(groups) if len(set(collections.Counter(layer).values())) > 1]


def config_records_gates(config: Any) -> bool:
    """Whether a model's 🤗 config records head gates still on it (:func:`add_head_gates` last, not undone by
    :func:`remove_head_gates`)."""
    entries = [entry for entry in getattr(config, SURGERY_KEY, None) or [] if isinstance(entry, dict)]
    gating = [entry["op"] for entry in entries if entry.get("op") in (GATES_OP, REMOVE_GATES_OP)]
    return bool(gating) and gating[-1] == GATES_OP


def parse_head_pairs(flag: str, text: str) -> tuple[tuple[int, int], ...]:
    """``"0:1,0:2,3:0"`` → ((0, 1), (0, 2), (3, 0)): (layer, head) pairs from the command line, in order."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        layer, separator, head = (part.strip() for part in item.partition(":"))
        if not separator or not layer.isdigit() or not head.isdigit():
            raise HeadkitError(
                f"{flag} must be layer:head pairs of non-negative integers (e.g. '0:1,3:0'), got {text!r}"
            )
        pairs.append((int(layer), int(head)))
    return tuple(pairs)


def parse_layer_heads(flag: str, text: str) -> LayerHeads:
    """``"0:1,0:2,3:0"`` → ((0, (1, 2)), (3, (0,))): layer:head pairs from the command line, grouped by layer."""
    grouped: dict[int, list[int]] = {}
    for layer, head in parse_head_pairs(flag, text):
        grouped.setdefault(layer, []).append(head)
    return layer_heads(flag, grouped)


def _as_index(argument: str, what: str, value: Any) -> int:
    # bool is an int, but True as a layer or head index is a mistake, not 1.
    if isinstance(value, bool):
        raise HeadkitError(f"{argument}: {what} must be an int, got {value!r}")
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)  # JSON keys (a recorded plan) are strings
    try:
        return operator.index(value)
    except TypeError:
        raise HeadkitError(f"{argument}: {what} must be an int, got {value!r}") from None


# -- pruning's refusals, on a model or its config -----------------------------------------------------------


def refuse_ungated() -> None:
    raise HeadkitError("the model has no head gates; call headkit.add_head_gates(model) and train them first")


def check_not_emptied(layer: int, pruned: list[int], allow_empty_layers: bool) -> None:
    """Refuse pruning every head of `layer` (`pruned`) unless `allow_empty_layers`."""
    if not allow_empty_layers:
        raise HeadkitError(
            f"pruning heads {pruned} removes every head of layer {layer}; pass allow_empty_layers=True to "
            "allow it (the layer's attention then adds only its output projection's bias)"
        )
