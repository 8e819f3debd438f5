"""The kernel registry: the causal attention kernels that ``headkit bench speed`` times, by name.

A kernel is registered with the shapes of its inputs, as layouts over the symbols B (batch), H (heads), T
(sequence length), D (head_dim), D/2 and H*D — by default q, k and v, each [B, H, T, D] — and the call that
maps them (as keywords) to the output::

    register_kernel(
        "mine_causal",
        "my attention, causal",
        run=lambda q, k, v: mine_attention(q, k, v, causal=True),
    )

A kernel that returns ``(output, state)`` is timed on its output. ``non_negative`` names inputs drawn ≥ 0.
``flops(batch, heads, seq_len, head_dim)``, where given, counts the kernel's floating-point operations, so
that a benchmark can report its rate against the machine's matmul rate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from headkit.ops.additive import additive_pool
from headkit.ops.coca import coca_attention
from headkit.ops.collaborative import collaborative_attention
from headkit.ops.linear import causal_linear_attention_flops, linear_attention
from headkit.ops.softmax import softmax_attention

QKV = ("B", "H", "T", "D")
QKV_INPUTS: Mapping[str, tuple[str, ...]] = MappingProxyType({"q": QKV, "k": QKV, "v": QKV})


@dataclass(frozen=True)
class KernelSpec:
    """One registered kernel: what it computes, its inputs' layouts, the inputs drawn ≥ 0, the call, and its
    FLOP count (batch, heads, seq_len, head_dim) -> FLOPs where known."""

    description: str
    inputs: Mapping[str, tuple[str, ...]]
    run: Callable[..., torch.Tensor]
    non_negative: frozenset[str] = frozenset()
    flops: Callable[[int, int, int, int], int] | None = None


KERNELS: dict[str, KernelSpec] = {}


def register_kernel(
    name: str,
    description: str,
    *,
    inputs: Mapping[str, tuple[str, ...]] = QKV_INPUTS,
    run: Callable[..., Any],
    non_negative: tuple[str, ...] = (),
    flops: Callable[[int, int, int, int], int] | None = None,
) -> KernelSpec:
    """Make ``run`` available as kernel ``name`` (replacing an earlier registration of the same name)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"kernel name must be a non-empty string, got {name!r}")
    unknown = set(non_negative) - set(inputs)
    if unknown:
        raise ValueError(f"kernel {name!r}: non_negative names {sorted(unknown)}, which are not inputs")

    def primary(**tensors: torch.Tensor) -> torch.Tensor:
        result = run(**tensors)  # kernels that carry a recurrent state return (output, state)
        return result[0] if isinstance(result, tuple) else result

    spec = KernelSpec(description, dict(inputs), primary, frozenset(non_negative), flops)
    KERNELS[name] = spec
    return spec


register_kernel(
    "sdpa_causal",
    "torch SDPA, causal (the baseline)",
    run=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
)
register_kernel(
    "linear_causal",
    "linear attention, elu+1 features, causal (kernel='auto': compiled where it applies, else chunked)",
    run=lambda q, k, v: linear_attention(q, k, v, causal=True),
    flops=causal_linear_attention_flops,
)
register_kernel(
    "linear_causal_chunked",
    "linear attention, elu+1 features, causal, the chunked PyTorch form (kernel='chunked')",
    run=lambda q, k, v: linear_attention(q, k, v, causal=True, kernel="chunked"),
    flops=causal_linear_attention_flops,
)
register_kernel(
    "additive_causal",
    "additive (Fastformer) pooling, causal",
    inputs={"x": QKV, "scores": ("B", "H", "T")},
    run=lambda x, scores: additive_pool(x, scores, causal=True),
)
register_kernel(
    "coca_causal",
    "CoCA, collinear keys with magnitudes t ≥ 0, causal",
    inputs={"q": QKV, "t": ("B", "H", "T", "D/2"), "v": QKV},
    run=lambda q, t, v: coca_attention(q, t, v, causal=True),
    non_negative=("t",),
)
register_kernel(
    "collaborative_causal",
    "collaborative heads, shared q/k of width H·64, causal",
    inputs={
        "q_shared": ("B", "T", "H*D"),
        "k_shared": ("B", "T", "H*D"),
        "v": QKV,
        "mixing": ("H", "H*D"),
        "content_bias": ("B", "H", "T"),
    },
    run=lambda q_shared, k_shared, v, mixing, content_bias: collaborative_attention(
        q_shared, k_shared, v, mixing, content_bias=content_bias, causal=True
    ),
)
register_kernel(
    "sdpa_causal_wide",
    "torch SDPA, causal, heads of width H·64 (collaborative_causal's arithmetic at full width)",
    inputs={"q": ("B", "H", "T", "H*D"), "k": ("B", "H", "T", "H*D"), "v": ("B", "H", "T", "H*D")},
    run=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
)
register_kernel(
    "softmax_noncausal",
    "headkit softmax attention, no mask (reference)",
    run=lambda q, k, v: softmax_attention(q, k, v, causal=False),
)
