"""AdditiveAttention (Fastformer) against a plain per-head, per-position reference: causal, windowed and
bidirectional pooling, the causal convolution, padding, the constant-size decoding state, gates."""

from __future__ import annotations

import pytest
import torch

from headkit.layers import AdditiveAttention, AdditiveState, HeadkitCache
from headkit.layers.gates import FixedGate
from headkit.models import HeadkitConfig

BATCH, SEQ, HIDDEN = 2, 7, 32


def make_layer(seed: int = 0, **overrides) -> AdditiveAttention:
    settings = dict(
        vocab_size=11,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        attention="additive",
        chunk_size=3,  # several chunks of the pooling scan even in short tests
    )
    config = HeadkitConfig(**{**settings, **overrides})
    torch.manual_seed(seed)
    layer = AdditiveAttention(config, layer_idx=0)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return layer.eval()


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 agreement relative to the tensor's scale: the convolution makes outputs in the hundreds."""
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-5)


def naive_causal_conv(layer: AdditiveAttention, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x_t + Σ_r W_r x_{t − (k − 1) + r}, x = 0 before the sequence and at padding; W_r block-diagonal by group."""
    weight = layer.conv.weight  # [C, C / groups, k]
    groups = layer.conv.groups
    per_group = x.shape[-1] // groups
    x = x * keep[..., None]
    kernel = weight.shape[-1]
    convolved = torch.zeros_like(x)
    for tap in range(kernel):
        dense = torch.block_diag(
            *[weight[g * per_group : (g + 1) * per_group, :, tap] for g in range(groups)]
        )
        shift = kernel - 1 - tap  # this tap reads the input `shift` positions back
        shifted = torch.cat([x.new_zeros(x.shape[0], shift, x.shape[2]), x[:, : x.shape[1] - shift]], dim=1)
        convolved = convolved + shifted @ dense.T
    return x + convolved


def naive_pool(x: torch.Tensor, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Σ_j softmax(scores over the visible j) x_j, for one query position: x [B, T, D], scores/visible [B, T]."""
    rows = []
    for b in range(x.shape[0]):
        if not visible[b].any():
            rows.append(x.new_zeros(x.shape[-1]))
            continue
        weights = torch.softmax(scores[b][visible[b]], dim=0)
        rows.append(weights @ x[b][visible[b]])
    return torch.stack(rows)


def naive_additive_layer(
    layer: AdditiveAttention, x: torch.Tensor, mask: torch.Tensor | None = None, head_scale=None
) -> torch.Tensor:
    """Wu et al. 2021 Eq. 1-6 head by head and position by position, each position pooling what it may see:
    its prefix (causal), the last `window` positions, or everything (bidirectional); padding never."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = layer.num_heads, layer.num_key_value_heads, layer.head_dim
    keep = torch.ones(batch, seq, dtype=torch.bool) if mask is None else mask.bool()
    if layer.conv is not None:
        x = naive_causal_conv(layer, x, keep)
    flat_queries = layer.q_proj(x)
    queries = flat_queries.view(batch, seq, heads, head_dim)
    keys = layer.k_proj(x).view(batch, seq, kv_heads, head_dim)
    values = layer.v_proj(x).view(batch, seq, kv_heads, head_dim)

    def visible_from(t: int) -> torch.Tensor:
        positions = torch.arange(seq)
        seen = torch.ones(seq, dtype=torch.bool)
        if layer.causal:
            seen = positions <= t
            if layer.window is not None:
                seen &= positions > t - layer.window
        return keep & seen

    head_outputs = []
    for head in range(heads):
        kv_head = head // (heads // kv_heads)
        q, k, v = queries[:, :, head], keys[:, :, kv_head], values[:, :, kv_head]
        query_scores = q @ layer.query_score_weight[head] / head_dim**0.5
        global_queries = torch.stack([naive_pool(q, query_scores, visible_from(t)) for t in range(seq)], 1)
        mixed_keys = global_queries * k
        key_scores = mixed_keys @ layer.key_score_weight[head] / head_dim**0.5
        global_keys = torch.stack(
            [naive_pool(mixed_keys, key_scores, visible_from(t)) for t in range(seq)], 1
        )
        output = global_keys * v
        head_outputs.append(output if head_scale is None else output * head_scale[head])
    return layer.o_proj(torch.cat(head_outputs, dim=-1)) + flat_queries


LAYER_VARIANTS = {
    "causal": {},
    "causal_gqa_bias": {"num_key_value_heads": 2, "attention_bias": True},
    "windowed": {"additive_window": 3},
    "windowed_conv": {"additive_window": 2, "convolve": True, "conv_kernel_size": 3, "conv_groups": 4},
    "causal_conv": {"convolve": True, "conv_kernel_size": 2, "conv_groups": 1},
    "bidirectional": {"causal": False},
}


def padding_mask(seq: int) -> torch.Tensor:
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[1, -1] = 0  # right padding
    return mask


@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
@pytest.mark.parametrize("padded", [False, True])
def test_outputs_and_gradients_match_the_naive_reference(variant, padded):
    layer = make_layer(**LAYER_VARIANTS[variant])
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    mask = padding_mask(SEQ) if padded else None

    out, weights = layer(x, attention_mask=mask)
    expected = naive_additive_layer(layer, x, mask)
    assert weights is None
    assert_close_to_scale(out, expected)

    inputs = [x, *layer.parameters()]
    grad_out = torch.randn_like(out)
    actual_grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    for actual, reference in zip(actual_grads, expected_grads, strict=True):
        assert_close_to_scale(actual, reference)


@pytest.mark.parametrize("variant", ["causal", "causal_gqa_bias", "windowed", "windowed_conv", "causal_conv"])
def test_cached_decoding_equals_the_full_forward_with_a_constant_size_state(variant):
    layer = make_layer(**LAYER_VARIANTS[variant])
    prefill, total = 8, 13  # a prefill of several pooling chunks
    x = torch.randn(BATCH, total, HIDDEN)
    mask = torch.ones(BATCH, total, dtype=torch.long)
    mask[0, :3] = 0
    cache = HeadkitCache(layer)
    with torch.no_grad():
        full, _ = layer(x, attention_mask=mask)
        pieces = [layer(x[:, :prefill], mask[:, :prefill], cache=cache, use_cache=True)[0]]
        state_shapes = set()
        for t in range(prefill, total):
            pieces.append(layer(x[:, t : t + 1], mask[:, : t + 1], cache=cache, use_cache=True)[0])
            state = cache.layers[0].get_state()
            state_shapes.add(tuple(tuple(tensor.shape) for tensor in _tensors(state)))
    assert_close_to_scale(torch.cat(pieces, dim=1), full)
    assert cache.get_seq_length() == total
    assert isinstance(state, AdditiveState)
    assert len(state_shapes) == 1  # the same shapes after every token

    heads, head_dim, window = layer.num_heads, layer.head_dim, layer.window
    if window is None:
        assert tuple(state.query_pool.pooled.shape) == (BATCH, heads, head_dim)
    else:  # only the window is kept
        assert tuple(state.key_pool.recent_x.shape) == (BATCH, heads, window - 1, head_dim)
    if layer.conv is None:
        assert state.conv_inputs is None
    else:  # the convolution keeps its last kernel_size - 1 inputs
        assert tuple(state.conv_inputs.shape) == (BATCH, layer.conv_kernel_size - 1, HIDDEN)


@pytest.mark.parametrize("variant", ["causal", "causal_gqa_bias", "windowed", "causal_conv"])
def test_decoding_from_the_first_token_matches_the_full_forward_and_its_gradients(variant):
    # Every token through the recurrent step, with autograd on: batch 0 starts with 3 padding tokens (steps over
    # an empty past) and batch 1 has one in the middle. Outputs and gradients w.r.t. the inputs and every
    # parameter must equal the parallel forward's, and nothing may be NaN.
    layer = make_layer(**LAYER_VARIANTS[variant])
    total = 6
    x = torch.randn(BATCH, total, HIDDEN, requires_grad=True)
    mask = torch.ones(BATCH, total, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 2] = 0
    full, _ = layer(x, attention_mask=mask)
    cache = HeadkitCache(layer)
    stepped = torch.cat(
        [layer(x[:, t : t + 1], mask[:, : t + 1], cache=cache, use_cache=True)[0] for t in range(total)],
        dim=1,
    )
    assert_close_to_scale(stepped, full)
    inputs = [x, *layer.parameters()]
    grad_out = torch.randn_like(full)
    stepped_grads = torch.autograd.grad(stepped, inputs, grad_out)
    full_grads = torch.autograd.grad(full, inputs, grad_out)
    for stepped_grad, full_grad in zip(stepped_grads, full_grads, strict=True):
        assert torch.isfinite(stepped_grad).all()
        assert_close_to_scale(stepped_grad, full_grad)


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, tuple):
        return [tensor for item in state for tensor in _tensors(item)]
    return []


def test_left_padding_is_invisible_to_the_convolution_and_the_pooling():
    layer = make_layer(**LAYER_VARIANTS["windowed_conv"])
    x = torch.randn(1, SEQ, HIDDEN)
    padded = torch.cat([torch.randn(1, 3, HIDDEN) * 10, x], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * SEQ])
    with torch.no_grad():
        alone, _ = layer(x)
        with_padding, _ = layer(padded, attention_mask=mask)
    assert_close_to_scale(with_padding[:, 3:], alone)


def test_windowed_positions_ignore_tokens_outside_the_window():
    layer = make_layer(additive_window=3)
    x = torch.randn(1, SEQ, HIDDEN)
    changed = x.clone()
    changed[0, 0] += 5.0
    with torch.no_grad():
        out, _ = layer(x)
        out_changed, _ = layer(changed)
    # Position t sees t-2..t through both poolings (the key pooling reads global queries of t-2..t, which
    # themselves see t-4..t), so token 0 reaches positions 0..4 and no further.
    assert (out[:, :5] - out_changed[:, :5]).abs().amax() > 1e-4
    torch.testing.assert_close(out[:, 5:], out_changed[:, 5:], atol=0, rtol=0)


def test_bidirectional_positions_see_the_future():
    layer = make_layer(causal=False)
    x = torch.randn(1, SEQ, HIDDEN)
    changed = x.clone()
    changed[0, -1] += 5.0
    with torch.no_grad():
        assert (layer(x)[0][:, 0] - layer(changed)[0][:, 0]).abs().max() > 1e-4
        causal = make_layer()
        torch.testing.assert_close(causal(x)[0][:, :-1], causal(changed)[0][:, :-1], atol=0, rtol=0)


def test_head_gate_scales_each_head_before_o_proj_not_the_query_residual():
    layer = make_layer(num_key_value_heads=2)
    layer.head_gate = FixedGate(layer.num_heads, alive_heads=[1, 2])
    x = torch.randn(BATCH, SEQ, HIDDEN)
    with torch.no_grad():
        gated, _ = layer(x)
        expected = naive_additive_layer(layer, x, head_scale=torch.tensor([0.0, 1.0, 1.0, 0.0]))
        layer.head_gate = FixedGate(layer.num_heads, alive_heads=[])
        all_closed, _ = layer(x)
    torch.testing.assert_close(gated, expected, atol=1e-5, rtol=1e-5)
    # With every head closed only o_proj's bias (none here) and the query residual remain.
    torch.testing.assert_close(all_closed, layer.q_proj(x), atol=1e-6, rtol=0)


def test_projections_and_parameters_are_named_for_peft_and_pruning():
    layer = make_layer(num_key_value_heads=2, convolve=True)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer, name), torch.nn.Linear)
    assert isinstance(layer.conv, torch.nn.Conv1d)
    assert layer.query_score_weight.shape == layer.key_score_weight.shape == (4, 8)


def test_bad_settings_raise_value_error():
    with pytest.raises(ValueError, match="query residual"):
        make_layer(head_dim=4)  # 4 heads × 4 ≠ hidden 32
    bidirectional = make_layer(causal=False)
    with pytest.raises(ValueError, match="causal"):
        bidirectional(torch.randn(1, 3, HIDDEN), cache=HeadkitCache(bidirectional), use_cache=True)
