"""Generated text for reports and retrieval: ``model.generate`` without the generation config's sampling
defaults (:func:`generate_tokens`), the padding token it needs (:func:`pad_token_of`), and a greedy sample of a
prompt's continuation (:func:`greedy_sample`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def generate_tokens(
    model: Any,
    prompts: torch.Tensor,
    max_new_tokens: int,
    pad_token_id: int | None,
    *,
    exact: bool = False,
    **options: Any,
) -> torch.Tensor:
    """``model.generate`` after each of ``prompts`` [N, P] (no padding): greedy unless ``do_sample=True``, none
    of the generation config's top-k, top-p or temperature applied; exactly ``max_new_tokens`` new tokens with
    ``exact``, else up to them. Returns the whole sequences [N, P + n]."""
    lengths = {"max_new_tokens": max_new_tokens} | ({"min_new_tokens": max_new_tokens} if exact else {})
    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        top_k=None,
        top_p=None,
        temperature=None,
        pad_token_id=pad_token_id,
        **lengths,
        **({"do_sample": False} | options),
    )


def pad_token_of(tokenizer: Any) -> int | None:
    """The tokenizer's padding token, else its end token (what generate() pads finished rows with)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else getattr(tokenizer, "eos_token_id", None)


@torch.no_grad()
def greedy_sample(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 24) -> str:
    """The model's greedy continuation of `prompt` (the continuation only)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    output = generate_tokens(model, ids, max_new_tokens, pad_token_of(tokenizer))
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
