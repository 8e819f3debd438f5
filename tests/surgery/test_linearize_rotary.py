"""The linear term's feature maps reading slow rotary pairs rotated back (LinearizeConfig.feature_wavelength):
the rotation undone is exactly the module's own (left padding included), only the chosen pairs change, and the
option is recorded, replayed and refused when out of range."""

import math

import pytest
import torch
import transformers

import headkit
from headkit.errors import HeadkitError
from headkit.ops.rotary import rotary_cos_sin, unrotate_pairs
from headkit.surgery.linearize import LinearizeConfig, linearized_modules, unrotated_rotary_pairs


def hf_tables(positions, pairs, theta=10000.0):
    # 🤗 Transformers' layout: the angles twice, [B, T, 2·pairs].
    cos, sin = rotary_cos_sin(positions, 2 * pairs, rope_theta=theta)
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


def hf_rotate(x, cos, sin):
    half = cos.shape[-1] // 2
    rotated = torch.cat((-x[..., half : 2 * half], x[..., :half]), -1)
    return torch.cat((x[..., : 2 * half] * cos[:, None] + rotated * sin[:, None], x[..., 2 * half :]), -1)


@pytest.mark.parametrize("rotary_pairs", [4, 3])  # full rotary, and partial (6 of 8 dimensions)
def test_unrotate_pairs_undoes_exactly_the_chosen_pairs_and_nothing_else(rotary_pairs):
    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 9, 30, 31, 400]])
    cos, sin = hf_tables(positions, rotary_pairs)
    cos, sin = cos.double(), sin.double()
    rotated = hf_rotate(raw, cos, sin)
    everything = torch.ones(rotary_pairs, dtype=torch.bool)
    torch.testing.assert_close(unrotate_pairs(rotated, cos, sin, everything), raw)
    some = torch.tensor([True, False, True] + [False] * (rotary_pairs - 3))
    back = unrotate_pairs(rotated, cos, sin, some)
    half = rotary_pairs
    for pair in range(rotary_pairs):
        source = raw if some[pair] else rotated
        torch.testing.assert_close(back[..., [pair, pair + half]], source[..., [pair, pair + half]])
    torch.testing.assert_close(back[..., 2 * half :], raw[..., 2 * half :])  # not rotary: untouched


def tiny_llama(theta=10000.0):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_theta=theta,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def test_the_slow_pairs_are_those_whose_wavelength_exceeds_the_option():
    model = tiny_llama()
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    wavelengths = 2 * math.pi / theta  # 6.3, 63, 628, 6283 tokens
    for limit in (1, 10, 100, 1000, 10000):
        expected = [i for i in range(4) if wavelengths[i] > limit] or None
        assert unrotated_rotary_pairs(model, [0, 1], limit) == [expected, expected]
    assert unrotated_rotary_pairs(model, [0, 1], 0) == [None, None]


def test_the_feature_maps_read_the_queries_and_keys_before_rotation_with_left_padding_too(tmp_path):
    # Every pair slower than 1 token: the maps must see exactly what q_proj / k_proj wrote, whatever the position.
    model = tiny_llama()
    report = headkit.linearize(model, window=2, chunk_size=2, feature_wavelength=1)
    assert report.unrotated_pairs == report.rotary_pairs == 4
    assert "rotated back" in str(report)
    attention = model.model.layers[1].self_attn
    seen = {}
    attention.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o))
    attention.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o))
    mechanism = linearized_modules(model)[1]
    mechanism.feature_map_q.register_forward_pre_hook(lambda m, i: seen.__setitem__("fq", i[0]))
    mechanism.feature_map_k.register_forward_pre_hook(lambda m, i: seen.__setitem__("fk", i[0]))
    tokens = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # left padding: that row's positions start at its first real token
    with torch.no_grad():
        model(tokens, attention_mask=mask)
    raw_q = seen["q"].unflatten(-1, (4, 8)).transpose(1, 2)
    raw_k = seen["k"].unflatten(-1, (2, 8)).transpose(1, 2)
    torch.testing.assert_close(seen["fq"], raw_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seen["fk"], raw_k, atol=1e-5, rtol=1e-5)


def test_the_option_changes_the_linear_term_only_and_is_replayed_on_reload(tmp_path):
    tokens = torch.randint(1, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    logits = {}
    for limit in (0, 10):
        model = tiny_llama()
        headkit.linearize(model, window=4, chunk_size=4, feature_wavelength=limit)
        with torch.no_grad():
            logits[limit] = model(tokens).logits
    # Inside the window the two agree (no linear term yet); beyond it the slow pairs change the features.
    torch.testing.assert_close(logits[0][:, :4], logits[10][:, :4])
    assert (logits[0][:, 8:] - logits[10][:, 8:]).abs().max() > 1e-4
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert [m.unrotated_pairs.tolist() for m in linearized_modules(reloaded)] == [
        m.unrotated_pairs.tolist() for m in linearized_modules(model)
    ]
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, logits[10])


@pytest.mark.parametrize("value", [-1, 1.5, True, "1024"])
def test_a_bad_feature_wavelength_is_refused_by_name(value):
    with pytest.raises(HeadkitError, match="feature_wavelength must be a non-negative integer"):
        LinearizeConfig(feature_wavelength=value)
