"""A model after surgery pickles whole (``torch.save(model)``) and loads back with the same outputs.

Surgery swaps in modules whose class is made at run time (the headkit class and the replaced 🤗 class both, so
🤗's output recorders keep matching them); pickle cannot look such a class up by name and must rebuild it.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from tiny_models import outputs, tiny_inputs, tiny_model

import headkit
from headkit.surgery.collaborative import swap_to_collaborative
from headkit.surgery.pruning import prune_heads


def _collaborative(model):
    swap_to_collaborative(model, dim_shared_query_key=16, max_iter=5)


def _prune_a_whole_layer(model):
    heads = model.config.num_attention_heads
    prune_heads(model, {0: list(range(heads)), 1: [0]}, allow_empty_layers=True)


def _linearize(model):
    headkit.linearize(model, window=4, chunk_size=4)


SURGERIES = [
    ("bert", _collaborative),
    ("gpt2", _collaborative),
    ("llama", _prune_a_whole_layer),
    ("gpt2", _prune_a_whole_layer),
    ("llama", _linearize),
    ("gpt2", _linearize),
]


@pytest.mark.parametrize(
    ("architecture", "surgery"), SURGERIES, ids=[f"{a}-{s.__name__[1:]}" for a, s in SURGERIES]
)
def test_a_model_after_surgery_pickles_and_loads_with_the_same_outputs(architecture, surgery):
    model = tiny_model(architecture)
    surgery(model)
    inputs = tiny_inputs(architecture)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [type(module).__name__ for module in loaded.modules()] == [
        type(module).__name__ for module in model.modules()
    ]
    with torch.no_grad():
        assert torch.equal(outputs(loaded, inputs), outputs(model, inputs))
    copied = copy.deepcopy(model)
    assert [type(module) for module in copied.modules()] == [type(module) for module in model.modules()]
