"""One config per surgery: LinearizeConfig and LatentKVConfig validate themselves when built, check a model (or
only its 🤗 config) before any work, are what the model's config records, and rebuild the model on reload."""

import copy
import dataclasses

import pytest
import torch
from family_models import family_config, family_inputs, family_model

import headkit
from headkit.errors import HeadkitError
from headkit.surgery import LatentKVConfig, LinearizeConfig, compress_kv_to_latent
from headkit.surgery.latent import collect_statistics
from headkit.surgery.linearize import linearize


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"window": 0}, "window must be a positive integer"),
        ({"window": True}, "window must be a positive integer"),
        ({"feature_map": "nope"}, "unknown feature map 'nope'"),
        ({"feature_dim": 0}, "feature_dim must be a positive integer or None"),
        ({"chunk_size": -1}, "chunk_size must be a positive integer"),
        ({"sinks": -1}, "sinks must be a non-negative integer"),
        ({"sparse_cache": 1.5}, "sparse_cache must be a non-negative integer"),
        ({"layers": ()}, "layers must name at least one layer"),
        ({"layers": (0, 0)}, "layers lists a layer twice"),
        ({"layers": (0.5,)}, r"layers must be layer indices \(integers\)"),
        ({"convert_sliding": 1}, "convert_sliding must be a bool"),
    ],
)
def test_linearize_config_names_a_bad_field_when_built(fields, message):
    with pytest.raises(HeadkitError, match=message):
        LinearizeConfig(**fields)


def test_linearize_config_is_frozen_and_normalises_layers():
    config = LinearizeConfig(layers=[1, 0])
    assert config.layers == (1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.window = 3


def test_linearize_config_checks_a_models_config_without_its_weights():
    config = family_config("llama")  # context 128, 2 layers
    assert LinearizeConfig(window=8).check(config) == [0, 1]
    assert LinearizeConfig(window=8, layers=(1,)).check(config) == [1]
    with pytest.raises(
        HeadkitError, match="window must be at most the model's context of 128 tokens, got 129"
    ):
        LinearizeConfig(window=129).check(config)
    with pytest.raises(HeadkitError, match=r"layers must be indices in \[0, 2\) .* got \[2\]"):
        LinearizeConfig(layers=(0, 2)).check(config)
    with pytest.raises(HeadkitError, match=r"layers must be indices in \[0, 2\) .* got \[-1\]"):
        LinearizeConfig(layers=(-1,)).check(config)
    gemma = family_config("gemma2")  # layer 0 slides
    assert LinearizeConfig(window=8).check(gemma) == [1]
    with pytest.raises(HeadkitError, match="attend through a sliding window"):
        LinearizeConfig(window=8, layers=(0,)).check(gemma)
    assert LinearizeConfig(window=8, convert_sliding=True).check(gemma) == [0, 1]


def test_linearize_with_a_config_equals_linearize_with_keywords_and_is_recorded():
    ids = family_inputs(length=12)
    first, second = family_model("llama"), family_model("llama")
    config = LinearizeConfig(window=4, sinks=1, sparse_cache=2)
    linearize(first, config)
    linearize(second, window=4, sinks=1, sparse_cache=2)
    assert first.config.headkit_surgery == second.config.headkit_surgery
    (entry,) = first.config.headkit_surgery
    assert LinearizeConfig.from_record(entry) == dataclasses.replace(config, layers=(0, 1))
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)
    with pytest.raises(HeadkitError, match="not both"):
        linearize(family_model("llama"), config, window=3)


def test_a_record_written_before_a_field_existed_rebuilds_with_its_default(tmp_path):
    model = family_model("llama")
    linearize(model, window=4)
    (entry,) = model.config.headkit_surgery
    for name in ("sinks", "sparse_cache", "convert_sliding", "chunk_size"):
        del entry[name]  # as an early checkpoint recorded it
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    ids = family_inputs(length=12)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert LinearizeConfig.from_record(entry) == LinearizeConfig(window=4, layers=(0, 1))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kv_rank": 1.5, "rope_dims": 4}, "kv_rank must be an integer"),
        ({"kv_rank": True, "rope_dims": 4}, "kv_rank must be an integer"),
        ({"kv_rank": 8, "rope_dims": "4"}, "rope_dims must be an integer"),
        ({"kv_rank": 8, "rope_dims": 4, "rope_selection": "best"}, "rope_selection must be one of"),
    ],
)
def test_latent_config_names_a_bad_field_when_built(fields, message):
    with pytest.raises(HeadkitError, match=message):
        LatentKVConfig(**fields)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_latent_config_refuses_a_per_head_key_norm_before_any_work(model_type):
    model = family_model(model_type)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(HeadkitError):
        LatentKVConfig(kv_rank=8, rope_dims=4).check(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_latent_config_check_names_the_models_ranges():
    model = family_model("llama")  # hidden 64, 2 key/value heads of 16
    with pytest.raises(HeadkitError, match=r"kv_rank must be an integer in \[1, "):
        LatentKVConfig(kv_rank=0, rope_dims=4).check(model)
    with pytest.raises(HeadkitError, match="whole number of rotary pairs"):
        LatentKVConfig(kv_rank=8, rope_dims=3).check(model)


def test_latent_conversion_from_collected_statistics_equals_one_from_calibration():
    calibration = [{"input_ids": family_inputs(batch=2, length=16)}]
    first, second = family_model("llama"), family_model("llama")
    config = LatentKVConfig(kv_rank=20, rope_dims=4)
    adapter, sites = config.check(second)
    statistics = collect_statistics(second, sites, adapter, calibration)
    report = compress_kv_to_latent(first, config, calibration=calibration)
    again = compress_kv_to_latent(second, config, statistics=statistics)
    assert (
        report.calibrated and again.calibrated and report.rope_selection == again.rope_selection == "fitted"
    )
    for (name, value), (_, other) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(value, other), name
