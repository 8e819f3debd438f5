"""Retrieval heads: the key/value heads that find a planted key in a long prompt.

Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context Factuality", arXiv:2404.15574) find that a
few heads do the copying when a model retrieves a fact from its context, and DuoAttention (Xiao et al. 2024,
arXiv:2410.10819) keeps those heads' full key/value cache while the others see a window and sinks. headkit scores
a key/value head by the attention mass its query heads put on the planted key's tokens while the model writes
the answer (the queries that predict each answer token, given the prompt and the right answer):

    r_h = mean over examples and answer queries i, and over the query heads g of h, of Σ_{j ∈ key span} a_gij

with a the model's own softmax attention. The heads with the largest r_h are the retrieval heads that
``LinearizeConfig.retrieval_heads`` keeps exact. The scores are read through transformers' attention interface:
a probe implementation runs the model's own (the output is unchanged) and adds the mass of the answer queries,
computed from their rows only (answer × prompt scores, never the T × T matrix).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface

from headkit.errors import HeadkitError
from headkit.surgery.attention import base_attention, base_implementation, register_base_mask

PROBE = "headkit_retrieval_probe"


class RetrievalExample(NamedTuple):
    """One prompt with its answer: ``input_ids`` (prompt then answer tokens), the planted key's token span
    [``key_start``, ``key_end``) and the answer's first token index ``answer_start`` (the queries from
    ``answer_start − 1`` to the second-last token predict the answer)."""

    input_ids: tuple[int, ...]
    key_start: int
    key_end: int
    answer_start: int


def retrieval_head_scores(model: nn.Module, examples: Sequence[RetrievalExample]) -> torch.Tensor:
    """r_h of every key/value head of every layer (module docstring), [layers, kv_heads] float32 in [0, 1].

    The model must run a stock attention implementation (sdpa or eager: score it before any conversion); it is
    left as it was."""
    if not examples:
        raise HeadkitError("retrieval_head_scores needs at least one example")
    for example in examples:
        length = len(example.input_ids)
        if not 0 <= example.key_start < example.key_end <= example.answer_start - 1 < length - 1:
            raise HeadkitError(
                f"an example's key span [{example.key_start}, {example.key_end}) must lie before its answer, "
                f"which starts at {example.answer_start} and must leave at least one answer token in {length}"
            )
    base = base_implementation(model)
    if base.startswith("headkit"):
        raise HeadkitError("score retrieval heads on the original model, before any headkit conversion")
    sums: dict[int, torch.Tensor] = {}
    device = next(model.parameters()).device
    with _probing(model, base, sums) as probe, torch.no_grad():
        for example in examples:
            probe["span"] = (example.key_start, example.key_end, example.answer_start - 1)
            model(input_ids=torch.tensor([example.input_ids], device=device), use_cache=False)
    if not sums:
        raise HeadkitError(
            "no attention layer reached the probe: the model does not use the attention interface"
        )
    layers = sorted(sums)
    return torch.stack([sums[layer] for layer in layers]) / len(examples)


def top_heads(scores: torch.Tensor, count: int) -> list[tuple[int, int]]:
    """The `count` (layer, key/value head) pairs of largest score, sorted by layer and head."""
    total = scores.numel()
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= total:
        raise HeadkitError(
            f"the retrieval head count must be in [0, {total}] (the model's key/value heads), got {count!r}"
        )
    order = scores.flatten().argsort(descending=True, stable=True)[:count].tolist()
    heads = scores.shape[1]
    return sorted((index // heads, index % heads) for index in order)


@contextmanager
def _probing(model: nn.Module, base: str, sums: dict[int, torch.Tensor]) -> Iterator[dict[str, Any]]:
    stock = base_attention(base)
    probe: dict[str, Any] = {}

    def probed(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        output = stock(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        key_start, key_end, first = probe["span"]
        batch, heads, seq, dim = query.shape
        kv_heads = key.shape[1]
        scale = dim**-0.5 if scaling is None else scaling
        rows = query[:, :, first : seq - 1].float()  # the queries that predict the answer tokens
        keys = key.float().repeat_interleave(heads // kv_heads, dim=1)
        logits = (rows @ keys.transpose(-1, -2)) * scale
        positions = torch.arange(first, seq - 1, device=query.device)[:, None]
        logits = logits.masked_fill(torch.arange(seq, device=query.device)[None] > positions, float("-inf"))
        mass = logits.softmax(dim=-1)[..., key_start:key_end].sum(dim=-1).mean(dim=(0, 2))  # [heads]
        per_kv_head = mass.view(kv_heads, heads // kv_heads).mean(dim=1).cpu()
        layer = int(getattr(module, "layer_idx", len(sums)))
        sums[layer] = sums.get(layer, torch.zeros(kv_heads)) + per_kv_head
        return output

    name = f"{PROBE}_{base}"
    AttentionInterface.register(name, probed)
    register_base_mask(name, base)
    model.set_attn_implementation(name)
    try:
        yield probe
    finally:
        model.set_attn_implementation(base)


__all__ = ["RetrievalExample", "retrieval_head_scores", "top_heads"]
