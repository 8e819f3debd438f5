"""HeadkitCache: a transformers Cache of key/value entries and StateCacheLayer entries side by side."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer

from headkit.layers import ATTENTION_LAYERS, HeadkitCache, SoftmaxAttention, StateCacheLayer, map_state
from headkit.models import HeadkitConfig, HeadkitModel


class PoolState(NamedTuple):
    log_normaliser: torch.Tensor  # [B, H]
    pooled: torch.Tensor  # [B, H, D]


class LayerState(NamedTuple):
    pools: tuple[PoolState, PoolState]
    conv_buffer: torch.Tensor | None


class RecurrentDummy(SoftmaxAttention):
    cache_layer_class = StateCacheLayer


def nested_state(batch: int) -> LayerState:
    """A state shaped like additive attention's: two pooling states and a conv buffer, batch first."""
    rows = torch.arange(batch, dtype=torch.float32)
    pool = PoolState(rows[:, None].expand(batch, 2).clone(), rows[:, None, None].expand(batch, 2, 3).clone())
    return LayerState(
        (pool, pool._replace(pooled=pool.pooled + 10)), rows[:, None, None].expand(batch, 4, 2) + 100
    )


@pytest.fixture
def hybrid_model(monkeypatch):
    monkeypatch.setitem(ATTENTION_LAYERS, "test_recurrent", RecurrentDummy)
    return HeadkitModel(config(layer_types=["softmax", "test_recurrent", "softmax"]))


def config(**overrides) -> HeadkitConfig:
    return HeadkitConfig(
        vocab_size=11,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        **overrides,
    )


def test_cache_layers_follow_each_attention_class(hybrid_model):
    cache = HeadkitCache(hybrid_model)
    assert [type(layer) for layer in cache.layers] == [DynamicLayer, StateCacheLayer, DynamicLayer]
    assert all(isinstance(layer, CacheLayerMixin) for layer in cache.layers)
    assert cache.get_seq_length() == 0 and cache.get_seq_length(1) == 0
    assert not cache.is_compileable  # generate() must keep passing 2D masks


def test_key_value_entries_concatenate_and_count_tokens(hybrid_model):
    cache = HeadkitCache(hybrid_model)
    first_k, first_v = torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    cache.update(first_k, first_v, 0)
    next_k, next_v = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)
    keys, values = cache.update(next_k, next_v, 0)
    assert torch.equal(keys, torch.cat([first_k, next_k], dim=2))
    assert torch.equal(values, torch.cat([first_v, next_v], dim=2))
    assert cache.get_seq_length(0) == 6


def test_recurrent_entries_store_states_and_count_tokens(hybrid_model):
    cache = HeadkitCache(hybrid_model)
    assert cache.layers[1].get_state() is None
    state = nested_state(3)
    cache.layers[1].set_state(state, 7)
    cache.layers[1].set_state(state, 1)
    assert cache.layers[1].get_state() is state
    assert cache.get_seq_length(1) == 8 and cache.get_mask_sizes(2, 1) == (10, 0)
    cache.reset()
    assert cache.layers[1].get_state() is None and cache.get_seq_length(1) == 0


def test_beam_reordering_and_batch_selection_index_every_tensor(hybrid_model):
    cache = HeadkitCache(hybrid_model)
    cache.layers[1].set_state(nested_state(3), 4)
    keys = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 4, 8)
    cache.update(keys, keys.clone(), 0)

    cache.reorder_cache(torch.tensor([2, 2, 0]))
    state = cache.layers[1].get_state()
    assert isinstance(state, LayerState) and isinstance(state.pools[1], PoolState)
    assert state.pools[0].log_normaliser[:, 0].tolist() == [2.0, 2.0, 0.0]
    assert state.pools[1].pooled[:, 0, 0].tolist() == [12.0, 12.0, 10.0]
    assert state.conv_buffer[:, 0, 0].tolist() == [102.0, 102.0, 100.0]
    assert cache.layers[0].keys[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]

    cache.batch_select_indices(torch.tensor([2]))
    assert cache.layers[1].get_state().conv_buffer.shape == (1, 4, 2)
    cache.batch_repeat_interleave(2)
    assert cache.layers[1].get_state().pools[0].pooled.shape == (2, 2, 3)
    assert cache.layers[0].keys.shape[0] == 2
    assert cache.get_seq_length(1) == 4


def test_recurrent_states_cannot_be_cropped(hybrid_model):
    cache = HeadkitCache(hybrid_model)
    cache.layers[1].set_state(nested_state(1), 2)
    cache.crop(0)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot be rewound"):
        cache.crop(-1)


def test_a_refused_crop_leaves_the_key_value_layers_as_they_were(hybrid_model):
    cache = HeadkitCache(hybrid_model)
    keys = torch.randn(1, 2, 3, 4)
    cache.update(keys, keys, 0)
    cache.layers[1].set_state(nested_state(1), 3)
    with pytest.raises(ValueError, match="cannot be rewound"):
        cache.crop(-1)
    assert cache.get_seq_length(0) == 3 and cache.get_seq_length(1) == 3


def test_map_state_keeps_structure_and_none():
    state = nested_state(2)
    doubled = map_state(state, lambda tensor: tensor * 2)
    assert (
        type(doubled) is LayerState and type(doubled.pools) is tuple and type(doubled.pools[0]) is PoolState
    )
    assert torch.equal(doubled.conv_buffer, state.conv_buffer * 2)
    assert map_state(state._replace(conv_buffer=None), lambda t: t).conv_buffer is None


def filled_key_value_entry(cache):
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    return cache


@pytest.mark.parametrize(
    "action, message",
    [
        (
            lambda cache: StateCacheLayer.in_cache(filled_key_value_entry(cache), 0),
            "keys and values of 2 tokens",
        ),
        (lambda cache: StateCacheLayer.in_cache(cache, 5), "cannot grow to layer 5"),
        (lambda cache: StateCacheLayer.in_cache(object(), 0), "per-layer entries"),
        (lambda cache: cache.layers[1].set_state({"kv": torch.zeros(1)}, 1), r"\(Named\)tuple"),
        (lambda cache: cache.layers[1].set_state(torch.zeros(1), -1), "num_new_tokens"),
    ],
)
def test_misuse_raises_value_error(hybrid_model, action, message):
    with pytest.raises(ValueError, match=message):
        action(HeadkitCache(hybrid_model))


def test_a_state_entry_passes_keys_and_values_through_and_takes_an_empty_stock_entry():
    # What surgery relies on: the stock module's cache update returns its inputs, and a stock cache's empty
    # key/value entry (or one it has yet to create) becomes the state entry.
    cache = DynamicCache()
    entry = StateCacheLayer.in_cache(cache, 1)
    assert (
        type(entry) is StateCacheLayer
        and len(cache.layers) == 2
        and StateCacheLayer.in_cache(cache, 1) is entry
    )
    keys = torch.randn(1, 2, 3, 4)
    assert cache.update(keys, keys, 1)[0] is keys
    entry.set_state(keys, 3)
    assert cache.get_seq_length(1) == 3 and entry.is_initialized


def test_cache_needs_a_model_or_layers():
    with pytest.raises(ValueError, match="exactly one"):
        HeadkitCache()
    cache = HeadkitCache(layers=[StateCacheLayer()])
    cache.layers[0].set_state(torch.ones(2, 3), 5)
    assert cache.get_seq_length() == 5


def test_the_cache_takes_its_entries_from_the_models_layers_not_from_names():
    # The model's layers declare their entries: a config (names only) is refused with the way to build one.
    with pytest.raises(ValueError, match=r"HeadkitCache\(model\)"):
        HeadkitCache(config())
    layer = RecurrentDummy(config(), layer_idx=0)
    assert [type(entry) for entry in HeadkitCache(layer).layers] == [StateCacheLayer]
    second = RecurrentDummy(config(), layer_idx=1)
    pair = HeadkitCache(torch.nn.ModuleList([SoftmaxAttention(config(), 0), second]))
    assert [type(entry) for entry in pair.layers] == [DynamicLayer, StateCacheLayer]
    with pytest.raises(ValueError, match="two attention layers with layer_idx 0"):
        HeadkitCache(torch.nn.ModuleList([SoftmaxAttention(config(), 0), layer]))
    with pytest.raises(ValueError, match="numbered 0, 1"):
        HeadkitCache(second)
