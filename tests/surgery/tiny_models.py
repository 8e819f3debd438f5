"""Tiny random models, one per registered attention adapter, for the gating, pruning and importance tests.

Every model has at least two attention sites (ALBERT: one site shared by three layers) with 4 heads of width 4,
except LLaMA and headkit, which use grouped-query attention with 8 query heads over 2 key/value heads so that
uneven pruning within a key/value group is reachable; the decoder families with an adapter of their own (OLMo 2,
Phi-3, GPT-NeoX) come from family_models.py (4 heads of width 16, over 2 key/value heads for OLMo 2 and Phi-3). Text inputs carry a right-padded row, so masks matter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers as tr
from family_models import family_model
from torch import nn

from headkit.models import HeadkitConfig, HeadkitModel

tr.logging.set_verbosity_error()

VOCAB = 50
SEQ = 6


def _bert() -> nn.Module:
    config = tr.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24
    )
    return tr.BertModel(config)


def _roberta() -> nn.Module:
    config = tr.RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24
    )
    return tr.RobertaModel(config)


def _distilbert() -> nn.Module:
    return tr.DistilBertModel(
        tr.DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=4, hidden_dim=24)
    )


def _albert() -> nn.Module:
    config = tr.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=24,
    )
    return tr.AlbertModel(config)


def _gpt2() -> nn.Module:
    config = tr.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return tr.GPT2Model(config)


def _vit() -> nn.Module:
    config = tr.ViTConfig(
        image_size=8,
        patch_size=4,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=24,
    )
    return tr.ViTModel(config)


def llama_config(**overrides) -> tr.LlamaConfig:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=24,
        attention_bias=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return tr.LlamaConfig(**(settings | overrides))


def _llama() -> nn.Module:
    return tr.LlamaModel(llama_config())


def peaked_llama(layers: int = 2, vocab: int = 97) -> tr.LlamaForCausalLM:
    """A tiny LLaMA causal LM (4 query heads over 2 key/value heads of width 8, RoPE, context 256) whose query
    and key projections are drawn large, so that attention is peaked and a wrong choice of keys shows."""
    torch.manual_seed(0)
    config = tr.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    model = tr.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.normal_(std=0.3)
    return model.eval()


def headkit_config(**overrides) -> HeadkitConfig:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=24,
        attention_bias=True,
    )
    return HeadkitConfig(**(settings | overrides))


def _headkit() -> nn.Module:
    return HeadkitModel(headkit_config())


def _family(model_type: str) -> Callable[[], nn.Module]:
    """The base model of a decoder family's tiny causal LM (family_models.py): 4 query heads of width 16 over 2
    key/value heads (GPT-NeoX: 4 heads), hidden 64."""
    return lambda: family_model(model_type, base=True, vocab_size=VOCAB)


TINY_MODELS: dict[str, Callable[[], nn.Module]] = {
    "albert": _albert,
    "bert": _bert,
    "distilbert": _distilbert,
    "gpt2": _gpt2,
    "gpt_neox": _family("gpt_neox"),
    "headkit": _headkit,
    "llama": _llama,
    "olmo2": _family("olmo2"),
    "phi3": _family("phi3"),
    "roberta": _roberta,
    "vit": _vit,
}


def tiny_model(name: str) -> nn.Module:
    """A fresh tiny model of architecture `name` (an adapter name), seeded, in eval mode."""
    torch.manual_seed(0)
    return TINY_MODELS[name]().eval()


def tiny_inputs(name: str, batch: int = 2) -> dict[str, torch.Tensor]:
    """Inputs for ``tiny_model(name)``: images for ViT; token ids with the last row right-padded otherwise."""
    generator = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(batch, 3, 8, 8, generator=generator)}
    input_ids = torch.randint(1, VOCAB, (batch, SEQ), generator=generator)
    attention_mask = torch.ones(batch, SEQ, dtype=torch.long)
    attention_mask[-1, -2:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def outputs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The last hidden state with padded positions zeroed (what the model puts there is not defined)."""
    states = model(**inputs).last_hidden_state
    if "attention_mask" in inputs:
        states = states * inputs["attention_mask"][..., None]
    return states


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the state dict, to check later that a refused operation changed nothing."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert list(state) == list(before)
    for name, tensor in before.items():
        assert state[name].shape == tensor.shape and torch.equal(state[name], tensor), name
