"""share_unchanged_weights: a converted model's untouched weights held once with the original's — the values,
the tied weights and the changed tensors as they were — and a recipe's result the same with it."""

import copy

import torch
import transformers

from headkit.runs.models import share_unchanged_weights


def _tiny_llama(tied: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def test_the_unchanged_weights_become_the_originals_and_the_changed_stay_the_models_own():
    for tied in (False, True):
        original = _tiny_llama(tied)
        converted = copy.deepcopy(original)
        with torch.no_grad():
            converted.model.layers[0].self_attn.o_proj.weight.mul_(2)
            converted.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # one value differs: kept apart
        before = {name: p.clone() for name, p in converted.named_parameters()}
        ids = torch.tensor([[1, 2, 3, 4]])
        logits = converted(ids).logits
        freed = share_unchanged_weights(converted, original)
        ours, theirs = dict(converted.named_parameters()), dict(original.named_parameters())
        changed = {"model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"}
        for name, parameter in ours.items():
            assert torch.equal(parameter, before[name]), name
            assert (parameter.data_ptr() == theirs[name].data_ptr()) == (name not in changed), name
        expected = sum(p.numel() * p.element_size() for n, p in ours.items() if n not in changed)
        assert freed == expected
        if tied:  # still one tensor for the embedding and the output layer
            assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
        assert torch.equal(converted(ids).logits, logits)
        assert share_unchanged_weights(converted, original) == 0  # shared already


def test_a_shared_copy_holds_the_originals_tensors_until_unshared():
    from headkit.runs.models import shared_copy, unshare_weights

    for tied in (False, True):
        original = _tiny_llama(tied)
        copied = shared_copy(original)
        ours, theirs = dict(copied.named_parameters()), dict(original.named_parameters())
        assert ours.keys() == theirs.keys()
        for name, parameter in ours.items():
            assert parameter is not theirs[name] and parameter.data_ptr() == theirs[name].data_ptr(), name
        if tied:
            assert copied.lm_head.weight is copied.model.embed_tokens.weight
        copied.requires_grad_(False)  # the copy's own flags
        assert all(p.requires_grad for p in original.parameters())
        attention = list(copied.model.layers[0].self_attn.parameters())
        copied_bytes = unshare_weights(copied, original, attention)
        assert copied_bytes == sum(p.numel() * 4 for p in attention)
        with torch.no_grad():
            for parameter in attention:
                parameter.add_(1.0)  # written in place: the original's stays
        for name, parameter in original.named_parameters():
            assert (parameter.data_ptr() == ours[name].data_ptr()) == ("layers.0.self_attn" not in name), name
        assert torch.equal(
            original.model.layers[0].self_attn.q_proj.weight + 1,
            ours["model.layers.0.self_attn.q_proj.weight"],
        )
        unshare_weights(copied, original)
        assert not {p.data_ptr() for p in copied.parameters()} & {p.data_ptr() for p in original.parameters()}
        if tied:
            assert copied.lm_head.weight is copied.model.embed_tokens.weight


def test_releasing_the_originals_weights_keeps_what_the_result_holds():
    from headkit.runs.models import release_weights, shared_copy

    original = _tiny_llama(tied=True)
    result = shared_copy(original)
    result.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(
        original.model.layers[0].mlp.up_proj.weight * 2
    )
    ids = torch.tensor([[1, 2, 3, 4]])
    logits = result(ids).logits
    own = original.model.layers[0].mlp.up_proj.weight.numel() * 4
    assert release_weights(original, result) == own  # only the tensor the result does not hold
    assert original.model.layers[0].mlp.up_proj.weight.numel() == 0
    assert torch.equal(result(ids).logits, logits)
