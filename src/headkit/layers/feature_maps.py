"""Feature maps as modules: learnable maps (Hedgehog) and the parameter-free ones of :mod:`headkit.ops`, by name.

A feature map module takes per-head inputs [B, heads, T, head_dim] and returns features [B, heads, T,
``output_dim``]. Learnable maps are classes registered with :func:`register_learnable_feature_map` and built with
``cls(num_heads, head_dim, feature_dim)``; every name of :data:`headkit.ops.FEATURE_MAPS` ("elu", "relu", …) is
available too, wrapped in a parameter-free :class:`FixedFeatureMap`. :func:`build_feature_map` is the only place
that turns a name into a module, so layers never branch on feature-map names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init

from headkit.layers.registry import check_registration
from headkit.ops._validation import check_positive_int
from headkit.ops.feature_maps import (
    BUILTIN_LEARNABLE_FEATURE_MAPS,
    FEATURE_MAPS,
    get_feature_map,
    hedgehog_feature_map,
)

LEARNABLE_FEATURE_MAPS: dict[str, type[nn.Module]] = {}


def register_learnable_feature_map(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: make a learnable feature map class available as ``name``.

    The class is built as ``cls(num_heads, head_dim, feature_dim)`` (feature_dim None: the class's default),
    maps [B, num_heads, T, head_dim] to [B, num_heads, T, ``output_dim``], and has ``reset_parameters()``, which
    initialises it with the ``transformers.initialization`` functions (so weights loaded from a checkpoint are
    left alone).
    """
    check_registration("feature map", LEARNABLE_FEATURE_MAPS, name)

    def register(map_class: type[nn.Module]) -> type[nn.Module]:
        check_registration("learnable feature map", LEARNABLE_FEATURE_MAPS, name, map_class)
        if name in FEATURE_MAPS:
            raise ValueError(
                f"{name!r} already names a parameter-free feature map of headkit.ops.FEATURE_MAPS"
            )
        LEARNABLE_FEATURE_MAPS[name] = map_class
        return map_class

    return register


def valid_feature_map_names() -> list[str]:
    """Every name :func:`build_feature_map` accepts: learnable maps and the parameter-free ones."""
    return sorted(set(LEARNABLE_FEATURE_MAPS) | set(FEATURE_MAPS))


@register_learnable_feature_map(BUILTIN_LEARNABLE_FEATURE_MAPS[0])
class HedgehogFeatureMap(nn.Module):
    """Hedgehog's learnable map φ(x) = [softmax(x W_h), softmax(−x W_h)] per head (Zhang et al. 2024,
    arXiv:2402.04347; see :func:`headkit.ops.hedgehog_feature_map`).

    Args:
        num_heads: H, one projection W_h per head.
        head_dim: d, the input width.
        feature_dim: d', the projection width (default d); the output has 2·d' features.

    ``weight`` [H, d, d'] starts as the (rectangular) identity in every head, as the authors' LoLCATs code does:
    the fresh map is then softmax(±x) over the raw coordinates, which is already a sensible positive kernel whose
    weights grow with the dot product, with no random projection to squash or amplify any direction — training
    (e.g. attention distillation) starts from a well-conditioned map rather than from noise.
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None) -> None:
        super().__init__()
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.feature_dim = check_positive_int("feature_dim", head_dim if feature_dim is None else feature_dim)
        self.output_dim = 2 * self.feature_dim
        self.weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.feature_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        identity = torch.eye(
            self.head_dim, self.feature_dim, dtype=self.weight.dtype, device=self.weight.device
        )
        init.copy_(self.weight, identity.expand_as(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, d] → [B, H, T, 2·d'] in x's dtype."""
        return hedgehog_feature_map(x, self.weight)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


class FixedFeatureMap(nn.Module):
    """A parameter-free map of :data:`headkit.ops.FEATURE_MAPS` (e.g. "elu" = elu + 1) as a module.

    Applied element-wise, so ``output_dim`` is the input's head_dim, and it has no parameters to initialise.
    """

    def __init__(self, name: str, head_dim: int) -> None:
        super().__init__()
        self.fn = get_feature_map(name)
        self.name = name
        self.output_dim = check_positive_int("head_dim", head_dim)

    def reset_parameters(self) -> None:
        """Nothing to initialise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return f"{self.name!r}"


def build_feature_map(name: str, num_heads: int, head_dim: int, feature_dim: int | None = None) -> nn.Module:
    """The feature map module called ``name`` for ``num_heads`` heads of width ``head_dim``.

    ``feature_dim`` sets a learnable map's projection width (None: its default); a parameter-free map keeps the
    input width, so it accepts only None or ``head_dim``.
    """
    if name in LEARNABLE_FEATURE_MAPS:
        return LEARNABLE_FEATURE_MAPS[name](num_heads, head_dim, feature_dim)
    if isinstance(name, str) and name in FEATURE_MAPS:
        if feature_dim is not None and feature_dim != head_dim:
            raise ValueError(
                f"feature map {name!r} is applied element-wise and keeps head_dim ({head_dim}) features; "
                f"feature_dim {feature_dim} needs a learnable map such as 'hedgehog'"
            )
        return FixedFeatureMap(name, head_dim)
    raise ValueError(
        f"unknown feature map {name!r}; valid feature maps: {', '.join(valid_feature_map_names())}"
    )


__all__ = [
    "LEARNABLE_FEATURE_MAPS",
    "FixedFeatureMap",
    "HedgehogFeatureMap",
    "build_feature_map",
    "register_learnable_feature_map",
    "valid_feature_map_names",
]
