"""Quantized key/value caches on stock decoders (KIVI through headkit.apply_): no forward changes without a cache
and none with a residual longer than the text; cached decoding is the uncached forward within the quantization's
error; a left-padded row decodes as it does alone; beam search; reload; the bytes per token the config states are
the measured cache growth; refusals in one line, before any work. Every decoder family is run."""

from __future__ import annotations

import copy

import pytest
import torch
from family_models import family_config, family_inputs, family_model
from tiny_models import state_of

import headkit
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.evaluation.memory import cache_bytes, kv_cache_bytes_per_token
from headkit.layers.quantized_cache import QuantizedKVCacheLayer
from headkit.surgery import LatentKVConfig, PruneConfig, QuantizedKVConfig, bytes_per_token, recorded_configs
from headkit.surgery.families import LINEARIZE, supported_families
from headkit.surgery.quantized_cache import QuantizedKVHeads, QuantizedKVReport, quantized_mechanisms

FAMILIES = supported_families(LINEARIZE)  # the decoders whose modules call the attention interface
# The tiny models' head_dim is 16: groups of 8 tokens (keys) and 8 channels (values), the 8 newest tokens kept.
INT8 = QuantizedKVConfig(bits=8, group_size=8, residual=8)
INT4 = QuantizedKVConfig(bits=4, group_size=8, residual=8)
# What quantization may cost these models' logits (random weights; their logits are at most about 1 in size):
# 4 bits more is a 16 times finer step, and the error shrinks with it.
BOUND = {8: 5e-3, 4: 5e-2}


def quantized(model_type: str, config: QuantizedKVConfig = INT8, **options):
    original = family_model(model_type, **options)
    model = copy.deepcopy(original)
    report = headkit.apply_(model, config)
    return original, model, report


def stepwise_logits(model, tokens, prefill=4):
    """Logits of every position: a prefill of `prefill` tokens, then one token at a time through the cache."""
    with torch.no_grad():
        out = model(tokens[:, :prefill], use_cache=True)
        cache, logits = output_cache(out), [out.logits]
        for t in range(prefill, tokens.shape[1]):
            out = model(tokens[:, t : t + 1], **cache_keyword(cache), use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1), cache


def test_the_mechanism_changes_no_forward_without_a_cache_and_none_with_a_residual_longer_than_the_text():
    original, model, report = quantized("llama", QuantizedKVConfig(bits=4, group_size=8, residual=64))
    assert isinstance(report, QuantizedKVReport) and report.layers == [0, 1]
    assert [m.layer_idx for m in quantized_mechanisms(model)] == [0, 1]
    assert isinstance(model.model.layers[0].self_attn.headkit_attention, QuantizedKVHeads)
    tokens = family_inputs(length=40)
    with torch.no_grad():
        assert torch.equal(model(tokens, use_cache=False).logits, original(tokens, use_cache=False).logits)
    mine, cache = stepwise_logits(model, tokens)
    theirs, _ = stepwise_logits(original, tokens)
    assert torch.equal(mine, theirs)  # nothing quantized: the stock cache's keys and values, exactly
    assert all(
        isinstance(layer, QuantizedKVCacheLayer) and layer.quantized_tokens == 0 for layer in cache.layers
    )
    assert "quantized to 4 bits" in str(report)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cached_decoding_is_the_uncached_forward_within_the_quantization_error(model_type):
    tokens = family_inputs(length=40)
    errors = {}
    for config in (INT8, INT4):
        original, model, _ = quantized(model_type, config)
        with torch.no_grad():
            uncached = original(tokens, use_cache=False).logits
        cached, cache = stepwise_logits(model, tokens)
        errors[config.bits] = float((cached - uncached).abs().max())
        assert cache.layers[-1].quantized_tokens == 32  # 40 tokens: 4 groups of 8 quantized, 8 kept
    assert 0 < errors[8] <= BOUND[8] and errors[4] <= BOUND[4], errors
    assert errors[4] > 4 * errors[8], errors  # the error is the quantization's


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2"])
def test_a_left_padded_row_decodes_as_it_does_alone(model_type):
    """Padded by a whole group (8 tokens), the row's real tokens are grouped — and quantized — as they are alone:
    the same scores up to float rounding. Padded by 3, the groups differ: within the quantization's error."""
    _, model, _ = quantized(model_type, QuantizedKVConfig(bits=4, group_size=8, residual=0))
    prompts = family_inputs(batch=2, length=20)
    options = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    options |= {"output_scores": True, "return_dict_in_generate": True}
    for padding, tolerance in [(8, 1e-5), (3, BOUND[4])]:
        padded = prompts.clone()
        padded[0, :padding] = 0
        mask = torch.ones_like(padded)
        mask[0, :padding] = 0
        with torch.no_grad():
            together = model.generate(padded, attention_mask=mask, **options)
            alone = model.generate(padded[:1, padding:], **options)
        mine, theirs = together.sequences[0, 20:], alone.sequences[0, 20 - padding :]  # the new tokens
        if padding == 8:
            assert torch.equal(mine, theirs)
        # the scores of the steps whose prefixes agree (greedy paths may part after a near tie)
        agree = int((mine != theirs).int().cumsum(0).eq(0).sum()) + 1
        difference = (torch.stack(together.scores)[:agree, 0] - torch.stack(alone.scores)[:agree, 0]).abs()
        assert difference.max() <= tolerance, (padding, float(difference.max()))


def test_beam_search_reorders_the_quantized_cache():
    original, model, _ = quantized("llama", QuantizedKVConfig(bits=8, group_size=4, residual=0))
    long_residual = copy.deepcopy(original)
    headkit.apply_(long_residual, QuantizedKVConfig(bits=8, group_size=4, residual=64))
    prompts = family_inputs(batch=2, length=9)
    options = {"max_new_tokens": 8, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        stock = original.generate(prompts, **options)
        assert torch.equal(long_residual.generate(prompts, **options), stock)
        beams = model.generate(prompts, **options)
    assert beams.shape == stock.shape


def test_save_and_reload_give_identical_logits_and_caches(tmp_path):
    _, model, _ = quantized("llama", INT4)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert [c.record() for c in recorded_configs(reloaded)] == [INT4.record()]
    assert [m.extra_repr() for m in quantized_mechanisms(reloaded)] == [
        m.extra_repr() for m in quantized_mechanisms(model)
    ]
    tokens = family_inputs(length=30)
    assert torch.equal(stepwise_logits(reloaded, tokens)[0], stepwise_logits(model, tokens)[0])
    options = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(reloaded.generate(tokens, **options), model.generate(tokens, **options))


@pytest.mark.parametrize(
    "steps",
    [
        [INT8],
        [INT4],
        [QuantizedKVConfig(bits=4, group_size=16, residual=0)],
        [PruneConfig(heads={0: [0, 1]}), INT4],  # one key/value group of layer 0 gone
        [PruneConfig(heads={0: [0]}), INT8],  # uneven: the cache keeps both key/value heads of layer 0
        [PruneConfig(heads={1: [0, 1, 2, 3]}, allow_empty_layers=True), INT4],  # layer 1 keeps no cache
    ],
    ids=["int8", "int4", "int4-g16-r0", "prune-int4", "uneven-int8", "empty-layer-int4"],
)
def test_bytes_per_token_from_the_configs_is_the_measured_cache(steps):
    original = family_model("llama")
    model = copy.deepcopy(original)
    headkit.apply_(model, steps)
    # float32: the scales, zero points and residual are 4 bytes; 5 tokens are all residual, 100 mostly codes
    for context in (5, 64, 100):
        measured = cache_bytes(model, context)
        assert bytes_per_token(original.config, steps, bytes_per_number=4, context=context) * context == (
            pytest.approx(measured)
        )
        assert bytes_per_token(model.config, bytes_per_number=4, context=context) * context == pytest.approx(
            measured
        )
    assert bytes_per_token(model.config, context=100) * 100 == pytest.approx(
        cache_bytes(copy.deepcopy(model).to(torch.bfloat16), 100)
    )
    unquantized = bytes_per_token(original.config, steps[:-1])
    assert bytes_per_token(model.config) < unquantized
    # the growth per token once the residual is full: the codes and their scales alone
    assert bytes_per_token(original.config, steps, bytes_per_number=4, context=10**6) == pytest.approx(
        kv_cache_bytes_per_token(model), rel=1e-4
    )
    # llama, bfloat16, 104 tokens (96 quantized, 8 residual): 2 layers · 2 key/value heads · per token
    # (96 · (2·16 codes + 2·16·2/8 key scales + 2·2·2 value scales) + 8 · 2·16·2 residual) / 104
    assert bytes_per_token(original.config, INT8, context=104) * 104 == 2 * 2 * (96 * 48 + 8 * 64)


def test_bad_settings_are_refused_in_one_line_naming_the_field_before_any_work():
    with pytest.raises(HeadkitError, match=r"bits must be one of \{4, 8\}, got 3") as refused:
        QuantizedKVConfig(bits=3)
    assert "\n" not in str(refused.value)
    for fields, message in [
        ({"bits": True}, "bits must be one of"),
        ({"bits": 8, "group_size": 0}, "group_size must be a positive integer"),
        ({"bits": 8, "residual": -1}, "residual must be a non-negative integer"),
    ]:
        with pytest.raises(HeadkitError, match=message):
            QuantizedKVConfig(**fields)
    config = family_config("llama")  # head_dim 16
    assert INT8.check(config) is None
    with pytest.raises(HeadkitError, match="group_size must divide head_dim 16 .* got 32"):
        QuantizedKVConfig(bits=8).check(config)
    with pytest.raises(HeadkitError, match="headkit family's attention modules"):
        INT8.check(family_config("headkit"))
    model = family_model("llama")
    before = state_of(model)
    with pytest.raises(HeadkitError, match="group_size must divide head_dim 16"):
        headkit.apply_(model, QuantizedKVConfig(bits=4, group_size=32))
    with pytest.raises(HeadkitError, match="LatentKVConfig replaces the attention mechanism"):
        headkit.apply_(model, [LatentKVConfig(kv_rank=12, rope_dims=4), INT8])
    with pytest.raises(HeadkitError, match="QuantizedKVConfig replaces the attention mechanism"):
        headkit.apply_(model, [INT8, INT4])
    assert not getattr(model.config, "headkit_surgery", None)
    assert state_of(model).keys() == before.keys() and not quantized_mechanisms(model)


def test_surgery_that_replaces_the_attention_refuses_a_quantized_cache_and_the_other_way_round():
    _, model, _ = quantized("llama")
    with pytest.raises(HeadkitError, match="already quantized"):
        headkit.apply_(model, INT4)
    with pytest.raises(HeadkitError, match="already runs QuantizedKVHeads"):
        headkit.apply_(model, LatentKVConfig(kv_rank=12, rope_dims=4))
    latent = family_model("llama")
    headkit.apply_(latent, LatentKVConfig(kv_rank=12, rope_dims=4))
    with pytest.raises(HeadkitError, match="replaced by LatentKVConfig"):
        INT8.check(latent.config)
    with pytest.raises(HeadkitError, match="replaced by LatentKVConfig"):
        headkit.apply_(latent, INT8)
