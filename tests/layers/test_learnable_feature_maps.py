"""Feature-map modules: Hedgehog's learnable map, its initialisation, and the registry of learnable maps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headkit.layers import (
    LEARNABLE_FEATURE_MAPS,
    FixedFeatureMap,
    HedgehogFeatureMap,
    build_feature_map,
    register_learnable_feature_map,
    valid_feature_map_names,
)
from headkit.ops import FEATURE_MAPS, hedgehog_feature_map


@pytest.fixture
def restore_learnable_maps():
    saved = dict(LEARNABLE_FEATURE_MAPS)
    yield
    LEARNABLE_FEATURE_MAPS.clear()
    LEARNABLE_FEATURE_MAPS.update(saved)


def test_a_fresh_hedgehog_map_is_the_softmax_of_the_raw_coordinates():
    feature_map = HedgehogFeatureMap(num_heads=3, head_dim=6)
    assert feature_map.output_dim == 12 and feature_map.weight.shape == (3, 6, 6)
    assert torch.equal(feature_map.weight, torch.eye(6).expand(3, 6, 6))
    x = torch.randn(2, 3, 5, 6)
    expected = torch.cat([x.softmax(-1), (-x).softmax(-1)], dim=-1)
    torch.testing.assert_close(feature_map(x), expected)


@pytest.mark.parametrize("feature_dim", [4, 9])
def test_a_rectangular_hedgehog_map_starts_as_the_rectangular_identity(feature_dim):
    feature_map = HedgehogFeatureMap(num_heads=2, head_dim=6, feature_dim=feature_dim)
    assert feature_map.output_dim == 2 * feature_dim
    assert torch.equal(feature_map.weight[1], torch.eye(6, feature_dim))
    with torch.no_grad():
        feature_map.weight.normal_()
    x = torch.randn(1, 2, 3, 6)
    torch.testing.assert_close(feature_map(x), hedgehog_feature_map(x, feature_map.weight))
    feature_map.reset_parameters()
    assert torch.equal(feature_map.weight[0], torch.eye(6, feature_dim))


def test_the_hedgehog_weight_is_learnable():
    feature_map = HedgehogFeatureMap(num_heads=2, head_dim=4)
    x = torch.randn(1, 2, 3, 4)
    (grad,) = torch.autograd.grad(feature_map(x)[..., 0].sum(), [feature_map.weight])
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("bad", [{"num_heads": 0}, {"head_dim": -1}, {"feature_dim": 0}])
def test_hedgehog_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a positive integer"):
        HedgehogFeatureMap(**{"num_heads": 2, "head_dim": 4, **bad})


def test_build_feature_map_gives_learnable_and_parameter_free_maps():
    assert isinstance(build_feature_map("hedgehog", 4, 8, 5), HedgehogFeatureMap)
    elu = build_feature_map("elu", 4, 8)
    assert isinstance(elu, FixedFeatureMap) and elu.output_dim == 8 and not list(elu.parameters())
    x = torch.randn(1, 4, 3, 8)
    assert torch.equal(elu(x), FEATURE_MAPS["elu"](x))
    assert {"hedgehog", "elu", "relu", "identity"} <= set(valid_feature_map_names())


def test_build_feature_map_rejects_unknown_names_and_a_width_for_element_wise_maps():
    with pytest.raises(ValueError, match=r"unknown feature map 'bogus'; valid feature maps: elu, hedgehog"):
        build_feature_map("bogus", 4, 8)
    with pytest.raises(ValueError, match="feature_dim 5 needs a learnable map"):
        build_feature_map("elu", 4, 8, 5)
    assert isinstance(build_feature_map("elu", 4, 8, 8), FixedFeatureMap)


def test_a_registered_learnable_map_is_built_by_name(restore_learnable_maps):
    @register_learnable_feature_map("test_scaled")
    class Scaled(nn.Module):
        def __init__(self, num_heads, head_dim, feature_dim=None):
            super().__init__()
            self.output_dim = head_dim
            self.scale = nn.Parameter(torch.ones(num_heads, 1, 1))

        def reset_parameters(self):
            nn.init.ones_(self.scale)

        def forward(self, x):
            return x.exp() * self.scale

    assert isinstance(build_feature_map("test_scaled", 2, 4), Scaled)
    assert "test_scaled" in valid_feature_map_names()
    with pytest.raises(ValueError, match="'test_scaled' is already registered"):
        register_learnable_feature_map("test_scaled")(HedgehogFeatureMap)
    with pytest.raises(ValueError, match="'elu' already names a parameter-free feature map"):
        register_learnable_feature_map("elu")(Scaled)
    with pytest.raises(ValueError, match="non-empty string"):
        register_learnable_feature_map("")
