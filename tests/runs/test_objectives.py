import math

import pytest
import torch
import torch.nn.functional as F

from headkit.errors import HeadkitError
from headkit.runs.objectives import embedding_distillation_loss, in_batch_contrastive_loss, next_token_kl


def test_next_token_kl_matches_a_hand_computed_value():
    teacher = torch.tensor([[[2.0, 0.0, -1.0]]])
    student = torch.tensor([[[0.5, 0.5, 0.0]]])
    for temperature in (1.0, 2.0):
        p = [math.exp(x / temperature) for x in (2.0, 0.0, -1.0)]
        q = [math.exp(x / temperature) for x in (0.5, 0.5, 0.0)]
        p = [x / sum(p) for x in p]
        q = [x / sum(q) for x in q]
        expected = temperature**2 * sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
        got = next_token_kl(student, teacher, temperature=temperature)
        assert got.item() == pytest.approx(expected, rel=1e-5)


def test_next_token_kl_is_zero_for_the_teacher_and_ignores_padding():
    teacher = torch.randn(2, 5, 11)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert next_token_kl(teacher, teacher, mask).item() == pytest.approx(0.0, abs=1e-6)
    student = teacher.clone()
    student[1, 4] += torch.randn(11) * 10  # a padded position
    assert next_token_kl(student, teacher, mask).item() == pytest.approx(0.0, abs=1e-6)
    student[0, 0] += torch.randn(11)
    one = next_token_kl(student[:, :1], teacher[:, :1], mask[:, :1])  # the mean over the 2 real first tokens
    assert next_token_kl(student, teacher, mask).item() == pytest.approx(one.item() * 2 / 8, rel=1e-5)
    with pytest.raises(HeadkitError, match="temperature"):
        next_token_kl(student, teacher, temperature=0.0)


def test_embedding_distillation_loss_is_zero_only_for_the_teacher():
    states = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert embedding_distillation_loss(states, states, mask).item() == pytest.approx(0.0, abs=1e-6)
    noisy = states.clone()
    noisy[1, 4] += 100.0  # a padded position: ignored
    assert embedding_distillation_loss(noisy, states, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert embedding_distillation_loss(states + 0.1 * torch.randn_like(states), states, mask).item() > 1e-4


def test_contrastive_loss_is_cross_entropy_over_scaled_cosines():
    torch.manual_seed(1)
    anchors, positives = torch.randn(5, 7), torch.randn(5, 7)
    loss = in_batch_contrastive_loss(anchors, positives)
    normed_a, normed_p = F.normalize(anchors, dim=-1), F.normalize(positives, dim=-1)
    logits = 20.0 * normed_a @ normed_p.T
    reference = -torch.log_softmax(logits, dim=-1).diagonal().mean()
    assert torch.allclose(loss, reference, atol=1e-5)
    # Matching pairs score far better than mismatched ones.
    assert in_batch_contrastive_loss(anchors, anchors) < loss


# The causal-LM objective computed from the heads' inputs in chunks equals the one on whole logits.


def _causal_pair(kind: str, seed: int = 0):
    import copy

    import transformers

    torch.manual_seed(seed)
    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=4)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(vocab_size=64, num_key_value_heads=2, tie_word_embeddings=False, **shape)
        )
    elif kind == "tied":  # SmolLM2's case: the head's weight is the input embeddings'
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(vocab_size=64, num_key_value_heads=2, tie_word_embeddings=True, **shape)
        )
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    elif kind == "gemma2":  # soft-capped logits; a small cap so that it bends them
        model = transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(
                vocab_size=64, num_key_value_heads=2, final_logit_softcapping=0.5, sliding_window=4, **shape
            )
        )
    elif kind == "gpt2":  # a head with LayerNorm before it, tied
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=4)
        )
    model = model.float().eval()
    student = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.requires_grad_(False), student


def _causal_batch(masked: bool):
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    if masked:
        mask[1, 5:] = 0
        mask[2, 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _loss_and_gradients(loss_fn, student, teacher, batch):
    student.zero_grad(set_to_none=True)
    loss = loss_fn(student, teacher, batch)
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
    return loss.detach(), gradients


@pytest.mark.parametrize("kind", ["llama", "tied", "gemma2", "gpt2"])
@pytest.mark.parametrize("temperature, hidden_weight, masked", [(1.0, 0.0, False), (2.0, 0.5, True)])
def test_chunked_causal_lm_objective_equals_the_whole_logits_one(
    kind, temperature, hidden_weight, masked, monkeypatch
):
    from headkit.runs import objectives
    from headkit.runs.objectives import CausalLMObjective, logit_head

    calls = []
    chunked = objectives.chunked_kl_divergence
    monkeypatch.setattr(
        objectives, "chunked_kl_divergence", lambda *a, **k: calls.append(1) or chunked(*a, **k)
    )
    teacher, student = _causal_pair(kind)
    student.requires_grad_(True)
    found = logit_head(student)
    assert found is not None and found.last_hidden
    assert (found.softcap is not None) == (kind == "gemma2")
    objective = CausalLMObjective(temperature, hidden_weight)
    batch = _causal_batch(masked)
    got, gradients = _loss_and_gradients(objective, student, teacher, batch)
    assert calls == [1]  # the chunked loss, not the fallback
    expected, expected_gradients = _loss_and_gradients(objective.logits_loss, student, teacher, batch)
    assert float(expected) > 1e-4  # the student differs from the teacher: a loss that says something
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert gradients.keys() == expected_gradients.keys()
    assert any(
        "embed" in name or "wte" in name for name in gradients
    )  # the head's (tied or not) weight trains
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected_gradients[name], rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_objective_with_a_frozen_head_trains_the_rest():
    """LoRA's case: the head does not train; the gradient still reaches the body through the head's input."""
    from headkit.runs.objectives import CausalLMObjective

    teacher, student = _causal_pair("llama")
    student.requires_grad_(True)
    student.get_output_embeddings().requires_grad_(False)
    objective, batch = CausalLMObjective(1.5), _causal_batch(True)
    got, gradients = _loss_and_gradients(objective, student, teacher, batch)
    expected, expected_gradients = _loss_and_gradients(objective.logits_loss, student, teacher, batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert "lm_head.weight" not in gradients and gradients.keys() == expected_gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected_gradients[name], rtol=1e-4, atol=1e-6, msg=name)


def test_an_unrecognised_head_falls_back_to_whole_logits():
    from headkit.runs.objectives import CausalLMObjective, logit_head

    teacher, student = _causal_pair("llama")
    original = student.forward

    def scaled(*args, **kwargs):  # logits that are not the head of its input: the check must refuse them
        output = original(*args, **kwargs)
        output.logits = output.logits * 2
        return output

    student.forward = scaled
    assert logit_head(student) is None
    objective, batch = CausalLMObjective(), _causal_batch(False)
    expected = objective.logits_loss(student, teacher, batch)
    torch.testing.assert_close(objective(student, teacher, batch), expected)


def test_the_objective_stops_the_student_at_its_head_and_runs_inside_objective_forward():
    from headkit.runs.objectives import CausalLMObjective

    assert CausalLMObjective().calls_student_forward is False
    assert CausalLMObjective(2.0) == CausalLMObjective(2.0)  # the head cache is not part of its identity


def test_the_head_check_runs_in_eval_mode_and_restores_each_module_mode():
    from headkit.runs.objectives import logit_head

    _, student = _causal_pair("llama")
    student.train()
    student.model.layers[0].eval()  # a mixed state, kept as it was
    student.config.attention_dropout = 0.5  # dropout would make two forwards disagree in training mode
    for layer in student.model.layers:
        layer.self_attn.attention_dropout = 0.5
    state = torch.get_rng_state()
    assert logit_head(student) is not None
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn: the training order is unchanged
    assert student.training and student.model.layers[1].training and not student.model.layers[0].training


def test_the_objective_pickles_without_its_memo_of_checked_heads():
    import pickle

    from headkit.runs.objectives import CausalLMObjective

    objective = CausalLMObjective(temperature=2.0)
    objective._heads[torch.nn.Linear(2, 2)] = True
    copy = pickle.loads(pickle.dumps(objective))
    assert copy.temperature == 2.0 and len(copy._heads) == 0
