"""The attention registry and the HeadkitAttention contract: head counts, project_heads, head gates, init."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import initialization as init

from headkit.layers import (
    ATTENTION_LAYERS,
    HeadkitAttention,
    SoftmaxAttention,
    build_attention,
    get_attention_class,
    register_attention,
    valid_attention_names,
)
from headkit.models import HeadkitConfig, HeadkitForCausalLM


def tiny_config(**overrides) -> HeadkitConfig:
    settings = dict(
        vocab_size=13, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32
    )
    return HeadkitConfig(**{**settings, **overrides})


# --- registry ------------------------------------------------------------------------------------------------


def test_softmax_is_registered_and_built_by_name():
    assert ATTENTION_LAYERS["softmax"] is SoftmaxAttention
    assert SoftmaxAttention.attention_name == "softmax"
    layer = build_attention(tiny_config(), layer_idx=1)
    assert type(layer) is SoftmaxAttention and layer.layer_idx == 1


def test_unknown_names_list_the_registered_layers():
    with pytest.raises(ValueError, match=r"unknown attention 'nope'; registered attention layers: .*softmax"):
        get_attention_class("nope")


def test_builtin_names_without_a_registered_layer_say_so(monkeypatch):
    monkeypatch.delitem(ATTENTION_LAYERS, "coca", raising=False)
    assert "coca" in valid_attention_names()
    with pytest.raises(ValueError, match=r"'coca' is a headkit mechanism whose layer is not available"):
        get_attention_class("coca")


def test_register_attention_adds_a_name_and_refuses_duplicates(monkeypatch):
    monkeypatch.setattr("headkit.layers.registry.ATTENTION_LAYERS", dict(ATTENTION_LAYERS))

    @register_attention("test_custom")
    class CustomAttention(SoftmaxAttention):
        pass

    assert get_attention_class("test_custom") is CustomAttention
    assert CustomAttention.attention_name == "test_custom"
    assert "test_custom" in valid_attention_names()
    assert tiny_config(layer_types=["softmax", "test_custom"]).attention_type(1) == "test_custom"

    class Impostor(SoftmaxAttention):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_attention("softmax")(Impostor)
    with pytest.raises(ValueError, match="non-empty string"):
        register_attention("")


def test_registrations_state_rotary_and_compared_and_list_headkits_own_first(monkeypatch):
    from headkit.layers import BUILTIN_ATTENTION_NAMES, attention_classes

    monkeypatch.setattr("headkit.layers.registry.ATTENTION_LAYERS", dict(ATTENTION_LAYERS))
    assert list(attention_classes()) == list(BUILTIN_ATTENTION_NAMES)
    assert [name for name, layer in attention_classes().items() if layer.rotary] == [
        "softmax",
        "coca",
        "hybrid",
    ]
    assert [name for name, layer in attention_classes().items() if not layer.compared] == ["hybrid"]

    @register_attention("test_rotary", rotary=True, compared=False)
    class RotaryAttention(SoftmaxAttention):
        pass

    assert list(attention_classes())[-1] == "test_rotary"
    assert RotaryAttention.rotary and not RotaryAttention.compared
    assert SoftmaxAttention.rotary and SoftmaxAttention.compared  # the parent keeps its own


# --- head counts ---------------------------------------------------------------------------------------------


def test_head_counts_come_from_overrides_before_the_config():
    config = tiny_config(num_key_value_heads=2)
    layer = SoftmaxAttention(config, 0, num_heads=2, num_key_value_heads=1, head_dim=4)
    assert (layer.num_heads, layer.num_key_value_heads, layer.head_dim) == (2, 1, 4)
    assert layer.num_key_value_groups == 2
    assert layer.q_proj.out_features == 8 and layer.k_proj.out_features == 4 and layer.o_proj.in_features == 8
    out, _ = layer(torch.randn(1, 3, 32))
    assert out.shape == (1, 3, 32)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_heads": 4, "num_key_value_heads": 3}, "must divide num_heads"),
        ({"num_heads": 0}, "num_heads must be a positive integer"),
        ({"head_dim": -1}, "head_dim must be a positive integer"),
    ],
)
def test_bad_head_counts_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        SoftmaxAttention(tiny_config(), 0, **overrides)


# --- project_heads and the head gate -------------------------------------------------------------------------


class ZeroOneGate(nn.Module):
    """A minimal head gate: multiplies head h of [B, H, T, Dv] by keep[h]."""

    def __init__(self, keep: list[float]) -> None:
        super().__init__()
        self.register_buffer("keep", torch.tensor(keep))

    def scale_heads(self, head_outputs: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
        return head_outputs * self.keep.view(1, -1, 1, 1).to(head_outputs.dtype)


def test_project_heads_merges_heads_in_order_then_projects():
    layer = SoftmaxAttention(tiny_config(), 0)
    head_outputs = torch.randn(2, 4, 3, 8)
    merged = torch.cat([head_outputs[:, h] for h in range(4)], dim=-1)  # [B, T, H·D], head-major
    torch.testing.assert_close(layer.project_heads(head_outputs), layer.o_proj(merged))
    with pytest.raises(ValueError, match="head_outputs must have shape"):
        layer.project_heads(torch.randn(2, 3, 3, 8))


@pytest.mark.parametrize("head", [0, 2])
@pytest.mark.parametrize("output_attentions", [False, True])
def test_a_gate_zeroing_a_head_equals_zeroing_its_output_before_o_proj(head, output_attentions):
    layer = SoftmaxAttention(tiny_config(num_key_value_heads=2), 0).eval()
    x = torch.randn(2, 5, 32)
    captured = []
    hook = layer.o_proj.register_forward_pre_hook(lambda module, args: captured.append(args[0].clone()))
    with torch.no_grad():
        ungated, _ = layer(x, output_attentions=output_attentions)
    hook.remove()
    merged = captured[0]
    merged[..., head * 8 : (head + 1) * 8] = 0.0
    expected = layer.o_proj(merged)

    keep = [1.0] * 4
    keep[head] = 0.0
    layer.head_gate = ZeroOneGate(keep)
    assert "head_gate" in dict(layer.named_children())
    with torch.no_grad():
        gated, _ = layer(x, output_attentions=output_attentions)
    torch.testing.assert_close(gated, expected, atol=1e-6, rtol=1e-6)
    assert (gated - ungated).abs().max() > 1e-4


def test_every_layer_of_a_model_has_an_empty_gate_slot():
    model = HeadkitForCausalLM(tiny_config())
    assert [layer.self_attn.head_gate for layer in model.model.layers] == [None, None]


# --- extra parameters and initialisation ---------------------------------------------------------------------


class BiasedAttention(SoftmaxAttention):
    """Softmax attention plus a per-head output bias of its own, initialised by init_extra_parameters."""

    def __init__(self, config, layer_idx, **head_overrides):
        super().__init__(config, layer_idx, **head_overrides)
        self.head_bias = nn.Parameter(torch.empty(self.num_heads))

    def init_extra_parameters(self, std: float) -> None:
        init.constant_(self.head_bias, std)


def test_init_extra_parameters_initialises_and_loading_keeps_checkpoint_values(monkeypatch, tmp_path):
    monkeypatch.setitem(ATTENTION_LAYERS, "test_biased", BiasedAttention)
    config = tiny_config(attention="test_biased", initializer_range=0.05)
    model = HeadkitForCausalLM(config)
    for layer in model.model.layers:
        assert isinstance(layer.self_attn, HeadkitAttention)
        assert torch.equal(layer.self_attn.head_bias.detach(), torch.full((4,), 0.05))
    with torch.no_grad():
        model.model.layers[1].self_attn.head_bias.fill_(3.0)
    model.save_pretrained(tmp_path)
    loaded = HeadkitForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.layers[1].self_attn.head_bias.detach(), torch.full((4,), 3.0))
    assert torch.equal(loaded.model.layers[0].self_attn.head_bias.detach(), torch.full((4,), 0.05))


def test_linear_weights_use_the_initializer_range():
    torch.manual_seed(0)
    model = HeadkitForCausalLM(tiny_config(hidden_size=64, initializer_range=0.1, intermediate_size=256))
    weights = torch.cat(
        [p.detach().flatten() for n, p in model.named_parameters() if n.endswith("proj.weight")]
    )
    assert abs(weights.std().item() - 0.1) < 0.005
    norms = [p for n, p in model.named_parameters() if "layernorm" in n or n.endswith("norm.weight")]
    assert all(torch.equal(p.detach(), torch.ones_like(p)) for p in norms)


def test_fused_unless_weights_needed_takes_the_fused_path_only_when_nothing_needs_the_weights():
    from headkit.layers.base import fused_unless_weights_needed

    torch.manual_seed(0)
    weights = torch.softmax(torch.randn(2, 4, 3, 5), dim=-1)
    values = torch.randn(2, 2, 5, 8)  # two key/value heads for four query heads
    expected = weights @ values.repeat_interleave(2, dim=1)
    calls = []

    def fused():
        calls.append("fused")
        return expected

    def explicit():
        calls.append("explicit")
        return weights

    out, returned = fused_unless_weights_needed(fused, explicit, values, dropout=0.0, output_attentions=False)
    assert calls == ["fused"] and returned is None and out is expected
    calls.clear()
    out, returned = fused_unless_weights_needed(fused, explicit, values, dropout=0.0, output_attentions=True)
    assert calls == ["explicit"] and returned is weights
    torch.testing.assert_close(out, expected)
    calls.clear()
    torch.manual_seed(1)
    out, returned = fused_unless_weights_needed(fused, explicit, values, dropout=0.5, output_attentions=False)
    torch.manual_seed(1)
    dropped = torch.nn.functional.dropout(weights, p=0.5, training=True)
    assert calls == ["explicit"] and returned is None
    torch.testing.assert_close(out, dropped @ values.repeat_interleave(2, dim=1))
