"""QuantizedKVCacheLayer: what attention reads at every step is the written-out reference (the tokens quantized
so far through the naive twins, the rest as they came), whatever the chunks; beam reordering moves the codes
exactly; the bytes it holds grow by the bytes per token the op states; with a residual longer than the stream it
is transformers' DynamicLayer. QuantizedHybridStateCacheLayer (the compressed cache's): codes stored, read back within half a
step, written back without quantizing again, reordered by beam search, its bytes those of the op."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from headkit.errors import HeadkitError
from headkit.layers.quantized_cache import QuantizedKVCacheLayer, QuantizedKVState
from headkit.ops.quantized_cache import (
    naive_dequantize_keys,
    naive_dequantize_values,
    naive_quantize_keys,
    naive_quantize_values,
    quantized_bytes_per_token,
    tokens_to_quantize,
)
from headkit.surgery.linearize import decoding_state_bytes


def stream(batch=2, heads=2, tokens=30, width=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, tokens, width, generator=generator)
    keys[..., 1] += 5.0  # an outlier channel
    return keys, torch.randn(batch, heads, tokens, width, generator=generator)


def reference(keys, values, fed, upto, *, bits, group_size, residual):
    """What attention reads after `fed` tokens were stored and the next ones up to `upto` arrive: the first
    tokens_to_quantize(fed) through the naive quantization, then the rest as they are."""
    count = tokens_to_quantize(fed, group_size=group_size, residual=residual)
    options = {"bits": bits, "group_size": group_size}
    old_keys = naive_dequantize_keys(naive_quantize_keys(keys[..., :count, :], **options), **options)
    old_values = naive_dequantize_values(naive_quantize_values(values[..., :count, :], **options), **options)
    return (
        torch.cat((old_keys, keys[..., count:upto, :]), dim=-2),
        torch.cat((old_values, values[..., count:upto, :]), dim=-2),
    )


def layer(bits=4, group_size=4, residual=3):
    return QuantizedKVCacheLayer().configure(bits=bits, group_size=group_size, residual=residual)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("chunks", [[30], [1] * 30, [5, 1, 1, 7, 2, 9, 5], [12, 1, 1, 16]])
@pytest.mark.parametrize("residual", [0, 3, 8])
def test_attention_reads_the_reference_at_every_step(bits, chunks, residual):
    keys, values = stream()
    cache = layer(bits=bits, group_size=4, residual=residual)
    fed = 0
    for size in chunks:
        got_keys, got_values = cache.update(keys[..., fed : fed + size, :], values[..., fed : fed + size, :])
        want_keys, want_values = reference(
            keys, values, fed, fed + size, bits=bits, group_size=4, residual=residual
        )
        assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)
        fed += size
        assert cache.get_seq_length() == fed
        assert cache.quantized_tokens == tokens_to_quantize(fed, group_size=4, residual=residual)
        assert cache.state.residual_keys.shape[-2] == fed - cache.quantized_tokens
    # the new tokens are read in full precision, earlier ones quantized once their group is in the past
    assert torch.equal(got_keys[..., -chunks[-1] :, :], keys[..., -chunks[-1] :, :])
    assert torch.equal(got_keys[..., :4, :], keys[..., :4, :]) == (len(chunks) == 1)


def test_a_residual_longer_than_the_stream_is_the_dynamic_layer():
    keys, values = stream(tokens=12)
    quantized, dynamic = layer(residual=16), DynamicLayer()
    for start, end in [(0, 5), (5, 6), (6, 12)]:
        mine = quantized.update(keys[..., start:end, :], values[..., start:end, :])
        theirs = dynamic.update(keys[..., start:end, :], values[..., start:end, :])
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert quantized.quantized_tokens == 0


def test_beam_reordering_moves_the_codes_exactly():
    keys, values = stream(batch=3, tokens=20)
    beams = torch.tensor([2, 0, 0])
    cache, reordered_stream = layer(bits=4), layer(bits=4)
    cache.update(keys[..., :17, :], values[..., :17, :])
    cache.reorder_cache(beams)
    reordered_stream.update(keys[beams, :, :17], values[beams, :, :17])
    assert all(torch.equal(a, b) for a, b in zip(cache.update(keys[beams, :, 17:], values[beams, :, 17:]),
                                                   reordered_stream.update(keys[beams, :, 17:], values[beams, :, 17:]),
                                                   strict=True))  # fmt: skip
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.state.keys.codes.shape[0] == cache.state.residual_values.shape[0] == 1
    cache.batch_repeat_interleave(2)
    assert cache.state.keys.scale.shape[0] == 2


@pytest.mark.parametrize("bits", [8, 4])
def test_the_bytes_held_grow_by_the_bytes_per_token_of_the_op(bits):
    keys, values = stream(batch=1, heads=2, tokens=64, width=8)
    cache = layer(bits=bits, group_size=4, residual=5)
    cache.update(keys[..., :32, :], values[..., :32, :])
    first = decoding_state_bytes(Cache(layers=[cache]))
    for t in range(32, 64):
        cache.update(keys[..., t : t + 1, :], values[..., t : t + 1, :])
    grown = decoding_state_bytes(Cache(layers=[cache])) - first
    per_head = quantized_bytes_per_token(8, bits=bits, group_size=4, bytes_per_number=4)
    assert grown == 32 * 2 * per_head  # 32 tokens, 2 key/value heads, float32 scales
    assert isinstance(cache.state, QuantizedKVState)


def test_it_takes_the_empty_entry_of_a_cache_and_refuses_what_it_cannot_do():
    cache = DynamicCache()
    entry = QuantizedKVCacheLayer.in_cache(cache, 1)
    assert cache.layers[1] is entry and QuantizedKVCacheLayer.in_cache(cache, 1) is entry
    with pytest.raises(HeadkitError, match="needs its settings"):
        entry.update(*stream(tokens=2))
    entry.configure(bits=8, group_size=4, residual=0)
    assert entry.configure(bits=8, group_size=4, residual=0) is entry
    with pytest.raises(HeadkitError, match="cannot switch to"):
        entry.configure(bits=4, group_size=4, residual=0)
    with pytest.raises(HeadkitError, match=r"\[batch, heads, tokens, head_dim\]"):
        entry.update(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8))
    entry.update(*stream(tokens=5))
    with pytest.raises(ValueError, match="cannot be rewound"):
        entry.crop(1)


def sparse_state(batch=2, heads=2, width=8, tokens=20, seed=0):
    """The state of the compressed cache's op (sinks 2, window 4, 3 kept keys, nothing folded) after `tokens`."""
    from headkit.ops.hybrid import sparse_hybrid_attention

    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, tokens, width, generator=generator) for _ in range(3))
    zeros = torch.zeros(batch, heads, tokens, 1)
    scores = torch.rand(batch, heads, tokens, generator=generator)
    _, state = sparse_hybrid_attention(
        q, k, v, zeros, zeros, torch.zeros(heads), window=4, sinks=2, budget=3, output_final_state=True,
        key_scores=scores,
    )  # fmt: skip
    return state


@pytest.mark.parametrize("bits", [8, 4])
def test_the_compressed_cache_layer_stores_codes_reads_them_back_and_beam_search_moves_them(bits):
    from headkit.layers.quantized_cache import QuantizedHybridStateCacheLayer, exact_leaves
    from headkit.ops.quantized_cache import QuantizedTensor

    state = sparse_state()
    entry = QuantizedHybridStateCacheLayer().configure(bits=bits, group_size=4)
    assert entry.get_state() is None and entry.state_bytes() == 0
    entry.set_state(state, 20)
    stored = dict(exact_leaves(entry.state))
    assert len(stored) == 6 and all(isinstance(leaf, QuantizedTensor) for leaf in stored.values())
    assert all(
        leaf.codes.dtype == torch.uint8 and leaf.codes.shape[-1] == 8 * bits // 8 for leaf in stored.values()
    )
    back = entry.get_state()
    for (path, mine), (_, theirs) in zip(exact_leaves(back), exact_leaves(state), strict=True):
        half_step = stored[path].scale.amax(dim=(-2, -1), keepdim=True) / 2  # the field's largest step
        assert ((mine - theirs).abs() <= half_step * (1 + 1e-5) + 1e-7).all(), path
    assert torch.equal(back.sparse_scores, state.sparse_scores)  # bookkeeping kept as it is
    # read and written back (a prompt continued in chunks), every token keeps its codes
    entry.set_state(back, 0)
    after = dict(exact_leaves(entry.state))
    assert all(torch.equal(a, b) for path in stored for a, b in zip(after[path], stored[path], strict=True))
    # 2 rows · 2 heads · (3 window + 2 sinks + 3 kept) slots, a key and a value each: codes, and float32 scales and
    # zero points per group of 4 channels
    per_slot = quantized_bytes_per_token(8, bits=bits, group_size=4, bytes_per_number=4, per_token_keys=True)
    assert entry.quantized_bytes() == 2 * 2 * 8 * per_slot
    # beam search reorders the codes themselves
    codes = dict(exact_leaves(entry.state))[("sparse_keys",)].codes.clone()
    entry.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(dict(exact_leaves(entry.state))[("sparse_keys",)].codes, codes.flip(0))
    with pytest.raises(HeadkitError, match="cannot switch to bits=8, group_size=8"):
        entry.configure(bits=8, group_size=8)
