"""Pure attention kernels: tensors in, tensors out, no parameters.

Every tensor is laid out [batch, heads, seq, head_dim] like :func:`torch.nn.functional.scaled_dot_product_attention`.
Each fast path has a plain, obviously-correct twin named ``naive_<function>`` in its own module; the tests
compare outputs, states and gradients with it.
"""

from headkit.ops.additive import AdditivePoolState, additive_pool, additive_pool_step
from headkit.ops.coca import coca_attention
from headkit.ops.collaborative import collaborative_attention, collaborative_scores
from headkit.ops.feature_maps import FEATURE_MAPS, get_feature_map, hedgehog_feature_map, register_feature_map
from headkit.ops.hybrid import (
    HybridAttentionState,
    HybridRingState,
    SparseHybridState,
    hybrid_attention,
    hybrid_attention_step_,
    ring_from_state,
    sparse_hybrid_attention,
    sparse_hybrid_attention_step_,
    sparse_hybrid_exact_sets,
    state_from_ring,
)
from headkit.ops.linear import LinearAttentionState, linear_attention, linear_attention_step
from headkit.ops.registry import KERNELS, KernelSpec, register_kernel
from headkit.ops.rotary import apply_rotary, rope_inverse_frequencies, rotary_cos_sin
from headkit.ops.softmax import eager_attention, softmax_attention

__all__ = [
    "KERNELS",
    "KernelSpec",
    "register_kernel",
    "FEATURE_MAPS",
    "AdditivePoolState",
    "HybridAttentionState",
    "HybridRingState",
    "LinearAttentionState",
    "additive_pool",
    "additive_pool_step",
    "apply_rotary",
    "coca_attention",
    "collaborative_attention",
    "collaborative_scores",
    "get_feature_map",
    "hedgehog_feature_map",
    "hybrid_attention",
    "hybrid_attention_step_",
    "linear_attention",
    "linear_attention_step",
    "register_feature_map",
    "rope_inverse_frequencies",
    "rotary_cos_sin",
    "eager_attention",
    "softmax_attention",
    "SparseHybridState",
    "sparse_hybrid_attention",
    "sparse_hybrid_attention_step_",
    "ring_from_state",
    "state_from_ring",
    "sparse_hybrid_exact_sets",
]
