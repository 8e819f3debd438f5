"""The compiled causal linear attention kernel (ops/csrc/causal_linear_attention.cpp) against the chunked PyTorch
form and the naive reference: outputs, final states and gradients (its backward); when `kernel="auto"` takes it,
and the fallbacks."""

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
    assert calls == [1]  # non-causal and float64 take the chunked form
    out, _ = linear_attention(q.requires_grad_(), k, v, causal=True)
    assert calls == [1, 1] and type(out.grad_fn).__name__ == "_FusedCausalLinearAttentionBackward"


def test_auto_under_autograd_runs_the_kernels_forward_and_backward(fused_available, monkeypatch):
    real = extensions.load_extension("causal_linear_attention")
    calls = []

    class Spy:  # the compiled module, counting its two entry points
        def causal_linear_attention(self, *args):
            calls.append("forward")
            return real.causal_linear_attention(*args)

        def causal_linear_attention_backward(self, *args):
            calls.append("backward")
            return real.causal_linear_attention_backward(*args)

    monkeypatch.setattr(linear_module, "load_extension", lambda name: Spy())
    q, k, v = (t.requires_grad_() for t in inputs(length=40))
    out, _ = linear_attention(q, k, v, causal=True)
    out.sum().backward()
    assert calls == ["forward", "backward"]
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_fused_kernel_refuses_what_it_cannot_do_and_names_the_argument():
    q, k, v = inputs(length=8)
    with pytest.raises(ValueError, match="kernel must be one of"):
        linear_attention(q, k, v, causal=True, kernel="cuda")
    with pytest.raises(ValueError, match="kernel='fused' needs float32"):
        linear_attention(q.double(), k.double(), v.double(), causal=True, kernel="fused")


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


def test_each_version_of_the_source_builds_under_its_own_name(monkeypatch, tmp_path):
    # Checkouts of different versions share torch's extension cache: a name per source keeps them apart.
    names = []
    monkeypatch.setattr(extensions, "_SOURCES", tmp_path)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: names.append(kwargs["name"]))
    for text in ("// one version", "// another version"):
        (tmp_path / "kernel.cpp").write_text(text)
        extensions._build("kernel")
    assert len(set(names)) == 2 and all(name.startswith("headkit_kernel_") for name in names)


def test_fused_kernel_with_a_chunk_longer_than_the_sequence_and_with_no_tokens(fused_available):
    q, k, v = inputs(length=50)
    huge, _ = linear_attention(q, k, v, causal=True, kernel="fused", chunk_size=10**9)  # buffers sized by T
    torch.testing.assert_close(huge, linear_attention(q, k, v, causal=True, kernel="chunked")[0])
    empty, state = linear_attention(*inputs(length=0), causal=True, kernel="fused", output_final_state=True)
    assert empty.shape == (2, 6, 0, 24) and not state.kv.any() and not state.k_sum.any()


# --- the backward ---------------------------------------------------------------------------------------------


def relu_squared(
    x: torch.Tensor,
) -> torch.Tensor:  # a callable feature map: applied in PyTorch, kernel on features
    return torch.relu(x) ** 2 + 0.1


def scaled_max_error(got: torch.Tensor, expected: torch.Tensor, scale: float) -> float:
    return (got.double() - expected.double()).abs().max().item() / scale


@pytest.mark.parametrize("feature_map", ["elu", "relu", relu_squared], ids=["elu", "relu", "callable"])
@pytest.mark.parametrize(
    "length, chunk_size, masked",
    [(203, 64, True), (203, 16, False), (45, 3, True), (17, 1, True), (64, 64, False), (1, 16, True)],
)
@pytest.mark.parametrize("use_final_state", [True, False], ids=["final_state_loss", "output_loss"])
def test_fused_gradients_equal_the_chunked_forms_and_the_naive_references(
    fused_available, feature_map, length, chunk_size, masked, use_final_state
):
    # GQA (4 query heads on 2 key/value heads), a padding mask, an initial state that requires grad, and a loss
    # that reads the final state too (or only the output: the state's gradients are then None in the backward).
    q, k, v = inputs(heads=4, kv_heads=2, length=length, head_dim=8, head_dim_v=12)
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(2, length, generator=generator) > 0.3 if masked else None
    if masked:
        mask[0, 0] = False  # the first query of row 0 sees only the initial state
    kv0, k_sum0 = torch.randn(2, 2, 8, 12, generator=generator), torch.rand(2, 2, 8, generator=generator) + 1
    cotangents = [torch.randn(2, 4, length, 12, generator=generator), torch.randn(2, 2, 8, 12, generator=generator),
                  torch.randn(2, 2, 8, generator=generator)]  # fmt: skip

    def gradients(kernel, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, kv0, k_sum0)]
        common = dict(causal=True, attention_mask=mask, feature_map=feature_map,
                      initial_state=LinearAttentionState(*leaves[3:]), output_final_state=True)  # fmt: skip
        if kernel == "naive":
            out, state = naive_linear_attention(*leaves[:3], **common)
        else:
            out, state = linear_attention(*leaves[:3], kernel=kernel, chunk_size=chunk_size, **common)
            expected_node = "_FusedCausalLinearAttentionBackward" if kernel == "fused" else None
            assert expected_node is None or type(out.grad_fn).__name__ == expected_node
        outputs = (out, *state) if use_final_state else (out,)
        loss = sum((x * w.to(dtype)).sum() for x, w in zip(outputs, cotangents, strict=False))
        return torch.autograd.grad(loss, leaves)

    fused = gradients("fused", torch.float32)
    chunked = gradients("chunked", torch.float32)
    naive = gradients("naive", torch.float64)
    largest = max(g.abs().max().item() for g in naive)
    for name, got, same_precision, reference in zip(
        ["q", "k", "v", "kv", "k_sum"], fused, chunked, naive, strict=True
    ):
        # Relative to the gradient's own size (floored where it is ~0 by construction, e.g. of a single
        # padded key).
        scale = max(reference.abs().max().item(), 1e-3 * largest)
        assert got.dtype == torch.float32 and got.shape == reference.shape
        assert scaled_max_error(got, same_precision, scale) < 1e-5, name
        assert scaled_max_error(got, reference, scale) < 2e-5, name
    if masked:  # a padded key reaches nothing: no gradient to it or its value
        assert not fused[1][~mask[:, None, :, None].expand_as(fused[1])].any()
        assert not fused[2][~mask[:, None, :, None].expand_as(fused[2])].any()


def test_fused_with_autograd_and_only_some_inputs_requiring_grad(fused_available):
    q, k, v = inputs(length=70)
    v.requires_grad_()
    out, _ = linear_attention(q, k, v, causal=True, kernel="fused", chunk_size=16)
    (grad_v,) = torch.autograd.grad(out.square().sum(), v)
    v_ref = v.detach().requires_grad_()
    out_ref, _ = linear_attention(q, k, v_ref, causal=True, kernel="chunked", chunk_size=16)
    (expected,) = torch.autograd.grad(out_ref.square().sum(), v_ref)
    torch.testing.assert_close(grad_v, expected, rtol=1e-5, atol=1e-5)
    # Only the final state in the loss: the output's gradient is None in the backward.
    k.requires_grad_()
    _, state = linear_attention(q, k, v, causal=True, kernel="fused", output_final_state=True)
    grad_k, grad_v = torch.autograd.grad(state.kv.sum() + state.k_sum.sum(), (k, v))
    k_ref = k.detach().requires_grad_()
    _, state_ref = linear_attention(q, k_ref, v_ref, causal=True, kernel="chunked", output_final_state=True)
    expected_k, expected_v = torch.autograd.grad(state_ref.kv.sum() + state_ref.k_sum.sum(), (k_ref, v_ref))
    torch.testing.assert_close(grad_k, expected_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_v, expected_v, rtol=1e-5, atol=1e-5)


def test_fused_gradients_with_no_tokens(fused_available):
    q, k, v = (t.requires_grad_() for t in inputs(length=0))
    kv0, k_sum0 = torch.rand(2, 2, 16, 24, requires_grad=True), torch.rand(2, 2, 16, requires_grad=True)
    _, state = linear_attention(q, k, v, causal=True, kernel="fused", output_final_state=True,
                                initial_state=LinearAttentionState(kv0, k_sum0))  # fmt: skip
    grads = torch.autograd.grad(2 * state.kv.sum() + 3 * state.k_sum.sum(), (q, k, v, kv0, k_sum0))
    assert [g.shape for g in grads[:3]] == [t.shape for t in (q, k, v)]
    assert (grads[3] == 2).all() and (grads[4] == 3).all()  # the initial state is the final state


def test_fused_double_backward_raises(fused_available):
    # The kernel's backward is once differentiable: a second derivative (create_graph=True, then backward
    # through the gradients) raises rather than returning a wrong answer; kernel="chunked" supports it.
    q, k, v = (t.requires_grad_() for t in inputs(length=20))
    out, _ = linear_attention(q, k, v, causal=True, kernel="fused")
    (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_q.sum().backward()
    out, _ = linear_attention(q, k, v, causal=True, kernel="chunked")
    (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    grad_q.sum().backward()


def test_torch_func_transforms_take_the_chunked_form(fused_available):
    # The kernel's autograd Function has no functorch rules: under torch.func the chunked form runs instead.
    q, k, v = inputs(length=30)

    def loss(q, kernel):
        return linear_attention(q, k, v, causal=True, kernel=kernel)[0].square().sum()

    torch.testing.assert_close(torch.func.grad(loss)(q, "auto"), torch.func.grad(loss)(q, "chunked"))
    with pytest.raises(ValueError, match="kernel='fused' needs no torch.func transform"):
        torch.func.grad(loss)(q, "fused")
