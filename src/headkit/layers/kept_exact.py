"""What a hybrid layer keeps exact beyond its window, one small class per method (kvpress's layout): the pieces
that plug into a linearized layer's mechanism (:class:`headkit.surgery.linearize.LinearizedHeads`).

* :class:`KeptKeys`: attention sinks (Xiao et al. 2023, "StreamingLLM", arXiv:2309.17453) and a budget of keys
  per key/value head, exact under the hybrid's one normaliser — the sparse variant of the op
  (:mod:`headkit.ops.hybrid.sparse`); the budget's keys are chosen by a selection:
* :class:`RecallSelection`: online, those the linear state recalls worst (McDermott et al. 2025, "LoLA",
  arXiv:2505.23666, eq. 6; the op scores them);
* :class:`QuestionSelection`: those the prompt's last queries attend to most (Li et al. 2024, "SnapKV",
  arXiv:2404.14469; :func:`headkit.ops.key_selection.observation_scores`);
* :class:`ReconstructionSelection`: those the prompt's repetition attends to most (Kim et al. 2025, "KVzip",
  arXiv:2505.23416; :func:`headkit.ops.key_selection.reconstruction_scores`), whatever the question;
* :class:`ExactHeads`: key/value heads that keep softmax with a full cache (retrieval heads; Xiao et al. 2024,
  "DuoAttention", arXiv:2410.10819), beside the converted heads of the same layer.

None of them has parameters: a trained layer takes other pieces as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from headkit.layers.hybrid import SplitHeadsRing, SplitHeadsState
from headkit.ops.hybrid import (
    SparseHybridState,
    sparse_hybrid_attention,
    sparse_hybrid_attention_step_,
    sparse_hybrid_stored_keys,
)
from headkit.ops.key_selection import (
    DEFAULT_KERNEL,
    MAX,
    QUESTION,
    RECALL,
    RECONSTRUCTION,
    SUM,
    observation_scores,
    reconstruction_scores,
)
from headkit.ops.quantized_attention import CodedSlots
from headkit.ops.softmax import softmax_attention_coded_step_, softmax_attention_static_step_


class RecallSelection:
    """The budget keeps the keys the linear state recalls worst (LoLA's self-recall error): the op scores each
    key as it leaves the window, so no score is given."""

    name: ClassVar[str] = RECALL

    def __init__(self, observation: int = 32) -> None:
        self.observation = observation  # unused: kept so that a layer can switch selections as it is

    def key_scores(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        new_mask: torch.Tensor | None,
        scale: float,
        prefill: bool,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        return None


class QuestionSelection(RecallSelection):
    """The budget keeps the keys that the last ``observation`` queries of a prompt prefilled into a cache attend
    to most (SnapKV). A forward without a cache (training, perplexity) is causal and has no question yet, and a
    decoding step asks none: their keys score 0, so they fill empty slots only and the question's choice stays. A
    prompt appended to a cache that holds one (a later turn) is scored by its last queries' softmax over the stored
    keys and its own — the weight they give each new key beside everything they see, the scale the earlier
    prompt's keys were scored on — so its keys evict a stored key only where they outscore it on that scale."""

    name: ClassVar[str] = QUESTION
    # How the voting queries' weights of a key combine, and the pooling width (SnapKV's: summed, 5 positions).
    reduction: ClassVar[str] = SUM
    kernel: ClassVar[int] = DEFAULT_KERNEL

    def key_scores(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        new_mask: torch.Tensor | None,
        scale: float,
        prefill: bool,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if not prefill:
            return keys.new_zeros(*keys.shape[:3], dtype=torch.float32)
        past_keys, past_mask = (None, None) if past is None else past
        return observation_scores(
            queries, keys, observation=self.observation, attention_mask=new_mask, scale=scale,
            kernel=self.kernel, past_keys=past_keys, past_mask=past_mask, reduction=self.reduction,
        )  # fmt: skip


class ReconstructionSelection(QuestionSelection):
    """The budget keeps the keys that the model reads most to repeat the prompt (KVzip): chosen before any
    question, so a later turn finds what it asks for. A model-level prefill
    (:mod:`headkit.surgery.reconstruction`) runs a scoring forward first — the prompt, a request to repeat it and
    the prompt again — with :attr:`scoring` set to where the prompt's tokens sit in that forward and which of its
    queries vote; the layer records each prompt key's score (:meth:`record_scores`), the prefill that follows keeps
    by them. A prompt prefilled without that pass (a later turn's tokens appended to a cache) is scored by its last
    queries beside the stored keys, as the question's selection does, but on the repetition's scale: each key the
    most weight any of them gives it, unpooled — the statistic its stored keys were kept by (at most 1), where
    SnapKV's sum over 32 queries and a group's heads is on another scale (up to 32 times the group)."""

    name: ClassVar[str] = RECONSTRUCTION
    reduction: ClassVar[str] = MAX
    kernel: ClassVar[int] = 1

    def __init__(self, observation: int = 32) -> None:
        super().__init__(observation)
        # During a scoring forward: where each prompt token sits in it [B, n], and which queries vote [B, T].
        self.scoring: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending: torch.Tensor | None = None  # [B, Hkv, n] the scores the next prefill keeps by

    def record_scores(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        new_mask: torch.Tensor | None,
        scale: float,
        heads: Sequence[int],
    ) -> None:
        """Score the prompt keys of the key/value heads `heads` by this scoring forward's repetition, each the
        most of any forward so far (a long prompt is repeated in chunks, one forward each)."""
        positions, voters = self.scoring  # type: ignore[misc]
        scores = reconstruction_scores(queries, keys, voters=voters, attention_mask=new_mask, scale=scale)
        index = positions.to(scores.device)[:, None, :].expand(-1, scores.shape[1], -1)
        scores = scores.gather(-1, index)[:, list(heads)]
        self.pending = scores if self.pending is None else torch.maximum(self.pending, scores)

    def key_scores(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        new_mask: torch.Tensor | None,
        scale: float,
        prefill: bool,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        pending, self.pending = self.pending, None
        if prefill and pending is not None and pending.shape == keys.shape[:3]:
            return pending.to(keys.device)
        return super().key_scores(queries, keys, new_mask, scale, prefill, past)


SELECTIONS = {
    selection.name: selection for selection in (RecallSelection, QuestionSelection, ReconstructionSelection)
}


class KeptKeys:
    """The first ``sinks`` tokens and ``budget`` keys per key/value head chosen by ``selection``, exact beyond the
    window in the training, prefill and decoding forms alike (:func:`headkit.ops.hybrid.sparse_hybrid_attention`).
    Neither: the plain hybrid."""

    def __init__(self, sinks: int, budget: int, selection: RecallSelection) -> None:
        self.sinks, self.budget, self.selection = sinks, budget, selection

    def __bool__(self) -> bool:
        return bool(self.sinks or self.budget)

    def options(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        new_mask: torch.Tensor | None,
        scale: float,
        prefill: bool,
        state: Any = None,
    ) -> dict[str, Any]:
        """The op's options for these tokens (:meth:`headkit.layers.hybrid.HybridHeads.hybrid_heads`): the sparse
        variant with its sizes and the selection's scores; nothing for the plain hybrid. ``state``: the
        :class:`~headkit.ops.hybrid.SparseHybridState` these tokens continue, whose stored keys a later turn's
        keys are scored beside."""
        if not self:
            return {}
        options = {"sinks": self.sinks, "budget": self.budget}
        options |= {"parallel": sparse_hybrid_attention, "decode": sparse_hybrid_attention_step_}
        past = sparse_hybrid_stored_keys(state) if prefill and isinstance(state, SparseHybridState) else None
        scores = self.selection.key_scores(queries, keys, new_mask, scale, prefill, past)
        return options if scores is None else options | {"key_scores": scores}


class ExactHeads:
    """Key/value heads ``heads`` (with their query heads) that keep causal softmax over a full key/value cache,
    beside the converted heads: one attention call splits the heads, the layer's cache entry holds a
    :class:`~headkit.layers.hybrid.SplitHeadsState` (the fast decoder's: a
    :class:`~headkit.layers.hybrid.SplitHeadsRing`)."""

    def __init__(self, heads: Sequence[int], num_heads: int, num_kv_heads: int) -> None:
        self.heads = tuple(sorted(heads))
        self.linear_heads = tuple(h for h in range(num_kv_heads) if h not in self.heads)
        groups = num_heads // num_kv_heads
        self.query_heads = [h * groups + g for h in self.heads for g in range(groups)]
        self.linear_query_heads = [h * groups + g for h in self.linear_heads for g in range(groups)]

    def __bool__(self) -> bool:
        return bool(self.heads)

    def attend(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_mask: torch.Tensor | None,
        scale: float,
        split: SplitHeadsState | SplitHeadsRing | None,
    ) -> tuple[torch.Tensor, SplitHeadsState | SplitHeadsRing]:
        """These heads' outputs (inputs: every head of the layer), and the split state with their keys and values
        after these tokens (the converted heads' part as it was): the fast decoder's fixed buffers written in
        place, or the eager cache grown."""
        queries, keys, values = (
            queries[:, self.query_heads],
            keys[:, list(self.heads)],
            values[:, list(self.heads)],
        )
        if isinstance(split, SplitHeadsRing):
            # a quantized cache's buffers on the fast decoder are codes, attended as they are
            step = (
                softmax_attention_coded_step_
                if isinstance(split.keys, CodedSlots)
                else softmax_attention_static_step_
            )
            outputs = step(
                queries, keys, values, split.keys, split.values, split.keep, split.seen, scale=scale
            )
            return outputs, split
        outputs, exact_state = causal_softmax(queries, keys, values, new_mask, scale, split)
        return outputs, SplitHeadsState(None if split is None else split.linear, *exact_state)

    def state_bytes(self, context: int, head_dim: int, element_size: int) -> int:
        """Bytes of these heads' cache for one sequence after ``context`` tokens: keys, values, one flag a token."""
        return (2 * len(self.heads) * head_dim * element_size + 1) * context if self.heads else 0


def causal_softmax(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    new_mask: torch.Tensor | None,
    scale: float,
    state: SplitHeadsState | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Causal softmax attention over the cached and new keys of some heads: (outputs, (keys, values, keep))."""
    batch, _, seq, _ = queries.shape
    new_keep = (
        torch.ones(batch, seq, dtype=torch.bool, device=queries.device) if new_mask is None else new_mask
    )
    if state is not None:
        keys = torch.cat([state.keys, keys], dim=2)
        values = torch.cat([state.values, values], dim=2)
        new_keep = torch.cat([state.keep, new_keep], dim=1)
    total = keys.shape[2]
    if keys.shape[1] == 0:
        return queries.new_zeros(batch, 0, seq, values.shape[-1]), (keys, values, new_keep)
    groups = queries.shape[1] // keys.shape[1]
    if total == seq and bool(new_keep.all()):
        # A prompt without padding: the causal kernel (flash on CPU and GPU), no [T, T] mask to build or read.
        masking: dict[str, Any] = {"is_causal": True}
    else:
        rows = torch.arange(total - seq, total, device=queries.device)[:, None]
        columns = torch.arange(total, device=queries.device)[None]
        # A padded query sees itself (its output is never used), so that no row is empty.
        masking = {"attn_mask": ((columns <= rows) & new_keep[:, None, None, :]) | (columns == rows)}
    outputs = torch.nn.functional.scaled_dot_product_attention(
        queries,
        keys.repeat_interleave(groups, dim=1),
        values.repeat_interleave(groups, dim=1),
        scale=scale,
        **masking,
    )
    return outputs, (keys, values, new_keep)
