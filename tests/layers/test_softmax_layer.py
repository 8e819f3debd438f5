"""SoftmaxAttention against a plain per-head reference: outputs, gradients, caching, weights, positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headkit.layers import HeadkitCache, SoftmaxAttention, softmax_attention_weights
from headkit.models import HeadkitConfig

BATCH, SEQ, HIDDEN = 2, 6, 32


def make_layer(seed: int = 0, **overrides) -> SoftmaxAttention:
    settings = dict(
        vocab_size=11, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, initializer_range=0.2
    )
    config = HeadkitConfig(**{**settings, **overrides})
    torch.manual_seed(seed)
    layer = SoftmaxAttention(config, layer_idx=0)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return layer.eval()


def naive_rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE as complex multiplication: pair (i, i + D/2) is the complex number x_i + j·x_{i+D/2}, times e^{j·m·θ_i}."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = positions.double()[..., None] * frequencies  # [B, T, D/2]
    rotated = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
        torch.ones_like(angles), angles
    )
    return torch.cat([rotated.real, rotated.imag], dim=-1).to(x.dtype)


def naive_softmax_layer(
    layer: SoftmaxAttention,
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vaswani et al. Eq. 1 head by head: explicit scores, causal + padding masks, softmax, concat, W_O."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = layer.num_heads, layer.num_key_value_heads, layer.head_dim
    positions = torch.arange(seq).expand(batch, seq) if positions is None else positions.expand(batch, seq)
    mask = torch.ones(batch, seq, dtype=torch.bool) if mask is None else mask.bool()
    queries = layer.q_proj(x).view(batch, seq, heads, head_dim)
    keys = layer.k_proj(x).view(batch, seq, kv_heads, head_dim)
    values = layer.v_proj(x).view(batch, seq, kv_heads, head_dim)
    head_outputs, all_weights = [], []
    for head in range(heads):
        kv_head = head // (heads // kv_heads)
        q, k, v = queries[:, :, head], keys[:, :, kv_head], values[:, :, kv_head]
        if layer.use_rope:
            q, k = naive_rotate(q, positions), naive_rotate(k, positions)
        scores = q @ k.transpose(-1, -2) / head_dim**0.5
        visible = torch.ones(seq, seq, dtype=torch.bool).tril() & mask[:, None, :]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
        head_outputs.append(weights @ v)
        all_weights.append(weights)
    return layer.o_proj(torch.cat(head_outputs, dim=-1)), torch.stack(all_weights, dim=1)


LAYER_VARIANTS = {
    "mha_rope": {},
    "gqa_rope": {"num_key_value_heads": 2},
    "mqa_no_positions": {"num_key_value_heads": 1, "position_embedding_type": "none"},
    "mha_bias": {"attention_bias": True},
}


@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
@pytest.mark.parametrize("padded", [False, True])
def test_outputs_and_gradients_match_the_naive_reference(variant, padded):
    layer = make_layer(**LAYER_VARIANTS[variant])
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:
        mask[0, :2] = 0  # left padding
        mask[1, -1] = 0  # right padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    out, weights = layer(x, attention_mask=mask, position_ids=positions)
    expected, _ = naive_softmax_layer(layer, x, mask, positions)
    assert weights is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    inputs = [x, *layer.parameters()]
    grad_out = torch.randn_like(out)
    actual_grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    for actual, reference in zip(actual_grads, expected_grads, strict=True):
        # float32 gradients through a softmax, summed in another order: 2e-5 relative on some CPUs
        torch.testing.assert_close(actual, reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
def test_output_attentions_returns_the_reference_weights(variant):
    layer = make_layer(**LAYER_VARIANTS[variant])
    x = torch.randn(BATCH, SEQ, HIDDEN)
    mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        out, weights = layer(x, attention_mask=mask, output_attentions=True)
        fast_out, _ = layer(x, attention_mask=mask)
        expected_out, expected_weights = naive_softmax_layer(layer, x, mask)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, fast_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
def test_cached_decoding_equals_the_full_forward(variant):
    layer = make_layer(**LAYER_VARIANTS[variant])
    x = torch.randn(BATCH, SEQ + 3, HIDDEN)
    mask = torch.ones(BATCH, SEQ + 3, dtype=torch.long)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = HeadkitCache(layer)
    with torch.no_grad():
        full, _ = layer(x, attention_mask=mask, position_ids=positions)
        pieces = [layer(x[:, :SEQ], mask[:, :SEQ], positions[:, :SEQ], cache=cache, use_cache=True)[0]]
        for t in range(SEQ, SEQ + 3):
            step, weights = layer(
                x[:, t : t + 1],
                mask[:, : t + 1],
                positions[:, t : t + 1],
                cache=cache,
                use_cache=True,
                output_attentions=True,
            )
            assert weights.shape == (BATCH, layer.num_heads, 1, t + 1)
            pieces.append(step)
    assert cache.get_seq_length() == SEQ + 3
    assert cache.layers[0].keys.shape == (BATCH, layer.num_key_value_heads, SEQ + 3, layer.head_dim)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_default_positions_continue_after_the_cache():
    layer = make_layer()
    x = torch.randn(1, 5, HIDDEN)
    with torch.no_grad():
        full, _ = layer(x)
        cache = HeadkitCache(layer)
        layer(x[:, :3], cache=cache, use_cache=True)
        rest, _ = layer(x[:, 3:], cache=cache, use_cache=True)
    torch.testing.assert_close(rest, full[:, 3:], atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_on_relative_positions_only():
    layer = make_layer()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    positions = torch.arange(SEQ)[None]
    with torch.no_grad():
        near, near_weights = layer(x, position_ids=positions, output_attentions=True)
        far, far_weights = layer(x, position_ids=positions + 1000, output_attentions=True)
        unrotated = make_layer(position_embedding_type="none")(x)[0]
    torch.testing.assert_close(far_weights, near_weights, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(far, near, atol=1e-4, rtol=1e-4)
    assert (unrotated - near).abs().max() > 1e-3  # the positions do matter


def test_attention_dropout_drops_attention_probabilities():
    layer = make_layer(attention_dropout=0.5).train()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    torch.manual_seed(7)
    out, _ = layer(x)

    with torch.no_grad():
        _, weights = layer.eval()(x, output_attentions=True)
        values = layer.split_heads(layer.v_proj(x), layer.num_key_value_heads)
        values = values.repeat_interleave(layer.num_key_value_groups, dim=1)
        torch.manual_seed(7)
        expected = layer.project_heads(F.dropout(weights, p=0.5, training=True) @ values)
    torch.testing.assert_close(out.detach(), expected, atol=1e-5, rtol=1e-5)
    assert (out.detach() - layer(x)[0]).abs().max() > 1e-3


def test_fully_padded_queries_give_zero_weights_not_nan():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    mask = torch.tensor([[False, True, True]])
    weights = softmax_attention_weights(q, k, causal=True, attention_mask=mask)
    assert torch.equal(weights[0, :, 0], torch.zeros(2, 3))
    torch.testing.assert_close(weights[0, :, 1:].sum(-1), torch.ones(2, 2))


def test_projections_are_linear_modules_named_for_peft():
    layer = make_layer(num_key_value_heads=2)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer, name), torch.nn.Linear)
    assert layer.k_proj.out_features == 2 * layer.head_dim


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention_mask": torch.ones(BATCH, SEQ + 1, dtype=torch.bool)}, "attention_mask"),
        ({"attention_mask": torch.ones(BATCH, SEQ)}, "attention_mask"),
        ({"position_ids": torch.arange(SEQ)}, "position_ids"),
        ({"position_ids": torch.zeros(3, SEQ, dtype=torch.long)}, "position_ids"),
    ],
)
def test_bad_inputs_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_layer()(torch.randn(BATCH, SEQ, HIDDEN), **kwargs)
