"""KIVI quantization of keys (per channel) and values (per token): the fast paths equal their written-out twins
exactly, every element comes back within half its group's scale, 4-bit codes pack two per byte, and the bytes per
token are those the tensors hold."""

from __future__ import annotations

import functools

import pytest
import torch

from headkit.layers.cache import state_tensors
from headkit.ops.hybrid import (
    HybridRingState,
    hybrid_attention,
    hybrid_attention_step_,
    ring_from_state,
    sparse_hybrid_attention,
    sparse_hybrid_attention_step_,
)
from headkit.ops.hybrid.quantized import (
    dequantized_ring,
    naive_dequantized_ring,
    naive_store_ring_step_,
    store_ring_step_,
)
from headkit.ops.quantized_cache import (
    append_quantized,
    dequantize_keys,
    dequantize_values,
    empty_quantized,
    naive_dequantize_keys,
    naive_dequantize_values,
    naive_pack_codes,
    naive_quantize_keys,
    naive_quantize_tokens,
    naive_quantize_values,
    naive_store_token_,
    pack_codes,
    quantize_keys,
    quantize_tokens,
    quantize_values,
    quantized_bytes_per_token,
    store_token_,
    stored_scale,
    tokens_to_quantize,
    unpack_codes,
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def kv(dtype=torch.float32, batch=2, heads=3, tokens=12, width=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, tokens, width, generator=generator, dtype=torch.float64)
    x[..., 3] += 6.0  # an outlier channel, as keys have (KIVI's motivation)
    return x.to(dtype)


def same(first, second):
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [1, 4, 16])
def test_quantize_and_dequantize_equal_their_naive_twins_exactly(bits, dtype, group_size):
    x = kv(dtype, tokens=16)
    keys = quantize_keys(x, bits=bits, group_size=group_size)
    assert same(keys, naive_quantize_keys(x, bits=bits, group_size=group_size))
    assert torch.equal(
        dequantize_keys(keys, bits=bits, group_size=group_size),
        naive_dequantize_keys(keys, bits=bits, group_size=group_size),
    )
    values = quantize_values(x, bits=bits, group_size=group_size)
    assert same(values, naive_quantize_values(x, bits=bits, group_size=group_size))
    assert torch.equal(
        dequantize_values(values, bits=bits, group_size=group_size),
        naive_dequantize_values(values, bits=bits, group_size=group_size),
    )
    # shapes: codes packed along the channels, one (scale, zero) per channel per token group / per token group
    assert keys.codes.shape == (2, 3, 16, 16 * bits // 8) and keys.codes.dtype == torch.uint8
    assert keys.scale.shape == keys.zero.shape == (2, 3, 16 // group_size, 16)
    assert values.scale.shape == values.zero.shape == (2, 3, 16, 16 // group_size)
    assert keys.scale.dtype == values.zero.dtype == dtype


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_element_comes_back_within_half_its_groups_scale(bits, dtype):
    x = kv(dtype, tokens=24)
    group = 8
    keys = quantize_keys(x, bits=bits, group_size=group)
    values = quantize_values(x, bits=bits, group_size=group)
    cases = [
        (dequantize_keys(keys, bits=bits, group_size=group), keys.scale.repeat_interleave(group, dim=-2)),
        (
            dequantize_values(values, bits=bits, group_size=group),
            values.scale.repeat_interleave(group, dim=-1),
        ),
    ]
    for restored, scale in cases:
        error = (restored.double() - x.double()).abs()
        # |X − X'| ≤ s/2 in the working precision (float32 rounding allowed for), then X' is rounded to the output
        # dtype: half its ulp on top in bfloat16 (2⁻⁹ relative).
        rounding = 0.0 if dtype != torch.bfloat16 else restored.double().abs() * 2.0**-8
        bound = scale.double() / 2 * (1 + 1e-6) + 1e-6 * x.double().abs() + rounding
        assert (error <= bound).all()
        assert error.max() > 0  # something was quantized
    if dtype == torch.float32:  # 16 times finer with 4 more bits
        fine = (
            dequantize_keys(quantize_keys(x, bits=8, group_size=group), bits=8, group_size=group) - x
        ).abs()
        coarse = (
            dequantize_keys(quantize_keys(x, bits=4, group_size=group), bits=4, group_size=group) - x
        ).abs()
        assert fine.max() * 8 < coarse.max()


@pytest.mark.parametrize("bits", [8, 4])
def test_each_group_spans_the_whole_code_range_and_a_constant_group_is_exact(bits):
    x = kv(tokens=8)
    keys = quantize_keys(x, bits=bits, group_size=4)
    codes = unpack_codes(keys.codes, bits).unflatten(-2, (2, 4))  # [B, H, groups, 4 tokens, D]
    assert (codes.amin(dim=-2) == 0).all() and (codes.amax(dim=-2) == 2**bits - 1).all()
    constant = torch.full((1, 1, 4, 8), 0.37)
    for quantize, dequantize in [(quantize_keys, dequantize_keys), (quantize_values, dequantize_values)]:
        quantized = quantize(constant, bits=bits, group_size=4)
        assert (quantized.scale == 0).all()
        assert torch.equal(dequantize(quantized, bits=bits, group_size=4), constant)


def test_a_stored_scale_is_rounded_up_so_the_largest_code_does_not_clamp():
    exact = torch.tensor([1.0 / 3.0, 0.1, 2.0**-20], dtype=torch.float32)
    stored = stored_scale(exact, torch.bfloat16)
    assert stored.dtype == torch.bfloat16 and (stored.float() >= exact).all()
    assert ((stored.float() - exact) / exact < 2.0**-7).all()  # one bfloat16 step at most
    assert torch.equal(stored_scale(exact, torch.float32), exact)


def test_four_bit_codes_pack_two_per_byte_low_nibble_first():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 10), generator=generator, dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert packed.shape == (3, 5, 5) and packed.dtype == torch.uint8
    assert torch.equal(packed, naive_pack_codes(codes, 4))
    assert torch.equal(unpack_codes(packed, 4), codes)
    assert pack_codes(torch.tensor([[1, 2]]), 4).item() == 1 + 16 * 2
    wide = torch.randint(0, 256, (4, 6), generator=generator).to(torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(wide, 8), 8), wide)


def test_appending_quantized_tokens_equals_quantizing_them_together():
    x = kv(tokens=12)
    for quantize, options in [
        (quantize_keys, {"per_channel": True}),
        (quantize_values, {"per_channel": False}),
    ]:
        start = empty_quantized(x, bits=4, group_size=4, **options)
        grown = append_quantized(start, quantize(x[..., :8, :], bits=4, group_size=4))
        grown = append_quantized(grown, quantize(x[..., 8:, :], bits=4, group_size=4))
        assert same(grown, quantize(x, bits=4, group_size=4))


@pytest.mark.parametrize(
    ("tokens", "group_size", "residual", "expected"),
    [(0, 4, 0, 0), (3, 4, 0, 0), (4, 4, 0, 4), (11, 4, 0, 8), (11, 4, 3, 8), (11, 4, 4, 4), (7, 4, 4, 0)],
)
def test_tokens_to_quantize_moves_whole_groups_and_keeps_the_residual(tokens, group_size, residual, expected):
    assert tokens_to_quantize(tokens, group_size=group_size, residual=residual) == expected
    left = tokens - expected
    assert left < residual + group_size and (left >= residual or expected == 0)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("dtype", "bytes_per_number"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_bytes_per_token_are_the_bytes_the_quantized_tensors_hold(bits, dtype, bytes_per_number):
    tokens, width, group = 32, 16, 8
    x = kv(dtype, batch=1, heads=1, tokens=tokens, width=width)
    held = sum(
        t.numel() * t.element_size()
        for quantized in (
            quantize_keys(x, bits=bits, group_size=group),
            quantize_values(x, bits=bits, group_size=group),
        )
        for t in quantized
    )
    per_token = quantized_bytes_per_token(
        width, bits=bits, group_size=group, bytes_per_number=bytes_per_number
    )
    assert per_token * tokens == held
    # SmolLM2's head (64 wide) in groups of 32, bfloat16: 144 bytes at 8 bits, 80 at 4, against 256 unquantized
    assert quantized_bytes_per_token(64, bits=8, group_size=32) == 144
    assert quantized_bytes_per_token(64, bits=4, group_size=32) == 80


def test_bad_arguments_are_named():
    x = kv(tokens=6)
    with pytest.raises(ValueError, match=r"bits must be one of \{4, 8\}, got 3"):
        quantize_keys(x, bits=3, group_size=2)
    with pytest.raises(ValueError, match="whole groups of 4 tokens, got 6"):
        quantize_keys(x, bits=8, group_size=4)
    with pytest.raises(ValueError, match="groups of 5 channels, which must divide 16"):
        quantize_values(x, bits=8, group_size=5)
    with pytest.raises(ValueError, match="even width"):
        quantize_values(x[..., :15], bits=4, group_size=5)
    with pytest.raises(ValueError, match="group_size"):
        quantize_values(x, bits=8, group_size=0)
    with pytest.raises(ValueError, match="residual must be a non-negative integer"):
        tokens_to_quantize(4, group_size=2, residual=-1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_already_stored_keeps_its_codes_and_a_new_one_is_quantized_per_token(bits, dtype):
    """quantize_tokens equals its twin exactly; a token equal to a stored one, dequantized, takes its codes (so it
    dequantizes to itself); any other is quantize_values' per-token quantization."""
    stored_tokens = kv(dtype, tokens=10, seed=1)
    stored = quantize_tokens(stored_tokens, bits=bits, group_size=8)
    assert same(stored, quantize_values(stored_tokens, bits=bits, group_size=8))
    back = dequantize_values(stored, bits=bits, group_size=8)
    x = kv(dtype, tokens=6, seed=2)
    x[:, :, 1], x[:, :, 4] = (
        back[:, :, 7],
        back[:, :, 0],
    )  # moved between slots, as a window key becomes a sink
    x[0, 1, 2] = back[1, 1, 3]  # another row's token: not that row's stored token
    mine = quantize_tokens(x, bits=bits, group_size=8, stored=stored, stored_values=back)
    assert same(mine, naive_quantize_tokens(x, bits=bits, group_size=8, stored=stored, stored_values=back))
    again = dequantize_values(mine, bits=bits, group_size=8)
    assert torch.equal(again[:, :, 1], x[:, :, 1]) and torch.equal(again[:, :, 4], x[:, :, 4])
    fresh = quantize_values(x, bits=bits, group_size=8)
    for field, expected in zip(mine, fresh, strict=True):
        for token in (0, 2, 3, 5):
            assert torch.equal(field[1:, :, token], expected[1:, :, token])
        assert torch.equal(field[0, 1, 2], expected[0, 1, 2])


def test_quantizing_a_dequantized_token_again_moves_it():
    """Why a stored token keeps its codes: quantized again from its bfloat16 numbers, some codes move."""
    x = kv(torch.bfloat16, tokens=64, seed=3)
    back = dequantize_values(quantize_values(x, bits=8, group_size=8), bits=8, group_size=8)
    twice = dequantize_values(quantize_values(back, bits=8, group_size=8), bits=8, group_size=8)
    assert not torch.equal(twice, back)
    kept = quantize_tokens(
        back, bits=8, group_size=8, stored=quantize_values(x, bits=8, group_size=8), stored_values=back
    )
    assert torch.equal(dequantize_values(kept, bits=8, group_size=8), back)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_stored_into_its_slot_is_quantized_on_its_own_as_the_twin_does(bits, dtype):
    x = kv(dtype)
    stored = [quantize_values(torch.zeros_like(x), bits=bits, group_size=8) for _ in range(2)]
    slot = torch.tensor(5)
    store_token_(stored[0], x, slot, bits=bits, group_size=8)
    naive_store_token_(stored[1], x, slot, bits=bits, group_size=8)
    alone = quantize_values(x[:, :, 5:6], bits=bits, group_size=8)
    for mine, twin, own in zip(*stored, alone, strict=True):
        assert torch.equal(mine, twin)
        assert torch.equal(mine[:, :, 5:6], own)
        assert not mine[:, :, :5].any() and not mine[:, :, 6:].any()  # the other slots untouched


def stored_ring(ring, bits, full_window=False):
    """`ring` with its exact fields quantized per token, as a compressed cache stores them after a prompt (the
    window's left as they are with `full_window`)."""

    def quantized(x):
        return quantize_values(x, bits=bits, group_size=8)

    if isinstance(ring, HybridRingState):
        if full_window:
            return ring._replace(keys=ring.keys.clone(), values=ring.values.clone())
        return ring._replace(keys=quantized(ring.keys), values=quantized(ring.values))
    names = ("sink_keys", "sink_values", "sparse_keys", "sparse_values")
    return ring._replace(
        window=stored_ring(ring.window, bits, full_window),
        **{name: quantized(getattr(ring, name)) for name in names},
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: a requantized token would move
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "window, sinks, budget, question",
    [
        (6, 2, 3, False),
        (6, 1, 4, True),
        (1, 2, 3, False),
        (1, 0, 2, True),
        (5, 0, 0, False),
        (4, 3, 0, False),
    ],
    ids=["recall", "question", "window-1-recall", "window-1-question", "plain", "sinks-only"],
)
@pytest.mark.parametrize("full_window", [False, True], ids=["", "full-precision-window"])
def test_the_quantized_ring_step_stores_the_codes_of_the_eager_caches_rule(
    dtype, bits, window, sinks, budget, question, full_window
):
    """store_ring_step_ (the new token quantized into its slot, a moved key's codes copied) against its twin, the
    eager cache's rule (every exact token requantized, a stored one matched to its codes): the same codes, scales
    and zero points, bit for bit, step after step — keys entering sinks and kept slots included. With the window
    in full precision (`full_window`): the window as the unquantized step leaves it, and a key that left it
    quantized from its numbers where it entered."""
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, features, prompt, steps = 2, 4, 2, 16, 6, 9, 7
    q, k, v = (torch.randn(batch, h, prompt + steps, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    qf = torch.rand(batch, heads, prompt + steps, features, dtype=dtype)
    kf = torch.rand(batch, kv_heads, prompt + steps, features, dtype=dtype)
    balance = torch.rand(heads, dtype=dtype)
    mask = torch.ones(batch, prompt, dtype=torch.bool)
    mask[0, :3] = False  # left padding: its keys never enter a sink or a kept slot
    first = [x[:, :, :prompt] for x in (q, k, v, qf, kf)]
    if sinks or budget:
        options = {"window": window, "sinks": sinks, "budget": budget}
        _, state = sparse_hybrid_attention(
            *first, balance, attention_mask=mask, output_final_state=True, **options
        )
    else:
        options = {"window": window}
        _, state = hybrid_attention(*first, balance, attention_mask=mask, output_final_state=True, **options)
    mine, twin = (
        stored_ring(ring_from_state(state, prompt), bits, full_window),
        stored_ring(ring_from_state(state, prompt), bits, full_window),
    )
    quantization = {"bits": bits, "group_size": 8}
    plain = ring_from_state(state, prompt)  # unquantized: its window is what a full-precision window holds
    for t in range(prompt, prompt + steps):
        inputs = [x[:, :, t : t + 1] for x in (q, k, v, qf, kf)]
        if sinks or budget:
            scores = torch.zeros(batch, kv_heads, 1) if question else None
            sparse_hybrid_attention_step_(*inputs, balance, plain, key_scores=scores, **options)
        else:
            hybrid_attention_step_(*inputs, balance, plain, **options)
        outputs = []
        for stored, read, store in (
            (mine, functools.partial(dequantized_ring, kept_codes=True), store_ring_step_),
            (twin, naive_dequantized_ring, naive_store_ring_step_),
        ):
            working = read(stored, **quantization)
            if sinks or budget:
                scores = torch.zeros(batch, kv_heads, 1) if question else None
                out = sparse_hybrid_attention_step_(*inputs, balance, working, key_scores=scores, **options)
            else:
                out = hybrid_attention_step_(*inputs, balance, working, **options)
            store(stored, working, **quantization)
            outputs.append(out)
        # The kept keys attended on their codes, c·s + z in float32, against the twin's numbers rounded to the
        # stored dtype: equal within that rounding (bfloat16's 2^-8 relative, on outputs of size ~1).
        tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 1.6e-2}
        torch.testing.assert_close(*outputs, **tolerance)
        for got, want in zip(state_tensors(mine), state_tensors(twin), strict=True):
            assert torch.equal(got, want), t
        if full_window:
            ours, unquantized = (r.window if sinks or budget else r for r in (mine, plain))
            assert torch.equal(ours.keys, unquantized.keys) and torch.equal(ours.values, unquantized.values)
    if sinks:  # the test saw keys move: the sinks filled from the window
        assert bool(mine.sink_keep.all())
