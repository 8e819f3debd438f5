"""Hybrid sliding-window softmax + linear attention (LoLCATs): the chunked kernel against the dense reference
(outputs, states, gradients), decoding from a state, padding, limiting cases, dtypes and bad input."""

from __future__ import annotations

import pytest
import torch

from headkit.ops import (
    HybridAttentionState,
    hybrid_attention,
    hybrid_attention_step_,
    ring_from_state,
    softmax_attention,
    state_from_ring,
)
from headkit.ops.hybrid import naive_hybrid_attention

REL_TOL = 1e-5


def assert_close_scaled(
    actual: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL, scale=None
) -> None:
    """max |actual − expected| ≤ rel · scale, scale = max |expected| unless given."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if scale is None:
        scale = expected.double().abs().max().item() if expected.numel() else 1.0
    error = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert error <= rel * max(scale, 1e-12), f"max error {error:.3g} > {rel:g} × scale {scale:.3g}"


def assert_states_close(actual: HybridAttentionState, expected: HybridAttentionState, rel: float = REL_TOL):
    assert torch.equal(actual.keep, expected.keep)
    for field in ("keys", "values", "key_features", "kv", "k_sum"):
        assert_close_scaled(getattr(actual, field), getattr(expected, field), rel)


def make_inputs(
    batch: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seq: int = 23,
    head_dim: int = 8,
    head_dim_v: int = 6,
    features: int = 10,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """q, k, v, positive features (softmax rows, like Hedgehog's halves) and a balance around 1."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = (
        draw(batch, heads, seq, head_dim),
        draw(batch, kv_heads, seq, head_dim),
        draw(batch, kv_heads, seq, head_dim_v),
    )
    qf = draw(batch, heads, seq, features).softmax(-1)
    kf = draw(batch, kv_heads, seq, features).softmax(-1)
    balance = torch.rand(heads, generator=generator, dtype=torch.float64) * 2 + 0.5
    return tuple(t.to(dtype) for t in (q, k, v, qf, kf, balance))


def make_padding_mask(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    keep = torch.rand(batch, seq, generator=generator) > 0.3
    keep[0, : min(3, seq)] = False  # left padding: row 0's first queries see no real key at all
    return keep


CASES = [  # (seq, window, chunk_size)
    (1, 4, 4),
    (3, 8, 4),  # T < window: pure softmax
    (10, 4, 4),  # T not a multiple of the chunk
    (23, 5, 7),
    (23, 1, 4),  # window 1: the query's own key, everything else linear
    (23, 9, 64),  # one chunk longer than T
    (23, 30, 3),  # window longer than T
    (40, 6, 1),
]


@pytest.mark.parametrize("seq, window, chunk_size", CASES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_outputs_states_and_gradients_match_the_dense_reference(
    seq, window, chunk_size, heads, kv_heads, padded
):
    inputs = [t.requires_grad_() for t in make_inputs(heads=heads, kv_heads=kv_heads, seq=seq)]
    mask = make_padding_mask(2, seq) if padded else None

    out, state = hybrid_attention(
        *inputs, window=window, chunk_size=chunk_size, attention_mask=mask, output_final_state=True
    )
    reference_inputs = [t.detach().double().requires_grad_() for t in inputs]
    expected, expected_state = naive_hybrid_attention(
        *reference_inputs, window=window, attention_mask=mask, output_final_state=True
    )
    assert out.dtype == torch.float32
    assert_close_scaled(out, expected)
    assert_states_close(state, expected_state)

    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, reference_inputs, grad_out.double())
    scale = max(g.abs().max().item() for g in expected_grads)
    for name, grad, reference in zip(
        ("q", "k", "v", "qf", "kf", "balance"), grads, expected_grads, strict=True
    ):
        assert grad is not None, name
        assert_close_scaled(grad, reference, 2 * REL_TOL, scale=scale)


def test_float64_gradcheck():
    inputs = [
        t.requires_grad_()
        for t in make_inputs(
            batch=1, heads=2, kv_heads=1, seq=7, head_dim=4, head_dim_v=3, features=3, dtype=torch.float64
        )
    ]
    mask = torch.tensor([[False, True, True, True, False, True, True]])

    def run(*args):
        return hybrid_attention(*args, window=3, chunk_size=2, attention_mask=mask)[0]

    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-7)


def test_float64_chunked_form_is_exact_to_float64_precision():
    inputs = make_inputs(seq=37, dtype=torch.float64)
    out, _ = hybrid_attention(*inputs, window=6, chunk_size=5)
    expected, _ = naive_hybrid_attention(*inputs, window=6)
    assert out.dtype == torch.float64
    assert_close_scaled(out, expected, rel=1e-12)


@pytest.mark.parametrize("window", [1, 4, 30])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("prefill", [0, 2, 11])
def test_prefill_then_step_by_step_decoding_equals_the_full_forward(window, padded, prefill):
    seq = 20
    q, k, v, qf, kf, balance = make_inputs(seq=seq)
    mask = make_padding_mask(2, seq) if padded else torch.ones(2, seq, dtype=torch.bool)
    full, full_state = hybrid_attention(
        q, k, v, qf, kf, balance, window=window, chunk_size=4, attention_mask=mask, output_final_state=True
    )

    def part(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return x[:, :, start:stop]

    # No prefill: the empty state, which the parallel form gives for no token.
    first, state = hybrid_attention(
        *(part(x, 0, prefill) for x in (q, k, v, qf, kf)),
        balance,
        window=window,
        chunk_size=4,
        attention_mask=mask[:, :prefill],
        output_final_state=True,
    )
    pieces, ring, shapes = [first], ring_from_state(state, prefill), set()
    for t in range(prefill, seq):
        out = hybrid_attention_step_(
            *(part(x, t, t + 1) for x in (q, k, v, qf, kf)),
            balance,
            ring,
            window=window,
            attention_mask=mask[:, t : t + 1],
        )
        pieces.append(out)
        state = state_from_ring(ring)
        shapes.add(tuple(tuple(tensor.shape) for tensor in state))
    assert_close_scaled(torch.cat(pieces, dim=2), full)
    assert_states_close(state, full_state)
    assert len(shapes) == 1  # one fixed-size state, whatever the number of tokens seen
    batch, kv_heads, head_dim, head_dim_v, features = 2, k.shape[1], k.shape[3], v.shape[3], kf.shape[3]
    assert shapes.pop() == (
        (batch, kv_heads, window - 1, head_dim),
        (batch, kv_heads, window - 1, head_dim_v),
        (batch, kv_heads, window - 1, features),
        (batch, window - 1),
        (batch, kv_heads, features, head_dim_v),
        (batch, kv_heads, features),
    )


@pytest.mark.parametrize("split", [1, 5, 13])
@pytest.mark.parametrize("chunk_size", [3, 64])
def test_a_prefill_state_continues_a_multi_token_call_exactly(split, chunk_size):
    q, k, v, qf, kf, balance = make_inputs(seq=21)
    mask = make_padding_mask(2, 21)
    full, full_state = hybrid_attention(
        q,
        k,
        v,
        qf,
        kf,
        balance,
        window=7,
        chunk_size=chunk_size,
        attention_mask=mask,
        output_final_state=True,
    )
    head = [x[:, :, :split] for x in (q, k, v, qf, kf)]
    tail = [x[:, :, split:] for x in (q, k, v, qf, kf)]
    first, state = hybrid_attention(
        *head,
        balance,
        window=7,
        chunk_size=chunk_size,
        attention_mask=mask[:, :split],
        output_final_state=True,
    )
    second, state = hybrid_attention(
        *tail,
        balance,
        window=7,
        chunk_size=chunk_size,
        attention_mask=mask[:, split:],
        initial_state=state,
        output_final_state=True,
    )
    assert_close_scaled(torch.cat([first, second], dim=2), full)
    assert_states_close(state, full_state)


def test_gradients_flow_through_the_initial_state():
    q, k, v, qf, kf, balance = make_inputs(seq=12, dtype=torch.float64)
    _, state = hybrid_attention(
        *(x[:, :, :8] for x in (q, k, v, qf, kf)), balance, window=3, output_final_state=True
    )
    leaves = [t.clone().requires_grad_() if t.dtype != torch.bool else t for t in state]
    tail = [x[:, :, 8:] for x in (q, k, v, qf, kf)]

    def run(keys, values, key_features, kv, k_sum):
        initial = HybridAttentionState(keys, values, key_features, leaves[3], kv, k_sum)
        return hybrid_attention(*tail, balance, window=3, chunk_size=2, initial_state=initial)[0]

    differentiable = [leaves[i] for i in (0, 1, 2, 4, 5)]
    assert torch.autograd.gradcheck(run, differentiable, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("window", [1, 3, 9])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("validate", [True, False])
def test_the_one_token_step_matches_the_parallel_form_in_outputs_states_and_gradients(
    window, padded, validate
):
    """The decoding step, in place on the ring buffers: same output, state and gradients (inputs and state) as
    the chunked form given the same single token, including windows that hold padding or no real key — also
    without its checks (``validate=False``, what a layer passes for buffers it holds)."""
    q, k, v, qf, kf, balance = make_inputs(seq=12, dtype=torch.float64)
    mask = make_padding_mask(2, 12) if padded else torch.ones(2, 12, dtype=torch.bool)
    _, state = hybrid_attention(
        *(x[:, :, :11] for x in (q, k, v, qf, kf)),
        balance,
        window=window,
        attention_mask=mask[:, :11],
        output_final_state=True,
    )
    token = [x[:, :, 11:].clone().requires_grad_() for x in (q, k, v, qf, kf)]
    carried = [t.clone().requires_grad_() if t.dtype != torch.bool else t for t in state]
    gamma = balance.clone().requires_grad_()

    def run(step: bool):
        initial = HybridAttentionState(*carried)
        if step:
            ring = ring_from_state(initial, 11)
            out = hybrid_attention_step_(
                *token, gamma, ring, window=window, attention_mask=mask[:, 11:], validate=validate
            )
            return out, state_from_ring(ring)
        return hybrid_attention(
            *token,
            gamma,
            window=window,
            attention_mask=mask[:, 11:],
            initial_state=initial,
            output_final_state=True,
        )

    leaves = [*token, gamma, *(t for t in carried if t.requires_grad)]
    results = {}
    for step in (True, False):
        out, final = run(step)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum() + sum(
            (t * t).sum() for t in final if t.dtype != torch.bool
        )
        results[step] = (out.detach(), final, torch.autograd.grad(loss, leaves))
    assert_close_scaled(results[True][0], results[False][0], rel=1e-12)
    assert_states_close(results[True][1], results[False][1], rel=1e-12)
    for fast, reference in zip(results[True][2], results[False][2], strict=True):
        assert_close_scaled(fast, reference, rel=1e-12)


def test_padded_keys_contribute_nothing_and_left_padding_changes_nothing():
    q, k, v, qf, kf, balance = make_inputs(batch=1, seq=15)
    pad = 4
    mask = torch.ones(1, 15, dtype=torch.bool)
    mask[0, :pad] = False
    out, _ = hybrid_attention(q, k, v, qf, kf, balance, window=5, chunk_size=4, attention_mask=mask)
    changed = [x.clone() for x in (q, k, v, qf, kf)]
    for x in changed:
        x[:, :, :pad] = x[:, :, :pad] * 7 + 3
    out_changed, _ = hybrid_attention(*changed, balance, window=5, chunk_size=4, attention_mask=mask)
    alone, _ = hybrid_attention(*(x[:, :, pad:] for x in (q, k, v, qf, kf)), balance, window=5, chunk_size=4)
    assert_close_scaled(out[:, :, pad:], out_changed[:, :, pad:], rel=1e-6)
    # The window counts positions, padding included: left padding shifts every real token's window and linear
    # range by the same amount, so the real tokens see exactly what they see unpadded.
    assert_close_scaled(out[:, :, pad:], alone)


def test_queries_that_see_no_real_key_return_zeros():
    q, k, v, qf, kf, balance = make_inputs(seq=6)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    out, _ = hybrid_attention(q, k, v, qf, kf, balance, window=3, chunk_size=4, attention_mask=mask)
    assert torch.equal(out, torch.zeros_like(out))


def test_outputs_do_not_depend_on_later_tokens():
    q, k, v, qf, kf, balance = make_inputs(seq=19)
    out, _ = hybrid_attention(q, k, v, qf, kf, balance, window=4, chunk_size=5)
    changed = [x.clone() for x in (q, k, v, qf, kf)]
    for x in changed:
        x[:, :, 11:] = x[:, :, 11:].flip(-1) * 3
    out_changed, _ = hybrid_attention(*changed, balance, window=4, chunk_size=5)
    assert torch.equal(out[:, :, :11], out_changed[:, :, :11])


def test_a_window_covering_the_sequence_is_causal_softmax_attention():
    q, k, v, qf, kf, balance = make_inputs(seq=17)
    out, _ = hybrid_attention(q, k, v, qf, kf, balance, window=17, chunk_size=4, eps=0.0)
    assert_close_scaled(out, softmax_attention(q, k, v, causal=True))


def test_zero_balance_is_sliding_window_softmax_attention():
    q, k, v, qf, kf, balance = make_inputs(seq=17)
    window = 5
    out, _ = hybrid_attention(
        q, k, v, qf, kf, torch.zeros_like(balance), window=window, chunk_size=4, eps=0.0
    )
    i, j = torch.arange(17)[:, None], torch.arange(17)[None, :]
    band = ((j <= i) & (j > i - window))[None, None].expand(2, 4, 17, 17)
    assert_close_scaled(out, softmax_attention(q, k, v, attention_mask=band))


def test_window_weights_are_stabilised_by_their_maximum():
    """LoLCATs' convention: a common shift of the scores leaves the window's normalised weights unchanged, and
    huge scores stay finite; only the balance against the linear term is set on the scale of the window max."""
    q, k, v, qf, kf, balance = make_inputs(seq=16)
    out, _ = hybrid_attention(q * 300, k, v, qf, kf, balance, window=4, chunk_size=4)
    expected, _ = naive_hybrid_attention(
        q.double() * 300, k.double(), v.double(), qf.double(), kf.double(), balance.double(), window=4
    )
    assert bool(torch.isfinite(out).all())
    assert_close_scaled(out, expected, rel=1e-4)


def test_bf16_inputs_and_autocast_accumulate_in_float32():
    q, k, v, qf, kf, balance = make_inputs(seq=33)
    expected, _ = naive_hybrid_attention(*(x.double() for x in (q, k, v, qf, kf, balance)), window=6)
    half = [x.bfloat16() for x in (q, k, v, qf, kf)]
    out, state = hybrid_attention(*half, balance, window=6, chunk_size=8, output_final_state=True)
    assert out.dtype == torch.bfloat16
    assert state.kv.dtype == torch.float32 and state.keys.dtype == torch.bfloat16
    assert_close_scaled(out, expected, rel=3e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_out, autocast_state = hybrid_attention(
            q, k, v, qf, kf, balance, window=6, output_final_state=True
        )
    assert autocast_out.dtype == torch.float32 and autocast_state.kv.dtype == torch.float32
    assert_close_scaled(autocast_out, expected)


def test_empty_sequence_returns_an_empty_output_and_the_initial_state():
    q, k, v, qf, kf, balance = make_inputs(seq=9)
    _, state = hybrid_attention(q, k, v, qf, kf, balance, window=4, output_final_state=True)
    empty = [x[:, :, :0] for x in (q, k, v, qf, kf)]
    out, same = hybrid_attention(*empty, balance, window=4, initial_state=state, output_final_state=True)
    assert out.shape == (2, 4, 0, 6)
    assert_states_close(same, state, rel=0)


def test_final_state_is_returned_only_on_request():
    q, k, v, qf, kf, balance = make_inputs(seq=5)
    assert hybrid_attention(q, k, v, qf, kf, balance, window=2)[1] is None


GOOD = dict(zip(("q", "k", "v", "qf", "kf", "balance"), make_inputs(seq=5), strict=True))


def call(**overrides):
    arguments = {**GOOD, "window": 3, **overrides}
    positional = [arguments.pop(name) for name in ("q", "k", "v", "qf", "kf", "balance")]
    return hybrid_attention(*positional, **arguments)


def bad_state(**fields):
    _, state = call(output_final_state=True)
    return state._replace(**fields)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"q": torch.zeros(2, 4, 5)}, r"q must have shape"),
        ({"k": torch.zeros(2, 3, 5, 8), "v": torch.zeros(2, 3, 5, 6)}, "does not divide"),
        ({"k": torch.zeros(2, 2, 4, 8), "v": torch.zeros(2, 2, 4, 6)}, "same seq length as q"),
        ({"qf": torch.zeros(2, 4, 5)}, r"qf must have shape"),
        ({"qf": torch.zeros(2, 2, 5, 10)}, r"qf must have shape \[2, 4, 5, feature_dim\]"),
        ({"kf": torch.zeros(2, 2, 5, 9)}, r"kf must have shape .*feature_dim 10"),
        ({"qf": torch.zeros(2, 4, 5, 10, dtype=torch.long)}, "qf must be a floating-point"),
        ({"balance": torch.ones(2)}, r"balance must be a tensor of shape \[heads\] = \[4\]"),
        ({"balance": 1.0}, "balance must be a tensor"),
        ({"balance": torch.ones(4, dtype=torch.long)}, "balance must be a floating-point"),
        ({"window": 0}, "window must be a positive integer"),
        ({"window": 2.5}, "window must be a positive integer"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"scale": -1.0}, "scale must be"),
        ({"eps": float("nan")}, "eps must be"),
        (
            {"attention_mask": torch.ones(2, 4, dtype=torch.bool)},
            r"attention_mask must have shape \[batch, seq\]",
        ),
        ({"attention_mask": torch.ones(2, 5)}, "attention_mask must be bool or integer"),
        ({"initial_state": (torch.zeros(1),)}, "initial_state must be a HybridAttentionState"),
    ],
)
def test_bad_input_raises_a_value_error_naming_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        call(**overrides)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("keys", torch.zeros(2, 2, 3, 8), r"initial_state.keys must have shape .*window 3"),
        ("keep", torch.ones(2, 2), "initial_state.keep must be a bool tensor"),
        ("kv", torch.zeros(2, 2, 10, 5), r"initial_state.kv must have shape"),
        ("k_sum", torch.zeros(2, 2, 10, dtype=torch.long), "initial_state.k_sum must be a floating-point"),
    ],
)
def test_a_bad_state_raises_a_value_error_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        call(initial_state=bad_state(**{field: value}))


def test_a_state_from_another_window_is_rejected_by_the_step():
    _, state = call(output_final_state=True)
    one = {name: tensor[:, :, :1] for name, tensor in GOOD.items() if name != "balance"}
    with pytest.raises(ValueError, match=r"state.keys must have shape .*window 5"):
        hybrid_attention_step_(**one, balance=GOOD["balance"], ring=ring_from_state(state, 5), window=5)


def test_the_step_takes_one_token_and_the_ring_buffers():
    _, state = call(output_final_state=True)
    two = {name: tensor[:, :, :2] for name, tensor in GOOD.items() if name != "balance"}
    with pytest.raises(ValueError, match="one new token"):
        hybrid_attention_step_(**two, balance=GOOD["balance"], ring=ring_from_state(state, 5))
    one = {name: tensor[:, :, :1] for name, tensor in GOOD.items() if name != "balance"}
    with pytest.raises(ValueError, match="HybridRingState"):
        hybrid_attention_step_(**one, balance=GOOD["balance"], ring=state)


def test_the_ring_converters_round_trip_at_any_phase():
    _, state = call(output_final_state=True)
    for seen in (2, 5, 6, 11):
        ring = ring_from_state(state, seen)
        assert int(ring.seen) == seen
        for got, want in zip(state_from_ring(ring), state, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("padded", [False, True])
def test_the_unchecked_parallel_form_is_the_checked_one(padded):
    """``validate=False`` (what layers pass) skips the checks and changes nothing else, with or without a state."""
    q, k, v, qf, kf, balance = make_inputs(seq=13)
    mask = make_padding_mask(2, 13) if padded else None
    head = [x[:, :, :7] for x in (q, k, v, qf, kf)]
    tail = [x[:, :, 7:] for x in (q, k, v, qf, kf)]
    head_mask = None if mask is None else mask[:, :7]
    tail_mask = None if mask is None else mask[:, 7:]
    results = {}
    for validate in (True, False):
        common = dict(window=4, chunk_size=3, output_final_state=True, validate=validate)
        first, state = hybrid_attention(*head, balance, attention_mask=head_mask, **common)
        second, final = hybrid_attention(
            *tail, balance, attention_mask=tail_mask, initial_state=state, **common
        )
        results[validate] = (first, second, final)
    torch.testing.assert_close(results[False][0], results[True][0], rtol=0, atol=0)
    torch.testing.assert_close(results[False][1], results[True][1], rtol=0, atol=0)
    assert_states_close(results[False][2], results[True][2], rel=0)
