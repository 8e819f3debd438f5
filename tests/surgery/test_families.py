"""The decoder family registry drives these tests: every entry of ``FAMILIES`` gets a tiny random model of its
real config class (family_models.py) and the pruning checks its operations promise. Adding an entry adds tests."""

import copy
import subprocess
import sys

import pytest
import torch
import transformers
from family_models import VOCAB, family_inputs, family_model

import headkit
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.surgery.adapters import ADAPTERS, get_adapter
from headkit.surgery.families import (
    COMPRESS,
    FAMILIES,
    PRUNE,
    UNIFORM,
    DecoderFamily,
    get_family,
    supported_families,
)
from headkit.surgery.gating import add_head_gates
from headkit.surgery.pruning import heads_per_layer, kv_heads_per_layer, prune_heads, to_stock_architecture

PRUNABLE = supported_families(PRUNE)
UNIFORM_FAMILIES = supported_families(UNIFORM)
# Layer 0 keeps heads 1 | 2, 3 (uneven under grouped-query attention); layer 1 keeps 0 | 3 (one per group).
QUERY_PLAN = {0: [0], 1: [1, 2]}
# Layer 0 loses key/value group 0 (heads 0, 1), layer 1 group 1 (heads 2, 3): 2 heads over 1 group in each.
GROUP_PLAN = {0: [0, 1], 1: [2, 3]}


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def _gate_zeroed(model, removed):
    reference = copy.deepcopy(model)
    sites = get_adapter(reference).sites(reference)
    keep = {i: [h for h in range(sites[i].num_heads) if h not in heads] for i, heads in removed.items()}
    add_head_gates(reference, "fixed", keep)
    return reference


def _pruned(model_type, plan=QUERY_PLAN):
    original = family_model(model_type)
    model = copy.deepcopy(original)
    report = prune_heads(model, plan)
    return original, model, report


# -- the registry ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_is_found_with_its_adapter_and_sites(model_type):
    family = FAMILIES[model_type]
    model = family_model(model_type)
    assert get_family(model) is family and get_family(model.config) is family
    assert family.adapter in ADAPTERS
    adapter = get_adapter(model)
    assert adapter.name == family.adapter
    assert [site.layers for site in adapter.sites(model)] == [(0,), (1,)]
    if COMPRESS in family.operations:
        assert not adapter.rotary  # the collaborative re-parametrisation needs queries linear in the input


def test_an_unsupported_decoder_family_is_refused_in_one_line():
    config = transformers.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        new_decoder_architecture=True,
    )
    model = transformers.FalconForCausalLM(config)
    with pytest.raises(HeadkitError) as error:
        get_family(model, PRUNE)
    message = str(error.value)
    assert "\n" not in message
    assert "'falcon'" in message and "qwen3" in message and "missing: a DecoderFamily entry" in message
    with pytest.raises(HeadkitError, match="decoder families: .*qwen3"):
        prune_heads(model, {0: [0]})
    with pytest.raises(HeadkitError, match=r"gpt_neox .* does not support uniform .*missing: a config"):
        get_family(family_model("gpt_neox"), UNIFORM)
    with pytest.raises(HeadkitError, match="unknown operations"):
        DecoderFamily("x", "XConfig", operations=frozenset({"fly"}))


# -- pruning query heads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", PRUNABLE)
def test_pruning_query_heads_equals_gate_zeroing(model_type):
    family = FAMILIES[model_type]
    original, model, report = _pruned(model_type)
    ids = family_inputs()
    assert heads_per_layer(model) == {0: 3, 1: 2}
    assert report.parameters_after < report.parameters_before
    grouped = original.config.model_type not in ("gpt2", "gpt_neox")
    if grouped:
        assert report.uneven_layers == [0] and kv_heads_per_layer(model) == {0: 2, 1: 2}
    expected = _logits(_gate_zeroed(original, QUERY_PLAN), ids)
    if family.exact_pruning:
        torch.testing.assert_close(_logits(model, ids), expected, atol=1e-5, rtol=1e-5)
    else:  # OLMo 2: the norms over all heads were sliced to the kept heads, which are renormalised
        site, before = get_adapter(model).sites(model)[1], get_adapter(original).sites(original)[1]
        kept = torch.cat([torch.arange(16), torch.arange(48, 64)])  # heads 0 and 3
        assert torch.equal(site.module.q_norm.weight, before.module.q_norm.weight[kept])
        assert site.module.k_norm.weight.shape == before.module.k_norm.weight.shape  # both groups still read
        changed = (_logits(model, ids) - expected).abs().max()
        assert torch.isfinite(_logits(model, ids)).all() and 0 < changed < 1.0


@pytest.mark.parametrize("model_type", PRUNABLE)
def test_pruned_families_decode_with_a_cache_like_without_and_generate(model_type):
    _, model, _ = _pruned(model_type)
    prompt = family_inputs(batch=1, length=6)
    with torch.no_grad():
        full = _logits(model, prompt)
        step = model(prompt[:, :3], use_cache=True)
        cache, logits = output_cache(step), [step.logits]
        for t in range(3, 6):
            step = model(prompt[:, t : t + 1], **cache_keyword(cache), use_cache=True)
            cache = output_cache(step)
            logits.append(step.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-5, rtol=1e-5)
    generated = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False
    )
    assert generated.shape == (1, 10)


@pytest.mark.parametrize("model_type", PRUNABLE)
def test_a_left_padded_batch_equals_each_row_alone(model_type):
    _, model, _ = _pruned(model_type)
    rows = [family_inputs(batch=1, length=7)[0], family_inputs(batch=1, length=7)[0, 3:]]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 7 - len(row) :], mask[i, 7 - len(row) :] = row, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batched = _logits(model, ids, attention_mask=mask, position_ids=positions)
    for i, row in enumerate(rows):
        alone = _logits(model, row[None])
        torch.testing.assert_close(batched[i, 7 - len(row) :], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", PRUNABLE)
def test_pruned_families_reload_with_headkit_with_identical_logits(model_type, tmp_path):
    _, model, _ = _pruned(model_type)
    ids = family_inputs()
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert type(reloaded) is type(model)
    assert heads_per_layer(reloaded) == heads_per_layer(model)
    assert torch.equal(_logits(reloaded, ids), _logits(model, ids))


# -- uniform group pruning: the stock architecture -------------------------------------------------------------

_NO_HEADKIT = """
import sys, importlib.abc, json
class NoHeadkit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "headkit" or name.startswith("headkit."):
            raise ImportError("headkit is not importable here")
sys.meta_path.insert(0, NoHeadkit())
import torch, transformers
torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
try:
    import headkit
except ImportError:
    pass
else:
    raise SystemExit("headkit was importable")
results = {}
for folder in sys.argv[1:]:
    expected = torch.load(folder + "/expected.pt")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(input_ids=expected["ids"]).logits
    results[folder] = [type(model).__name__, float((logits - expected["logits"]).abs().max())]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def stock_folders(tmp_path_factory):
    """Each uniform family, group-pruned to the stock architecture and saved, then loaded in one Python that
    cannot import headkit: {model_type: (folder, class name there, max |Δ logits|)}."""
    import json

    folders = {}
    for model_type in UNIFORM_FAMILIES:
        _, model, _ = _pruned(model_type, GROUP_PLAN)
        to_stock_architecture(model)
        folder = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(folder)
        ids = family_inputs()
        torch.save({"ids": ids, "logits": _logits(model, ids)}, folder / "expected.pt")
        folders[model_type] = folder
    result = subprocess.run(
        [sys.executable, "-c", _NO_HEADKIT, *map(str, folders.values())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    return {model_type: (folder, *loaded[str(folder)]) for model_type, folder in folders.items()}


@pytest.mark.parametrize("model_type", UNIFORM_FAMILIES)
def test_uniform_group_pruning_loads_in_plain_transformers_with_identical_logits(model_type, stock_folders):
    import json

    original, model, _ = _pruned(model_type, GROUP_PLAN)
    update = to_stock_architecture(model)
    assert update == {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    if FAMILIES[model_type].exact_pruning:
        ids = family_inputs()
        torch.testing.assert_close(
            _logits(model, ids), _logits(_gate_zeroed(original, GROUP_PLAN), ids), atol=1e-5, rtol=1e-5
        )
    folder, class_name, difference = stock_folders[model_type]
    config = json.loads((folder / "config.json").read_text())
    assert "headkit_surgery" not in config and config["architectures"] == [type(model).__name__]
    assert class_name == type(model).__name__
    assert difference == 0.0


@pytest.mark.parametrize("model_type", sorted(set(PRUNABLE) - set(UNIFORM_FAMILIES)))
def test_families_whose_config_cannot_state_fewer_heads_refuse_the_stock_form(model_type):
    _, model, _ = _pruned(model_type, GROUP_PLAN)
    before = model.config.to_dict()
    with pytest.raises(HeadkitError):
        to_stock_architecture(model)
    assert model.config.to_dict() == before
