"""The generation cache of headkit models: key/value caches and constant-size recurrent states, one API.

A :class:`HeadkitCache` is a :class:`transformers.Cache` holding one entry per decoder layer, of the kind the
layer's class asks for in its ``cache_layer_class`` attribute (the model hands its attention layers to the
cache, which builds what each declares; the cache knows no mechanism by name):

* :class:`transformers.cache_utils.DynamicLayer` (softmax, CoCA, collaborative attention): the keys and
  values of every past token, [B, Hkv, T, D]. Layers call ``cache.update(keys, values, layer_idx)`` — the
  standard transformers API — and attend over what it returns.
* :class:`RecurrentStateLayer` (linear, additive attention): one state object of constant size, whatever
  the layer needs (a NamedTuple of tensors, possibly nested, with the batch as dim 0 of every tensor).
  Layers call ``cache.get_state(layer_idx)`` (None before the first token) and
  ``cache.set_state(state, layer_idx, num_new_tokens)``.

``get_seq_length()`` counts the tokens a layer has seen for both kinds, so ``generate()`` and the models'
position bookkeeping work unchanged, and beam search / batch selection (``reorder_cache``,
``batch_select_indices``, ``batch_repeat_interleave``) index dim 0 of every tensor of every state.
A recurrent state cannot be rewound: ``crop`` (assisted generation) raises for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

# A recurrent state: a tensor, None, or a (Named)tuple of states; every tensor has the batch as dim 0.
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
        f"a recurrent state must be a tensor, None, or a (Named)tuple of those, got {type(state).__name__}"
    )


class RecurrentStateLayer:
    """The cache entry of a recurrent layer: one constant-size state and the number of tokens it summarises.

    Duck-types the per-layer API of :class:`transformers.Cache` (as transformers' own ``DummyLayer`` does),
    so the container's beam-search and batch methods work on it.
    """

    is_compileable = False  # a compilable cache would make generate() build 4D masks we do not use
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self) -> None:
        self.state: State = None
        self.seen_tokens = 0
        # transformers' exporters and DDP helpers read these on every cache layer.
        self.keys = None
        self.values = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seen_tokens={self.seen_tokens})"

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    def get_state(self) -> State:
        return self.state

    def set_state(self, state: State, num_new_tokens: int) -> None:
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative integer, got {num_new_tokens!r}")
        _tensors(state)  # rejects anything that is not a state now, not at the next beam reorder
        self.state = state
        self.seen_tokens += num_new_tokens

    def update(self, *args: Any, **kwargs: Any):
        raise ValueError(
            "this cache layer holds the constant-size state of a recurrent attention layer, not keys and values: "
            "use cache.get_state(layer_idx) / cache.set_state(state, layer_idx, num_new_tokens)"
        )

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        self.state = None
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = map_state(self.state, lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = map_state(self.state, lambda tensor: tensor[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = map_state(self.state, lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                "a recurrent state cannot be rewound (crop): it summarises every past token in constant size"
            )

    def offload(self) -> None:
        self._device = next((t.device for t in _tensors(self.state)), None)
        self.state = map_state(self.state, lambda tensor: tensor.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        device = getattr(self, "_device", None)
        if device is not None:
            self.state = map_state(self.state, lambda tensor: tensor.to(device, non_blocking=True))


def cache_layers(model: nn.Module) -> list[Any]:
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


def _tensors(state: State) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_state(state, collect)
    return found


class HeadkitCache(Cache):
    """Per-layer generation cache for a headkit model: key/value caches and recurrent states side by side.

    Build it from the model (each of its attention layers gets the cache entry its class declares in
    ``cache_layer_class``; a single attention layer is a model of one), or from a list of entries.
    ``HeadkitForCausalLM`` creates one itself when ``use_cache`` is on and none is passed, so ``generate()``
    needs nothing special.

    Example::

        cache = HeadkitCache(model)
        out = model(input_ids, cache=cache, use_cache=True)   # prefill
        out = model(next_ids, cache=cache, use_cache=True)    # one more token
    """

    def __init__(self, model: nn.Module | None = None, *, layers: list[Any] | None = None) -> None:
        if (model is None) == (layers is None):
            raise ValueError("HeadkitCache needs exactly one of model (a headkit model) or layers (a list)")
        if layers is None:
            layers = cache_layers(model)
        super().__init__(layers=list(layers))

    def _layer(self, layer_idx: int) -> Any:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be in [0, {len(self.layers)}), got {layer_idx}")
        return self.layers[layer_idx]

    def _recurrent_layer(self, layer_idx: int) -> RecurrentStateLayer:
        layer = self._layer(layer_idx)
        if not isinstance(layer, RecurrentStateLayer):
            raise ValueError(
                f"cache layer {layer_idx} is a {type(layer).__name__} (keys and values): use "
                "cache.update(keys, values, layer_idx); get_state/set_state are for recurrent layers"
            )
        return layer

    def get_state(self, layer_idx: int) -> State:
        """The recurrent state of layer ``layer_idx``, or None before its first token."""
        return self._recurrent_layer(layer_idx).get_state()

    def set_state(self, state: State, layer_idx: int, num_new_tokens: int) -> None:
        """Store the state of layer ``layer_idx`` after it consumed ``num_new_tokens`` more tokens."""
        self._recurrent_layer(layer_idx).set_state(state, num_new_tokens)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append keys/values [B, Hkv, T, D] for layer ``layer_idx``; return all of them so far."""
        self._layer(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The number of tokens layer ``layer_idx`` has seen (cached keys, or tokens folded into its state)."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._layer(layer_idx).get_mask_sizes(query_length)

    def crop(self, *args: Any, **kwargs: Any) -> None:
        # Every recurrent layer refuses a rewind before any key/value layer is cut: a refused crop leaves the
        # whole cache as it was.
        for layer in self.layers:
            if isinstance(layer, RecurrentStateLayer):
                layer.crop(*args, **kwargs)
        super().crop(*args, **kwargs)

    @property
    def is_recurrent(self) -> list[bool]:
        """Per layer: whether it holds a recurrent state rather than keys and values."""
        return [isinstance(layer, RecurrentStateLayer) for layer in self.layers]


__all__ = ["DynamicLayer", "HeadkitCache", "RecurrentStateLayer", "map_state"]
