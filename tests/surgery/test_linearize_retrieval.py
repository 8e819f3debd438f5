"""Linearized models that keep what the question asks for: retrieval heads kept exact with a full cache
(DuoAttention), the sparse cache chosen by the prompt's last queries (SnapKV), and the compressed-cache baseline
(fold=False: the same mechanism with no linear state) — decoding, beam search, padding, reload and bad input."""

import pytest
import torch
from tiny_models import peaked_llama

import headkit
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.ops.key_selection import observation_scores
from headkit.surgery.io import SURGERY_KEY
from headkit.surgery.linearize import (
    SplitHeadsState,
    decoding_state_bytes,
    linearized_modules,
    linearized_parameters,
    reconfigure,
)


def tiny(layers=2):
    return peaked_llama(layers)


def ids(batch=2, length=24, seed=1):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def converted(layers=2, **options):
    model = tiny(layers=layers)
    report = headkit.linearize(model, **({"window": 4, "chunk_size": 4} | options))
    with torch.no_grad():  # away from the initial balance, so that the linear term matters
        for parameter in linearized_parameters(model):
            parameter.add_(0.3 * torch.randn_like(parameter))
    return model, report


def steps_and_whole(model, tokens, prefill):
    with torch.no_grad():
        whole = model(tokens).logits
        out = model(tokens[:, :prefill], use_cache=True)
        cache, logits = output_cache(out), [out.logits]
        for t in range(prefill, tokens.shape[1]):
            out = model(tokens[:, t : t + 1], **cache_keyword(cache), use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, 1), whole, cache


RETRIEVAL = {"retrieval_heads": [(0, 1), (1, 0)], "sinks": 1, "budget": 2}


def test_retrieval_heads_decode_as_the_parallel_form_and_their_cache_grows():
    model, report = converted(**RETRIEVAL)
    assert [m.exact_heads for m in linearized_modules(model)] == [(1,), (0,)]
    stepped, whole, cache = steps_and_whole(model, ids(length=30), prefill=9)
    torch.testing.assert_close(stepped, whole, atol=1e-5, rtol=1e-5)
    state = cache.layers[0].get_state()
    assert isinstance(state, SplitHeadsState) and state.keys.shape == (2, 1, 30, 8)
    prompt = ids(batch=1, length=9)
    cached = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=False))
    beams = {"max_new_tokens": 10, "num_beams": 3, "do_sample": False, "early_stopping": False}
    assert torch.equal(
        model.generate(prompt, use_cache=True, **beams), model.generate(prompt, use_cache=False, **beams)
    )

    def state_bytes(context):
        with torch.no_grad():
            return decoding_state_bytes(output_cache(model(ids(batch=1, length=context), use_cache=True)))

    # The exact heads' keys and values grow by 2 heads · 2 · 8 floats per token, plus a padding flag each.
    assert state_bytes(60) - state_bytes(40) == 20 * (2 * 2 * 8 * 4 + 2)
    assert report.state_bytes == sum(m.state_bytes() for m in linearized_modules(model))


def test_every_head_exact_is_the_original_model():
    model = tiny()
    original = tiny()
    headkit.linearize(
        model, window=2, retrieval_heads=[(layer, head) for layer in range(2) for head in range(2)]
    )
    tokens = ids(length=20)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, original(tokens).logits, atol=1e-5, rtol=1e-5)
    stepped, whole, _ = steps_and_whole(model, tokens, prefill=5)
    torch.testing.assert_close(stepped, original(tokens).logits.detach(), atol=1e-5, rtol=1e-5)


def test_a_left_padded_row_with_retrieval_heads_decodes_as_it_does_alone():
    model, _ = converted(**RETRIEVAL)
    short, long = ids(batch=1, length=7, seed=2), ids(batch=1, length=12, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    options = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    together = model.generate(batch, attention_mask=mask, **options)
    assert torch.equal(together[0, 5:], model.generate(short, **options)[0])
    assert torch.equal(together[1], model.generate(long, **options)[0])


def test_the_question_chooses_the_cache_of_a_prefilled_prompt(monkeypatch):
    model, _ = converted(sinks=1, budget=3, selection="question", observation=4)
    seen = []
    module = __import__("headkit.layers.kept_exact", fromlist=["observation_scores"])

    def recording(q, k, **options):
        scores = observation_scores(q, k, **options)
        seen.append((k.detach().clone(), scores))
        return scores

    monkeypatch.setattr(module, "observation_scores", recording)
    tokens = ids(batch=1, length=26)
    with torch.no_grad():
        cache = output_cache(model(tokens, use_cache=True))
    keys, scores = seen[0]  # layer 0
    state = cache.layers[0].get_state()
    # The keys that left the window (positions 1 … 26 − 4; position 0 is the sink), best 3 by the question's score.
    for head in range(2):
        best = sorted(range(1, 23), key=lambda j: -float(scores[0, head, j]))[:3]
        kept = state.sparse_keys[0, head][state.sparse_keep[0, head]]
        torch.testing.assert_close(kept, keys[0, head, sorted(best)])
    # Without a cache no question is asked: the forward is causal (a later token changes no earlier logit).
    other = tokens.clone()
    other[0, -1] = (other[0, -1] + 1) % 97
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, use_cache=False).logits[:, :-1], model(other, use_cache=False).logits[:, :-1]
        )
    prompt = tokens[:, :12]
    assert model.generate(prompt, max_new_tokens=8, do_sample=False).shape == (1, 20)


def test_a_later_turn_is_scored_beside_the_keys_the_cache_holds(monkeypatch):
    # A second prompt appended to a cache: its keys are scored by its last queries over the stored keys (sinks,
    # kept keys, window) and its own, the scale the first prompt's keys were scored on; alone, its softmax over
    # fewer keys would rank every one of its keys above the first prompt's.
    model, _ = converted(sinks=1, budget=3, selection="question", observation=4, fold=False)
    seen = []
    module = __import__("headkit.layers.kept_exact", fromlist=["observation_scores"])

    def recording(q, k, **options):
        seen.append((q.detach().clone(), k.detach().clone(), options))
        return observation_scores(q, k, **options)

    monkeypatch.setattr(module, "observation_scores", recording)
    first, second = ids(batch=1, length=20), ids(batch=1, length=9, seed=5)
    with torch.no_grad():
        cache = output_cache(model(first, use_cache=True))
        stored = [cache.layers[layer].get_state() for layer in range(len(cache.layers))]
        model(second, **cache_keyword(cache), use_cache=True)
    layers = len(stored)
    assert seen[0][2].get("past_keys") is None  # the first prompt: an empty cache
    q, k, options = seen[layers]  # layer 0, the second prompt
    state = stored[0]
    window = state.window
    expected_keys = torch.cat([state.sink_keys, state.sparse_keys, window.keys], dim=2)
    torch.testing.assert_close(options["past_keys"], expected_keys)
    heads = state.sparse_keys.shape[1]
    filled = heads * (state.sink_keep.sum() + window.keep.sum()) + state.sparse_keep.sum()
    assert options["past_mask"].sum() == filled > 0
    beside = observation_scores(q, k, **options)
    options = {name: value for name, value in options.items() if not name.startswith("past")}
    assert (beside < observation_scores(q, k, **options)).any()


def test_the_compressed_cache_baseline_prefills_in_full_and_decodes_from_the_kept_keys():
    model = tiny()
    original = tiny()
    report = headkit.linearize(model, window=4, sinks=1, budget=3, selection="question", fold=False)
    assert report.trainable_parameters == 0 and not linearized_parameters(model)
    tokens = ids(batch=1, length=30)
    stepped, whole, cache = steps_and_whole(model, tokens, prefill=20)
    with torch.no_grad():
        reference = original(tokens).logits
    torch.testing.assert_close(stepped[:, :20], reference[:, :20], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(stepped[:, 20:], reference[:, 20:], atol=1e-3)
    # The state: window 3 + 1 sink + 3 kept keys and values per key/value head, nothing that grows.
    assert decoding_state_bytes(cache) < 2 * 2 * 2 * 8 * 4 * 30


def test_save_and_reload_rebuilds_selection_fold_and_retrieval_heads(tmp_path):
    model, _ = converted(selection="question", observation=5, **RETRIEVAL)
    entry = model.config.to_dict()[SURGERY_KEY][-1]
    assert entry["retrieval_heads"] == [[0, 1], [1, 0]] and entry["selection"] == "question"
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    rebuilt = [(m.exact_heads, m.selection, m.observation, m.fold) for m in linearized_modules(reloaded)]
    assert rebuilt == [((1,), "question", 5, True), ((0,), "question", 5, True)]
    prompt = ids(batch=1, length=15)
    assert torch.equal(
        reloaded.generate(prompt, max_new_tokens=8, do_sample=False),
        model.generate(prompt, max_new_tokens=8, do_sample=False),
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"retrieval_heads": [(0, 2)]}, r"retrieval_heads must name key/value heads in \[0, 2\)"),
        ({"retrieval_heads": [(5, 0)]}, r"retrieval_heads must name layers in \[0, 2\)"),
        ({"retrieval_heads": [(0, 0), (0, 0)]}, "retrieval_heads lists a head twice"),
        ({"retrieval_heads": [(1, 0)], "layers": [0]}, "retrieval_heads must name heads of converted layers"),
        ({"budget": 300}, "budget must be at most the model's context of 256"),
        ({"observation": 257}, "observation must be at most the model's context of 256"),
        ({"observation": 0}, "observation must be a positive integer"),
        ({"selection": "oracle"}, "selection must be one of recall, question"),
        ({"fold": "no"}, "fold must be a bool"),
    ],
)
def test_bad_retrieval_options_leave_the_model_untouched(arguments, message):
    model = tiny()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(HeadkitError, match=message):
        headkit.linearize(model, window=4, **arguments)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not linearized_modules(model) and not getattr(model.config, SURGERY_KEY, None)


def test_reconfigure_changes_the_budget_selection_and_heads_in_place_and_reloads(tmp_path):
    model, _ = converted(sinks=1, budget=2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = reconfigure(model, budget=5, selection="question", retrieval_heads=[(1, 1)])
    assert config.budget == 5 and config.retrieval_heads == ((1, 1),)
    assert [(m.budget, m.selection, m.exact_heads) for m in linearized_modules(model)] == [
        (5, "question", ()),
        (5, "question", (1,)),
    ]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    fresh, _ = converted(sinks=1, budget=5, selection="question", retrieval_heads=[(1, 1)])
    fresh.load_state_dict(model.state_dict())
    prompt = ids(batch=1, length=20)
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, fresh(prompt).logits)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert [m.exact_heads for m in linearized_modules(reloaded)] == [(), (1,)]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(prompt).logits, model(prompt).logits)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"window": 8}, "reconfigure changes only"),
        ({"retrieval_heads": [(0, 5)]}, r"retrieval_heads must name key/value heads in \[0, 2\)"),
        ({"budget": -1}, "budget must be a non-negative integer"),
    ],
)
def test_a_bad_reconfiguration_leaves_the_model_as_it_was(changes, message):
    model, _ = converted(sinks=1, budget=2)
    record = model.config.to_dict()[SURGERY_KEY]
    with pytest.raises(HeadkitError, match=message):
        reconfigure(model, **changes)
    assert model.config.to_dict()[SURGERY_KEY] == record
    assert [m.budget for m in linearized_modules(model)] == [2, 2]
