"""Hybrid sliding-window softmax + linear attention, the attention of LoLCATs.

Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large Language Models" (arXiv:2410.10254): each query
attends exactly (softmax) to the last ``window`` keys and through a linear-attention kernel φ(q)ᵀφ(k) to every
earlier key, under one shared normaliser. For query i (window W, scores s_ij = q_i·k_j · scale):

    a_ij = exp(s_ij − m_i)              for j ∈ (i − W, i]      (the window; m_i = max of its real scores)
    a_ij = γ_h · φ(q_i)ᵀ φ(k_j)         for j ≤ i − W           (everything that has left the window)
    y_i  = Σ_j a_ij v_j / (Σ_j a_ij + eps)

with γ_h ≥ 0 a per-head balance (LoLCATs' linear_factor / window_factor). Padded keys get a_ij = 0.

The convention for m_i is the one of the authors' reference implementation (``hybrid_attention_quadratic`` in
HazyResearch/lolcats): the window scores are stabilised by their own maximum and the linear terms are *not*
multiplied by exp(−m_i). It is a model choice, not only a rounding trick — the linear terms are measured against
the window's largest weight, which is exactly 1, so γ_h sets the linear share on a fixed scale — and it is
stable: every window weight lies in (0, 1], the denominator is ≥ 1 for a query that sees a real key in its
window (its own), and nothing overflows however large the scores. (Scaling the linear terms by exp(−m_i) would
make y the exact mixture exp(s) + γ φᵀφ, but exp(−m_i) overflows for very negative window maxima.) Because
m_i does not cancel, it is part of the function: its gradient flows, it is not detached.

One folder per mechanism (flash-linear-attention's layout): :mod:`~headkit.ops.hybrid.parallel` (the chunkwise
parallel form, training and prefill), :mod:`~headkit.ops.hybrid.step` (the one decoding step, in place on ring
buffers), :mod:`~headkit.ops.hybrid.naive` (the test references), and :mod:`~headkit.ops.hybrid.sparse`, the
variant that keeps sinks and a sparse cache exact beyond the window (LoLA) — its parallel form here, its step and
twin beside the plain op's.
"""

from headkit.ops.hybrid.naive import naive_hybrid_attention, naive_sparse_hybrid_attention
from headkit.ops.hybrid.parallel import HybridAttentionState, hybrid_attention
from headkit.ops.hybrid.sparse import (
    SparseHybridState,
    sparse_hybrid_attention,
    sparse_hybrid_exact_sets,
    sparse_hybrid_state,
    sparse_hybrid_stored_keys,
)
from headkit.ops.hybrid.step import (
    HybridRingState,
    SparseHybridRingState,
    hybrid_attention_step_,
    ring_from_state,
    sparse_hybrid_attention_step_,
    state_from_ring,
)

__all__ = [
    "HybridAttentionState",
    "HybridRingState",
    "SparseHybridRingState",
    "SparseHybridState",
    "hybrid_attention",
    "hybrid_attention_step_",
    "naive_hybrid_attention",
    "naive_sparse_hybrid_attention",
    "ring_from_state",
    "sparse_hybrid_attention",
    "sparse_hybrid_state",
    "sparse_hybrid_attention_step_",
    "sparse_hybrid_exact_sets",
    "sparse_hybrid_stored_keys",
    "state_from_ring",
]
