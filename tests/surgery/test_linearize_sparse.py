"""headkit.linearize with attention sinks and a sparse exact cache: decoding, beam search, padding and reload all
see the mechanism the parallel (training) form computes."""

import copy

import pytest
import torch
from tiny_models import peaked_llama

import headkit
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.ops.hybrid import SparseHybridState
from headkit.surgery.io import SURGERY_KEY
from headkit.surgery.linearize import decoding_state_bytes, linearized_modules, linearized_parameters


def tiny(architecture="llama", layers=2):
    assert architecture == "llama"
    return peaked_llama(layers)


def ids(batch=2, length=24, seed=1):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def state_snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


EXACT = {"window": 4, "sinks": 2, "budget": 3}


def converted(layers=2, **options):
    model = tiny("llama", layers=layers)
    report = headkit.linearize(model, chunk_size=4, **(EXACT | options))
    with torch.no_grad():  # away from the initial balance, so that the linear term and the selection matter
        for parameter in linearized_parameters(model):
            parameter.add_(0.3 * torch.randn_like(parameter))
    return model, report


def test_step_by_step_decoding_equals_the_parallel_form_and_generate_agrees():
    model, report = converted(layers=3)
    assert report.sinks == 2 and report.budget == 3 and "2 sinks, budget 3" in str(report)
    tokens = ids(batch=2, length=40)
    with torch.no_grad():
        full = model(tokens).logits
        out = model(tokens[:, :11], use_cache=True)  # a multi-token prefill, then one token at a time
        cache, steps = output_cache(out), [out.logits[:, -1]]
        for t in range(11, 39):
            out = model(tokens[:, t : t + 1], **cache_keyword(cache), use_cache=True)
            steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 10:-1], atol=1e-4, rtol=1e-4)
    assert isinstance(cache.layers[0].get_state(), SparseHybridState)
    prompt = tokens[:1, :9]
    cached = model.generate(prompt, max_new_tokens=25, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=25, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_the_mechanism_differs_from_the_plain_hybrid_beyond_the_window():
    model, _ = converted()
    plain = copy.deepcopy(model)
    for module in linearized_modules(plain):
        module.configure(sinks=0, budget=0, selection="recall", observation=32, exact_heads=())
    tokens = ids(length=30)
    with torch.no_grad():
        same = (model(tokens[:, :4]).logits - plain(tokens[:, :4]).logits).abs().max()
        differ = (model(tokens).logits - plain(tokens).logits).abs().max()
    assert same < 1e-5 < differ  # inside the window nothing left it: identical


def test_beam_search_reorders_the_state():
    model, _ = converted()
    prompt = ids(batch=1, length=8, seed=4)
    options = {"max_new_tokens": 14, "num_beams": 3, "do_sample": False, "early_stopping": False}
    cached = model.generate(prompt, use_cache=True, **options)
    uncached = model.generate(prompt, use_cache=False, **options)
    assert torch.equal(cached, uncached)


def test_a_left_padded_row_decodes_as_it_does_alone():
    model, _ = converted()
    short, long = ids(batch=1, length=7, seed=2), ids(batch=1, length=12, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    options = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    together = model.generate(batch, attention_mask=mask, **options)
    assert torch.equal(together[0, 5:], model.generate(short, **options)[0])
    assert torch.equal(together[1], model.generate(long, **options)[0])


def test_the_state_is_constant_in_the_context_and_counts_sinks_and_cache():
    model, report = converted()
    plain = tiny("llama")
    headkit.linearize(plain, window=4)

    def state_bytes(network, context):
        with torch.no_grad():
            return decoding_state_bytes(output_cache(network(ids(batch=1, length=context), use_cache=True)))

    assert state_bytes(model, 16) == state_bytes(model, 90) == state_bytes(model, 200) == report.state_bytes
    assert state_bytes(model, 90) > state_bytes(plain, 90)


def test_save_and_reload_rebuilds_sinks_and_cache(tmp_path):
    model, _ = converted(layers=3)
    entry = model.config.to_dict()[SURGERY_KEY][-1]
    assert entry["sinks"] == 2 and entry["budget"] == 3
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert [(m.sinks, m.budget) for m in linearized_modules(reloaded)] == [(2, 3)] * 3
    tokens = ids(length=30)
    torch.testing.assert_close(reloaded(tokens).logits, model(tokens).logits, atol=0, rtol=0)
    prompt = tokens[:1, :7]
    assert torch.equal(
        reloaded.generate(prompt, max_new_tokens=10, do_sample=False),
        model.generate(prompt, max_new_tokens=10, do_sample=False),
    )


def test_gradients_of_the_parallel_form_reach_the_feature_maps():
    model, _ = converted()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in linearized_parameters(model):
        parameter.requires_grad_(True)
    model(ids(length=30)).logits.pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in linearized_parameters(model))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"sinks": -1}, "sinks must be a non-negative integer"),
        ({"budget": 2.5}, "budget must be a non-negative integer"),
        ({"budget": True}, "budget must be a non-negative integer"),
    ],
)
def test_bad_sinks_or_budget_leave_the_model_untouched(arguments, message):
    model = tiny("llama")
    before = state_snapshot(model)
    with pytest.raises(HeadkitError, match=message):
        headkit.linearize(model, window=4, **arguments)
    after = state_snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not linearized_modules(model) and not getattr(model.config, SURGERY_KEY, None)
