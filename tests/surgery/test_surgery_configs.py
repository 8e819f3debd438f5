"""One config per surgery: LinearizeConfig, LatentKVConfig, PruneConfig, GateConfig and CollaborativeConfig
validate themselves when built, check a model (or only its 🤗 config) before any work, are what the model's
config records, and rebuild the model on reload (records written before a config existed included)."""

import copy
import dataclasses
import math

import pytest
import torch
from family_models import family_config, family_inputs, family_model

import headkit
from headkit.errors import HeadkitError
from headkit.surgery import (
    CollaborativeConfig,
    GateConfig,
    LatentKVConfig,
    LinearizeConfig,
    PruneConfig,
    add_head_gates,
    compress_kv_to_latent,
    prune_dead_heads,
    prune_heads,
    remove_head_gates,
    swap_to_collaborative,
)
from headkit.surgery.gating import head_gates
from headkit.surgery.latent_fit import collect_statistics
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
        ({"budget": 1.5}, "budget must be a non-negative integer"),
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
    assert LinearizeConfig(window=8).layers_to_convert(config) == [0, 1]
    assert LinearizeConfig(window=8, layers=(1,)).layers_to_convert(config) == [1]
    with pytest.raises(
        HeadkitError, match="window must be at most the model's context of 128 tokens, got 129"
    ):
        LinearizeConfig(window=129).check(config)
    with pytest.raises(HeadkitError, match=r"layers must be indices in \[0, 2\) .* got \[2\]"):
        LinearizeConfig(layers=(0, 2)).check(config)
    with pytest.raises(HeadkitError, match=r"layers must be indices in \[0, 2\) .* got \[-1\]"):
        LinearizeConfig(layers=(-1,)).check(config)
    gemma = family_config("gemma2")  # layer 0 slides
    assert LinearizeConfig(window=8).layers_to_convert(gemma) == [1]
    with pytest.raises(HeadkitError, match="attend through a sliding window"):
        LinearizeConfig(window=8, layers=(0,)).check(gemma)
    assert LinearizeConfig(window=8, convert_sliding=True).layers_to_convert(gemma) == [0, 1]


def test_linearize_with_a_config_equals_linearize_with_keywords_and_is_recorded():
    ids = family_inputs(length=12)
    first, second = family_model("llama"), family_model("llama")
    config = LinearizeConfig(window=4, sinks=1, budget=2)
    linearize(first, config)
    linearize(second, window=4, sinks=1, budget=2)
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
    for name in ("sinks", "budget", "convert_sliding", "chunk_size"):
        del entry[name]  # as an early checkpoint recorded it
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    ids = family_inputs(length=12)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert LinearizeConfig.from_record(entry) == LinearizeConfig(window=4, layers=(0, 1))


def test_a_linearized_checkpoint_that_named_the_budget_sparse_cache_reloads(tmp_path):
    model = family_model("llama")
    headkit.apply_(model, LinearizeConfig(window=4, sinks=1, budget=3, chunk_size=4))
    (entry,) = model.config.headkit_surgery
    entry["sparse_cache"] = entry.pop("budget")  # as a checkpoint saved before the rename recorded it
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    ids = family_inputs(length=12)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert LinearizeConfig.from_record(entry).budget == 3
    assert all(module.budget == 3 for module in reloaded.modules() if hasattr(module, "kept"))


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


def test_latent_conversion_refuses_a_config_of_another_surgery_and_a_config_with_keywords():
    model = family_model("llama")
    before = _state(model)
    with pytest.raises(HeadkitError, match="config must be a LatentKVConfig, got PruneConfig"):
        compress_kv_to_latent(model, PruneConfig(heads={0: [0]}))
    with pytest.raises(HeadkitError, match="not both"):
        compress_kv_to_latent(model, LatentKVConfig(kv_rank=20, rope_dims=4), rope_dims=8)
    assert _same_state(model, before)


def test_latent_conversion_from_collected_statistics_equals_one_from_calibration():
    calibration = [{"input_ids": family_inputs(batch=2, length=16)}]
    first, second = family_model("llama"), family_model("llama")
    config = LatentKVConfig(kv_rank=20, rope_dims=4)
    adapter, sites = config.sites_to_convert(second)
    statistics = collect_statistics(second, sites, adapter, calibration)
    report = compress_kv_to_latent(first, config, calibration=calibration)
    again = compress_kv_to_latent(second, config, statistics=statistics)
    assert (
        report.calibrated
        and again.calibrated
        and report.rope_selection == again.rope_selection == "rorope_fitted"
    )
    for (name, value), (_, other) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(value, other), name


# -- pruning, gating and the collaborative swap: PruneConfig, GateConfig, CollaborativeConfig --------------------


def _state(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _same_state(model, before):
    state = model.state_dict()
    return list(state) == list(before) and all(torch.equal(state[k], v) for k, v in before.items())


def _bert(**overrides):
    import transformers

    torch.manual_seed(0)
    settings = dict(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24
    )
    return transformers.BertModel(transformers.BertConfig(**(settings | overrides))).eval()


def _bert_inputs():
    generator = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(1, 50, (2, 6), generator=generator)}


def _hidden(model):
    with torch.no_grad():
        return model(**_bert_inputs()).last_hidden_state


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"heads": [[0]]}, r"heads must be a mapping \{layer: \[head indices\]\}, got list"),
        ({"heads": {-1: [0]}}, "heads names layer -1, out of range"),
        ({"heads": {0: [-2]}}, r"heads\[0\] holds head -2, out of range"),
        ({"heads": {0: [True]}}, "head index of layer 0 must be an int"),
        ({"heads": {0.5: [0]}}, "layer index must be an int"),
        ({"heads": {0: 1}}, "must be an iterable of head indices"),
        ({"heads": {0: [0], "0": [1]}}, "heads names layer 0 twice"),
        ({"allow_empty_layers": "yes"}, "allow_empty_layers must be a bool"),
        ({"dead_threshold": -0.1}, r"dead_threshold must be a gate value in \[0, 1\), got -0.1"),
        ({"dead_threshold": 1.0}, "dead_threshold must be a gate value"),
        ({"dead_threshold": math.nan}, "dead_threshold must be a gate value"),
        ({"dead_threshold": True}, "dead_threshold must be a gate value"),
        ({"dead_threshold": "0"}, "dead_threshold must be a gate value"),
    ],
)
def test_prune_config_names_a_bad_field_when_built(fields, message):
    with pytest.raises(HeadkitError, match=message):
        PruneConfig(**fields)


def test_prune_config_holds_its_heads_sorted_and_frozen():
    config = PruneConfig(heads={"3": [2, 0, 2], 1: (1,)})
    assert config.heads == ((1, (1,)), (3, (0, 2))) and config.plan == {1: [1], 3: [0, 2]}
    assert config == PruneConfig(heads=config.heads) and hash(config) == hash(PruneConfig(heads=config.heads))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.allow_empty_layers = True


def test_prune_config_checks_a_models_config_without_its_weights():
    model = _bert()
    config = model.config  # 2 layers of 4 heads
    assert PruneConfig(heads={1: [3, 0]}).heads_to_remove(config) == {1: [0, 3]}
    with pytest.raises(
        HeadkitError, match=r"heads names layer 2, out of range: the model has 2 attention layers"
    ):
        PruneConfig(heads={2: [0]}).check(config)
    with pytest.raises(HeadkitError, match=r"heads\[0\] holds head 4, out of range: layer 0 has 4 heads"):
        PruneConfig(heads={0: [4]}).check(config)
    with pytest.raises(HeadkitError, match="removes every head of layer 0; pass allow_empty_layers=True"):
        PruneConfig(heads={0: [0, 1, 2, 3]}).check(config)
    assert PruneConfig(heads={0: [0, 1, 2, 3]}, allow_empty_layers=True).heads_to_remove(config) == {
        0: [0, 1, 2, 3]
    }
    # the pruning a config records counts: layer 0 has 3 heads left
    prune_heads(model, {0: [1]})
    with pytest.raises(HeadkitError, match=r"holds head 3, out of range: layer 0 has 3 heads"):
        PruneConfig(heads={0: [3]}).check(model.config)
    with pytest.raises(HeadkitError, match="removes every head of layer 0"):
        PruneConfig(heads={0: [0, 1, 2]}).check(model.config)
    # ALBERT's layers share one attention module: one site
    import transformers

    albert = transformers.AlbertConfig(hidden_size=16, num_hidden_layers=3, num_attention_heads=4)
    with pytest.raises(HeadkitError, match="the model has 1 attention layers"):
        PruneConfig(heads={1: [0]}).check(albert)


def test_prune_config_check_refuses_before_any_weight_changes():
    model = _bert()
    before = _state(model)
    for config in (PruneConfig(heads={0: [0], 1: [9]}), PruneConfig(heads={1: [0, 1, 2, 3]})):
        with pytest.raises(HeadkitError, match="out of range|removes every head"):
            config.check(model)
        with pytest.raises(HeadkitError, match="out of range|removes every head"):
            prune_heads(model, config)
        assert _same_state(model, before) and not getattr(model.config, "headkit_surgery", None)


def test_prune_heads_with_a_config_equals_prune_heads_with_keywords_and_is_recorded(tmp_path):
    first, second, third = _bert(), _bert(), _bert()
    config = PruneConfig(heads={0: [2, 1], 1: []})
    prune_heads(first, config)
    prune_heads(second, {0: [1, 2], 1: []}, allow_empty_layers=False)
    prune_heads(third, config=config)
    assert first.config.headkit_surgery == second.config.headkit_surgery == third.config.headkit_surgery
    assert _same_state(first, _state(second)) and _same_state(first, _state(third))
    (entry,) = first.config.headkit_surgery
    # the keys a record had before the config, and the config's later field: old records replay unchanged
    assert set(entry) == {"op", "adapter", "heads", "num_heads", "allow_empty_layers", "dead_threshold"} | {
        "unit",
        "uniform",
    }
    assert PruneConfig.from_record(entry) == PruneConfig(heads={0: [1, 2]})
    with pytest.raises(HeadkitError, match="not both"):
        prune_heads(_bert(), config, allow_empty_layers=True)
    first.save_pretrained(tmp_path)
    assert torch.equal(_hidden(headkit.from_pretrained(tmp_path)), _hidden(first))


def test_a_prune_record_written_before_the_config_replays(tmp_path):
    model = _bert()
    prune_heads(model, {1: [0, 3]})
    # as an early checkpoint recorded it, key for key (string layers, the heads before)
    model.config.headkit_surgery = [
        {
            "op": "prune",
            "adapter": "bert",
            "heads": {"1": [0, 3]},
            "num_heads": {"1": 4},
            "allow_empty_layers": False,
        }
    ]
    assert PruneConfig.from_record(model.config.headkit_surgery[0]).dead_threshold is None
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert torch.equal(_hidden(reloaded), _hidden(model))


def _gated_bert():
    model = _bert()
    gates = add_head_gates(model, "hard_concrete")
    with torch.no_grad():
        gates[0].log_alpha.copy_(torch.tensor([-10.0, 3.0, -1.0, 0.5]))  # closed, open, 0.22, 0.65
        gates[1].log_alpha.copy_(torch.tensor([2.0, -5.0, 3.0, 3.0]))
    return model


def test_the_dead_threshold_is_the_configs_and_prune_dead_heads_is_prune_heads_with_it(tmp_path):
    first, second = _gated_bert(), _gated_bert()
    config = PruneConfig(dead_threshold=0.3)
    assert config.heads_to_remove(first) == {0: [0, 2], 1: [1]}
    report = prune_heads(first, config)
    assert prune_dead_heads(second, 0.3).pruned == report.pruned == {0: [0, 2], 1: [1]}
    assert first.config.headkit_surgery == second.config.headkit_surgery
    entry = first.config.headkit_surgery[-1]
    assert entry["dead_threshold"] == 0.3 and entry["heads"] == {"0": [0, 2], "1": [1]}
    assert PruneConfig.from_record(entry) == PruneConfig(heads={0: [0, 2], 1: [1]}, dead_threshold=0.3)
    # the listed heads and the dead ones together
    assert PruneConfig(heads={1: [3]}, dead_threshold=0.0).heads_to_remove(_gated_bert()) == {
        0: [0],
        1: [1, 3],
    }
    # a reload replays the heads recorded, without reading the gates (their values load afterwards)
    first.save_pretrained(tmp_path)
    assert torch.equal(_hidden(headkit.from_pretrained(tmp_path)), _hidden(first))


def test_the_dead_threshold_needs_gates_which_a_config_alone_tells():
    model = _bert()
    with pytest.raises(HeadkitError, match="the model has no head gates"):
        PruneConfig(dead_threshold=0.0).check(model.config)
    with pytest.raises(HeadkitError, match="the model has no head gates"):
        prune_heads(model, dead_threshold=0.0)
    assert not getattr(model.config, "headkit_surgery", None)
    gated = _gated_bert()
    assert PruneConfig(heads={1: [2]}, dead_threshold=0.0).heads_to_remove(gated.config) == {1: [2]}
    with pytest.raises(HeadkitError, match="out of range"):
        PruneConfig(heads={2: [0]}, dead_threshold=0.0).check(gated)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kind": "soft"}, "kind must be one of"),
        ({"alive_heads": [[0]]}, "alive_heads must be a mapping"),
        ({"alive_heads": {0: [-1]}}, r"alive_heads\[0\] holds head -1, out of range"),
        ({"alive_heads": {True: [0]}}, "layer index must be an int"),
        ({"temperature": -1.0}, "temperature must be a positive float"),
        ({"temperature": math.inf}, "temperature must be a positive float"),
        ({"stretch": (0.1, 1.1)}, r"stretch must be a pair \(l, r\) with l < 0 < 1 < r"),
        ({"stretch": "wide"}, "stretch must be a pair"),
        ({"init_log_alpha": torch.zeros(4)}, "init_log_alpha must be a float"),
        ({"init_log_alpha": math.nan}, "init_log_alpha must be finite"),
        ({"hard": 1}, "hard must be a bool"),
        ({"kind": "fixed", "temperature": 0.5}, r"fixed gates take no options, got \['temperature'\]"),
    ],
)
def test_gate_config_names_a_bad_field_when_built(fields, message):
    with pytest.raises(HeadkitError, match=message):
        GateConfig(**fields)


def test_gate_config_defaults_are_the_hard_concrete_gates():
    import inspect

    from headkit.layers.gates import HardConcreteGate

    defaults = inspect.signature(HardConcreteGate).parameters
    config = GateConfig()
    for name in ("temperature", "stretch", "init_log_alpha", "hard"):
        assert getattr(config, name) == defaults[name].default, name
    assert GateConfig(stretch=[-0.2, 1.2], temperature=1).stretch == (-0.2, 1.2)


def test_gate_config_checks_a_models_config_without_its_weights():
    model = _bert()
    assert GateConfig(alive_heads={1: [3, 1]}).alive(model.config) == {1: [1, 3]}
    with pytest.raises(HeadkitError, match=r"alive_heads names layer 2, out of range"):
        GateConfig(alive_heads={2: [0]}).check(model.config)
    with pytest.raises(HeadkitError, match=r"alive_heads\[0\] holds head 4, out of range"):
        GateConfig(kind="fixed", alive_heads={0: [4]}).check(model.config)
    add_head_gates(model)
    with pytest.raises(HeadkitError, match="already has head gates"):
        GateConfig().check(model.config)
    with pytest.raises(HeadkitError, match="already has head gates"):
        GateConfig().check(model)
    remove_head_gates(model)
    assert GateConfig().alive(model.config) == {}


def test_gate_config_check_refuses_before_any_gate_is_attached():
    model = _bert()
    before, modules = _state(model), [type(m) for m in model.modules()]
    config = GateConfig(alive_heads={0: [0], 1: [7]})
    with pytest.raises(HeadkitError, match="out of range"):
        config.check(model)
    with pytest.raises(HeadkitError, match="out of range"):
        add_head_gates(model, config)
    assert _same_state(model, before) and [type(m) for m in model.modules()] == modules
    assert not getattr(model.config, "headkit_surgery", None)


def test_add_head_gates_with_a_config_equals_add_head_gates_with_keywords_and_is_recorded(tmp_path):
    first, second, third = _bert(), _bert(), _bert()
    config = GateConfig(alive_heads={0: [0, 2]}, temperature=0.5, stretch=(-0.2, 1.2), init_log_alpha=1.0)
    add_head_gates(first, config)
    add_head_gates(
        second, "hard_concrete", {0: [2, 0]}, temperature=0.5, stretch=(-0.2, 1.2), init_log_alpha=1.0
    )
    add_head_gates(third, config=config)
    assert first.config.headkit_surgery == second.config.headkit_surgery == third.config.headkit_surgery
    assert _same_state(first, _state(second)) and _same_state(first, _state(third))
    (entry,) = first.config.headkit_surgery
    assert GateConfig.from_record(entry) == config
    with pytest.raises(HeadkitError, match="not both"):
        add_head_gates(_bert(), config, temperature=0.5)
    with pytest.raises(HeadkitError, match="not both"):
        add_head_gates(_bert(), "fixed", config=config)
    fixed, again = _bert(), _bert()
    add_head_gates(fixed, GateConfig(kind="fixed", alive_heads={1: [1]}))
    add_head_gates(again, "fixed", {1: [1]})
    assert fixed.config.headkit_surgery == again.config.headkit_surgery
    assert _same_state(fixed, _state(again))
    first.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert torch.equal(_hidden(reloaded), _hidden(first))
    gate = head_gates(reloaded)[0]
    assert (gate.temperature, gate.stretch, gate.hard) == (0.5, (-0.2, 1.2), False)


def test_a_gates_record_written_before_the_config_replays_its_options(tmp_path):
    model = _bert()
    add_head_gates(model, temperature=0.5, stretch=(-0.2, 1.2), hard=True, init_log_alpha=0.5)
    # as an early checkpoint recorded it: the Hard Concrete options given, under "options"
    model.config.headkit_surgery = [
        {
            "op": "gates",
            "adapter": "bert",
            "kind": "hard_concrete",
            "num_heads": {"0": 4, "1": 4},
            "options": {"temperature": 0.5, "hard": True, "stretch": [-0.2, 1.2]},
        }
    ]
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    for gate in head_gates(reloaded).values():
        assert (gate.temperature, gate.stretch, gate.hard) == (0.5, (-0.2, 1.2), True)
    assert torch.equal(_hidden(reloaded), _hidden(model))
    assert GateConfig.from_record(model.config.headkit_surgery[0]) == GateConfig(
        temperature=0.5, stretch=(-0.2, 1.2), hard=True
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dim_shared_query_key": 0}, "dim_shared_query_key must be a positive integer, got 0"),
        ({"dim_shared_query_key": True}, "dim_shared_query_key must be a positive integer"),
        ({"dim_shared_query_key": 8.0}, "dim_shared_query_key must be a positive integer"),
        ({"dim_shared_query_key": 8, "seed": "0"}, "seed must be an integer"),
        ({"dim_shared_query_key": 8, "tol": -1e-3}, "tol must be a non-negative number"),
        ({"dim_shared_query_key": 8, "tol": math.nan}, "tol must be a non-negative number"),
        ({"dim_shared_query_key": 8, "max_iter": -1}, "max_iter must be a non-negative integer"),
    ],
)
def test_collaborative_config_names_a_bad_field_when_built(fields, message):
    with pytest.raises(HeadkitError, match=message):
        CollaborativeConfig(**fields)


def test_collaborative_config_checks_a_models_config_without_its_weights():
    import transformers

    bert = _bert().config  # hidden 16, 4 heads of 4
    CollaborativeConfig(16).check(bert)
    with pytest.raises(HeadkitError, match="at most the hidden size 16 .* got 17"):
        CollaborativeConfig(17).check(bert)
    gpt2 = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=4)
    CollaborativeConfig(8).check(gpt2)
    with pytest.raises(HeadkitError, match="does not support compress"):
        CollaborativeConfig(8).check(family_config("llama"))
    grouped = transformers.BertConfig(hidden_size=16, num_attention_heads=4)
    grouped.num_key_value_heads = 2
    with pytest.raises(HeadkitError, match="grouped-query attention"):
        CollaborativeConfig(8).check(grouped)


def test_collaborative_config_check_refuses_before_any_weight_changes():
    model = _bert()
    before = _state(model)
    with pytest.raises(HeadkitError, match="at most the hidden size"):
        CollaborativeConfig(17).check(model)
    with pytest.raises(HeadkitError, match="at most the hidden size"):
        swap_to_collaborative(model, CollaborativeConfig(17))
    llama = family_model("llama")
    llama_state = _state(llama)
    with pytest.raises(HeadkitError, match="rotary"):
        CollaborativeConfig(8).check(llama)
    assert _same_state(model, before) and _same_state(llama, llama_state)
    assert not getattr(model.config, "headkit_surgery", None)


def test_swap_with_a_config_equals_swap_with_keywords_and_is_recorded(tmp_path):
    first, second, third = _bert(), _bert(), _bert()
    config = CollaborativeConfig(8, seed=1, max_iter=20)
    swap_to_collaborative(first, config)
    swap_to_collaborative(second, dim_shared_query_key=8, seed=1, max_iter=20)
    swap_to_collaborative(third, "bert", config=config)
    assert first.config.headkit_surgery == second.config.headkit_surgery == third.config.headkit_surgery
    assert _same_state(first, _state(second)) and _same_state(first, _state(third))
    (entry,) = first.config.headkit_surgery
    assert CollaborativeConfig.from_record(entry) == config
    with pytest.raises(HeadkitError, match="not both"):
        swap_to_collaborative(_bert(), config, seed=2)
    first.save_pretrained(tmp_path)
    assert torch.equal(_hidden(headkit.from_pretrained(tmp_path)), _hidden(first))


def test_a_collaborative_record_written_before_the_config_replays(tmp_path):
    model = _bert()
    swap_to_collaborative(model, dim_shared_query_key=8, max_iter=20)
    (entry,) = model.config.headkit_surgery
    for name in ("seed", "tol", "max_iter"):
        del entry[name]  # as an early checkpoint recorded it: D̃ only
    model.config.headkit_surgery = [entry]
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert torch.equal(_hidden(reloaded), _hidden(model))
    assert CollaborativeConfig.from_record(entry) == CollaborativeConfig(8)


def test_the_configs_fields_are_command_line_options():
    from headkit.runs.options import command_parameters, option_fields, option_name, parse_option

    for config in (PruneConfig, GateConfig, CollaborativeConfig):
        names = [parameter.name for parameter in command_parameters(config)]
        assert names == [f.name for f in dataclasses.fields(config)], config
    (heads, _, dead_threshold, _, _) = option_fields(PruneConfig)
    assert option_name(dead_threshold) == "--dead-threshold"
    assert parse_option(heads, str, "0:1,3:0,0:2") == ((0, (1, 2)), (3, (0,)))
    with pytest.raises(HeadkitError, match="--heads must be layer:head pairs"):
        parse_option(heads, str, "0-1")
