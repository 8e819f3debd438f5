"""Text for the recipes, the measurements and the benchmarks: the user's own (``--data``: a text file, a folder
of them, or JSON Lines with a ``"text"`` field) or, by default, the running Python's standard-library source,
split by :func:`headkit.data.load_corpus` into training and held-out documents. Held-out documents are never trained on:
every measurement of fidelity or perplexity is on them.

- Encoders see short texts: chunks of a few non-blank lines (:func:`text_chunks`), tokenised into fixed-shape
  padded batches (:func:`tokenize_batches`).
- Causal LMs see token windows (:func:`lm_windows`): training windows drawn from a seeded shuffle of the training
  documents, held-out windows one per held-out document (the documents in a seeded order), so that the
  evaluation spreads over many files instead of the first one or two.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headkit.data import ByteTokenizer, Corpus, Document, load_corpus
from headkit.errors import HeadkitError

LINES_PER_TEXT = 6


def load_text(data: str | Path | None) -> Corpus:
    """The corpus at `data` (None: the standard library), with errors that name ``--data``."""
    if data is not None and not Path(data).exists():
        raise HeadkitError(f"--data {str(data)!r} does not exist")
    try:
        return load_corpus(data)
    except HeadkitError as exc:
        raise HeadkitError(f"--data: {exc}" if data is not None else str(exc)) from None


def text_chunks(
    corpus: Corpus, train_texts: int, held_out_texts: int, seed: int = 0
) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): chunks of LINES_PER_TEXT non-blank lines (whitespace collapsed) from
    the training and the held-out documents, sampled reproducibly."""

    def chunks(documents: tuple[Document, ...]) -> list[str]:
        found = []
        for document in documents:
            lines = [" ".join(line.split()) for line in document.text.splitlines()]
            lines = [line for line in lines if line]
            for start in range(0, max(1, len(lines) - LINES_PER_TEXT + 1), LINES_PER_TEXT):
                piece = " ".join(lines[start : start + LINES_PER_TEXT])
                if piece:
                    found.append(piece)
        random.Random(seed).shuffle(found)
        return found

    train, held_out = chunks(corpus.train), chunks(corpus.held_out)
    if len(train) < train_texts or len(held_out) < held_out_texts:
        raise HeadkitError(
            f"the text ({corpus.source}) yields {len(train)} training and {len(held_out)} held-out texts, fewer "
            f"than the {train_texts} and {held_out_texts} asked for"
        )
    return train[:train_texts], held_out[:held_out_texts]


def text_halves(texts: list[str]) -> tuple[list[str], list[str]]:
    """(first halves, second halves) of each text's words: positive pairs for a contrastive loss."""
    firsts, seconds = [], []
    for text in texts:
        words = text.split()
        cut = max(1, len(words) // 2)
        firsts.append(" ".join(words[:cut]))
        seconds.append(" ".join(words[cut:]) or " ".join(words))
    return firsts, seconds


def pair_batches(
    tokenizer: Any, texts: list[str], batch_size: int, max_length: int
) -> list[tuple[dict, dict]]:
    """Batch pairs (first halves, second halves) of `texts` (:func:`text_halves`), tokenised as
    :func:`tokenize_batches` does."""
    halves = [tokenize_batches(tokenizer, half, batch_size, max_length) for half in text_halves(texts)]
    return list(zip(*halves, strict=True))


def tokenize_batches(tokenizer: Any, texts: list[str], batch_size: int, max_length: int) -> list[dict]:
    """Fixed-shape batches [batch_size, max_length] (padded), so every step and timing costs the same."""
    batches = []
    for start in range(0, len(texts) - batch_size + 1, batch_size):
        encoded = tokenizer(
            texts[start : start + batch_size],
            padding="max_length",
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        batches.append({key: encoded[key] for key in ("input_ids", "attention_mask")})
    return batches


@dataclass
class LMWindows:
    """Token windows for a causal LM: training examples and held-out windows [N, length]."""

    train: list[dict[str, torch.Tensor]]
    held_out: torch.Tensor
    source: str

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "train_windows": len(self.train),
            "held_out_windows": int(self.held_out.shape[0]),
            "window": int(self.held_out.shape[1]),
        }


def _encode(tokenizer: Any, text: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):  # headkit's own (not callable like a 🤗 tokenizer)
        return tokenizer.encode(text)
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a whole file is longer than the model's context: no warning
    try:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    finally:
        transformers.logging.set_verbosity(verbosity)


def lm_windows(
    tokenizer: Any,
    corpus: Corpus,
    *,
    length: int,
    train_windows: int,
    held_out_windows: int,
    seed: int = 0,
) -> LMWindows:
    """`train_windows` training windows (random positions in the training documents' token stream) and up to
    `held_out_windows` held-out windows (the first `length` tokens of held-out documents at least that long,
    cut from shorter ones' concatenation when there are too few), all of `length` tokens."""
    if length < 2:
        raise HeadkitError(f"the window length must be at least 2 tokens, got {length!r}")
    generator = random.Random(seed)
    separator = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []

    train_documents = list(corpus.train)
    generator.shuffle(train_documents)
    stream: list[int] = []
    needed = max(4 * train_windows * length, length + 1)
    for document in train_documents:
        stream += _encode(tokenizer, document.text) + separator
        if len(stream) >= needed:
            break
    if len(stream) < length:
        raise HeadkitError(
            f"the training text ({corpus.source}) holds {len(stream)} tokens, fewer than one window of {length}"
        )
    ids = torch.tensor(stream, dtype=torch.long)
    starts = torch.randint(
        0, len(stream) - length + 1, (train_windows,), generator=torch.Generator().manual_seed(seed)
    )
    # Each window owns its tokens: a view would carry the whole stream into every pickle of it (a recipe's
    # snapshot held 512 copies of a 4 MB stream: 2.1 GB, and as much memory after --resume).
    train = [
        {"input_ids": ids[s : s + length].clone(), "attention_mask": torch.ones(length, dtype=torch.long)}
        for s in starts.tolist()
    ]

    held_documents = list(corpus.held_out)
    generator.shuffle(held_documents)
    windows, leftovers = [], []
    for document in held_documents:
        tokens = _encode(tokenizer, document.text)
        if len(tokens) >= length:
            windows.append(tokens[:length])
        else:
            leftovers += tokens + separator
        if len(windows) >= held_out_windows:
            break
    while len(windows) < held_out_windows and len(leftovers) >= length:
        windows.append(leftovers[:length])
        leftovers = leftovers[length:]
    if not windows:
        raise HeadkitError(
            f"the held-out text ({corpus.source}) is shorter than one window of {length} tokens"
        )
    return LMWindows(train, torch.tensor(windows, dtype=torch.long), corpus.source)


def held_out_by_length(
    tokenizer: Any, corpus: Any, lengths: Any, windows: int, seed: int = 0
) -> dict[int, torch.Tensor]:
    """`windows` held-out windows [N, length] of `corpus` for each of `lengths` (:func:`lm_windows`)."""
    return {
        length: lm_windows(
            tokenizer, corpus, length=length, train_windows=1, held_out_windows=windows, seed=seed
        ).held_out
        for length in lengths
    }


def window_batches(windows: list[dict[str, torch.Tensor]], batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Training windows (:attr:`LMWindows.train`) stacked into batches of `batch_size` (the last may be smaller)."""
    ids = torch.stack([window["input_ids"] for window in windows])
    return [{"input_ids": chunk, "attention_mask": torch.ones_like(chunk)} for chunk in ids.split(batch_size)]


def calibration_batches(
    windows: list[dict[str, torch.Tensor]], batch_size: int, count: int
) -> list[dict[str, Any]]:
    """The first `count` :func:`window_batches` as inputs of a language-model loss (labels: the inputs), what
    :func:`headkit.analysis.importance.head_importance` ranks heads by."""
    return [
        {"input_ids": batch["input_ids"], "labels": batch["input_ids"], "use_cache": False}
        for batch in window_batches(windows, batch_size)[:count]
    ]
