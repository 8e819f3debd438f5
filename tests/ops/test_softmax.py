import pytest
import torch

from headkit.ops import softmax_attention


def assert_outputs_and_gradients_close(out, inputs, ref, ref_inputs, *, outputs=1e-5, gradients=1e-5):
    """`out` against the reference `ref` (in the reference's dtype), and their gradients with respect to `inputs`
    and `ref_inputs` under one random cotangent, each within its tolerance (absolute and relative)."""
    torch.testing.assert_close(out.to(ref.dtype), ref, atol=outputs, rtol=outputs)
    cotangent = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, cotangent.to(out.dtype))
    want = torch.autograd.grad(ref, ref_inputs, cotangent)
    for got_grad, want_grad in zip(grads, want, strict=True):
        torch.testing.assert_close(got_grad.to(want_grad.dtype), want_grad, atol=gradients, rtol=gradients)


def naive_softmax_attention(q, k, v, *, causal=False, key_mask=None, scale=None):
    """Explicit scores, masks and softmax, with key/value heads repeated by hand."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = scale * q @ k.transpose(-1, -2)
    q_len, kv_len = q.shape[2], k.shape[2]
    keep = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        keep = keep.tril(kv_len - q_len)
    keep = keep[None, None].expand(q.shape[0], 1, q_len, kv_len)
    if key_mask is not None:
        keep = keep & key_mask.bool()[:, None, None, :]
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("q_len,kv_len", [(9, 9), (1, 9), (3, 9)])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_naive_reference_outputs_and_gradients(causal, heads, kv_heads, q_len, kv_len, masked):
    q = torch.randn(2, heads, q_len, 8, requires_grad=True)
    k = torch.randn(2, kv_heads, kv_len, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, kv_len, 6, requires_grad=True)
    mask = None
    if masked:
        mask = torch.ones(2, kv_len, dtype=torch.long)
        mask[1, :4] = 0  # left padding of the second sample
    out = softmax_attention(q, k, v, causal=causal, attention_mask=mask)
    ref = naive_softmax_attention(q, k, v, causal=causal, key_mask=mask)
    assert_outputs_and_gradients_close(out, (q, k, v), ref, (q, k, v))


def test_fully_masked_rows_are_zero_not_nan():
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    v = torch.randn(1, 2, 4, 8)
    mask = torch.tensor([[0, 0, 1, 1]])
    out = softmax_attention(q, k, v, causal=True, attention_mask=mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))


def test_rank4_bool_mask_and_additive_mask_agree():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    keep = torch.rand(1, 1, 5, 5) > 0.3
    keep[..., 0] = True
    additive = torch.zeros(1, 1, 5, 5).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(
        softmax_attention(q, k, v, attention_mask=keep), softmax_attention(q, k, v, attention_mask=additive)
    )


def test_custom_scale():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    torch.testing.assert_close(
        softmax_attention(q, k, v, scale=0.1),
        naive_softmax_attention(q, k, v, scale=0.1),
        atol=1e-6,
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    "shapes,kwargs,match",
    [
        (((2, 4, 5), (2, 4, 5, 8), (2, 4, 5, 8)), {}, "q must have shape"),
        (((2, 4, 5, 8), (2, 3, 5, 8), (2, 3, 5, 8)), {}, "does not divide"),
        (((2, 4, 5, 8), (2, 4, 5, 6), (2, 4, 5, 8)), {}, "head_dim"),
        (((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 6, 8)), {}, "v must have shape"),
        (((2, 4, 5, 8), (1, 4, 5, 8), (1, 4, 5, 8)), {}, "batch"),
        (
            ((2, 4, 5, 8),) * 3,
            {"attention_mask": torch.ones(2, 4, dtype=torch.bool)},
            r"attention_mask.*\[2, 5\]",
        ),
        (((2, 4, 5, 8),) * 3, {"attention_mask": torch.ones(2, 5)}, "bool or integer"),
        (((2, 4, 5, 8),) * 3, {"attention_mask": torch.ones(2, 3, 5, 5, dtype=torch.bool)}, "1 or heads"),
    ],
)
def test_bad_input_names_the_argument(shapes, kwargs, match):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        softmax_attention(q, k, v, **kwargs)


def test_float_mask_with_causal_and_empty_rows_is_finite():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    additive = torch.zeros(1, 1, 4, 4)
    additive[..., :2] = float("-inf")  # the first two keys are padding: causal rows 0 and 1 see nothing
    out = softmax_attention(q, k, v, causal=True, attention_mask=additive)
    ref = naive_softmax_attention(q, k, v, causal=True, key_mask=torch.tensor([[0, 0, 1, 1]]))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_static_step_matches_softmax_over_the_held_keys():
    from headkit.ops.softmax import softmax_attention_static_step_

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length, capacity, prompt = 2, 6, 2, 8, 11, 16, 4
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, dim, dtype=torch.float64) for _ in range(2))
    real = torch.ones(batch, length, dtype=torch.bool)
    real[0, :2] = False  # a left-padded prompt
    keys = torch.zeros(batch, kv_heads, capacity, dim, dtype=torch.float64)
    values, keep = torch.zeros_like(keys), torch.zeros(batch, capacity, dtype=torch.bool)
    keys[:, :, :prompt], values[:, :, :prompt], keep[:, :prompt] = (
        k[:, :, :prompt],
        v[:, :, :prompt],
        real[:, :prompt],
    )
    seen = torch.tensor(prompt)
    for t in range(prompt, length):
        out = softmax_attention_static_step_(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], keys, values, keep, seen, scale=0.3
        )
        expected = softmax_attention(
            q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], attention_mask=real[:, : t + 1], scale=0.3
        )
        torch.testing.assert_close(out, expected)
    assert int(seen) == length and torch.equal(keep[:, :length], real) and not keep[:, length:].any()
    torch.testing.assert_close(keys[:, :, :length], k)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_grouped_query_step_matches_repeated_keys_outputs_and_gradients(heads, kv_heads, mask_kind):
    from headkit.ops.softmax import grouped_query_step_attention

    q = torch.randn(2, heads, 1, 8, requires_grad=True)
    k = torch.randn(2, kv_heads, 11, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, 11, 5, requires_grad=True)
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[1, :4] = False  # left padding of the second row
    keep[0, 9:] = False  # static-cache slots not written yet
    mask = None
    if mask_kind == "bool":
        mask = keep[:, None, None, :]
    elif mask_kind == "additive":
        mask = torch.zeros(2, 1, 1, 11).masked_fill(~keep[:, None, None, :], float("-inf"))
    out = grouped_query_step_attention(q, k, v, mask, scale=0.3)
    ref = naive_softmax_attention(q, k, v, key_mask=None if mask is None else keep, scale=0.3)
    assert_outputs_and_gradients_close(out, (q, k, v), ref, (q, k, v))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_grouped_query_step_in_bfloat16_matches_the_float32_reference(mask_kind):
    # Reduced precision takes the written-out form (scores and softmax in float32): within bfloat16's rounding of
    # the float32 reference over repeated keys, gradients included.
    from headkit.ops.softmax import grouped_query_step_attention

    q, k, v = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 300, 8), torch.randn(2, 2, 300, 5)
    keep = torch.ones(2, 300, dtype=torch.bool)
    keep[1, :40] = False
    mask = {"none": None, "bool": keep[:, None, None, :]}.get(mask_kind)
    if mask_kind == "additive":
        mask = torch.zeros(2, 1, 1, 300, dtype=torch.bfloat16).masked_fill(
            ~keep[:, None, None, :], float("-inf")
        )
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = grouped_query_step_attention(*low, mask, scale=0.3)
    assert out.dtype == torch.bfloat16
    full = [t.bfloat16().float().requires_grad_() for t in (q, k, v)]
    ref = naive_softmax_attention(*full, key_mask=None if mask is None else keep, scale=0.3)
    assert_outputs_and_gradients_close(out, low, ref, full, outputs=2e-2, gradients=3e-2)


def test_grouped_query_step_refuses_what_it_cannot_group():
    from headkit.ops.softmax import grouped_query_step_attention

    k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="one token per row"):
        grouped_query_step_attention(torch.randn(1, 4, 2, 8), k, v, None)
    with pytest.raises(ValueError, match="multiple of the 2 key/value heads"):
        grouped_query_step_attention(torch.randn(1, 3, 1, 8), k, v, None)
    with pytest.raises(ValueError, match="same for every head"):
        grouped_query_step_attention(torch.randn(1, 4, 1, 8), k, v, torch.ones(1, 4, 1, 5, dtype=torch.bool))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_step_over_a_buffer_of_codes_is_the_static_step_over_its_numbers(bits):
    """softmax_attention_coded_step_ (a quantized cache's retrieval heads on the fast decoder): the static step
    over the dequantized buffer, the new token in full precision; the new key and value handed back for the caller
    to store, the slot marked kept and the count advanced. A row with nothing held yet sees only its new token."""
    from headkit.ops.quantized_attention import CodedSlots
    from headkit.ops.quantized_cache import dequantize_values, quantize_values
    from headkit.ops.softmax import softmax_attention_coded_step_, softmax_attention_static_step_

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length, held = 2, 6, 2, 64, 12, 7
    options = {"bits": bits, "group_size": 32}
    codes = [quantize_values(torch.randn(batch, kv_heads, length, dim), **options) for _ in range(2)]
    keep = torch.zeros(batch, length, dtype=torch.bool)
    keep[0, :held] = True
    keep[1, 3:held] = True  # a left-padded row
    q, k, v = (
        torch.randn(batch, heads, 1, dim),
        torch.randn(batch, kv_heads, 1, dim),
        torch.randn(batch, kv_heads, 1, dim),
    )
    numbers = [dequantize_values(c, **options) for c in codes]
    reference_keep, reference_seen = keep.clone(), torch.tensor(held)
    want = softmax_attention_static_step_(q, k, v, *numbers, reference_keep, reference_seen, scale=dim**-0.5)
    slots = [CodedSlots(c, torch.zeros(batch, kv_heads, dim)) for c in codes]
    seen = torch.tensor(held)
    got = softmax_attention_coded_step_(q, k, v, *slots, keep, seen, scale=dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(keep, reference_keep) and int(seen) == held + 1
    assert torch.equal(slots[0].entering, k[:, :, 0]) and torch.equal(slots[1].entering, v[:, :, 0])
    empty = torch.zeros(batch, length, dtype=torch.bool)
    alone = softmax_attention_coded_step_(q, k, v, *slots, empty, torch.tensor(0), scale=dim**-0.5)
    torch.testing.assert_close(alone, v.repeat_interleave(heads // kv_heads, dim=1))
