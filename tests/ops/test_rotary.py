"""Rotary embeddings: frequencies, the rotation itself, linear and dynamic-NTK scaling, argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from headkit.ops.rotary import apply_rotary, naive_rotary, rope_inverse_frequencies, rotary_cos_sin


def formula_frequencies(head_dim: int, base: float) -> torch.Tensor:
    """θ_i = base^(−2i/D) in float64, written out independently of the module."""
    return torch.tensor([base ** (-2.0 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= rel * max(expected.double().abs().max().item(), 1e-12), f"max error {error:.3e}"


@pytest.mark.parametrize("head_dim", [2, 8, 64, 128])
@pytest.mark.parametrize("rope_theta", [10000.0, 500000.0])
def test_inverse_frequencies_follow_the_formula(head_dim, rope_theta):
    frequencies = rope_inverse_frequencies(head_dim, rope_theta=rope_theta)
    assert frequencies.dtype == torch.float32 and frequencies.shape == (head_dim // 2,)
    torch.testing.assert_close(
        frequencies.double(), formula_frequencies(head_dim, rope_theta), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("batch_positions", [False, True])
@pytest.mark.parametrize("head_dim", [2, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_apply_rotary_equals_the_complex_reference(batch_positions, head_dim, dtype):
    torch.manual_seed(0)
    batch, heads, seq = 2, 3, 11
    x = torch.randn(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True)
    if batch_positions:
        position_ids = torch.stack([torch.arange(seq), torch.randint(0, 5000, (seq,))])
    else:
        position_ids = torch.arange(7, 7 + seq)
    cos, sin = rotary_cos_sin(position_ids, head_dim)
    assert cos.shape == sin.shape == (batch if batch_positions else 1, seq, head_dim // 2)

    rotated = apply_rotary(x, cos, sin)
    reference = naive_rotary(x, position_ids)
    assert rotated.dtype == dtype
    assert_close_rel(rotated, reference, 1e-6)
    upstream = torch.randn_like(rotated)
    (grad,) = torch.autograd.grad(rotated, x, upstream)
    (grad_reference,) = torch.autograd.grad(reference, x, upstream)
    assert_close_rel(grad, grad_reference, 1e-6)


def test_rotation_keeps_norms_and_makes_dot_products_relative():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
    positions = torch.arange(16)
    dots = (
        apply_rotary(q, *rotary_cos_sin(positions, 32)) @ apply_rotary(k, *rotary_cos_sin(positions, 32)).mT
    )
    shifted = rotary_cos_sin(positions + 1000, 32)
    dots_shifted = apply_rotary(q, *shifted) @ apply_rotary(k, *shifted).mT
    assert_close_rel(dots_shifted, dots, 1e-5)
    torch.testing.assert_close(apply_rotary(q, *shifted).norm(dim=-1), q.norm(dim=-1))


def test_apply_rotary_keeps_bfloat16():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8, 16)
    cos, sin = rotary_cos_sin(torch.arange(8), 16)
    rotated = apply_rotary(x.bfloat16(), cos, sin)
    assert rotated.dtype == torch.bfloat16
    assert_close_rel(rotated.float(), apply_rotary(x, cos, sin), 1e-2)


@pytest.mark.parametrize("factor", [0.5, 2.0, 4.0])
@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_linear_scaling_divides_the_positions(factor, key):
    head_dim, positions = 16, torch.arange(0, 300, 7)
    cos, sin = rotary_cos_sin(positions, head_dim, rope_scaling={key: "linear", "factor": factor})
    angles = (positions.double() / factor)[:, None] * formula_frequencies(head_dim, 10000.0)
    torch.testing.assert_close(cos[0].double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0].double(), angles.sin(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("length", [1, 17, 64])
@pytest.mark.parametrize("factor", [1.0, 2.0, 8.0])
def test_dynamic_ntk_is_plain_rope_up_to_the_trained_length(length, factor):
    scaling = {"rope_type": "dynamic", "factor": factor}
    positions = torch.arange(length)
    dynamic = rotary_cos_sin(positions, 32, rope_scaling=scaling, max_position_embeddings=64)
    plain = rotary_cos_sin(positions, 32)
    assert torch.equal(dynamic[0], plain[0]) and torch.equal(dynamic[1], plain[1])


@pytest.mark.parametrize("length", [65, 200])
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_dynamic_ntk_grows_the_base_beyond_the_trained_length(length, factor):
    head_dim, trained = 32, 64
    positions = torch.arange(length)
    cos, sin = rotary_cos_sin(
        positions,
        head_dim,
        rope_scaling={"rope_type": "dynamic", "factor": factor},
        max_position_embeddings=trained,
    )
    base = 10000.0 * (factor * length / trained - (factor - 1)) ** (head_dim / (head_dim - 2))
    angles = positions.double()[:, None] * formula_frequencies(head_dim, base)
    torch.testing.assert_close(cos[0].double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0].double(), angles.sin(), rtol=0, atol=1e-6)
    plain_cos, _ = rotary_cos_sin(positions, head_dim)
    assert (cos - plain_cos).abs().max() > 1e-3


@pytest.mark.parametrize("seq_len", [10, 32, 33, 100, 4096])
def test_dynamic_ntk_matches_transformers(seq_len):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_parameters = {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0}
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=32,
        rope_parameters=dict(rope_parameters),
    )
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=seq_len)
    ours = rope_inverse_frequencies(
        16, rope_scaling=rope_parameters, seq_len=seq_len, max_position_embeddings=32
    )
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)


def test_dynamic_ntk_is_stateless():
    scaling = {"rope_type": "dynamic", "factor": 4.0}
    short = torch.arange(20)
    before = rotary_cos_sin(short, 16, rope_scaling=scaling, max_position_embeddings=32)
    long = rotary_cos_sin(torch.arange(500), 16, rope_scaling=scaling, max_position_embeddings=32)
    after = rotary_cos_sin(short, 16, rope_scaling=scaling, max_position_embeddings=32)
    plain = rotary_cos_sin(short, 16)
    assert torch.equal(after[0], plain[0]) and torch.equal(after[1], plain[1])
    assert torch.equal(before[0], after[0])
    assert not torch.allclose(long[0][:, :20], plain[0])


def test_dynamic_ntk_prefers_original_max_position_embeddings():
    positions = torch.arange(100)
    from_dict = rotary_cos_sin(
        positions,
        16,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 50},
        max_position_embeddings=4096,
    )
    from_argument = rotary_cos_sin(
        positions, 16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=50
    )
    assert torch.equal(from_dict[0], from_argument[0])
    assert not torch.equal(from_dict[0], rotary_cos_sin(positions, 16)[0])


def test_dynamic_ntk_scales_for_the_largest_position_of_the_batch():
    positions = torch.stack([torch.arange(10), torch.arange(90, 100)])
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    cos, _ = rotary_cos_sin(positions, 16, rope_scaling=scaling, max_position_embeddings=32)
    alone, _ = rotary_cos_sin(torch.arange(90, 100), 16, rope_scaling=scaling, max_position_embeddings=32)
    assert torch.equal(cos[1], alone[0])
    forced, _ = rotary_cos_sin(
        torch.arange(10), 16, rope_scaling=scaling, max_position_embeddings=32, seq_len=100
    )
    assert torch.equal(cos[0], forced[0])


def test_rope_parameters_dict_with_matching_theta_is_accepted():
    scaling = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    ours = rope_inverse_frequencies(8, rope_theta=500000.0, rope_scaling=scaling)
    torch.testing.assert_close(ours.double(), formula_frequencies(8, 500000.0) / 2, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rope_inverse_frequencies(7), "head_dim"),
        (lambda: rope_inverse_frequencies(0), "head_dim"),
        (lambda: rotary_cos_sin(torch.arange(4), 9), "head_dim"),
        (lambda: rope_inverse_frequencies(8, rope_theta=-1.0), "rope_theta"),
        (lambda: rope_inverse_frequencies(8, rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type"),
        (lambda: rope_inverse_frequencies(8, rope_scaling={"rope_type": "linear"}), "factor"),
        (lambda: rope_inverse_frequencies(8, rope_scaling={"rope_type": "linear", "factor": 0.0}), "factor"),
        (
            lambda: rope_inverse_frequencies(8, rope_scaling={"rope_type": "linear", "factor": math.nan}),
            "factor",
        ),
        (
            lambda: rope_inverse_frequencies(
                8, rope_scaling={"rope_type": "dynamic", "factor": 0.5}, max_position_embeddings=16
            ),
            "factor",
        ),
        (
            lambda: rope_inverse_frequencies(8, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            "max_position",
        ),
        (lambda: rope_inverse_frequencies(8, rope_scaling={"rope_type": "default", "factor": 2.0}), "factor"),
        (lambda: rope_inverse_frequencies(8, rope_scaling={"rope_type": "linear", "factr": 2.0}), "factr"),
        (
            lambda: rope_inverse_frequencies(8, rope_scaling={"rope_type": "linear", "type": "dynamic"}),
            "type",
        ),
        (lambda: rope_inverse_frequencies(8, rope_scaling="linear"), "rope_scaling"),
        (lambda: rope_inverse_frequencies(8, rope_scaling={"rope_theta": 5.0}), "rope_theta"),
        (lambda: rope_inverse_frequencies(8, max_position_embeddings=-3), "max_position_embeddings"),
        (lambda: rotary_cos_sin(torch.arange(4.0), 8), "position_ids"),
        (lambda: rotary_cos_sin(torch.zeros(1, 2, 4, dtype=torch.long), 8), "position_ids"),
        (lambda: apply_rotary(torch.randn(2, 4, 8), *rotary_cos_sin(torch.arange(4), 8)), "x"),
        (lambda: apply_rotary(torch.randn(1, 2, 4, 8), *rotary_cos_sin(torch.arange(5), 8)), "cos"),
        (lambda: apply_rotary(torch.randn(1, 2, 4, 8), *rotary_cos_sin(torch.arange(4), 6)), "cos"),
        (
            lambda: apply_rotary(
                torch.randn(3, 2, 4, 8), *rotary_cos_sin(torch.zeros(2, 4, dtype=torch.long), 8)
            ),
            "cos",
        ),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()
