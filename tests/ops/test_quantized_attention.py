"""Attention on stored codes (the fast decoder's kept keys in int8 / int4): the compiled kernel and its PyTorch
path against the written-out twin — partials, masks, layouts, dtypes, a compiled graph — and bad layouts named."""

from __future__ import annotations

import pytest
import torch

from headkit.ops import extensions
from headkit.ops.quantized_attention import (
    _dequantized_partials,
    naive_quantized_attention_partials,
    quantized_attention_partials,
    quantized_layout,
)
from headkit.ops.quantized_cache import quantize_values


def stored(
    batch=2, kv_heads=3, rows=3, dim=64, tokens=37, *, bits=4, group_size=32, dtype=torch.float32, seed=0
):
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, kv_heads, rows, dim, generator=generator)
    keys, values = (
        torch.randn(batch, kv_heads, tokens, dim, generator=generator).to(dtype) for _ in range(2)
    )
    options = {"bits": bits, "group_size": group_size}
    return queries, quantize_values(keys, **options), quantize_values(values, **options)


def assert_partials_close(got, want, tolerance=2e-5):
    maxima, sums, numerators = got
    want_maxima, want_sums, want_numerators = want
    assert maxima.shape == want_maxima.shape and numerators.shape == want_numerators.shape
    assert torch.equal(torch.isinf(maxima), torch.isinf(want_maxima))  # rows that see nothing
    finite = torch.isfinite(want_maxima)
    torch.testing.assert_close(maxima[finite], want_maxima[finite], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(sums, want_sums, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(numerators, want_numerators, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim, group_size", [(64, 32), (64, 64), (128, 32), (32, 16), (48, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_the_twin(bits, dim, group_size, dtype):
    """Head sizes the kernel compiles for (64, 128) and any other (32, 48); scales in float32 and bfloat16; a
    mask per head with a head that sees nothing (m = −inf, sums 0)."""
    queries, keys, values = stored(dim=dim, bits=bits, group_size=group_size, dtype=dtype)
    visible = torch.rand(2, 3, 37, generator=torch.Generator().manual_seed(1)) > 0.3
    visible[1, 2] = False
    got = quantized_attention_partials(queries, keys, values, visible, scale=dim**-0.5, value_dim=dim)
    want = naive_quantized_attention_partials(queries, keys, values, visible, scale=dim**-0.5, value_dim=dim)
    assert all(x.dtype == torch.float32 for x in got)
    assert_partials_close(got, want)
    assert torch.equal(got[1][1, 2], torch.zeros(3, 1)) and torch.equal(got[2][1, 2], torch.zeros(3, dim))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("rows, tokens", [(1, 16), (5, 5), (8, 33), (3, 1)])
def test_the_kernel_is_the_twin_in_blocks_of_keys_and_rows(bits, dim, rows, tokens):
    """The vector path scores keys 16 at a time and sums the values of a few query rows at once: whole blocks, a
    last block of 1–15 keys, one block cut short, row counts that fill and overflow a pass, a block with no key
    visible."""
    queries, keys, values = stored(rows=rows, dim=dim, tokens=tokens, bits=bits, group_size=32)
    visible = torch.rand(2, 3, tokens, generator=torch.Generator().manual_seed(2)) > 0.25
    visible[0, 1, :16] = False
    options = {"scale": dim**-0.5, "value_dim": dim}
    got = quantized_attention_partials(queries, keys, values, visible, **options)
    assert_partials_close(got, naive_quantized_attention_partials(queries, keys, values, visible, **options))


def test_a_mask_shared_by_the_heads_and_the_pytorch_path():
    """visible [B, 1, N] serves every head; with the extension off (HEADKIT_EXTENSIONS=0, or no compiler) the
    PyTorch path gives the same partials."""
    queries, keys, values = stored(bits=4)
    visible = torch.ones(2, 1, 37, dtype=torch.bool)
    visible[0, 0, :5] = False
    options = {"scale": 0.125, "value_dim": 64}
    want = naive_quantized_attention_partials(queries, keys, values, visible, **options)
    assert_partials_close(quantized_attention_partials(queries, keys, values, visible, **options), want)
    assert_partials_close(_dequantized_partials(queries, keys, values, visible, 0.125, 4, 32), want)


def test_merged_partials_are_softmax_attention_over_the_dequantized_set():
    """The partials merged as a caller merges them (one set split in two) give softmax attention over the set's
    dequantized numbers."""
    queries, keys, values = stored(bits=8, tokens=40)
    visible = torch.ones(2, 3, 20, dtype=torch.bool)
    halves = [
        quantized_attention_partials(
            queries,
            type(keys)(*(f[:, :, part] for f in keys)),
            type(values)(*(f[:, :, part] for f in values)),
            visible,
            scale=0.125,
            value_dim=64,
        )  # fmt: skip
        for part in (slice(0, 20), slice(20, 40))
    ]
    m = torch.maximum(halves[0][0], halves[1][0])
    numerator = sum(torch.exp(h[0] - m) * h[2] for h in halves)
    denominator = sum(torch.exp(h[0] - m) * h[1] for h in halves)
    from headkit.ops.quantized_cache import dequantize_values

    k, v = (dequantize_values(x, bits=8, group_size=32) for x in (keys, values))
    want = torch.softmax(queries @ k.transpose(-1, -2) * 0.125, dim=-1) @ v
    torch.testing.assert_close(numerator / denominator, want, atol=1e-5, rtol=1e-5)


def test_float64_queries_take_the_exact_path():
    queries, keys, values = stored(bits=4)
    visible = torch.ones(2, 3, 37, dtype=torch.bool)
    got = quantized_attention_partials(queries.double(), keys, values, visible, scale=0.125, value_dim=64)
    want = naive_quantized_attention_partials(
        queries.double(), keys, values, visible, scale=0.125, value_dim=64
    )
    assert all(x.dtype == torch.float64 for x in got)
    assert_partials_close(got, want, tolerance=1e-10)


def test_a_compiled_graph_calls_the_kernel():
    """The op is one node of a compiled graph (fullgraph): the decoder's step compiles around it."""
    queries, keys, values = stored(bits=4)
    visible = torch.ones(2, 3, 37, dtype=torch.bool)

    def attend(q, kc, ks, kz, vc, vs, vz, seen):
        partials = quantized_attention_partials(
            q, type(keys)(kc, ks, kz), type(values)(vc, vs, vz), seen, scale=0.125, value_dim=64
        )
        return partials[2] / partials[1]

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="inductor")
    got = compiled(queries, *keys, *values, visible)
    torch.testing.assert_close(got, attend(queries, *keys, *values, visible), atol=1e-6, rtol=1e-6)


def test_the_kernel_builds_here():
    """Where a compiler is (CI's and this project's machines), the op runs the kernel, not the fallback."""
    if not extensions.extensions_enabled():
        pytest.skip("HEADKIT_EXTENSIONS=0")
    assert extensions.load_extension("quantized_attention") is not None


@pytest.mark.parametrize(
    "codes_width, scales, width, match",
    [
        (32, 2, 64, None),
        (64, 2, 64, None),
        (16, 2, 64, "one of"),  # 2 bits a number
        (32, 3, 64, "do not store rows of 64"),
        (33, 2, 64, "do not store rows of 64"),
    ],
)
def test_a_layout_the_codes_cannot_hold_is_named(codes_width, scales, width, match):
    from headkit.ops.quantized_cache import QuantizedTensor

    codes = QuantizedTensor(
        torch.zeros(1, 1, 2, codes_width, dtype=torch.uint8),
        torch.ones(1, 1, 2, scales),
        torch.zeros(1, 1, 2, scales),
    )
    if match is None:
        assert quantized_layout(codes, width) == (codes_width * 8 // width, width // scales)
    else:
        with pytest.raises(ValueError, match=match):
            quantized_layout(codes, width)
