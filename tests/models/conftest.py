"""Shared fixtures for the model tests: tiny configs and a toy recurrent attention layer.

``running_mean`` registers a minimal recurrent mechanism (each head outputs the running mean of its values
over the real tokens so far, with a constant-size (sum, count) state). It exercises the whole recurrent path —
``StateCacheLayer`` entries, ``get_state``/``set_state``, left padding, beam reordering — independently of
the real linear/additive layers.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn

from headkit.layers import ATTENTION_LAYERS, HeadkitAttention, StateCacheLayer
from headkit.models import HeadkitConfig

RUNNING_MEAN = "test_running_mean"


class RunningMeanState(NamedTuple):
    value_sum: torch.Tensor  # [B, H, D]
    count: torch.Tensor  # [B, 1, 1]


class RunningMeanAttention(HeadkitAttention):
    cache_layer_class = StateCacheLayer
    attention_name = RUNNING_MEAN

    def __init__(self, config, layer_idx, **head_overrides):
        super().__init__(config, layer_idx, **head_overrides)
        self.v_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        output_attentions=False,
    ):
        batch, seq, _ = hidden_states.shape
        values = self.split_heads(self.v_proj(hidden_states), self.num_heads)
        past = self.past_length(cache)
        mask = self.key_padding_mask(attention_mask, batch, past + seq)
        real = torch.ones(batch, seq, dtype=values.dtype) if mask is None else mask[:, -seq:].to(values.dtype)
        weights = real[:, None, :, None]
        sums = (values * weights).cumsum(2)
        counts = weights.cumsum(2)
        entry = self.state_entry(cache)
        state = None if entry is None else entry.get_state()
        if state is not None:
            sums = sums + state.value_sum[:, :, None]
            counts = counts + state.count[:, :, None]
        if entry is not None:
            entry.set_state(RunningMeanState(sums[:, :, -1], counts[:, :, -1]), seq)
        return self.project_heads(sums / counts.clamp(min=1.0)), None


@pytest.fixture
def running_mean(monkeypatch):
    """Register the toy recurrent layer for one test."""
    monkeypatch.setitem(ATTENTION_LAYERS, RUNNING_MEAN, RunningMeanAttention)
    return RUNNING_MEAN


TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=256,
    pad_token_id=0,
)


@pytest.fixture
def make_config():
    """A factory of tiny configs: make_config(**overrides)."""

    def make(**overrides) -> HeadkitConfig:
        return HeadkitConfig(**{**TINY, **overrides})

    return make
