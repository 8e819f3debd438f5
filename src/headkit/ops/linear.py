"""Linear attention: Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive Transformers with
Linear Attention" (arXiv:2006.16236).

With the kernel similarity sim(q, k) = φ(q)ᵀ φ(k) (Eq. 3), the sums over keys factor out of the query (Eq. 4):

    out_i = φ(q_i)ᵀ S / (φ(q_i)ᵀ z + eps),    S = Σ_j φ(k_j) v_jᵀ   [Dk, Dv],    z = Σ_j φ(k_j)   [Dk].

Under causal masking the sums run over j ≤ i (S_i, Z_i of Eq. 10-11), which is an RNN with the constant-size
state (S_i, z_i) (Eq. 16-20): :func:`linear_attention_step` decodes one token with it.

The causal forward is chunkwise-parallel (the form used by e.g. Yang et al. 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training", §2.2). Cut the sequence into chunks of C tokens; for chunk c,

    numerator_c = tril(φ(Q_c) φ(K_c)ᵀ) V_c  +  φ(Q_c) S_{<c},        S_{<c} = S_0 + Σ_{c' < c} φ(K_c')ᵀ V_c',

a dense C×C matmul inside the chunk plus one [Dk, Dv] state per chunk obtained by a prefix sum (the
denominator likewise, with z in place of S and row sums of the chunk scores): O(T·C·D + T·D²) time and no
Python loop over tokens. Chunks are taken in blocks of a few hundred tokens that carry the state, so that
φ(q), φ(k), chunk scores and per-chunk states exist for one block at a time: peak memory stays ≈ inputs +
output and each block's working set stays in cache. Everything is accumulated in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from headkit.ops._precision import autocast_disabled
from headkit.ops._validation import check_eps, check_padding_mask, check_positive_int, check_qkv, repeat_kv
from headkit.ops.extensions import load_extension
from headkit.ops.feature_maps import elu_plus_one, get_feature_map

# Elements per block-sized intermediate (φ(q), chunk scores, ...) of the causal forward, 1 MiB in float32: big
# enough to amortise the per-block Python overhead, small enough to stay in a core's L2 cache (measured ~1.4x
# faster than 4 MiB blocks at T = 8192, one thread) and to keep the peak memory near inputs + output.
_BLOCK_ELEMENTS = 1 << 18
# Tokens per chunk of the causal form: at head_dim 64 the [C, C] chunk products cost as much as the [Dk, Dv]
# state products (FLOPs ∝ C·D vs D², see causal_linear_attention_flops), and 64×64 matmuls run near the
# machine's matmul rate on CPU.
DEFAULT_CHUNK_SIZE = 64
# Implementations of the causal forward (see `kernel` in linear_attention).
KERNELS = ("auto", "chunked", "fused")


class LinearAttentionState(NamedTuple):
    """Recurrent state of linear attention, one per key/value head, always float32.

    kv: Σ_j φ(k_j) v_jᵀ, [batch, kv_heads, head_dim, head_dim_v] (S_i of Eq. 10).
    k_sum: Σ_j φ(k_j), [batch, kv_heads, head_dim] (Z_i of Eq. 10).
    """

    kv: torch.Tensor
    k_sum: torch.Tensor


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str | Callable[[torch.Tensor], torch.Tensor] = "elu",
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: LinearAttentionState | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    validate: bool = True,
    kernel: str = "auto",
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Linear attention out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + eps) (Eq. 4; causal Eq. 9-11).

    Args:
        q: queries [B, H, Tq, Dk].
        k, v: keys and values [B, Hkv, Tk, Dk] / [B, Hkv, Tk, Dv]; ``H % Hkv == 0`` (grouped-query attention:
            query head h reads key/value head h // (H / Hkv)). Causal mode needs Tq == Tk.
        feature_map: a name registered in :data:`headkit.ops.FEATURE_MAPS` ("elu" = elu(x) + 1, Eq. 7) or a
            callable Tensor -> Tensor of the same shape.
        causal: sum over keys j ≤ i only; otherwise over all keys.
        attention_mask: key padding mask [B, Tk], bool or 0/1 integers, True = real token. Padded keys
            contribute nothing (their values must still be finite).
        chunk_size: tokens per chunk of the causal chunkwise-parallel form (a speed knob; results agree up to
            rounding). Ignored when not causal.
        initial_state: sums over keys that precede this call (e.g. from a prefill with
            ``output_final_state=True``); every query also sees them. None = empty.
        output_final_state: also return the state after the last key.
        eps: added to the denominator; a query that sees no key at all returns zeros.
        validate: False skips the checks, for a caller (a layer) that built the inputs itself: a bool mask or
            None, a state this op returned.
        kernel: the causal forward's implementation: "chunked" (PyTorch, every device, dtype and autograd),
            "fused" (the compiled kernel of ``ops/csrc/causal_linear_attention.cpp``, forward and backward:
            float32 on CPU, eager (not under torch.compile or a torch.func transform), each chunk's products
            kept in cache; its backward is once differentiable, so a double backward raises; see
            :mod:`headkit.ops.extensions`), or "auto": fused wherever it applies and the extension is
            available, else chunked. Ignored when not causal.

    Returns:
        (out [B, H, Tq, Dv] in q's dtype, final :class:`LinearAttentionState` or None). Accumulation is
        float32, even under ``torch.autocast``.
    """
    if validate:
        batch, _, kv_heads, kv_len = check_qkv(q, k, v)
    else:
        batch, (kv_heads, kv_len) = q.shape[0], k.shape[1:3]
    q_len, head_dim, head_dim_v = q.shape[2], k.shape[3], v.shape[3]
    if validate and causal and q_len != kv_len:
        raise ValueError(
            f"causal linear attention needs k and v with the same seq length as q ({q_len}), got {kv_len}"
        )
    phi = get_feature_map(feature_map)
    if validate:
        check_positive_int("chunk_size", chunk_size)
        check_eps(eps)
        keep = check_padding_mask(attention_mask, batch, kv_len)
        kv, k_sum = _checked_state(
            initial_state, "initial_state", batch, kv_heads, head_dim, head_dim_v, q.device
        )
    else:
        keep = attention_mask
        kv, k_sum = initial_state or _checked_state(
            None, "initial_state", batch, kv_heads, head_dim, head_dim_v, q.device
        )
    if keep is not None:
        keep = keep.to(q.device)
    extension = _fused_extension(kernel, causal, q, k, v, kv, k_sum)

    with autocast_disabled(q.device):
        if extension is not None:
            out, kv, k_sum = _fused_causal_linear_attention(
                extension, q, k, v, keep, kv, k_sum, phi, chunk_size, eps
            )
        elif causal:
            out, kv, k_sum = _causal_linear_attention(q, k, v, keep, kv, k_sum, phi, chunk_size, eps)
        else:
            out, kv, k_sum = _non_causal_linear_attention(q, k, v, keep, kv, k_sum, phi, eps)
    return out, (LinearAttentionState(kv, k_sum) if output_final_state else None)


def causal_linear_attention_flops(
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    head_dim_v: int | None = None,
    *,
    kv_heads: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> int:
    """Floating-point operations (2 per multiply-add) of the matmuls of the causal chunkwise form.

    Per query head and chunk of c tokens: the scores φ(Q_c)φ(K_c)ᵀ (2c²·Dk, the whole [c, c] block, which is
    what is computed) and their product with V_c (2c²·Dv), and the read of the earlier chunks' state φ(Q_c)S
    (2c·Dk·Dv); per key/value head and chunk, the chunk's state φ(K_c)ᵀV_c (2c·Dk·Dv). The prefix sum over
    chunk states, the denominators and the feature map are left out (a few % at most). At B=1, H=8, T=8192,
    D=64, C=64: 2.15 GFLOP.
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kv_heads = heads if kv_heads is None else kv_heads
    whole, tail = divmod(seq_len, chunk_size)
    square_tokens = whole * chunk_size**2 + tail**2  # Σ over chunks of c²
    per_query_head = 2 * square_tokens * (head_dim + head_dim_v) + 2 * seq_len * head_dim * head_dim_v
    per_kv_head = 2 * seq_len * head_dim * head_dim_v
    return batch * (heads * per_query_head + kv_heads * per_kv_head)


def linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: LinearAttentionState | None,
    *,
    feature_map: str | Callable[[torch.Tensor], torch.Tensor] = "elu",
    eps: float = 1e-6,
    validate: bool = True,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """One step of the recurrent form (Eq. 16-20): fold token t into the state, then read it with q_t.

    Args:
        q: the new query [B, H, 1, Dk]; k, v: the new key/value [B, Hkv, 1, Dk] / [B, Hkv, 1, Dv].
        state: :class:`LinearAttentionState` of the tokens before (None = empty).
        validate: False skips the checks, for a caller that passes a state this op returned (or None).

    Returns:
        (out [B, H, 1, Dv] in q's dtype, the state including this token, float32). Decoding a sequence token
        by token gives the causal :func:`linear_attention` output.
    """
    phi = get_feature_map(feature_map)
    head_dim, head_dim_v = k.shape[3], v.shape[3]
    if validate:
        batch, q_heads, kv_heads, _ = check_qkv(q, k, v)
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            if tensor.shape[2] != 1:
                raise ValueError(
                    f"{name} must hold one token, shape [batch, heads, 1, head_dim], got {tuple(tensor.shape)}"
                )
        check_eps(eps)
        kv, k_sum = _checked_state(state, "state", batch, kv_heads, head_dim, head_dim_v, q.device)
    else:
        (batch, q_heads), kv_heads = q.shape[:2], k.shape[1]
        kv, k_sum = state or _checked_state(None, "state", batch, kv_heads, head_dim, head_dim_v, q.device)

    with autocast_disabled(q.device):
        phi_q = _feature(phi, q.float()).reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
        phi_k = _feature(phi, k.float())  # [B, Hkv, 1, Dk]
        kv = torch.addcmul(kv, phi_k.transpose(-1, -2), v.float())  # + φ(k)vᵀ: one broadcast outer product
        k_sum = k_sum + phi_k.squeeze(2)
        numerator = phi_q @ kv  # [B, Hkv, G, Dv]
        denominator = phi_q @ k_sum.unsqueeze(-1)  # [B, Hkv, G, 1]
        out = (numerator / (denominator + eps)).reshape(batch, q_heads, 1, head_dim_v)
    return out.to(q.dtype), LinearAttentionState(kv, k_sum)


def naive_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str | Callable[[torch.Tensor], torch.Tensor] = "elu",
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Test reference for :func:`linear_attention`: the dense O(T²) form of Eq. 2-3 with an explicit mask.

    out_i = Σ_j w_ij v_j / (Σ_j w_ij + eps) with w_ij = φ(q_i)ᵀ φ(k_j) where key j is visible to query i, plus
    the initial state's sums. Computed in q's dtype (pass float64 for a high-precision reference); the
    returned state is in that dtype too.
    """
    batch, q_heads, kv_heads, kv_len = check_qkv(q, k, v)
    groups = q_heads // kv_heads
    q_len = q.shape[2]
    phi = get_feature_map(feature_map)
    keep = check_padding_mask(attention_mask, batch, kv_len)
    if keep is None:
        keep = torch.ones(batch, kv_len, dtype=torch.bool, device=q.device)

    visible = keep[:, None, None, :].expand(batch, q_heads, q_len, kv_len)
    if causal:
        visible = visible & torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril()
    phi_q = phi(q)
    phi_k = phi(k) * keep[:, None, :, None]
    weights = (phi_q @ repeat_kv(phi_k, groups).transpose(-1, -2)) * visible
    numerator = weights @ repeat_kv(v, groups)
    denominator = weights.sum(dim=-1, keepdim=True)

    kv = torch.einsum("bhtd,bhte->bhde", phi_k, v)
    k_sum = phi_k.sum(dim=2)
    if initial_state is not None:
        kv0, k_sum0 = initial_state.kv.to(q.dtype), initial_state.k_sum.to(q.dtype)
        numerator = numerator + phi_q @ repeat_kv(kv0, groups)
        denominator = denominator + phi_q @ repeat_kv(k_sum0.unsqueeze(-1), groups)
        kv, k_sum = kv + kv0, k_sum + k_sum0
    out = numerator / (denominator + eps)
    return out, (LinearAttentionState(kv, k_sum) if output_final_state else None)


def _fused_extension(kernel: str, causal: bool, *tensors: torch.Tensor) -> ModuleType | None:
    """The compiled kernel's module if this call takes it (see ``kernel`` in :func:`linear_attention`), else None."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    if kernel == "chunked" or not causal:
        return None
    why_not = _fused_unsupported(tensors)
    if why_not is not None:
        if kernel == "fused":
            raise ValueError(f"kernel='fused' needs {why_not}; kernel='auto' falls back to the chunked form")
        return None
    extension = load_extension("causal_linear_attention")
    if extension is None and kernel == "fused":
        raise RuntimeError("kernel='fused': the compiled extension is not available here (see the warning)")
    return extension


def _fused_unsupported(tensors: tuple[torch.Tensor, ...]) -> str | None:
    """Why the fused kernel cannot take these tensors (q, k, v and the state), or None if it can. Autograd is
    fine (the kernel has a backward, once differentiable: a double backward raises)."""
    if any(t.device.type != "cpu" for t in tensors):
        return "tensors on the CPU"
    if any(t.dtype != torch.float32 for t in tensors):
        return "float32 tensors"
    if torch.compiler.is_compiling():
        return "an eager call (torch.compile traces the chunked form)"
    if torch._C._are_functorch_transforms_active():
        return "no torch.func transform (grad, vmap, ...: they run the chunked form)"
    return None


def _fused_causal_linear_attention(
    extension: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    phi: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal form through the compiled kernel; returns (out, final kv, final k_sum) like the chunked one.
    elu + 1 is computed inside the kernel; any other feature map is applied here first (autograd goes through it
    into the kernel's backward, which then differentiates w.r.t. the features)."""
    elu = phi is elu_plus_one
    if not elu:
        q, k = _feature(phi, q), _feature(phi, k)
    keep_bytes = torch.empty(0, dtype=torch.uint8) if keep is None else keep.to(torch.uint8).contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, kv, k_sum)):
        return _FusedCausalLinearAttention.apply(
            extension, q, k, v, keep_bytes, kv, k_sum, chunk_size, eps, elu
        )
    return _kernel_forward(extension, q, k, v, keep_bytes, kv, k_sum, chunk_size, eps, elu)


def _kernel_forward(
    extension: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep_bytes: torch.Tensor,
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    chunk_size: int,
    eps: float,
    elu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, final kv, final k_sum) from the kernel, which advances a contiguous copy of the state in place
    (the caller's initial state is left as it was)."""
    final_kv = kv.clone(memory_format=torch.contiguous_format)
    final_k_sum = k_sum.clone(memory_format=torch.contiguous_format)
    out = extension.causal_linear_attention(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        keep_bytes,
        final_kv,
        final_k_sum,
        chunk_size,
        float(eps),
        elu,
    )
    return out, final_kv, final_k_sum


class _FusedCausalLinearAttention(torch.autograd.Function):
    """The compiled kernel's forward and backward as one autograd node: (out, final kv, final k_sum) from
    (q, k, v, initial kv, initial k_sum), pre-feature q and k when ``elu`` (φ = elu + 1 inside the kernel), else
    the features. The backward recomputes the chunk scores and states from the saved inputs and output; it is
    not itself differentiable (a double backward raises)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        extension: ModuleType,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep_bytes: torch.Tensor,
        kv: torch.Tensor,
        k_sum: torch.Tensor,
        chunk_size: int,
        eps: float,
        elu: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kv, k_sum = kv.contiguous(), k_sum.contiguous()  # the initial state, kept for the backward
        out, final_kv, final_k_sum = _kernel_forward(
            extension, q, k, v, keep_bytes, kv, k_sum, chunk_size, eps, elu
        )
        ctx.save_for_backward(q, k, v, keep_bytes, kv, k_sum, out)
        ctx.extension, ctx.chunk_size, ctx.eps, ctx.elu = extension, chunk_size, float(eps), elu
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to build
        return out, final_kv, final_k_sum

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx,
        grad_out: torch.Tensor | None,
        grad_kv: torch.Tensor | None,
        grad_k_sum: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, keep_bytes, kv, k_sum, out = ctx.saved_tensors
        empty = q.new_empty(0)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
        grad_q, grad_k, grad_v, grad_kv, grad_k_sum = ctx.extension.causal_linear_attention_backward(
            q, k, v, keep_bytes, kv, k_sum, out, grad_out,
            empty if grad_kv is None else grad_kv.contiguous(),
            empty if grad_k_sum is None else grad_k_sum.contiguous(),
            ctx.chunk_size, ctx.eps, ctx.elu,
        )  # fmt: skip
        return None, grad_q, grad_k, grad_v, None, grad_kv, grad_k_sum, None, None, None


def _causal_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    phi: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunkwise-parallel causal form, block by block; returns (out, final kv, final k_sum)."""
    batch, q_heads, seq_len, _ = q.shape
    kv_heads, head_dim_v = k.shape[1], v.shape[3]
    groups = q_heads // kv_heads
    q = q.unflatten(1, (kv_heads, groups))  # [B, Hkv, G, T, Dk]
    keep = None if keep is None else keep[:, None, :, None]  # [B, 1, T, 1]

    # Blocks of whole chunks, then the leftover T mod C tokens as one shorter chunk: no padding copy.
    whole = seq_len - seq_len % chunk_size
    elements_per_chunk = batch * q_heads * chunk_size * max(q.shape[-1], head_dim_v)
    chunks_per_block = _BLOCK_ELEMENTS // max(1, elements_per_chunk)
    block_len = chunk_size * max(1, chunks_per_block)
    spans = [(start, min(block_len, whole - start), chunk_size) for start in range(0, whole, block_len)]
    if whole < seq_len:
        spans.append((whole, seq_len - whole, seq_len - whole))

    # With autograd, concatenating the blocks keeps the backward cheap; without it, writing each block into
    # the preallocated output keeps the peak memory at one output.
    build_graph = (
        seq_len > 0 and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, kv, k_sum))
    )
    out = q.new_empty(0) if build_graph else q.new_empty(batch, kv_heads, groups, seq_len, head_dim_v)
    pieces = []
    # One split per input rather than a slice per block: the backward of a split is a single concatenation,
    # while each slice's backward would materialise a full-length zero gradient.
    lengths = [length for _, length, _ in spans]
    blocks = zip(q.split(lengths, dim=3), k.split(lengths, dim=2), v.split(lengths, dim=2), strict=True)
    for (start, length, chunk), (q_block, k_block, v_block) in zip(spans, blocks, strict=True):
        block_keep = None if keep is None else keep[:, :, start : start + length]
        numerator, denominator, kv, k_sum = _causal_block(
            q_block, k_block, v_block, block_keep, kv, k_sum, phi, chunk, eps
        )
        if build_graph:
            pieces.append((numerator / denominator).to(q.dtype))
        else:
            torch.div(numerator, denominator, out=out[:, :, :, start : start + length])
    if build_graph:
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=3)
    return out.reshape(batch, q_heads, seq_len, head_dim_v), kv, k_sum


def _causal_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    phi: Callable[[torch.Tensor], torch.Tensor],
    chunk: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of L = n·C tokens: q [B, Hkv, G, L, Dk], k [B, Hkv, L, Dk], v [B, Hkv, L, Dv], keep
    [B, 1, L, 1] or None; kv [B, Hkv, Dk, Dv] and k_sum [B, Hkv, Dk] summarise every earlier token.

    Returns the block's numerator [B, Hkv, G, L, Dv] and denominator (eps included) [B, Hkv, G, L, 1], both
    float32, and the state after the block. The caller divides, straight into the output when it can.
    """
    batch, kv_heads, groups, length, head_dim = q.shape
    head_dim_v = v.shape[-1]
    n_chunks = length // chunk
    rows = batch * kv_heads * n_chunks  # the batch of every matmul below
    # Every matmul below is a plain batched matmul over (batch, kv head, chunk). The G query heads that share
    # a key/value head are stacked as rows, so keys, values and states are never repeated per query head.
    phi_q = _feature(phi, q.float()).unflatten(3, (n_chunks, chunk)).transpose(2, 3)
    phi_q = phi_q.reshape(rows, groups * chunk, head_dim)  # [B·Hkv·n, G·C, Dk]
    phi_k = _feature(phi, k.float())
    if keep is not None:
        phi_k = phi_k.masked_fill(~keep, 0.0)  # a zero feature drops the key from every sum
    phi_k = phi_k.reshape(rows, chunk, head_dim)  # [B·Hkv·n, C, Dk]
    values = v.float().reshape(rows, chunk, head_dim_v)  # [B·Hkv·n, C, Dv]

    # Per-chunk sums Σ φ(k_j) v_jᵀ and Σ φ(k_j); an exclusive prefix sum seeded with the incoming state gives
    # what each chunk's queries see from before their chunk.
    chunk_kv = torch.bmm(phi_k.transpose(1, 2), values)  # [B·Hkv·n, Dk, Dv]
    chunk_k_sum = phi_k.sum(dim=1)  # [B·Hkv·n, Dk]
    per_head = (batch * kv_heads, n_chunks)
    kv_before, kv = _exclusive_prefix_sum(chunk_kv.view(*per_head, head_dim * head_dim_v), kv)
    k_sum_before, k_sum = _exclusive_prefix_sum(chunk_k_sum.view(*per_head, head_dim), k_sum)
    kv_before = kv_before.view(rows, head_dim, head_dim_v)
    k_sum_before = k_sum_before.view(rows, 1, head_dim)

    # Inside the chunk: φ(q_i)ᵀφ(k_j) for j ≤ i, one [C, C] lower triangle per stacked query head.
    scores = torch.bmm(phi_q, phi_k.transpose(1, 2))  # [B·Hkv·n, G·C, C]
    scores.view(-1, groups, chunk, chunk).tril_()
    # Earlier chunks through the prefix state, plus this chunk through the masked scores.
    numerator = torch.bmm(phi_q, kv_before).baddbmm_(scores, values)  # [B·Hkv·n, G·C, Dv]
    denominator = (phi_q * k_sum_before).sum(dim=2, keepdim=True) + scores.sum(dim=2, keepdim=True) + eps

    def block_layout(x: torch.Tensor) -> torch.Tensor:  # [B·Hkv·n, G·C, X] -> [B, Hkv, G, L, X]
        x = x.view(batch, kv_heads, n_chunks, groups, chunk, x.shape[-1]).transpose(2, 3)
        return x.reshape(batch, kv_heads, groups, length, x.shape[-1])

    return block_layout(numerator), block_layout(denominator), kv, k_sum


def _exclusive_prefix_sum(
    chunk_sums: torch.Tensor, initial: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_sums [M, n, X], initial [M, ...] of X elements -> (initial + Σ_{c' < c} chunk_sums[c'] for
    every c, as [M, n, X]; and initial + Σ_c chunk_sums[c], in initial's shape).

    A matmul with a strictly lower-triangular matrix of ones: much faster on CPU than a cumsum over a middle
    dimension.
    """
    batch, n_chunks, size = chunk_sums.shape
    strictly_lower = torch.ones(n_chunks, n_chunks, dtype=chunk_sums.dtype, device=chunk_sums.device).tril(-1)
    flat_initial = initial.reshape(batch, 1, size)
    before = torch.baddbmm(flat_initial, strictly_lower.expand(batch, -1, -1), chunk_sums)
    total = before[:, -1] + chunk_sums[:, -1]
    return before, total.view_as(initial)


def _non_causal_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    phi: Callable[[torch.Tensor], torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 5, φ(Q)(φ(K)ᵀV): the key sums are taken once. Returns (out, final kv, final k_sum)."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, head_dim_v = k.shape[1], v.shape[3]
    phi_k = _feature(phi, k.float())
    if keep is not None:
        phi_k = phi_k.masked_fill(~keep[:, None, :, None], 0.0)
    kv = kv + phi_k.transpose(-1, -2) @ v.float()
    k_sum = k_sum + phi_k.sum(dim=2)
    # The queries of a group all read the same key/value head: stack them as the rows of one matmul,
    # [B, Hkv, G·Tq, Dk].
    phi_q = _feature(phi, q.float()).reshape(batch, kv_heads, q_heads // kv_heads * q_len, head_dim)
    out = (phi_q @ kv) / (phi_q @ k_sum.unsqueeze(-1) + eps)
    return out.reshape(batch, q_heads, q_len, head_dim_v).to(q.dtype), kv, k_sum


def _feature(phi: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    mapped = phi(x)
    if not isinstance(mapped, torch.Tensor) or mapped.shape != x.shape:
        got = tuple(mapped.shape) if isinstance(mapped, torch.Tensor) else type(mapped).__name__
        raise ValueError(f"feature_map must return a tensor of its input's shape {tuple(x.shape)}, got {got}")
    return mapped


def _checked_state(
    state: LinearAttentionState | None,
    name: str,
    batch: int,
    kv_heads: int,
    head_dim: int,
    head_dim_v: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a (kv, k_sum) state and return it as float32 on ``device``; None gives zeros."""
    kv_shape, k_sum_shape = (batch, kv_heads, head_dim, head_dim_v), (batch, kv_heads, head_dim)
    if state is None:
        return (
            torch.zeros(kv_shape, dtype=torch.float32, device=device),
            torch.zeros(k_sum_shape, dtype=torch.float32, device=device),
        )
    if not (isinstance(state, tuple) and len(state) == 2 and all(isinstance(t, torch.Tensor) for t in state)):
        raise ValueError(
            f"{name} must be a LinearAttentionState(kv, k_sum) of tensors, got {type(state).__name__}"
        )
    kv, k_sum = state
    for field, tensor, shape, layout in (
        ("kv", kv, kv_shape, "[batch, kv_heads, head_dim, head_dim_v]"),
        ("k_sum", k_sum, k_sum_shape, "[batch, kv_heads, head_dim]"),
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name}.{field} must have shape {layout} = {list(shape)}, got {tuple(tensor.shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name}.{field} must be a floating-point tensor, got dtype {tensor.dtype}")
    return kv.to(device=device, dtype=torch.float32), k_sum.to(device=device, dtype=torch.float32)
