"""headkit.apply_: one entry point for every surgery config, compositions applied and replayed in order, the config
protocol (check / record / from_record), and the one function for the cache's bytes per token."""

import copy
import dataclasses
import json
import warnings

import pytest
import torch
from family_models import family_inputs, family_model
from tiny_models import outputs, state_of, tiny_inputs, tiny_model

import headkit
import headkit.surgery.records
from headkit.compat import output_cache
from headkit.errors import HeadkitError
from headkit.evaluation.memory import cache_bytes, kv_cache_bytes_per_token
from headkit.layers.cache import state_tensors
from headkit.layers.quantized_cache import exact_leaves
from headkit.surgery import (
    CollaborativeConfig,
    CompressedCacheConfig,
    GateConfig,
    LatentKVConfig,
    LinearizeConfig,
    PruneConfig,
    QuantizedKVConfig,
    SurgeryConfig,
    bytes_per_token,
    recorded_configs,
)
from headkit.surgery.records import CONVERSIONS

# One config of each surgery, with values other than the defaults wherever a field has one.
CONFIGS = [
    PruneConfig(heads={0: [1, 3], 1: [0]}, allow_empty_layers=True, dead_threshold=0.25),
    PruneConfig(heads={0: [0, 1], 1: [2, 3]}, unit="group", uniform=True),
    GateConfig(alive_heads={1: [0, 2]}, temperature=0.5, stretch=(-0.2, 1.2), init_log_alpha=2.0, hard=True),
    GateConfig(kind="fixed", alive_heads={0: [1]}),
    CollaborativeConfig(24, seed=3, tol=1e-5, max_iter=40),
    LatentKVConfig(kv_rank=20, rope_dims=4, rope_selection="norms", rank_allocation="spectrum"),
    LatentKVConfig(kv_rank=20, rope_dims=4, rope_selection="rorope", rope_fold=2, balance_kv=True),
    CompressedCacheConfig(window=8, sinks=2, budget=3, observation=4, retrieval_heads=((1, 0),), layers=(1,)),
    CompressedCacheConfig(budget=3, selection="reconstruction", reconstruction_prompt=(5, 6)),
    LinearizeConfig(
        window=8,
        feature_map="elu",
        layers=(1,),
        feature_dim=16,
        chunk_size=16,
        convert_sliding=True,
        sinks=2,
        budget=3,
        selection="question",
        observation=4,
        fold=False,
        feature_wavelength=32,
        retrieval_heads=((1, 0),),
    ),  # fmt: skip
    QuantizedKVConfig(bits=4, group_size=8, residual=16),
    QuantizedKVConfig(bits=8, full_precision_window=True),
]


def test_every_registered_config_is_one_of_these_and_round_trips_its_record():
    assert {type(config) for config in CONFIGS} == set(CONVERSIONS)
    unchanged: dict[type, set[str]] = {}
    for config in CONFIGS:
        assert isinstance(config, SurgeryConfig)
        record = config.record()
        assert type(config).from_record(json.loads(json.dumps(record))) == config  # what config.json holds
        defaults = {
            f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING
        }
        same = {name for name, value in defaults.items() if getattr(config, name) == value}
        unchanged[type(config)] = unchanged.get(type(config), same) & same
    # every field is shown with a value other than its default by one of the configs
    assert not any(unchanged.values()), unchanged


def test_check_returns_nothing_and_refuses_by_naming_the_field():
    llama = family_model("llama")
    for config in [
        PruneConfig(heads={0: [1]}),
        GateConfig(),
        LatentKVConfig(20, 4),
        LinearizeConfig(window=8),
    ]:
        assert config.check(llama.config) is None
        assert config.check(llama) is None
    with pytest.raises(HeadkitError, match="heads"):
        PruneConfig(heads={0: [99]}).check(llama.config)
    with pytest.raises(HeadkitError, match="window"):
        LinearizeConfig(window=100_000).check(llama.config)
    with pytest.raises(HeadkitError, match="kv_rank|R"):
        LatentKVConfig(kv_rank=100_000, rope_dims=4).check(llama.config)


@pytest.mark.parametrize(
    "old, config, call",
    [
        ("prune_heads", PruneConfig(heads={0: [1]}), lambda m: headkit.prune_heads(m, {0: [1]})),
        ("add_head_gates", GateConfig(kind="fixed"), lambda m: headkit.add_head_gates(m, "fixed")),
        (
            "swap_to_collaborative",
            CollaborativeConfig(16, max_iter=5),
            lambda m: headkit.swap_to_collaborative(m, dim_shared_query_key=16, max_iter=5),
        ),
    ],
)
def test_apply_gives_what_the_old_entry_point_gives_and_the_old_one_says_its_deprecation_once(
    old, config, call, monkeypatch
):
    monkeypatch.setattr(headkit.surgery.records, "_DEPRECATIONS_SAID", set())  # as in a new process
    first, second = tiny_model("bert"), tiny_model("bert")
    headkit.apply_(first, config)
    with pytest.warns(FutureWarning, match=f"{old}.*headkit.apply_"):
        call(second)
    inputs = tiny_inputs("bert")
    assert torch.equal(outputs(first, inputs), outputs(second, inputs))
    assert first.config.headkit_surgery == second.config.headkit_surgery
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(tiny_model("bert"))  # said once per process


def test_apply_on_decoders_latent_and_linearize_as_the_old_functions_do():
    tokens = family_inputs(length=9)
    for config, old in [
        (LatentKVConfig(kv_rank=24, rope_dims=8), headkit.surgery.compress_kv_to_latent),
        (LinearizeConfig(window=4, feature_map="elu"), headkit.linearize),
    ]:
        first, second = family_model("llama"), family_model("llama")
        report = headkit.apply_(first, config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            old(second, config)
        assert type(report).__name__.endswith("Report")
        with torch.no_grad():
            assert torch.equal(first(tokens).logits, second(tokens).logits)
        assert recorded_configs(first)[0].record() == recorded_configs(second)[0].record()


@pytest.mark.parametrize(
    "steps",
    [
        [PruneConfig(heads={0: [0, 1], 1: [2, 3]}), LatentKVConfig(kv_rank=12, rope_dims=4)],
        [
            PruneConfig(heads={0: [0, 1]}),
            LinearizeConfig(window=4, sinks=1, budget=2, selection="question", observation=2, fold=False),
        ],
        # heads renumbered after the first pruning: 0 of what is left is the original's 1, so group 0 goes
        [PruneConfig(heads={0: [0]}), PruneConfig(heads={0: [0]}), LatentKVConfig(kv_rank=16, rope_dims=4)],
    ],
    ids=["prune-latent", "prune-compressed-cache", "prune-prune-latent"],
)
def test_a_composition_applies_in_order_and_reloads_with_identical_logits_and_caches(tmp_path, steps):
    model = family_model("llama")  # 4 query heads, 2 key/value heads per layer
    reports = headkit.apply_(model, steps)
    assert len(reports) == len(steps)
    assert [type(c) for c in recorded_configs(model)] == [type(s) for s in steps]
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert [c.record() for c in recorded_configs(reloaded)] == [c.record() for c in recorded_configs(model)]
    tokens = family_inputs(length=12)
    with torch.no_grad():
        mine, theirs = model(tokens, use_cache=True), reloaded(tokens, use_cache=True)
        assert torch.equal(mine.logits, theirs.logits)
        options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(reloaded.generate(tokens, **options), model.generate(tokens, **options))


def test_bytes_per_token_from_the_configs_is_the_measured_cache_growth():
    original = family_model("llama")
    cases = [
        [],
        [PruneConfig(heads={0: [0, 1]})],  # one key/value group of layer 0
        [PruneConfig(heads={0: [0]})],  # a query head only: the cache keeps its key/value head
        [LatentKVConfig(kv_rank=12, rope_dims=4)],
        [PruneConfig(heads={0: [0, 1], 1: [2, 3]}), LatentKVConfig(kv_rank=12, rope_dims=4)],
    ]
    for steps in cases:
        model = copy.deepcopy(original)
        if steps:
            headkit.apply_(model, steps)
        measured = kv_cache_bytes_per_token(model)  # float32 caches
        assert bytes_per_token(original.config, steps, bytes_per_number=4) == measured, steps
        assert bytes_per_token(original.config, steps) == measured / 2  # bfloat16, what engines keep
        assert bytes_per_token(model.config) == measured / 2  # the surgery the model's config records
    assert bytes_per_token(original.config) == 2 * 2 * 2 * 16 * 2  # layers · (K, V) · G · head_dim · 2 bytes


def _floating_state_bytes(model, context):
    """The floating-point numbers (float32) of the cache a prompt of `context` tokens leaves, every layer: a
    linearized layer's state (window, sinks, kept keys, linear state, normalizer, retrieval heads), a stock layer's
    keys and values; not the bookkeeping (positions, flags)."""
    with torch.no_grad():
        cache = output_cache(model(torch.zeros(1, context, dtype=torch.long), use_cache=True))
    total = 0
    for layer in cache.layers:
        state = getattr(layer, "state", None)
        tensors = state_tensors(state) if state is not None else [layer.keys, layer.values]
        total += sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())
    return total


@pytest.mark.parametrize(
    "steps",
    [
        [LinearizeConfig(window=4)],
        [LinearizeConfig(window=4, sinks=2, budget=3)],
        [LinearizeConfig(window=4, sinks=1, budget=2, selection="question", observation=2)],
        [LinearizeConfig(window=4, layers=(0,))],  # layer 1 keeps its key/value cache
        [LinearizeConfig(window=4, retrieval_heads=((0, 1),))],  # a full cache that grows
        [LinearizeConfig(window=4, feature_map="elu")],
        [PruneConfig(heads={0: [0, 1]}), LinearizeConfig(window=4, budget=2)],
    ],
    ids=["plain", "sinks-budget", "question", "one-layer", "retrieval", "elu", "prune-linearize"],
)
def test_a_linearized_states_bytes_per_token_from_the_configs_are_the_state_it_keeps(steps):
    original = family_model("llama")
    model = copy.deepcopy(original)
    headkit.apply_(model, steps)
    for context in (12, 40):
        measured = _floating_state_bytes(model, context)
        assert bytes_per_token(original.config, steps, bytes_per_number=4, context=context) * context == (
            pytest.approx(measured)
        )
        assert bytes_per_token(model.config, bytes_per_number=4, context=context) * context == pytest.approx(
            measured
        )
    constant = not steps[-1].retrieval_heads and steps[-1].layers is None
    # a state of constant size costs less per token of a longer sequence; a full cache does not
    longer, shorter = (bytes_per_token(model.config, context=n) for n in (8192, 1024))
    assert longer < shorter if constant else longer > 0
    with torch.random.fork_rng():
        torch.manual_seed(3)
        expected = torch.rand(1)
    torch.manual_seed(3)
    bytes_per_token(original.config, steps)  # builds a mechanism: the random generators are left as they were
    assert torch.equal(torch.rand(1), expected)


def test_a_composition_is_refused_before_any_work():
    model = family_model("llama")
    before = state_of(model)
    with pytest.raises(HeadkitError, match="LinearizeConfig replaces the attention mechanism.*PruneConfig"):
        headkit.apply_(model, [LinearizeConfig(window=4), PruneConfig(heads={0: [0]})])
    with pytest.raises(HeadkitError, match="heads"):  # the second step against the config the first leaves
        headkit.apply_(model, [PruneConfig(heads={0: [0, 1]}), PruneConfig(heads={0: [2]})])
    with pytest.raises(HeadkitError, match="gated"):
        headkit.apply_(model, [GateConfig(), LatentKVConfig(kv_rank=12, rope_dims=4)])
    with pytest.raises(HeadkitError, match=r"pruned unevenly in layers \[0\]"):
        headkit.apply_(model, [PruneConfig(heads={0: [0]}), LatentKVConfig(kv_rank=12, rope_dims=4)])
    with pytest.raises(HeadkitError, match=r"keywords \['calibraton'\]"):
        headkit.apply_(model, LatentKVConfig(kv_rank=12, rope_dims=4), calibraton=[])
    with pytest.raises(HeadkitError, match="config must be a surgery config"):
        headkit.apply_(model, {"kv_rank": 12})
    with pytest.raises(HeadkitError, match="non-empty list"):
        headkit.apply_(model, [])
    after = state_of(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not getattr(model.config, "headkit_surgery", None)


def test_checkpoints_recorded_before_the_protocol_still_load(tmp_path):
    # A latent record as written before the ranks were allocated per layer: replayed through from_record.
    model = family_model("llama")
    headkit.apply_(model, LatentKVConfig(kv_rank=12, rope_dims=4))
    entry = model.config.headkit_surgery[0]
    legacy = {key: entry[key] for key in ("op", "adapter", "kv_rank", "rope_dims", "rope_selection", "sites")}
    legacy["rope_pairs"] = entry["rope_pairs"]  # no kv_ranks, no rank_allocation: written before both
    model.config.headkit_surgery = [legacy]
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = family_inputs(length=6)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


def test_the_pruning_unit_and_uniformity_are_checked_on_the_config_and_the_model():
    model = family_model("llama")  # 2 layers of 4 query heads in 2 key/value groups
    before = state_of(model)
    for config in [
        PruneConfig(heads={0: [0]}, unit="group"),  # half of group 0
        PruneConfig(heads={0: [0, 1]}, uniform=True),  # layer 1 keeps every head
        PruneConfig(heads={0: [0, 2], 1: [0, 1]}, uniform=True),  # one head per group, then a whole group
    ]:
        for target in (model.config, model):
            with pytest.raises(HeadkitError, match="unit 'group'|uniform pruning"):
                config.check(target)
        with pytest.raises(HeadkitError):
            headkit.apply_(model, config)
    with pytest.raises(HeadkitError, match="unit must be one of query, group"):
        PruneConfig(unit="layer")
    after = state_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    report = headkit.apply_(model, PruneConfig(heads={0: [0, 2], 1: [1, 3]}, uniform=True))
    assert report.kv_heads_after == {0: 2, 1: 2} and report.heads_after == {0: 2, 1: 2}
    assert recorded_configs(model)[0].uniform


def test_the_compressed_cache_is_the_linearized_layer_with_nothing_folded_and_counts_its_bytes(tmp_path):
    config = CompressedCacheConfig(window=8, sinks=2, budget=4, observation=4)
    first, second = family_model("llama"), family_model("llama")
    headkit.apply_(first, config)
    headkit.apply_(second, config.linearize_config())  # the same mechanism, recorded as a linearization
    tokens = family_inputs(length=40)
    with torch.no_grad():
        assert torch.equal(first(tokens).logits, second(tokens).logits)
    assert first.config.headkit_surgery[0]["op"] == "compressed_cache"
    assert recorded_configs(first) == [dataclasses.replace(config, layers=(0, 1))]  # the layers it resolved
    assert not any(
        p.requires_grad and "feature_map" in n for n, p in first.named_parameters()
    )  # nothing to train
    first.save_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(headkit.from_pretrained(tmp_path)(tokens).logits, first(tokens).logits)
    # bytes from the config against the cache a prompt leaves, at two lengths (the state does not grow)
    for context in (32, 64):
        measured = cache_bytes(first, context) / context
        counted = bytes_per_token(first.config, bytes_per_number=4, context=context)
        with torch.no_grad():
            cache = output_cache(first(torch.zeros(1, context, dtype=torch.long), use_cache=True))
        stored = sum(
            t.numel() * t.element_size() for layer in cache.layers for _, t in exact_leaves(layer.state)
        )
        assert stored == counted * context  # S + W − 1 + B keys and values per head
        assert counted < measured <= 1.15 * counted, (context, counted, measured)  # + features, flags, scores
    retrieval = family_model("llama")
    headkit.apply_(retrieval, CompressedCacheConfig(window=8, sinks=2, budget=4, retrieval_heads=((0, 1),)))
    growth = (cache_bytes(retrieval, 64) - cache_bytes(retrieval, 32)) / 32
    assert growth == pytest.approx(2 * 16 * 4, abs=1)  # one head's key and value per token (+ a padding flag)


def test_the_compressed_cache_refuses_by_its_own_names():
    model = family_model("llama")  # context 128
    with pytest.raises(HeadkitError, match="budget must be at most the model's context"):
        CompressedCacheConfig(window=8, budget=1000).check(model.config)
    with pytest.raises(HeadkitError, match="budget must be"):
        CompressedCacheConfig(budget=-1)
    with pytest.raises(HeadkitError, match="retrieval_heads must name key/value heads in \\[0, 2\\)"):
        headkit.apply_(model, CompressedCacheConfig(window=8, retrieval_heads=((0, 5),)))
    assert not getattr(model.config, "headkit_surgery", None)
