import copy
import math

import pytest
import torch
from tiny_models import TINY_MODELS, assert_same_state, outputs, state_of, tiny_inputs, tiny_model
from torch import nn

import headkit
from headkit.compat import attention_implementation
from headkit.errors import HeadkitError
from headkit.layers.gates import FixedGate, HardConcreteGate
from headkit.surgery.adapters import get_adapter, supported_architectures
from headkit.surgery.attention import needs_dispatch
from headkit.surgery.gating import (
    add_head_gates,
    gate_probabilities,
    gate_values,
    head_gates,
    l0_penalty,
    remove_head_gates,
)

ARCHITECTURES = supported_architectures()


def _run(model, inputs):
    with torch.no_grad():
        return outputs(model, inputs)


def _naive_head_scaling(model, scales):
    """Reference gating, independent of the gate modules: a pre-hook on each site's output projection multiplies
    the input columns h·d … (h+1)·d − 1 by scales[site][h] (a tensor, so gradients flow to it)."""
    handles = []
    for site in get_adapter(model).sites(model):
        if site.index not in scales:
            continue
        column_scale = scales[site.index].repeat_interleave(site.head_dim)

        def hook(module, args, column_scale=column_scale):
            return (args[0] * column_scale.to(args[0].dtype), *args[1:])

        handles.append(site.output_projection.register_forward_pre_hook(hook))
    return handles


def test_every_registered_adapter_has_a_tiny_model():
    assert set(ARCHITECTURES) <= set(TINY_MODELS), "add a tiny model for each new adapter in tiny_models.py"


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_wide_open_gates_leave_outputs_identical(kind):
    model = tiny_model(kind)
    inputs = tiny_inputs(kind)
    expected = _run(model, inputs)
    gates = headkit.add_head_gates(model, "hard_concrete", init_log_alpha=10.0)
    sites = get_adapter(model).sites(model)
    assert sorted(gates) == [site.index for site in sites]
    assert all(isinstance(gate, HardConcreteGate) for gate in gates.values())
    # Real submodules: in the state dict, in model.modules(), trained with model.parameters().
    gate_keys = [key for key in model.state_dict() if key.endswith("head_gate.log_alpha")]
    assert len(gate_keys) == len(sites)
    assert {id(p) for g in gates.values() for p in g.parameters()} <= {id(p) for p in model.parameters()}
    assert (_run(model, inputs) - expected).abs().max() < 1e-6


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_a_fixed_zero_gate_equals_zeroing_that_heads_output(kind):
    model = tiny_model(kind)
    inputs = tiny_inputs(kind)
    sites = get_adapter(model).sites(model)
    closed = {0: [1], len(sites) - 1: [0, 2]} if len(sites) > 1 else {0: [1, 2]}
    scales = {}
    for site in sites:
        scales[site.index] = torch.ones(site.num_heads)
        scales[site.index][closed.get(site.index, [])] = 0.0
    reference = copy.deepcopy(model)
    _naive_head_scaling(reference, scales)
    expected = _run(reference, inputs)

    alive = {i: [h for h in range(sites[i].num_heads) if h not in heads] for i, heads in closed.items()}
    gates = add_head_gates(model, "fixed", alive)
    assert all(isinstance(gate, FixedGate) for gate in gates.values())
    got = _run(model, inputs)
    assert (got - expected).abs().max() < 1e-6
    assert (got - _run(tiny_model(kind), inputs)).abs().max() > 1e-4  # closing heads changed something


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_hard_concrete_gates_match_the_naive_scaling_in_value_and_gradient(kind):
    """Evaluation gates g = clip(σ(log α)(r − l) + l, 0, 1) strictly inside (0, 1): outputs and ∂output/∂log α
    through the gate modules equal those of the hand-written scaling."""
    model = tiny_model(kind)
    inputs = tiny_inputs(kind)
    sites = get_adapter(model).sites(model)
    generator = torch.Generator().manual_seed(2)
    log_alphas = {site.index: torch.rand(site.num_heads, generator=generator) * 2 - 1 for site in sites}

    reference = copy.deepcopy(model)
    reference_leaves = {i: v.clone().requires_grad_(True) for i, v in log_alphas.items()}
    low, high = -0.1, 1.1
    scales = {i: (torch.sigmoid(v) * (high - low) + low).clamp(0, 1) for i, v in reference_leaves.items()}
    assert all(((s > 0) & (s < 1)).all() for s in scales.values())
    _naive_head_scaling(reference, scales)

    gates = add_head_gates(model, "hard_concrete")
    with torch.no_grad():
        for index, gate in gates.items():
            gate.log_alpha.copy_(log_alphas[index])
    cotangent = torch.randn(outputs(model, inputs).shape, generator=generator)

    got = outputs(model, inputs)
    want = outputs(reference, inputs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    got_grads = torch.autograd.grad(got, [gates[i].log_alpha for i in sorted(gates)], cotangent)
    want_grads = torch.autograd.grad(want, [reference_leaves[i] for i in sorted(gates)], cotangent)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        scale = want_grad.abs().max()
        assert scale > 0
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "albert", "llama", "headkit"])
def test_gated_models_reload_with_their_gates(tmp_path, kind):
    model = tiny_model(kind)
    inputs = tiny_inputs(kind)
    gates = add_head_gates(model, "hard_concrete", temperature=0.5, stretch=(-0.2, 1.2))
    with torch.no_grad():
        for gate in gates.values():
            gate.log_alpha.uniform_(-3.0, 3.0)
    expected = _run(model, inputs)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    reloaded_gates = head_gates(reloaded)
    assert sorted(reloaded_gates) == sorted(gates)
    for index, gate in gates.items():
        assert reloaded_gates[index].temperature == 0.5 and reloaded_gates[index].stretch == (-0.2, 1.2)
        assert torch.equal(reloaded_gates[index].log_alpha, gate.log_alpha)
    assert torch.equal(_run(reloaded, inputs), expected)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama", "headkit"])
def test_remove_head_gates_with_and_without_folding(tmp_path, kind):
    model = tiny_model(kind)
    inputs = tiny_inputs(kind)
    original = _run(model, inputs)
    gates = add_head_gates(model, "hard_concrete")
    with torch.no_grad():
        for gate in gates.values():
            gate.log_alpha.uniform_(-3.0, 1.0)  # a mix of closed, partly open and open heads
    gated = _run(model, inputs)

    folded = copy.deepcopy(model)
    remove_head_gates(folded, fold=True)
    assert not head_gates(folded) and not any(isinstance(m, HardConcreteGate) for m in folded.modules())
    torch.testing.assert_close(_run(folded, inputs), gated, atol=1e-6, rtol=1e-5)

    remove_head_gates(model)  # every head fully open again
    torch.testing.assert_close(_run(model, inputs), original, atol=1e-6, rtol=1e-5)
    assert not any(needs_dispatch(site.module) for site in get_adapter(model).sites(model))
    assert not attention_implementation(model).startswith("headkit_")  # the stock implementation again

    folded.save_pretrained(tmp_path)  # the record of the removal reloads a model without gates
    reloaded = headkit.from_pretrained(tmp_path)
    assert not head_gates(reloaded)
    assert torch.equal(_run(reloaded, inputs), _run(folded, inputs))


def test_l0_penalty_is_the_sum_of_nonzero_probabilities_and_counts_a_shared_layer_once():
    model = tiny_model("albert")  # one attention module shared by three layers
    gates = add_head_gates(model, "hard_concrete", temperature=0.4)
    assert len(gates) == 1
    with torch.no_grad():
        gates[0].log_alpha.copy_(torch.tensor([-2.0, 0.0, 1.0, 3.0]))
    penalty = headkit.l0_penalty(model)
    closed_form = torch.sigmoid(gates[0].log_alpha - 0.4 * math.log(0.1 / 1.1))
    torch.testing.assert_close(penalty, closed_form.sum())
    (gradient,) = torch.autograd.grad(penalty, [gates[0].log_alpha])
    torch.testing.assert_close(gradient, closed_form * (1 - closed_form))  # dσ/dx = σ(1 − σ)
    assert headkit.l0_penalty(list(gates.values())).item() == pytest.approx(penalty.item())

    llama = tiny_model("llama")
    add_head_gates(llama, "fixed", {0: [0, 5], 1: [7]})
    assert l0_penalty(llama).item() == 3.0  # fixed gates count their kept heads


def test_gate_readouts_per_layer_and_head():
    model = tiny_model("bert")
    add_head_gates(model, "hard_concrete", alive_heads={1: [0, 3]})
    model.train()  # readouts are evaluation values whatever the mode
    values, probabilities = gate_values(model), gate_probabilities(model)
    assert sorted(values) == [0, 1] and all(v.shape == (4,) for v in values.values())
    assert torch.equal(values[0], torch.ones(4))  # init log α = 3 is fully open in evaluation
    assert torch.equal(
        values[1], torch.tensor([1.0, 0.0, 0.0, 1.0])
    )  # heads outside alive_heads start closed
    expected = torch.sigmoid(torch.tensor([3.0, -10.0, -10.0, 3.0]) - 0.33 * math.log(0.1 / 1.1))
    torch.testing.assert_close(probabilities[1], expected)
    assert all(gate.training for gate in head_gates(model).values())
    with pytest.raises(HeadkitError, match="no head gates"):
        gate_values(tiny_model("bert"))


def test_a_copied_model_uses_its_own_gates():
    model = tiny_model("distilbert")
    inputs = tiny_inputs("distilbert")
    add_head_gates(model, "hard_concrete")
    copied = copy.deepcopy(model)
    before = _run(model, inputs)
    with torch.no_grad():
        head_gates(copied)[0].log_alpha.fill_(-10.0)
    assert torch.equal(_run(model, inputs), before)
    assert (_run(copied, inputs) - before).abs().max() > 1e-4


def test_training_mode_samples_one_gate_per_head_shared_over_the_batch():
    model = tiny_model("bert")
    inputs = {key: value[:1].expand(3, -1) for key, value in tiny_inputs("bert").items()}  # 3 identical rows
    gates = add_head_gates(model, "hard_concrete", init_log_alpha=0.0)
    for gate in gates.values():
        gate.train()
    first, second = _run(model, inputs), _run(model, inputs)
    assert (first - second).abs().max() > 1e-4  # a new sample per forward
    torch.testing.assert_close(first[0], first[2])  # the same sample for every row


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: add_head_gates(m, "soft"), "kind must be one of"),
        (lambda m: add_head_gates(m, "fixed", {2: [0]}), "out of range"),
        (lambda m: add_head_gates(m, "fixed", {0: [4]}), "out of range"),
        (lambda m: add_head_gates(m, "fixed", {0: [-1]}), "out of range"),
        (lambda m: add_head_gates(m, "fixed", {True: [0]}), "must be an int"),
        (lambda m: add_head_gates(m, "fixed", {0: "01"}), "iterable of head indices"),
        (lambda m: add_head_gates(m, "fixed", [[0]]), "mapping"),
        (lambda m: add_head_gates(m, "fixed", temperature=0.5), "no options"),
        (lambda m: add_head_gates(m, "hard_concrete", temperature=-1.0), "temperature"),
        (lambda m: add_head_gates(m, "hard_concrete", init_log_alpha=torch.zeros(4)), "init_log_alpha"),
        (lambda m: add_head_gates(m, "hard_concrete", colour="red"), "option"),
    ],
)
def test_bad_gate_requests_leave_the_model_untouched(call, match):
    model = tiny_model("bert")
    before, modules = state_of(model), [type(m) for m in model.modules()]
    with pytest.raises(HeadkitError, match=match):
        call(model)
    assert_same_state(model, before)
    assert [type(m) for m in model.modules()] == modules
    assert getattr(model.config, "headkit_surgery", None) in (None, [])
    for site in get_adapter(model).sites(model):
        assert not site.output_projection._forward_pre_hooks


def test_gating_twice_unsupported_models_and_removing_nothing_are_errors():
    model = tiny_model("bert")
    add_head_gates(model)
    with pytest.raises(HeadkitError, match="already has head gates"):
        add_head_gates(model, "fixed")
    assert all(isinstance(g, HardConcreteGate) for g in head_gates(model).values())
    with pytest.raises(HeadkitError, match="no head gates to remove"):
        remove_head_gates(tiny_model("gpt2"))
    with pytest.raises(HeadkitError, match="unsupported architecture"):
        add_head_gates(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(HeadkitError, match="no head gates"):
        l0_penalty(tiny_model("vit"))
