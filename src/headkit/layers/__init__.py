"""Attention layers: one ``nn.Module`` per mechanism behind one interface (:class:`HeadkitAttention`).

Mechanisms are looked up by name in :data:`ATTENTION_LAYERS`; importing this package registers the ones
headkit ships. :class:`HeadkitCache` holds their generation state (key/value caches or :class:`StateCacheLayer` states).
Learnable feature maps (Hedgehog) are looked up by name in :data:`LEARNABLE_FEATURE_MAPS`.
"""

from headkit.layers.additive import AdditiveAttention, AdditiveState
from headkit.layers.base import HeadkitAttention, LayerInputs
from headkit.layers.cache import HeadkitCache, StateCacheLayer, map_state
from headkit.layers.coca import CoCAAttention
from headkit.layers.collaborative import CollaborativeAttention
from headkit.layers.feature_maps import (
    LEARNABLE_FEATURE_MAPS,
    FixedFeatureMap,
    HedgehogFeatureMap,
    build_feature_map,
    register_learnable_feature_map,
    valid_feature_map_names,
)
from headkit.layers.hybrid import HybridAttention
from headkit.layers.linear import LinearAttention
from headkit.layers.registry import (
    ATTENTION_LAYERS,
    BUILTIN_ATTENTION_NAMES,
    attention_classes,
    build_attention,
    get_attention_class,
    register_attention,
    valid_attention_names,
)
from headkit.layers.softmax import SoftmaxAttention, softmax_attention_weights

__all__ = [
    "ATTENTION_LAYERS",
    "BUILTIN_ATTENTION_NAMES",
    "LEARNABLE_FEATURE_MAPS",
    "AdditiveAttention",
    "AdditiveState",
    "CoCAAttention",
    "CollaborativeAttention",
    "FixedFeatureMap",
    "HeadkitAttention",
    "HeadkitCache",
    "HedgehogFeatureMap",
    "HybridAttention",
    "LayerInputs",
    "LinearAttention",
    "SoftmaxAttention",
    "StateCacheLayer",
    "attention_classes",
    "build_attention",
    "build_feature_map",
    "get_attention_class",
    "map_state",
    "register_attention",
    "register_learnable_feature_map",
    "softmax_attention_weights",
    "valid_attention_names",
    "valid_feature_map_names",
]
