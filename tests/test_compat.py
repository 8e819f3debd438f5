"""headkit.compat: the cache keyword of the installed transformers, and the private access fenced there, on
whichever release the suite runs (make test runs it on both ends of the declared range)."""

import inspect

import torch
from transformers import GenerationMixin, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from headkit.compat import (
    CACHE_ARGUMENT,
    CACHE_OUTPUT_FIELD,
    cache_keyword,
    cache_output,
    checkpoint_key_renamer,
    output_cache,
    pop_cache_argument,
)


def test_the_cache_names_are_the_installed_releases_own():
    assert CACHE_ARGUMENT in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    assert CACHE_ARGUMENT in inspect.signature(LlamaForCausalLM.forward).parameters
    assert CACHE_OUTPUT_FIELD in CausalLMOutputWithPast.__dataclass_fields__


def test_a_stock_model_decodes_through_the_compat_helpers():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        full = model(ids).logits
        cache = output_cache(model(ids[:, :5], use_cache=True))
        assert cache is not None and cache.get_seq_length() == 5
        step = model(ids[:, 5:], **cache_keyword(cache), use_cache=True)
    torch.testing.assert_close(step.logits, full[:, 5:], atol=1e-5, rtol=0)
    assert output_cache(CausalLMOutputWithPast(**cache_output(cache))) is cache


def test_pop_cache_argument_takes_either_name():
    for name in ("cache", "past_key_values"):
        arguments = {name: 1, "other": 2}
        assert pop_cache_argument(arguments) == 1 and arguments == {"other": 2}
    assert pop_cache_argument({}) is None


def test_the_checkpoint_key_renamer_maps_saved_names_back_to_the_models_own(tmp_path):
    from safetensors.torch import load_file

    model = ViTModel(
        ViTConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=8,
            patch_size=4,
        )
    )
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    expected = model.state_dict()
    rename = checkpoint_key_renamer(model)
    if rename is None:  # a release without conversion rules saves the model's own names
        assert saved.keys() == expected.keys()
        return
    renamed = {rename(key, expected) for key in saved}
    assert {name for name, _ in renamed} == set(expected)
    assert not any(needs_conversion for _, needs_conversion in renamed)
