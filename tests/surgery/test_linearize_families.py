"""headkit.linearize on every decoder family the registry marks linearizable, each a tiny random checkpoint of
the family's real config class: exact while the window covers the sequence, cached == uncached, padded == alone,
reload, and a decoding state that does not grow with the context."""

import pytest
import torch
from family_models import family_inputs, family_model

import headkit
from headkit.compat import output_cache
from headkit.errors import HeadkitError
from headkit.surgery.families import FAMILIES, LINEARIZE
from headkit.surgery.linearize import decoding_state_bytes, linearized_modules, sliding_layers

LINEARIZABLE = sorted(name for name, family in FAMILIES.items() if LINEARIZE in family.operations)


def converted(model_type, window):
    model = family_model(model_type)
    # feature_wavelength 8: the slow rotary pairs reach the feature maps rotated back by the module's own tables.
    report = headkit.linearize(model, window=window, chunk_size=4, feature_wavelength=8)
    with torch.no_grad():  # the balances away from 1, so that the linear term matters
        generator = torch.Generator().manual_seed(3)
        for mechanism in linearized_modules(model):
            mechanism.log_balance.copy_(torch.randn(mechanism.log_balance.shape, generator=generator))
    return model, report


def test_the_matrix_covers_the_required_families():
    required = {"llama", "mistral", "qwen2", "qwen3", "granite", "smollm3", "gemma2", "gemma3_text", "olmo2"}
    assert required | {"phi3", "gpt_neox", "starcoder2", "gpt2"} <= set(LINEARIZABLE)


@pytest.mark.parametrize("model_type", LINEARIZABLE)
def test_exact_while_the_window_covers_the_sequence(model_type):
    model = family_model(model_type)
    tokens = family_inputs(length=12)
    with torch.no_grad():
        reference = model(tokens).logits
        report = headkit.linearize(model, window=32, chunk_size=4)
        got = model(tokens).logits
    assert report.layers and not set(report.layers) & set(report.sliding_layers)
    if getattr(model.config, "attn_logit_softcapping", None):  # the window term does not soft-cap
        assert any("soft-cap" in note for note in report.notes)
        # Not exact, so bounded — against the logits' own scale: a tiny model's logits are small (Gemma 2's:
        # std ~0.18, max |.| ~0.66), so a fixed bound like 0.5 would pass a model whose logits are unrelated.
        # The cap tanh(s/c)·c bends these small scores s by ~s³/(3c²): measured, the error is ~1e-5 of the
        # logits' std, while a model seeded differently differs by ~4 stds and this one converted with a window
        # shorter than the sequence (window 4) by ~2.5. 1% of the std lies far from both.
        error = float((got - reference).abs().max())
        assert error < 0.01 * float(reference.std()), (error, float(reference.std()))
    else:
        torch.testing.assert_close(got, reference, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", LINEARIZABLE)
def test_cached_decoding_equals_uncached_and_padded_rows_equal_each_alone(model_type):
    model, _ = converted(model_type, window=3)
    prompts = family_inputs(batch=2, length=7)
    assert_cached_and_padded_decoding_agree(model, prompts, padding=3)


def assert_cached_and_padded_decoding_agree(model, prompts, padding):
    """Greedy generate: cached == uncached, and row 0 left-padded by `padding` tokens (its positions from the
    mask) decodes as it does alone."""
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        cached = model.generate(prompts, use_cache=True, **options)
        assert torch.equal(cached, model.generate(prompts, use_cache=False, **options))
        padded = prompts.clone()
        padded[0, :padding] = 0
        mask = torch.ones_like(padded)
        mask[0, :padding] = 0
        together = model.generate(padded, attention_mask=mask, **options)
        alone = model.generate(padded[:1, padding:], **options)
    assert torch.equal(together[0, padding:], alone[0])


@pytest.mark.parametrize("model_type", LINEARIZABLE)
def test_reload_gives_identical_logits_and_the_state_does_not_grow(model_type, tmp_path):
    model, report = converted(model_type, window=3)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = family_inputs(length=10)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
        sizes = [
            decoding_state_bytes(output_cache(model(family_inputs(batch=1, length=n), use_cache=True)))
            for n in (12, 40)
        ]
    assert [m.layer_idx for m in linearized_modules(reloaded)] == report.layers
    assert sizes[0] == sizes[1] > 0


SLIDING = [("gemma2", {}), ("gemma3_text", {}), ("mistral", {"sliding_window": 4})]


@pytest.mark.parametrize(("model_type", "options"), SLIDING, ids=[name for name, _ in SLIDING])
def test_sliding_layers_convert_on_request_and_decode_like_the_rest(model_type, options, tmp_path):
    model = family_model(model_type, **options)
    sliding = sliding_layers(model.config, model.config.num_hidden_layers)
    assert sliding  # a 4-token window: shorter than the prompts below, so padding falls outside it
    report = headkit.linearize(model, window=3, chunk_size=4, convert_sliding=True)
    assert report.layers == list(range(model.config.num_hidden_layers))
    assert report.converted_sliding_layers == sliding and report.sliding_layers == []
    assert "converted too" in str(report)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for mechanism in linearized_modules(model):
            mechanism.log_balance.copy_(torch.randn(mechanism.log_balance.shape, generator=generator))
    # Row 0 left-padded by 5, more than the 4-token sliding window: the padding is read from the diagonal.
    assert_cached_and_padded_decoding_agree(model, family_inputs(batch=2, length=9), padding=5)
    with torch.no_grad():
        sizes = [
            decoding_state_bytes(output_cache(model(family_inputs(batch=1, length=n), use_cache=True)))
            for n in (12, 40)
        ]
    assert sizes[0] == sizes[1] > 0  # no key/value layer left: nothing grows
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = family_inputs(length=10)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


def test_an_all_sliding_model_is_refused_with_the_option_named_and_a_partial_sliding_list_too():
    model = family_model("mistral", sliding_window=4)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(HeadkitError, match="convert_sliding=True"):
        headkit.linearize(model, window=3)
    gemma = family_model("gemma3_text")
    sliding = sliding_layers(gemma.config, gemma.config.num_hidden_layers)
    with pytest.raises(HeadkitError, match="convert_sliding"):
        headkit.linearize(gemma, window=3, layers=sliding)
    with pytest.raises(HeadkitError, match="every sliding-window layer"):
        headkit.linearize(gemma, window=3, layers=[0], convert_sliding=True) if 0 not in sliding else (
            headkit.linearize(gemma, window=3, layers=[1], convert_sliding=True)
        )
    with pytest.raises(HeadkitError, match="convert_sliding must be a bool"):
        headkit.linearize(gemma, window=3, convert_sliding="yes")
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    assert not linearized_modules(model) and not linearized_modules(gemma)


def test_a_mixed_cache_of_sliding_full_and_linearized_layers_beam_searches_as_without_a_cache():
    # Gemma 3: a sliding layer, a full one kept, a full one linearized — three kinds of entries in one Cache.
    model = family_model(
        "gemma3_text",
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
    )
    headkit.linearize(model, window=3, chunk_size=4, layers=[2])
    with torch.no_grad():
        for mechanism in linearized_modules(model):
            mechanism.log_balance.copy_(
                torch.randn(mechanism.log_balance.shape, generator=torch.Generator().manual_seed(3))
            )
        prompts = family_inputs(batch=2, length=9)
        cache = output_cache(model(prompts, use_cache=True))
        kinds = [type(layer).__name__ for layer in cache.layers]
        assert kinds[0] != kinds[1] != kinds[2] and kinds[2] == "HybridStateCacheLayer", kinds
        options = {"max_new_tokens": 5, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
        # Beam search reorders every cache entry by beam at each step; without a cache nothing is reordered.
        with_cache = model.generate(prompts, use_cache=True, **options)
        without = model.generate(prompts, use_cache=False, **options)
    assert torch.equal(with_cache, without)
