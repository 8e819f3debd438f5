"""Quality of a model's predictions: the next-token loss (:func:`next_token_nats`) behind held-out perplexity
(:func:`perplexity`) and bits per byte (:func:`held_out_bits_per_byte`); top-1 agreement and KL against a
reference (:func:`agreement`); for encoders, the cosine of mean-pooled embeddings (:func:`embedding_cosine`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.compat import cache_keyword, output_cache
from headkit.data import count_text_bytes
from headkit.devices import model_device
from headkit.errors import HeadkitError
from headkit.runs.objectives import mean_pool, next_token_kl

# Logit entries one forward of the measurements may produce (float32: 128 MiB): the rows a forward takes are capped
# so that [rows, T, vocabulary] stays within it (SmolLM2, 256-token windows: 2 rows), whatever the batch size asked.
LOGIT_ENTRIES = 1 << 25
# Logit entries whose softmaxes the agreement's KL holds at once (float32: 16 MiB each).
KL_SLICE_ENTRIES = 1 << 22


def _row_chunks(model: nn.Module, windows: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, ...]:
    """`windows` split into forwards of at most `batch_size` rows and :data:`LOGIT_ENTRIES` logits (one row at
    least); the sums over them are the same."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocabulary = getattr(head, "out_features", None) or getattr(
        getattr(model, "config", None), "vocab_size", 0
    )
    if vocabulary and windows.dim() == 2:
        batch_size = max(1, min(batch_size, LOGIT_ENTRIES // (windows.shape[1] * vocabulary)))
    return windows.split(batch_size)


def summed_nats(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Σ −log softmax(logits)[target] in nats over rows ([N, V] logits, [N] targets), in float32 at least: the
    one next-token loss behind perplexity and bits per byte, headkit's models' and llama.cpp's alike."""
    return float(F.cross_entropy(logits.float(), targets, reduction="sum"))


@torch.no_grad()
def next_token_nats(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 4, ignored_ids: torch.Tensor | None = None
) -> tuple[float, torch.Tensor]:
    """The summed next-token negative log-likelihood (nats) of `model` over `windows` [N, T] — every token but
    the first of each window predicted, except those in `ignored_ids` (special tokens: document separators) —
    and the mask of the predicted targets [N, T − 1]: the one loss behind perplexity and bits per byte."""
    device = model_device(model)
    total, predicted = 0.0, []
    for chunk in _row_chunks(model, windows, batch_size):
        targets = chunk[:, 1:].to(device)
        keep = torch.ones_like(targets, dtype=torch.bool)
        if ignored_ids is not None and ignored_ids.numel():
            keep = ~torch.isin(targets, ignored_ids.to(device))
        logits = model(input_ids=chunk.to(device), use_cache=False).logits[:, :-1]
        total += summed_nats(logits[keep], targets[keep])
        predicted.append(keep.cpu())
    return total, torch.cat(predicted)


def perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """exp of the mean next-token negative log-likelihood over every position of `windows` [N, L] but the first."""
    nats, predicted = next_token_nats(model, windows, batch_size)
    return math.exp(nats / int(predicted.sum()))


@torch.no_grad()
def continuation_perplexity(
    model: nn.Module, windows: torch.Tensor, *, scored: int, chunk: int = 16
) -> float:
    """Perplexity of the last `scored` tokens of each window [N, L], read through the model's own cache: the first
    L − `scored` tokens are prefilled at once (a cache that compresses a prompt does so then), and the rest fed
    `chunk` tokens at a time, each chunk attending to the cache as it stands (a cache that quantizes, drops or
    selects what it keeps is what the continuation reads). Every continuation token is predicted, the first of them
    by the prefill's last logits."""
    length = windows.shape[1]
    if isinstance(scored, bool) or not isinstance(scored, int) or not 1 <= scored < length:
        raise HeadkitError(
            f"scored must be an integer in [1, {length - 1}] (the windows' length − 1), got {scored!r}"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise HeadkitError(f"chunk must be a positive integer, got {chunk!r}")
    device = model_device(model)
    prefix = length - scored
    total = 0.0
    for window in windows.to(device):
        ids = window[None]
        out = model(input_ids=ids[:, :prefix], use_cache=True, logits_to_keep=1)  # the prefix's last row only
        cache, last = output_cache(out), out.logits[:, -1]
        for start in range(prefix, length, chunk):
            piece = ids[:, start : start + chunk]
            total += summed_nats(last, piece[:, 0])
            out = model(input_ids=piece, use_cache=True, **cache_keyword(cache))
            cache, last = output_cache(out), out.logits[:, -1]
            total += summed_nats(out.logits[0, :-1], piece[0, 1:])
    return math.exp(total / (scored * windows.shape[0]))


def held_out_bits_per_byte(
    model: nn.Module,
    windows: torch.Tensor,
    tokenizer: Any,
    ignored_ids: torch.Tensor | None = None,
    batch_size: int = 8,
) -> float:
    """Bits per UTF-8 byte of the next-token loss over ``windows`` [N, T] (tokens 1… of each are predicted), in
    evaluation mode (the model's mode restored after).

    Tokens in ``ignored_ids`` (special tokens) are not predicted and their bytes are not counted.
    """
    was_training = model.training
    model.eval()
    try:
        nats, predicted = next_token_nats(model, windows, batch_size, ignored_ids)
    finally:
        model.train(was_training)
    total_bytes = sum(
        count_text_bytes(tokenizer, row[1:][mask]) for row, mask in zip(windows, predicted, strict=True)
    )
    if total_bytes == 0:
        raise HeadkitError("the held-out windows encode no text bytes; use a larger held-out split")
    return nats / (math.log(2) * total_bytes)


@dataclass(frozen=True)
class Agreement:
    """How closely a model's next-token predictions follow a reference's on the same windows: the share of
    positions whose most likely token is the same (``top1``), and the mean KL(reference ‖ model) of the
    next-token distributions in nats (``kl``)."""

    top1: float
    kl: float


@torch.no_grad()
def agreement(
    model: nn.Module, reference: nn.Module, windows: torch.Tensor, batch_size: int = 4
) -> Agreement:
    """Top-1 agreement and mean KL(reference ‖ model) (:func:`headkit.runs.objectives.next_token_kl`, the
    distillation loss at τ = 1) over every position of `windows` [N, L]."""
    same, kl_sum, count = 0, 0.0, 0
    for chunk in _row_chunks(model, windows, batch_size):
        chunk = chunk.to(model_device(model))
        got = model(input_ids=chunk, use_cache=False).logits.float().flatten(0, 1)
        expected = reference(input_ids=chunk.to(model_device(reference)), use_cache=False).logits
        expected = expected.float().to(got.device).flatten(0, 1)
        same += int((got.argmax(-1) == expected.argmax(-1)).sum())
        # The KL's softmaxes a slice of positions at a time: four more logit-sized tensors otherwise.
        rows = max(1, KL_SLICE_ENTRIES // got.shape[-1])
        for mine, theirs in zip(got.split(rows), expected.split(rows), strict=True):
            kl_sum += float(next_token_kl(mine[None], theirs[None])) * mine.shape[0]
        count += chunk.numel()
    return Agreement(top1=same / count, kl=kl_sum / count)


@torch.no_grad()
def last_hidden_states(model: nn.Module, batches: Sequence[dict]) -> list[torch.Tensor]:
    """An encoder's last hidden states [B, T, hidden] on each of `batches`."""
    return [model(**batch).last_hidden_state for batch in batches]


@torch.no_grad()
def embedding_cosine(
    model: nn.Module | Sequence[torch.Tensor],
    reference: nn.Module | Sequence[torch.Tensor],
    batches: Sequence[dict],
) -> torch.Tensor:
    """Per text of `batches`: the cosine of `model`'s and `reference`'s sentence embeddings (mean-pooled last
    hidden states over real tokens, sentence-transformers' pooling) [texts]. Each of `model` and `reference` is
    an encoder or its :func:`last_hidden_states` on `batches` (a reference's, computed once for many students)."""
    states = [
        last_hidden_states(side, batches) if isinstance(side, nn.Module) else list(side)
        for side in (model, reference)
    ]
    return torch.cat(
        [
            F.cosine_similarity(
                mean_pool(got, b["attention_mask"]), mean_pool(expected, b["attention_mask"]), dim=-1
            )
            for got, expected, b in zip(*states, batches, strict=True)
        ]
    )
