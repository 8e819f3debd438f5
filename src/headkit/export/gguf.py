"""Export a causal LM — stock, or after headkit's head pruning — to a GGUF file that llama.cpp runs.

The file follows the GGUF specification (ggml's ``docs/gguf.md``: a key/value header, tensor infos, aligned
tensor data) and llama.cpp's conventions for each architecture, as its own ``convert_hf_to_gguf.py`` writes them.
Writing, tensor names and quantization are the ``gguf`` package's (:class:`gguf.GGUFWriter`,
:func:`gguf.get_tensor_name_map`, :func:`gguf.quants.quantize`); this module decides what goes in.

What is exported, and as which llama.cpp architecture:

* a result whose layers all keep the same query and key/value heads, grouped evenly, is written as its own
  family's architecture (``llama`` — Mistral too, as llama.cpp's converter writes it —, ``qwen2``, ``qwen3``,
  ``gemma2``, ``gemma3``, ``phi3``) with the head counts it has now, whatever its config says (a pruned model
  that was not turned back into the stock architecture still records the original counts);
* a LLaMA result with different heads per layer is written as ``deci`` (llama.cpp's architecture for DeciLM and
  Nemotron-NAS), whose ``attention.head_count`` / ``attention.head_count_kv`` are per-layer arrays; a layer pruned
  to no heads is a layer with 0 of both, which llama.cpp runs without attention (nor its norm).

llama.cpp runs grouped-query attention with equal groups: query head h of a layer reads key/value head
⌊h / (n_head / n_head_kv)⌋. After uneven pruning a layer's groups may be unequal (say 3 query heads on one
key/value head and 1 on another; headkit stores which key/value head each query head reads in the buffer
``headkit_kv_head_index``). The export makes them equal instead of refusing: the query heads are reordered so
that each key/value head's readers are contiguous (a permutation of the query rows and the output projection's
columns, which changes nothing computed), and each key/value head is written c / g times, where c is the number
of its readers and g the greatest common divisor of those numbers, which is the largest equal group size
possible. Duplicating parameters costs file size and KV cache (reported in
:attr:`ExportReport.extra_kv_cache_bytes_per_token`) but never accuracy; refusing would make the most useful
pruning results — those that keep the important query heads wherever they are — impossible to deploy.
Duplication is the default because it adds no query work; where the KV cache matters more (long contexts:
with SmolLM2's groups of 3, removing one head of a group makes the counts 3, 3, 2, whose gcd is 1, so the
layer's 3 key/value heads become 8), ``uneven_groups="pad"`` instead fills every group up to the largest with
zero query heads: their output-projection columns are zero, so they add exactly nothing, and the KV cache
stays at the key/value heads the model reads.

The tokenizer comes from the source: copied field by field from a GGUF input (``tokenizer.*``: model, pre-tokenizer,
tokens, types, merges, special token ids, chat template), converted from a 🤗 byte-level BPE tokenizer otherwise
(``tokenizer.ggml.model = "gpt2"``, the pre-tokenizer named from the tokenizer's own pre-tokenizer definition,
merges, special tokens and chat template through :class:`gguf.SpecialVocab`).

Linearized, collaborative and additive models have no llama.cpp architecture and are refused in one line, as
are models still carrying head gates, encoders and families without a mapping. Not exported yet, each refused
in one line: rotary scaling other than plain (``rope_type`` llama3, linear, yarn), 🤗 tokenizers other than
byte-level BPE (SentencePiece: export from a GGUF input, whose tokenizer is copied), and per-layer head counts
outside the LLaMA and Phi-3 families (llama.cpp's qwen2/qwen3/gemma2/gemma3 read one count for all
layers). Phi-3 with fewer query heads than its width is written as llama or deci, its fused projections split:
llama.cpp's phi3 graph sizes its projections by the hidden width.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.files import record_write
from headkit.surgery.adapters import get_adapter
from headkit.surgery.io import SURGERY_KEY
from headkit.surgery.pruning import query_to_kv_heads

GGUF_INSTALL_HINT = "pip install gguf"

# --type: (llama.cpp's general.file_type, the tensor type of the 2-D weights). 1-D tensors (norms) stay float32,
# as llama.cpp's converter keeps them: they are tiny and ggml's norm kernels read them in float32.
EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0")
DEFAULT_TYPE = "f16"

# Surgery that has no llama.cpp architecture: the heads no longer compute softmax attention over slices of the
# stock projections.
UNEXPORTABLE_OPS = {
    "linearize": "linearized attention",
    "collaborative": "collaborative heads",
    "gates": "head gates (fold them first: headkit.remove_head_gates(model, fold=True))",
}
# headkit's own models (model_type "headkit": additive and other mechanisms) have no mapping in MAPPINGS.


@dataclass(frozen=True)
class _Mapping:
    """How a 🤗 model_type becomes a llama.cpp architecture.

    uneven_arch: the llama.cpp architecture of a result with different heads per layer, if any.
    narrow_arch: the architecture of a uniform result whose query heads no longer fill the hidden width, where
        the family's own graph assumes they do (llama.cpp's phi3 sizes its projections n_embd × n_embd); Phi-3
        is LLaMA's computation with fused projections, so it is written as llama with them split.

    Whether query and key rows are permuted follows from the architecture written (:data:`PAIRED_ROTARY`).
    norm_shift: added to every RMSNorm weight: Gemma's norms scale by (1 + weight), llama.cpp's by the weight.
    """

    arch: str
    uneven_arch: str | None = None
    narrow_arch: str | None = None
    norm_shift: float = 0.0


MAPPINGS: dict[str, _Mapping] = {
    "llama": _Mapping("llama", uneven_arch="deci"),
    # Mistral is LLaMA's graph (llama.cpp's converter writes it as llama); its sliding window is handled by
    # capping the context (see _context_length).
    "mistral": _Mapping("llama", uneven_arch="deci"),
    "qwen2": _Mapping("qwen2"),
    "qwen3": _Mapping("qwen3"),
    "gemma2": _Mapping("gemma2", norm_shift=1.0),
    "gemma3_text": _Mapping("gemma3", norm_shift=1.0),
    "phi3": _Mapping("phi3", uneven_arch="deci", narrow_arch="llama"),
}
# llama.cpp's ``llama``/``deci`` graphs rotate adjacent pairs (ggml's "normal" rope mode) while 🤗 rotates the two
# halves of each head (``rotate_half``), so their query and key rows are reordered (as ``LlamaModel.permute`` in
# llama.cpp's converter does); the other graphs use the NeoX (halves) mode and take the rows as they are.
PAIRED_ROTARY = ("llama", "deci")
# Fused 🤗 projections written as llama.cpp's separate tensors where the architecture has no fused one.
FUSED_SPLITS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def exportable_families() -> str:
    """A one-line list of what can be exported, for refusals."""
    return (
        f"causal LMs of the families {', '.join(sorted(MAPPINGS))} (stock, or after head pruning; uneven "
        "LLaMA pruning as deci)"
    )


@dataclass
class ExportReport:
    """What :func:`export_gguf` wrote.

    heads / kv_heads: per layer, the query and key/value heads in the file (kv_heads includes duplicates made to
    equalize groups, heads the zero heads padded in); kv_heads_read: the distinct key/value heads the model
    reads; extra_kv_cache_bytes_per_token: what the duplicates add to llama.cpp's KV cache per token of context,
    at its default float16 cache; padded_query_heads: zero query heads written per layer.
    """

    source: str
    out: Path
    arch: str
    type: str
    heads: list[int]
    kv_heads: list[int]
    kv_heads_read: list[int]
    head_dim: int
    extra_kv_cache_bytes_per_token: int
    tensors: int
    file_bytes: int
    tokenizer: str
    uneven_layers: list[int] = field(default_factory=list)
    padded_query_heads: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"out": str(self.out)}

    def __str__(self) -> str:
        lines = [
            f"wrote {self.out} ({self.file_bytes:,} bytes): llama.cpp architecture {self.arch}, {self.type}, "
            f"{self.tensors} tensors, {len(self.heads)} layers; tokenizer {self.tokenizer}"
        ]
        if len(set(self.heads)) == 1 and len(set(self.kv_heads)) == 1:
            lines.append(f"  {self.heads[0]} query heads, {self.kv_heads[0]} key/value heads per layer")
        else:
            lines.append(f"  query heads per layer {self.heads}; key/value heads {self.kv_heads}")
        if any(self.padded_query_heads):
            lines.append(
                f"  layers {self.uneven_layers} had unequal query groups: padded with zero query heads "
                f"{self.padded_query_heads}, no extra KV cache"
            )
        elif self.uneven_layers:
            lines.append(
                f"  layers {self.uneven_layers} had unequal query groups: key/value heads duplicated to "
                f"equalize them, +{self.extra_kv_cache_bytes_per_token:,} bytes of float16 KV cache per token"
            )
        return "\n".join(lines)


# -- the plan of one attention layer -------------------------------------------------------------------------


@dataclass
class _LayerPlan:
    """One layer as written: query heads in `query_order` (indices into the module's heads), key/value heads
    `kv_order` (indices into the module's key/value heads, repeated where duplicated)."""

    query_order: list[int | None]
    kv_order: list[int]
    kv_read: int

    @property
    def padded(self) -> int:
        return sum(h is None for h in self.query_order)

    @property
    def heads(self) -> int:
        return len(self.query_order)

    @property
    def kv_heads(self) -> int:
        return len(self.kv_order)

    @property
    def duplicated(self) -> bool:
        return self.kv_heads != self.kv_read or self.padded > 0


def plan_layer(kv_index: list[int], uneven_groups: str = "duplicate") -> _LayerPlan:
    """Equal groups for a layer whose query head h reads key/value head ``kv_index[h]``, readers made
    contiguous. "duplicate": each key/value head repeated (its readers / g) times, g the gcd of the readers'
    counts. "pad": every group filled up to the largest with zero query heads (None in ``query_order``)."""
    if not kv_index:
        return _LayerPlan([], [], 0)
    kv_heads = sorted(set(kv_index))
    readers = {kv: [h for h, k in enumerate(kv_index) if k == kv] for kv in kv_heads}
    if uneven_groups == "pad":
        group = max(len(r) for r in readers.values())
        query_order = [h for kv in kv_heads for h in readers[kv] + [None] * (group - len(readers[kv]))]
        return _LayerPlan(query_order, list(kv_heads), len(kv_heads))
    group = math.gcd(*(len(r) for r in readers.values()))
    query_order = [h for kv in kv_heads for h in readers[kv]]
    kv_order = [kv for kv in kv_heads for _ in range(len(readers[kv]) // group)]
    return _LayerPlan(query_order, kv_order, len(kv_heads))


def _rows(weight: torch.Tensor, order: list[int | None], head_dim: int) -> torch.Tensor:
    """The rows of heads `order` (each `head_dim` rows), in that order; None: a head of zeros."""
    heads = torch.cat(
        [weight.reshape(-1, head_dim, *weight.shape[1:]), weight.new_zeros(1, head_dim, *weight.shape[1:])]
    )
    index = torch.tensor([len(heads) - 1 if h is None else h for h in order], dtype=torch.long)
    return heads[index].reshape(len(order) * head_dim, *weight.shape[1:])


def _rotary_pairs(weight: torch.Tensor, heads: int, rotary: int | None = None) -> torch.Tensor:
    """Reorder each head's rows from 🤗's rotate-half layout (first half, second half) to llama.cpp's adjacent
    pairs: row i of the first half and row i of the second half become rows 2i and 2i + 1. With `rotary` set
    (partial rotary: only each head's first `rotary` rows rotate) the rest of each head stays as it is."""
    if heads == 0:
        return weight
    shape = weight.shape
    per_head = weight.reshape(heads, shape[0] // heads, *shape[1:])
    rotary = per_head.shape[1] if rotary is None else rotary
    rotated = per_head[:, :rotary].reshape(heads, 2, rotary // 2, *shape[1:]).transpose(1, 2)
    rotated = rotated.reshape(heads, rotary, *shape[1:])
    return torch.cat([rotated, per_head[:, rotary:]], dim=1).reshape(shape)


# -- inputs ----------------------------------------------------------------------------------------------------


def _require_gguf() -> Any:
    if importlib.util.find_spec("gguf") is None:
        raise HeadkitError(f"export needs the gguf package ({GGUF_INSTALL_HINT})")
    import gguf

    return gguf


def check_export_target(
    model_path: str | os.PathLike[str], out: str | os.PathLike[str], type: str, overwrite: bool
) -> None:
    """Everything :func:`export_gguf` can check before a recipe's work: the type, the target file, and that the
    model at `model_path` (folder or GGUF file) is of a family with a llama.cpp mapping."""
    gguf = _require_gguf()
    _check_type(type)
    model_path, out = Path(model_path), Path(out)
    _check_out(out, model_path, overwrite)
    if model_path.is_file():
        field = gguf.GGUFReader(model_path).fields.get("general.architecture")
        model_type = field.contents() if field is not None else None
        known: dict[str, str] = {}
        for name, mapping in MAPPINGS.items():  # llama files come back as llama, not mistral
            known.setdefault(mapping.arch, name)
        model_type = known.get(model_type, model_type)
    else:
        try:
            model_type = json.loads((model_path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            model_type = None
    if model_type not in MAPPINGS:
        raise HeadkitError(
            f"--export-gguf: MODEL is a {model_type!r} model, which has no llama.cpp mapping here; can export: "
            f"{exportable_families()}"
        )


def _check_out(out: Path, source: Path | None, overwrite: bool) -> None:
    if out.suffix != ".gguf":
        raise HeadkitError(f"--gguf must name a .gguf file, got {str(out)!r}")
    if source is not None and out.resolve() == source.resolve():
        raise HeadkitError(f"--gguf {str(out)!r} is the input model; choose another file")
    if source is not None and source.is_dir() and out.resolve().is_relative_to(source.resolve()):
        raise HeadkitError(f"--gguf {str(out)!r} lies inside the input model folder; choose another place")
    if out.is_dir():
        raise HeadkitError(f"--gguf {str(out)!r} is a folder; name a .gguf file")
    if out.exists() and not overwrite:
        raise HeadkitError(f"--gguf {str(out)!r} exists; pass --overwrite to replace it")
    if not isinstance(overwrite, bool):
        raise HeadkitError(f"overwrite must be a bool, got {overwrite!r}")


def _check_type(type: str) -> str:
    if type not in EXPORT_TYPES:
        raise HeadkitError(f"--type must be one of {', '.join(EXPORT_TYPES)}, got {type!r}")
    return type


def _check_exportable(model: nn.Module) -> tuple[_Mapping, Any]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    ops = {str(entry.get("op")) for entry in (getattr(config, SURGERY_KEY, None) or [])} - {"gates"}
    # Gates still on the model (recorded, and not removed since) scale heads in a way no GGUF key states.
    if any(name.split(".")[-1] == "head_gate" for name, _ in model.named_modules()):
        ops.add("gates")
    for op, what in UNEXPORTABLE_OPS.items():
        if op in ops:
            raise HeadkitError(
                f"MODEL runs {what}, which llama.cpp has no architecture for; can export: "
                f"{exportable_families()}"
            )
    if model_type not in MAPPINGS:
        raise HeadkitError(
            f"MODEL is a {model_type!r} model, which has no llama.cpp mapping here; can export: "
            f"{exportable_families()}"
        )
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise HeadkitError(f"MODEL is an encoder (no LM head); can export: {exportable_families()}")
    return MAPPINGS[model_type], config


def _load(model_path_or_model: Any, tokenizer: Any) -> tuple[nn.Module, Any, Path | None]:
    from headkit.runs.models import CAUSAL_LM, load_model, model_kind

    if isinstance(model_path_or_model, nn.Module):
        if tokenizer is None:
            raise HeadkitError("exporting a model object needs its tokenizer (tokenizer=...)")
        return model_path_or_model, tokenizer, None
    if not isinstance(model_path_or_model, (str, os.PathLike)):
        raise HeadkitError(f"MODEL must be a path or a model, got {type(model_path_or_model).__name__}")
    path = Path(model_path_or_model)
    if not path.exists():
        raise HeadkitError(f"MODEL {str(path)!r} does not exist")
    if model_kind(path) != CAUSAL_LM:
        raise HeadkitError(f"MODEL {str(path)!r} is an encoder; can export: {exportable_families()}")
    loaded = load_model(path, kind=CAUSAL_LM, dtype="float32")
    return loaded.model, tokenizer if tokenizer is not None else loaded.tokenizer, path


# -- metadata --------------------------------------------------------------------------------------------------


def _rope_theta(config: Any, kind: str = "full_attention") -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get(kind, rope)
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise HeadkitError(
            f"MODEL uses rope_type {rope_type!r}; the export writes plain rotary (rope_type 'default') only"
        )
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _write_hparams(
    writer: Any,
    gguf: Any,
    config: Any,
    arch: str,
    plans: list[_LayerPlan],
    head_dim: int,
    file_type: Any,
    uniform: bool,
) -> None:
    """The hyperparameter keys llama.cpp reads (``{arch}.context_length``, ``.embedding_length``, …)."""
    hidden = int(config.hidden_size)
    writer.add_block_count(len(plans))
    writer.add_context_length(context_length(config, arch))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config.intermediate_size))
    if uniform:
        writer.add_head_count(plans[0].heads)
        writer.add_head_count_kv(plans[0].kv_heads)
    else:
        writer.add_head_count([plan.heads for plan in plans])
        writer.add_head_count_kv([plan.kv_heads for plan in plans])
    # llama.cpp derives the head width as embedding_length / head_count unless key_length says otherwise; a
    # pruned model keeps its width with fewer heads, and deci's per-layer counts give it no single quotient.
    if not uniform or plans[0].heads * head_dim != hidden:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(_rotary_dims(config, head_dim))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_file_type(file_type)
    if arch in ("gemma2", "gemma3"):
        _write_gemma_hparams(writer, config, arch, head_dim)


def context_length(config: Any, arch: str) -> int:
    """The context written for llama.cpp. Its ``llama`` and ``phi3`` graphs attend over the whole context, so a
    Mistral or Phi-3 config with a sliding window shorter than its context is written with the window as its
    context: within it the two attentions are the same, beyond it llama.cpp would silently differ."""
    context = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if arch in ("llama", "phi3") and window:
        return min(context, int(window))
    return context


def _rotary_dims(config: Any, head_dim: int) -> int:
    """Rotated dimensions per head: all of them, or Phi-3's ``partial_rotary_factor`` of them (the first ones,
    halves rotated together, as llama.cpp's NeoX mode does over its first ``rope_dimension_count``)."""
    factor = float((getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0))
    factor = float(getattr(config, "partial_rotary_factor", factor) or factor)
    return int(head_dim * factor)


def _write_gemma_hparams(writer: Any, config: Any, arch: str, head_dim: int) -> None:
    """Gemma 2's and 3's extras: sliding-window layers, soft-caps, and (Gemma 3) the sliding layers' own rotary
    base. llama.cpp scales scores by head_dim^-1/2 (1/sqrt(n_embd_head_k)); 🤗 by query_pre_attn_scalar^-1/2.
    llama.cpp's gemma2 slides on every even layer (a fixed pattern); gemma3 reads the pattern per layer."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap and arch == "gemma3":
        raise HeadkitError("MODEL soft-caps attention logits, which llama.cpp's gemma3 does not")
    if softcap:
        writer.add_attn_logit_softcapping(float(softcap))
    if float(getattr(config, "query_pre_attn_scalar", head_dim)) != float(head_dim):
        raise HeadkitError(
            f"MODEL scales attention by query_pre_attn_scalar={config.query_pre_attn_scalar}, llama.cpp's "
            f"{arch} by the head width {head_dim}"
        )
    layer_types = list(getattr(config, "layer_types", None) or [])
    if arch == "gemma2":
        alternating = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(layer_types))
        ]
        if layer_types != alternating:
            raise HeadkitError(
                f"MODEL's layer_types {layer_types} are not Gemma 2's alternation (sliding on even layers), the "
                "only pattern llama.cpp's gemma2 runs"
            )
        writer.add_sliding_window(int(config.sliding_window))
    elif "sliding_attention" in layer_types:
        writer.add_sliding_window(int(config.sliding_window))
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])
        writer.add_rope_freq_base_swa(_rope_theta(config, "sliding_attention"))
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def _copy_gguf_tokenizer(writer: Any, gguf: Any, source: Path) -> str:
    """Copy every ``tokenizer.*`` key of the source GGUF as it is (same value types)."""
    reader = gguf.GGUFReader(source)
    for name, value in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        main = value.types[0]
        sub = value.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value.contents(), main, sub_type=sub)
    model = reader.fields.get("tokenizer.ggml.model")
    return f"copied from {source.name} ({model.contents() if model else 'no tokenizer.ggml.model'})"


# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre, llama-vocab.cpp) for the byte-level BPE pre-tokenizers
# headkit can recognise from their 🤗 definition: the split regex decides how text is cut before BPE merges.
_LLAMA3_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def _pre_tokenizer_name(definition: dict[str, Any]) -> str | None:
    """llama.cpp's name for a 🤗 byte-level pre-tokenizer, or None when it is not one headkit knows."""
    pre = definition.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"  # every digit on its own, then GPT-2's split
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        return {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}.get(regex)
    return None


def _convert_hf_tokenizer(writer: Any, gguf: Any, tokenizer: Any, vocab_size: int) -> str:
    """A 🤗 byte-level BPE tokenizer as llama.cpp's ``gpt2`` tokenizer model: tokens by id (ids the vocabulary
    lacks are unused padding, as llama.cpp's converter writes them), their types, the pre-tokenizer's name, and
    through :class:`gguf.SpecialVocab` the merges, special token ids, add-BOS/EOS flags and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise HeadkitError("the tokenizer is not a 🤗 fast tokenizer; export from a GGUF or a tokenizer.json")
    definition = json.loads(backend.to_str())
    if (definition.get("model") or {}).get("type") != "BPE":
        raise HeadkitError(
            f"the tokenizer is a {(definition.get('model') or {}).get('type')!r} tokenizer; the export converts "
            "byte-level BPE tokenizers (or copies a GGUF input's)"
        )
    pre = _pre_tokenizer_name(definition)
    if pre is None:
        raise HeadkitError(
            "the tokenizer's pre-tokenizer is not one headkit can name for llama.cpp (gpt-2, smollm, llama-bpe, "
            "qwen2); export from a GGUF input to copy its tokenizer"
        )
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise HeadkitError(
            f"the tokenizer has ids up to {max(vocab.values())}, beyond the model's {vocab_size}"
        )
    by_id = {index: token for token, index in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory(prefix="headkit-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)  # SpecialVocab reads tokenizer.json and tokenizer_config.json
        gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
    # Whether llama.cpp adds BOS/EOS when asked for special tokens: as the 🤗 tokenizer does, measured (its
    # config may not say, and llama.cpp's default for gpt2 vocabularies need not match).
    ids = tokenizer("a")["input_ids"]
    flags = {
        gguf.Keys.Tokenizer.ADD_BOS: tokenizer.bos_token_id is not None
        and ids[:1] == [tokenizer.bos_token_id],
        gguf.Keys.Tokenizer.ADD_EOS: tokenizer.eos_token_id is not None
        and ids[-1:] == [tokenizer.eos_token_id],
    }
    for key, value in flags.items():
        writer.kv_data[0].pop(
            key, None
        )  # SpecialVocab's value, if it wrote one, is replaced without a warning
        writer.add_bool(key, value)
    return f"converted from 🤗 (gpt2 BPE, pre-tokenizer {pre})"


# -- tensors ---------------------------------------------------------------------------------------------------


def _tensor_type(gguf: Any, type: str, name: str, data: np.ndarray) -> Any:
    quant = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        return quant.F32
    return {"f32": quant.F32, "f16": quant.F16, "bf16": quant.BF16, "q8_0": quant.Q8_0}[type]


def _file_type(gguf: Any, type: str) -> Any:
    kinds = gguf.LlamaFileType
    return {
        "f32": kinds.ALL_F32,
        "f16": kinds.MOSTLY_F16,
        "bf16": kinds.MOSTLY_BF16,
        "q8_0": kinds.MOSTLY_Q8_0,
    }[type]


def _add_tensor(
    writer: Any, gguf: Any, type: str, name: str, tensor: torch.Tensor, shift: float = 0.0
) -> None:
    data = (tensor.detach().to(torch.float32) + shift).cpu().numpy()
    qtype = _tensor_type(gguf, type, name, data)
    try:
        packed = gguf.quants.quantize(data, qtype)
    except gguf.QuantError:  # rows not a multiple of the block size (32 for q8_0): float16 instead
        qtype = gguf.GGMLQuantizationType.F16
        packed = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, packed, raw_dtype=qtype)


def _layer_tensors(
    site: Any, plan: _LayerPlan, head_dim: int, permute: bool, rotary: int, split: bool
) -> dict[str, torch.Tensor]:
    """The attention projections of one layer as written: reordered, duplicated and (for llama/deci) permuted
    to llama.cpp's rotary pairs over the first `rotary` rows of each head; a fused projection split when
    `split`. Keys are the 🤗 names relative to the attention module."""
    out: dict[str, torch.Tensor] = {}
    for name, parameter in site.module.named_parameters():
        data = parameter.detach()
        projection = name.split(".")[0]
        if projection == "q_proj":
            data = _rows(data, plan.query_order, head_dim)
            data = _rotary_pairs(data, plan.heads, rotary) if permute else data
        elif projection == "k_proj":
            data = _rows(data, plan.kv_order, head_dim)
            data = _rotary_pairs(data, plan.kv_heads, rotary) if permute else data
        elif projection == "v_proj":
            data = _rows(data, plan.kv_order, head_dim)
        elif projection == "qkv_proj":  # Phi-3's fused rows: queries, keys, values
            query, key, value = data.split(
                [len(data) - 2 * plan.kv_read * head_dim, *[plan.kv_read * head_dim] * 2]
            )
            query = _rows(query, plan.query_order, head_dim)
            key, value = _rows(key, plan.kv_order, head_dim), _rows(value, plan.kv_order, head_dim)
            if permute:
                query = _rotary_pairs(query, plan.heads, rotary)
                key = _rotary_pairs(key, plan.kv_heads, rotary)
            if split:
                suffix = name.removeprefix(projection)
                out.update(
                    {
                        f"{part}{suffix}": t
                        for part, t in zip(FUSED_SPLITS[projection], (query, key, value), strict=True)
                    }
                )
                continue
            data = torch.cat([query, key, value])
        elif projection == "o_proj" and name.endswith("weight"):
            data = _rows(data.t(), plan.query_order, head_dim).t()
        out[name] = data
    return out


def _plans(model: nn.Module, uneven_groups: str) -> tuple[list[Any], list[_LayerPlan], int]:
    adapter = get_adapter(model)
    sites = adapter.sites(model)
    widths = {site.head_dim for site in sites}
    if len(widths) != 1:
        raise HeadkitError(f"MODEL has heads of widths {sorted(widths)}; llama.cpp needs one width")
    plans = []
    for site in sites:
        if site.num_heads == 0:
            if any(True for _ in site.module.parameters()):
                raise HeadkitError(
                    f"layer {site.index} has no heads but keeps an output bias; llama.cpp's deci "
                    "layers without heads have no attention tensors"
                )
            plans.append(_LayerPlan([], [], 0))
        else:
            plans.append(plan_layer(query_to_kv_heads(site), uneven_groups))
    return sites, plans, widths.pop()


def export_gguf(
    model_path_or_model: str | os.PathLike[str] | nn.Module,
    out: str | os.PathLike[str],
    *,
    type: str = DEFAULT_TYPE,
    overwrite: bool = False,
    tokenizer: Any = None,
    uneven_groups: str = "duplicate",
    tokenizer_from: str | os.PathLike[str] | None = None,
) -> ExportReport:
    """Write MODEL as a GGUF file that llama.cpp loads.

    Args:
        model_path_or_model: a model folder (a headkit result or a stock 🤗 causal LM), a GGUF file, or a model
            object (then `tokenizer` is required).
        out: the .gguf file to write; written to a temporary file beside it and moved into place, so an
            interrupted export never leaves a partial file.
        type: "f32", "f16", "bf16" or "q8_0" for the 2-D weights (``gguf``'s own quantizers); norms stay f32.
        overwrite: replace an existing `out`.
        tokenizer: the tokenizer to write (default: the model's own; a GGUF input's is copied from the file).
        uneven_groups: how a layer's unequal grouped-query groups are made equal (see the module docstring):
            "duplicate" key/value heads (the default: no extra query work, more KV cache), or "pad" each group
            with zero query heads up to the largest (no extra KV cache, extra query work; a zero query head
            with a zero output-projection column adds exactly nothing).
        tokenizer_from: a GGUF file whose tokenizer keys are copied (a model object pruned from a GGUF input).

    Returns:
        an :class:`ExportReport`. Unsupported models, an existing `out` without `overwrite`, or `out` equal to
        the input raise :class:`~headkit.errors.HeadkitError` before anything is written.
    """
    gguf = _require_gguf()
    type = _check_type(type)
    if uneven_groups not in ("duplicate", "pad"):
        raise HeadkitError(f"--uneven-groups must be 'duplicate' or 'pad', got {uneven_groups!r}")
    out = Path(out)
    source = Path(model_path_or_model) if isinstance(model_path_or_model, (str, os.PathLike)) else None
    _check_out(out, source, overwrite)
    model, tokenizer, source = _load(model_path_or_model, tokenizer)
    mapping, config = _check_exportable(model)
    sites, plans, head_dim = _plans(model, uneven_groups)
    layers = int(config.num_hidden_layers)
    if len(sites) != layers or [site.layers for site in sites] != [(i,) for i in range(layers)]:
        raise HeadkitError("MODEL's attention layers do not match config.num_hidden_layers")
    shapes = {(plan.heads, plan.kv_heads) for plan in plans}
    uniform = len(shapes) == 1 and 0 not in shapes.pop()
    narrow = plans[0].heads * head_dim != int(config.hidden_size)
    if uniform and narrow and mapping.narrow_arch is not None:
        arch = mapping.narrow_arch
    elif uniform:
        arch = mapping.arch
    elif mapping.uneven_arch is not None:
        arch = mapping.uneven_arch
    else:
        raise HeadkitError(
            f"MODEL ({config.model_type}) has different heads per layer; llama.cpp runs that only for the LLaMA "
            "family (deci). Prune uniformly (headkit prune --uniform) to export it"
        )
    if arch in PAIRED_ROTARY and _rotary_dims(config, head_dim) != head_dim:
        raise HeadkitError(
            f"MODEL rotates {_rotary_dims(config, head_dim)} of its {head_dim} head dimensions; pruned "
            f"{config.model_type} is written as llama.cpp's {arch}, which rotates all of them. Prune it uniformly "
            "with full-width query heads kept, or export it unpruned"
        )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp_name, arch)
        if source is not None:
            writer.add_name(source.stem if source.is_file() else source.name)
        _write_hparams(writer, gguf, config, arch, plans, head_dim, _file_type(gguf, type), uniform)
        if tokenizer_from is not None:
            tokenizer_note = _copy_gguf_tokenizer(writer, gguf, Path(tokenizer_from))
        elif source is not None and source.is_file():
            tokenizer_note = _copy_gguf_tokenizer(writer, gguf, source)
        else:
            tokenizer_note = _convert_hf_tokenizer(writer, gguf, tokenizer, int(config.vocab_size))
        count = _write_tensors(writer, gguf, model, sites, plans, head_dim, mapping, arch, names, type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp_name, 0o666 & ~_umask())
        os.replace(tmp_name, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    record_write(out)
    extra = sum((plan.kv_heads - plan.kv_read) for plan in plans) * head_dim * 2 * 2  # K and V, float16
    return ExportReport(
        source=str(source) if source is not None else model.__class__.__name__,
        out=out,
        arch=arch,
        type=type,
        heads=[plan.heads for plan in plans],
        kv_heads=[plan.kv_heads for plan in plans],
        kv_heads_read=[plan.kv_read for plan in plans],
        head_dim=head_dim,
        extra_kv_cache_bytes_per_token=extra,
        tensors=count,
        file_bytes=out.stat().st_size,
        tokenizer=tokenizer_note,
        uneven_layers=[i for i, plan in enumerate(plans) if plan.duplicated],
        padded_query_heads=[plan.padded for plan in plans],
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_tensors(
    writer: Any,
    gguf: Any,
    model: nn.Module,
    sites: list[Any],
    plans: list[_LayerPlan],
    head_dim: int,
    mapping: _Mapping,
    arch: str,
    names: Any,
    type: str,
) -> int:
    """Every parameter under its llama.cpp name; the LM head only when it is not tied to the embeddings
    (llama.cpp then reads ``token_embd.weight`` for the output, as its loader falls back to it). Fused
    projections are split when `arch` is not the family's own (Phi-3 written as llama or deci)."""
    attention = {site.name: (site, plan) for site, plan in zip(sites, plans, strict=True)}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    embeddings = model.get_input_embeddings().weight
    count = 0
    done: set[str] = set()
    permute, split = arch in PAIRED_ROTARY, arch != mapping.arch
    rotary = _rotary_dims(model.config, head_dim)
    for module_name, (site, plan) in attention.items():
        done.update(f"{module_name}.{name}" for name, _ in site.module.named_parameters())
        if plan.heads == 0:
            continue  # deci: a layer without heads has no attention tensors and no attention norm
        for name, data in _layer_tensors(site, plan, head_dim, permute, rotary, split).items():
            full = f"{module_name}.{name}"
            _add_tensor(writer, gguf, type, _gguf_name(names, full), data, _shift(mapping, full))
            count += 1
    empty_norms = {
        f"model.layers.{i}.input_layernorm.weight" for i, plan in enumerate(plans) if plan.heads == 0
    }
    for full, parameter in model.named_parameters():
        if full in done or full in empty_norms:
            continue
        if full.endswith("lm_head.weight") and (tied or parameter is embeddings):
            continue
        fused = full.split(".")[-2]
        if split and fused in FUSED_SPLITS:  # Phi-3's gate_up_proj: gate rows first, then up
            parts = parameter.detach().chunk(len(FUSED_SPLITS[fused]))
            for part, data in zip(FUSED_SPLITS[fused], parts, strict=True):
                name = full.replace(f".{fused}.", f".{part}.")
                _add_tensor(writer, gguf, type, _gguf_name(names, name), data, _shift(mapping, name))
                count += 1
            continue
        _add_tensor(writer, gguf, type, _gguf_name(names, full), parameter, _shift(mapping, full))
        count += 1
    return count


def _shift(mapping: _Mapping, name: str) -> float:
    return mapping.norm_shift if name.endswith("norm.weight") else 0.0


def _gguf_name(names: Any, full: str) -> str:
    name = names.get_name(full, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise HeadkitError(
            f"MODEL has a parameter {full!r} that llama.cpp's architecture has no tensor for; "
            f"can export: {exportable_families()}"
        )
    return name
