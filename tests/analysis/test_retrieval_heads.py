"""Retrieval-head scores through the attention interface against the mass read from the model's own eager
attention weights; the model is left as it was; top heads and bad examples."""

import pytest
import torch
import transformers

from headkit.analysis.retrieval import RetrievalExample, retrieval_head_scores, top_heads
from headkit.errors import HeadkitError


def tiny():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.normal_(std=0.3)
    return model.eval()


def examples():
    generator = torch.Generator().manual_seed(3)
    made = []
    for length, key_start, answer_start in ((30, 5, 25), (40, 20, 33)):
        ids = torch.randint(0, 97, (length,), generator=generator).tolist()
        made.append(RetrievalExample(tuple(ids), key_start, key_start + 4, answer_start))
    return made


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_scores_equal_the_mass_in_the_models_own_attention_weights(implementation):
    model = tiny()
    model.set_attn_implementation(implementation)
    tokens = torch.tensor([examples()[0].input_ids])
    before = model(tokens).logits
    scores = retrieval_head_scores(model, examples())
    assert model.config._attn_implementation == implementation
    torch.testing.assert_close(model(tokens).logits, before)
    reference = tiny()
    reference.set_attn_implementation("eager")
    expected = torch.zeros(3, 2)
    for example in examples():
        with torch.no_grad():
            out = reference(torch.tensor([example.input_ids]), output_attentions=True)
        for layer, weights in enumerate(out.attentions):  # [1, heads, T, T]
            rows = weights[0, :, example.answer_start - 1 : len(example.input_ids) - 1]
            mass = rows[..., example.key_start : example.key_end].sum(-1).mean(-1)  # [heads]
            expected[layer] += mass.view(2, 3).mean(-1) / len(examples())
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert (scores >= 0).all() and (scores <= 1).all()


def test_top_heads_are_the_largest_scores_in_layer_order():
    scores = torch.tensor([[0.1, 0.9], [0.5, 0.2], [0.8, 0.0]])
    assert top_heads(scores, 3) == [(0, 1), (1, 0), (2, 0)]
    assert top_heads(scores, 0) == []
    with pytest.raises(HeadkitError, match=r"retrieval head count must be in \[0, 6\]"):
        top_heads(scores, 7)


def test_an_example_without_an_answer_after_its_key_is_refused():
    model = tiny()
    bad = RetrievalExample(tuple(range(20)), 10, 14, 12)
    with pytest.raises(HeadkitError, match="key span"):
        retrieval_head_scores(model, [bad])
