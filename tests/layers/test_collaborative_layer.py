"""CollaborativeAttention against a per-head reference of the paper's Eq. 6: outputs, gradients, weights, padding,
the cache of shared keys / content biases / values, the exact multi-head case, construction from weights."""

from __future__ import annotations

import pytest
import torch

from headkit.layers import CollaborativeAttention, HeadkitCache, SoftmaxAttention
from headkit.layers.collaborative import (
    concatenated_mixing,
    content_bias_weight,
    pack_shared_keys,
    unpack_shared_keys,
)
from headkit.layers.gates import FixedGate
from headkit.models import HeadkitConfig

BATCH, SEQ, HIDDEN = 2, 6, 32
SETTINGS = dict(vocab_size=11, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4)


def make_layer(seed: int = 0, randomise: bool = True, **overrides) -> CollaborativeAttention:
    config = HeadkitConfig(**{**SETTINGS, "attention": "collaborative", **overrides})
    torch.manual_seed(seed)
    layer = CollaborativeAttention(config, layer_idx=0)
    if randomise:
        for parameter in layer.parameters():
            torch.nn.init.normal_(parameter, std=0.3)
    return layer.eval()


def naive_collaborative_layer(
    layer: CollaborativeAttention, x: torch.Tensor, mask: torch.Tensor | None = None, head_scale=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cordonnier et al. Eq. 6 head by head: score_h(i, j) = [(q̃_i ⊙ m_h)ᵀ k̃_j + c_hᵀ x_j] / √d, masks, softmax,
    the head's values, concat, W_O."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = layer.num_heads, layer.num_key_value_heads, layer.head_dim
    mask = torch.ones(batch, seq, dtype=torch.bool) if mask is None else mask.bool()
    shared_queries, shared_keys = layer.q_proj(x), layer.k_proj(x)
    values = layer.v_proj(x).view(batch, seq, kv_heads, head_dim)
    content = x @ layer.content_bias.weight.T  # [B, T, H]
    head_outputs, all_weights = [], []
    for head in range(heads):
        scores = (shared_queries * layer.mixing[head]) @ shared_keys.transpose(1, 2) + content[
            :, None, :, head
        ]
        scores = scores / head_dim**0.5
        visible = mask[:, None, :].expand(batch, seq, seq)
        if layer.causal:
            visible = visible & torch.ones(seq, seq, dtype=torch.bool).tril()
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
        output = weights @ values[:, :, head // (heads // kv_heads)]
        head_outputs.append(output if head_scale is None else output * head_scale[head])
        all_weights.append(weights)
    return layer.o_proj(torch.cat(head_outputs, dim=-1)), torch.stack(all_weights, dim=1)


LAYER_VARIANTS = {
    "full_size": {},
    "compressed_normal_init": {"dim_shared_query_key": 12, "collaborative_init": "normal"},
    "gqa_bias": {"num_key_value_heads": 2, "attention_bias": True, "dim_shared_query_key": 20},
    "bidirectional": {"causal": False, "dim_shared_query_key": 8},
    # D̃ < SEQ: the fused (SDPA) kernel rather than the explicit scores of short sequences.
    "narrow_fused_gqa_bias": {"num_key_value_heads": 2, "attention_bias": True, "dim_shared_query_key": 4},
    "narrow_fused_bidirectional": {"causal": False, "dim_shared_query_key": 3},
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

    out, weights = layer(x, attention_mask=mask)
    expected, expected_weights = naive_collaborative_layer(layer, x, mask)
    assert weights is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    inputs = [x, *layer.parameters()]
    grad_out = torch.randn_like(out)
    actual_grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    for actual, reference in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, reference, atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        explicit_out, weights = layer(x, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(weights, expected_weights.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(explicit_out, out.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["full_size", "gqa_bias", "narrow_fused_gqa_bias"])
def test_cached_decoding_equals_the_full_forward(variant):
    layer = make_layer(**LAYER_VARIANTS[variant])
    total = SEQ + 3
    x = torch.randn(BATCH, total, HIDDEN)
    mask = torch.ones(BATCH, total, dtype=torch.long)
    mask[0, :2] = 0
    cache = HeadkitCache(layer)
    with torch.no_grad():
        full, _ = layer(x, attention_mask=mask)
        pieces = [layer(x[:, :SEQ], mask[:, :SEQ], cache=cache, use_cache=True)[0]]
        for t in range(SEQ, total):
            pieces.append(layer(x[:, t : t + 1], mask[:, : t + 1], cache=cache, use_cache=True)[0])
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    # Keys: one shared key of width D̃ plus one content-bias score per head; values per key/value head.
    dim_shared, heads = layer.dim_shared_query_key, layer.num_heads
    assert cache.layers[0].keys.shape == (BATCH, 1, total, dim_shared + heads)
    assert cache.layers[0].values.shape == (BATCH, layer.num_key_value_heads, total, layer.head_dim)
    # the cache holds the content logits c_hᵀ x unscaled: the heads scale them with the dot products
    with torch.no_grad():
        shared, logits = unpack_shared_keys(cache.layers[0].keys[:, 0], dim_shared, heads)
        torch.testing.assert_close(shared, layer.k_proj(x))
        torch.testing.assert_close(logits, layer.content_bias(x))


def test_concatenate_init_at_full_size_is_exactly_multi_head_attention():
    softmax = SoftmaxAttention(HeadkitConfig(**SETTINGS, position_embedding_type="none"), layer_idx=0)
    collaborative = make_layer(randomise=False)  # "concatenate" mixing, D̃ = heads · head_dim
    with torch.no_grad():
        for parameter in softmax.parameters():
            parameter.normal_(std=0.3)
        collaborative.content_bias.weight.zero_()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(collaborative, name).weight.copy_(getattr(softmax, name).weight)
    expected_mixing = torch.zeros(4, 32)
    for head in range(4):
        expected_mixing[head, head * 8 : (head + 1) * 8] = 1.0
    assert torch.equal(collaborative.mixing.detach(), expected_mixing)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(collaborative(x)[0], softmax(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides", [{"attention_bias": True}, {"num_key_value_heads": 2, "attention_bias": True}]
)
def test_from_softmax_attention_reproduces_the_softmax_layer(overrides):
    config = HeadkitConfig(**SETTINGS, position_embedding_type="none", **overrides)
    softmax = SoftmaxAttention(config, layer_idx=0)
    with torch.no_grad():
        for parameter in softmax.parameters():
            parameter.normal_(std=0.3)
    collaborative = CollaborativeAttention.from_softmax_attention(softmax)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        expected, expected_weights = softmax(x, attention_mask=mask, output_attentions=True)
        actual, weights = collaborative(x, attention_mask=mask, output_attentions=True)
    # The query bias lives on as the content bias; the key bias cancels in the softmax.
    assert collaborative.content_bias.weight.abs().max() > 0
    torch.testing.assert_close(weights, expected_weights, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_the_content_bias_of_a_query_bias_is_one_function():
    config = HeadkitConfig(
        **SETTINGS, position_embedding_type="none", num_key_value_heads=2, attention_bias=True
    )
    softmax = SoftmaxAttention(config, layer_idx=0)
    with torch.no_grad():
        for parameter in softmax.parameters():
            parameter.normal_(std=0.3)
    collaborative = CollaborativeAttention.from_softmax_attention(softmax)
    heads, head_dim = softmax.num_heads, softmax.head_dim
    keys = softmax.k_proj.weight.detach().view(2, head_dim, HIDDEN).repeat_interleave(2, dim=0)
    query_bias = softmax.q_proj.bias.detach().view(heads, head_dim)
    expected = torch.stack(
        [keys[h].double().T @ query_bias[h].double() for h in range(heads)]
    )  # W_{K,h}ᵀ b_{Q,h}
    weight = content_bias_weight(softmax.q_proj.bias, keys.reshape(heads * head_dim, HIDDEN), heads)
    assert torch.equal(collaborative.content_bias.weight.detach(), weight)
    torch.testing.assert_close(weight, expected.float(), atol=1e-6, rtol=1e-6)


def test_shared_keys_pack_with_their_content_logits_and_unpack():
    shared, logits = torch.randn(2, 5, 7), torch.randn(2, 5, 3)
    packed = pack_shared_keys(shared, logits)
    padded = torch.cat([packed, torch.zeros(2, 5, 2)], dim=-1)  # as surgery's key projection pads it
    for keys in (packed, padded):
        unpacked = unpack_shared_keys(keys, 7, 3)
        assert torch.equal(unpacked[0], shared) and torch.equal(unpacked[1], logits)
    assert pack_shared_keys(shared, None) is shared and unpack_shared_keys(shared, 7, 0)[1] is None


def test_from_softmax_attention_refuses_rotary_layers():
    with pytest.raises(ValueError, match="rotary"):
        CollaborativeAttention.from_softmax_attention(
            SoftmaxAttention(HeadkitConfig(**SETTINGS), layer_idx=0)
        )


def test_from_weights_holds_the_given_weights_and_checks_shapes():
    config = HeadkitConfig(**SETTINGS, attention="collaborative")
    weights = dict(
        q_weight=torch.randn(6, HIDDEN),
        k_weight=torch.randn(6, HIDDEN),
        mixing=torch.randn(6, 6),
        v_weight=torch.randn(2 * 5, HIDDEN),  # 2 key/value heads of width 5
        o_weight=torch.randn(HIDDEN, 6 * 5),
        content_bias_weight=torch.randn(6, HIDDEN),
    )
    layer = CollaborativeAttention.from_weights(config, 0, **weights)
    assert (layer.num_heads, layer.num_key_value_heads, layer.head_dim, layer.dim_shared_query_key) == (
        6,
        2,
        5,
        6,
    )
    assert torch.equal(layer.mixing.detach(), weights["mixing"])
    assert torch.equal(layer.content_bias.weight.detach(), weights["content_bias_weight"])
    x = torch.randn(1, 4, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], naive_collaborative_layer(layer, x)[0], atol=1e-4, rtol=1e-5)

    with pytest.raises(ValueError, match="k_weight"):
        CollaborativeAttention.from_weights(config, 0, **{**weights, "k_weight": torch.randn(7, HIDDEN)})
    with pytest.raises(ValueError, match="content_bias_weight"):
        CollaborativeAttention.from_weights(
            config, 0, **{**weights, "content_bias_weight": torch.randn(5, HIDDEN)}
        )
    with pytest.raises(ValueError, match="v_bias"):
        CollaborativeAttention.from_weights(config, 0, **weights, v_bias=torch.zeros(10))


def test_concatenated_mixing_gives_uneven_blocks_when_heads_do_not_divide():
    mixing = concatenated_mixing(3, 7)  # blocks of 3, 3, 1
    assert mixing.sum(1).tolist() == [3.0, 3.0, 1.0]
    assert mixing.sum(0).tolist() == [1.0] * 7


def test_head_gate_scales_each_head_before_o_proj():
    layer = make_layer(num_key_value_heads=2)
    layer.head_gate = FixedGate(layer.num_heads, alive_heads=[0, 1])
    x = torch.randn(BATCH, SEQ, HIDDEN)
    with torch.no_grad():
        gated, _ = layer(x)
        expected, _ = naive_collaborative_layer(layer, x, head_scale=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(gated, expected, atol=1e-5, rtol=1e-5)


def test_projections_are_linear_modules_named_for_peft():
    layer = make_layer(dim_shared_query_key=12, num_key_value_heads=2)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "content_bias"):
        assert isinstance(getattr(layer, name), torch.nn.Linear)
    assert layer.q_proj.out_features == layer.k_proj.out_features == 12
    assert layer.mixing.shape == (4, 12)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="dim_shared_query_key"):
        CollaborativeAttention(make_layer().config, layer_idx=0, dim_shared_query_key=0)
    with pytest.raises(ValueError, match="attention_mask"):
        make_layer()(torch.randn(BATCH, SEQ, HIDDEN), attention_mask=torch.ones(BATCH, SEQ))
