import pytest
import torch

from headkit.ops import collaborative, collaborative_attention, collaborative_scores
from headkit.ops.collaborative import collaborative_attention_weights, naive_collaborative_attention
from headkit.ops.softmax import softmax_attention


def _inputs(batch=2, heads=3, q_len=6, kv_len=6, dim_shared=10, dim_v=4, bias=True):
    q = torch.randn(batch, q_len, dim_shared, requires_grad=True)
    k = torch.randn(batch, kv_len, dim_shared, requires_grad=True)
    v = torch.randn(batch, heads, kv_len, dim_v, requires_grad=True)
    mixing = torch.randn(heads, dim_shared, requires_grad=True)
    content_bias = torch.randn(batch, heads, kv_len, requires_grad=True) if bias else None
    return q, k, v, mixing, content_bias


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("q_len", [6, 2])
@pytest.mark.parametrize("kernel", ["auto", "fused", "explicit"])
def test_matches_naive_reference_outputs_and_gradients(causal, bias, masked, q_len, kernel):
    q, k, v, mixing, content_bias = _inputs(q_len=q_len, bias=bias)
    mask = None
    if masked:
        mask = torch.ones(2, 6, dtype=torch.bool)
        mask[0, :2] = False
    kwargs = dict(content_bias=content_bias, causal=causal, attention_mask=mask, scale=0.5)
    out = collaborative_attention(q, k, v, mixing, kernel=kernel, **kwargs)
    ref = naive_collaborative_attention(q, k, v, mixing, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    leaves = [t for t in (q, k, v, mixing, content_bias) if t is not None]
    cotangent = torch.randn_like(out)
    for g, r in zip(
        torch.autograd.grad(out, leaves, cotangent), torch.autograd.grad(ref, leaves, cotangent), strict=True
    ):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def _mask(kind, batch, heads, q_len, kv_len, generator):
    """Every mask form the op takes; the first batch row's first two keys are padding."""
    keep = torch.ones(batch, kv_len, dtype=torch.bool)
    keep[0, :2] = False
    if kind is None:
        return None
    if kind == "padding":
        return keep
    if kind == "padding_int":
        return keep.long()
    if kind == "key_bool":  # [B, 1, 1, Tk]
        return keep[:, None, None, :]
    if kind == "key_bool_broadcast":  # [B, 1, Tq, Tk], one row seen through a stride-0 view
        return keep[:, None, None, :].expand(batch, 1, q_len, kv_len)
    if kind == "key_float_heads":  # additive, per head, same for every query
        mask = torch.randn(batch, heads, 1, kv_len, generator=generator, dtype=torch.float64)
        return mask.masked_fill(~keep[:, None, None, :], float("-inf"))
    if kind == "query_bool":  # varies over the queries; row 0 of batch 1 sees nothing
        mask = torch.rand(batch, 1, q_len, kv_len, generator=generator) > 0.3
        mask[..., -1] = True
        mask[1, :, 0] = False
        return mask
    if kind == "query_float":
        mask = torch.randn(batch, heads, q_len, kv_len, generator=generator, dtype=torch.float64)
        return mask.masked_fill(torch.rand(mask.shape, generator=generator) > 0.7, float("-inf"))
    raise AssertionError(kind)


MASK_KINDS = [
    None,
    "padding",
    "padding_int",
    "key_bool",
    "key_bool_broadcast",
    "key_float_heads",
    "query_bool",
    "query_float",
]


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("q_len,dim_v", [(6, 4), (2, 4), (1, 4), (6, 13)])
def test_every_mask_form_matches_the_explicit_scores_in_float64(mask_kind, causal, bias, q_len, dim_v):
    """Outputs and gradients (q̃, k̃, v, mixing, content bias) of the fused path, the explicit-weights path and
    the head-by-head twin agree, with padding, content bias, causal and query-dependent masks; dim_v 13 > D̃
    pads the queries and keys instead of the values."""
    generator = torch.Generator().manual_seed(3)
    batch, heads, kv_len, dim_shared = 2, 3, 6, 10

    def leaf(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_(True)

    q, k, v, mixing = (
        leaf(batch, q_len, dim_shared),
        leaf(batch, kv_len, dim_shared),
        leaf(batch, heads, kv_len, dim_v),
        leaf(heads, dim_shared),
    )
    content_bias = leaf(batch, heads, kv_len) if bias else None
    mask = _mask(mask_kind, batch, heads, q_len, kv_len, generator)
    if mask is not None and mask.dim() == 4 and mask.shape[2] not in (1, q_len):
        mask = mask[:, :, :q_len]
    kwargs = dict(content_bias=content_bias, causal=causal, attention_mask=mask, scale=0.5)
    out = collaborative_attention(q, k, v, mixing, kernel="fused", **kwargs)
    ref = naive_collaborative_attention(q, k, v, mixing, **kwargs)
    explicit = collaborative_attention(q, k, v, mixing, kernel="explicit", **kwargs)
    weights = collaborative_attention_weights(q, k, mixing, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(explicit, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(weights @ v, ref, atol=1e-10, rtol=1e-10)
    leaves = [t for t in (q, k, v, mixing, content_bias) if t is not None]
    cotangent = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    want = torch.autograd.grad(ref, leaves, cotangent)
    for name, result in (("fused", out), ("explicit", explicit)):
        got = torch.autograd.grad(result, leaves, cotangent)
        for leaf_name, g, w in zip("q k v mixing content_bias".split(), got, want, strict=False):
            assert torch.isfinite(g).all(), (name, leaf_name)
            torch.testing.assert_close(
                g, w, atol=1e-9, rtol=1e-9, msg=lambda m, n=name, t=leaf_name: f"{n} {t}: {m}"
            )


def _kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        fn()
    return {event.key for event in profiler.key_averages()}


@pytest.mark.parametrize("causal", [False, True])
def test_scores_go_through_the_fused_cpu_kernel_without_a_square_tensor(causal):
    """With content bias (and a padding mask when not causal) the call reaches SDPA's fused CPU kernel, and
    nothing it allocates is [T, T]-sized: the math fallback would materialise the scores."""
    batch, heads, seq, dim_shared, dim_v = 1, 4, 512, 64, 16
    q = torch.randn(batch, seq, dim_shared)
    k = torch.randn(batch, seq, dim_shared)
    v = torch.randn(batch, heads, seq, dim_v)
    mixing = torch.randn(heads, dim_shared)
    content_bias = torch.randn(batch, heads, seq)
    mask = (
        None
        if causal
        else torch.ones(batch, seq, dtype=torch.bool).index_fill(1, torch.tensor([0, 5]), False)
    )

    def call():
        with torch.no_grad():
            collaborative_attention(
                q, k, v, mixing, content_bias=content_bias, causal=causal, attention_mask=mask
            )

    kernels = _kernels(call)  # "auto": Tk = 512 > D̃ = 64
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels
    assert "aten::_scaled_dot_product_attention_math" not in kernels
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as profiler:
        call()
    largest = max(event.cpu_memory_usage for event in profiler.events())
    assert largest < seq * seq * 4, largest  # one float32 [T, T] matrix; every head's would be 4 times that


def test_auto_takes_the_explicit_scores_only_while_they_are_no_larger_than_the_mixed_queries():
    q, k, v, mixing, content_bias = (t.detach() for t in _inputs(q_len=6, kv_len=6, dim_shared=6))
    short = _kernels(lambda: collaborative_attention(q, k, v, mixing, content_bias=content_bias))
    assert not any("scaled_dot_product" in name for name in short)  # Tk = 6 ≤ D̃ = 6
    narrow = (q[..., :5], k[..., :5], v, mixing[:, :5])  # Tk = 6 > D̃ = 5
    fused = _kernels(lambda: collaborative_attention(*narrow, content_bias=content_bias))
    assert "aten::scaled_dot_product_attention" in fused
    with pytest.raises(ValueError, match="kernel must be"):
        collaborative_attention(q, k, v, mixing, kernel="flash")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("with_column", [False, True])
def test_kernel_widths_change_no_score_and_no_output(device_type, with_column):
    """What SDPA receives, as built for each device (CPU: one width for all; CUDA: each side rounded up to a
    multiple of 8, the content bias as an extra dimension), gives the explicit scores' result: checked here on
    the CPU, where unequal widths run SDPA's math kernel."""
    generator = torch.Generator().manual_seed(7)
    batch, heads, seq, dim_shared, dim_v = 2, 3, 5, 9, 4
    queries = torch.randn(batch, heads, seq, dim_shared, generator=generator, dtype=torch.float64)
    keys = torch.randn(batch, 1, seq, dim_shared, generator=generator, dtype=torch.float64).expand_as(queries)
    v = torch.randn(batch, heads, seq, dim_v, generator=generator, dtype=torch.float64)
    column = torch.randn(batch, heads, seq, generator=generator, dtype=torch.float64) if with_column else None
    q_in, k_in, v_in, width = collaborative._kernel_widths(queries, keys, v, column, device_type=device_type)
    if device_type == "cuda":
        assert q_in.shape[-1] % 8 == 0 and k_in.shape[-1] == q_in.shape[-1] and v_in.shape[-1] == 8
    else:
        assert q_in.shape[-1] == k_in.shape[-1] == v_in.shape[-1] == 16
    out = torch.nn.functional.scaled_dot_product_attention(q_in, k_in, v_in, scale=0.5)[..., :width]
    scores = 0.5 * queries @ keys.transpose(-1, -2)
    if with_column:
        scores = scores + 0.5 * column[:, :, None, :]
    torch.testing.assert_close(out, scores.softmax(-1) @ v)


def test_block_mixing_at_full_size_is_multi_head_attention():
    """Concatenated per-head projections with 0/1 block mixing reproduce ordinary multi-head scores."""
    heads, head_dim = 3, 4
    q_heads = torch.randn(2, heads, 5, head_dim)
    k_heads = torch.randn(2, heads, 5, head_dim)
    v = torch.randn(2, heads, 5, head_dim)
    q_shared = q_heads.transpose(1, 2).reshape(2, 5, heads * head_dim)
    k_shared = k_heads.transpose(1, 2).reshape(2, 5, heads * head_dim)
    mixing = torch.block_diag(*[torch.ones(1, head_dim)] * heads)
    torch.testing.assert_close(
        collaborative_attention(q_shared, k_shared, v, mixing, causal=True),
        softmax_attention(q_heads, k_heads, v, causal=True),
        atol=1e-6,
        rtol=1e-5,
    )
    scores = collaborative_scores(q_shared, k_shared, mixing, scale=head_dim**-0.5)
    torch.testing.assert_close(
        scores, head_dim**-0.5 * q_heads @ k_heads.transpose(-1, -2), atol=1e-6, rtol=1e-5
    )


def test_scores_add_content_bias_per_key():
    q, k, _, mixing, content_bias = _inputs()
    with_bias = collaborative_scores(q, k, mixing, content_bias=content_bias, scale=1.0)
    without = collaborative_scores(q, k, mixing, scale=1.0)
    torch.testing.assert_close(with_bias - without, content_bias[:, :, None, :].expand_as(with_bias))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "q": torch.randn(2, 6)}, "q_shared"),
        (lambda a: {**a, "k": torch.randn(2, 6, 9)}, "k_shared"),
        (lambda a: {**a, "mixing": torch.randn(3, 9)}, "mixing"),
        (lambda a: {**a, "bias": torch.randn(2, 3, 5)}, "content_bias"),
        (lambda a: {**a, "v": torch.randn(2, 4, 6, 4)}, "v must have shape"),
    ],
)
def test_bad_input_names_the_argument(change, match):
    q, k, v, mixing, bias = _inputs()
    args = change({"q": q, "k": k, "v": v, "mixing": mixing, "bias": bias})
    with pytest.raises(ValueError, match=match):
        collaborative_attention(args["q"], args["k"], args["v"], args["mixing"], content_bias=args["bias"])
