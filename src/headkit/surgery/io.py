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
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Each op module registers its re-apply function(s) when imported: import them all, so that every op headkit
# ships can be loaded (the ops import the record, headkit.surgery.records, not this loader).
import headkit.models  # noqa: F401  (headkit's model types with the Auto classes, which a reload may need)
import headkit.surgery.collaborative
import headkit.surgery.compressed_cache
import headkit.surgery.gating
import headkit.surgery.latent
import headkit.surgery.linearize
import headkit.surgery.pruning
import headkit.surgery.quantized_cache  # noqa: F401
from headkit.compat import checkpoint_key_renamer
from headkit.errors import HeadkitError
from headkit.surgery.records import (
    SURGERY_KEY,
    SURGERY_OPS,
    ReapplyFunction,
    record_surgery,
    recorded_surgery,
    register_surgery_op,
)

# Bytes of saved tensors a reload reads before copying them into the model (a larger tensor is read alone).
LOAD_BYTES = 256 * 1024**2


def from_pretrained(
    path: str | Path,
    *,
    model_class: type | None = None,
    attn_implementation: str | None = None,
    dtype: str | torch.dtype | None = None,
    device_map: str | torch.device | dict[str, Any] | None = None,
) -> nn.Module:
    """Load a model saved with ``save_pretrained``, before or after headkit surgery, with identical outputs.

    Args:
        path: a local model directory (config.json + safetensors weights, one file or shards).
        model_class: the 🤗 class to build; by default the first of ``config.architectures``, else AutoModel.
        attn_implementation: e.g. "eager" or "sdpa"; by default what transformers picks.
        dtype: e.g. ``torch.bfloat16`` or "bfloat16"; None: transformers' default for a model without surgery,
            the saved dtype (``config.dtype``) for one after surgery.
        device_map: where the weights go. Without surgery it is transformers' ``device_map`` (a device, "auto", a
            per-module map). After surgery the model is rebuilt from its config: one device (e.g. "cpu",
            "cuda:0", ``{"": "cuda:0"}``), which every shard is loaded onto.

    After surgery the model is built (in `dtype`), the recorded surgery re-applied, and the weights loaded shard
    by shard: at most one shard's tensors are held besides the model. Returns the model in eval mode.
    """
    from transformers import AutoConfig, AutoModel

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise HeadkitError(f"path must be a model directory containing config.json, got {str(path)!r}")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    model_class = model_class or _architecture_class(config) or AutoModel
    entries = list(getattr(config, SURGERY_KEY, None) or [])
    load_options: dict[str, Any] = (
        {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    )
    if dtype is not None:
        load_options["dtype"] = dtype
    if not entries:
        if device_map is not None:
            load_options["device_map"] = device_map
        return model_class.from_pretrained(directory, local_files_only=True, **load_options).eval()

    device = _single_device(device_map)
    for entry in entries:
        _reapply_function(entry)  # every op known before anything is built
    build_dtype = _torch_dtype(dtype if dtype is not None else getattr(config, "dtype", None))
    if hasattr(model_class, "from_config"):  # AutoModel
        model = model_class.from_config(config, **load_options)
    else:
        model = model_class(config)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
    for entry in entries:
        _reapply_function(entry)(model, copy.deepcopy(entry))
    if build_dtype is not None:  # the built model and what the re-applied ops added, as from_config builds it
        model.to(build_dtype)
    if device is not None:
        model.to(device)
    _load_weights(model, directory)
    return model.eval()


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    """`dtype` as a torch dtype: a torch dtype, or its name ("bfloat16", "torch.float32"); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(resolved, torch.dtype):
        raise HeadkitError(f"dtype must be a torch dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
    return resolved


def _single_device(device_map: Any) -> torch.device | None:
    """The one device a model rebuilt after surgery is loaded onto (None: where it is built, the CPU)."""
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map is None or isinstance(device_map, torch.device):
        return device_map
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    if isinstance(device_map, str) and device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        try:
            return torch.device(device_map)
        except RuntimeError:
            pass
    raise HeadkitError(
        f"a model saved after headkit surgery loads onto one device (e.g. 'cpu', 'cuda:0' or {{'': 'cuda:0'}}), "
        f"got device_map={device_map!r}"
    )


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
        raise HeadkitError(
            f"config.json records surgery op {entry['op']!r}, which no loaded module registers "
            f"(known: {', '.join(sorted(SURGERY_OPS))})"
        )
    return SURGERY_OPS[entry["op"]]


def _load_weights(model: nn.Module, directory: Path) -> None:
    """Load the safetensors weights in `directory` into `model`, a few tensors at a time (at most
    :data:`LOAD_BYTES` of them, or one larger tensor): each piece is read, copied into the model's tensors and
    released before the next is read, so loading holds the model and one piece, not the model and a whole file."""
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        shards = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        files = [directory / shard for shard in shards]
    else:
        files = [directory / "model.safetensors"]
    missing_files = [str(f) for f in files if not f.is_file()]
    if missing_files:
        raise HeadkitError(f"weights not found: {', '.join(missing_files)} (save with save_pretrained)")
    expected = model.state_dict()  # the model's names (compat's renamer reads it as a mapping)
    device = next(iter(model.parameters()), torch.empty(0)).device
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        for piece in _read_pieces(file, device):
            piece = _model_keys(model, piece, expected)
            result = model.load_state_dict(piece, strict=False)
            loaded.update(piece.keys() - set(result.unexpected_keys))
            unexpected += result.unexpected_keys
            del piece, result  # released before the next piece is read
    # save_pretrained leaves out tied copies (e.g. an LM head tied to the embeddings): a name may be missing only
    # when another name of the same tensor was loaded.
    model.tie_weights()
    missing_set = expected.keys() - loaded
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


def _read_pieces(file: Path, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of one safetensors file, on `device`, in pieces of at most :data:`LOAD_BYTES` (a larger tensor
    alone), each read through a handle of its own: a handle maps the file, and the pages its reads touch stay
    resident until it closes (one handle for the whole file held the file's size again at its end: a 1B model's
    reload check 4.6 GB)."""
    from safetensors import safe_open

    for names in _pieces_of(file):
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            piece = {name: handle.get_tensor(name) for name in names}
        yield piece


def _pieces_of(file: Path) -> list[list[str]]:
    """The tensor names of a safetensors file in file order, grouped in pieces of at most :data:`LOAD_BYTES` (a
    larger tensor alone), from its header (an 8-byte length, then JSON with each tensor's byte range)."""
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    ranges = sorted((entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__")
    pieces: list[list[str]] = []
    size = 0
    for (start, end), name in ranges:
        if not pieces or (pieces[-1] and size + end - start > LOAD_BYTES):
            pieces.append([])
            size = 0
        pieces[-1].append(name)
        size += end - start
    return pieces


def _model_keys(
    model: nn.Module, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`state` with checkpoint names mapped to the model's own (`expected`): ``save_pretrained`` writes some
    architectures (e.g. ViT) under their legacy names, which transformers' loader renames back; the same renaming
    applies here to every name the model does not know."""
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


__all__ = [
    "SURGERY_KEY",
    "SURGERY_OPS",
    "ReapplyFunction",
    "from_pretrained",
    "record_surgery",
    "recorded_surgery",
    "register_surgery_op",
]
