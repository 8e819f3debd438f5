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
