"""Teacher → student objectives for recovering a model after surgery.

An objective turns one batch into a scalar loss given the student and the (frozen) teacher. Both are computed in
the same step, the teacher under ``torch.no_grad``: nothing is cached, so the same objective runs unchanged in a
data-parallel run where each process sees its own shard.

- :class:`EncoderObjective`: sentence encoders — 1 − cos of the mean-pooled embeddings (the sentence-transformers
  pooling all-MiniLM-L6-v2 was trained with) plus the token states' squared error relative to the teacher's.
- :func:`sentence_pair_contrastive_loss`: a sentence encoder's own objective on pairs of texts (in-batch
  negatives), no teacher: what head importance ranks an encoder's heads by.
- :class:`CausalLMObjective`: language models — KL(teacher ‖ student) of the next-token distributions at a
  temperature τ, times τ² (Hinton, Vinyals & Dean 2015, §2: the τ² keeps the gradient scale independent of τ),
  averaged over real tokens; optionally plus the last hidden state's relative squared error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.errors import HeadkitError


def mean_pool(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings [B, hidden]: the mean of the real tokens' states (sentence-transformers' pooling)."""
    weights = attention_mask.to(hidden_states.dtype)[..., None]
    return (hidden_states * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def relative_squared_error(
    student: torch.Tensor, teacher: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """Σ (s − t)² / Σ t² over real tokens: scale-free, so it weighs alike whatever the model's hidden size."""
    real = (
        torch.ones_like(teacher[..., :1])
        if attention_mask is None
        else attention_mask.to(teacher.dtype)[..., None]
    )
    return ((student - teacher) ** 2 * real).sum() / ((teacher**2) * real).sum().clamp_min(1e-12)


def embedding_distillation_loss(
    student_states: torch.Tensor, teacher_states: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """(1 − cos) of the mean-pooled embeddings, averaged over the batch, plus the token states' relative
    squared error."""
    cosine = F.cosine_similarity(
        mean_pool(student_states, attention_mask), mean_pool(teacher_states, attention_mask), dim=-1
    )
    return (1.0 - cosine).mean() + relative_squared_error(student_states, teacher_states, attention_mask)


# sentence-transformers' MultipleNegativesRankingLoss multiplies the cosine similarities by 20.
CONTRASTIVE_SCALE = 20.0


def in_batch_contrastive_loss(
    anchors: torch.Tensor, positives: torch.Tensor, scale: float = CONTRASTIVE_SCALE
) -> torch.Tensor:
    """MultipleNegativesRankingLoss (Henderson et al. 2017, "Efficient Natural Language Response Suggestion for
    Smart Reply", §4.4): cross-entropy of picking positive i for anchor i among all the batch's positives, by
    scaled cosine similarity — the objective all-MiniLM-L6-v2 was trained with."""
    similarities = scale * F.cosine_similarity(anchors[:, None], positives[None, :], dim=-1)
    return F.cross_entropy(similarities, torch.arange(len(anchors), device=anchors.device))


def sentence_pair_contrastive_loss(model: nn.Module, pair: tuple[dict, dict]) -> torch.Tensor:
    """:func:`in_batch_contrastive_loss` of an encoder's mean-pooled embeddings of a batch pair (anchors,
    positives): a sentence encoder's own training objective, with no teacher. Its gradient at the unpruned model
    is not 0 (unlike a distillation loss's), so head importance (Michel et al. 2019) can rank heads by it."""
    first, second = (mean_pool(model(**batch).last_hidden_state, batch["attention_mask"]) for batch in pair)
    return in_batch_contrastive_loss(first, second)


def next_token_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """τ² · mean over real positions of KL(softmax(t/τ) ‖ softmax(s/τ)) for logits [B, T, V].

    Every position predicts the token after it, so every real position counts (the last one too: the
    teacher's distribution there is as good a target as any other)."""
    if temperature <= 0:
        raise HeadkitError(f"temperature must be positive, got {temperature!r}")
    teacher_log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    student_log_p = F.log_softmax(student_logits.float() / temperature, dim=-1)
    per_position = (teacher_log_p.exp() * (teacher_log_p - student_log_p)).sum(-1)
    if attention_mask is None:
        mean = per_position.mean()
    else:
        real = attention_mask.to(per_position.dtype)
        mean = (per_position * real).sum() / real.sum().clamp_min(1.0)
    return temperature**2 * mean


def _model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {key: batch[key] for key in ("input_ids", "attention_mask") if key in batch}


@dataclass
class EncoderObjective:
    """Sentence-encoder distillation: :func:`embedding_distillation_loss` on the last hidden states."""

    name: str = "encoder"

    def __call__(self, student: nn.Module, teacher: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        inputs = _model_inputs(batch)
        with torch.no_grad():
            expected = teacher(**inputs).last_hidden_state
        got = student(**inputs).last_hidden_state
        mask = batch.get("attention_mask")
        if mask is None:
            mask = torch.ones(got.shape[:2], dtype=torch.long, device=got.device)
        return embedding_distillation_loss(got, expected, mask)


@dataclass
class CausalLMObjective:
    """Causal-LM distillation: :func:`next_token_kl` at `temperature`, plus `hidden_weight` × the last hidden
    state's relative squared error (0: logits only, which needs no hidden states)."""

    temperature: float = 1.0
    hidden_weight: float = 0.0
    name: str = "causal_lm"

    def __post_init__(self) -> None:
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not self.temperature > 0
        ):
            raise HeadkitError(f"temperature must be a positive number, got {self.temperature!r}")
        if (
            isinstance(self.hidden_weight, bool)
            or not isinstance(self.hidden_weight, (int, float))
            or self.hidden_weight < 0
        ):
            raise HeadkitError(f"hidden_weight must be a non-negative number, got {self.hidden_weight!r}")

    def __call__(self, student: nn.Module, teacher: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        inputs = _model_inputs(batch) | {"use_cache": False}
        hidden = self.hidden_weight > 0
        with torch.no_grad():
            expected = teacher(**inputs, output_hidden_states=hidden)
        got = student(**inputs, output_hidden_states=hidden)
        mask = batch.get("attention_mask")
        loss = next_token_kl(got.logits, expected.logits, mask, self.temperature)
        if hidden:
            loss = loss + self.hidden_weight * relative_squared_error(
                got.hidden_states[-1], expected.hidden_states[-1], mask
            )
        return loss
