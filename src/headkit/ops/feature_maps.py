"""Feature maps φ for kernelised (linear) attention.

Katharopoulos et al. 2020, "Transformers are RNNs", §3.2: replacing the softmax similarity by a kernel
sim(q, k) = φ(q)ᵀ φ(k) (Eq. 3) lets attention be computed in linear time. The paper's choice, and our default,
is φ(x) = elu(x) + 1 (Eq. 7): positive, so the normaliser φ(q)ᵀ Σ φ(k) stays away from 0 for any sensible
input, and with a non-zero gradient for negative inputs (unlike relu).

Feature maps are looked up by name in :data:`FEATURE_MAPS`; :func:`register_feature_map` adds new ones, and
every function that takes a ``feature_map`` also accepts a plain callable. A feature map takes a float32
[..., head_dim] tensor and returns one of the same shape (the recurrent state is [head_dim, head_dim_v]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020, Eq. 7): positive, smooth, gradient everywhere.

    In floating point it rounds to 0 far below zero (x < −17 or so in float32), where exp(x) < 1 ulp of 1.
    """
    # In place on elu's fresh output, saving a temporary: elu's backward reads its input, not its output.
    return F.elu(x).add_(1.0)


def relu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = max(x, 0): non-negative, but a query with no positive coordinate sees nothing (output 0)."""
    return F.relu(x)


def identity_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = x: plain (unnormalised-kernel) linear attention; the normaliser may be ≤ 0, use with care."""
    return x


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
