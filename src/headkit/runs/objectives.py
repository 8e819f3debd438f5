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
  averaged over real tokens; optionally plus the last hidden state's relative squared error. It is computed from
  both LM heads' inputs a chunk of tokens at a time (:func:`headkit.ops.chunked_loss.chunked_kl_divergence`,
  Liger Kernel's chunking, Hsu et al. 2024): neither model's [tokens, vocabulary] logits are held whole.
  :func:`next_token_kl` is the plain loss on whole logits (the reference, and the measurements' KL).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.errors import HeadkitError
from headkit.ops.chunked_loss import chunked_kl_divergence
from headkit.surgery.repair import linear_head, lm_head_input


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


@dataclass(frozen=True)
class LogitHead:
    """A causal LM's logits as a function of its LM head's input h: softcap · tanh(head(h) / softcap), or
    head(h) without a soft-cap (Gemma 2/3's ``final_logit_softcapping``); `last_hidden`: h is also the model's
    last hidden state (``output_hidden_states``' last)."""

    head: nn.Linear
    softcap: float | None
    last_hidden: bool


def logit_head(model: nn.Module, *, hidden: bool = True) -> LogitHead | None:
    """`model`'s :class:`LogitHead` when its own logits are its LM head (``get_output_embeddings()``, an
    nn.Linear) applied to the head's input and soft-capped as its config says — checked on a few tokens against
    the model's own logits — so that its loss can be computed from the head's input in chunks; None otherwise
    (a head this does not know how to apply: the logits are computed whole). `hidden`: also check that the
    head's input is the last hidden state (asking transformers for the hidden states installs its capturing
    hooks on the model, which a recipe's snapshot cannot pickle: only an objective that uses them asks)."""
    found = linear_head(model)
    if found is None:
        return None
    head, softcap = found
    ids = (torch.arange(2, 10)[None] % head.out_features).to(head.weight.device)
    # In eval mode, so that two forwards agree (no dropout, no gate noise) and draw nothing from the random
    # generators a training run's order depends on; each module's mode restored after.
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            expected = model(
                input_ids=ids, use_cache=False, **({"output_hidden_states": True} if hidden else {})
            )
            hidden = lm_head_input(model, head, {"input_ids": ids})
            logits = head(hidden)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
    finally:
        for module, training in modes.items():
            module.training = training
    exact = head.weight.dtype in (torch.float32, torch.float64)
    tolerance = 1e-4 if exact else 2e-2
    if getattr(expected, "logits", None) is None or not torch.allclose(
        logits.float(), expected.logits.float(), rtol=tolerance, atol=tolerance
    ):
        return None
    states = getattr(expected, "hidden_states", None)
    last_hidden = bool(states) and states[-1].shape == hidden.shape and torch.equal(states[-1], hidden)
    return LogitHead(head, softcap, last_hidden)


@dataclass
class CausalLMObjective:
    """Causal-LM distillation: :func:`next_token_kl` at `temperature`, plus `hidden_weight` × the last hidden
    state's relative squared error (0: logits only, which needs no hidden states).

    With `chunked` (the default) and both models' heads recognised (:func:`logit_head`), the KL is computed from
    the heads' inputs a chunk of tokens at a time (:func:`~headkit.ops.chunked_loss.chunked_kl_divergence`): the
    same loss and gradients without either model's [tokens, vocabulary] logits, their float32 log-softmaxes and
    their gradient (SmolLM2, 16 windows of 256 tokens: 0.8 GB each). The student's forward then stops at its
    head, so the objective runs inside the distillation's :class:`~headkit.recipes.distill.ObjectiveForward`
    (``calls_student_forward``), which is what keeps a data-parallel run's gradients averaged."""

    temperature: float = 1.0
    hidden_weight: float = 0.0
    name: str = "causal_lm"
    chunked: bool = True
    _heads: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False
    )
    # the student's forward is stopped at its head (lm_head_input): DDP must wrap the objective, not the student
    calls_student_forward = False

    def __getstate__(self) -> dict[str, Any]:
        # The heads checked so far are a memo of live models (weak references cannot be pickled): a recipe's
        # snapshot (headkit.recipes.work) keeps the objective without it, and the head is checked again.
        return {name: value for name, value in self.__dict__.items() if name != "_heads"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._heads = weakref.WeakKeyDictionary()

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
        heads = (self._head(student), self._head(teacher))
        if self.chunked and all(heads) and (self.hidden_weight == 0 or all(h.last_hidden for h in heads)):
            return self._chunked(student, teacher, batch, *heads)
        return self.logits_loss(student, teacher, batch)

    def logits_loss(self, student: nn.Module, teacher: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The loss from both models' whole logits (:func:`next_token_kl`): the reference the chunked loss is
        tested against, and the loss of a model whose head :func:`logit_head` does not recognise."""
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

    def _chunked(
        self,
        student: nn.Module,
        teacher: nn.Module,
        batch: dict[str, Any],
        ours: LogitHead,
        theirs: LogitHead,
    ) -> torch.Tensor:
        inputs = _model_inputs(batch)
        with torch.no_grad():
            expected = lm_head_input(teacher, theirs.head, inputs)
        got = lm_head_input(student, ours.head, inputs)
        mask = batch.get("attention_mask")
        weights = None if mask is None else mask.reshape(-1).float()
        # next_token_kl's mean: over the real positions (all of them without a mask)
        count = got.shape[0] * got.shape[1] if mask is None else float(mask.sum().clamp_min(1))
        loss = (
            chunked_kl_divergence(
                got.reshape(-1, got.shape[-1]),
                ours.head.weight,
                expected.reshape(-1, expected.shape[-1]),
                theirs.head.weight,
                bias=ours.head.bias,
                teacher_bias=theirs.head.bias,
                weights=weights,
                temperature=self.temperature,
                softcap=ours.softcap,
                teacher_softcap=theirs.softcap,
            )
            / count
        )
        if self.hidden_weight > 0:  # the head's input is the last hidden state (logit_head checked it)
            loss = loss + self.hidden_weight * relative_squared_error(got, expected, mask)
        return loss

    def _head(self, model: nn.Module) -> LogitHead | None:
        # checked once per model: the check runs two forwards of a few tokens
        if model not in self._heads:
            self._heads[model] = logit_head(model, hidden=self.hidden_weight > 0)
        return self._heads[model]
