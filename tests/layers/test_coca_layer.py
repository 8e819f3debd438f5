"""CoCAAttention against the paper's definition computed pair by pair: outputs, gradients, weights, padding,
rotary scaling, the t/v cache with recomputed key positions, gates."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from headkit.layers import CoCAAttention, HeadkitCache
from headkit.layers.gates import FixedGate
from headkit.models import HeadkitConfig

BATCH, SEQ, HIDDEN = 2, 6, 32


def make_layer(seed: int = 0, **overrides) -> CoCAAttention:
    settings = dict(
        vocab_size=11, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, attention="coca"
    )
    config = HeadkitConfig(**{**settings, **overrides})
    torch.manual_seed(seed)
    layer = CoCAAttention(config, layer_idx=0)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return layer.eval()


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 agreement relative to the tensor's scale (|q|² · t scores make peaked softmaxes, large gradients)."""
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-5)


def naive_frequencies(layer: CoCAAttention, longest: int) -> torch.Tensor:
    """θ_i = base^(−2i/d), written out for the three rope types (RoFormer Eq. 15; linear: ÷ factor; dynamic NTK:
    base · (factor·L/L₀ − (factor − 1))^(d/(d−2)) once the length L passes the trained L₀)."""
    parameters = layer.config.rope_parameters or {}
    rope_type = parameters.get("rope_type", "default")
    base, head_dim = parameters.get("rope_theta", 10000.0), layer.head_dim
    factor = parameters.get("factor", 1.0)
    trained = layer.config.max_position_embeddings
    if rope_type == "dynamic" and longest > trained:
        base = base * (factor * longest / trained - (factor - 1)) ** (head_dim / (head_dim - 2))
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return theta / factor if rope_type == "linear" else theta


def naive_coca_layer(
    layer: CoCAAttention,
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    head_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zhu et al. 2023 §2 literally, head by head: the key query m sees at n is k_mn = t_n ∘ q_m inside each
    rotary pair (complex numbers), both rotated by RoPE, score = Re⟨R_m q_m, R_n k_mn⟩ / √d; masks, softmax."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = layer.num_heads, layer.num_key_value_heads, layer.head_dim
    half = head_dim // 2
    positions = torch.arange(seq).expand(batch, seq) if positions is None else positions.expand(batch, seq)
    mask = torch.ones(batch, seq, dtype=torch.bool) if mask is None else mask.bool()
    activation = F.relu if layer.t_activation == "relu" else F.softplus
    queries = layer.q_proj(x).view(batch, seq, heads, head_dim)
    magnitudes = activation(layer.k_proj(x)).view(batch, seq, kv_heads, half)
    values = layer.v_proj(x).view(batch, seq, kv_heads, head_dim)
    theta = naive_frequencies(layer, int(positions.max()) + 1)
    angles = positions.double()[..., None] * theta  # [B, T, D/2]
    rotation = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)

    head_outputs, all_weights = [], []
    for head in range(heads):
        kv_head = head // (heads // kv_heads)
        q = torch.complex(queries[:, :, head, :half], queries[:, :, head, half:])  # [B, T, D/2]
        t = magnitudes[:, :, kv_head]
        rotated_q = q * rotation
        key = q[:, :, None, :] * t[:, None, :, :]  # k_mn, [B, Tq, Tk, D/2]
        rotated_key = key * rotation[:, None, :, :]
        scores = (rotated_q[:, :, None, :] * rotated_key.conj()).real.sum(-1) / math.sqrt(head_dim)
        visible = torch.ones(seq, seq, dtype=torch.bool).tril() & mask[:, None, :]
        if not layer.causal:
            visible = mask[:, None, :].expand(batch, seq, seq)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
        output = weights @ values[:, :, kv_head]
        head_outputs.append(output if head_scale is None else output * head_scale[head])
        all_weights.append(weights)
    return layer.o_proj(torch.cat(head_outputs, dim=-1)), torch.stack(all_weights, dim=1)


LAYER_VARIANTS = {
    "mha_relu": {},
    "gqa_softplus_bias": {"num_key_value_heads": 2, "coca_t_activation": "softplus", "attention_bias": True},
    "linear_scaling": {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}},
    "dynamic_ntk": {
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100.0},
        "max_position_embeddings": 4,  # shorter than SEQ: the base is stretched
    },
    "bidirectional": {"causal": False, "num_key_value_heads": 1},
}


@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
@pytest.mark.parametrize("padded", [False, True])
def test_outputs_gradients_and_weights_match_the_naive_reference(variant, padded):
    layer = make_layer(**LAYER_VARIANTS[variant])
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:
        mask[0, :2] = 0  # left padding
        mask[1, -1] = 0  # right padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    out, weights = layer(x, attention_mask=mask, position_ids=positions)
    expected, expected_weights = naive_coca_layer(layer, x, mask, positions)
    assert weights is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    inputs = [x, *layer.parameters()]
    grad_out = torch.randn_like(out)
    actual_grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    for actual, reference in zip(actual_grads, expected_grads, strict=True):
        assert_close_to_scale(actual, reference)

    with torch.no_grad():
        explicit_out, weights = layer(x, attention_mask=mask, position_ids=positions, output_attentions=True)
    torch.testing.assert_close(weights, expected_weights.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(explicit_out, out.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["mha_relu", "gqa_softplus_bias", "dynamic_ntk"])
def test_cached_decoding_equals_the_full_forward(variant):
    layer = make_layer(**LAYER_VARIANTS[variant])
    total = SEQ + 3
    x = torch.randn(BATCH, total, HIDDEN)
    mask = torch.ones(BATCH, total, dtype=torch.long)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = HeadkitCache(layer)
    with torch.no_grad():
        full, _ = layer(x, attention_mask=mask, position_ids=positions)
        prefill = layer(x[:, :SEQ], mask[:, :SEQ], positions[:, :SEQ], cache=cache, use_cache=True)[0]
        pieces = [prefill]
        for t in range(SEQ, total):
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
    if variant == "dynamic_ntk":
        # Dynamic NTK rescales for the longest position of each call: a prefix decoded alone sees a shorter
        # length than the full forward, as in every dynamic-NTK implementation. The last step sees all of it.
        torch.testing.assert_close(pieces[-1], full[:, -1:], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    # The cache holds t (head_dim / 2 per key/value head) and v.
    assert cache.layers[0].keys.shape == (BATCH, layer.num_key_value_heads, total, layer.head_dim // 2)
    assert cache.layers[0].values.shape == (BATCH, layer.num_key_value_heads, total, layer.head_dim)
    assert bool((cache.layers[0].keys >= 0).all())


def test_default_positions_continue_after_the_cache():
    layer = make_layer()
    x = torch.randn(1, 5, HIDDEN)
    with torch.no_grad():
        full, _ = layer(x)
        cache = HeadkitCache(layer)
        layer(x[:, :3], cache=cache, use_cache=True)
        rest, _ = layer(x[:, 3:], cache=cache, use_cache=True)
    torch.testing.assert_close(rest, full[:, 3:], atol=1e-5, rtol=1e-5)


def test_scores_depend_on_relative_positions_only():
    layer = make_layer()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    positions = torch.arange(SEQ)[None]
    with torch.no_grad():
        near, near_weights = layer(x, position_ids=positions, output_attentions=True)
        far, far_weights = layer(x, position_ids=positions + 1000, output_attentions=True)
        shuffled, _ = layer(x, position_ids=positions * 3)  # other relative distances: other weights
    torch.testing.assert_close(far_weights, near_weights, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(far, near, atol=1e-4, rtol=1e-4)
    assert (shuffled - near).abs().max() > 1e-3


def test_t_projection_is_k_proj_with_one_magnitude_per_rotary_pair():
    layer = make_layer(num_key_value_heads=2)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer, name), torch.nn.Linear)
    assert layer.k_proj.out_features == 2 * layer.head_dim // 2
    assert layer.v_proj.out_features == 2 * layer.head_dim


def test_head_gate_scales_each_head_before_o_proj():
    layer = make_layer()
    layer.head_gate = FixedGate(layer.num_heads, alive_heads=[2])
    x = torch.randn(BATCH, SEQ, HIDDEN)
    with torch.no_grad():
        gated, _ = layer(x)
        expected, _ = naive_coca_layer(layer, x, head_scale=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(gated, expected, atol=1e-5, rtol=1e-5)


def test_attention_dropout_drops_attention_probabilities():
    layer = make_layer(attention_dropout=0.5).train()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    torch.manual_seed(7)
    out, _ = layer(x)
    with torch.no_grad():
        _, weights = layer.eval()(x, output_attentions=True)
        values = layer.split_heads(layer.v_proj(x), layer.num_key_value_heads)
        torch.manual_seed(7)
        expected = layer.project_heads(F.dropout(weights, p=0.5, training=True) @ values)
    torch.testing.assert_close(out.detach(), expected, atol=1e-5, rtol=1e-5)


def test_bad_settings_raise_value_error():
    with pytest.raises(ValueError, match="even head_dim"):
        CoCAAttention(make_layer().config, layer_idx=0, head_dim=5)
    with pytest.raises(ValueError, match="position_ids"):
        make_layer()(torch.randn(BATCH, SEQ, HIDDEN), position_ids=torch.arange(SEQ))
