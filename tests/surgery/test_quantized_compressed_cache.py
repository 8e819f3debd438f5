"""Fewer tokens with fewer bits: [CompressedCacheConfig, QuantizedKVConfig] through headkit.apply_. The quantized
path is the unquantized compressed cache run on the dequantized keys and values (outputs and states), each token
quantized once; cached decoding is the uncached forward within the quantization's error; padded rows decode as
each alone; beam search; reload; the bytes per token the configs state are the bytes stored; refusals of orders
that cannot be replayed, in one line before any work."""

from __future__ import annotations

import copy

import pytest
import torch
from family_models import family_inputs, family_model
from tiny_models import state_of

import headkit
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.layers.cache import state_tensors
from headkit.layers.hybrid import HybridStateCacheLayer
from headkit.layers.quantized_cache import (
    QuantizedHybridStateCacheLayer,
    exact_leaves,
)
from headkit.ops.quantized_cache import dequantize_values
from headkit.surgery import (
    CompressedCacheConfig,
    LinearizeConfig,
    PruneConfig,
    QuantizedKVConfig,
    bytes_per_token,
    recorded_configs,
)
from headkit.surgery.linearize import linearized_modules

# Far smaller than the prompts below: keys are dropped (window 4, one sink, 3 chosen keys per head).
COMPRESSED = CompressedCacheConfig(window=4, sinks=1, budget=3, observation=2)
# Layer 0's key/value head 1 keeps its whole cache (a retrieval head), quantized too.
RETRIEVAL = CompressedCacheConfig(window=4, sinks=1, budget=3, observation=2, retrieval_heads=((0, 1),))
# Nothing dropped within 40 tokens: the compressed cache is the original model.
EVERYTHING = CompressedCacheConfig(window=64, sinks=0, budget=0, observation=2)
INT8 = QuantizedKVConfig(bits=8, group_size=8, residual=8)
INT4 = QuantizedKVConfig(bits=4, group_size=8, residual=8)
# The same, each compressed head's window kept in full precision.
INT8_WINDOW = QuantizedKVConfig(bits=8, group_size=8, full_precision_window=True)
INT4_WINDOW = QuantizedKVConfig(bits=4, group_size=8, full_precision_window=True)
# What quantization may cost these models' logits (random weights, logits about 1 in size), as for a stock cache.
BOUND = {8: 5e-3, 4: 5e-2}


def converted(model_type: str, *steps):
    original = family_model(model_type)
    model = copy.deepcopy(original)
    headkit.apply_(model, list(steps))
    return original, model


def stepwise_logits(model, tokens, prefill=12, chunk=1):
    """Logits of every position: a prefill of `prefill` tokens, then `chunk` tokens at a time through the cache."""
    with torch.no_grad():
        out = model(tokens[:, :prefill], use_cache=True)
        cache, logits = output_cache(out), [out.logits]
        for t in range(prefill, tokens.shape[1], chunk):
            out = model(tokens[:, t : t + chunk], **cache_keyword(cache), use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1), cache


def exact_fields(state):
    return {path: tensor for path, tensor in exact_leaves(state)}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("compressed", [COMPRESSED, RETRIEVAL], ids=["compressed", "retrieval-head"])
@pytest.mark.parametrize("full_window", [False, True], ids=["", "full-precision-window"])
def test_the_quantized_path_is_the_compressed_cache_on_the_dequantized_keys_and_values(
    bits, chunk, compressed, full_window
):
    """The naive twin: the unquantized compressed cache handed the dequantized state. Same logits at every step;
    after it, the states differ only in the new tokens (with a full-precision window: the tokens that left it),
    each within half its group's scale (the quantization's error), and every token stored before keeps its
    dequantized numbers exactly: quantized once. A full-precision window is the twin's, exactly."""
    original = family_model("llama")
    plain, model = copy.deepcopy(original), copy.deepcopy(original)
    headkit.apply_(plain, compressed)
    storage = QuantizedKVConfig(bits=bits, group_size=8, full_precision_window=full_window)
    headkit.apply_(model, [compressed, storage])
    tokens = family_inputs(length=30)
    with torch.no_grad():
        cache = output_cache(model(tokens[:, :12], use_cache=True))
        twin = output_cache(plain(tokens[:, :12], use_cache=True))
        for t in range(12, 30, chunk):
            for mine, theirs in zip(cache.layers, twin.layers, strict=True):
                assert (
                    isinstance(mine, QuantizedHybridStateCacheLayer) and type(theirs) is HybridStateCacheLayer
                )
                theirs.reset()
                theirs.set_state(mine.get_state(), mine.seen_tokens)
            new = tokens[:, t : t + chunk]
            ours = model(new, **cache_keyword(cache), use_cache=True).logits
            reference = plain(new, **cache_keyword(twin), use_cache=True).logits
            assert torch.equal(ours, reference), t
            for mine, theirs in zip(cache.layers, twin.layers, strict=True):
                stored = dict(mine.quantized_fields(mine.state))
                kept_whole = set(exact_fields(mine.state)) - set(stored)
                assert {path[-2:] for path in kept_whole} == (
                    {("window", "keys"), ("window", "values")} if full_window else set()
                )
                for path, values in exact_fields(mine.dequantized()).items():
                    exact = exact_fields(theirs.state)[path]
                    if path in kept_whole:
                        assert torch.equal(values, exact), (t, path)
                        continue
                    changed = (values != exact).any(-1)  # [B, H, slots]
                    # at most the new tokens are quantized: the window's newest slots (or those that left it)
                    assert int(changed.sum(-1).max()) <= new.shape[1], (t, path)
                    half_step = stored[path].scale.amax(-1, keepdim=True) / 2
                    assert ((values - exact).abs() <= half_step * (1 + 1e-5) + 1e-7).all(), (t, path)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2", "qwen3"])
def test_cached_decoding_is_the_uncached_forward_within_the_quantization_error(model_type):
    """Nothing dropped (a window longer than the text): the compressed cache is the original model, and the
    quantized one reads it within the quantization's error (gemma2's sliding layer is left alone by both). With keys dropped, the error the bits add to the compressed cache."""
    tokens = family_inputs(length=40)
    errors, added = {}, {}
    for config in (INT8, INT4):
        original, model = converted(model_type, EVERYTHING, config)
        with torch.no_grad():
            uncached = original(tokens, use_cache=False).logits
        cached, cache = stepwise_logits(model, tokens, chunk=2)
        errors[config.bits] = float((cached - uncached).abs().max())
        # gemma2's sliding layer 0 is left alone, its window unquantized (KIVI's cache would keep every token)
        left_alone = [0] if model_type == "gemma2" else []
        for index, layer in enumerate(cache.layers):
            assert isinstance(layer, QuantizedHybridStateCacheLayer) == (index not in left_alone)
        _, compressed = converted(model_type, COMPRESSED)
        _, both = converted(model_type, COMPRESSED, config)
        added[config.bits] = float(
            (stepwise_logits(both, tokens)[0] - stepwise_logits(compressed, tokens)[0]).abs().max()
        )
    assert 0 < errors[8] <= BOUND[8] and errors[4] <= BOUND[4], errors
    assert errors[4] > 4 * errors[8], errors  # the error is the quantization's
    assert 0 < added[8] <= BOUND[8] and added[4] <= BOUND[4], added


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_full_precision_window_reads_a_prompt_it_holds_as_the_compressed_cache_does(model_type):
    """A chat shorter than the window, through [CompressedCacheConfig, QuantizedKVConfig(4 bits,
    full_precision_window)]: the logits of the compressed cache alone, bit for bit, prompt and decoding steps —
    nothing it attends is quantized —, where the 4-bit composition without it drifts. Longer, the window's tokens
    are exact and the rest within the quantization's error."""
    tokens = family_inputs(length=40)
    _, alone = converted(model_type, EVERYTHING)
    _, whole_window = converted(model_type, EVERYTHING, INT4_WINDOW)
    _, quantized = converted(model_type, EVERYTHING, INT4)
    reference = stepwise_logits(alone, tokens)[0]
    mine, cache = stepwise_logits(whole_window, tokens)
    assert torch.equal(mine, reference)
    assert all(layer.quantized_bytes() == 0 for layer in cache.layers)  # the window holds every token
    assert float((stepwise_logits(quantized, tokens)[0] - reference).abs().max()) > 1e-3
    _, compressed = converted(model_type, COMPRESSED)
    _, dropped = converted(model_type, COMPRESSED, INT4_WINDOW)
    error = float((stepwise_logits(dropped, tokens)[0] - stepwise_logits(compressed, tokens)[0]).abs().max())
    assert 0 < error <= BOUND[4]


def test_a_full_precision_window_needs_a_compressed_cache_before_it_refused_in_one_line():
    model = family_model("llama")
    before = state_of(model)
    for steps in ([INT4_WINDOW], [PruneConfig(heads={0: [0]}), INT4_WINDOW]):
        with pytest.raises(
            HeadkitError, match="full_precision_window keeps a compressed cache's window"
        ) as refused:
            headkit.apply_(model, steps)
        assert "\n" not in str(refused.value)
    with pytest.raises(HeadkitError, match="full_precision_window must be True or False, got 1"):
        QuantizedKVConfig(bits=4, full_precision_window=1)
    assert not getattr(model.config, "headkit_surgery", None)
    assert all(torch.equal(before[k], v) for k, v in state_of(model).items())


def test_padded_rows_decode_as_each_alone_beam_search_runs_and_it_reloads_identically(tmp_path):
    """Each token is quantized alone (per token), so a left-padded row stores its real tokens as it does alone."""
    _, model = converted("llama", COMPRESSED, INT4)
    prompts = family_inputs(batch=2, length=9)
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        padded = prompts.clone()
        padded[0, :3] = 0
        mask = torch.ones_like(padded)
        mask[0, :3] = 0
        together = model.generate(padded, attention_mask=mask, **options)
        alone = model.generate(padded[:1, 3:], **options)
        assert torch.equal(together[0, 3:], alone[0])
        beams = model.generate(prompts, num_beams=3, **options)
        assert beams.shape == (2, 9 + 8)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert [type(c) for c in recorded_configs(reloaded)] == [CompressedCacheConfig, QuantizedKVConfig]
    storage = {"bits": 4, "group_size": 8, "full_precision_window": False}
    assert [m.quantized_storage for m in linearized_modules(reloaded)] == [storage, storage]
    tokens = family_inputs(length=30)
    assert torch.equal(stepwise_logits(reloaded, tokens)[0], stepwise_logits(model, tokens)[0])
    with torch.no_grad():
        assert torch.equal(reloaded.generate(tokens, **options), model.generate(tokens, **options))


def stored_bytes(model, context):
    """Bytes the cache stores after a prompt of `context` tokens: the compressed layers' quantized keys and values
    (codes, scales, zero points) and a window kept in full precision, a layer left alone its keys and values."""
    with torch.no_grad():
        cache = output_cache(model(torch.zeros(1, context, dtype=torch.long), use_cache=True))
    stored = 0
    for layer in cache.layers:
        if not isinstance(layer, QuantizedHybridStateCacheLayer):
            stored += layer.keys.numel() * layer.keys.element_size() * 2
            continue
        quantized = dict(layer.quantized_fields(layer.state))
        whole = [t for path, t in exact_leaves(layer.state) if path not in quantized]
        stored += layer.quantized_bytes() + sum(t.numel() * t.element_size() for t in whole)
    return stored


@pytest.mark.parametrize(
    "model_type, steps",
    [
        ("llama", [COMPRESSED, INT8]),
        ("llama", [COMPRESSED, INT4]),
        ("llama", [CompressedCacheConfig(window=4, sinks=1, budget=3, retrieval_heads=((0, 1),)), INT4]),
        ("llama", [PruneConfig(heads={0: [0, 1]}), COMPRESSED, INT4]),
        ("gemma2", [COMPRESSED, INT8]),  # its sliding layer left alone
        ("llama", [COMPRESSED, INT4_WINDOW]),
        ("llama", [RETRIEVAL, INT8_WINDOW]),  # the retrieval head, which has no window, all quantized
        ("gemma2", [COMPRESSED, INT4_WINDOW]),
    ],
    ids=[
        "int8",
        "int4",
        "retrieval-int4",
        "prune-int4",
        "gemma2-int8",
        "int4-window",
        "retrieval-int8-window",
        "gemma2-int4-window",
    ],  # fmt: skip
)
def test_bytes_per_token_from_the_configs_are_the_bytes_stored(model_type, steps):
    original = family_model(model_type)
    model = copy.deepcopy(original)
    headkit.apply_(model, steps)
    for context in (12, 40):  # float32: scales and zero points of 4 bytes
        measured = stored_bytes(model, context)
        assert bytes_per_token(original.config, steps, bytes_per_number=4, context=context) * context == (
            pytest.approx(measured)
        )
        assert bytes_per_token(model.config, bytes_per_number=4, context=context) * context == pytest.approx(
            measured
        )
    # llama, 40 tokens: 2 layers · 2 key/value heads · 7 slots (1 sink, 3 window, 3 kept) · per token
    # 2 · (16 codes + 2 · 2 · 2 bytes of scales and zero points) at 8 bits, bfloat16
    if model_type == "llama":
        assert bytes_per_token(original.config, [COMPRESSED, INT8], context=40) * 40 == 2 * 2 * 7 * 2 * (
            16 + 8
        )
        # the window's 3 slots in full precision: 2 · 16 numbers of 2 bytes
        assert bytes_per_token(original.config, [COMPRESSED, INT8_WINDOW], context=40) * 40 == 2 * 2 * (
            4 * 2 * (16 + 8) + 3 * 2 * 16 * 2
        )
    unquantized = bytes_per_token(original.config, steps[:-1])
    assert bytes_per_token(model.config) < unquantized


def test_orders_that_cannot_be_replayed_are_refused_in_one_line_before_any_work():
    model = family_model("llama")
    before = state_of(model)
    refusals = [
        ([INT8, COMPRESSED], "QuantizedKVConfig replaces the attention mechanism.*got CompressedCacheConfig"),
        (
            [COMPRESSED, INT8, INT4],
            "QuantizedKVConfig replaces the attention mechanism.*got QuantizedKVConfig",
        ),
        ([COMPRESSED, INT8, PruneConfig(heads={0: [0]})], "got PruneConfig after it"),
        (
            [COMPRESSED, PruneConfig(heads={0: [0]})],
            r"followed by QuantizedKVConfig alone\); got PruneConfig",
        ),
        ([COMPRESSED, QuantizedKVConfig(bits=4, group_size=32)], "group_size must divide head_dim 16"),
    ]
    for steps, message in refusals:
        with pytest.raises(HeadkitError, match=message) as refused:
            headkit.apply_(model, steps)
        assert "\n" not in str(refused.value)
    assert not getattr(model.config, "headkit_surgery", None)
    assert all(torch.equal(before[k], v) for k, v in state_of(model).items())
    headkit.apply_(model, [COMPRESSED, INT8])
    with pytest.raises(HeadkitError, match="already quantized"):
        headkit.apply_(model, INT4)
    with pytest.raises(HeadkitError, match="already quantized"):
        INT4.check(model.config)
    # after a linearization too (its exact sets stored quantized)
    linearized = family_model("llama")
    headkit.apply_(linearized, [LinearizeConfig(window=4, sinks=1, budget=2), INT8])
    storage = {"bits": 8, "group_size": 8, "full_precision_window": False}
    assert [m.quantized_storage for m in linearized_modules(linearized)] == [storage, storage]
    stepwise_logits(linearized, family_inputs(length=20))


@pytest.mark.parametrize(
    "steps",
    [
        [LinearizeConfig(window=4, sinks=1, budget=2), INT8],
        [LinearizeConfig(window=4, retrieval_heads=((1, 0),)), INT4],
        [LinearizeConfig(window=4, layers=(0,)), INT4],  # layer 1 keeps its cache, unquantized
        [LinearizeConfig(window=4, sinks=1, budget=2), INT8_WINDOW],
    ],
    ids=["int8", "retrieval-int4", "one-layer-int4", "int8-window"],
)
def test_a_quantized_linearized_states_bytes_per_token_are_the_bytes_stored(steps):
    """The exact keys and values as quantized codes, scales and zero points; the linear state and its
    normalizer as they are (float32 here); not the bookkeeping."""
    original = family_model("llama")
    model = copy.deepcopy(original)
    headkit.apply_(model, steps)
    for context in (12, 40):
        with torch.no_grad():
            cache = output_cache(model(torch.zeros(1, context, dtype=torch.long), use_cache=True))
        measured = 0
        for layer in cache.layers:
            if not isinstance(layer, QuantizedHybridStateCacheLayer):
                measured += 2 * layer.keys.numel() * layer.keys.element_size()
                continue
            full = layer.dequantized()
            exact = sum(t.numel() for _, t in layer.quantized_fields(full))
            rest = sum(t.numel() for t in state_tensors(full) if t.is_floating_point()) - exact
            measured += layer.quantized_bytes() + rest * 4
        for config, applied in ((original.config, steps), (model.config, [])):
            counted = bytes_per_token(config, applied, bytes_per_number=4, context=context)
            assert counted * context == pytest.approx(measured), (context, counted * context, measured)
    assert bytes_per_token(model.config) < bytes_per_token(original.config, steps[:-1])


def test_the_fast_decoder_decodes_a_quantized_compressed_cache_and_refuses_a_quantized_stock_cache():
    """The compressed cache stored in 8 bits (and in 4 with its window in full precision) decodes on the fast
    decoder as model.generate decodes it (the runtime tests compare the buffers); a stock model's KIVI cache
    (QuantizedKVConfig alone), which its static cache cannot hold, is refused in one line naming the model."""
    from headkit.runtime.fast import FastDecoder

    prompt = family_inputs(batch=1, length=9)
    for storage in (INT8, INT4_WINDOW):
        _, model = converted("llama", COMPRESSED, storage)
        with torch.no_grad():
            expected = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(FastDecoder(model, compile=False).generate(prompt, max_new_tokens=6), expected)
    _, stock = converted("llama", INT8)
    with pytest.raises(HeadkitError, match=r"model: .* keeps its key/value cache quantized \(QuantizedKVConfig\).*"
                       r"decode it with model\.generate") as refused:  # fmt: skip
        FastDecoder(stock, compile=False)
    assert "\n" not in str(refused.value)


def test_a_token_moved_from_the_window_to_the_kept_keys_keeps_its_codes():
    """Window → sink or kept key is a copy: the codes move with it, nothing is quantized twice."""
    _, model = converted("llama", COMPRESSED, INT4)
    tokens = family_inputs(batch=1, length=20)
    _, cache = stepwise_logits(model, tokens, prefill=6)
    layer = cache.layers[0]
    stored = exact_fields(layer.state)
    window = stored[("window", "keys")]
    rows = dequantize_values(window, bits=4, group_size=8)
    kept = dequantize_values(stored[("sparse_keys",)], bits=4, group_size=8)
    sinks = dequantize_values(stored[("sink_keys",)], bits=4, group_size=8)
    assert rows.shape[2] == 3 and kept.shape[2] == 3 and sinks.shape[2] == 1
    assert layer.state_bytes() < HybridStateCacheLayer.state_bytes(layer)  # counted as stored: quantized


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("compressed", [COMPRESSED, RETRIEVAL], ids=["compressed", "retrieval-head"])
@pytest.mark.parametrize("full_window", [False, True], ids=["", "full-precision-window"])
def test_a_decoding_step_stores_what_quantizing_the_whole_state_again_stores(
    monkeypatch, bits, compressed, full_window
):
    """The eager step stores only what it wrote (the new token, a key's codes moved with it): bit for bit what
    :meth:`QuantizedHybridStateCacheLayer._quantized` — every exact token matched to its stored codes or
    quantized anew — gives for the same step, at every step and layer, padded rows included."""
    storage = QuantizedKVConfig(bits=bits, group_size=8, full_precision_window=full_window)
    _, model = converted("llama", compressed, storage)
    tokens = family_inputs(batch=2, length=24)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # a left-padded row
    stepped, checked = QuantizedHybridStateCacheLayer.stepped, []

    def checking(layer, buffers):
        expected = layer._quantized(buffers)  # before the store: the stored codes are the step's table
        stepped(layer, buffers)
        got, want = state_tensors(layer.state), state_tensors(expected)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        checked.append(layer)

    monkeypatch.setattr(QuantizedHybridStateCacheLayer, "stepped", checking)
    with torch.no_grad():
        out = model(tokens[:, :10], attention_mask=mask[:, :10], use_cache=True)
        cache = output_cache(out)
        for t in range(10, 24):
            out = model(
                tokens[:, t : t + 1], attention_mask=mask[:, : t + 1], **cache_keyword(cache), use_cache=True
            )
    assert len(checked) == 14 * len(cache.layers)
