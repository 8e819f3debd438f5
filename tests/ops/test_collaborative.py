import pytest
import torch

from headkit.ops import collaborative_attention, collaborative_scores
from headkit.ops.collaborative import naive_collaborative_attention
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
def test_matches_naive_reference_outputs_and_gradients(causal, bias, masked, q_len):
    q, k, v, mixing, content_bias = _inputs(q_len=q_len, bias=bias)
    mask = None
    if masked:
        mask = torch.ones(2, 6, dtype=torch.bool)
        mask[0, :2] = False
    kwargs = dict(content_bias=content_bias, causal=causal, attention_mask=mask, scale=0.5)
    out = collaborative_attention(q, k, v, mixing, **kwargs)
    ref = naive_collaborative_attention(q, k, v, mixing, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    leaves = [t for t in (q, k, v, mixing, content_bias) if t is not None]
    cotangent = torch.randn_like(out)
    for g, r in zip(
        torch.autograd.grad(out, leaves, cotangent), torch.autograd.grad(ref, leaves, cotangent), strict=True
    ):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


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
