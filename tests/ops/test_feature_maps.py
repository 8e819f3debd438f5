"""Feature maps φ of linear attention: the built-in maps, lookup and registration, and Hedgehog's learnable map."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headkit.ops import FEATURE_MAPS, get_feature_map, hedgehog_feature_map, register_feature_map


@pytest.fixture(autouse=True)
def restore_feature_maps():
    saved = dict(FEATURE_MAPS)
    yield
    FEATURE_MAPS.clear()
    FEATURE_MAPS.update(saved)


def test_the_registry_holds_the_documented_maps():
    assert {"elu", "relu", "identity"} <= set(FEATURE_MAPS)


def test_elu_map_is_elu_plus_one_positive_with_the_elu_gradient():
    x = torch.linspace(-30.0, 60.0, 1001, dtype=torch.float64).requires_grad_()
    phi = FEATURE_MAPS["elu"](x)
    # elu(x) + 1 = exp(x) for x ≤ 0, up to the rounding of expm1(x) + 1 near 1.
    assert torch.allclose(phi, torch.where(x > 0, x + 1, torch.exp(x)), rtol=1e-12, atol=2e-16)
    assert bool((phi > 0).all())
    (grad,) = torch.autograd.grad(phi.sum(), x)
    assert torch.allclose(grad, torch.where(x > 0, torch.ones_like(x), torch.exp(x)), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_elu_map_without_autograd_agrees_with_elu_plus_one_to_a_few_ulp(dtype):
    # Without autograd on CPU, from 2^14 elements, the map takes its exp2 form; it must agree with elu(x) + 1
    # (the autograd form) to a couple of ulp of 1, including the edges: 0, ±inf, NaN, rounding to 0 far below 0.
    special = torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, float("inf"), float("-inf"), -200.0, 200.0], dtype=dtype
    )
    x = torch.cat([torch.linspace(-30.0, 60.0, 20001, dtype=dtype), torch.randn(4096, dtype=dtype), special])
    assert x.numel() >= 1 << 14
    expected = F.elu(x) + 1
    with torch.no_grad():
        fast = FEATURE_MAPS["elu"](x.clone().requires_grad_())
    plain = FEATURE_MAPS["elu"](x)  # no input requires grad: also the fast form
    eps = torch.finfo(dtype).eps
    for phi in (fast, plain):
        assert phi.dtype == dtype and not phi.requires_grad
        assert torch.allclose(phi, expected, rtol=2 * eps, atol=2 * eps, equal_nan=True)
        assert torch.equal(phi[x > 0], expected[x > 0])  # x + 1, rounded once
        assert bool((phi[x < -40] == 0).all()) and bool((phi[(x > -5) & (x <= 0)] > 0).all())
    nan = FEATURE_MAPS["elu"](torch.tensor([float("nan")], dtype=dtype))
    assert bool(nan.isnan().all())


def test_elu_map_gradients_of_every_order_and_under_torch_func_match_elu():
    x = (torch.randn(64, dtype=torch.float64) * 3).requires_grad_()
    phi = FEATURE_MAPS["elu"]
    assert torch.autograd.gradcheck(phi, (x,))
    assert torch.autograd.gradgradcheck(phi, (x,))
    (grad,) = torch.autograd.grad(phi(x).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), x)
    torch.testing.assert_close(second, torch.where(x > 0, 0.0, torch.exp(x)).detach(), rtol=1e-12, atol=0)
    batched = torch.func.vmap(torch.func.grad(lambda row: phi(row).sum()))(x.detach().view(8, 8))
    torch.testing.assert_close(batched.flatten(), torch.where(x > 0, 1.0, torch.exp(x)).detach())


def test_elu_map_on_a_few_elements_is_elu_plus_one_exactly():
    # A decoding step's keys are a few hundred elements: one elu kernel beats the exp2 form's seven.
    x = torch.randn(2, 4, 1, 64)
    assert torch.equal(FEATURE_MAPS["elu"](x), F.elu(x).add_(1.0))


def test_elu_map_in_low_precision_is_elu_plus_one_exactly():
    x = torch.randn(512).to(torch.bfloat16)
    assert torch.equal(FEATURE_MAPS["elu"](x), F.elu(x).add_(1.0))


def test_elu_map_leaves_its_input_untouched():
    x = torch.randn(4, 8)
    before = x.clone()
    FEATURE_MAPS["elu"](x)
    assert torch.equal(x, before)


def test_relu_and_identity_maps():
    x = torch.randn(3, 5, 8)
    assert torch.equal(FEATURE_MAPS["relu"](x), x.clamp(min=0))
    assert torch.equal(FEATURE_MAPS["identity"](x), x)


@pytest.mark.parametrize("name", ["elu", "relu", "identity"])
def test_get_feature_map_by_name_returns_the_registered_callable(name):
    assert get_feature_map(name) is FEATURE_MAPS[name]


def test_get_feature_map_passes_a_callable_through():
    def squared(x: torch.Tensor) -> torch.Tensor:
        return x * x

    assert get_feature_map(squared) is squared


@pytest.mark.parametrize("bad", ["softmax", "", 3, None])
def test_get_feature_map_rejects_unknown_names_listing_the_valid_ones(bad):
    with pytest.raises(ValueError, match=r"feature_map must be one of \['elu', 'identity', 'relu'\]"):
        get_feature_map(bad)


def test_register_feature_map_adds_a_name():
    register_feature_map("softplus", F.softplus)
    assert get_feature_map("softplus") is F.softplus
    with pytest.raises(ValueError, match="softplus"):  # now listed among the valid names
        get_feature_map("nope")


def test_register_feature_map_refuses_a_duplicate_unless_overwrite():
    with pytest.raises(ValueError, match="'elu' is already registered; pass overwrite=True"):
        register_feature_map("elu", F.softplus)
    assert FEATURE_MAPS["elu"] is not F.softplus
    register_feature_map("elu", F.softplus, overwrite=True)
    assert get_feature_map("elu") is F.softplus


@pytest.mark.parametrize(
    "name,fn,message",
    [
        ("", F.relu, "name must be a non-empty string"),
        (3, F.relu, "name must be"),
        ("x", 42, "fn must be callable"),
    ],
)
def test_register_feature_map_rejects_bad_arguments(name, fn, message):
    with pytest.raises(ValueError, match=message):
        register_feature_map(name, fn)
    assert name not in FEATURE_MAPS


# --- Hedgehog (Zhang et al. 2024) --------------------------------------------------------------------------------


def naive_hedgehog(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Head by head: [softmax(x_h W_h), softmax(−x_h W_h)] over the feature dimension."""
    heads = []
    for head in range(x.shape[1]):
        projected = x[:, head] @ weight[head]
        heads.append(torch.cat([projected.softmax(-1), (-projected).softmax(-1)], dim=-1))
    return torch.stack(heads, dim=1)


@pytest.mark.parametrize("head_dim, feature_dim", [(8, 8), (8, 5), (4, 12)])
def test_hedgehog_map_shape_positivity_and_halves_summing_to_one(head_dim, feature_dim):
    x = torch.randn(2, 3, 7, head_dim) * 4
    weight = torch.randn(3, head_dim, feature_dim)
    phi = hedgehog_feature_map(x, weight)
    assert phi.shape == (2, 3, 7, 2 * feature_dim) and phi.dtype == x.dtype
    assert bool((phi > 0).all())
    ones = torch.ones(2, 3, 7)
    torch.testing.assert_close(phi[..., :feature_dim].sum(-1), ones)
    torch.testing.assert_close(phi[..., feature_dim:].sum(-1), ones)
    torch.testing.assert_close(phi, naive_hedgehog(x, weight))


def test_hedgehog_map_gradients_match_the_per_head_loop_and_pass_gradcheck():
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(hedgehog_feature_map, (x, weight))
    grad_out = torch.randn(2, 3, 5, 12, dtype=torch.float64)
    grads = torch.autograd.grad(hedgehog_feature_map(x, weight), (x, weight), grad_out)
    expected = torch.autograd.grad(naive_hedgehog(x, weight), (x, weight), grad_out)
    for actual, reference in zip(grads, expected, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-12, atol=1e-12)


def test_hedgehog_map_stays_finite_for_huge_inputs_and_computes_bf16_in_float32():
    x = torch.randn(1, 2, 4, 8) * 1e4
    weight = torch.randn(2, 8, 8)
    assert bool(torch.isfinite(hedgehog_feature_map(x, weight)).all())
    half = hedgehog_feature_map(x.bfloat16() / 1e4, weight.bfloat16())
    assert half.dtype == torch.bfloat16
    reference = naive_hedgehog(x.bfloat16().double() / 1e4, weight.bfloat16().double())
    torch.testing.assert_close(half.double(), reference, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize(
    "x, weight, message",
    [
        (torch.zeros(2, 3, 8), torch.zeros(3, 8, 8), r"x must have shape \[batch, heads, seq, head_dim\]"),
        (
            torch.zeros(1, 3, 2, 8),
            torch.zeros(8, 8),
            r"weight must have shape \[heads, head_dim, feature_dim\]",
        ),
        (torch.zeros(1, 3, 2, 8), torch.zeros(2, 8, 8), r"= \[3, 8, feature_dim\]"),
        (torch.zeros(1, 3, 2, 8), torch.zeros(3, 4, 8), r"= \[3, 8, feature_dim\]"),
    ],
)
def test_hedgehog_map_rejects_mismatched_shapes(x, weight, message):
    with pytest.raises(ValueError, match=message):
        hedgehog_feature_map(x, weight)
