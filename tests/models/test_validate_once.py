"""Inputs are validated once, at the public boundary a call enters by.

A HeadkitModel checks ``attention_mask`` and ``position_ids`` once per forward and its layers trust them; a layer
used on its own checks them itself; the ops its layers call skip the checks the layer has made. Counted here by
wrapping the check functions wherever a headkit module has imported them.
"""

from __future__ import annotations

import sys

import pytest
import torch

from headkit.layers import ATTENTION_LAYERS, BUILTIN_ATTENTION_NAMES, SoftmaxAttention, build_attention
from headkit.layers.base import LayerInputs
from headkit.models import HeadkitForCausalLM
from headkit.ops import _validation, rotary
from headkit.surgery.pruning import prune_heads


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` in every headkit module that imported it; return the list its calls go to."""
    original = getattr(module, name)
    calls: list = []

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for loaded in list(sys.modules.values()):
        if (
            loaded is not None
            and loaded.__name__.startswith("headkit")
            and getattr(loaded, name, None) is original
        ):
            monkeypatch.setattr(loaded, name, counting)
    return calls


@pytest.mark.parametrize("attention", BUILTIN_ATTENTION_NAMES)
def test_a_model_forward_checks_the_mask_and_the_positions_once(make_config, monkeypatch, attention):
    torch.manual_seed(0)
    model = HeadkitForCausalLM(make_config(attention=attention, num_hidden_layers=3)).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    mask_checks = count_calls(monkeypatch, _validation, "check_padding_mask")
    position_checks = count_calls(monkeypatch, _validation, "check_batch_position_ids")
    rotary_position_checks = count_calls(monkeypatch, rotary, "check_position_ids")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    assert len(mask_checks) == 1
    assert len(position_checks) + len(rotary_position_checks) == 1


def test_a_layer_taken_out_of_a_model_checks_its_inputs_again(make_config):
    # Trust is per call (the model passes inputs_validated=True), not a flag left on the layer.
    model = HeadkitForCausalLM(make_config())
    layer = model.model.layers[0].self_attn
    x = torch.randn(2, 5, layer.hidden_size)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        layer(x, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask must be bool or integer"):
        layer(x, attention_mask=torch.ones(2, 5))


@pytest.mark.parametrize("attention", BUILTIN_ATTENTION_NAMES)
def test_a_layer_on_its_own_still_rejects_bad_inputs(make_config, attention):
    layer = build_attention(make_config(attention=attention), 0)
    x = torch.randn(2, 5, layer.hidden_size)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        layer(x, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask must be bool or integer"):
        layer(x, attention_mask=torch.ones(2, 5))
    if layer.rotary:
        with pytest.raises(ValueError, match="position_ids must be integers of shape"):
            layer(x, position_ids=torch.arange(5))
        with pytest.raises(ValueError, match="position_ids must be integers of shape"):
            layer(x, position_ids=torch.zeros(1, 5))


class PlainForwardSoftmax(SoftmaxAttention):
    """A mechanism that overrides forward with the plain signature (no ``inputs_validated``), reading its inputs
    through key_padding_mask and positions, as the layers' contract allows."""

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
        past = self.past_length(cache)
        mask = self.key_padding_mask(attention_mask, batch, past + seq)
        positions = self.positions(position_ids, batch, seq, past, hidden_states.device)
        inputs = LayerInputs(batch, seq, past, mask, positions, cache, output_attentions)
        return self.attend(hidden_states, inputs)


@pytest.fixture
def plain_forward(monkeypatch):
    monkeypatch.setitem(ATTENTION_LAYERS, "test_plain_forward", PlainForwardSoftmax)
    return "test_plain_forward"


def test_a_plain_forward_layer_on_its_own_checks_its_positions(make_config, plain_forward):
    layer = PlainForwardSoftmax(make_config(position_embedding_type="rope"), 0)
    assert not PlainForwardSoftmax.takes_inputs_validated
    x = torch.randn(2, 5, layer.hidden_size)
    for bad in (torch.zeros(1, 5), torch.arange(5)):
        with pytest.raises(ValueError, match="position_ids must be integers of shape"):
            layer(x, position_ids=bad)


def test_a_model_of_plain_forward_layers_runs_and_after_surgery_too(make_config, plain_forward):
    torch.manual_seed(0)
    model = HeadkitForCausalLM(make_config(attention=plain_forward, position_embedding_type="rope")).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        heads = model.config.num_attention_heads
        prune_heads(model, {0: list(range(heads))}, allow_empty_layers=True)  # a replacement in layer 0
        after = model(input_ids=ids).logits
    assert before.shape == after.shape and torch.isfinite(after).all()
