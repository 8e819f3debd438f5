"""Text for training headkit language models: corpora, the byte-level tokenizer, token streams and batches.

* :func:`load_corpus` reads a text file, a directory of text files, or, by default, the embedded corpus: the
  running Python's standard-library source files (``sysconfig.get_paths()["stdlib"]``), present on every machine
  with nothing to download. Documents are split into a training and a held-out part deterministically: a
  document is held out when the CRC-32 of its relative path falls in the held-out fraction, so the split depends
  on the file names only (never on the order files are listed or on a seed); a single file is split by lines,
  its last lines held out.
* :class:`ByteTokenizer` maps UTF-8 bytes to ids 0–255 plus three special tokens (pad 256, bos 257, eos 258), so
  any text is representable and bits per byte are exact. It saves itself as a stock ``tokenizer.json`` that
  ``transformers.AutoTokenizer.from_pretrained`` loads with nothing from headkit and that encodes and decodes
  alike. Any 🤗 tokenizer saved locally works too (:func:`load_tokenizer`).
* :func:`encode_corpus` concatenates a split's documents into one token stream, documents separated by the
  end-of-sequence token; :func:`sample_batch` draws training windows from it and :func:`evaluation_windows`
  cuts it into non-overlapping windows for held-out evaluation.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headkit.errors import HeadkitError
from headkit.ops._validation import check_positive_int

BYTE_VOCAB = 256
PAD_ID, BOS_ID, EOS_ID = BYTE_VOCAB, BYTE_VOCAB + 1, BYTE_VOCAB + 2
# headkit's own description of the byte tokenizer, written before tokenizer.json replaced it; still read.
TOKENIZER_FILE = "headkit_byte_tokenizer.json"
HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
SPECIAL_TOKENS = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID}
# tokenizer_config.json of the byte tokenizer, beside its class. Text is bytes: "<eos>" typed in a prompt is five
# bytes, never the special token (split_special_tokens), and decoding returns the bytes' text untouched.
_TRANSFORMERS_SETTINGS = {
    "pad_token": "<pad>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "split_special_tokens": True,
    "clean_up_tokenization_spaces": False,
}
# Folders of the standard library that hold installed third-party packages or caches, not the library itself.
_STDLIB_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Buckets of the CRC-32 split: a document is held out when crc32(name) % _SPLIT_BUCKETS < fraction · buckets.
_SPLIT_BUCKETS = 10_000


class ByteTokenizer:
    """Byte-level tokenizer: the UTF-8 bytes of the text as ids 0–255, then pad (256), bos (257), eos (258).

    ``vocab_size`` is 259. Decoding skips the special tokens and replaces invalid UTF-8 (a window may cut a
    multi-byte character). :meth:`save_pretrained` writes it as 🤗 files (``tokenizer.json``,
    ``tokenizer_config.json``), so a model folder carries a tokenizer that ``AutoTokenizer`` loads.
    """

    vocab_size = BYTE_VOCAB + 3
    pad_token_id, bos_token_id, eos_token_id = PAD_ID, BOS_ID, EOS_ID

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, no special tokens."""
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """:meth:`encode` as an int32 tensor, without a Python list per byte (fast for megabytes of text)."""
        data = bytearray(text.encode("utf-8"))
        if not data:
            return torch.empty(0, dtype=torch.int32)
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.int32)

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Text of the byte ids (special tokens dropped, or kept as <pad>/<bos>/<eos> when not skipped)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        names = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}
        pieces, run = [], bytearray()
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"ids must be in [0, {self.vocab_size}) for the byte tokenizer, got {token}")
            if token < BYTE_VOCAB:
                run.append(token)
                continue
            if not skip_special_tokens:
                pieces.append(run.decode("utf-8", errors="replace"))
                pieces.append(names[token])
                run = bytearray()
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    @staticmethod
    def backend() -> Any:
        """The same tokenizer as a ``tokenizers.Tokenizer``, built from stock parts only: the ``ByteLevel``
        pre-tokenizer writes each UTF-8 byte of the text as one character of GPT-2's byte alphabet (without its
        word-splitting regex or a prefix space), a BPE model without merges maps byte character b to id b, and
        the ``ByteLevel`` decoder turns the characters back into bytes and decodes them, replacing invalid
        UTF-8 exactly as :meth:`decode` does. The special tokens are added tokens 256–258."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        tokenizer = Tokenizer(models.BPE(vocab=_byte_level_vocabulary(), merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(
            [AddedToken(name, special=True, normalized=False) for name in SPECIAL_TOKENS]
        )
        return tokenizer

    def to_transformers(self) -> Any:
        """This tokenizer as the ``PreTrainedTokenizerFast`` that ``AutoTokenizer`` loads from what
        :meth:`save_pretrained` writes (for 🤗 code that calls a tokenizer: ``generate`` streamers, pipelines)."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self.backend(), **_TRANSFORMERS_SETTINGS)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (created if needed), which
        ``transformers.AutoTokenizer.from_pretrained(directory)`` loads as a ``PreTrainedTokenizerFast`` that
        encodes and decodes like this tokenizer. Returns the path of ``tokenizer.json``."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / HF_TOKENIZER_FILE
        self.backend().save(str(path))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **_TRANSFORMERS_SETTINGS}
        (folder / HF_TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> ByteTokenizer:
        """The byte tokenizer saved in ``directory``: its ``tokenizer.json``, or the ``headkit_byte_tokenizer.json``
        that older headkit versions wrote."""
        folder = Path(directory)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            if is_byte_tokenizer_folder(folder):
                return cls()
            raise HeadkitError(
                f"{str(folder)!r} holds no byte tokenizer (a byte-level {HF_TOKENIZER_FILE} or {TOKENIZER_FILE})"
            )
        try:
            description = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise HeadkitError(f"cannot read a byte tokenizer from {str(folder)!r}: {exc}") from None
        if description.get("type") != "bytes" or description.get("vocab_size") != cls.vocab_size:
            raise HeadkitError(f"{str(path)!r} does not describe headkit's byte tokenizer: {description}")
        return cls()


def _byte_level_vocabulary() -> dict[str, int]:
    """GPT-2's byte alphabet (the ``ByteLevel`` pre-tokenizer's): printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order; character of byte b -> id b, then the special tokens."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [byte for byte in range(BYTE_VOCAB) if byte not in printable]
    characters = {byte: chr(byte) for byte in printable} | {
        byte: chr(BYTE_VOCAB + rank) for rank, byte in enumerate(others)
    }
    return {characters[byte]: byte for byte in range(BYTE_VOCAB)} | SPECIAL_TOKENS


def is_byte_tokenizer_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds headkit's byte tokenizer: a ``tokenizer.json`` that :meth:`ByteTokenizer.backend`
    wrote (its vocabulary, byte-level pre-tokenizer and decoder), or the older ``headkit_byte_tokenizer.json``."""
    folder = Path(folder)
    if (folder / TOKENIZER_FILE).is_file():
        return True
    try:
        description = json.loads((folder / HF_TOKENIZER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(description, dict):
        return False
    model, added = description.get("model") or {}, description.get("added_tokens") or []
    return (
        model.get("type") == "BPE"
        and model.get("vocab") == _byte_level_vocabulary()
        and not model.get("merges")
        and (description.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
        and (description.get("decoder") or {}).get("type") == "ByteLevel"
        and {token.get("content"): token.get("id") for token in added} == SPECIAL_TOKENS
    )


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """The byte tokenizer (``path`` None, or a folder that :meth:`ByteTokenizer.save_pretrained` wrote, in this
    version's format or the older one), or the 🤗 tokenizer saved in the local folder ``path`` (never
    downloaded)."""
    if path is None:
        return ByteTokenizer()
    folder = Path(path)
    if not folder.is_dir():
        raise HeadkitError(f"--tokenizer must be a folder holding a saved tokenizer, got {str(folder)!r}")
    if is_byte_tokenizer_folder(folder):
        return ByteTokenizer.from_pretrained(folder)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise HeadkitError(f"cannot load a tokenizer from {str(folder)!r}: {exc}") from None


# --- corpora ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """One text of a corpus; ``name`` is its path relative to the corpus root (what the split hashes)."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """A corpus split into training and held-out documents."""

    source: str
    train: tuple[Document, ...]
    held_out: tuple[Document, ...]

    def num_bytes(self, split: str) -> int:
        """UTF-8 bytes of the ``"train"`` or ``"held_out"`` documents."""
        return sum(len(document.text.encode("utf-8")) for document in self._split(split))

    def _split(self, split: str) -> tuple[Document, ...]:
        if split not in ("train", "held_out"):
            raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
        return self.train if split == "train" else self.held_out

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "train_documents": len(self.train),
            "held_out_documents": len(self.held_out),
            "train_bytes": self.num_bytes("train"),
            "held_out_bytes": self.num_bytes("held_out"),
        }


def stdlib_directory() -> Path:
    """The running Python's standard-library folder (the embedded corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    held_out_fraction: float = 0.05,
    max_bytes: int | None = None,
) -> Corpus:
    """Read a corpus and split it deterministically into training and held-out documents.

    Args:
        path: a UTF-8 text file, a JSON Lines file (``*.jsonl``, one object with a ``"text"`` field per line,
            each a document), a directory (every file that decodes as UTF-8 text, recursively; hidden files
            and folders skipped), or None for the standard-library ``*.py`` files of the running Python.
        held_out_fraction: share of documents (of lines, for a single file) held out, in (0, 1).
        max_bytes: stop reading once this many bytes are collected (files in sorted path order); None = all.

    Raises:
        FileNotFoundError: ``path`` does not exist. HeadkitError: no text found, or too little to split.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise HeadkitError(f"held_out_fraction must be in (0, 1), got {held_out_fraction!r}")
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
    ):
        raise HeadkitError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")

    if path is None:
        root = stdlib_directory()
        files = _text_files(root, suffix=".py", skipped_dirs=_STDLIB_SKIPPED_DIRS)
        source = f"Python {sysconfig.get_python_version()} standard library ({root})"
    else:
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"corpus {str(root)!r} does not exist")
        if root.is_file() and root.suffix == ".jsonl":
            return _jsonl_corpus(root, held_out_fraction, max_bytes)
        if root.is_file():
            text = _read_text(root)
            if text is None or not text.strip():
                raise HeadkitError(f"corpus file {str(root)!r} is not UTF-8 text, or is empty")
            if max_bytes is not None:
                text = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
            return _split_single_file(root.name, text, held_out_fraction, source=str(root))
        files = _text_files(root, suffix=None, skipped_dirs=set())
        source = str(root)

    documents, collected = [], 0
    for file in files:
        text = _read_text(file)
        if text is None or not text.strip():
            continue
        if max_bytes is not None:
            remaining = max_bytes - collected
            text = text.encode("utf-8")[:remaining].decode("utf-8", errors="ignore")
        documents.append(Document(file.relative_to(root).as_posix(), text))
        collected += len(text.encode("utf-8"))
        if max_bytes is not None and collected >= max_bytes:
            break
    if not documents:
        raise HeadkitError(f"no UTF-8 text found in corpus {source!r}")
    return _split_documents(source, documents, held_out_fraction)


def _jsonl_corpus(path: Path, fraction: float, max_bytes: int | None) -> Corpus:
    """Documents from a JSON Lines file: line i's ``"text"`` is document ``name:i`` (what the split hashes)."""
    documents, collected = [], 0
    try:
        # Not splitlines(): JSON strings may hold U+2028, U+2029 or U+0085 unescaped; only "\n" ends a record.
        lines = path.read_text(encoding="utf-8").split("\n")
    except (UnicodeDecodeError, OSError) as exc:
        raise HeadkitError(f"corpus {str(path)!r} cannot be read as UTF-8 text ({exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise HeadkitError(f"corpus {str(path)!r}, line {number}: not a JSON object") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise HeadkitError(
                f'corpus {str(path)!r}, line {number}: expected an object with a "text" string'
            )
        if not text.strip():
            continue
        documents.append(Document(f"{path.name}:{number}", text))
        collected += len(text.encode("utf-8"))
        if max_bytes is not None and collected >= max_bytes:
            break
    if not documents:
        raise HeadkitError(f'corpus {str(path)!r} holds no non-empty "text"')
    return _split_documents(str(path), documents, fraction)


def _split_documents(source: str, documents: list[Document], fraction: float) -> Corpus:
    """Whole documents to each side by the hash of their names; a lone document is split by its lines."""
    if len(documents) == 1:
        return _split_single_file(documents[0].name, documents[0].text, fraction, source=source)
    held_out = [d for d in documents if _held_out(d.name, fraction)]
    train = [d for d in documents if not _held_out(d.name, fraction)]
    # Small corpora may draw no document (or every one) for a side: move the one whose hash is closest.
    if not held_out:
        moved = min(train, key=lambda d: _bucket(d.name))
        train.remove(moved)
        held_out.append(moved)
    elif not train:
        moved = max(held_out, key=lambda d: _bucket(d.name))
        held_out.remove(moved)
        train.append(moved)
    return Corpus(source, tuple(train), tuple(held_out))


def _bucket(name: str) -> int:
    return zlib.crc32(name.encode("utf-8")) % _SPLIT_BUCKETS


def _held_out(name: str, fraction: float) -> bool:
    return _bucket(name) < fraction * _SPLIT_BUCKETS


def _split_single_file(name: str, text: str, fraction: float, *, source: str) -> Corpus:
    lines = text.splitlines(keepends=True)
    if len(lines) < 2:
        raise HeadkitError(f"corpus {source!r} has fewer than 2 lines: too little text to hold some out")
    held_out_lines = min(len(lines) - 1, max(1, round(len(lines) * fraction)))
    cut = len(lines) - held_out_lines
    train = Document(f"{name}[:{cut}]", "".join(lines[:cut]))
    held_out = Document(f"{name}[{cut}:]", "".join(lines[cut:]))
    return Corpus(source, (train,), (held_out,))


def _text_files(root: Path, *, suffix: str | None, skipped_dirs: set[str]) -> list[Path]:
    """Regular files under ``root`` in sorted relative-path order (a stable order on every file system)."""
    found = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(
            d for d in subdirectories if d not in skipped_dirs and not d.startswith(".")
        )
        for name in names:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            found.append(Path(directory) / name)
    return sorted(found, key=lambda file: file.relative_to(root).as_posix())


def _read_text(file: Path) -> str | None:
    try:
        return file.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


# --- token streams ---------------------------------------------------------------------------------------------


def encode_corpus(documents: Sequence[Document], tokenizer: Any) -> torch.Tensor:
    """One int32 token stream [N]: each document's tokens followed by the tokenizer's eos token (if it has one)."""
    separator = getattr(tokenizer, "eos_token_id", None)
    pieces = []
    for document in documents:
        if isinstance(tokenizer, ByteTokenizer):
            pieces.append(tokenizer.encode_tensor(document.text))
        else:
            ids = tokenizer(document.text, add_special_tokens=False)["input_ids"]
            pieces.append(torch.tensor(ids, dtype=torch.int32))
        if separator is not None:
            pieces.append(torch.tensor([separator], dtype=torch.int32))
    if not pieces:
        return torch.empty(0, dtype=torch.int32)
    return torch.cat(pieces)


def sample_batch(
    stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` windows of ``seq_len`` consecutive tokens at uniform random offsets: int64 [B, seq_len]."""
    if stream.dim() != 1 or stream.numel() < seq_len:
        raise HeadkitError(
            f"the training stream holds {stream.numel()} tokens, fewer than seq_len={seq_len}: "
            "use a larger corpus or a shorter --seq-len"
        )
    starts = torch.randint(0, stream.numel() - seq_len + 1, (batch_size,), generator=generator)
    offsets = starts[:, None] + torch.arange(seq_len)
    return stream[offsets].long()


def evaluation_windows(
    stream: torch.Tensor, seq_len: int, max_tokens: int | None = None, *, spread: bool = False
) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len] (int64) of ``stream``, at most ``max_tokens`` tokens in all.

    By default the windows are the start of the stream, back to back (the same tokens at every ``seq_len``,
    which a length-extrapolation study needs). With ``spread=True`` the ``max_tokens // seq_len`` windows are
    spaced evenly from the first token to the last, so a small budget samples every part of a held-out split
    made of many documents rather than its first one or two. A stream shorter than one window gives one
    shorter window.
    """
    check_positive_int("seq_len", seq_len)
    total = stream.numel()
    if max_tokens is not None and max_tokens < total and spread and max_tokens >= seq_len:
        count = max_tokens // seq_len
        # Evenly spaced starts from 0 to total − seq_len; spacing ≥ seq_len since count · seq_len ≤ total.
        starts = torch.linspace(0, total - seq_len, count).long() if count > 1 else torch.zeros(1).long()
        return torch.stack([stream[start : start + seq_len] for start in starts.tolist()]).long()
    if max_tokens is not None:
        stream = stream[:max_tokens]
    if stream.numel() < 2:
        raise HeadkitError(f"the held-out stream holds {stream.numel()} tokens; at least 2 are needed")
    if stream.numel() < seq_len:
        return stream[None].long()
    count = stream.numel() // seq_len
    return stream[: count * seq_len].view(count, seq_len).long()


def special_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's special tokens (they are not text, so bits per byte does not count them)."""
    if isinstance(tokenizer, ByteTokenizer):
        return [PAD_ID, BOS_ID, EOS_ID]
    return sorted(set(getattr(tokenizer, "all_special_ids", []) or []))


def count_text_bytes(tokenizer: Any, ids: torch.Tensor) -> int:
    """UTF-8 bytes of the text that the non-special tokens ``ids`` [N] encode."""
    if isinstance(tokenizer, ByteTokenizer):
        return int((ids < BYTE_VOCAB).sum())
    text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
    return len(text.encode("utf-8"))


__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "ByteTokenizer",
    "Corpus",
    "Document",
    "count_text_bytes",
    "encode_corpus",
    "evaluation_windows",
    "is_byte_tokenizer_folder",
    "load_corpus",
    "load_tokenizer",
    "sample_batch",
    "special_token_ids",
    "stdlib_directory",
]
