"""CoCA: Collinear Constrained Attention.

Zhu et al. 2023, "CoCA: Fusing Position Embedding with Collinear Constrained Attention in Transformers for Long
Context Window Extending" (arXiv:2309.08646, §2). RoPE attention in which no key is free: inside every rotary
pair i (dimensions i and i + D/2, as complex numbers q̃_i = q_i + j·q_{i+D/2}) the key that query m sees at
position n is collinear with the query, k̃_mn,i = t_n,i · q̃_m,i with t_n,i ≥ 0 (the paper's k_n = q ∘ t_n).
Rotating both by RoPE (Su et al. 2021) gives

    score(m, n) = scale · Re Σ_i q̃_m,i e^{j·m·θ_i} · conj(t_n,i q̃_m,i e^{j·n·θ_i})
                = scale · Σ_i t_n,i · |q̃_m,i|² · cos((m − n)·θ_i),

a function of the relative position m − n only (shifting every position changes nothing).

Since cos((m − n)θ) = cos mθ · cos nθ + sin mθ · sin nθ, the score is an ordinary dot product of two D-dim
"collinear" vectors,

    Q'_m = [a_m ⊙ cos mθ, a_m ⊙ sin mθ]  with a_m,i = |q̃_m,i|² = q_m,i² + q_m,i+D/2²,
    K'_n = [t_n ⊙ cos nθ, t_n ⊙ sin nθ],

so :func:`coca_attention` runs :func:`torch.nn.functional.scaled_dot_product_attention` on (Q', K', V), at the time
and memory of ordinary attention. Without autograd, large calls take a few heads per SDPA call, so that the extra
D-dim vectors never exist for all heads at once: each group builds its K' and writes into a preallocated output,
and Q' is built in that output buffer itself (when Dv = D), each group's output overwriting its own Q'.

:func:`naive_coca_scores` and :func:`naive_coca_attention` implement the definition literally, as the test reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from headkit.ops._validation import check_padding_mask, check_qkv, check_rank, is_finite_number, repeat_kv
from headkit.ops.rotary import angle_frequencies, check_position_ids, dynamic_rope_length, naive_rotations

# Without autograd, the scratch memory of one group of heads (its collinear keys, its SDPA output, and its collinear
# queries unless they live in the output buffer) may take this share of the memory the call holds anyway (inputs
# and output), or _MIN_WORKSPACE_BYTES, whichever is larger: small calls (short contexts) make one SDPA call.
_WORKSPACE_FRACTION = 1 / 3
_MIN_WORKSPACE_BYTES = 1 << 20
# SDPA lets several query heads read one key/value head without copying it since torch 2.5 (enable_gqa).
_SDPA_HAS_GQA = torch.__version__ >= "2.5"


def coca_attention(
    q: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    position_ids: torch.Tensor | None = None,
    key_position_ids: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Collinear constrained attention (see the module docstring for the equations).

    Args:
        q: queries [B, H, Tq, D], D even; RoPE is applied inside, pass them unrotated.
        t: non-negative key multipliers [B, Hkv, Tk, D/2], one per rotary pair; ``H % Hkv == 0``.
        v: values [B, Hkv, Tk, Dv].
        causal: query i sees keys j ≤ i + (Tk − Tq), by index (the queries are the newest Tq tokens).
        position_ids: query positions [Tq] or [B, Tq]; by default the last Tq of arange(Tk), as when decoding
            with a key/value cache.
        key_position_ids: key positions [Tk] or [B, Tk]; arange(Tk) by default.
        rope_theta, rope_scaling, max_position_embeddings: RoPE base and scaling, as in
            :func:`headkit.ops.rotary.rotary_cos_sin`. Dynamic NTK scales for the largest query or key position.
        attention_mask: key padding mask [B, Tk], bool or 0/1 integers, True = a real token.
        scale: score scale, 1/√D by default.
        validate: check the arguments (which costs a device sync: ``t ≥ 0``). ``False`` is for callers that
            have (an attention layer: its t comes out of relu/softplus): the mask must then be bool on q's device.

    Returns:
        [B, H, Tq, Dv]. Queries that see no key at all return zeros rather than NaN.

    Q' and K' are built in float32 (float64 for float64 inputs), then handed to SDPA in v's dtype, or in the
    autocast dtype under autocast. Q' holds |q̃_i|², which overflows float16 once a rotary pair's norm passes 256:
    prefer bfloat16.
    """
    keep = attention_mask
    if validate:
        keep = _check_inputs(q, t, v, causal, position_ids, key_position_ids, attention_mask, scale)
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len, value_dim = t.shape[1], t.shape[2], v.shape[-1]
    heads_per_kv = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # The collinear vectors hold |q|²: built in at least float32 (16-bit products lose range and precision).
    work_dtype = torch.promote_types(q.dtype, torch.float32)
    query_rotation, key_rotation = _rotation_tables(
        position_ids,
        key_position_ids,
        q_len,
        kv_len,
        head_dim,
        rope_theta,
        rope_scaling,
        max_position_embeddings,
        work_dtype,
        q.device,
    )
    mask, empty_rows = _visibility_mask(keep, causal, q_len, kv_len, q.device)
    use_is_causal = causal and mask is None and q_len == kv_len
    autocast = torch.is_autocast_enabled(q.device.type)

    def attend(queries: torch.Tensor, kv_heads_slice: slice) -> torch.Tensor:
        keys = _collinear_keys(t[:, kv_heads_slice], key_rotation, work_dtype)
        if not autocast:  # under autocast SDPA picks its own dtype; otherwise it needs q, k and v alike
            queries, keys = queries.to(v.dtype), keys.to(v.dtype)
        out = _sdpa(queries, keys, v[:, kv_heads_slice], mask, use_is_causal, scale, heads_per_kv)
        return out if empty_rows is None else out.masked_fill(empty_rows, 0.0)

    out_dtype = torch.get_autocast_dtype(q.device.type) if autocast else v.dtype
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, t, v)):
        # Autograd keeps every SDPA input for the backward pass anyway: head groups would save no memory.
        kv_heads_per_group, queries_in_out = kv_heads, False
    else:
        queries_in_out = value_dim == head_dim and out_dtype == work_dtype
        kv_heads_per_group = _kv_heads_per_group(q, t, v, work_dtype, out_dtype, queries_in_out)
    if kv_heads_per_group == kv_heads:
        return attend(_collinear_queries(q, query_rotation, work_dtype), slice(None))

    out = torch.empty(batch, q_heads, q_len, value_dim, dtype=out_dtype, device=q.device)
    if queries_in_out:
        # The output buffer is free until SDPA fills it: the collinear queries of every head are built there, and
        # each group's output overwrites its group's queries once SDPA has read them.
        _collinear_queries(q, query_rotation, work_dtype, out=out)
    for first in range(0, kv_heads, kv_heads_per_group):
        kv_heads_slice = slice(first, min(first + kv_heads_per_group, kv_heads))
        q_heads_slice = slice(kv_heads_slice.start * heads_per_kv, kv_heads_slice.stop * heads_per_kv)
        if queries_in_out:
            queries = out[:, q_heads_slice]
        else:
            queries = _collinear_queries(q[:, q_heads_slice], query_rotation, work_dtype)
        group_out = attend(queries, kv_heads_slice)
        del queries  # before the next group builds its own
        out[:, q_heads_slice] = group_out
        del group_out
    return out


def naive_coca_scores(
    q: torch.Tensor,
    t: torch.Tensor,
    *,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Test reference: CoCA scores [B, H, Tq, Tk] straight from the paper's definition.

    For every (m, n) the key k_mn = q_m ∘ t_n is built (pair i of the query scaled by t_n,i), query and key are
    rotated by RoPE as complex numbers, and score = scale · ⟨R_m q_m, R_n k_mn⟩. Memory O(B·H·Tq·Tk·D): small
    shapes only.
    """
    head_dim = q.shape[-1]
    half = head_dim // 2
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    t = t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)  # query head h reads key/value head h // groups
    query_positions = query_positions if query_positions.dim() == 2 else query_positions[None]
    key_positions = key_positions if key_positions.dim() == 2 else key_positions[None]

    rope = dict(
        seq_len=max(int(query_positions.max()), int(key_positions.max())) + 1,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
    )
    complex_dtype = torch.complex128 if q.dtype == torch.float64 else torch.complex64
    # [B|1, 1, Tq, 1, D/2] and [B|1, 1, 1, Tk, D/2]
    rotate_query = naive_rotations(query_positions, head_dim, **rope)[:, :, :, None].to(complex_dtype)
    rotate_key = naive_rotations(key_positions, head_dim, **rope)[:, :, None].to(complex_dtype)

    real_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    query = torch.complex(q[..., :half].to(real_dtype), q[..., half:].to(real_dtype))[:, :, :, None, :]
    key = query * t.to(real_dtype)[:, :, None, :, :]  # k_mn = q_m ∘ t_n: [B, H, Tq, Tk, D/2]
    scores = (query * rotate_query * (key * rotate_key).conj()).real.sum(dim=-1)
    return scores * scale


def naive_coca_attention(
    q: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    position_ids: torch.Tensor | None = None,
    key_position_ids: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Test reference for :func:`coca_attention`: dense :func:`naive_coca_scores`, a mask, softmax, values."""
    q_len, kv_len = q.shape[2], t.shape[2]
    if position_ids is None:
        position_ids = torch.arange(kv_len - q_len, kv_len, device=q.device)
    if key_position_ids is None:
        key_position_ids = torch.arange(kv_len, device=q.device)
    scores = naive_coca_scores(
        q,
        t,
        query_positions=position_ids,
        key_positions=key_position_ids,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        scale=scale,
    )
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(kv_len - q_len)
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, None, :]
    sees_a_key = visible.any(dim=-1, keepdim=True)
    # A row with no visible key is set to zeros before the softmax (no NaN, not even in the gradient), then to 0.
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~sees_a_key, 0.0)
    weights = scores.softmax(dim=-1).masked_fill(~sees_a_key, 0.0)
    values = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).to(weights.dtype)
    return (weights @ values).to(v.dtype)


def _check_inputs(
    q: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    position_ids: torch.Tensor | None,
    key_position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor | None:
    """Validate coca_attention's arguments; return the key padding mask as bool (or None)."""
    check_rank("q", q, 4, "[batch, heads, seq, head_dim]")
    check_rank("t", t, 4, "[batch, kv_heads, seq, head_dim/2]")
    head_dim = q.shape[-1]
    if head_dim % 2:
        raise ValueError(f"q must have an even head_dim (rotary pairs (i, i + head_dim/2)), got {head_dim}")
    if t.shape[-1] != head_dim // 2:
        raise ValueError(
            f"t must have shape [batch, kv_heads, seq, head_dim/2] with head_dim/2 = {head_dim // 2} (one value per "
            f"rotary pair of q), got {tuple(t.shape)}"
        )
    batch, _, _, kv_len = check_qkv(q, t, v, k_name="t", same_head_dim=False)
    q_len = q.shape[2]

    for name, tensor in (("q", q), ("t", t), ("v", v)):
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if not torch.is_autocast_enabled(q.device.type) and not (q.dtype == t.dtype == v.dtype):
        raise ValueError(f"q, t and v must share one dtype, got {q.dtype}, {t.dtype} and {v.dtype}")
    if t.numel() and bool(t.amin() < 0):
        raise ValueError(
            "t must be non-negative (each key is q scaled by t inside a rotary pair), got negative entries"
        )
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if scale is not None and not is_finite_number(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")

    if position_ids is not None:
        check_position_ids("position_ids", position_ids, batch, q_len)
    if key_position_ids is not None:
        check_position_ids("key_position_ids", key_position_ids, batch, kv_len)
    keep = check_padding_mask(attention_mask, batch, kv_len)
    return None if keep is None else keep.to(q.device)


def _rotation_tables(
    position_ids: torch.Tensor | None,
    key_position_ids: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    head_dim: int,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None,
    max_position_embeddings: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[cos nθ, sin nθ] of the query and of the key positions, each [B|1, 1, T, 2, D/2].

    Queries and keys must rotate with the same frequencies (else the score is no longer relative), so dynamic NTK
    scales both for the largest position of either.
    """
    key_positions = (
        torch.arange(kv_len, device=device) if key_position_ids is None else key_position_ids.to(device)
    )
    if position_ids is None:
        query_positions = torch.arange(kv_len - q_len, kv_len, device=device)
    else:
        query_positions = position_ids.to(device)
    seq_len = dynamic_rope_length(
        rope_scaling, rope_theta, max_position_embeddings, query_positions, key_positions
    )
    # Angles in float64, as in headkit.ops.rotary (MPS has no float64).
    frequencies = angle_frequencies(
        head_dim,
        device,
        seq_len,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
    )
    angle_dtype = frequencies.dtype
    # sin x = cos(x − π/2): one cosine over the angles shifted by [0, −π/2] gives both rows of the table.
    phases = torch.tensor([[0.0], [-math.pi / 2]], dtype=angle_dtype, device=device)

    def table(positions: torch.Tensor) -> torch.Tensor:
        positions = positions if positions.dim() == 2 else positions[None]
        angles = torch.addcmul(phases, positions.to(angle_dtype)[:, None, :, None, None], frequencies)
        return angles.cos().to(dtype)

    key_table = table(key_positions)
    # (Compared only when the queries' positions were not given: the comparison syncs with the device.)
    if (
        position_ids is None
        and q_len <= kv_len
        and torch.equal(key_positions[..., kv_len - q_len :], query_positions)
    ):
        return key_table[:, :, kv_len - q_len :], key_table  # share the rows rather than recompute them
    return table(query_positions), key_table


def _collinear_queries(
    q: torch.Tensor, rotation: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Q' = [a ⊙ cos mθ, a ⊙ sin mθ], a_i = q_i² + q_{i+D/2}²: [B, h, Tq, D], written into ``out`` if given."""
    half = q.shape[-1] // 2
    q = q.to(dtype)
    energy = torch.addcmul(q[..., :half].square(), q[..., half:], q[..., half:])
    if out is None:
        return (energy[..., None, :] * rotation).flatten(-2)
    return torch.mul(energy[..., None, :], rotation, out=out.unflatten(-1, (2, half))).flatten(-2)


def _collinear_keys(t: torch.Tensor, rotation: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K' = [t ⊙ cos nθ, t ⊙ sin nθ]: [B, h, Tk, D]."""
    return (t.to(dtype)[..., None, :] * rotation).flatten(-2)


def _visibility_mask(
    keep: torch.Tensor | None, causal: bool, q_len: int, kv_len: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(boolean mask for SDPA or None, the rows that see no key or None), both broadcastable to [B, H, Tq, Tk].

    SDPA's own is_causal aligns the diagonal top-left, so a causal call with Tq ≠ Tk needs an explicit mask.
    """
    if keep is None and (not causal or q_len == kv_len):
        return None, None
    mask = None if keep is None else keep[:, None, None, :]  # [B, 1, 1, Tk]
    if causal:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
        mask = allowed if mask is None else mask & allowed
    empty_rows = ~mask.any(dim=-1, keepdim=True)
    if torch.compiler.is_compiling():
        # Reading the mask's values would split torch.compile's graph: keep the form that is right for any mask.
        return mask | empty_rows, empty_rows
    if bool(mask.all()):
        return None, None
    if not bool(empty_rows.any()):
        return mask, None
    # Softmax over no key at all is NaN: let such rows see every key, and zero them afterwards.
    return mask | empty_rows, empty_rows


def _kv_heads_per_group(
    q: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    work_dtype: torch.dtype,
    out_dtype: torch.dtype,
    queries_in_out: bool,
) -> int:
    """How many key/value heads (with their query heads) one SDPA call takes, under the workspace budget."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = t.shape[1], t.shape[2]
    heads_per_kv = q_heads // kv_heads
    value_dim = v.shape[-1]
    work_bytes = torch.empty((), dtype=work_dtype).element_size()
    out_bytes = torch.empty((), dtype=out_dtype).element_size()
    # A group holds the collinear keys of its key/value heads and the SDPA output of its query heads, plus their
    # collinear queries and the |q|² they come from unless those live in the output buffer.
    query_head_bytes = q_len * (
        out_bytes * value_dim + (0 if queries_in_out else work_bytes * (head_dim + head_dim // 2))
    )
    bytes_per_kv_head = batch * (work_bytes * kv_len * head_dim + heads_per_kv * query_head_bytes)
    held_bytes = (
        sum(x.numel() * x.element_size() for x in (q, t, v)) + batch * q_heads * q_len * value_dim * out_bytes
    )
    budget = max(_MIN_WORKSPACE_BYTES, _WORKSPACE_FRACTION * held_bytes)
    per_group = max(1, min(kv_heads, int(budget // max(bytes_per_kv_head, 1))))
    if q.device.type == "cpu" and per_group < kv_heads:
        # SDPA's CPU kernel hands each thread a contiguous run of query blocks, and under a causal mask the later
        # blocks of a head cost more: a group whose query heads split evenly over the threads stays balanced.
        threads = torch.get_num_threads()
        balanced = [n for n in range(per_group, 0, -1) if (n * heads_per_kv) % threads == 0]
        if balanced:
            per_group = balanced[0]
    return per_group


def _sdpa(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    heads_per_kv: int,
) -> torch.Tensor:
    if heads_per_kv == 1:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale
        )
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    keys, values = repeat_kv(keys, heads_per_kv), repeat_kv(values, heads_per_kv)
    return F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale
    )
