"""Additive attention pooling (headkit.ops.additive) against its naive per-position softmax twin."""

from __future__ import annotations

import pytest
import torch

from headkit.ops.additive import AdditivePoolState, additive_pool, additive_pool_step, naive_additive_pool

BATCH, HEADS, DIM = 2, 2, 3

# (causal, window): bidirectional, global causal, windowed causal; "long" = a window longer than the sequence.
MODES = {
    "bidirectional": (False, None),
    "causal": (True, None),
    "window1": (True, 1),
    "window3": (True, 3),
    "window17": (True, 17),
    "window_long": (True, "long"),
}
# Sequence lengths with the chunk sizes worth running: chunking is moot below 16 positions.
LENGTHS_AND_CHUNKS = [(1, 16), (5, 16), (64, 16), (64, 64), (130, 16), (130, 64)]


def _mode(name: str, seq: int) -> tuple[bool, int | None]:
    causal, window = MODES[name]
    return causal, (seq + 5 if window == "long" else window)


def _inputs(seq: int, seed: int, score_scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, HEADS, seq, DIM, generator=generator)
    scores = score_scale * torch.randn(BATCH, HEADS, seq, generator=generator)
    return x, scores


def _padding_mask(kind: str | None, seq: int) -> torch.Tensor | None:
    """Left padding hides the first seq // 2 + 1 positions of batch 0 (with seq = 130, a whole 64-chunk and
    every position of a 1-token sequence); right padding hides the last seq // 3 + 1 positions of batch 1."""
    if kind is None:
        return None
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    if kind == "left":
        mask[0, : seq // 2 + 1] = 0
    else:
        mask[1, seq - seq // 3 - 1 :] = 0
    return mask


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """Equal up to tol relative to the scale of the expected values (infinities must match exactly)."""
    expected = expected.to(actual.dtype)
    assert actual.shape == expected.shape
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), "finite/non-finite entries differ"
    assert torch.equal(actual[~finite], expected[~finite])
    if finite.any():
        scale = max(1.0, expected[finite].abs().max().item())
        error = (actual[finite] - expected[finite]).abs().max().item()
        assert error <= tol * scale, f"max error {error:.3g} > {tol:.1g} x scale {scale:.3g}"


def _assert_states_close(
    actual: AdditivePoolState | None, expected: AdditivePoolState | None, tol=1e-5
) -> None:
    assert (actual is None) == (expected is None)
    if actual is None:
        return
    for name in AdditivePoolState._fields:
        a, e = getattr(actual, name), getattr(expected, name)
        assert (a is None) == (e is None), name
        if a is not None:
            _assert_close(a, e, tol)


def _state_loss(state: AdditivePoolState | None, generator: torch.Generator) -> torch.Tensor:
    """A random linear function of the finite state entries, so gradients flow through the state too."""
    total = torch.zeros((), dtype=torch.float64)
    for tensor in state or ():
        if tensor is not None:
            finite = torch.where(torch.isfinite(tensor), tensor, 0.0)
            total = total + (finite.double() * torch.randn(finite.shape, generator=generator).double()).sum()
    return total


def _pooled_state_and_grads(fn, dtype, x, scores, initial_state=None, **kwargs):
    """fn on copies of the inputs in dtype: pooled, final state, and the gradients of a random linear loss of
    both w.r.t. x, scores and the initial state's tensors."""
    state_fields = [field for field in initial_state or () if field is not None]
    leaves = [leaf.detach().to(dtype).requires_grad_(True) for leaf in (x, scores, *state_fields)]
    if initial_state is not None:
        copies = iter(leaves[2:])
        initial_state = AdditivePoolState(
            *(None if field is None else next(copies) for field in initial_state)
        )
    pooled, final = fn(leaves[0], leaves[1], initial_state=initial_state, **kwargs)
    generator = torch.Generator().manual_seed(7)
    cotangent = torch.randn(pooled.shape, generator=generator).double()
    loss = (pooled.double() * cotangent).sum() + _state_loss(final, generator)
    return pooled.detach(), final, torch.autograd.grad(loss, leaves)


def _assert_matches_naive(x, scores, tol=1e-5, chunk_size=64, **kwargs):
    """The fast float32 path against the float64 naive twin; returns the fast output and gradients."""
    fast_out, fast_state, fast_grads = _pooled_state_and_grads(
        additive_pool, torch.float32, x, scores, chunk_size=chunk_size, **kwargs
    )
    ref_out, ref_state, ref_grads = _pooled_state_and_grads(
        naive_additive_pool, torch.float64, x, scores, **kwargs
    )
    _assert_close(fast_out, ref_out, tol)
    _assert_states_close(fast_state, ref_state, tol)
    for fast_grad, ref_grad in zip(fast_grads, ref_grads, strict=True):
        _assert_close(fast_grad, ref_grad, tol)
    return fast_out, fast_grads


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize(("seq", "chunk_size"), LENGTHS_AND_CHUNKS)
@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_states_and_gradients_match_naive(mode, seq, chunk_size, padding):
    causal, window = _mode(mode, seq)
    x, scores = _inputs(seq, seed=seq)
    _assert_matches_naive(
        x,
        scores,
        causal=causal,
        window=window,
        attention_mask=_padding_mask(padding, seq),
        output_final_state=True,
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "window3", "window17"])
def test_float64_is_exact_to_float64_precision(mode):
    # In float64 only the algorithm can differ from the reference, not float32 rounding.
    causal, window = _mode(mode, 130)
    x, scores = _inputs(130, seed=1)
    x, scores = x.double(), scores.double()
    mask = _padding_mask("left", 130)
    fast, fast_state = additive_pool(
        x, scores, causal=causal, window=window, attention_mask=mask, output_final_state=True, chunk_size=16
    )
    ref, ref_state = naive_additive_pool(
        x, scores, causal=causal, window=window, attention_mask=mask, output_final_state=True
    )
    _assert_close(fast, ref, 1e-12)
    _assert_states_close(fast_state, ref_state, 1e-12)


def _random_state(window: int | None, seed: int) -> AdditivePoolState:
    generator = torch.Generator().manual_seed(seed)
    if window is None:
        log_normalizer = 2 * torch.randn(BATCH, HEADS, generator=generator)
        # One head has seen nothing yet: its (random) pooled field must be ignored.
        log_normalizer[0, 0] = float("-inf")
        pooled = torch.randn(BATCH, HEADS, DIM, generator=generator)
        return AdditivePoolState(log_normalizer=log_normalizer, pooled=pooled)
    recent_scores = 3 * torch.randn(BATCH, HEADS, window - 1, generator=generator)
    recent_scores[0, :, : (window - 1) // 2] = float("-inf")  # slots never filled
    recent_x = torch.randn(BATCH, HEADS, window - 1, DIM, generator=generator)
    return AdditivePoolState(recent_scores=recent_scores, recent_x=recent_x)


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("seq", [5, 70])
@pytest.mark.parametrize("mode", ["bidirectional", "causal", "window1", "window3", "window17"])
def test_initial_state_matches_naive_including_state_gradients(mode, seq, padding):
    causal, window = _mode(mode, seq)
    state = _random_state(window, seed=seq)
    x, scores = _inputs(seq, seed=3)
    _assert_matches_naive(
        x,
        scores,
        causal=causal,
        window=window,
        attention_mask=_padding_mask(padding, seq),
        initial_state=state,
        output_final_state=True,
        chunk_size=16,
    )


def _run_steps(x, scores, window, state=None):
    outputs = []
    for t in range(x.shape[2]):
        out, state = additive_pool_step(x[:, :, t : t + 1], scores[:, :, t : t + 1], state, window=window)
        outputs.append(out)
    return torch.cat(outputs, dim=2), state


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("window", [None, 1, 3, 17])
def test_recurrent_steps_equal_parallel_forward(window, padding):
    seq = 40
    x, scores = _inputs(seq, seed=5)
    mask = _padding_mask(padding, seq)
    parallel, parallel_state = additive_pool(
        x, scores, causal=True, window=window, attention_mask=mask, output_final_state=True, chunk_size=16
    )
    step_scores = scores if mask is None else scores.masked_fill(~mask.bool()[:, None, :], float("-inf"))
    stepped, stepped_state = _run_steps(x, step_scores, window)
    _assert_close(stepped, parallel)
    _assert_states_close(stepped_state, parallel_state)


@pytest.mark.parametrize("window", [None, 3, 17])
def test_steps_continue_a_prefill_exactly(window):
    x, scores = _inputs(50, seed=6)
    full, full_state = additive_pool(x, scores, causal=True, window=window, output_final_state=True)
    _, prefill_state = additive_pool(
        x[:, :, :30], scores[:, :, :30], causal=True, window=window, output_final_state=True, chunk_size=16
    )
    stepped, stepped_state = _run_steps(x[:, :, 30:], scores[:, :, 30:], window, prefill_state)
    _assert_close(stepped, full[:, :, 30:])
    _assert_states_close(stepped_state, full_state)


def _stepped_pool(
    x, scores, *, window=None, attention_mask=None, initial_state=None, output_final_state=True
):
    """additive_pool's causal result, computed token by token with additive_pool_step (padding as −inf)."""
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask.bool()[:, None, :], float("-inf"))
    return _run_steps(x, scores, window, initial_state)


# Left padding of batch 0 for the first 4 tokens: the first steps pool padding over an empty past (−inf, −inf),
# where a careless online softmax gives NaN values or NaN gradients. Batch 1 stays empty for 3 tokens too.
def _leading_padding_mask(seq: int) -> torch.Tensor:
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[0, :4] = 0
    mask[1, :3] = 0
    mask[1, seq // 2] = 0
    return mask


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("padding", [None, "leading", "right"])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_steps_match_naive_outputs_states_and_gradients(window, padding, initial_state):
    seq = 12
    x, scores = _inputs(seq, seed=14)
    mask = {None: None, "leading": _leading_padding_mask(seq), "right": _padding_mask("right", seq)}[padding]
    kwargs = {
        "window": window,
        "attention_mask": mask,
        "initial_state": _random_state(window, seed=15) if initial_state else None,
    }
    step_out, step_state, step_grads = _pooled_state_and_grads(
        _stepped_pool, torch.float32, x, scores, **kwargs
    )
    ref_out, ref_state, ref_grads = _pooled_state_and_grads(
        naive_additive_pool, torch.float64, x, scores, causal=True, output_final_state=True, **kwargs
    )
    _assert_close(step_out, ref_out)
    _assert_states_close(step_state, ref_state)
    for step_grad, ref_grad in zip(step_grads, ref_grads, strict=True):
        _assert_close(step_grad, ref_grad)


@pytest.mark.parametrize("window", [None, 3])
def test_padding_over_an_empty_past_stays_empty_and_finite(window):
    # Every token padding: the state must stay "nothing seen" (−inf, 0) and no value or gradient becomes NaN.
    x, scores = _inputs(4, seed=16)
    x.requires_grad_(True)
    scores.requires_grad_(True)
    padding_scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool), float("-inf"))
    out, state = _run_steps(x, padding_scores, window)
    assert torch.equal(out, torch.zeros_like(out))
    if window is None:
        assert torch.equal(state.log_normalizer, torch.full((BATCH, HEADS), float("-inf")))
        assert torch.equal(state.pooled, torch.zeros(BATCH, HEADS, DIM))
    grads = torch.autograd.grad((out * 2.0).sum(), (x, scores))
    assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in grads)


def test_global_step_is_the_same_with_and_without_autograd():
    # The step differentiates a clamped log-normaliser and skips the clamp when nothing needs a gradient: both
    # must give bit-identical values, −inf for "nothing seen" included (batch 1 is padding throughout).
    seq = 10
    x, scores = _inputs(seq, seed=17)
    mask = _leading_padding_mask(seq)
    mask[1] = 0
    with torch.no_grad():
        plain_out, plain_state = _stepped_pool(x, scores, attention_mask=mask)
    tracked_out, tracked_state = _stepped_pool(
        x.requires_grad_(True), scores.requires_grad_(True), attention_mask=mask
    )
    assert tracked_out.requires_grad
    assert torch.equal(tracked_out, plain_out)
    assert torch.equal(tracked_state.log_normalizer, plain_state.log_normalizer)
    assert torch.equal(tracked_state.pooled, plain_state.pooled)
    assert torch.equal(plain_state.log_normalizer[1], torch.full((HEADS,), float("-inf")))


@pytest.mark.parametrize("window", [None, 3])
def test_step_dtypes_float64_bf16_and_autocast(window):
    x, scores = _inputs(6, seed=18)
    mask = _leading_padding_mask(6)
    # float64 stays float64 throughout and is exact to float64 precision.
    out64, state64 = _stepped_pool(x.double(), scores.double(), window=window, attention_mask=mask)
    ref64, ref_state64 = naive_additive_pool(
        x.double(), scores.double(), causal=True, window=window, attention_mask=mask, output_final_state=True
    )
    assert out64.dtype == torch.float64
    assert all(tensor.dtype == torch.float64 for tensor in state64 if tensor is not None)
    _assert_close(out64, ref64, 1e-12)
    _assert_states_close(state64, ref_state64, 1e-12)
    # bf16 values: the output comes back in bf16, the scores and pooled vectors are accumulated in float32.
    x16 = x.bfloat16()
    out16, state16 = _run_steps(x16, scores, window)
    assert out16.dtype == torch.bfloat16
    assert (state16.pooled if window is None else state16.recent_scores).dtype == torch.float32
    _assert_close(
        out16.double(),
        naive_additive_pool(x16.double(), scores.double(), causal=True, window=window)[0],
        1e-2,
    )
    # bf16 autocast must leave the float32 accumulation of float32 inputs alone.
    plain, _ = _run_steps(x, scores, window)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_out, _ = _run_steps(x, scores, window)
    assert autocast_out.dtype == torch.float32
    _assert_close(autocast_out, plain, 1e-6)


@pytest.mark.parametrize("split", [1, 17, 99])
@pytest.mark.parametrize("mode", ["bidirectional", "causal", "window1", "window3", "window17"])
def test_prefill_state_continues_a_second_call_exactly(mode, split):
    seq = 100
    causal, window = _mode(mode, seq)
    x, scores = _inputs(seq, seed=8)
    mask = _padding_mask("left", seq)
    kwargs = {"causal": causal, "window": window, "output_final_state": True, "chunk_size": 16}

    def split_run(x, scores):
        first, state = additive_pool(
            x[:, :, :split], scores[..., :split], attention_mask=mask[:, :split], **kwargs
        )
        second, state = additive_pool(
            x[:, :, split:],
            scores[..., split:],
            attention_mask=mask[:, split:],
            initial_state=state,
            **kwargs,
        )
        return (second if not causal else torch.cat([first, second], dim=2)), state

    x.requires_grad_(True)
    scores.requires_grad_(True)
    whole, whole_state = additive_pool(x, scores, attention_mask=mask, **kwargs)
    parts, parts_state = split_run(x, scores)
    _assert_close(parts, whole)
    _assert_states_close(parts_state, whole_state)
    cotangent = torch.randn(whole.shape, generator=torch.Generator().manual_seed(0))
    whole_grads = torch.autograd.grad((whole * cotangent).sum(), (x, scores))
    parts_grads = torch.autograd.grad((parts * cotangent).sum(), (x, scores))
    for parts_grad, whole_grad in zip(parts_grads, whole_grads, strict=True):
        _assert_close(parts_grad, whole_grad)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("window", [None, 3, 17])
def test_outputs_do_not_depend_on_later_tokens(window, chunk_size):
    seq, cut = 100, 37
    x, scores = _inputs(seq, seed=9)
    later_x, later_scores = x.clone(), scores.clone()
    later_x[:, :, cut + 1 :] = 1e3 * torch.randn_like(later_x[:, :, cut + 1 :])
    later_scores[:, :, cut + 1 :] = 1e3
    before = additive_pool(x, scores, causal=True, window=window, chunk_size=chunk_size)[0]
    after = additive_pool(later_x, later_scores, causal=True, window=window, chunk_size=chunk_size)[0]
    _assert_close(after[:, :, : cut + 1], before[:, :, : cut + 1], 1e-6)
    assert not torch.allclose(after[:, :, cut + 1 :], before[:, :, cut + 1 :])


@pytest.mark.parametrize("window", [None, 3])
def test_strided_inputs_give_the_same_result(window):
    # Projections usually arrive as [B, T, H, D] views transposed to [B, H, T, D].
    x, scores = _inputs(48, seed=13)
    strided_x = x.transpose(1, 2).contiguous().transpose(1, 2)
    strided_scores = scores.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided_x.is_contiguous() and not strided_scores.is_contiguous()
    strided = additive_pool(strided_x, strided_scores, causal=True, window=window, chunk_size=16)[0]
    _assert_close(strided, additive_pool(x, scores, causal=True, window=window, chunk_size=16)[0], 1e-6)


def _steep_scores(kind: str, seq: int) -> torch.Tensor:
    positions = torch.arange(seq, dtype=torch.float32)
    profile = {
        "random_1e4": 1e4 * torch.randn(seq, generator=torch.Generator().manual_seed(2)),
        "rising": 100.0 * positions,  # every new token outweighs the whole past
        "falling": -100.0 * positions,  # the first token outweighs everything after it
        "rising_1e4": -1e4 + 2e4 * positions / seq,
        "falling_1e4": 1e4 - 2e4 * positions / seq,
    }[kind]
    return profile.expand(BATCH, HEADS, seq).contiguous()


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("kind", ["random_1e4", "rising", "falling", "rising_1e4", "falling_1e4"])
@pytest.mark.parametrize("mode", ["bidirectional", "causal", "window3", "window17"])
def test_huge_and_steep_scores_are_exact_and_finite(mode, kind, padding):
    seq = 130
    causal, window = _mode(mode, seq)
    x, _ = _inputs(seq, seed=10)
    scores = _steep_scores(kind, seq)
    fast, fast_grads = _assert_matches_naive(
        x,
        scores,
        causal=causal,
        window=window,
        attention_mask=_padding_mask(padding, seq),
        output_final_state=True,
        chunk_size=16,
    )
    assert torch.isfinite(fast).all()
    assert all(torch.isfinite(grad).all() for grad in fast_grads)


def test_a_huge_common_offset_changes_nothing_beyond_its_rounding():
    # scores + 1e4 would overflow exp() unshifted; float32 rounds each shifted score by up to 5e-4, hence 2e-3.
    x, scores = _inputs(130, seed=11)
    for window in (None, 17):
        plain = additive_pool(x, scores, causal=True, window=window, chunk_size=16)[0]
        shifted = additive_pool(x, scores + 1e4, causal=True, window=window, chunk_size=16)[0]
        _assert_close(shifted, plain, 2e-3)


@pytest.mark.parametrize("window", [None, 256])
def test_bf16_autocast_times_100_at_8192_tokens_is_finite_and_accurate(window):
    seq, generator = 8192, torch.Generator().manual_seed(12)
    x = 100 * torch.randn(1, 2, seq, 8, generator=generator)
    scores = 100 * torch.randn(1, 2, seq, generator=generator)
    x16, scores16 = x.bfloat16().requires_grad_(True), scores.bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pooled16, _ = additive_pool(x16, scores16, causal=True, window=window)
        pooled32, _ = additive_pool(x, scores, causal=True, window=window)
    assert pooled16.dtype == torch.bfloat16 and pooled32.dtype == torch.float32
    assert torch.isfinite(pooled16).all()
    grads = torch.autograd.grad(pooled16.float().square().mean(), (x16, scores16))
    assert all(torch.isfinite(grad).all() for grad in grads)
    # Autocast must not leak into the accumulation: float32 inputs give the float32 result.
    _assert_close(pooled32, additive_pool(x, scores, causal=True, window=window)[0])

    x64, scores64 = x16.detach().double(), scores16.detach().double()
    for t in (0, 1, 255, 256, 4000, seq - 1):
        start = 0 if window is None else max(0, t - window + 1)
        expected = (
            torch.softmax(scores64[..., start : t + 1], dim=-1)[..., None, :] @ x64[..., start : t + 1, :]
        )
        _assert_close(pooled16[:, :, t].double(), expected[..., 0, :], 1e-2)


def _bad_calls():
    x, scores = _inputs(6, seed=0)
    good_mask = torch.ones(BATCH, 6, dtype=torch.bool)
    global_state = additive_pool(x, scores, causal=True, output_final_state=True)[1]
    window_state = additive_pool(x, scores, causal=True, window=3, output_final_state=True)[1]
    return {
        "x rank": (lambda: additive_pool(x[0], scores), "^x must have shape"),
        "scores rank": (lambda: additive_pool(x, scores[..., None]), "^scores must"),
        "scores length": (lambda: additive_pool(x, scores[..., :5]), "^scores must"),
        "scores heads": (lambda: additive_pool(x, scores[:, :1]), "^scores must"),
        "empty sequence": (lambda: additive_pool(x[:, :, :0], scores[..., :0]), "^x must hold"),
        "window zero": (lambda: additive_pool(x, scores, causal=True, window=0), "window"),
        "window negative": (lambda: additive_pool(x, scores, causal=True, window=-2), "window"),
        "window float": (lambda: additive_pool(x, scores, causal=True, window=2.5), "window"),
        "bidirectional window": (lambda: additive_pool(x, scores, window=3), "window"),
        "mask shape": (lambda: additive_pool(x, scores, attention_mask=good_mask[:, :5]), "attention_mask"),
        "mask dtype": (lambda: additive_pool(x, scores, attention_mask=good_mask.float()), "attention_mask"),
        "chunk zero": (lambda: additive_pool(x, scores, causal=True, chunk_size=0), "chunk_size"),
        "chunk negative": (lambda: additive_pool(x, scores, causal=True, chunk_size=-4), "chunk_size"),
        "state not a state": (lambda: additive_pool(x, scores, causal=True, initial_state=(1, 2)), "state"),
        "window state for global": (
            lambda: additive_pool(x, scores, causal=True, initial_state=window_state),
            "state",
        ),
        "global state for window": (
            lambda: additive_pool(x, scores, causal=True, window=3, initial_state=global_state),
            "state",
        ),
        "state of another window": (
            lambda: additive_pool(x, scores, causal=True, window=5, initial_state=window_state),
            "state.recent_scores",
        ),
        "state of another batch": (
            lambda: additive_pool(x[:1], scores[:1], causal=True, initial_state=global_state),
            "state.log_normalizer",
        ),
        "step two tokens": (
            lambda: additive_pool_step(x[:, :, :2], scores[..., :2], None),
            r"^x .*\[batch, heads, 1,",
        ),
        "step score shape": (lambda: additive_pool_step(x[:, :, :1], scores[:, :, 0], None), "^score must"),
        "step window state": (
            lambda: additive_pool_step(x[:, :, :1], scores[..., :1], window_state),
            "state",
        ),
        "step window zero": (
            lambda: additive_pool_step(x[:, :, :1], scores[..., :1], None, window=0),
            "window",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_value_error_naming_the_argument(case):
    call, argument = _bad_calls()[case]
    with pytest.raises(ValueError, match=argument):
        call()
