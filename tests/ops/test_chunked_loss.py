"""The chunked next-token cross-entropy against the plain one: values and gradients (hidden states, weight, bias),
ignored rows, soft-capping, bfloat16, a chunk that does not divide the rows, bad input."""

from __future__ import annotations

import pytest
import torch

from headkit.ops.chunked_loss import chunked_cross_entropy, default_chunk, naive_chunked_cross_entropy


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
