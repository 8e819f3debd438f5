"""The compiled causal linear attention kernel (ops/csrc/causal_linear_attention.cpp) against the chunked PyTorch
form and the naive reference: outputs and final states; when `kernel="auto"` takes it, and the fallbacks."""

from __future__ import annotations

import warnings

import pytest
import torch

import headkit.ops.linear as linear_module
from headkit.ops import extensions
from headkit.ops.linear import LinearAttentionState, linear_attention, naive_linear_attention


@pytest.fixture(scope="module")
def fused_available():
    if extensions.load_extension("causal_linear_attention") is None:
        pytest.skip(
            "the compiled kernel cannot be built here (no C++ compiler or ninja); the PyTorch path serves"
        )


def inputs(batch=2, heads=6, kv_heads=2, length=203, head_dim=16, head_dim_v=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, head_dim, generator=generator)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=generator)
    v = torch.randn(batch, kv_heads, length, head_dim_v, generator=generator)
    return q, k, v


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize(
    "length, chunk_size, masked, with_state",
    [
        (203, 32, True, True),
        (203, 64, False, False),
        (64, 64, True, False),
        (5, 1, False, True),
        (1, 7, True, True),
    ],
)
def test_fused_kernel_equals_the_chunked_form_and_the_naive_reference(
    fused_available, feature_map, length, chunk_size, masked, with_state
):
    q, k, v = inputs(length=length)
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(2, length, generator=generator) > 0.25 if masked else None
    state = None
    if with_state:
        state = LinearAttentionState(
            torch.rand(2, 2, 16, 24, generator=generator), torch.rand(2, 2, 16, generator=generator)
        )
    common = dict(
        causal=True, attention_mask=mask, initial_state=state, output_final_state=True,
        feature_map=feature_map, chunk_size=chunk_size,
    )  # fmt: skip
    fused, fused_state = linear_attention(q, k, v, kernel="fused", **common)
    chunked, chunked_state = linear_attention(q, k, v, kernel="chunked", **common)
    naive, naive_state = naive_linear_attention(
        q.double(), k.double(), v.double(), causal=True, attention_mask=mask, feature_map=feature_map,
        initial_state=None if state is None else LinearAttentionState(*(t.double() for t in state)),
        output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(fused, chunked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.double(), naive, rtol=1e-4, atol=1e-5)
    for got, expected in zip(fused_state, naive_state, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    if state is not None:  # the caller's state is read, never written
        assert fused_state.kv.data_ptr() != state.kv.data_ptr()


def test_fused_elu_features_match_elu_plus_one_across_the_range(fused_available):
    # The kernel's e^x (range reduction + polynomial): one key per batch row, so the final state's k_sum is φ(k).
    x = torch.cat(
        [torch.linspace(-100.0, 30.0, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("inf")])]
    )
    k = x.view(-1, 1, 1, 1)
    _, state = linear_attention(
        k, k, torch.ones_like(k), causal=True, kernel="fused", output_final_state=True
    )
    x = x.double()
    expected = torch.where(x > 0, x + 1, torch.exp(x))  # elu(x) + 1, without expm1's rounding near 1
    # A few float32 ulp; below e^-87.3 (where float32 turns subnormal) the kernel stops at ≈ 1.2e-38.
    torch.testing.assert_close(state.k_sum.view(-1).double(), expected, rtol=5e-7, atol=1.3e-38)


def test_auto_takes_the_fused_kernel_only_where_it_applies(fused_available, monkeypatch):
    calls = []
    real = linear_module._fused_causal_linear_attention
    monkeypatch.setattr(
        linear_module, "_fused_causal_linear_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    q, k, v = inputs(length=40)
    with torch.no_grad():
        linear_attention(q, k, v, causal=True)
    assert calls == [1]  # float32 on the CPU without autograd
    linear_attention(q, k, v, causal=False)
    linear_attention(q.double(), k.double(), v.double(), causal=True)
    out, _ = linear_attention(q.requires_grad_(), k, v, causal=True)
    assert calls == [1] and out.grad_fn is not None  # non-causal, float64 and autograd take the chunked form


def test_fused_kernel_refuses_what_it_cannot_do_and_names_the_argument():
    q, k, v = inputs(length=8)
    with pytest.raises(ValueError, match="kernel must be one of"):
        linear_attention(q, k, v, causal=True, kernel="cuda")
    with pytest.raises(ValueError, match="kernel='fused' needs no autograd"):
        linear_attention(q.requires_grad_(), k, v, causal=True, kernel="fused")
    with pytest.raises(ValueError, match="kernel='fused' needs float32"):
        linear_attention(q.detach().double(), k.double(), v.double(), causal=True, kernel="fused")


def test_without_the_extension_auto_falls_back_and_fused_says_why(monkeypatch):
    monkeypatch.setattr(linear_module, "load_extension", lambda name: None)
    q, k, v = inputs(length=30)
    with torch.no_grad():
        out, _ = linear_attention(q, k, v, causal=True)
        expected, _ = linear_attention(q, k, v, causal=True, kernel="chunked")
        with pytest.raises(RuntimeError, match="not available"):
            linear_attention(q, k, v, causal=True, kernel="fused")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_failed_build_warns_once_and_the_environment_can_switch_extensions_off(monkeypatch):
    from torch.utils import cpp_extension

    def failing_load(**kwargs):
        raise RuntimeError("Error building extension\nc++: not found")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    monkeypatch.setattr(extensions, "_LOADED", {})
    with pytest.warns(RuntimeWarning, match="not available .*c\\+\\+: not found"):
        assert extensions.load_extension("causal_linear_attention") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second attempt, no second warning
        assert extensions.load_extension("causal_linear_attention") is None
    monkeypatch.setenv("HEADKIT_EXTENSIONS", "0")
    monkeypatch.setattr(extensions, "_LOADED", {})
    assert extensions.load_extension("causal_linear_attention") is None  # not even tried: no warning


def test_fused_kernel_with_a_chunk_longer_than_the_sequence_and_with_no_tokens(fused_available):
    q, k, v = inputs(length=50)
    huge, _ = linear_attention(q, k, v, causal=True, kernel="fused", chunk_size=10**9)  # buffers sized by T
    torch.testing.assert_close(huge, linear_attention(q, k, v, causal=True, kernel="chunked")[0])
    empty, state = linear_attention(*inputs(length=0), causal=True, kernel="fused", output_final_state=True)
    assert empty.shape == (2, 6, 0, 24) and not state.kv.any() and not state.k_sum.any()
