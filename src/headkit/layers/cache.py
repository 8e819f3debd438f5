"""The cache entries headkit adds to transformers' :class:`~transformers.Cache`: one class for every decoding
state that is not a key/value cache, and the cache of headkit's own models.

Every attention layer — of headkit's own models and of a stock 🤗 model after surgery — keeps its decoding state
in one entry of a transformers ``Cache`` (``cache.layers[layer_idx]``), of one of two kinds:

* :class:`transformers.cache_utils.DynamicLayer` (softmax, CoCA, collaborative attention): the keys and
  values of every past token, [B, Hkv, T, D]. Layers call ``cache.update(keys, values, layer_idx)`` — the
  standard transformers API — and attend over what it returns.
* :class:`StateCacheLayer` (linear, additive, hybrid attention; a linearized, latent or emptied stock layer):
  one state object of whatever the mechanism needs (a NamedTuple of tensors, possibly nested, with the batch as
  dim 0 of every tensor). A mechanism takes its entry with ``StateCacheLayer.in_cache(cache, layer_idx)`` (or a
  subclass's, which swaps it in for the empty key/value entry a stock cache made) and calls ``get_state()``
  (None before the first token) and ``set_state(state, num_new_tokens)``.

A ``StateCacheLayer`` is a transformers ``CacheLayerMixin``, so the container counts its tokens
(``get_seq_length``, mask sizes) like a key/value layer's, and beam search / batch selection (``reorder_cache``,
``batch_select_indices``, ``batch_repeat_interleave``) index dim 0 of every tensor of every state (a scalar
tensor, a count shared by the batch, stays). A state
cannot be rewound: ``crop`` (assisted generation) raises for it.

:class:`HeadkitCache` is the transformers ``Cache`` of a headkit model, built with the entry each of its
attention layers declares in ``cache_layer_class`` (the cache knows no mechanism by name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from headkit.errors import HeadkitError

# A decoding state: a tensor, None, or a (Named)tuple of states; every tensor has the batch as dim 0.
State = Any


def map_state(state: State, fn: Callable[[torch.Tensor], torch.Tensor]) -> State:
    """Apply ``fn`` to every tensor of a (nested) tuple / NamedTuple state, keeping its structure."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, tuple):
        mapped = [map_state(item, fn) for item in state]
        # NamedTuples are rebuilt field by field; plain tuples from the list.
        return type(state)(*mapped) if hasattr(state, "_fields") else tuple(mapped)
    raise ValueError(
        f"a decoding state must be a tensor, None, or a (Named)tuple of those, got {type(state).__name__}"
    )


class StateCacheLayer(CacheLayerMixin):
    """The entry in a 🤗 ``Cache`` of a layer that keeps a state of its own instead of keys and values: the state
    and the number of tokens it summarises.

    A stock module's ``update`` call gets its keys and values back unchanged (surgery's mechanisms read them from
    the attention call and fold them into the state; headkit's own recurrent layers do not call it).

    Not transformers' ``LinearAttentionCacheLayerMixin`` (5.24): that one holds conv/recurrent tensors by index
    and counts no tokens, while these states are anything from a window of keys and values plus running sums to
    a latent per token, and the masks of every later layer are sized from their token count; it is also absent
    before 5.24."""

    is_compileable = (
        False  # a compilable cache would make generate() build 4D masks headkit's models do not use
    )
    is_croppable = False
    is_sliding = False
    supports_early_init = False  # the state is created by the layer's first forward
    describes: ClassVar[str] = "a layer with a state of its own"  # what errors call the layer

    def __init__(self) -> None:
        super().__init__()
        self.state: State = None
        self.seen_tokens = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seen_tokens={self.seen_tokens})"

    @classmethod
    def in_cache(cls, cache: Any, layer_idx: int) -> Any:
        """This class's entry of ``layer_idx`` in ``cache``, put in place of the empty key/value entry the cache
        made for it (or appended, for a cache that creates its layers lazily)."""
        layers = getattr(cache, "layers", None)
        if not isinstance(layers, list):
            raise HeadkitError(
                f"{cls.describes} needs a transformers Cache with per-layer entries, got {type(cache).__name__}"
            )
        if layer_idx < len(layers) and isinstance(layers[layer_idx], cls):
            return layers[layer_idx]
        if layer_idx >= len(layers):
            make = getattr(cache, "layer_class_to_replicate", None)
            if make is None:
                raise HeadkitError(
                    f"the cache holds {len(layers)} layers and cannot grow to layer {layer_idx}; use a DynamicCache"
                )
            while len(layers) <= layer_idx:
                layers.append(make())
        existing = layers[layer_idx]
        if existing.get_seq_length() > 0:
            raise HeadkitError(
                f"cache layer {layer_idx} already holds keys and values of {existing.get_seq_length()} tokens; "
                f"{cls.describes} keeps a state of its own instead (start from an empty cache)"
            )
        layers[layer_idx] = cls()
        return layers[layer_idx]

    def get_state(self) -> State:
        return self.state

    def set_state(self, state: State, num_new_tokens: int) -> None:
        """Store the state after the layer consumed ``num_new_tokens`` more tokens."""
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative integer, got {num_new_tokens!r}")
        state_tensors(state)  # rejects anything that is not a state now, not at the next beam reorder
        self.state = state
        self.is_initialized = state is not None
        self.seen_tokens += num_new_tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate ahead: the state is created by the layer's first forward."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        self.state = None
        self.is_initialized = False
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda tensor: tensor[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def _map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # A scalar (a ring buffer's token count) is shared by every row: it stays as it is.
        self.state = map_state(self.state, lambda tensor: fn(tensor) if tensor.dim() else tensor)

    def state_bytes(self) -> int:
        """Bytes of the state this entry holds."""
        return sum(t.numel() * t.element_size() for t in state_tensors(self.state))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                "a decoding state cannot be rewound (crop): it summarises every past token in its own form"
            )

    def offload(self) -> None:
        self._device = next((t.device for t in state_tensors(self.state)), None)
        self.state = map_state(self.state, lambda tensor: tensor.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        device = getattr(self, "_device", None)
        if device is not None:
            self.state = map_state(self.state, lambda tensor: tensor.to(device, non_blocking=True))


def cache_layers(model: nn.Module) -> list[CacheLayerMixin]:
    """New cache entries for `model`: one per attention layer (a module with ``cache_layer_class`` and
    ``layer_idx``, searched outermost first), of the class it declares, in ``layer_idx`` order 0, 1, …"""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"HeadkitCache is built from the model whose attention layers declare their cache entries "
            f"(HeadkitCache(model)), got {type(model).__name__}"
        )
    attention = {}
    for module in _attention_layers(model):
        if module.layer_idx in attention:
            raise ValueError(
                f"{type(model).__name__} has two attention layers with layer_idx {module.layer_idx}"
            )
        attention[module.layer_idx] = module
    if sorted(attention) != list(range(len(attention))) or not attention:
        raise ValueError(
            f"a cache needs attention layers numbered 0, 1, …; {type(model).__name__} has {sorted(attention)}"
        )
    return [attention[index].cache_layer_class() for index in range(len(attention))]


def _attention_layers(module: nn.Module) -> Iterator[nn.Module]:
    # An attention layer's own submodules (e.g. a hybrid layer's parts) are not layers of the model.
    if hasattr(module, "cache_layer_class") and hasattr(module, "layer_idx"):
        yield module
        return
    for child in module.children():
        yield from _attention_layers(child)


def state_tensors(state: State) -> list[torch.Tensor]:
    """Every tensor of a (nested) state, in order (none for None)."""
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_state(state, collect)
    return found


class HeadkitCache(Cache):
    """The generation cache of a headkit model: a transformers ``Cache`` with, per attention layer, the entry its
    class declares in ``cache_layer_class`` (a single attention layer is a model of one), or the given entries.
    ``HeadkitForCausalLM`` creates one itself when ``use_cache`` is on and none is passed, so ``generate()``
    needs nothing special.

    Example::

        cache = HeadkitCache(model)
        out = model(input_ids, cache=cache, use_cache=True)   # prefill
        out = model(next_ids, cache=cache, use_cache=True)    # one more token
    """

    def __init__(
        self, model: nn.Module | None = None, *, layers: list[CacheLayerMixin] | None = None
    ) -> None:
        if (model is None) == (layers is None):
            raise ValueError("HeadkitCache needs exactly one of model (a headkit model) or layers (a list)")
        super().__init__(layers=cache_layers(model) if layers is None else list(layers))

    def crop(self, tokens_to_remove: int) -> None:
        # The states refuse before any key/value entry is cut: a refused crop leaves the whole cache as it was.
        for layer in self.layers:
            if isinstance(layer, StateCacheLayer):
                layer.crop(tokens_to_remove)
        super().crop(tokens_to_remove)


__all__ = ["DynamicLayer", "HeadkitCache", "StateCacheLayer", "map_state"]
