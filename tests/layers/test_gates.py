from __future__ import annotations

import doctest
import math

import pytest
import torch

from headkit.layers.gates import (
    GATES,
    FixedGate,
    HardConcreteGate,
    HeadkitGate,
    L0Controller,
    build_gate,
    expected_open_heads,
    l0_penalty,
)

LOG_ALPHAS = (-3.0, 0.0, 3.0)
SHAPES = [(0.33, (-0.1, 1.1)), (2 / 3, (-0.2, 1.3))]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def hard_concrete_cdf(x: float, log_alpha: float, temperature: float, stretch: tuple[float, float]) -> float:
    """P(g ≤ x) for 0 ≤ x < 1: the binary-concrete CDF σ(β·logit(s) − log α) at s = (x − l) / (r − l)."""
    low, high = stretch
    return sigmoid(temperature * logit((x - low) / (high - low)) - log_alpha)


def gate_over_groups(log_alphas, samples_per_value, **kwargs) -> HardConcreteGate:
    """One gate with `samples_per_value` heads per log α: one call draws every Monte-Carlo sample at once."""
    init = torch.tensor(log_alphas).repeat_interleave(samples_per_value)
    return HardConcreteGate(len(log_alphas) * samples_per_value, init_log_alpha=init, **kwargs)


# --- Hard Concrete distribution ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,stretch", SHAPES)
@pytest.mark.parametrize("hard", [False, True])
def test_monte_carlo_probability_nonzero_matches_closed_form(temperature, stretch, hard):
    samples = 10**6
    gate = gate_over_groups(LOG_ALPHAS, samples, temperature=temperature, stretch=stretch, hard=hard)
    with torch.no_grad():
        open_fraction = (gate() != 0).float().view(len(LOG_ALPHAS), samples).mean(dim=1)
        predicted = gate.probability_nonzero().view(len(LOG_ALPHAS), samples)[:, 0]
    low, high = stretch
    for group, log_alpha in enumerate(LOG_ALPHAS):
        # Louizos et al. Eq. 12 for soft gates; a straight-through gate is non-zero when g > 0.5.
        closed_form = (
            1.0 - hard_concrete_cdf(0.5, log_alpha, temperature, stretch)
            if hard
            else sigmoid(log_alpha - temperature * math.log(-low / high))
        )
        assert predicted[group].item() == pytest.approx(closed_form, abs=1e-6)
        assert abs(open_fraction[group].item() - closed_form) < 0.005


@pytest.mark.parametrize("temperature,stretch", SHAPES)
def test_samples_follow_the_stretched_and_clipped_concrete_cdf(temperature, stretch):
    samples = 10**6
    gate = gate_over_groups(LOG_ALPHAS, samples, temperature=temperature, stretch=stretch)
    with torch.no_grad():
        values = gate().view(len(LOG_ALPHAS), samples)
    assert values.min() >= 0 and values.max() <= 1
    for group, log_alpha in enumerate(LOG_ALPHAS):
        # Point masses at exactly 0 and exactly 1 (from the clip), a continuous density in between.
        assert (
            abs(
                (values[group] == 0).float().mean().item()
                - hard_concrete_cdf(0.0, log_alpha, temperature, stretch)
            )
            < 0.005
        )
        assert (
            abs(
                (values[group] == 1).float().mean().item()
                - (1 - hard_concrete_cdf(1.0 - 1e-7, log_alpha, temperature, stretch))
            )
            < 0.005
        )
        for x in (0.25, 0.5, 0.75):
            empirical = (values[group] <= x).float().mean().item()
            assert abs(empirical - hard_concrete_cdf(x, log_alpha, temperature, stretch)) < 0.005


@pytest.mark.parametrize("temperature,stretch", SHAPES)
def test_training_sample_and_its_gradient_follow_the_formula_for_the_same_noise(temperature, stretch):
    num_heads = 64
    log_alpha = torch.linspace(-2.0, 2.0, num_heads)
    gate = HardConcreteGate(
        num_heads,
        temperature=temperature,
        stretch=stretch,
        init_log_alpha=log_alpha,
        generator=torch.Generator().manual_seed(7),
    )
    values = gate()
    weights = torch.randn(num_heads)
    (grad,) = torch.autograd.grad((values * weights).sum(), gate.log_alpha)

    eps = HardConcreteGate.noise_eps
    u = torch.rand(num_heads, generator=torch.Generator().manual_seed(7)).clamp(eps, 1 - eps).double()
    low, high = stretch
    s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + log_alpha.double()) / temperature)
    stretched = s * (high - low) + low
    expected = stretched.clamp(0, 1)
    # d g / d log α = (r − l)·s·(1 − s)/β inside the clip, 0 where the clip is active.
    inside = (stretched > 0) & (stretched < 1)
    expected_grad = torch.where(inside, (high - low) * s * (1 - s) / temperature, 0.0) * weights
    torch.testing.assert_close(values.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-6, rtol=1e-5)
    assert inside.any() and (grad != 0).any()


@pytest.mark.parametrize("temperature,stretch", SHAPES)
def test_eval_gate_equals_its_closed_form_exactly(temperature, stretch):
    log_alpha = torch.linspace(-6.0, 6.0, 25)
    gate = HardConcreteGate(25, temperature=temperature, stretch=stretch, init_log_alpha=log_alpha).eval()
    low, high = stretch
    expected = torch.clamp(torch.sigmoid(log_alpha) * (high - low) + low, 0.0, 1.0)
    assert torch.equal(gate(), expected)
    assert torch.equal(gate(), gate())  # deterministic
    assert (expected == 0).any() and (expected == 1).any() and ((expected > 0) & (expected < 1)).any()


@pytest.mark.parametrize("init_log_alpha", [10.0, None])  # None: the default, documented as fully open
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_open_eval_gates_are_exactly_one_and_leave_outputs_unchanged(init_log_alpha, dtype):
    kwargs = {} if init_log_alpha is None else {"init_log_alpha": init_log_alpha}
    gate = HardConcreteGate(4, **kwargs).eval()
    assert gate().dtype == torch.float32
    assert torch.equal(gate(), torch.ones(4))
    head_outputs = torch.randn(2, 4, 5, 3, dtype=dtype)
    gated = gate.scale_heads(head_outputs)
    assert gated.dtype == dtype
    assert torch.equal(gated, head_outputs)


def test_scale_heads_draws_one_sample_per_head_shared_over_batch_and_positions():
    gate = HardConcreteGate(6, init_log_alpha=0.0)
    head_outputs = torch.rand(3, 6, 5, 4) + 0.5
    torch.manual_seed(3)
    gated = gate.scale_heads(head_outputs)
    torch.manual_seed(3)
    values = gate()
    ratios = gated / head_outputs
    torch.testing.assert_close(ratios, values.view(1, 6, 1, 1).expand_as(ratios), atol=1e-6, rtol=1e-6)
    assert values.unique().numel() > 1  # the heads drew different samples


@pytest.mark.parametrize("hard", [False, True])
def test_scale_heads_matches_explicit_broadcasting_in_value_and_gradients(hard):
    gate = HardConcreteGate(5, init_log_alpha=torch.linspace(-1.0, 1.0, 5), hard=hard)
    head_outputs = torch.randn(2, 5, 3, 4, requires_grad=True)
    torch.manual_seed(11)
    gated = gate.scale_heads(head_outputs)
    torch.manual_seed(11)
    reference = head_outputs * gate()[None, :, None, None]
    torch.testing.assert_close(gated, reference, atol=0, rtol=0)
    cotangent = torch.randn_like(gated)
    grads = torch.autograd.grad(gated, (head_outputs, gate.log_alpha), cotangent)
    reference_grads = torch.autograd.grad(reference, (head_outputs, gate.log_alpha), cotangent)
    for grad, reference_grad in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(grad, reference_grad, atol=1e-6, rtol=1e-5)
    assert (grads[1] != 0).any()  # the gates learn through the layer's output


def test_uniform_noise_is_kept_away_from_zero_and_one(monkeypatch):
    eps = HardConcreteGate.noise_eps
    log_alpha = torch.tensor([logit(1 - eps), logit(eps)])  # where u = 0 or 1 would saturate instead
    gate = HardConcreteGate(2, init_log_alpha=log_alpha)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor([0.0, 1.0]))
    values = gate()
    (grad,) = torch.autograd.grad(values.sum(), gate.log_alpha)
    u = torch.tensor([eps, 1 - eps]).double()  # 1 − eps rounded to float32, as the gate sees it
    s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + log_alpha.double()) / gate.temperature)
    torch.testing.assert_close(values.double(), (s * 1.2 - 0.1).clamp(0, 1), atol=1e-5, rtol=1e-4)
    assert ((values > 0) & (values < 1)).all() and torch.isfinite(grad).all() and (grad != 0).all()


def test_scale_heads_on_another_head_axis_matches_the_default_layout():
    gate = FixedGate(4, alive_heads=[1, 3])
    head_outputs = torch.randn(2, 4, 5, 3)
    by_default = gate.scale_heads(head_outputs)
    time_major = gate.scale_heads(head_outputs.transpose(1, 2), head_dim=2)
    negative_axis = gate.scale_heads(head_outputs.transpose(1, 2), head_dim=-2)
    assert torch.equal(time_major.transpose(1, 2), by_default)
    assert torch.equal(negative_axis, time_major)


@pytest.mark.parametrize("hard", [False, True])
def test_probability_nonzero_is_differentiable(hard):
    log_alpha = torch.linspace(-3.0, 3.0, 7)
    gate = HardConcreteGate(7, init_log_alpha=log_alpha, hard=hard)
    probabilities = gate.probability_nonzero()
    weights = torch.randn(7)
    (grad,) = torch.autograd.grad((probabilities * weights).sum(), gate.log_alpha)
    # P = σ(log α − c), so dP/d log α = P·(1 − P).
    torch.testing.assert_close(grad, weights * probabilities.detach() * (1 - probabilities.detach()))
    assert (grad != 0).all()


@pytest.mark.parametrize("training", [True, False])
def test_straight_through_gates_are_zero_or_one_with_the_soft_gradient(training):
    log_alpha = torch.linspace(-1.0, 1.0, 64)
    hard_gate = HardConcreteGate(
        64, init_log_alpha=log_alpha, hard=True, generator=torch.Generator().manual_seed(1)
    )
    soft_gate = HardConcreteGate(64, init_log_alpha=log_alpha, generator=torch.Generator().manual_seed(1))
    hard_gate.train(training)
    soft_gate.train(training)
    hard_values, soft_values = hard_gate(), soft_gate()
    assert torch.equal(hard_values, (soft_values > 0.5).float())
    assert (hard_values == 0).any() and (hard_values == 1).any()
    weights = torch.randn(64)
    (hard_grad,) = torch.autograd.grad((hard_values * weights).sum(), hard_gate.log_alpha)
    (soft_grad,) = torch.autograd.grad((soft_values * weights).sum(), soft_gate.log_alpha)
    torch.testing.assert_close(hard_grad, soft_grad, atol=0, rtol=0)
    assert (hard_grad != 0).any()


def test_samples_are_reproducible_from_the_global_seed():
    gate = HardConcreteGate(16, init_log_alpha=0.0)
    torch.manual_seed(123)
    first, second = gate(), gate()
    torch.manual_seed(123)
    assert torch.equal(gate(), first) and torch.equal(gate(), second)
    assert not torch.equal(first, second)  # a fresh sample every call


def test_a_generator_reproduces_samples_without_touching_the_global_rng():
    gate_a = HardConcreteGate(16, init_log_alpha=0.0, generator=torch.Generator().manual_seed(5))
    gate_b = HardConcreteGate(16, init_log_alpha=0.0, generator=torch.Generator().manual_seed(5))
    global_state = torch.get_rng_state()
    samples_a = [gate_a() for _ in range(3)]
    samples_b = [gate_b() for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), global_state)
    for a, b in zip(samples_a, samples_b, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(samples_a[0], samples_a[1])


# --- Fixed gates and the registry --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alive_heads",
    [
        [0, 2, 5],
        range(0, 6, 5),
        {2},
        torch.tensor([1, 0, 1, 0, 0, 1]),
        torch.tensor([0, 0, 0, 0, 0, 0]).bool(),
    ],
    ids=["list", "range", "set", "int-mask", "bool-mask"],
)
def test_fixed_gate_equals_its_mask_and_zeroes_exactly_the_dropped_heads(alive_heads):
    if isinstance(alive_heads, torch.Tensor):
        mask = alive_heads.float()
    else:
        mask = torch.zeros(6)
        mask[list(alive_heads)] = 1.0
    gate = FixedGate(6, alive_heads=alive_heads)
    assert torch.equal(gate(), mask)
    assert torch.equal(gate.probability_nonzero(), mask)
    assert list(gate.parameters()) == []
    assert torch.equal(gate.state_dict()["mask"], mask)
    head_outputs = torch.randn(2, 6, 4, 3) + 10.0  # no exact zeros of its own
    gated = gate.scale_heads(head_outputs)
    kept = mask.bool()
    assert torch.equal(gated[:, kept], head_outputs[:, kept])
    assert torch.equal(gated[:, ~kept], torch.zeros_like(gated[:, ~kept]))


def test_fixed_gate_keeps_every_head_by_default():
    gate = FixedGate(3)
    assert torch.equal(gate(), torch.ones(3))
    head_outputs = torch.randn(1, 3, 2, 2)
    assert torch.equal(gate.scale_heads(head_outputs), head_outputs)


def test_build_gate_builds_each_registered_kind():
    assert set(GATES) == {"hard_concrete", "fixed"}
    hard_concrete = build_gate("hard_concrete", 5, temperature=0.5, hard=True)
    assert isinstance(hard_concrete, HardConcreteGate)
    assert (hard_concrete.num_heads, hard_concrete.temperature, hard_concrete.hard) == (5, 0.5, True)
    fixed = build_gate("fixed", 3, alive_heads=[1])
    assert isinstance(fixed, FixedGate) and torch.equal(fixed(), torch.tensor([0.0, 1.0, 0.0]))
    for gate in (hard_concrete, fixed):
        assert isinstance(gate, HeadkitGate)


def test_build_gate_lists_the_valid_kinds():
    with pytest.raises(ValueError, match="kind.*'fixed'.*'hard_concrete'"):
        build_gate("magnitude", 4)


# --- L0 penalty and the controller -------------------------------------------------------------------------


def test_l0_penalty_is_the_expected_number_of_open_heads_over_all_gates():
    learned = [HardConcreteGate(4, init_log_alpha=torch.randn(4)) for _ in range(2)]
    fixed = FixedGate(5, alive_heads=[0, 3])
    penalty = l0_penalty(gate for gate in [*learned, fixed])  # any iterable, a generator included
    probabilities = [gate.probability_nonzero().detach() for gate in learned]
    expected = sum(p.sum() for p in probabilities) + 2.0
    torch.testing.assert_close(penalty, expected)
    assert penalty.dim() == 0
    assert expected_open_heads([*learned, fixed]) == pytest.approx(expected.item(), rel=1e-6)
    grads = torch.autograd.grad(penalty, [gate.log_alpha for gate in learned])
    for grad, p in zip(grads, probabilities, strict=True):
        torch.testing.assert_close(grad, p * (1 - p))


def test_controller_penalty_value_and_reversed_multiplier_gradients():
    gates = [HardConcreteGate(6, init_log_alpha=torch.randn(6)) for _ in range(2)]
    controller = L0Controller(target_heads=4, lr=0.1)
    with torch.no_grad():
        controller.lambda_1.fill_(0.7)
        controller.lambda_2.fill_(0.3)
    penalty = controller.penalty(gates)
    probabilities = [gate.probability_nonzero().detach() for gate in gates]
    gap = sum(p.sum() for p in probabilities) - 4.0
    torch.testing.assert_close(penalty, 0.7 * gap + 0.3 * gap**2)
    grads = torch.autograd.grad(
        penalty, [controller.lambda_1, controller.lambda_2, *(gate.log_alpha for gate in gates)]
    )
    # The multipliers are maximised: their gradients are negated, so a minimising optimizer ascends.
    torch.testing.assert_close(grads[0], -gap)
    torch.testing.assert_close(grads[1], -(gap**2))
    for grad, p in zip(grads[2:], probabilities, strict=True):
        torch.testing.assert_close(grad, (0.7 + 2 * 0.3 * gap) * p * (1 - p))
    group = controller.param_group()
    assert group["lr"] == 0.1 and group["weight_decay"] == 0.0
    assert group["params"] == [controller.lambda_1, controller.lambda_2]


def train_with_controller(gates, controller, steps, task_loss=None, lr=0.05):
    gate_params = [p for gate in gates for p in gate.parameters()]
    optimizer = torch.optim.Adam([{"params": gate_params}, controller.param_group()], lr=lr)
    for _ in range(steps):
        loss = controller.penalty(gates)
        if task_loss is not None:
            loss = loss + task_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("target", [6, 20, 40])
def test_controller_drives_expected_open_heads_to_the_target(target):
    gates = [HardConcreteGate(12, init_log_alpha=3.0 + 0.5 * torch.randn(12)) for _ in range(4)]
    assert expected_open_heads(gates) > 45
    controller = L0Controller(target_heads=target)
    train_with_controller(gates, controller, steps=300)
    assert abs(expected_open_heads(gates) - target) <= 1.0
    assert controller.lambda_2.item() > 0  # ascended: (E[L0] − t)² ≥ 0 only ever pushes λ₂ up


def test_controller_with_a_task_loss_keeps_the_heads_the_task_needs():
    gates = [HardConcreteGate(12) for _ in range(4)]
    useful = torch.zeros(48, dtype=torch.bool)
    useful[torch.randperm(48)[:12]] = True

    def task_loss():
        # Only the useful heads lower the loss when open.
        return -torch.cat([gate() for gate in gates])[useful].sum()

    controller = L0Controller(target_heads=12)
    train_with_controller(gates, controller, steps=300, task_loss=task_loss)
    assert abs(expected_open_heads(gates) - 12) <= 1.0
    log_alpha = torch.cat([gate.log_alpha.detach() for gate in gates])
    assert set(log_alpha.topk(12).indices.tolist()) == set(useful.nonzero().flatten().tolist())


def test_controller_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(L0Controller, "L0Controller", globs={}):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0


def test_target_heads_can_be_annealed_during_training():
    controller = L0Controller(target_heads=30)
    controller.target_heads = 12
    assert controller.target_heads == 12.0
    with pytest.raises(ValueError, match="target_heads"):
        controller.target_heads = -1


# --- Bad arguments -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"num_heads": 0}, "num_heads"),
        ({"num_heads": 2.5}, "num_heads"),
        ({"num_heads": True}, "num_heads"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stretch": (0.1, 1.1)}, "stretch"),
        ({"stretch": (-0.1, 0.9)}, "stretch"),
        ({"stretch": (-0.1,)}, "stretch"),
        ({"stretch": "ab"}, "stretch"),
        ({"init_log_alpha": torch.zeros(3)}, "init_log_alpha"),
        ({"init_log_alpha": torch.zeros(4, dtype=torch.long)}, "init_log_alpha"),
        ({"init_log_alpha": float("inf")}, "init_log_alpha"),
        ({"init_log_alpha": "open"}, "init_log_alpha"),
        ({"hard": 1}, "hard"),
        ({"generator": 0}, "generator"),
    ],
)
def test_hard_concrete_gate_rejects_bad_arguments(kwargs, argument):
    kwargs = {"num_heads": 4, **kwargs}
    with pytest.raises(ValueError, match=argument):
        HardConcreteGate(**kwargs)


@pytest.mark.parametrize(
    "alive_heads",
    [[4], [-1], [0, 4], [True], [1.0], 3, torch.ones(5), torch.ones(2, 2), torch.tensor([0, 1, 2, 1])],
)
def test_fixed_gate_rejects_bad_alive_heads(alive_heads):
    with pytest.raises(ValueError, match="alive_heads"):
        FixedGate(4, alive_heads=alive_heads)


@pytest.mark.parametrize(
    "head_outputs,head_dim,argument",
    [
        (torch.randn(2, 3, 5, 8), 1, "head_outputs"),
        (torch.randn(2, 5, 4, 8), 1, "head_outputs"),
        (torch.randn(2, 4, 5, 8), 4, "head_dim"),
        (torch.randn(2, 4, 5, 8), 1.0, "head_dim"),
        ([[1.0] * 4], 1, "head_outputs"),
    ],
)
def test_scale_heads_rejects_mismatched_head_outputs(head_outputs, head_dim, argument):
    gate = HardConcreteGate(4)
    with pytest.raises(ValueError, match=argument):
        gate.scale_heads(head_outputs, head_dim=head_dim)


def test_l0_utilities_reject_empty_or_foreign_gates():
    for function in (l0_penalty, expected_open_heads, L0Controller(1).penalty):
        with pytest.raises(ValueError, match="gates"):
            function([])
        with pytest.raises(ValueError, match="gates"):
            function([torch.nn.Linear(2, 2)])
        with pytest.raises(ValueError, match="gates"):
            function(3)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"target_heads": -1}, "target_heads"),
        ({"target_heads": float("nan")}, "target_heads"),
        ({"target_heads": 4, "lr": 0.0}, "lr"),
        ({"target_heads": 4, "lr": -0.1}, "lr"),
    ],
)
def test_controller_rejects_bad_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        L0Controller(**kwargs)


def test_controller_rejects_a_target_above_the_gated_head_count():
    with pytest.raises(ValueError, match="target_heads.*8"):
        L0Controller(target_heads=9).penalty([HardConcreteGate(4), HardConcreteGate(4)])
