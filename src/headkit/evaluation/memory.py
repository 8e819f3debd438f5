"""Memory of decoding: the bytes of the decoding cache after a prompt (:func:`cache_bytes`) and their growth
per token (:func:`kv_cache_bytes_per_token`); a cache filled to a context without its prefill
(:func:`filled_cache`); the process's peak resident memory while a call runs (:func:`peak_resident_bytes`) and
while a model decodes from a filled cache (:func:`decode_peak_bytes`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from headkit.compat import cache_keyword, output_cache
from headkit.devices import model_device
from headkit.runs.resident import tracking_peak
from headkit.surgery.latent_heads import LatentCacheLayer
from headkit.surgery.linearize import decoding_state_bytes


@torch.no_grad()
def cache_bytes(model: nn.Module, context: int) -> int:
    """Bytes of the decoding cache after a prompt of `context` tokens (batch 1)."""
    ids = torch.zeros(1, context, dtype=torch.long)
    return decoding_state_bytes(output_cache(model(input_ids=ids, use_cache=True)))


def kv_cache_bytes_per_token(model: nn.Module, context: int = 64) -> float:
    """Growth of the decoding cache per token of context, all layers: 2·G·head_dim numbers per layer for a
    key/value cache, R + G·D for a latent one (:class:`~headkit.surgery.latent_heads.LatentCacheLayer`), 0 for a
    constant-size state. The one measure of KV bytes per token (reports that show whole bytes round it)."""
    return (cache_bytes(model, 2 * context) - cache_bytes(model, context)) / context


def filled_cache(model: nn.Module, batch: int, context: int, seed: int = 0) -> Any:
    """The model's decoding cache for `batch` sequences of `context` tokens, without running a `context`-token
    prefill: a two-token prefill builds the entries the model's layers use, then every key/value entry (keys and
    values [B, G, T, D]) and every latent entry (:class:`~headkit.surgery.latent_heads.LatentCacheLayer`, [B, T, W]) is
    filled with `context` tokens of random numbers. Decoding time and memory depend on the sizes, not the values;
    a constant-size state is left as the prefill made it."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, 2, dtype=torch.long, device=model_device(model))
    cache = output_cache(model(input_ids=ids, use_cache=True))

    def random(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[dim] = context
        return torch.randn(shape, generator=generator, dtype=tensor.dtype).to(tensor.device)

    for layer in cache.layers:
        if isinstance(layer, LatentCacheLayer):
            layer.state, layer.seen_tokens = random(layer.state, 1), context
        elif getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
            layer.keys, layer.values = random(layer.keys, 2), random(layer.values, 2)
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = context
    return cache


def peak_resident_bytes(fn: Callable[[], object]) -> int | None:
    """The process's peak resident memory (VmHWM) while `fn` runs, the peak reset before it
    (:func:`headkit.runs.resident.tracking_peak`: a recipe stage around it still sees it); None where the kernel
    cannot reset it."""
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    with tracking_peak() as peak:
        fn()
    return peak.resident


@torch.no_grad()
def decode_peak_bytes(model: nn.Module, batch: int, context: int) -> int | None:
    """Peak resident memory of the process while `model` fills a `context`-token cache for `batch` sequences and
    decodes one token from it (the weights of every model the process holds included)."""
    token = torch.ones(batch, 1, dtype=torch.long, device=model_device(model))

    def run() -> None:
        cache = filled_cache(model, batch, context)
        model(input_ids=token, **cache_keyword(cache), use_cache=True)
        del cache

    return peak_resident_bytes(run)
