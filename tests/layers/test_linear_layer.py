"""LinearAttention against a plain per-head reference: outputs, gradients, padding, the recurrent state, gates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headkit.layers import HeadkitCache, LinearAttention
from headkit.layers.gates import FixedGate
from headkit.models import HeadkitConfig
from headkit.ops import LinearAttentionState

BATCH, SEQ, HIDDEN = 2, 7, 32
EPS = 1e-6  # the kernel's default denominator epsilon
FEATURES = {"elu": lambda x: F.elu(x) + 1, "relu": F.relu}


def make_layer(seed: int = 0, **overrides) -> LinearAttention:
    settings = dict(
        vocab_size=11,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        attention="linear",
        chunk_size=3,  # several chunks even in short tests
    )
    config = HeadkitConfig(**{**settings, **overrides})
    torch.manual_seed(seed)
    layer = LinearAttention(config, layer_idx=0)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return layer.eval()


def naive_linear_layer(
    layer: LinearAttention, x: torch.Tensor, mask: torch.Tensor | None = None, head_scale=None
) -> torch.Tensor:
    """Katharopoulos et al. Eq. 2-3 head by head and query by query: weights φ(q_i)ᵀφ(k_j) over the visible real
    keys, normalised by their sum (+ eps), then concat and W_O. ``head_scale`` [H] multiplies each head's output."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = layer.num_heads, layer.num_key_value_heads, layer.head_dim
    phi = FEATURES[layer.feature_map]
    mask = torch.ones(batch, seq, dtype=torch.bool) if mask is None else mask.bool()
    queries = layer.q_proj(x).view(batch, seq, heads, head_dim)
    keys = layer.k_proj(x).view(batch, seq, kv_heads, head_dim)
    values = layer.v_proj(x).view(batch, seq, kv_heads, head_dim)
    head_outputs = []
    for head in range(heads):
        kv_head = head // (heads // kv_heads)
        rows = []
        for i in range(seq):
            visible = mask.clone()
            if layer.causal:
                visible[:, i + 1 :] = False
            weights = (phi(queries[:, i, head, None, :]) * phi(keys[:, :, kv_head])).sum(
                -1
            ) * visible  # [B, T]
            numerator = (weights[..., None] * values[:, :, kv_head]).sum(1)
            rows.append(numerator / (weights.sum(1, keepdim=True) + EPS))
        output = torch.stack(rows, dim=1)
        head_outputs.append(output if head_scale is None else output * head_scale[head])
    return layer.o_proj(torch.cat(head_outputs, dim=-1))


LAYER_VARIANTS = {
    "causal_elu": {},
    "causal_gqa_bias": {"num_key_value_heads": 2, "attention_bias": True},
    "causal_relu": {"feature_map": "relu"},
    "bidirectional": {"causal": False},
    "bidirectional_mqa": {"causal": False, "num_key_value_heads": 1},
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

    out, weights = layer(x, attention_mask=mask, output_attentions=True)
    expected = naive_linear_layer(layer, x, mask)
    assert weights is None  # the T × T weights are never formed
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    inputs = [x, *layer.parameters()]
    grad_out = torch.randn_like(out)
    actual_grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    # float32 against float32 summed in another order, measured against the largest gradient entry (~20 here):
    # a relu map's small denominators amplify rounding. Against a float64 reference the causal kernel's backward,
    # the chunked form and this naive one all err by ~5e-7 of it (median over seeds), up to ~2e-6 (90th pct).
    scale = max(reference.abs().max().item() for reference in expected_grads)
    for actual, reference in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, reference, atol=max(1e-5, 2e-6 * scale), rtol=1e-5)


@pytest.mark.parametrize("variant", ["causal_elu", "causal_gqa_bias", "causal_relu"])
def test_cached_decoding_equals_the_full_forward(variant):
    layer = make_layer(**LAYER_VARIANTS[variant])
    prefill, total = 2, 10
    x = torch.randn(BATCH, total, HIDDEN)
    mask = torch.ones(BATCH, total, dtype=torch.long)
    mask[0, :3] = 0  # the prefill is all padding in row 0, and decoding step 2 feeds one more pad
    cache = HeadkitCache(layer)
    with torch.no_grad():
        full, _ = layer(x, attention_mask=mask)
        pieces = [layer(x[:, :prefill], mask[:, :prefill], cache=cache, use_cache=True)[0]]
        state_shapes = set()
        for t in range(prefill, total):
            pieces.append(layer(x[:, t : t + 1], mask[:, : t + 1], cache=cache, use_cache=True)[0])
            state = cache.layers[0].get_state()
            state_shapes.add((tuple(state.kv.shape), tuple(state.k_sum.shape)))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == total
    # One constant-size state, whatever the number of tokens seen.
    kv_heads, head_dim = layer.num_key_value_heads, layer.head_dim
    assert state_shapes == {((BATCH, kv_heads, head_dim, head_dim), (BATCH, kv_heads, head_dim))}
    assert isinstance(cache.layers[0].get_state(), LinearAttentionState)


def test_a_prefill_of_several_chunks_continues_exactly():
    layer = make_layer(chunk_size=4)
    x = torch.randn(BATCH, 13, HIDDEN)
    cache = HeadkitCache(layer)
    with torch.no_grad():
        full, _ = layer(x)
        first, _ = layer(x[:, :9], cache=cache, use_cache=True)  # 2 chunks and a partial one
        rest, _ = layer(x[:, 9:], cache=cache, use_cache=True)  # a multi-token continuation
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)


def test_padded_keys_contribute_nothing():
    layer = make_layer()
    x = torch.randn(1, SEQ, HIDDEN)
    mask = torch.ones(1, SEQ, dtype=torch.bool)
    mask[0, :3] = False
    changed = x.clone()
    changed[0, :3] = torch.randn(3, HIDDEN) * 10
    with torch.no_grad():
        out, _ = layer(x, attention_mask=mask)
        out_changed, _ = layer(changed, attention_mask=mask)
        alone, _ = layer(x[:, 3:])
    torch.testing.assert_close(out[:, 3:], out_changed[:, 3:], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[:, 3:], alone, atol=1e-5, rtol=1e-5)


def test_head_gate_scales_each_head_before_o_proj():
    layer = make_layer(num_key_value_heads=2)
    layer.head_gate = FixedGate(layer.num_heads, alive_heads=[0, 3])
    x = torch.randn(BATCH, SEQ, HIDDEN)
    with torch.no_grad():
        gated, _ = layer(x)
        expected = naive_linear_layer(layer, x, head_scale=torch.tensor([1.0, 0.0, 0.0, 1.0]))
        layer.head_gate = None
        ungated, _ = layer(x)
    torch.testing.assert_close(gated, expected, atol=1e-5, rtol=1e-5)
    assert (gated - ungated).abs().max() > 1e-3


def test_projections_are_linear_modules_named_for_peft():
    layer = make_layer(num_key_value_heads=2)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer, name), torch.nn.Linear)
    assert layer.k_proj.out_features == layer.v_proj.out_features == 2 * layer.head_dim


def test_bad_settings_and_inputs_raise_value_error():
    with pytest.raises(ValueError, match="feature_map"):
        make_layer(feature_map="no_such_map")
    bidirectional = make_layer(causal=False)
    with pytest.raises(ValueError, match="causal"):
        bidirectional(torch.randn(1, 3, HIDDEN), cache=HeadkitCache(bidirectional), use_cache=True)
    with pytest.raises(ValueError, match="attention_mask"):
        make_layer()(
            torch.randn(BATCH, SEQ, HIDDEN), attention_mask=torch.ones(BATCH, SEQ + 1, dtype=torch.bool)
        )
