"""HeadkitConfig: derived defaults, per-layer entries, RoPE settings, validation and the Auto registration."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from headkit.layers import ATTENTION_LAYERS, BUILTIN_ATTENTION_NAMES
from headkit.models import HeadkitConfig, HeadkitForCausalLM


def test_derived_defaults(make_config):
    config = make_config(num_attention_heads=4, hidden_size=32, intermediate_size=None)
    assert config.head_dim == 8
    assert config.num_key_value_heads == 4
    assert config.intermediate_size == 128
    assert config.attention == "softmax"
    assert [config.attention_type(i) for i in range(2)] == ["softmax", "softmax"]
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_explicit_head_dim_need_not_divide_hidden_size(make_config):
    config = make_config(hidden_size=30, num_attention_heads=4, head_dim=8)
    assert config.head_dim == 8
    model = HeadkitForCausalLM(config)
    assert model.model.layers[0].self_attn.q_proj.out_features == 32


def test_per_layer_head_counts(make_config):
    config = make_config(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_attention_heads_per_layer=[4, 2, 1],
        num_key_value_heads_per_layer=[2, 2, 1],
    )
    assert [config.heads_for_layer(i) for i in range(3)] == [(4, 2), (2, 2), (1, 1)]
    attention = [layer.self_attn for layer in HeadkitForCausalLM(config).model.layers]
    assert [(a.num_heads, a.num_key_value_heads) for a in attention] == [(4, 2), (2, 2), (1, 1)]
    assert [a.o_proj.in_features for a in attention] == [32, 16, 8]


def test_pruned_multi_head_layers_stay_multi_head(make_config):
    config = make_config(num_hidden_layers=2, num_attention_heads=4, num_attention_heads_per_layer=[3, 1])
    assert [config.heads_for_layer(i) for i in range(2)] == [(3, 3), (1, 1)]


def test_legacy_rope_arguments_fold_into_rope_parameters(make_config):
    config = make_config(rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    assert config.rope_kwargs() == {
        "rope_theta": 500.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "max_position_embeddings": config.max_position_embeddings,
    }
    assert make_config().rope_kwargs()["rope_scaling"] is None


def test_linear_rope_scaling_reaches_the_layers(make_config):
    # Linear scaling divides positions by the factor: positions 0, 2, 4 scaled by 2 equal positions 0, 1, 2.
    ids = torch.randint(1, 97, (1, 3))
    torch.manual_seed(0)
    scaled = HeadkitForCausalLM(make_config(rope_parameters={"rope_type": "linear", "factor": 2.0})).eval()
    torch.manual_seed(0)
    plain = HeadkitForCausalLM(make_config()).eval()
    with torch.no_grad():
        expected = plain(ids, position_ids=torch.tensor([[0, 1, 2]])).logits
        actual = scaled(ids, position_ids=torch.tensor([[0, 2, 4]])).logits
        unscaled_positions = plain(ids, position_ids=torch.tensor([[0, 2, 4]])).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    assert (unscaled_positions - expected).abs().max() > 1e-4


def test_dict_roundtrip_and_auto_config(make_config, tmp_path):
    config = make_config(layer_types=["softmax", "linear"], additive_window=8, feature_map="relu")
    restored = HeadkitConfig.from_dict(config.to_dict())
    assert restored.to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is HeadkitConfig
    assert loaded.layer_types == ["softmax", "linear"] and loaded.additive_window == 8
    assert type(AutoConfig.for_model("headkit")) is HeadkitConfig


@pytest.mark.parametrize("name", BUILTIN_ATTENTION_NAMES)
def test_every_builtin_mechanism_is_a_valid_config(make_config, name):
    assert make_config(attention=name).attention_type(1) == name


def test_unregistered_builtin_mechanism_fails_at_model_construction(make_config, monkeypatch):
    monkeypatch.delitem(ATTENTION_LAYERS, "collaborative", raising=False)
    config = make_config(layer_types=["softmax", "collaborative"])
    with pytest.raises(ValueError, match=r"'collaborative'.*registered attention layers: .*softmax"):
        HeadkitForCausalLM(config)


def test_registered_custom_mechanisms_are_valid(make_config, running_mean):
    assert make_config(attention=running_mean).attention == running_mean


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention": "bogus"}, r"unknown attention 'bogus'; valid attention types: additive, coca, collab"),
        (
            {"layer_types": ["softmax", "bogus"]},
            r"unknown layer type 'bogus' at layer_types\[1\]; valid .*linear",
        ),
        ({"layer_types": ["softmax"]}, "one attention type per layer"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "divisible by num_attention_heads"),
        ({"num_key_value_heads": 3}, "must divide the attention heads"),
        ({"num_attention_heads_per_layer": [4]}, "one entry per layer"),
        ({"num_attention_heads_per_layer": [4, 0]}, r"num_attention_heads_per_layer\[1\]"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type must be one of rope, learned, none"),
        ({"mlp_type": "moe"}, "mlp_type"),
        ({"hidden_act": "nope"}, "hidden_act"),
        ({"attention_dropout": 1.0}, "attention_dropout"),
        ({"label_smoothing": -0.1}, "label_smoothing"),
        ({"conv_groups": 3}, "conv_groups"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"additive_window": 0}, "additive_window"),
        ({"collaborative_init": "zeros"}, "collaborative_init"),
        ({"coca_t_activation": "tanh"}, "coca_t_activation"),
    ],
)
def test_invalid_configs_raise_value_error(make_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_importing_headkit_registers_the_auto_classes():
    code = (
        "import headkit, transformers as t\n"
        "c = t.AutoConfig.for_model('headkit', vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)\n"
        "print(type(t.AutoModelForCausalLM.from_config(c)).__name__,"
        " type(t.AutoModel.from_config(c)).__name__,"
        " type(t.AutoModelForSequenceClassification.from_config(c)).__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["HeadkitForCausalLM", "HeadkitModel", "HeadkitForSequenceClassification"]
