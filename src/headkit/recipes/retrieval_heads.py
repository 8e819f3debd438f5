"""The retrieval heads a recipe keeps whole: the key/value heads of the original model that attend most to the key
on passkey prompts (:func:`headkit.analysis.retrieval.retrieval_head_scores`; DuoAttention, Xiao et al. 2025,
keeps such heads' whole cache), chosen among the layers a conversion changes. ``headkit linearize
--retrieval-head-count`` and ``headkit compress --kv-budget … --kv-retrieval-heads`` choose them here."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from headkit.analysis.retrieval import top_heads
from headkit.evaluation.retrieval import RETRIEVAL_SCORING_PROMPTS, passkey_retrieval_scores, prose_sentences
from headkit.surgery.linearize import max_context


def chosen_retrieval_heads(
    teacher: nn.Module,
    tokenizer: Any,
    corpus: Any,
    layers: Sequence[int],
    count: int,
    *,
    seed: int,
    echo: Callable[[str], None],
) -> tuple[tuple[int, int], ...]:
    """The `count` best-scored (layer, key/value head) pairs of `layers` on the original `teacher`: passkey
    prompts of their own seed built from `corpus`'s prose (none of them a measured prompt), 1,024 tokens or the
    model's context; the choice and its scores said in one line."""
    started = time.perf_counter()
    sentences = prose_sentences(corpus, seed=seed)
    scores, length = passkey_retrieval_scores(
        teacher, tokenizer, sentences, context=max_context(teacher), seed=seed
    )
    eligible = torch.full_like(scores, float("-inf"))
    eligible[list(layers)] = scores[list(layers)]
    heads = top_heads(eligible, count)
    echo(
        f"retrieval heads (passkey attention mass, {RETRIEVAL_SCORING_PROMPTS} prompts of {length} tokens, "
        f"{time.perf_counter() - started:.0f} s): "
        + ", ".join(f"{layer}:{head} {float(scores[layer, head]):.2f}" for layer, head in heads)
    )
    return tuple(heads)


__all__ = ["chosen_retrieval_heads"]
