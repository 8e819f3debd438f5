"""Asymmetric low-bit quantization of a key/value cache: keys per channel, values per token (KIVI).

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv:2402.02750)
observes that a few key *channels* carry large magnitudes across every token while values have no such
structure, and so quantizes keys per channel and values per token. Every group of numbers X is quantized with
its own zero point and scale — the asymmetric round-to-nearest quantizer the paper builds on (Eq. Q below):

    (Q)   z = min X,   s = (max X − min X) / (2^B − 1),   Q(X) = round((X − z) / s),   X' = Q(X) · s + z

so that each element comes back within s/2 of itself (:func:`dequantize_keys` / :func:`dequantize_values`). The
groups (the paper's per-channel / per-token grouping, its Fig. 3 and Algorithm 1):

* **keys, per channel**: a group is one channel over ``group_size`` consecutive tokens; keys [..., T, D] give
  codes [..., T, D · B / 8] and scales / zero points [..., T / group_size, D] — one pair per channel per group of tokens.
* **values, per token**: a group is ``group_size`` consecutive channels of one token; values [..., T, D] give
  codes [..., T, D · B / 8] and scales / zero points [..., T, D / group_size].

Codes are unsigned B-bit integers (B = 8 or 4) stored in uint8, two 4-bit codes per byte (:func:`pack_codes`: the
even channel in the low nibble). Scales and zero points are kept in the dtype of the tensor quantized (what the
cache stores: two numbers per group). The zero point, a minimum of numbers of that dtype, is stored exactly; the
scale is rounded *up* to that dtype, so that the codes, computed against the stored numbers in float32, never
clamp: |X − X'| ≤ s/2 for every element, s the stored scale, before X' is rounded to the output dtype.

Because a key group spans ``group_size`` tokens, the newest tokens cannot be quantized until their group is
full; KIVI keeps a full-precision *residual* of the most recent tokens (its Algorithm 1, "The KIVI Prefill &
Decoding Algorithm").
:func:`tokens_to_quantize` says how many of the oldest residual tokens a cache moves into the quantized part: whole
groups, while at least ``residual`` tokens stay behind — a sliding residual of ``residual`` to
``residual + group_size − 1`` tokens (``residual = 0``: only the incomplete newest group), rather than one emptied
whenever it fills. :func:`quantized_bytes_per_token` is the cost per token and
key/value head, scales and zero points included.

A compressed cache (sinks, a window ring, question-chosen keys: :mod:`headkit.ops.hybrid.sparse`) keeps tokens
in slots that change one at a time, not in a growing sequence, so a key group spanning several tokens would have to
be re-quantized whenever one of its slots changes. Its exact sets are quantized per token instead, keys and values
alike (:func:`quantize_tokens`: :func:`quantize_values`' grouping, each token on its own): KIVI's per-channel
keys matter at 2 bits; at 4 bits (and so at 8) its fake-quantization study (§3, Table 1) finds per-token keys and
values close to full precision. A token is quantized once: :func:`quantize_tokens` gives a token that equals one already
stored, dequantized, that token's codes, so a token moving between slots (window → sink or kept key) or read
back and written again (a prompt continued in chunks) is not quantized a second time (quantizing a dequantized
bfloat16 token again moves it, measured: 13% of the 8-bit codes).

Each fast path has its obviously correct twin (``naive_*``: loops over the groups, element by element for the
packing), which the tests compare with exactly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from headkit.ops._validation import check_positive_int

BITS = (4, 8)


class QuantizedTensor(NamedTuple):
    """Quantized keys or values: ``codes`` uint8 [..., T, D · bits / 8] (packed along the channels), and per group
    its ``scale`` and ``zero`` point (the group's minimum) in the dtype quantized — [..., T / group_size, D] for
    keys (per channel), [..., T, D / group_size] for values (per token)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def check_bits(bits: int) -> None:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {{4, 8}}, got {bits!r}")


def levels(bits: int) -> int:
    """The largest code of `bits` bits: 2^bits − 1."""
    return (1 << bits) - 1


def _check_input(name: str, x: torch.Tensor, bits: int, group_size: int) -> None:
    check_bits(bits)
    check_positive_int("group_size", group_size)
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor [..., tokens, channels]")
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(
            f"4-bit codes are packed two per byte: {name} needs an even width, got {x.shape[-1]}"
        )


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (integers in [0, 2^bits − 1], any integer dtype) [..., D] as uint8: unchanged for 8 bits; two per byte
    for 4 bits, [..., D / 2], channel 2i in the low nibble and 2i + 1 in the high one."""
    check_bits(bits)
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The uint8 codes [..., D] that :func:`pack_codes` packed."""
    check_bits(bits)
    if bits == 8:
        return packed
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, scale, zero) of `x` grouped along `dim` (min/max over it, kept as size 1), scale and zero in
    x's dtype and the codes computed against them in float32 (float64 for float64)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.detach()
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    zero = low.to(x.dtype)
    scale = stored_scale((high.to(work) - zero.to(work)) / levels(bits), x.dtype)
    scale_w = scale.to(work)
    divisor = torch.where(scale_w > 0, scale_w, torch.ones_like(scale_w))
    codes = ((x.to(work) - zero.to(work)) / divisor).round().clamp(0, levels(bits))
    return codes.to(torch.uint8), scale, zero


def stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scale` in `dtype`, rounded up where rounding to nearest would make it smaller (a smaller scale would
    clamp the group's largest code)."""
    stored = scale.to(dtype)
    up = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    return torch.where(stored.to(scale.dtype) < scale, up, stored)


def _dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    work = torch.float64 if scale.dtype == torch.float64 else torch.float32
    return (codes.to(work) * scale.to(work) + zero.to(work)).to(dtype)


def quantize_keys(keys: torch.Tensor, *, bits: int, group_size: int) -> QuantizedTensor:
    """Keys [..., T, D] quantized per channel over groups of `group_size` tokens (T a multiple of it): codes
    [..., T, D · bits / 8], scale and zero [..., T / group_size, D] (KIVI's per-channel key quantization, Eq. Q)."""
    _check_input("keys", keys, bits, group_size)
    tokens = keys.shape[-2]
    if tokens % group_size:
        raise ValueError(f"keys are quantized in whole groups of {group_size} tokens, got {tokens} tokens")
    grouped = keys.unflatten(-2, (tokens // group_size, group_size))  # [..., T/G, G, D]
    codes, scale, zero = _quantize(grouped, bits, dim=-2)
    return QuantizedTensor(pack_codes(codes.flatten(-3, -2), bits), scale.squeeze(-2), zero.squeeze(-2))


def dequantize_keys(
    quantized: QuantizedTensor, *, bits: int, group_size: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The keys [..., T, D] that :func:`quantize_keys` quantized, back in `dtype` (the scales' by default)."""
    codes = unpack_codes(quantized.codes, bits)
    grouped = codes.unflatten(-2, (-1, group_size))  # [..., T/G, G, D]
    scale, zero = quantized.scale.unsqueeze(-2), quantized.zero.unsqueeze(-2)
    keys = _dequantize(grouped, scale, zero, dtype or quantized.scale.dtype)
    return keys.flatten(-3, -2)


def quantize_values(values: torch.Tensor, *, bits: int, group_size: int) -> QuantizedTensor:
    """Values [..., T, D] quantized per token over groups of `group_size` channels (D a multiple of it): codes
    [..., T, D · bits / 8], scale and zero [..., T, D / group_size] (KIVI's per-token value quantization, Eq. Q)."""
    _check_input("values", values, bits, group_size)
    width = values.shape[-1]
    if width % group_size:
        raise ValueError(
            f"values are quantized in groups of {group_size} channels, which must divide {width}"
        )
    grouped = values.unflatten(-1, (width // group_size, group_size))  # [..., T, D/G, G]
    codes, scale, zero = _quantize(grouped, bits, dim=-1)
    return QuantizedTensor(pack_codes(codes.flatten(-2), bits), scale.squeeze(-1), zero.squeeze(-1))


def dequantize_values(
    quantized: QuantizedTensor, *, bits: int, group_size: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The values [..., T, D] that :func:`quantize_values` quantized, back in `dtype` (the scales' by default)."""
    codes = unpack_codes(quantized.codes, bits).unflatten(-1, (-1, group_size))  # [..., T, D/G, G]
    scale, zero = quantized.scale.unsqueeze(-1), quantized.zero.unsqueeze(-1)
    return _dequantize(codes, scale, zero, dtype or quantized.scale.dtype).flatten(-2)


def empty_quantized(like: torch.Tensor, *, bits: int, group_size: int, per_channel: bool) -> QuantizedTensor:
    """No tokens yet, shaped for `like` [..., T, D] (keys: `per_channel`; values: per token)."""
    check_bits(bits)
    *lead, _, width = like.shape
    codes = like.new_empty(*lead, 0, width * bits // 8, dtype=torch.uint8)
    groups = width if per_channel else width // group_size
    return QuantizedTensor(codes, like.new_empty(*lead, 0, groups), like.new_empty(*lead, 0, groups))


def append_quantized(first: QuantizedTensor, second: QuantizedTensor) -> QuantizedTensor:
    """`first` then `second` along the tokens (keys and values alike: every field has its tokens at dim −2)."""
    return QuantizedTensor(*(torch.cat(pair, dim=-2) for pair in zip(first, second, strict=True)))


def tokens_to_quantize(residual_tokens: int, *, group_size: int, residual: int) -> int:
    """How many of the oldest of `residual_tokens` full-precision tokens a cache quantizes now: whole groups of
    `group_size`, while at least `residual` tokens stay in full precision (so between `residual` and
    `residual` + `group_size` − 1 stay once there are that many)."""
    check_positive_int("group_size", group_size)
    if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
        raise ValueError(f"residual must be a non-negative integer, got {residual!r}")
    return max(0, residual_tokens - residual) // group_size * group_size


def quantized_bytes_per_token(
    head_dim: int, *, bits: int, group_size: int, bytes_per_number: int = 2, per_token_keys: bool = False
) -> int:
    """Bytes per token of one key/value head's quantized keys and values, scales and zero points included and
    amortised over their group (the full-precision residual is a constant, not counted):

        keys:   head_dim · bits / 8  +  2 · head_dim · bytes_per_number / group_size   (a pair per channel per group)
        values: head_dim · bits / 8  +  2 · (head_dim / group_size) · bytes_per_number  (a pair per group per token)

    `per_token_keys`: keys grouped as values are (:func:`quantize_tokens`, a compressed cache's exact sets)."""
    check_bits(bits)
    check_positive_int("group_size", group_size)
    if head_dim % group_size or head_dim * bits % 8:
        raise ValueError(
            f"group_size {group_size} must divide head_dim {head_dim}, whose codes fill whole bytes"
        )
    codes = head_dim * bits // 8
    value_scales = 2 * (head_dim // group_size) * bytes_per_number
    key_scales = value_scales if per_token_keys else 2 * head_dim * bytes_per_number // group_size
    return 2 * codes + key_scales + value_scales


def _fingerprints(x: torch.Tensor) -> torch.Tensor:
    """[..., N] int64: a hash of each token's bits (collisions are told apart by comparing the tokens)."""
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()]
    weights = torch.randint(
        1, 2**31, (x.shape[-1],), generator=torch.Generator().manual_seed(0), dtype=torch.int64
    ).to(x.device)
    # int64 products and sums wrap around: a hash, not a number
    return (x.contiguous().view(bits).to(torch.int64) * weights).sum(-1)


def quantize_tokens(
    x: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    stored: QuantizedTensor | None = None,
    stored_values: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Tokens [..., N, D] quantized each on its own (:func:`quantize_values`' groups of `group_size` channels, keys
    and values alike: module docstring), except that a token equal to one of `stored_values` [..., M, D] — the
    dequantized `stored` tokens of the same leading rows — takes that token's codes, scale and zero point, so it
    dequantizes to itself and a stored token is never quantized twice. Matched by a hash of the bits, then
    compared whole."""
    fresh = quantize_values(x, bits=bits, group_size=group_size)
    if stored is None or stored_values is None or stored_values.shape[-2] == 0 or x.shape[-2] == 0:
        return fresh
    if stored_values.shape[:-2] != x.shape[:-2] or stored_values.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"stored_values must be [..., M, {x.shape[-1]}] over x's leading dims {tuple(x.shape[:-2])}, got "
            f"{tuple(stored_values.shape)}"
        )
    ordered, order = _fingerprints(stored_values).sort(dim=-1, stable=True)  # ties: the first, as the twin
    wanted = _fingerprints(x)
    at = torch.searchsorted(ordered, wanted).clamp(max=ordered.shape[-1] - 1)
    candidate = order.gather(-1, at)  # [..., N]: the stored token with the nearest hash

    def take(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.gather(-2, candidate[..., None].expand(*candidate.shape, tensor.shape[-1]))

    hit = (ordered.gather(-1, at) == wanted) & (take(stored_values) == x).all(-1)
    return QuantizedTensor(
        *(torch.where(hit[..., None], take(old), new) for old, new in zip(stored, fresh, strict=True))
    )


def store_token_(
    stored: QuantizedTensor,
    x: torch.Tensor,
    slot: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    into: torch.Tensor | None = None,
) -> None:
    """Quantize token ``slot`` of ``x`` [..., N, D] on its own (:func:`quantize_values`' groups of `group_size`
    channels, as :func:`quantize_tokens` quantizes a fresh token) into the same slot of ``stored`` (codes, scale and
    zero [..., N, ·]), in place. ``slot``: an int64 tensor of one element, so that a compiled step is not
    specialised on it (the fast decoder's fixed buffers: :class:`headkit.layers.quantized_cache.QuantizedRingHybridStateCacheLayer`).
    ``into``: the slot of ``stored`` it goes to, where not ``slot`` (a token handed over on its own)."""
    slot = slot.view(1)
    into = slot if into is None else into.view(1)
    token = quantize_values(x.index_select(-2, slot), bits=bits, group_size=group_size)
    for buffer, new in zip(stored, token, strict=True):
        buffer.index_copy_(buffer.dim() - 2, into, new.to(buffer.dtype))


# -- the obviously correct twins ---------------------------------------------------------------------------------


def naive_pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_codes`, byte by byte with Python integers."""
    check_bits(bits)
    if bits == 8:
        return codes.to(torch.uint8)
    width = codes.shape[-1]
    rows = codes.reshape(codes.numel() // width, width).tolist()
    packed = [[row[i] + 16 * row[i + 1] for i in range(0, width, 2)] for row in rows]
    return torch.tensor(packed, dtype=torch.uint8).reshape(*codes.shape[:-1], width // 2)


def _naive_group(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group (a 1-D tensor) by Eq. Q, written out: z = min, s = (max − min) / (2^B − 1), round((x − z) / s)."""
    work = torch.float64 if values.dtype == torch.float64 else torch.float32
    zero = values.min().to(values.dtype)
    exact = (values.max().to(work) - zero.to(work)) / levels(bits)
    scale = exact.to(values.dtype)
    if scale.to(work) < exact:  # rounded down: one step up, so that the largest code does not clamp
        scale = torch.nextafter(scale, torch.tensor(float("inf"), dtype=values.dtype))
    if scale.to(work) > 0:
        codes = ((values.to(work) - zero.to(work)) / scale.to(work)).round().clamp(0, levels(bits))
    else:
        codes = torch.zeros_like(values, dtype=work)
    return codes.to(torch.uint8), scale, zero


def naive_quantize_keys(keys: torch.Tensor, *, bits: int, group_size: int) -> QuantizedTensor:
    """:func:`quantize_keys`, one channel of one group of tokens at a time."""
    *lead, tokens, width = keys.shape
    flat = keys.detach().reshape(math.prod(lead), tokens, width)
    codes = torch.zeros(flat.shape, dtype=torch.uint8)
    scale = keys.new_zeros(flat.shape[0], tokens // group_size, width)
    zero = keys.new_zeros(flat.shape[0], tokens // group_size, width)
    for row in range(flat.shape[0]):
        for group in range(tokens // group_size):
            span = slice(group * group_size, (group + 1) * group_size)
            for channel in range(width):
                c, s, z = _naive_group(flat[row, span, channel], bits)
                codes[row, span, channel], scale[row, group, channel], zero[row, group, channel] = c, s, z
    packed = naive_pack_codes(codes, bits).to(keys.device)
    return QuantizedTensor(
        packed.reshape(*lead, tokens, width * bits // 8),
        scale.reshape(*lead, tokens // group_size, width),
        zero.reshape(*lead, tokens // group_size, width),
    )


def naive_dequantize_keys(quantized: QuantizedTensor, *, bits: int, group_size: int) -> torch.Tensor:
    """:func:`dequantize_keys`: code · s + z, token by token with its group's scale and zero point."""
    codes = unpack_codes(quantized.codes, bits)
    work = torch.float64 if quantized.scale.dtype == torch.float64 else torch.float32
    out = torch.zeros(codes.shape, dtype=work, device=codes.device)
    for token in range(codes.shape[-2]):
        group = token // group_size
        scale, zero = quantized.scale[..., group, :].to(work), quantized.zero[..., group, :].to(work)
        out[..., token, :] = codes[..., token, :].to(work) * scale + zero
    return out.to(quantized.scale.dtype)


def naive_quantize_values(values: torch.Tensor, *, bits: int, group_size: int) -> QuantizedTensor:
    """:func:`quantize_values`, one group of channels of one token at a time."""
    *lead, tokens, width = values.shape
    flat = values.detach().reshape(math.prod(lead) * tokens, width)
    codes = torch.zeros(flat.shape, dtype=torch.uint8)
    scale = values.new_zeros(flat.shape[0], width // group_size)
    zero = values.new_zeros(flat.shape[0], width // group_size)
    for row in range(flat.shape[0]):
        for group in range(width // group_size):
            span = slice(group * group_size, (group + 1) * group_size)
            codes[row, span], scale[row, group], zero[row, group] = _naive_group(flat[row, span], bits)
    packed = naive_pack_codes(codes, bits).to(values.device)
    return QuantizedTensor(
        packed.reshape(*lead, tokens, width * bits // 8),
        scale.reshape(*lead, tokens, width // group_size),
        zero.reshape(*lead, tokens, width // group_size),
    )


def naive_quantize_tokens(
    x: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    stored: QuantizedTensor | None = None,
    stored_values: torch.Tensor | None = None,
) -> QuantizedTensor:
    """:func:`quantize_tokens`, token by token: the first equal stored token's codes, else the token quantized."""
    fresh = naive_quantize_values(x, bits=bits, group_size=group_size)
    if stored is None or stored_values is None:
        return fresh
    *lead, tokens, _ = x.shape
    out = [field.clone().reshape(math.prod(lead), tokens, field.shape[-1]) for field in fresh]
    old = [field.reshape(math.prod(lead), -1, field.shape[-1]) for field in stored]
    rows, olds = (
        x.reshape(math.prod(lead), tokens, -1),
        stored_values.reshape(math.prod(lead), -1, x.shape[-1]),
    )
    for row in range(rows.shape[0]):
        for token in range(tokens):
            for slot in range(olds.shape[1]):
                if torch.equal(olds[row, slot], rows[row, token]):
                    for mine, theirs in zip(out, old, strict=True):
                        mine[row, token] = theirs[row, slot]
                    break
    return QuantizedTensor(*(field.reshape(*lead, tokens, field.shape[-1]) for field in out))


def naive_store_token_(
    stored: QuantizedTensor, x: torch.Tensor, slot: torch.Tensor, *, bits: int, group_size: int
) -> None:
    """:func:`store_token_`: the token quantized group by group (:func:`naive_quantize_values`), copied field by field."""
    index = int(slot)
    token = naive_quantize_values(x[..., index : index + 1, :], bits=bits, group_size=group_size)
    for buffer, new in zip(stored, token, strict=True):
        buffer[..., index : index + 1, :] = new


def naive_dequantize_values(quantized: QuantizedTensor, *, bits: int, group_size: int) -> torch.Tensor:
    """:func:`dequantize_values`: code · s + z, channel by channel with its group's scale and zero point."""
    codes = unpack_codes(quantized.codes, bits)
    work = torch.float64 if quantized.scale.dtype == torch.float64 else torch.float32
    out = torch.zeros(codes.shape, dtype=work, device=codes.device)
    for channel in range(codes.shape[-1]):
        group = channel // group_size
        scale, zero = quantized.scale[..., group].to(work), quantized.zero[..., group].to(work)
        out[..., channel] = codes[..., channel].to(work) * scale + zero
    return out.to(quantized.scale.dtype)


__all__ = [
    "BITS",
    "QuantizedTensor",
    "append_quantized",
    "check_bits",
    "dequantize_keys",
    "dequantize_values",
    "empty_quantized",
    "levels",
    "naive_dequantize_keys",
    "naive_dequantize_values",
    "naive_pack_codes",
    "naive_quantize_keys",
    "naive_quantize_tokens",
    "naive_quantize_values",
    "naive_store_token_",
    "pack_codes",
    "quantize_keys",
    "quantize_tokens",
    "quantize_values",
    "quantized_bytes_per_token",
    "store_token_",
    "stored_scale",
    "tokens_to_quantize",
    "unpack_codes",
]
