"""HybridAttention (LoLCATs) against the composition of naive pieces: outputs, gradients, padding, the
fixed-size decoding state, initialisation, and a causal LM with hybrid layers that trains and generates."""

from __future__ import annotations

import pytest
import torch

from headkit.layers import HeadkitCache, HedgehogFeatureMap, HybridAttention, StateCacheLayer
from headkit.models import HeadkitConfig, HeadkitForCausalLM
from headkit.ops import FEATURE_MAPS, HybridAttentionState
from headkit.ops.hybrid import hybrid_attention, naive_hybrid_attention
from headkit.ops.rotary import naive_rotary

BATCH, SEQ, HIDDEN = 2, 11, 32


def make_layer(seed: int = 0, **overrides) -> HybridAttention:
    settings = dict(
        vocab_size=11,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        attention="hybrid",
        hybrid_window=4,
        chunk_size=3,  # several chunks even in short tests
    )
    config = HeadkitConfig(**{**settings, **overrides})
    torch.manual_seed(seed)
    layer = HybridAttention(config, layer_idx=0)
    for parameter in layer.parameters():  # away from the identity maps and γ = 1, so every piece is exercised
        torch.nn.init.normal_(parameter, std=0.3)
    return layer.eval()


def naive_hedgehog(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    heads = []
    for head in range(x.shape[1]):
        projected = x[:, head] @ weight[head]
        heads.append(torch.cat([projected.softmax(-1), (-projected).softmax(-1)], dim=-1))
    return torch.stack(heads, dim=1)


def naive_features(feature_map, x: torch.Tensor) -> torch.Tensor:
    if isinstance(feature_map, HedgehogFeatureMap):
        return naive_hedgehog(x, feature_map.weight)
    return FEATURE_MAPS[feature_map.name](x)


def naive_hybrid_layer(
    layer: HybridAttention, x: torch.Tensor, mask: torch.Tensor | None = None, positions=None
) -> torch.Tensor:
    """Projections, RoPE as complex rotations, per-head feature maps on the rotated q/k, the dense hybrid
    weights of LoLCATs, concat and W_O."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = layer.num_heads, layer.num_key_value_heads, layer.head_dim
    queries = layer.q_proj(x).view(batch, seq, heads, head_dim).transpose(1, 2)
    keys = layer.k_proj(x).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    values = layer.v_proj(x).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    if layer.use_rope:
        positions = torch.arange(seq)[None] if positions is None else positions
        queries, keys = naive_rotary(queries, positions), naive_rotary(keys, positions)
    out, _ = naive_hybrid_attention(
        queries,
        keys,
        values,
        naive_features(layer.feature_map_q, queries),
        naive_features(layer.feature_map_k, keys),
        layer.log_balance.exp(),
        window=layer.window,
        attention_mask=mask,
    )
    return layer.o_proj(out.transpose(1, 2).reshape(batch, seq, heads * head_dim))


LAYER_VARIANTS = {
    "hedgehog_rope": {},
    "gqa_bias": {"num_key_value_heads": 2, "attention_bias": True},
    "narrow_features": {"hybrid_feature_dim": 5, "num_key_value_heads": 1},
    "elu_no_positions": {"hybrid_feature_map": "elu", "position_embedding_type": "none"},
    "window_1": {"hybrid_window": 1},
    "window_over_seq": {"hybrid_window": 16},
}


def padding_mask(seq: int) -> torch.Tensor:
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[1, -1] = 0  # right padding
    return mask


@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
@pytest.mark.parametrize("padded", [False, True])
def test_outputs_and_gradients_match_the_naive_composition(variant, padded):
    layer = make_layer(**LAYER_VARIANTS[variant])
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    mask = padding_mask(SEQ) if padded else None

    out, weights = layer(x, attention_mask=mask, output_attentions=True)
    expected = naive_hybrid_layer(layer, x, mask)
    assert weights is None  # no T × T weights are formed
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    inputs = [x, *layer.parameters()]
    grad_out = torch.randn_like(out)
    actual_grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    for actual, reference in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, reference, atol=1e-5, rtol=1e-5)


def test_a_training_forward_recomputes_the_window_scores_in_the_backward_instead_of_keeping_them():
    layer = make_layer()
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    block = layer.chunk_size + layer.window - 1  # a query chunk's window scores: [..., C, C + W - 1]

    def saved_shapes(**inputs) -> list[tuple[int, ...]]:
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t
        ):
            layer(x, **inputs)
        return shapes

    assert not [shape for shape in saved_shapes() if shape[-1:] == (block,)]
    # what the recomputation replaces: the op itself keeps its scores for the backward
    shapes = []
    queries, keys, values = (torch.randn(1, 4, SEQ, 8, requires_grad=True) for _ in range(3))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        hybrid_attention(
            queries, keys, values, queries.exp(), keys.exp(), torch.ones(4), window=4, chunk_size=3
        )
    assert [shape for shape in shapes if shape[-1:] == (3 + 4 - 1,)]


def test_feature_maps_read_the_rotated_queries_and_keys():
    layer = make_layer()
    x = torch.randn(1, SEQ, HIDDEN)
    shifted = torch.arange(SEQ)[None] + 5
    with torch.no_grad():
        out, _ = layer(x, position_ids=shifted)
        expected = naive_hybrid_layer(layer, x, positions=shifted)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["hedgehog_rope", "gqa_bias", "narrow_features"])
def test_cached_decoding_equals_the_full_forward_with_a_fixed_size_state(variant):
    layer = make_layer(**LAYER_VARIANTS[variant])
    prefill, total = 2, 14
    x = torch.randn(BATCH, total, HIDDEN)
    mask = torch.ones(BATCH, total, dtype=torch.long)
    mask[0, :3] = 0  # the prefill is all padding in row 0, and decoding step 1 feeds one more pad
    cache = HeadkitCache(layer)
    assert isinstance(cache.layers[0], StateCacheLayer)
    with torch.no_grad():
        full, _ = layer(x, attention_mask=mask)
        pieces = [layer(x[:, :prefill], mask[:, :prefill], cache=cache, use_cache=True)[0]]
        shapes = set()
        for t in range(prefill, total):
            pieces.append(layer(x[:, t : t + 1], mask[:, : t + 1], cache=cache, use_cache=True)[0])
            shapes.add(tuple(tuple(tensor.shape) for tensor in cache.layers[0].get_state()))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == total
    assert isinstance(cache.layers[0].get_state(), HybridAttentionState)
    assert len(shapes) == 1


def test_a_multi_token_continuation_continues_exactly():
    layer = make_layer(num_key_value_heads=2)
    x = torch.randn(BATCH, 17, HIDDEN)
    cache = HeadkitCache(layer)
    with torch.no_grad():
        full, _ = layer(x)
        first, _ = layer(x[:, :9], cache=cache, use_cache=True)  # 3 chunks, past the window
        rest, _ = layer(x[:, 9:], cache=cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_state_size_does_not_grow_with_the_context():
    layer = make_layer()
    sizes = []
    for length in (3, 40, 200):
        cache = HeadkitCache(layer)
        with torch.no_grad():
            layer(torch.randn(1, length, HIDDEN), cache=cache, use_cache=True)
        sizes.append([tuple(tensor.shape) for tensor in cache.layers[0].get_state()])
    assert sizes[0] == sizes[1] == sizes[2]
    heads, head_dim, features = layer.num_key_value_heads, layer.head_dim, 2 * layer.head_dim
    assert sizes[0][0] == (1, heads, layer.window - 1, head_dim)  # the window's keys
    assert sizes[0][4] == (1, heads, features, head_dim)  # Σ φ(k) vᵀ


def test_padded_keys_contribute_nothing_and_left_padding_changes_nothing():
    layer = make_layer(position_embedding_type="none")
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


def test_a_fresh_layer_starts_from_identity_feature_maps_and_unit_balance():
    config = HeadkitConfig(
        vocab_size=11, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, attention="hybrid"
    )
    for layer in (HybridAttention(config, 0), HeadkitForCausalLM(config).model.layers[0].self_attn):
        assert torch.equal(layer.balance, torch.ones(4))
        assert torch.equal(layer.feature_map_q.weight, torch.eye(8).expand(4, 8, 8))
        assert torch.equal(layer.feature_map_k.weight, torch.eye(8).expand(4, 8, 8))


def test_settings_are_validated():
    with pytest.raises(ValueError, match="hybrid attention is causal only"):
        make_layer(causal=False)
    with pytest.raises(ValueError, match="feature_dim 5 needs a learnable map"):
        make_layer(hybrid_feature_map="elu", hybrid_feature_dim=5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hybrid_window": 0}, "hybrid_window must be a positive integer"),
        ({"hybrid_feature_dim": 0}, "hybrid_feature_dim must be a positive integer"),
        ({"hybrid_feature_map": "bogus"}, r"hybrid_feature_map must be one of elu, hedgehog"),
    ],
)
def test_bad_config_fields_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        HeadkitConfig(
            vocab_size=11, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, **overrides
        )


# --- a causal LM with hybrid layers ----------------------------------------------------------------------------


def make_model(seed: int = 0, **overrides) -> HeadkitForCausalLM:
    settings = dict(
        vocab_size=61,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        layer_types=["hybrid", "softmax"],
        hybrid_window=4,
        chunk_size=3,
        pad_token_id=0,
        initializer_range=0.2,  # peaked enough that greedy decoding does not repeat one token
    )
    torch.manual_seed(seed)
    return HeadkitForCausalLM(HeadkitConfig(**{**settings, **overrides})).eval()


def test_a_model_with_hybrid_layers_trains():
    model = make_model(layer_types=["hybrid", "hybrid"])
    model.train()
    ids = torch.randint(1, 61, (2, 12))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        attention = model.model.layers[0].self_attn
        for parameter in (
            attention.log_balance,
            attention.feature_map_q.weight,
            attention.feature_map_k.weight,
        ):
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("layer_types", [["hybrid", "softmax"], ["hybrid", "hybrid"]])
def test_greedy_generation_is_the_same_with_and_without_the_cache(layer_types):
    model = make_model(layer_types=layer_types)
    prompt = torch.randint(1, 61, (2, 5))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert cached.shape == (2, 17)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 5:].tolist())) > 1  # the comparison is not between two constant sequences


def test_left_padded_batched_generation_equals_one_prompt_at_a_time():
    model = make_model(layer_types=["hybrid", "hybrid"])
    short, long = torch.randint(1, 61, (3,)), torch.randint(1, 61, (7,))
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    ids[0, 4:], mask[0, 4:] = short, 1
    ids[1], mask[1] = long, 1
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        alone = [model.generate(p[None], max_new_tokens=8, do_sample=False)[0, -8:] for p in (short, long)]
    assert torch.equal(batched[:, -8:], torch.stack(alone))
