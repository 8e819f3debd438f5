"""The next-token losses of a language-model head — the cross-entropy, and the distillation's KL against a
teacher's head — computed a chunk of tokens at a time: the [tokens, vocabulary] logits and their gradient are never
held whole (Liger Kernel's fused linear losses, Hsu et al. 2024, §3.3, without the fused kernel).

:func:`chunked_cross_entropy` takes the head's input h [N, d] (the last hidden states), its weight W [V, d] (and
bias), and the target of every row (−100: ignored), and returns the summed cross-entropy Σ_t −log softmax(W h_t)
[target_t]. In the forward it runs over the rows in chunks: each chunk's logits, their log-sum-exp, the loss, and
the gradient with respect to the chunk's logits, softmax − one-hot, folded at once into ∂L/∂h = (softmax −
one-hot) W (and ∂L/∂W, when W needs one); the backward only scales those by the incoming gradient. The peak is one
chunk's logits (``chunk`` rows × V) instead of all N × V logits, their float32 copy, log-softmax and gradient
(SmolLM2, 4,096 tokens: 0.8 GB each). :func:`naive_chunked_cross_entropy` is the plain twin the tests compare
values and gradients with.

:func:`chunked_kl_divergence` is the distillation loss likewise: τ² · Σ_t w_t · KL(softmax(t_t/τ) ‖ softmax(s_t/τ))
(Hinton, Vinyals & Dean 2015, §2) from the student's head input and weight and the teacher's, each chunk's logits of
both models computed, used and dropped in turn, and the gradient τ (q − p) w folded into ∂L/∂h (and ∂L/∂W, ∂L/∂b)
in the forward; :func:`naive_chunked_kl_divergence` is its plain twin.

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


def _fold(gradient, rows, weight, start, grad_hidden, grad_weight, grad_bias) -> None:
    """Fold one chunk's ∂L/∂logits [rows, V] into the gradients with respect to the head's input (rows `start`…),
    its weight and its bias (each None when not needed): ∂L/∂h = g W, ∂L/∂W += gᵀ h, ∂L/∂b += Σ g."""
    if grad_hidden is not None:
        grad_hidden[start : start + len(rows)] = (gradient.to(weight.dtype) @ weight).to(grad_hidden.dtype)
    if grad_weight is not None:
        grad_weight += gradient.T @ rows.float()
    if grad_bias is not None:
        grad_bias += gradient.sum(0)


def _keep_gradients(ctx, weight, bias, grad_hidden, grad_weight, grad_bias) -> None:
    """Save the gradients a forward computed, for :func:`_scaled_gradients` (those not needed: empty tensors)."""
    ctx.save_for_backward(
        *(t if t is not None else torch.empty(0) for t in (grad_hidden, grad_weight, grad_bias))
    )
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)


def _scaled_gradients(ctx, grad_output):
    """The gradients with respect to (hidden, weight, bias) the forward saved, times the incoming gradient: the
    loss is a scalar, so the backward is only that product."""
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    weight_dtype, bias_dtype = ctx.dtypes
    scale = grad_output.float()
    return (
        (grad_hidden * scale.to(grad_hidden.dtype)) if need_hidden else None,
        (grad_weight * scale).to(weight_dtype) if need_weight else None,
        (grad_bias * scale).to(bias_dtype) if need_bias else None,
    )


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
                _fold(gradient, rows, weight, start, grad_hidden, grad_weight, grad_bias)
                del gradient, logits
        _keep_gradients(ctx, weight, bias, grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return (*_scaled_gradients(ctx, grad_output), None, None, None)


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
    _check_head(hidden, weight)
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    _check_options(chunk, softcap=softcap)
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


class _ChunkedKLDivergence(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden,
        weight,
        bias,
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        weights,
        temperature,
        caps,
        chunk,
    ):
        softcap, teacher_softcap = caps
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_any = need_hidden or need_weight or need_bias
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        total = hidden.new_zeros((), dtype=torch.float32)
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                rows = hidden[start : start + chunk]
                weight_rows = weights[start : start + chunk].float()
                student = _logits(rows, weight, bias, softcap)
                # d(c·tanh(z/c))/dz = 1 − tanh²(z/c) = 1 − (s/c)², read off the capped logits s before they are
                # overwritten (no second product with the head's weight)
                slope = (
                    (student / softcap).square_().neg_().add_(1.0)
                    if softcap is not None and need_any
                    else None
                )
                # log q = log softmax(s/τ), log p = log softmax(t/τ), in place: one buffer each
                log_q = student.div_(temperature)
                log_q = log_q.sub_(torch.logsumexp(log_q, dim=-1, keepdim=True))
                log_p = _logits(
                    teacher_hidden[start : start + chunk], teacher_weight, teacher_bias, teacher_softcap
                )
                log_p = log_p.div_(temperature)
                log_p = log_p.sub_(torch.logsumexp(log_p, dim=-1, keepdim=True))
                p = log_p.exp()
                # KL(p ‖ q) per row = Σ_v p (log p − log q); 0 · log 0 = 0: a p that underflows to 0 counts nothing
                per_row = (p * log_p.sub_(log_q)).sum(-1)
                total += temperature**2 * (per_row * weight_rows).sum()
                del log_p
                if not need_any:
                    continue
                # τ² · ∂KL/∂s = τ² · (q − p)/τ = τ (q − p), times the row's weight (in place on log q's buffer)
                gradient = log_q.exp_().sub_(p).mul_(temperature * weight_rows[:, None])
                if slope is not None:
                    gradient.mul_(slope)
                _fold(gradient, rows, weight, start, grad_hidden, grad_weight, grad_bias)
                del gradient, log_q, p, slope
        _keep_gradients(ctx, weight, bias, grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return (*_scaled_gradients(ctx, grad_output), *([None] * 7))


def _check_head(hidden: torch.Tensor, weight: torch.Tensor, name: str = "") -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{name}hidden must be [N, d] and {name}weight [V, d] with the same d, got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )


def _check_options(chunk: int | None, temperature: float = 1.0, **softcaps: float | None) -> None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    for name, softcap in softcaps.items():
        if softcap is not None and not softcap > 0:
            raise ValueError(f"{name} must be positive, got {softcap!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")


def _row_weights(weights: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    if weights is None:
        return hidden.new_ones(hidden.shape[0], dtype=torch.float32)
    if weights.shape != hidden.shape[:1]:
        raise ValueError(f"weights must be [N] = [{hidden.shape[0]}], got {tuple(weights.shape)}")
    return weights.detach()


def chunked_kl_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """τ² · Σ_rows w · KL(softmax(t/τ) ‖ softmax(s/τ)): the distillation loss of Hinton, Vinyals & Dean 2015
    (§2; the τ² keeps the gradient's scale independent of τ), summed over the rows (the caller divides by their
    count), computed a chunk of rows at a time as Liger Kernel computes its fused linear losses (Hsu et al. 2024,
    §3.3): neither model's [N, V] logits nor their gradient are ever held whole.

    The student's logits are s = W h (+ b; with `softcap`, cap · tanh(· / cap)) for `hidden` [N, d] and `weight`
    [V, d]; the teacher's t likewise from `teacher_hidden` [N, d'], `teacher_weight` [V, d'], `teacher_bias` and
    `teacher_softcap`. `weights` [N]: each row's weight (an attention mask: 0 leaves a row out; default 1).

    A float32 scalar, differentiable with respect to `hidden`, `weight` and `bias`; the teacher is the target and
    gets no gradient. The gradient is computed in the forward, chunk by chunk, from τ² · ∂KL/∂s = τ (q − p) · w
    (p = softmax(t/τ), q = softmax(s/τ)), times 1 − (s/cap)² under a soft-cap. `chunk`: rows a chunk holds
    (default :func:`default_chunk`)."""
    _check_head(hidden, weight)
    _check_head(teacher_hidden, teacher_weight, "teacher_")
    if teacher_hidden.shape[0] != hidden.shape[0] or teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"the teacher must have as many rows and outputs as the student: hidden {tuple(hidden.shape)}, "
            f"teacher_hidden {tuple(teacher_hidden.shape)}, weight {tuple(weight.shape)}, teacher_weight "
            f"{tuple(teacher_weight.shape)}"
        )
    _check_options(chunk, temperature, softcap=softcap, teacher_softcap=teacher_softcap)
    chunk = chunk or default_chunk(weight.shape[0])
    return _ChunkedKLDivergence.apply(
        hidden,
        weight,
        bias,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(),
        _row_weights(weights, hidden),
        float(temperature),
        (softcap, teacher_softcap),
        chunk,
    )


def naive_chunked_kl_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The plain twin of :func:`chunked_kl_divergence`: both models' logits at once, autograd's gradients."""
    student = _logits(hidden, weight, bias, softcap) / temperature
    with torch.no_grad():
        teacher = _logits(teacher_hidden, teacher_weight, teacher_bias, teacher_softcap) / temperature
    per_row = F.kl_div(
        F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1), reduction="none", log_target=True
    ).sum(-1)
    return temperature**2 * (per_row * _row_weights(weights, hidden).float()).sum()


__all__ = [
    "CHUNK_ENTRIES",
    "IGNORE_INDEX",
    "chunked_cross_entropy",
    "chunked_kl_divergence",
    "default_chunk",
    "naive_chunked_cross_entropy",
    "naive_chunked_kl_divergence",
]
