"""Saving and reloading models that went through headkit surgery.

Surgery changes a model's structure (collaborative heads, gates, pruned heads) in ways its 🤗 config cannot
express, so ``save_pretrained`` alone writes weights that the stock loader cannot put back. Every surgery op
therefore records itself in ``config.headkit_surgery`` — a list of JSON entries ``{"op": name, ...}`` that
``save_pretrained`` writes to config.json — and registers a *re-apply* function that rebuilds the same
structure on a freshly built model. :func:`from_pretrained` builds the saved architecture, re-applies the
recorded entries in order and only then loads the weights, strictly.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.compat import checkpoint_key_renamer
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


def from_pretrained(
    path: str | Path, *, model_class: type | None = None, attn_implementation: str | None = None
) -> nn.Module:
    """Load a model saved with ``save_pretrained``, before or after headkit surgery, with identical outputs.

    Args:
        path: a local model directory (config.json + safetensors weights).
        model_class: the 🤗 class to build; by default the first of ``config.architectures``, else AutoModel.
        attn_implementation: e.g. "eager" or "sdpa"; by default what transformers picks.

    Returns the model in eval mode.
    """
    from transformers import AutoConfig, AutoModel

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise HeadkitError(f"path must be a model directory containing config.json, got {str(path)!r}")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    model_class = model_class or _architecture_class(config) or AutoModel
    entries = list(getattr(config, SURGERY_KEY, None) or [])
    load_options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if not entries:
        return model_class.from_pretrained(directory, local_files_only=True, **load_options).eval()

    for entry in entries:
        _reapply_function(entry)  # every op known before anything is built
    if hasattr(model_class, "from_config"):  # AutoModel
        model = model_class.from_config(config, **load_options)
    else:
        model = model_class(config)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        if isinstance(getattr(config, "dtype", None), torch.dtype):  # as from_config builds it
            model.to(config.dtype)
    for entry in entries:
        _reapply_function(entry)(model, copy.deepcopy(entry))
    _load_weights(model, directory)
    return model.eval()


def _architecture_class(config: Any) -> type | None:
    import transformers

    import headkit.models

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None) or getattr(headkit.models, name, None)
        if cls is not None:
            return cls
    return None


def _reapply_function(entry: Any) -> ReapplyFunction:
    if not isinstance(entry, dict) or "op" not in entry:
        raise HeadkitError(f"malformed {SURGERY_KEY} entry in config.json: {entry!r}")
    if entry["op"] not in SURGERY_OPS:
        importlib.import_module("headkit")  # registers every op headkit ships
    if entry["op"] not in SURGERY_OPS:
        raise HeadkitError(
            f"config.json records surgery op {entry['op']!r}, which no loaded module registers "
            f"(known: {', '.join(sorted(SURGERY_OPS))})"
        )
    return SURGERY_OPS[entry["op"]]


def _load_weights(model: nn.Module, directory: Path) -> None:
    from safetensors.torch import load_file

    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        shards = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        files = [directory / shard for shard in shards]
    else:
        files = [directory / "model.safetensors"]
    missing_files = [str(f) for f in files if not f.is_file()]
    if missing_files:
        raise HeadkitError(f"weights not found: {', '.join(missing_files)} (save with save_pretrained)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(_model_keys(model, state), strict=False)
    # save_pretrained leaves out tied copies (e.g. an LM head tied to the embeddings): a name may be missing only
    # when another name of the same tensor was loaded.
    model.tie_weights()
    missing_set = set(missing)
    untied_missing = [
        name
        for group in _parameter_groups(model)
        if all(member in missing_set for member in group)
        for name in group
    ]
    if untied_missing or unexpected:
        raise HeadkitError(
            f"the saved weights do not fit the rebuilt model: missing {untied_missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def _model_keys(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with checkpoint names mapped to the model's own: ``save_pretrained`` writes some architectures
    (e.g. ViT) under their legacy names, which transformers' loader renames back; the same renaming applies here to
    every name the model does not know."""
    expected = model.state_dict()
    if state.keys() <= expected.keys():
        return state
    rename = checkpoint_key_renamer(model)
    if rename is None:  # a transformers without conversion mappings saves the model's own names
        return state
    renamed = {}
    for key, tensor in state.items():
        if key not in expected:
            key, needs_conversion = rename(key, expected)
            if needs_conversion:
                raise HeadkitError(
                    f"checkpoint tensor {key!r} needs a tensor conversion that headkit cannot replay"
                )
        renamed[key] = tensor
    return renamed


def _parameter_groups(model: nn.Module) -> list[list[str]]:
    """Names of each distinct parameter or buffer of `model`, grouped by tensor (tied names share a group)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(buffer), []).append(name)
    return list(groups.values())
