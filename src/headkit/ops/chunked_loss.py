"""The next-token cross-entropy of a language-model head, computed a chunk of tokens at a time: the [tokens,
vocabulary] logits and their gradient are never held whole (Liger Kernel's fused linear cross-entropy, Hsu et al.
2024, §3.3, without the fused kernel).

:func:`chunked_cross_entropy` takes the head's input h [N, d] (the last hidden states), its weight W [V, d] (and
bias), and the target of every row (−100: ignored), and returns the summed cross-entropy Σ_t −log softmax(W h_t)
[target_t]. In the forward it runs over the rows in chunks: each chunk's logits, their log-sum-exp, the loss, and
the gradient with respect to the chunk's logits, softmax − one-hot, folded at once into ∂L/∂h = (softmax −
one-hot) W (and ∂L/∂W, when W needs one); the backward only scales those by the incoming gradient. The peak is one
chunk's logits (``chunk`` rows × V) instead of all N × V logits, their float32 copy, log-softmax and gradient
(SmolLM2, 4,096 tokens: 0.8 GB each). :func:`naive_chunked_cross_entropy` is the plain twin the tests compare
values and gradients with.

``softcap`` (Gemma 2/3's ``final_logit_softcapping``): the logits are cap · tanh(W h / cap), as those models compute
them; the logits are computed in the input's dtype and the loss in float32, as 🤗 models' own losses do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Logit entries one chunk holds at most (float32: 64 MiB): SmolLM2's 49,152-word vocabulary gives 341 rows a chunk.
CHUNK_ENTRIES = 1 << 24


def default_chunk(vocabulary: int) -> int:
    """Rows a chunk holds for a head of `vocabulary` outputs: :data:`CHUNK_ENTRIES` logits, at least one row."""
    return max(1, CHUNK_ENTRIES // max(vocabulary, 1))


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, softcap, chunk):  # type: ignore[override]
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        total = hidden.new_zeros((), dtype=torch.float32)
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                rows, target = hidden[start : start + chunk], targets[start : start + chunk]
                valid = target != IGNORE_INDEX
                logits = _logits(rows, weight, bias, softcap)
                normaliser = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, target.clamp_min(0)[:, None])[:, 0]
                total += ((normaliser - picked) * valid).sum()
                if not (need_hidden or need_weight or need_bias):
                    continue
                # ∂L/∂logits = softmax − one-hot on the counted rows, 0 on the ignored ones (in place: one buffer)
                gradient = logits.sub_(normaliser[:, None]).exp_()
                gradient[torch.arange(len(target)), target.clamp_min(0)] -= 1.0
                gradient.mul_(valid[:, None])
                if softcap is not None:  # d(c·tanh(x/c))/dx = 1 − tanh²(x/c)
                    capped = F.linear(rows, weight, bias).float() / softcap
                    gradient.mul_(1.0 - torch.tanh(capped).square())
                if need_hidden:
                    grad_hidden[start : start + chunk] = (gradient.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_weight:
                    grad_weight += gradient.T @ rows.float()
                if need_bias:
                    grad_bias += gradient.sum(0)
                del gradient, logits
        ctx.save_for_backward(
            *(t if t is not None else torch.empty(0) for t in (grad_hidden, grad_weight, grad_bias))
        )
        ctx.needs = (need_hidden, need_weight, need_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_output.float()
        return (
            (grad_hidden * scale.to(grad_hidden.dtype)) if need_hidden else None,
            (grad_weight * scale).to(weight_dtype) if need_weight else None,
            (grad_bias * scale).to(bias_dtype) if need_bias else None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Σ over the rows whose target is not −100 of −log softmax(logits)[target], logits = W h (+ b; with `softcap`,
    cap · tanh(· / cap)), for `hidden` [N, d], `weight` [V, d], `targets` [N]; a float32 scalar, differentiable
    with respect to `hidden`, `weight` and `bias`. `chunk`: rows a chunk holds (default :func:`default_chunk`)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, d] and weight [V, d] with the same d, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap!r}")
    chunk = chunk or default_chunk(weight.shape[0])
    return _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, softcap, chunk)


def naive_chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The plain twin of :func:`chunked_cross_entropy`: all logits at once, autograd's gradients."""
    logits = _logits(hidden, weight, bias, softcap)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


__all__ = [
    "CHUNK_ENTRIES",
    "IGNORE_INDEX",
    "chunked_cross_entropy",
    "default_chunk",
    "naive_chunked_cross_entropy",
]
