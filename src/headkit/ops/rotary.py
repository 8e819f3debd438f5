"""Rotary position embeddings (RoPE) with linear and dynamic-NTK scaling.

Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding" (arXiv:2104.09864), Eq. 34:
inside every rotary pair i the vector at position m is rotated by the angle m·θ_i, θ_i = rope_theta^(−2i/D),
so that ⟨R_m q, R_n k⟩ depends on m − n only. Pairs are (i, i + D/2) ("rotate-half", as GPT-NeoX and LLaMA).

Scaling follows 🤗 Transformers' ``rope_scaling`` / ``rope_parameters`` conventions:

* ``"linear"`` (position interpolation, Chen et al. 2023, arXiv:2306.15595): positions divided by ``factor``.
* ``"dynamic"`` (dynamic NTK-aware scaling, bloc97/emozilla 2023, as transformers'
  ``_compute_dynamic_ntk_parameters``): when the current length L exceeds the trained length L₀, the base
  becomes rope_theta · (factor·L/L₀ − (factor − 1))^(D/(D−2)); at L ≤ L₀ it is exactly plain RoPE.
  Unlike transformers' rotary module, which caches the frequencies it grew for a long input, everything here is
  computed from the positions of this call only: a short call after a long one gets plain RoPE again.

Angles are formed in float64 (the rounding of a float32 m·θ grows with the position m) and returned as float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from headkit.ops._validation import check_positive_int, check_rank, is_finite_number

ROPE_TYPES = ("default", "linear", "dynamic")
_ROPE_SCALING_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "rope_theta")


class _RopeScaling(NamedTuple):
    rope_type: str
    factor: float
    trained_length: int | None  # L₀ of dynamic NTK; None for the other rope types


def rope_inverse_frequencies(
    head_dim: int,
    *,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    seq_len: int | None = None,
    max_position_embeddings: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The rotary frequencies θ_i = base^(−2i/D), i < D/2, after scaling (RoFormer Eq. 15).

    Args:
        head_dim: D, even.
        rope_theta: the base.
        rope_scaling: None, or ``{"rope_type": "default" | "linear" | "dynamic", "factor": ...,
            "original_max_position_embeddings": ...}`` (the older key ``"type"`` is accepted too).
        seq_len: the current length L, used by dynamic NTK only (None: no longer than the trained length).
        max_position_embeddings: the trained length L₀ for dynamic NTK, unless the dict gives
            ``original_max_position_embeddings``.

    Returns:
        [D/2] tensor of ``dtype`` (float32 by default). Linear scaling divides it by ``factor``, which is the same
        as dividing the positions.
    """
    check_positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary pairs (i, i + head_dim/2)), got {head_dim}")
    _check_rope_theta(rope_theta)
    if seq_len is not None:
        check_positive_int("seq_len", seq_len)
    scaling = _parse_rope_scaling(rope_scaling, rope_theta, max_position_embeddings)

    base = float(rope_theta)
    if scaling.rope_type == "dynamic" and seq_len is not None and seq_len > scaling.trained_length:
        # With head_dim 2 the only frequency is base⁰ = 1, and the exponent D/(D−2) is undefined: nothing to do.
        if head_dim > 2:
            stretch = scaling.factor * seq_len / scaling.trained_length - (scaling.factor - 1)
            base = base * stretch ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inverse_frequencies = 1.0 / base**exponents
    if scaling.rope_type == "linear":
        inverse_frequencies = inverse_frequencies / scaling.factor
    return inverse_frequencies.to(dtype)


def dynamic_rope_length(
    rope_scaling: Mapping[str, Any] | None,
    rope_theta: float,
    max_position_embeddings: int | None,
    *position_ids: torch.Tensor,
) -> int | None:
    """The length L that dynamic NTK scales for: 1 + the largest of ``position_ids``; None under every other
    scaling, which needs no length — reading the largest position syncs with the device and breaks the graphs
    that torch.compile captures, so it is read only when it matters."""
    if _parse_rope_scaling(rope_scaling, rope_theta, max_position_embeddings).rope_type != "dynamic":
        return None
    return max([int(positions.max()) + 1 for positions in position_ids if positions.numel()], default=1)


def rotary_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    *,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    dtype: torch.dtype = torch.float32,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(m·θ_i) and sin(m·θ_i) for every position m and rotary pair i.

    Args:
        position_ids: integer positions [T] or [B, T].
        head_dim, rope_theta, rope_scaling, max_position_embeddings: as in :func:`rope_inverse_frequencies`.
        seq_len: the length dynamic NTK scales for; max(position_ids) + 1 by default. Pass it to give several
            calls the same frequencies (e.g. the queries and the keys of one attention call).
        validate: check ``position_ids``; ``False`` for callers that have (an attention layer).

    Returns:
        (cos, sin), each [B or 1, T, D/2] of ``dtype`` (float32 by default).
    """
    if validate:
        check_position_ids("position_ids", position_ids)
    if seq_len is None:
        seq_len = dynamic_rope_length(rope_scaling, rope_theta, max_position_embeddings, position_ids)
    inverse_frequencies = angle_frequencies(
        head_dim,
        position_ids.device,
        seq_len,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
    )
    positions = position_ids if position_ids.dim() == 2 else position_ids[None]
    angles = positions.to(inverse_frequencies.dtype)[..., None] * inverse_frequencies
    return angles.cos().to(dtype), angles.sin().to(dtype)


def angle_frequencies(
    head_dim: int,
    device: torch.device,
    seq_len: int | None,
    *,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None,
    max_position_embeddings: int | None,
) -> torch.Tensor:
    """:func:`rope_inverse_frequencies` [D/2] on `device`, in the dtype the angles m·θ_i are formed in: float64
    (see the module docstring), float32 on MPS, which has no float64."""
    return rope_inverse_frequencies(
        head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        seq_len=seq_len,
        max_position_embeddings=max_position_embeddings,
        dtype=torch.float32 if device.type == "mps" else torch.float64,
        device=device,
    )


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, validate: bool = True
) -> torch.Tensor:
    """Rotate every pair (x_i, x_{i+D/2}) by the angle whose cosine and sine are given (RoFormer Eq. 34).

    Args:
        x: [B, H, T, D].
        cos, sin: [B or 1, T, D/2] from :func:`rotary_cos_sin`, shared by all heads.
        validate: check the shapes; ``False`` for callers that have (an attention layer).

    Returns:
        [B, H, T, D] in x's dtype, computed in the wider of x's and cos's dtypes.
    """
    if validate:
        _check_rotary_inputs(x, cos, sin)
    half = x.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def unrotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: torch.Tensor
) -> torch.Tensor:
    """Undo the rotation of the chosen rotary pairs of already-rotated queries or keys; leave the others rotated.

    Args:
        x: [B, H, T, D], rotated by the attention module.
        cos, sin: the module's own tables, [B or 1, T, R] in 🤗 Transformers' layout (the R/2 angles twice,
            R ≤ D: partial rotary rotates the first R dimensions, pairs (i, i + R/2)).
        pairs: bool [R/2], True for the pairs to rotate back to angle 0.

    Returns [B, H, T, D] in x's dtype. Rotating back is rotating by the negative angle (RoFormer Eq. 34), so with
    the module's own tables the result is exact whatever its positions were (left padding included).
    """
    rotary = cos.shape[-1]
    half = rotary // 2
    # Angle 0 (cos 1, sin 0) on the pairs that stay rotated; the negative angle on the others.
    cos_half = torch.where(pairs, cos[..., :half], torch.ones_like(cos[..., :half]))
    sin_half = torch.where(pairs, -sin[..., :half], torch.zeros_like(sin[..., :half]))
    back = apply_rotary(x[..., :rotary], cos_half, sin_half, validate=False)
    return back if rotary == x.shape[-1] else torch.cat((back, x[..., rotary:]), dim=-1)


def _check_rotary_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_rank("x", x, 4, "[batch, heads, seq, head_dim]")
    batch, _, seq, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x must have an even head_dim (rotary pairs (i, i + head_dim/2)), got {head_dim}")
    half = head_dim // 2
    for name, table in (("cos", cos), ("sin", sin)):
        check_rank(name, table, 3, f"[batch or 1, seq, head_dim/2] = [{batch} or 1, {seq}, {half}]")
        if table.shape[0] not in (1, batch) or tuple(table.shape[1:]) != (seq, half):
            raise ValueError(
                f"{name} must have shape [batch or 1, seq, head_dim/2] = [{batch} or 1, {seq}, {half}] to match "
                f"x of shape {tuple(x.shape)}, got {tuple(table.shape)}"
            )
        if not table.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {table.dtype}")


def naive_rotary(
    x: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """Test reference for ``apply_rotary(x, *rotary_cos_sin(position_ids, ...))``: RoPE as complex numbers.

    RoFormer §3.2.2: pair i is the complex number z_i = x_i + j·x_{i+D/2}, and rotating by m·θ_i multiplies it
    by e^{j·m·θ_i}. Computed in complex128.
    """
    head_dim = x.shape[-1]
    half = head_dim // 2
    rotations = naive_rotations(
        position_ids,
        head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
    )
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * rotations
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def naive_rotations(
    position_ids: torch.Tensor,
    head_dim: int,
    *,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None,
    max_position_embeddings: int | None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """The test references' RoPE (RoFormer §3.2.2): e^{j·m·θ_i} for every position m of `position_ids` ([T] or
    [B, T]) and pair i, complex128 [B or 1, 1, T, D/2]; `seq_len` (dynamic NTK) is 1 + the largest position by
    default."""
    positions = position_ids if position_ids.dim() == 2 else position_ids[None]
    seq_len = int(positions.max()) + 1 if seq_len is None else seq_len
    frequencies = rope_inverse_frequencies(
        head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        seq_len=seq_len,
        max_position_embeddings=max_position_embeddings,
        dtype=torch.float64,
    )
    angles = positions.double()[:, None, :, None] * frequencies  # [B or 1, 1, T, D/2]
    return torch.polar(torch.ones_like(angles), angles)


def _parse_rope_scaling(
    rope_scaling: Mapping[str, Any] | None, rope_theta: float, max_position_embeddings: int | None
) -> _RopeScaling:
    if max_position_embeddings is not None:
        check_positive_int("max_position_embeddings", max_position_embeddings)
    if rope_scaling is None:
        return _RopeScaling("default", 1.0, None)
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(
            'rope_scaling must be None or a dict like {"rope_type": "linear", "factor": 2.0}, '
            f"got {type(rope_scaling).__name__}"
        )
    unknown = sorted(set(rope_scaling) - set(_ROPE_SCALING_KEYS))
    if unknown:
        raise ValueError(
            f"rope_scaling has unsupported key(s) {unknown}; expected some of {list(_ROPE_SCALING_KEYS)}"
        )

    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if "rope_type" in rope_scaling and "type" in rope_scaling and rope_scaling["type"] != rope_type:
        raise ValueError(
            f"rope_scaling gives two rope types: rope_type={rope_type!r} and type={rope_scaling['type']!r}"
        )
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling['rope_type'] must be one of {list(ROPE_TYPES)}, got {rope_type!r}")
    # A 🤗 v5 rope_parameters dict carries rope_theta too: accept it when it agrees with the argument.
    if "rope_theta" in rope_scaling and rope_scaling["rope_theta"] != rope_theta:
        raise ValueError(
            f"rope_scaling['rope_theta'] = {rope_scaling['rope_theta']!r} disagrees with rope_theta = {rope_theta!r}"
        )

    trained_length = rope_scaling.get("original_max_position_embeddings")
    if trained_length is not None:
        check_positive_int("rope_scaling['original_max_position_embeddings']", trained_length)

    factor = rope_scaling.get("factor")
    if rope_type == "default":
        if factor is not None and factor != 1:
            raise ValueError(
                f"rope_scaling['factor'] = {factor!r} has no meaning for rope_type 'default'; "
                "use rope_type 'linear' or 'dynamic'"
            )
        return _RopeScaling("default", 1.0, None)
    if factor is None:
        raise ValueError(f"rope_scaling['factor'] is required for rope_type {rope_type!r}")
    if not is_finite_number(factor) or factor <= 0:
        raise ValueError(f"rope_scaling['factor'] must be a finite number > 0, got {factor!r}")
    if rope_type == "linear":
        return _RopeScaling("linear", float(factor), None)

    if factor < 1:
        raise ValueError(f"rope_scaling['factor'] must be >= 1 for rope_type 'dynamic', got {factor!r}")
    if trained_length is None:
        trained_length = max_position_embeddings
    if trained_length is None:
        raise ValueError(
            "rope_type 'dynamic' needs the trained length: pass max_position_embeddings or set "
            "rope_scaling['original_max_position_embeddings']"
        )
    return _RopeScaling("dynamic", float(factor), trained_length)


def _check_rope_theta(rope_theta: float) -> None:
    if not is_finite_number(rope_theta) or rope_theta <= 0:
        raise ValueError(f"rope_theta must be a finite number > 0, got {rope_theta!r}")


def check_position_ids(
    name: str, position_ids: torch.Tensor, batch: int | None = None, seq: int | None = None
) -> None:
    """Integer positions [seq] or [batch, seq]; batch and seq are checked when given."""
    expected = "[seq] or [batch, seq]" if seq is None else f"[{seq}] or [{batch}, {seq}]"
    if not isinstance(position_ids, torch.Tensor):
        raise ValueError(
            f"{name} must be an integer torch.Tensor of shape {expected}, got {type(position_ids).__name__}"
        )
    if (
        position_ids.dtype.is_floating_point
        or position_ids.dtype.is_complex
        or position_ids.dtype == torch.bool
    ):
        raise ValueError(f"{name} must hold integer positions, got dtype {position_ids.dtype}")
    shape = tuple(position_ids.shape)
    if position_ids.dim() not in (1, 2) or (seq is not None and shape not in ((seq,), (batch, seq))):
        raise ValueError(f"{name} must have shape {expected}, got {shape}")
