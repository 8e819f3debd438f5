"""A GGUF file's 🤗 config from its metadata alone, in milliseconds: what a recipe's checks read before anything
is loaded.

transformers reads a GGUF file's config through ``gguf.GGUFReader``, which builds a numpy view of every metadata
value — on SmolLM2-135M, 98k tokenizer strings and merges — before it maps the few it needs: 5.1 s of a 6.4 s
config read (measured 2026-11-29), longer than the whole check it serves. Here the header is read directly (the
GGUF layout: magic, version, tensor and key/value counts, then each key with its typed value), skipping over every
array of more than :data:`KEPT_ARRAY_LENGTH` elements (only its length is kept), and the scalars, the short arrays,
the vocabulary's length and which output tensor exists are written to a small GGUF file that
``AutoConfig.from_pretrained(gguf_file=...)`` reads — transformers' own mapping from GGUF keys to config fields,
applied to the few keys it maps.
"""

from __future__ import annotations

import mmap
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
# struct formats of GGUF's scalar value types (gguf.GGUFValueType's numbering), little-endian
SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
STRING, ARRAY = 8, 9
# Arrays longer than this (the tokenizer's tokens, scores, merges) are skipped; shorter ones (per-layer head
# counts, rope sections) are kept whole.
KEPT_ARRAY_LENGTH = 1024
# The tensor whose presence says the LM head is not tied to the embeddings (transformers reads it the same way).
OUTPUT_TENSOR = "output.weight"


@dataclass
class GGUFMetadata:
    """A GGUF file's key/value metadata: scalars and short arrays as (GGUF value type, value), long arrays as
    their element type and length, and the tensors' names."""

    values: dict[str, tuple[int, Any]] = field(default_factory=dict)
    array_lengths: dict[str, tuple[int, int]] = field(default_factory=dict)
    tensor_names: list[str] = field(default_factory=list)


class _Cursor:
    def __init__(self, data: Any) -> None:
        self.data, self.offset = data, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.offset + length > len(self.data):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.data[self.offset : self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return text

    def skip_string(self) -> None:
        length = self.unpack("<Q")  # read first: it moves the offset past the length
        self.offset += length

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind in SCALAR_FORMATS:
            return self.unpack(SCALAR_FORMATS[kind])
        raise ValueError(f"unknown GGUF value type {kind}")

    def skip(self, kind: int, count: int) -> None:
        if kind == STRING:
            for _ in range(count):
                self.skip_string()
        elif kind in SCALAR_FORMATS:
            self.offset += struct.calcsize(SCALAR_FORMATS[kind]) * count
        else:
            raise ValueError(f"an array of GGUF value type {kind} cannot be skipped")


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """The metadata of the GGUF file at `path` (versions 2 and 3), reading only its header. Raises ValueError (or
    struct.error) for a file that is not GGUF or is cut short."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if bytes(data[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        cursor.offset = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        metadata = GGUFMetadata()
        for _ in range(kv_count):
            key, kind = cursor.string(), cursor.unpack("<I")
            if kind != ARRAY:
                metadata.values[key] = (kind, cursor.value(kind))
                continue
            element, length = cursor.unpack("<I"), cursor.unpack("<Q")
            if length > KEPT_ARRAY_LENGTH or element == ARRAY:
                cursor.skip(element, length)
                metadata.array_lengths[key] = (element, length)
            else:
                metadata.values[key] = (ARRAY, (element, [cursor.value(element) for _ in range(length)]))
        for _ in range(tensor_count):
            metadata.tensor_names.append(cursor.string())
            dims = cursor.unpack("<I")
            cursor.offset += 8 * dims + 4 + 8  # the dimensions, the type, the data offset
        return metadata


def gguf_config(path: str | Path) -> Any:
    """The 🤗 config transformers builds from the GGUF file at `path`, built from its metadata alone: the scalars
    and short arrays, the vocabulary's length (where no ``{arch}.vocab_size`` states it) and the output tensor's
    presence (the tied LM head) are written to a small GGUF file that ``AutoConfig`` reads."""
    import numpy as np
    from gguf import GGUFValueType, GGUFWriter
    from transformers import AutoConfig

    metadata = read_gguf_metadata(path)
    architecture = metadata.values.get("general.architecture", (None, None))[1]
    if not isinstance(architecture, str):
        raise ValueError(f"{path}: no general.architecture in its metadata")
    with tempfile.TemporaryDirectory(prefix="headkit-gguf-") as folder:
        small = Path(folder) / "metadata.gguf"
        writer = GGUFWriter(small, architecture)  # writes general.architecture itself
        for key, (kind, value) in metadata.values.items():
            if key == "general.architecture":
                continue
            if kind == ARRAY:
                element, items = value
                writer.add_key_value(key, items, GGUFValueType.ARRAY, sub_type=GGUFValueType(element))
            else:
                writer.add_key_value(key, value, GGUFValueType(kind))
        vocab_key = f"{architecture}.vocab_size"
        if vocab_key not in metadata.values and "tokenizer.ggml.tokens" in metadata.array_lengths:
            writer.add_key_value(
                vocab_key, metadata.array_lengths["tokenizer.ggml.tokens"][1], GGUFValueType.UINT32
            )
        if OUTPUT_TENSOR in metadata.tensor_names:
            writer.add_tensor(OUTPUT_TENSOR, np.zeros(1, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        config = AutoConfig.from_pretrained(folder, gguf_file=small.name, local_files_only=True)
    config._name_or_path = str(Path(path).parent)  # where transformers' own reading says it came from
    return config


__all__ = ["GGUFMetadata", "gguf_config", "read_gguf_metadata"]
