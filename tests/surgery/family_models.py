"""Tiny random causal LMs, one per registered decoder family, built from the family's real config class.

Two layers, hidden 64, 4 query heads of width 16 over 2 key/value heads where the family has grouped-query
attention (so that uneven pruning within a group is reachable), vocabulary 100 by default. What sets a family
apart is switched on and made to matter at this size: Gemma's sliding window (4 tokens) and soft-capping,
Gemma's ``query_pre_attn_scalar`` and Granite's ``attention_multiplier`` away from head_dim^-0.5, a SmolLM3 NoPE
layer, partial rotary for GPT-NeoX and Phi-3, biases where the family has them. A family added to
:data:`headkit.surgery.families.FAMILIES` gets a model here with no change: its config class is given the common
settings, and :data:`OVERRIDES` only holds what a family needs beyond them.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tr
from torch import nn

from headkit.surgery.families import FAMILIES

tr.logging.set_verbosity_error()

VOCAB = 100
HEAD_DIM = 16

COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)

OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": dict(attention_bias=True),
    "qwen3": dict(attention_bias=True),
    "granite": dict(attention_multiplier=0.3, attention_bias=True),
    "smollm3": dict(no_rope_layers=[1, 0], use_sliding_window=False),
    "gemma2": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        query_pre_attn_scalar=8,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3_text": dict(
        layer_types=["sliding_attention", "full_attention"], sliding_window=4, query_pre_attn_scalar=8
    ),
    "phi3": dict(partial_rotary_factor=0.5),
    "gpt_neox": dict(num_key_value_heads=None, head_dim=None, partial_rotary_factor=0.5, attention_bias=True),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),  # learned positions: room to decode
    "headkit": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}
# Families whose config takes none of the common settings.
OWN_SETTINGS_ONLY = {"gpt2", "headkit"}


def family_config(
    model_type: str,
    *,
    vocab_size: int = VOCAB,
    special_ids: tuple[int, int, int] | None = (0, 1, 2),
    **overrides: Any,
):
    """The tiny config of `model_type` (pad, bos, eos ids from `special_ids`, or the family's own defaults with
    None; `overrides` set last)."""
    family = FAMILIES[model_type]
    if model_type == "headkit":
        from headkit.models import HeadkitConfig

        config_class = HeadkitConfig
    else:
        config_class = getattr(tr, family.config_class_name)
    settings = {} if model_type in OWN_SETTINGS_ONLY else dict(COMMON)
    settings |= OVERRIDES.get(model_type, {})
    settings = {k: v for k, v in settings.items() if v is not None}
    settings["vocab_size"] = vocab_size
    if special_ids is not None:
        pad, bos, eos = special_ids
        settings |= dict(pad_token_id=pad, bos_token_id=bos, eos_token_id=eos)
    return config_class(**(settings | overrides))


def family_model(model_type: str, *, base: bool = False, **config_options: Any) -> nn.Module:
    """A fresh tiny ``*ForCausalLM`` (or its base model) of `model_type`, seeded, in eval mode; float32 and
    eager-free (the config's default attention implementation)."""
    config = family_config(model_type, **config_options)
    torch.manual_seed(0)
    if model_type == "headkit":
        from headkit.models import HeadkitForCausalLM, HeadkitModel

        model = (HeadkitModel if base else HeadkitForCausalLM)(config)
    else:
        auto = tr.AutoModel if base else tr.AutoModelForCausalLM
        model = auto.from_config(config)
    _spread_norms(model)
    return model.float().eval()


def _spread_norms(model: nn.Module) -> None:
    """Random norm weights (a fresh model's are all ones, or zeros for Gemma's 1 + w), so that slicing or
    misplacing one shows."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))


def family_inputs(batch: int = 2, length: int = 7, vocab_size: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


def save_family_model(model_type: str, folder):
    """The tiny model of `model_type` with headkit's byte tokenizer (ids fit its 259-row embedding), saved to
    `folder` as a recipe's MODEL."""
    from headkit.data import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer

    tokenizer = ByteTokenizer()
    model = family_model(model_type, vocab_size=tokenizer.vocab_size, special_ids=(PAD_ID, BOS_ID, EOS_ID))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
