"""Feature maps φ for kernelised (linear) attention.

Katharopoulos et al. 2020, "Transformers are RNNs", §3.2: replacing the softmax similarity by a kernel
sim(q, k) = φ(q)ᵀ φ(k) (Eq. 3) lets attention be computed in linear time. The paper's choice, and our default,
is φ(x) = elu(x) + 1 (Eq. 7): positive, so the normaliser φ(q)ᵀ Σ φ(k) stays away from 0 for any sensible
input, and with a non-zero gradient for negative inputs (unlike relu).

Feature maps are looked up by name in :data:`FEATURE_MAPS`; :func:`register_feature_map` adds new ones, and
every function that takes a ``feature_map`` also accepts a plain callable. A feature map takes a float32
[..., head_dim] tensor and returns one of the same shape (the recurrent state is [head_dim, head_dim_v]).

:func:`hedgehog_feature_map` is the one map here with parameters (a per-head projection), so it is not in the
registry of parameter-free maps: :class:`headkit.layers.HedgehogFeatureMap` holds its weight, and the hybrid
attention op takes features already computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

FeatureMap = Callable[[torch.Tensor], torch.Tensor]

_LOG2_E = math.log2(math.e)
# Dtypes in which elu_plus_one's exp2 form is as accurate as elu: x·log2 e rounded to bf16 would not be.
_EXP2_DTYPES = (torch.float32, torch.float64)
# Below this many elements the exp2 form's seven small kernels cost more than elu's one (a decoding step's
# [B, H, 1, D] keys: 15 µs against 5 µs); above it the exp2 kernel's speed wins (measured crossover ≈ 16K, CPU).
_EXP2_MIN_ELEMENTS = 1 << 14


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020, Eq. 7): positive, smooth, gradient everywhere.

    In floating point it rounds to 0 far below zero (x < −17 or so in float32), where exp(x) < 1 ulp of 1.
    """
    if (
        x.device.type != "cpu"
        or x.dtype not in _EXP2_DTYPES
        or x.numel() < _EXP2_MIN_ELEMENTS
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        # In place on elu's fresh output, saving a temporary: elu's backward reads its input, not its output.
        # (Under autograd an exp2 form with its own backward measured slower than elu's fused kernels.)
        return F.elu(x).add_(1.0)
    # Without autograd on CPU: elu(x) + 1 = (exp(min(x, 0)) − 1) + max(x, 0) + 1 with exp(y) = 2^(y·log2 e):
    # the exp2 kernel is ~4x cheaper than elu's expm1 (~2x for the whole map). Subtracting 1 before adding it
    # back rounds like elu(x) + 1 does (to 0 far below zero), so both forms agree to a couple of ulp of 1.
    return x.clamp(max=0.0).mul_(_LOG2_E).exp2_().sub_(1.0).add_(x.clamp(min=0.0)).add_(1.0)


def relu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = max(x, 0): non-negative, but a query with no positive coordinate sees nothing (output 0)."""
    return F.relu(x)


def identity_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = x: plain (unnormalised-kernel) linear attention; the normaliser may be ≤ 0, use with care."""
    return x


def hedgehog_feature_map(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Hedgehog's feature map (Zhang et al. 2024, "The Hedgehog & the Porcupine: Expressive Linear Attentions
    with Softmax Mimicry", ICLR 2024, arXiv:2402.04347): per head h, φ(x) = [softmax(x W_h), softmax(−x W_h)].

    The paper's map is [exp(x W_h), exp(−x W_h)]; normalising each half over the feature dimension, as the
    ``softmax_dim`` activation of the authors' LoLCATs code does, keeps every feature in [0, 1] whatever the
    scale of x, where a plain exp overflows.

    Args:
        x: [B, H, T, d].
        weight: the per-head projections W_h, [H, d, d'].

    Returns:
        [B, H, T, 2·d'] in x's dtype (computed in float32 at least): positive, each half summing to 1. The
        exponentials give the "spiky", dot-product-monotonic weights the paper asks of a softmax mimic; the ± pair
        keeps both signs of every projected coordinate.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape [batch, heads, seq, head_dim], got {got}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must have shape [heads, head_dim, feature_dim], got {got}")
    heads, head_dim = x.shape[1], x.shape[3]
    if weight.shape[0] != heads or weight.shape[1] != head_dim:
        raise ValueError(
            f"weight must have shape [heads, head_dim, feature_dim] = [{heads}, {head_dim}, feature_dim] to "
            f"match x of shape {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    # A bf16 softmax over d' features would round every entry to ~3 significant digits: compute wider.
    dtype = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    projected = torch.matmul(x.to(dtype), weight.to(dtype).unsqueeze(0))  # [B, H, T, d'], per head
    # Both halves in one softmax over a stacked [2, d'] pair: three ops instead of four, for decoding steps.
    mapped = torch.stack((projected, -projected), dim=-2).softmax(dim=-1).flatten(-2)
    return mapped.to(x.dtype)


# The learnable feature maps headkit ships (headkit.layers.feature_maps registers their modules under these names): a
# config may name them before that module is imported, as it may the parameter-free maps below.
BUILTIN_LEARNABLE_FEATURE_MAPS: tuple[str, ...] = ("hedgehog",)

FEATURE_MAPS: dict[str, FeatureMap] = {
    "elu": elu_plus_one,
    "relu": relu_feature_map,
    "identity": identity_feature_map,
}


def register_feature_map(name: str, fn: FeatureMap, *, overwrite: bool = False) -> None:
    """Make ``fn`` available as ``feature_map=name``; a name already taken needs ``overwrite=True``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise ValueError(f"fn must be callable (Tensor -> Tensor), got {type(fn).__name__}")
    if name in FEATURE_MAPS and not overwrite:
        raise ValueError(f"feature map {name!r} is already registered; pass overwrite=True to replace it")
    FEATURE_MAPS[name] = fn


def get_feature_map(name_or_callable: str | FeatureMap) -> FeatureMap:
    """Return the registered feature map called ``name_or_callable``, or the callable itself."""
    if isinstance(name_or_callable, str):
        if name_or_callable in FEATURE_MAPS:
            return FEATURE_MAPS[name_or_callable]
    elif callable(name_or_callable):
        return name_or_callable
    raise ValueError(
        f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable, got {name_or_callable!r}"
    )
