"""headkit.linearize: softmax attention of LLaMA (GQA, RoPE) and GPT-2 → sliding-window + linear attention."""

import copy

import pytest
import torch
import transformers

import headkit
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.layers.hybrid import HybridStateCacheLayer
from headkit.surgery.io import SURGERY_KEY
from headkit.surgery.linearize import (
    LinearizedHeads,
    converted_attention_modules,
    decoding_state_bytes,
    linearized_modules,
    linearized_parameters,
    new_key_padding_mask,
)

ARCHITECTURES = ["llama", "gpt2"]


def tiny(architecture, layers=2, bias=False):
    torch.manual_seed(0)
    if architecture == "llama":
        config = transformers.LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            attention_bias=bias,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=layers, n_head=4, n_positions=256)
        model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # peaked attention, so that a wrong score shows
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight")):
                parameter.normal_(std=0.3)
            if bias and name.endswith("bias"):
                parameter.normal_(std=0.1)
    return model.eval()


def ids(batch=2, length=24, seed=1):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def state_snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_exact_when_the_window_covers_the_sequence(architecture, attn):
    model = tiny(architecture)
    model.config._attn_implementation = attn
    tokens = ids(length=24)
    reference = model(tokens).logits
    converted = copy.deepcopy(model)
    report = headkit.linearize(converted, window=24, chunk_size=8)
    assert report.layers == [0, 1] and report.softmax_layers == []
    assert len(linearized_modules(converted)) == 2
    torch.testing.assert_close(converted(tokens).logits, reference, atol=2e-5, rtol=1e-4)
    # Beyond the window the linear term (untrained) takes over: no longer the original.
    shorter = copy.deepcopy(model)
    headkit.linearize(shorter, window=4)
    assert (shorter(tokens).logits - reference).abs().max() > 1e-3


def test_exact_with_biases_and_left_padding():
    model = tiny("llama", bias=True)
    tokens = ids(length=16)
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0  # left padding, as batched generation has
    reference = model(tokens, attention_mask=mask).logits
    converted = copy.deepcopy(model)
    headkit.linearize(converted, window=16)
    got = converted(tokens, attention_mask=mask).logits
    torch.testing.assert_close(got[0, 5:], reference[0, 5:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], reference[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_stock_attention_module_stays_and_gains_only_the_mechanism(architecture):
    model = tiny(architecture, bias=True)
    adapter = headkit.surgery.get_adapter(model)
    modules = [site.module for site in adapter.sites(model)]
    before = state_snapshot(model)
    headkit.linearize(model, window=8)
    converted = converted_attention_modules(model)
    assert [converted[i] for i in range(2)] == modules  # the same objects, of the family's own class
    assert all(type(module).__module__.startswith("transformers.") for module in modules)
    after = model.state_dict()
    added = set(after) - set(before)
    assert added and all(".headkit_attention." in name for name in added)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
    assert all(isinstance(module.headkit_attention, LinearizedHeads) for module in modules)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_gradients_reach_the_feature_maps_and_balances(architecture):
    model = tiny(architecture)
    headkit.linearize(model, window=4)
    trainable = linearized_parameters(model)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in trainable:
        parameter.requires_grad_(True)
    model(ids(length=20)).logits.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    names = {name for name, p in model.named_parameters() if p.grad is not None}
    assert names and all(("feature_map" in name or "log_balance" in name) for name in names)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("layers", [None, [1]])
def test_cached_generation_equals_uncached(architecture, layers):
    model = tiny(architecture, layers=3)
    headkit.linearize(model, window=5, layers=layers, chunk_size=4)
    with torch.no_grad():  # the balances away from 1, so the linear term matters
        for module in linearized_modules(model):
            module.log_balance.normal_()
    prompt = ids(batch=1, length=9)
    cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    # Step by step the logits match the parallel form too.
    full = model(cached).logits
    out = model(cached[:, :9], use_cache=True)
    cache, steps = output_cache(out), [out.logits[:, -1]]
    for t in range(9, cached.shape[1] - 1):
        out = model(cached[:, t : t + 1], **cache_keyword(cache), use_cache=True)
        steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 8:-1], atol=1e-4, rtol=1e-4)
    kinds = [type(layer).__name__ for layer in cache.layers]
    expected = [
        "HybridStateCacheLayer" if layers is None or i in layers else "DynamicLayer" for i in range(3)
    ]
    assert kinds == expected


def test_batched_left_padded_generation_matches_each_prompt_alone():
    model = tiny("llama")
    headkit.linearize(model, window=4)
    with torch.no_grad():
        for module in linearized_modules(model):
            module.log_balance.fill_(-0.5)
    short, long = ids(batch=1, length=6, seed=2), ids(batch=1, length=10, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    together = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    alone = model.generate(short, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(together[0, 4:], alone[0])
    assert torch.equal(
        together[1], model.generate(long, max_new_tokens=6, do_sample=False, pad_token_id=0)[0]
    )


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_decoding_state_does_not_grow_with_the_context(architecture):
    model = tiny(architecture)
    original = copy.deepcopy(model)
    headkit.linearize(model, window=8)

    def state_bytes(network, context):
        with torch.no_grad():
            return decoding_state_bytes(output_cache(network(ids(batch=1, length=context), use_cache=True)))

    assert state_bytes(model, 16) == state_bytes(model, 64) == state_bytes(model, 200) > 0
    assert state_bytes(original, 64) == 4 * state_bytes(original, 16)
    cache = output_cache(model(ids(batch=1, length=30), use_cache=True))
    assert all(isinstance(layer, HybridStateCacheLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 30


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_save_and_reload_gives_identical_logits(architecture, tmp_path):
    model = tiny(architecture, layers=3)
    headkit.linearize(model, window=6, layers=[0, 2], feature_dim=4)
    with torch.no_grad():
        for parameter in linearized_parameters(model):
            parameter.add_(0.1 * torch.randn_like(parameter))
    entry = model.config.to_dict()[SURGERY_KEY][-1]
    assert entry["op"] == "linearize" and entry["layers"] == [0, 2] and entry["window"] == 6
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = ids(length=30)
    torch.testing.assert_close(reloaded(tokens).logits, model(tokens).logits, atol=0, rtol=0)
    assert [m.layer_idx for m in linearized_modules(reloaded)] == [0, 2]
    prompt = tokens[:1, :7]
    assert torch.equal(
        reloaded.generate(prompt, max_new_tokens=8, do_sample=False),
        model.generate(prompt, max_new_tokens=8, do_sample=False),
    )


def test_fixed_feature_map_and_conversion_in_two_steps():
    model = tiny("llama", layers=3)
    tokens = ids(length=12)
    headkit.linearize(model, window=12, feature_map="elu", layers=[0])
    report = headkit.linearize(model, window=12, layers=[2])
    assert report.softmax_layers == [1]
    assert [m.feature_map_name for m in linearized_modules(model)] == ["elu", "hedgehog"]
    torch.testing.assert_close(
        model(tokens).logits, tiny("llama", layers=3)(tokens).logits, atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"window": 0}, "window must be a positive integer"),
        ({"window": 257}, "at most the model's context of 256"),
        ({"window": 2.5}, "window must be a positive integer"),
        ({"feature_map": "nope"}, "unknown feature map 'nope'"),
        ({"layers": [2]}, r"layers must be indices in \[0, 2\)"),
        ({"layers": [-1]}, r"layers must be indices in \[0, 2\)"),
        ({"layers": []}, "at least one layer"),
        ({"layers": [1, 1]}, "twice"),
        ({"feature_dim": 0}, "feature_dim must be a positive integer"),
        ({"feature_map": "elu", "feature_dim": 4}, "learnable map"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_arguments_leave_the_model_untouched(arguments, message):
    model = tiny("llama")
    before = state_snapshot(model)
    with pytest.raises(HeadkitError, match=message):
        headkit.linearize(model, **arguments)
    after = state_snapshot(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not linearized_modules(model) and not getattr(model.config, SURGERY_KEY, None)


def test_unsupported_architectures_are_refused(save_tiny_encoder, tmp_path):
    encoder = transformers.AutoModel.from_pretrained(save_tiny_encoder(tmp_path / "bert"))
    with pytest.raises(HeadkitError, match="unsupported decoder family BertModel .* for linearize"):
        headkit.linearize(encoder)
    with pytest.raises(HeadkitError, match="converts causal self-attention; bert"):
        headkit.linearize(encoder, adapter="bert")
    with pytest.raises(HeadkitError, match="unsupported decoder family Linear"):
        headkit.linearize(torch.nn.Linear(2, 2))
    model = tiny("llama")
    headkit.linearize(model, layers=[0])
    with pytest.raises(HeadkitError, match="already linearized"):
        headkit.linearize(model, layers=[0, 1])
    assert [m.layer_idx for m in linearized_modules(model)] == [0]


def test_new_key_padding_mask_reads_every_mask_form_and_sliding_masks():
    keep = torch.tensor([[False, True, True, True], [True, True, True, True]])
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    # A window of 2: the last row no longer sees token 0, whose padding only the diagonal still tells.
    sliding = causal & ~torch.ones(4, 4, dtype=torch.bool).tril(-2)[None, None]
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    for mask in (keep.long(), causal, sliding, additive):
        assert torch.equal(new_key_padding_mask(mask, 2, 0, 4), keep)
    # Two new tokens after two in the cache: their rows of the full mask, their columns of the padding.
    assert torch.equal(new_key_padding_mask(causal[:, :, 2:], 2, 2, 2), keep[:, 2:])
    assert torch.equal(new_key_padding_mask(keep, 2, 2, 2), keep[:, 2:])
    assert new_key_padding_mask(None, 2, 0, 4) is None
    with pytest.raises(HeadkitError, match="padding mask"):
        new_key_padding_mask(keep, 2, 0, 5)


def test_attention_with_a_custom_forward_is_refused_before_any_work():
    # A module that computes attention itself would never run the mechanism: found by probing, not guessed.
    model = tiny("llama")
    module = model.model.layers[1].self_attn
    stock_forward = type(module).forward

    def custom_forward(self, hidden_states, *args, **kwargs):
        kwargs.pop("headkit_probe", None)  # drops the keywords it was given, as a custom forward would
        return stock_forward(
            self, hidden_states, *args, **{k: v for k, v in kwargs.items() if k != "headkit_probe"}
        )

    module.forward = custom_forward.__get__(module)
    before = state_snapshot(model)
    with pytest.raises(
        HeadkitError, match=r"model.layers.1.self_attn \(LlamaAttention\) do\(es\) not dispatch"
    ):
        headkit.linearize(model)
    assert state_snapshot(model).keys() == before.keys() and not linearized_modules(model)
    assert not getattr(model.config, SURGERY_KEY, None)


def test_sliding_window_layers_are_kept_and_an_all_sliding_model_is_refused():
    def mistral(sliding_window):
        config = transformers.MistralConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            sliding_window=sliding_window,
        )
        return transformers.MistralForCausalLM(config).eval()

    with pytest.raises(HeadkitError, match="every layer of this model attends through a sliding window"):
        headkit.linearize(mistral(16))
    model = mistral(None)
    assert headkit.linearize(model, window=8).layers == [0, 1]
    gemma = transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    ).eval()
    report = headkit.linearize(gemma, window=4)
    assert report.layers == [1] and report.sliding_layers == [0, 2]
    assert report.sliding_cache_bytes == 2 * (2 * 2 * 8 * 8 * 4)
    with pytest.raises(HeadkitError, match=r"layers \[0\] attend through a sliding window"):
        headkit.linearize(gemma, layers=[0])


def test_the_configs_names_of_feature_maps_and_selections_are_the_layers():
    # LinearizeConfig checks its feature map and selection against names declared in ops (no model code): those
    # must be what headkit.layers builds.
    from headkit.layers.feature_maps import LEARNABLE_FEATURE_MAPS
    from headkit.layers.kept_exact import SELECTIONS
    from headkit.ops.feature_maps import BUILTIN_LEARNABLE_FEATURE_MAPS
    from headkit.ops.key_selection import SELECTION_NAMES

    assert set(BUILTIN_LEARNABLE_FEATURE_MAPS) <= set(LEARNABLE_FEATURE_MAPS)
    assert set(SELECTION_NAMES) == set(SELECTIONS)
