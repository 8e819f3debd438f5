"""One query token's softmax attention over keys and values stored quantized, read on their codes: the decoding
step of a compressed cache kept in int8 / int4 (:mod:`headkit.ops.hybrid.quantized`).

The codes are KIVI's (Liu et al. 2024, "KIVI", arXiv:2402.02750, Eq. Q) grouped per token as a compressed cache
stores them (:func:`headkit.ops.quantized_cache.quantize_values`: x = c · s + z per group of channels). A step
that dequantized its stored sets into float tensors before attending (what the fast step did) wrote, at batch 8
and 1/8 of SmolLM2's cache, 168 M numbers a step and read them back: four times the bytes of the codes, and in
4 bits most of the step (docs/compressed-cache.md). Here each stored row is dequantized where it is used — in
registers, one row at a time — by a compiled kernel (``ops/csrc/quantized_attention.cpp``): its scores against
the query rows of its key/value head, then its share of the weighted values.

The result is the set's *partial* softmax (flash-decoding's split, Dao et al. 2023): per query row the largest
score m, Σ_n e^{s_n − m} and Σ_n e^{s_n − m} v_n, so that a caller merges the sets it attends (a window in full
precision, the new token, the stored codes) under one normaliser: rescale each by e^{m − max m}, add.

:func:`naive_quantized_attention_partials` is the obviously correct twin: the stored tensors dequantized
(c · s + z, channel by channel), then softmax's partials written out. Where the
kernel cannot be built (no compiler, ``HEADKIT_EXTENSIONS=0``) or cannot take the call (float64, a group of odd
width in 4 bits), the op dequantizes the set and attends to it in PyTorch: the same partials.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from headkit.ops.extensions import load_extension
from headkit.ops.quantized_cache import (
    QuantizedTensor,
    check_bits,
    dequantize_values,
    naive_dequantize_values,
)

_OP = "headkit::quantized_attention_partials"


class CodedSlots(NamedTuple):
    """Slots of keys or values stored as codes, as a decoding step reads and writes them
    (:func:`headkit.ops.hybrid.quantized.dequantized_ring`): ``codes``, the stored
    :class:`~headkit.ops.quantized_cache.QuantizedTensor` [B, Hkv, N, ·], attended on and read where they are; and
    ``entering`` [B, Hkv, D], the numbers of the key each head's step writes into a slot, which the caller stores
    (as its codes, where it has them: a key that moves keeps them; else quantized from these numbers). Where the
    step chooses the slot (a compressed cache's kept keys), ``slot`` [B, Hkv] int64 and ``written`` [B, Hkv] bool,
    when given, are set to each head's slot and whether a key entered it, so that the caller finds them without
    comparing the bookkeeping of every slot before and after the step."""

    codes: QuantizedTensor
    entering: torch.Tensor
    slot: torch.Tensor | None = None
    written: torch.Tensor | None = None


def quantized_layout(stored: QuantizedTensor, width: int) -> tuple[int, int]:
    """(bits, group_size) of per-token codes ``stored`` of rows ``width`` numbers wide: what the codes' and scales'
    widths say (the bits a number takes, the channels a scale spans)."""
    codes, groups = stored.codes.shape[-1], stored.scale.shape[-1]
    bits = codes * 8 // width if width else 0
    if bits * width != codes * 8 or groups == 0 or width % groups:
        raise ValueError(
            f"codes {codes} bytes wide with {groups} scales per row do not store rows of {width} numbers"
        )
    check_bits(bits)
    return bits, width // groups


def quantized_attention_partials(
    queries: torch.Tensor,
    keys: QuantizedTensor,
    values: QuantizedTensor,
    visible: torch.Tensor,
    *,
    scale: float,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax's partials of query rows ``queries`` [B, Hkv, G, D] (the G query heads of each key/value head) over
    ``N`` stored tokens: ``keys`` and ``values`` per-token codes ([B, Hkv, N, ·], rows of D and ``value_dim``
    numbers), ``visible`` [B, Hkv or 1, N] bool. Returns (m [B, Hkv, G, 1], Σ e^{s − m} [B, Hkv, G, 1],
    Σ e^{s − m} v [B, Hkv, G, Dv]), s = scale · q·k, in float32 (float64 for float64 queries): m = −inf, the sums
    0 for a row that sees nothing. Inference only: no gradient flows to the codes (they are integers) or the
    queries."""
    bits, group_size = quantized_layout(keys, queries.shape[-1])
    value_bits, value_group = quantized_layout(values, value_dim)
    if (value_bits, value_group) != (bits, group_size):
        raise ValueError(
            f"keys and values must share bits and group size, got {bits}/{group_size} and {value_bits}/{value_group}"
        )
    if queries.dtype == torch.float64 or group_size % (8 // bits) or queries.device.type != "cpu":
        return _dequantized_partials(queries, keys, values, visible, scale, bits, group_size)
    return _partials_op(
        queries.detach().to(torch.float32).contiguous(),
        keys.codes.contiguous(),
        keys.scale.to(torch.float32).contiguous(),
        keys.zero.to(torch.float32).contiguous(),
        values.codes.contiguous(),
        values.scale.to(torch.float32).contiguous(),
        values.zero.to(torch.float32).contiguous(),
        visible.to(torch.bool).contiguous(),
        float(scale),
        bits,
        group_size,
    )


@torch.library.custom_op(_OP, mutates_args=())
def _partials_op(
    queries: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    bits: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # A custom op, so that a compiled decoding step calls the kernel as one opaque node (Inductor cannot trace it).
    extension = load_extension("quantized_attention")
    keys = QuantizedTensor(key_codes, key_scale, key_zero)
    values = QuantizedTensor(value_codes, value_scale, value_zero)
    if extension is None:
        return _dequantized_partials(queries, keys, values, visible, scale, bits, group_size)
    maxima, sums, numerators = extension.quantized_attention_partials(
        queries, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, visible, scale, bits,
        group_size,
    )  # fmt: skip
    return maxima.unsqueeze(-1), sums.unsqueeze(-1), numerators


@_partials_op.register_fake
def _(
    queries,
    key_codes,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    visible,
    scale,
    bits,
    group_size,
):
    rows = queries.shape[:3]
    value_dim = value_codes.shape[-1] * 8 // bits
    return queries.new_empty(*rows, 1), queries.new_empty(*rows, 1), queries.new_empty(*rows, value_dim)


def _dequantized_partials(
    queries: torch.Tensor,
    keys: QuantizedTensor,
    values: QuantizedTensor,
    visible: torch.Tensor,
    scale: float,
    bits: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partials with the set dequantized first (the PyTorch path, batched)."""
    work = torch.float64 if queries.dtype == torch.float64 else torch.float32

    def numbers(x: QuantizedTensor) -> torch.Tensor:  # c · s + z in the working dtype, not the scales'
        exact = QuantizedTensor(x.codes, x.scale.to(work), x.zero.to(work))
        return dequantize_values(exact, bits=bits, group_size=group_size)

    return _partials(queries.to(work), numbers(keys), numbers(values), visible, scale)


def _partials(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores = (queries @ keys.transpose(-1, -2) * scale).masked_fill(~visible[:, :, None, :], float("-inf"))
    maxima = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - maxima.clamp_min(torch.finfo(scores.dtype).min))
    return maxima, weights.sum(dim=-1, keepdim=True), weights @ values


# -- the obviously correct twin -----------------------------------------------------------------------------------


def naive_quantized_attention_partials(
    queries: torch.Tensor,
    keys: QuantizedTensor,
    values: QuantizedTensor,
    visible: torch.Tensor,
    *,
    scale: float,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantized_attention_partials`: every stored number dequantized channel by channel, then each query
    row's scores, their largest, the weights and the weighted sum, one key/value head and row at a time. The
    numbers are c · s + z in float64, not rounded to the scales' dtype: what the op attends to."""
    bits, group_size = quantized_layout(keys, queries.shape[-1])
    work, options = torch.float64, {"bits": bits, "group_size": group_size}
    # c · s + z in float64: the scales widened first, so the twin's dequantizer does not round to their dtype
    key_numbers, value_numbers = (
        naive_dequantize_values(QuantizedTensor(x.codes, x.scale.to(work), x.zero.to(work)), **options)
        for x in (keys, values)
    )
    batch, kv_heads, rows = queries.shape[:3]
    maxima = torch.full((batch, kv_heads, rows, 1), float("-inf"), dtype=work)
    sums = torch.zeros(batch, kv_heads, rows, 1, dtype=work)
    numerators = torch.zeros(batch, kv_heads, rows, value_dim, dtype=work)
    for b in range(batch):
        for h in range(kv_heads):
            seen = visible[b, h if visible.shape[1] > 1 else 0]
            if not bool(seen.any()):
                continue
            for r in range(rows):
                scores = (key_numbers[b, h][seen] @ queries[b, h, r].to(work)) * scale
                maxima[b, h, r, 0] = scores.max()
                weights = torch.exp(scores - scores.max())
                sums[b, h, r, 0] = weights.sum()
                numerators[b, h, r] = weights @ value_numbers[b, h][seen]
    out = torch.float64 if queries.dtype == torch.float64 else torch.float32
    return maxima.to(out), sums.to(out), numerators.to(out)


__all__ = [
    "CodedSlots",
    "naive_quantized_attention_partials",
    "quantized_attention_partials",
    "quantized_layout",
]
