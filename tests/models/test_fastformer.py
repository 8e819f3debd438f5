"""FastformerLMConfig / FastformerForCausalLM: the Additive-Attention LM package's names on headkit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from headkit.layers import ATTENTION_LAYERS
from headkit.models import HeadkitConfig
from headkit.models.fastformer import FastformerForCausalLM, FastformerLMConfig

PACKAGE_ARGUMENTS = dict(
    hidden_size=32,
    vocab_size=50,
    n_positions=64,
    n_heads=4,
    convolve=True,
    groups=2,
    kernel_size=3,
    num_hidden_layers=2,
    label_smoothing=0.1,
    initializer_range=0.05,
    hidden_dropout_prob=0.0,
)


def test_package_arguments_map_onto_headkit_fields():
    config = FastformerLMConfig(**PACKAGE_ARGUMENTS)
    assert isinstance(config, HeadkitConfig)
    assert config.attention == "additive"
    assert (config.hidden_size, config.vocab_size, config.max_position_embeddings) == (32, 50, 64)
    assert (config.num_attention_heads, config.num_hidden_layers) == (4, 2)
    assert (config.convolve, config.conv_groups, config.conv_kernel_size) == (True, 2, 3)
    assert (config.label_smoothing, config.initializer_range, config.hidden_dropout) == (0.1, 0.05, 0.0)
    assert config.position_embedding_type == "learned"
    assert (config.mlp_type, config.hidden_act, config.tie_word_embeddings) == ("plain", "gelu", True)


def test_package_defaults():
    config = FastformerLMConfig()
    assert (config.hidden_size, config.vocab_size, config.num_attention_heads) == (256, 32100, 4)
    assert (config.max_position_embeddings, config.num_hidden_layers, config.conv_kernel_size) == (1024, 4, 4)
    assert config.hidden_dropout == 0.1 and not config.convolve


def test_native_names_still_work_and_conflicts_are_errors():
    assert FastformerLMConfig(max_position_embeddings=128, n_layer=3).num_hidden_layers == 3
    with pytest.raises(ValueError, match="n_heads=4 and num_attention_heads=8"):
        FastformerLMConfig(n_heads=4, num_attention_heads=8)
    with pytest.raises(ValueError, match="conv_groups"):
        FastformerLMConfig(hidden_size=32, n_heads=4, groups=3)


def test_saved_config_loads_through_the_auto_classes(tmp_path):
    config = FastformerLMConfig(**PACKAGE_ARGUMENTS)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is HeadkitConfig
    assert loaded.attention == "additive" and loaded.conv_kernel_size == 3
    reloaded = FastformerLMConfig.from_pretrained(tmp_path).to_diff_dict()
    assert reloaded == loaded.to_diff_dict() == config.to_diff_dict()


def test_model_builds_when_additive_attention_is_available(tmp_path):
    config = FastformerLMConfig(**PACKAGE_ARGUMENTS)
    if "additive" not in ATTENTION_LAYERS:
        with pytest.raises(ValueError, match="'additive'"):
            FastformerForCausalLM(config)
        return
    torch.manual_seed(0)
    model = FastformerForCausalLM(config).eval()
    ids = torch.randint(1, 50, (2, 10))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 10, 50)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits, logits)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        model(torch.ones(1, 65, dtype=torch.long))
