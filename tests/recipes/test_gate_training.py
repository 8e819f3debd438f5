"""Head gates trained to a head budget (headkit.recipes.gates) on the one training loop: the budget is reached,
the heads that matter are found, bad settings are refused."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery"))
from tiny_models import tiny_inputs, tiny_model  # noqa: E402

import headkit  # noqa: E402
from headkit.errors import HeadkitError  # noqa: E402
from headkit.recipes.gates import train_gates_to_budget  # noqa: E402
from headkit.surgery.adapters import get_adapter  # noqa: E402
from headkit.surgery.gating import add_head_gates, head_gates, remove_head_gates  # noqa: E402


def test_training_reaches_the_head_budget_and_finds_the_heads_that_matter():
    """The teacher is the model with only heads {0: [0, 1], 1: [2]} open; distilling into a gated student under a
    budget of 3 heads must open exactly those (the attention is scaled up so that heads matter)."""
    base = tiny_model("bert")
    with torch.no_grad():
        for site in get_adapter(base).sites(base):
            site.output_projection.weight.mul_(30.0)
    teacher, student = copy.deepcopy(base), copy.deepcopy(base)
    add_head_gates(teacher, "fixed", {0: [0, 1], 1: [2]})
    add_head_gates(student, "hard_concrete")
    inputs = tiny_inputs("bert", batch=4)
    with torch.no_grad():
        target_states = teacher(**inputs).last_hidden_state

    def loss_fn(model, batch):
        return 300.0 * ((model(**batch).last_hidden_state - target_states) ** 2).mean()

    seen = []
    log = train_gates_to_budget(
        student,
        loss_fn,
        [inputs],
        target_heads=3,
        steps=150,
        gate_lr=0.2,
        controller_lr=0.2,
        log_every=10,
        callback=lambda step, log: seen.append(step),
    )
    assert log.steps == seen == list(range(10, 151, 10))
    assert log.targets[0] > log.targets[-1] == 3.0  # the target is annealed down to the budget
    assert abs(log.expected_heads[-1] - 3) < 0.5 and abs(headkit.l0_penalty(student).item() - 3) < 0.5
    assert log.task_losses[-1] < 0.2 * log.task_losses[0]
    ranked = sorted(
        (
            (float(a), layer, head)
            for layer, g in head_gates(student).items()
            for head, a in enumerate(g.log_alpha.tolist())
        ),
        reverse=True,
    )
    assert sorted((layer, head) for _, layer, head in ranked[:3]) == [(0, 0), (0, 1), (1, 2)]
    assert all(not gate.training for gate in head_gates(student).values())  # back to the model's mode
    assert [len(log.gate_values[-1][layer]) for layer in (0, 1)] == [4, 4]


def test_training_refuses_bad_settings():
    model = tiny_model("bert")
    with pytest.raises(HeadkitError, match="no head gates"):
        train_gates_to_budget(model, lambda m, b: torch.zeros(()), [0], target_heads=1, steps=1)
    add_head_gates(model, "fixed")
    with pytest.raises(HeadkitError, match="Hard Concrete"):
        train_gates_to_budget(model, lambda m, b: torch.zeros(()), [0], target_heads=1, steps=1)
    remove_head_gates(model)
    add_head_gates(model)
    for kwargs, match in [
        ({"target_heads": 9}, "target_heads"),
        ({"target_heads": -1}, "target_heads"),
        ({"steps": 0}, "steps"),
        ({"gate_lr": 0.0}, "gate_lr"),
        ({"anneal_fraction": 1.5}, "anneal_fraction"),
    ]:
        settings = {"target_heads": 2, "steps": 1} | kwargs
        with pytest.raises(HeadkitError, match=match):
            train_gates_to_budget(model, lambda m, b: torch.zeros(()), [0], **settings)
    with pytest.raises(HeadkitError, match="re-iterable"):
        train_gates_to_budget(model, lambda m, b: torch.zeros(()), iter([0]), target_heads=1, steps=1)
    with pytest.raises(HeadkitError, match="at least one batch"):
        train_gates_to_budget(model, lambda m, b: torch.zeros(()), [], target_heads=1, steps=1)
