"""The chunked next-token cross-entropy against the plain one: values and gradients (hidden states, weight, bias),
ignored rows, soft-capping, bfloat16, a chunk that does not divide the rows, bad input; and the chunked distillation
loss (KL of teacher and student) against its plain twin likewise, with masks and temperatures."""

from __future__ import annotations

import pytest
import torch

from headkit.ops.chunked_loss import (
    chunked_cross_entropy,
    chunked_kl_divergence,
    default_chunk,
    naive_chunked_cross_entropy,
    naive_chunked_kl_divergence,
)


def _inputs(rows=37, width=16, vocabulary=50, dtype=torch.float64, bias=True):
    hidden = torch.randn(rows, width, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocabulary, width, dtype=dtype) / 2).requires_grad_(True)
    offset = torch.randn(vocabulary, dtype=dtype).requires_grad_(True) if bias else None
    targets = torch.randint(vocabulary, (rows,))
    targets[::5] = -100
    return hidden, weight, offset, targets


def _value_and_gradients(loss_fn, hidden, weight, bias, targets, **kwargs):
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    loss = loss_fn(hidden, weight, targets, bias=bias, **kwargs)
    scale = torch.tensor(1.7, dtype=loss.dtype)  # an incoming gradient other than 1
    gradients = torch.autograd.grad(loss * scale, leaves)
    return loss.detach(), gradients


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 100])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_values_and_gradients_equal_the_plain_loss(chunk, softcap):
    inputs = _inputs()
    value, gradients = _value_and_gradients(chunked_cross_entropy, *inputs, chunk=chunk, softcap=softcap)
    expected, expected_gradients = _value_and_gradients(naive_chunked_cross_entropy, *inputs, softcap=softcap)
    # float32 loss accumulation; float64 weights and states
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_it_equals_a_causal_lm_loss_summed_over_real_tokens():
    hidden, weight, _, targets = _inputs(bias=False, dtype=torch.float32)
    plain = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, chunk=4), plain)


def test_bfloat16_matches_the_plain_loss_in_bfloat16():
    hidden, weight, _, targets = _inputs(dtype=torch.bfloat16, bias=False)
    value, (grad_hidden, grad_weight) = _value_and_gradients(
        chunked_cross_entropy, hidden, weight, None, targets, chunk=6
    )
    expected, (want_hidden, want_weight) = _value_and_gradients(
        naive_chunked_cross_entropy, hidden, weight, None, targets
    )
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-4)
    assert grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.bfloat16
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_weight, want_weight, rtol=2e-2, atol=2e-2)


def test_only_the_inputs_that_need_a_gradient_get_one():
    hidden, weight, _, targets = _inputs(bias=False)
    weight.requires_grad_(False)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk=7)
    (gradient,) = torch.autograd.grad(loss, [hidden])
    expected = torch.autograd.grad(naive_chunked_cross_entropy(hidden, weight, targets), [hidden])[0]
    torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_cross_entropy(hidden, weight, targets),
            naive_chunked_cross_entropy(hidden, weight, targets),
        )


def test_all_rows_ignored_is_zero():
    hidden, weight, _, targets = _inputs(bias=False)
    loss = chunked_cross_entropy(hidden, weight, torch.full_like(targets, -100), chunk=8)
    assert float(loss.detach()) == 0.0
    assert float(torch.autograd.grad(loss, [hidden])[0].abs().max()) == 0.0


def test_default_chunk_bounds_the_logits():
    assert default_chunk(49_152) == 341
    assert default_chunk(10**9) == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda h, w, t: (h[:, :3], w, t), "same d"),
        (lambda h, w, t: (h, w, t[:3]), "targets must be"),
    ],
)
def test_bad_shapes_are_refused(change, message):
    hidden, weight, _, targets = _inputs(bias=False)
    with pytest.raises(ValueError, match=message):
        chunked_cross_entropy(*change(hidden, weight, targets))


@pytest.mark.parametrize("kwargs, message", [({"chunk": 0}, "chunk"), ({"softcap": 0.0}, "softcap")])
def test_bad_options_are_refused(kwargs, message):
    hidden, weight, _, targets = _inputs(bias=False)
    with pytest.raises(ValueError, match=message):
        chunked_cross_entropy(hidden, weight, targets, **kwargs)


# The chunked distillation loss: KL(teacher ‖ student) from both heads' inputs.


def _kl_inputs(rows=37, width=16, vocabulary=50, dtype=torch.float64, bias=True, teacher_width=12):
    hidden, weight, offset, _ = _inputs(rows, width, vocabulary, dtype, bias)
    teacher_hidden = torch.randn(rows, teacher_width, dtype=dtype)
    teacher_weight = torch.randn(vocabulary, teacher_width, dtype=dtype) / 2
    teacher_bias = torch.randn(vocabulary, dtype=dtype) if bias else None
    weights = (torch.arange(rows) % 4 != 0).to(dtype)  # a mask: every fourth row left out
    return hidden, weight, offset, teacher_hidden, teacher_weight, teacher_bias, weights


def _kl_value_and_gradients(
    loss_fn, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, **kwargs
):
    leaves = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    loss = loss_fn(
        hidden, weight, teacher_hidden, teacher_weight, bias=bias, teacher_bias=teacher_bias, **kwargs
    )
    scale = torch.tensor(1.7, dtype=loss.dtype)  # an incoming gradient other than 1
    return loss.detach(), torch.autograd.grad(loss * scale, leaves)


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 100])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("masked", [False, True])
def test_kl_values_and_gradients_equal_the_plain_loss(chunk, softcap, temperature, masked):
    *inputs, weights = _kl_inputs()
    options = {"softcap": softcap, "teacher_softcap": softcap and 4.0, "temperature": temperature}
    options["weights"] = weights if masked else None
    value, gradients = _kl_value_and_gradients(chunked_kl_divergence, *inputs, chunk=chunk, **options)
    expected, expected_gradients = _kl_value_and_gradients(naive_chunked_kl_divergence, *inputs, **options)
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
    assert len(gradients) == 3
    for got, want in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kl_in_float32_equals_the_plain_loss():
    *inputs, weights = _kl_inputs(dtype=torch.float32)
    options = {"weights": weights, "temperature": 2.0, "softcap": 5.0, "teacher_softcap": 5.0}
    value, gradients = _kl_value_and_gradients(chunked_kl_divergence, *inputs, chunk=6, **options)
    expected, expected_gradients = _kl_value_and_gradients(naive_chunked_kl_divergence, *inputs, **options)
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(gradients, expected_gradients, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_kl_gradient_is_tau_times_q_minus_p():
    """The derivation, by hand: τ² ∂KL(p ‖ q)/∂s = τ (q − p) per row, times its weight (no soft-cap)."""
    student = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(6, 9, dtype=torch.float64)
    identity = torch.eye(9, dtype=torch.float64)
    weights = torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    loss = chunked_kl_divergence(
        student, identity, teacher, identity, weights=weights, temperature=3.0, chunk=4
    )
    (gradient,) = torch.autograd.grad(loss, [student])
    p, q = torch.softmax(teacher / 3.0, -1), torch.softmax(student.detach() / 3.0, -1)
    # the logits are float32 inside: float32 precision
    torch.testing.assert_close(gradient, 3.0 * (q - p) * weights[:, None], rtol=1e-5, atol=1e-6)
    expected = 9.0 * (weights * (p * (p.log() - q.log())).sum(-1)).sum()
    torch.testing.assert_close(loss, expected.float())


def test_kl_is_zero_for_the_teacher_and_the_teacher_gets_no_gradient():
    hidden, weight, bias, *_ = _kl_inputs()
    teacher_hidden = hidden.detach().clone().requires_grad_(True)
    loss = chunked_kl_divergence(
        hidden, weight, teacher_hidden, weight, bias=bias, teacher_bias=bias, chunk=7
    )
    assert abs(float(loss.detach())) < 1e-6
    loss.backward()
    assert teacher_hidden.grad is None
    assert float(hidden.grad.abs().max()) < 1e-6


def test_kl_only_the_inputs_that_need_a_gradient_get_one():
    hidden, weight, _, teacher_hidden, teacher_weight, _, weights = _kl_inputs(bias=False)
    weight.requires_grad_(False)  # a frozen head (LoRA): only the hidden states get a gradient
    loss = chunked_kl_divergence(hidden, weight, teacher_hidden, teacher_weight, weights=weights, chunk=7)
    (gradient,) = torch.autograd.grad(loss, [hidden])
    plain = naive_chunked_kl_divergence(hidden, weight, teacher_hidden, teacher_weight, weights=weights)
    torch.testing.assert_close(gradient, torch.autograd.grad(plain, [hidden])[0], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_kl_divergence(hidden, weight, teacher_hidden, teacher_weight),
            naive_chunked_kl_divergence(hidden, weight, teacher_hidden, teacher_weight),
        )


def test_kl_bfloat16_matches_the_plain_loss_in_bfloat16():
    hidden, weight, _, teacher_hidden, teacher_weight, _, weights = _kl_inputs(
        dtype=torch.bfloat16, bias=False
    )
    inputs = (hidden, weight, None, teacher_hidden, teacher_weight, None)
    value, (grad_hidden, grad_weight) = _kl_value_and_gradients(
        chunked_kl_divergence, *inputs, weights=weights, chunk=6
    )
    expected, (want_hidden, want_weight) = _kl_value_and_gradients(
        naive_chunked_kl_divergence, *inputs, weights=weights
    )
    torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-3)
    assert grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.bfloat16
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_weight, want_weight, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda h, w, th, tw, m: (h[:, :3], w, th, tw, m), "same d"),
        (lambda h, w, th, tw, m: (h, w, th[:, :3], tw, m), "teacher_hidden must be"),
        (lambda h, w, th, tw, m: (h, w, th[:5], tw, m), "as many rows"),
        (lambda h, w, th, tw, m: (h, w, th, tw[:7], m), "as many rows"),
        (lambda h, w, th, tw, m: (h, w, th, tw, m[:3]), "weights must be"),
    ],
)
def test_kl_bad_shapes_are_refused(change, message):
    hidden, weight, _, teacher_hidden, teacher_weight, _, weights = _kl_inputs(bias=False)
    h, w, th, tw, m = change(hidden, weight, teacher_hidden, teacher_weight, weights)
    with pytest.raises(ValueError, match=message):
        chunked_kl_divergence(h, w, th, tw, weights=m)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk": 0}, "chunk"),
        ({"softcap": 0.0}, "softcap"),
        ({"teacher_softcap": -1.0}, "teacher_softcap"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_kl_bad_options_are_refused(kwargs, message):
    hidden, weight, _, teacher_hidden, teacher_weight, _, _ = _kl_inputs(bias=False)
    with pytest.raises(ValueError, match=message):
        chunked_kl_divergence(hidden, weight, teacher_hidden, teacher_weight, **kwargs)
