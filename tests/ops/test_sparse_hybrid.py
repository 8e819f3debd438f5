"""Hybrid attention with sinks and a sparse exact cache: the chunked kernel and the decoding step against the
one-token-at-a-time reference (outputs, exact-set membership, states, gradients), over masks, padding, GQA and
the window and budget edges; S = G = 0 is the plain hybrid exactly."""

from __future__ import annotations

import pytest
import torch

from headkit.ops.hybrid import (
    SparseHybridState,
    hybrid_attention,
    hybrid_attention_step_,
    naive_sparse_hybrid_attention,
    ring_from_state,
    sparse_hybrid_attention,
    sparse_hybrid_attention_step_,
    sparse_hybrid_exact_sets,
    sparse_hybrid_state,
    state_from_ring,
)

# (window, sinks, budget, seq, heads, kv_heads, padded)
CASES = [
    (4, 2, 3, 23, 4, 2, False),  # GQA, all three sets
    (1, 0, 2, 17, 4, 2, False),  # window 1, no sinks
    (5, 1, 0, 20, 2, 2, True),  # no cache, padding
    (1, 2, 0, 12, 4, 1, True),  # window 1, sinks only, one key/value head
    (6, 0, 4, 30, 4, 2, True),  # cache only, padding
    (2, 3, 5, 40, 4, 2, True),  # more sinks and cache than window
    (3, 0, 1, 26, 3, 3, False),  # a cache of one
    (8, 2, 6, 7, 4, 2, True),  # the whole sequence inside the window
]


def make_inputs(batch=2, heads=4, kv_heads=2, seq=23, head_dim=8, head_dim_v=6, features=10, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = (
        draw(batch, heads, seq, head_dim),
        draw(batch, kv_heads, seq, head_dim),
        draw(batch, kv_heads, seq, head_dim_v),
    )
    qf = draw(batch, heads, seq, features).softmax(-1)
    kf = draw(batch, kv_heads, seq, features).softmax(-1)
    balance = torch.rand(heads, generator=generator, dtype=torch.float64) * 2 + 0.5
    return q, k, v, qf, kf, balance


def padding_mask(batch, seq):
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[-1, : min(5, seq - 1)] = False  # left padding
    mask[0, seq // 3] = False  # a hole, as a masked token in training
    return mask


def assert_close(actual, expected, rel=1e-9, where=None):
    actual, expected = actual.double(), expected.double()
    if where is not None:
        actual, expected = actual * where, expected * where
    same = actual == expected  # −inf scores of empty slots
    error = torch.where(same, 0.0, (actual - expected).abs())
    scale = torch.where(torch.isfinite(expected), expected.abs(), 0.0)
    bound = rel * max(scale.max().item() if scale.numel() else 1.0, 1.0)
    assert error.numel() == 0 or error.max().item() <= bound, (
        f"max error {error.max().item():.3g} > {bound:.3g}"
    )


def assert_states_close(actual: SparseHybridState, expected: SparseHybridState, rel=1e-9):
    for name in ("keep",):
        assert torch.equal(getattr(actual.window, name), getattr(expected.window, name))
    for name in ("keys", "values", "key_features", "kv", "k_sum"):
        assert_close(getattr(actual.window, name), getattr(expected.window, name), rel)
    assert torch.equal(actual.sink_keep, expected.sink_keep)
    assert torch.equal(actual.sparse_keep, expected.sparse_keep)
    for name in SparseHybridState._fields[1:]:
        if not name.endswith("keep"):
            assert_close(getattr(actual, name), getattr(expected, name), rel)


@pytest.mark.parametrize(("window", "sinks", "budget", "seq", "heads", "kv_heads", "padded"), CASES)
def test_the_chunked_kernel_equals_the_reference(window, sinks, budget, seq, heads, kv_heads, padded):
    q, k, v, qf, kf, balance = make_inputs(heads=heads, kv_heads=kv_heads, seq=seq)
    mask = padding_mask(2, seq) if padded else None
    options = {"window": window, "sinks": sinks, "budget": budget, "attention_mask": mask}
    expected, exact, expected_state = naive_sparse_hybrid_attention(
        q, k, v, qf, kf, balance, output_final_state=True, **options
    )
    real = torch.ones(2, 1, seq, 1, dtype=torch.bool) if mask is None else mask[:, None, :, None]
    for chunk in (1, 4, 64):
        out, state = sparse_hybrid_attention(
            q, k, v, qf, kf, balance, chunk_size=chunk, output_final_state=True, **options
        )
        assert_close(out, expected, where=real)  # a padded query's own output is never used
        assert_states_close(state, expected_state)
    members = sparse_hybrid_exact_sets(k, v, kf, chunk_size=4, **options)
    assert torch.equal(members, exact)


@pytest.mark.parametrize(("window", "sinks", "budget", "seq", "heads", "kv_heads", "padded"), CASES)
def test_exact_sets_are_window_sinks_and_at_most_the_budget(
    window, sinks, budget, seq, heads, kv_heads, padded
):
    _, k, v, _, kf, _ = make_inputs(heads=heads, kv_heads=kv_heads, seq=seq)
    mask = padding_mask(2, seq) if padded else None
    members = sparse_hybrid_exact_sets(
        k, v, kf, window=window, sinks=sinks, budget=budget, attention_mask=mask
    )
    keep = torch.ones(2, seq, dtype=torch.bool) if mask is None else mask
    for b in range(2):
        real = keep[b].nonzero().flatten().tolist()
        for i in range(seq):
            in_window = [j for j in real if i - window < j <= i]
            beyond = members[b, :, i].sum(-1) - len(in_window)
            assert (beyond <= sinks + budget).all()
            # the first S real tokens stay exact (once they exist)
            assert members[b, :, i, [j for j in real[:sinks] if j <= i]].all()
            assert not members[b, :, i, i + 1 :].any()
            assert not members[b, :, i, ~keep[b]].any()


@pytest.mark.parametrize(("window", "sinks", "budget", "seq", "heads", "kv_heads", "padded"), CASES)
def test_decoding_token_by_token_and_in_pieces_continues_the_parallel_form(
    window, sinks, budget, seq, heads, kv_heads, padded
):
    q, k, v, qf, kf, balance = make_inputs(heads=heads, kv_heads=kv_heads, seq=seq)
    mask = padding_mask(2, seq) if padded else None
    options = {"window": window, "sinks": sinks, "budget": budget}
    whole, whole_state = sparse_hybrid_attention(
        q, k, v, qf, kf, balance, attention_mask=mask, chunk_size=4, output_final_state=True, **options
    )
    real = torch.ones(2, 1, seq, 1, dtype=torch.bool) if mask is None else mask[:, None, :, None]

    def part(x, a, b):
        return x[:, :, a:b]

    # one token at a time, from the empty state (the parallel form's for no token)
    _, empty = sparse_hybrid_attention(
        *(part(x, 0, 0) for x in (q, k, v, qf, kf)), balance, output_final_state=True, **options
    )
    ring, outputs = ring_from_state(empty, 0), []
    for t in range(seq):
        piece = [part(x, t, t + 1) for x in (q, k, v, qf, kf)]
        out = sparse_hybrid_attention_step_(
            *piece, balance, ring, attention_mask=None if mask is None else mask[:, t : t + 1], **options
        )
        outputs.append(out)
    assert_close(torch.cat(outputs, 2), whole, where=real)
    assert_states_close(state_from_ring(ring), whole_state)
    # uneven pieces: a prefill, a few tokens, the rest
    cuts = [0, seq // 2, seq // 2 + 3, seq]
    state, outputs = None, []
    for a, b in zip(cuts, cuts[1:], strict=False):
        if a == b:
            continue
        piece = [part(x, a, b) for x in (q, k, v, qf, kf)]
        out, state = sparse_hybrid_attention(
            *piece,
            balance,
            attention_mask=None if mask is None else mask[:, a:b],
            chunk_size=3,
            initial_state=state,
            output_final_state=True,
            **options,
        )
        outputs.append(out)
    assert_close(torch.cat(outputs, 2), whole, where=real)
    assert_states_close(state, whole_state)


@pytest.mark.parametrize(("window", "sinks", "budget"), [(4, 2, 3), (1, 0, 2), (3, 2, 0), (2, 3, 5)])
def test_gradients_equal_the_reference(window, sinks, budget):
    inputs = [x.clone().requires_grad_(True) for x in make_inputs(seq=21)]
    mask = padding_mask(2, 21)
    options = {"window": window, "sinks": sinks, "budget": budget, "attention_mask": mask}
    weights = torch.randn(2, 4, 21, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    weights = weights * mask[:, None, :, None]
    out, _ = sparse_hybrid_attention(*inputs, chunk_size=4, **options)
    fast = torch.autograd.grad((out * weights).sum(), inputs)
    expected, _, _ = naive_sparse_hybrid_attention(*inputs, **options)
    slow = torch.autograd.grad((expected * weights).sum(), inputs)
    for got, want in zip(fast, slow, strict=True):
        assert_close(got, want)
    assert fast[1].abs().sum() > 0 and fast[4].abs().sum() > 0


@pytest.mark.parametrize("padded", [False, True])
def test_no_sinks_and_no_cache_is_the_plain_hybrid_exactly(padded):
    q, k, v, qf, kf, balance = make_inputs(seq=25)
    q, k, v, qf, kf, balance = (x.float() for x in (q, k, v, qf, kf, balance))
    mask = padding_mask(2, 25) if padded else None
    options = {"window": 5, "attention_mask": mask, "chunk_size": 4, "output_final_state": True}
    plain, plain_state = hybrid_attention(q, k, v, qf, kf, balance, **options)
    out, state = sparse_hybrid_attention(q, k, v, qf, kf, balance, sinks=0, budget=0, **options)
    assert torch.equal(out, plain)
    for got, want in zip(state.window, plain_state, strict=True):
        assert torch.equal(got, want)
    step = [x[:, :, :1] for x in (q, k, v, qf, kf)]
    one = None if mask is None else mask[:, :1]
    plain_ring, ring = ring_from_state(plain_state, 25), ring_from_state(state, 25)
    plain_step = hybrid_attention_step_(*step, balance, plain_ring, window=5, attention_mask=one)
    sparse_step = sparse_hybrid_attention_step_(
        *step, balance, ring, window=5, sinks=0, budget=0, attention_mask=one
    )
    assert torch.equal(plain_step, sparse_step)
    for got, want in zip(ring.window, plain_ring, strict=True):
        assert torch.equal(got, want)


def test_the_cache_keeps_what_the_linear_state_recalls_worst():
    # Every key is the same except one, whose value is far off: once it leaves the window it is the one kept.
    q, k, v, qf, kf, balance = make_inputs(batch=1, heads=2, kv_heads=1, seq=30)
    k[:], kf[:] = k[:, :, :1], kf[:, :, :1]
    v[:] = v[:, :, :1]
    v[:, :, 7] += 50.0
    members = sparse_hybrid_exact_sets(k, v, kf, window=4, sinks=0, budget=1)
    assert members[0, 0, 11:, 7].all()  # beyond the window (from query 11), key 7 stays exact
    for i in range(11, 30):
        beyond = members[0, 0, i, : i - 3].nonzero().flatten().tolist()
        assert beyond == [7]


def test_float32_and_autocast_agree_with_float64():
    q, k, v, qf, kf, balance = make_inputs(seq=33)
    options = {"window": 4, "sinks": 1, "budget": 3, "chunk_size": 8}
    exact, _ = sparse_hybrid_attention(q, k, v, qf, kf, balance, **options)
    single, _ = sparse_hybrid_attention(*(x.float() for x in (q, k, v, qf, kf, balance)), **options)
    assert single.dtype == torch.float32
    assert_close(single, exact, rel=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sinks": -1}, "sinks must be a non-negative integer"),
        ({"budget": 1.5}, "budget must be a non-negative integer"),
        ({"window": 0}, "window"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"initial_state": (1, 2)}, "SparseHybridState"),
    ],
)
def test_bad_arguments_are_named(change, message):
    q, k, v, qf, kf, balance = make_inputs(seq=6)
    options = {"window": 3, "sinks": 1, "budget": 2} | change
    with pytest.raises(ValueError, match=message):
        sparse_hybrid_attention(q, k, v, qf, kf, balance, **options)


def test_a_state_of_other_sizes_is_refused():
    q, k, v, qf, kf, balance = make_inputs(seq=6)
    _, state = sparse_hybrid_attention(
        q, k, v, qf, kf, balance, window=3, sinks=1, budget=2, output_final_state=True
    )
    with pytest.raises(ValueError, match="sparse_keys must have shape"):
        sparse_hybrid_attention_step_(
            *(x[:, :, :1] for x in (q, k, v, qf, kf)), balance, ring_from_state(state, 6), window=3, sinks=1,
            budget=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="SparseHybridRingState"):
        sparse_hybrid_attention_step_(
            *(x[:, :, :1] for x in (q, k, v, qf, kf)), balance, state, window=3, sinks=1, budget=2
        )


# -- given scores (the question's choice, headkit.ops.key_selection) --


def given_scores(batch, kv_heads, seq, seed=3):
    return torch.rand(
        batch, kv_heads, seq, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )


@pytest.mark.parametrize(("window", "sinks", "budget", "seq", "heads", "kv_heads", "padded"), CASES)
def test_given_scores_chunked_equal_the_reference(window, sinks, budget, seq, heads, kv_heads, padded):
    q, k, v, qf, kf, balance = make_inputs(heads=heads, kv_heads=kv_heads, seq=seq)
    mask = padding_mask(2, seq) if padded else None
    scores = given_scores(2, kv_heads, seq)
    options = {
        "window": window,
        "sinks": sinks,
        "budget": budget,
        "attention_mask": mask,
        "key_scores": scores,
    }
    expected, _, expected_state = naive_sparse_hybrid_attention(
        q, k, v, qf, kf, balance, output_final_state=True, **options
    )
    real = torch.ones(2, 1, seq, 1, dtype=torch.bool) if mask is None else mask[:, None, :, None]
    for chunk in (1, 5, 64):
        out, state = sparse_hybrid_attention(
            q, k, v, qf, kf, balance, chunk_size=chunk, output_final_state=True, **options
        )
        assert_close(out, expected, where=real)
        assert_states_close(state, expected_state)
    if budget:
        # The cache holds the best-scored real keys that left the window (sinks aside).
        keep = torch.ones(2, seq, dtype=torch.bool) if mask is None else mask
        for b in range(2):
            real_keys = keep[b].nonzero().flatten().tolist()
            left = [j for j in real_keys[sinks:] if j <= seq - window]
            for h in range(kv_heads):
                best = sorted(left, key=lambda j: -float(scores[b, h, j]))[:budget]
                kept = state.sparse_keys[b, h][state.sparse_keep[b, h]]
                assert kept.shape[0] == len(best)
                assert torch.equal(kept, k[b, h, sorted(best)])


@pytest.mark.parametrize(("window", "sinks", "budget", "seq", "heads", "kv_heads", "padded"), CASES)
@pytest.mark.parametrize("selection", ["question", "recall"])
def test_the_state_without_outputs_is_the_references_final_state(
    window, sinks, budget, seq, heads, kv_heads, padded, selection
):
    """A prompt prefilled in full (SnapKV) keeps the state the op leaves: sparse_hybrid_state against the
    one-token-at-a-time reference's final state, given scores or the recall error."""
    if sinks + budget == 0:
        pytest.skip("the plain hybrid: no sparse state")
    q, k, v, qf, kf, balance = make_inputs(heads=heads, kv_heads=kv_heads, seq=seq)
    mask = padding_mask(2, seq) if padded else None
    options = {"window": window, "sinks": sinks, "budget": budget, "attention_mask": mask}
    if selection == "question":
        options["key_scores"] = given_scores(2, kv_heads, seq)
    _, _, expected = naive_sparse_hybrid_attention(
        q, k, v, qf, kf, balance, output_final_state=True, **options
    )
    for chunk in (1, 5, 64):
        assert_states_close(sparse_hybrid_state(k, v, kf, chunk_size=chunk, **options), expected)


def test_the_state_without_outputs_needs_sinks_or_a_budget():
    _, k, v, _, kf, _ = make_inputs()
    with pytest.raises(ValueError, match="sinks or a budget"):
        sparse_hybrid_state(k, v, kf, window=3, sinks=0, budget=0)


@pytest.mark.parametrize(("window", "sinks", "budget"), [(4, 2, 3), (1, 0, 2), (3, 1, 6)])
def test_a_prompt_with_given_scores_then_decoding_continues_as_the_reference(window, sinks, budget):
    # The prompt's keys carry the question's scores; the keys still in its window at its end and every decoded
    # key score 0: they fill empty slots only, the question's choice stays.
    seq, prompt = 26, 19
    q, k, v, qf, kf, balance = make_inputs(seq=seq)
    scores = given_scores(2, 2, seq)
    scores[:, :, prompt - (window - 1) :] = 0
    options = {"window": window, "sinks": sinks, "budget": budget}
    expected, _, expected_state = naive_sparse_hybrid_attention(
        q, k, v, qf, kf, balance, output_final_state=True, key_scores=scores, **options
    )
    out, state = sparse_hybrid_attention(
        *(x[:, :, :prompt] for x in (q, k, v, qf, kf)), balance, chunk_size=4, output_final_state=True,
        key_scores=scores[:, :, :prompt], **options,
    )  # fmt: skip
    outputs, ring = [out], ring_from_state(state, prompt)
    for t in range(prompt, seq):
        outputs.append(
            sparse_hybrid_attention_step_(
                *(x[:, :, t : t + 1] for x in (q, k, v, qf, kf)),
                balance,
                ring,
                key_scores=torch.zeros(2, 2, 1, dtype=torch.float64),
                **options,
            )  # fmt: skip
        )
    assert_close(torch.cat(outputs, 2), expected)
    assert_states_close(state_from_ring(ring), expected_state)


def test_gradients_with_given_scores_equal_the_reference():
    inputs = [x.clone().requires_grad_(True) for x in make_inputs(seq=21)]
    options = {"window": 3, "sinks": 1, "budget": 4, "key_scores": given_scores(2, 2, 21)}
    weights = torch.randn(2, 4, 21, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out, _ = sparse_hybrid_attention(*inputs, chunk_size=4, **options)
    fast = torch.autograd.grad((out * weights).sum(), inputs)
    expected, _, _ = naive_sparse_hybrid_attention(*inputs, **options)
    slow = torch.autograd.grad((expected * weights).sum(), inputs)
    for got, want in zip(fast, slow, strict=True):
        assert_close(got, want)


def test_key_scores_of_the_wrong_shape_are_refused():
    q, k, v, qf, kf, balance = make_inputs(seq=8)
    with pytest.raises(ValueError, match="key_scores must be a tensor of shape"):
        sparse_hybrid_attention(
            q, k, v, qf, kf, balance, window=2, sinks=0, budget=2, key_scores=torch.zeros(2, 2, 7)
        )


# (window, sinks, budget, prompt, selection): prompts that leave the sink and cache slots partly empty, and ones
# that fill them; the question's scores (ties at 0 while decoding) and LoLA's recall error.
RING_CASES = [
    (4, 2, 3, 19, "recall"),
    (4, 2, 3, 19, "question"),
    (1, 0, 2, 3, "recall"),  # window 1: the new key leaves at once; slots still empty
    (1, 1, 2, 9, "question"),
    (3, 2, 0, 4, "recall"),  # sinks only, filled while decoding
    (2, 0, 5, 5, "question"),  # empty cache slots filled by decoded keys (score 0 beats −inf)
    (6, 3, 6, 14, "recall"),
]


@pytest.mark.parametrize(("window", "sinks", "budget", "prompt", "selection"), RING_CASES)
def test_the_step_continues_a_padded_prompt_as_the_reference(window, sinks, budget, prompt, selection):
    seq = 30
    q, k, v, qf, kf, balance = make_inputs(seq=seq)
    mask = torch.cat([padding_mask(2, prompt), torch.ones(2, seq - prompt, dtype=torch.bool)], dim=1)
    options = {"window": window, "sinks": sinks, "budget": budget}
    scores = given_scores(2, 2, seq)
    scores[:, :, prompt - (window - 1) :] = 0  # what is still in the window at the prompt's end scores 0
    prefill = {"key_scores": scores[:, :, :prompt]} if selection == "question" else {}
    expected, _, expected_state = naive_sparse_hybrid_attention(
        q, k, v, qf, kf, balance, attention_mask=mask, output_final_state=True, **options,
        **({"key_scores": scores} if selection == "question" else {}),
    )  # fmt: skip
    _, state = sparse_hybrid_attention(
        *(x[:, :, :prompt] for x in (q, k, v, qf, kf)), balance, chunk_size=4, output_final_state=True,
        attention_mask=mask[:, :prompt], **options, **prefill,
    )  # fmt: skip
    ring = ring_from_state(state, prompt)
    assert_states_close(state_from_ring(ring), state, rel=0)
    step = {"key_scores": torch.zeros(2, 2, 1, dtype=torch.float64)} if selection == "question" else {}
    outputs = []
    for t in range(prompt, seq):
        inputs = [x[:, :, t : t + 1] for x in (q, k, v, qf, kf)]
        outputs.append(sparse_hybrid_attention_step_(*inputs, balance, ring, **options, **step))
    assert_close(torch.cat(outputs, 2), expected[:, :, prompt:])
    assert_states_close(state_from_ring(ring), expected_state)
    assert int(ring.window.seen) == seq
    # The slots were replaced in place: some kept key sits out of the order it entered in.
    if budget and selection == "recall":
        assert bool((ring.sparse_order.diff(dim=2) < 0).any())


def test_a_compiled_step_reads_bfloat16_sets_as_the_eager_matmuls_do():
    """Compiled, the exact sets stored in bfloat16 are scored and summed by products reduced in float32 that
    read each key in its own dtype (no float32 copy of the window per step); eager, by matmuls on float32
    copies. The two agree to float32's rounding, with visible and hidden keys."""
    from headkit.ops.hybrid.step import attend_one_token

    torch.manual_seed(0)
    batch, kv_heads, groups, dim, features = 3, 2, 3, 16, 8
    q = torch.randn(batch, kv_heads * groups, 1, dim)
    qf = torch.rand(batch, kv_heads * groups, 1, features)
    balance = torch.rand(kv_heads * groups)
    sets = []
    for tokens in (7, 1, 20):
        visible = torch.rand(batch, kv_heads, 1, tokens) > 0.3
        visible[..., 0] = True
        keys, values = (torch.randn(batch, kv_heads, tokens, dim).bfloat16() for _ in range(2))
        sets.append((keys, values, visible))
    kv = torch.randn(batch, kv_heads, features, dim)
    k_sum = torch.rand(batch, kv_heads, features)

    def step(q, qf, balance, sets, kv, k_sum):
        return attend_one_token(q, qf, balance, sets, kv, k_sum, scale=dim**-0.5, eps=1e-6)

    eager = step(q, qf, balance, sets, kv, k_sum)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(q, qf, balance, sets, kv, k_sum)
    float64 = step(
        q.double(), qf.double(), balance.double(), [(k.double(), v.double(), m) for k, v, m in sets],
        kv.double(), k_sum.double(),
    )  # fmt: skip
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled.double(), float64, rtol=1e-5, atol=1e-5)
