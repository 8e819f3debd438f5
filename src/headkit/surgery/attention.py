"""Surgery inside the stock attention modules, through transformers' own extension points.

Nearly every 🤗 decoder (llama, mistral, qwen2/3, gemma2/3, phi3, gpt_neox, olmo2, granite, starcoder2, GPT-2, …)
computes attention in three steps: its own preamble (projections, biases, q/k norms, rotary), the cache's
``update``, then ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)(module, q, k, v,
mask, scaling=…, **kwargs)``. headkit converts a layer without replacing or copying its module:

* the stock attention module gains one submodule, its **mechanism**, under the name ``headkit_attention``
  (e.g. :class:`headkit.surgery.linearize.LinearizedHeads`); its parameters are saved with the model's;
* the model's attention implementation becomes ``headkit_<base>``, a function registered with
  ``AttentionInterface`` (:func:`headkit_attention_forward`): it runs a module's mechanism where the module has
  one, and the implementation the model ran before (``<base>``: sdpa, flash, … from the registry; eager written
  out by :func:`headkit.ops.eager_attention`, since each family's eager function is its own) for every other
  layer, with the same arguments. The same name is registered with ``AttentionMaskInterface`` under the base's
  mask function, so the model builds exactly the masks it built before;
* a mechanism with a decoding state of its own gets its cache layer through :class:`CacheLayerHook`, a stateless
  forward pre-hook: it reads the cache the decoder layer hands the module (``cache``, ``past_key_values``
  before transformers 5.24, or positionally) and passes the mechanism's entry on as the keyword
  ``headkit_cache_layer``, which the module's ``**kwargs`` carry to the attention function untouched.

So each family keeps its own projections, biases, norms, rotary, scaling and masks. :func:`modules_calling_the_interface`
checks, before any surgery, that a model's attention modules really dispatch through the interface (a module
with a custom ``forward`` would silently ignore the mechanism).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface

from headkit.compat import CACHE_ARGUMENT_NAMES, attention_implementation, cache_parameter
from headkit.errors import HeadkitError
from headkit.layers.base import KV_HEAD_INDEX
from headkit.ops.softmax import eager_attention

MECHANISM = "headkit_attention"
# A module's head gate (Voita et al. 2019): scales each head's output before the output projection.
HEAD_GATE = "head_gate"
POSITION_EMBEDDINGS_KEYWORD = "headkit_position_embeddings"
CACHE_LAYER_KEYWORD = "headkit_cache_layer"
PREFIX = "headkit_"
_PROBE = "headkit_probe"
# What attention modules call their cache parameter: transformers' name (either release), GPT-NeoX's own.
CACHE_PARAMETER_NAMES = (*CACHE_ARGUMENT_NAMES, "layer_past")


def mechanism_of(module: nn.Module) -> nn.Module | None:
    """The headkit mechanism a stock attention module runs, or None."""
    return getattr(module, MECHANISM, None)


def base_implementation(model: nn.Module) -> str:
    """The implementation the model's unconverted layers run: what it ran before any headkit mechanism."""
    current = attention_implementation(model)
    return current[len(PREFIX) :] if current.startswith(PREFIX) else current


def base_attention(base: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The attention function of implementation `base` (eager: :func:`headkit.ops.eager_attention`)."""
    if base == "eager":
        return _eager
    registry = AttentionInterface()
    if base not in registry:
        raise HeadkitError(
            f"attention implementation {base!r} is not registered with transformers' AttentionInterface"
        )
    return registry[base]


def _eager(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    return eager_attention(
        query,
        key,
        value,
        attention_mask,
        scale=scaling,
        softcap=softcap,
        dropout=dropout,
        training=module.training,
    )


class AttentionCall(NamedTuple):
    """One call of the registered attention function, as a mechanism receives it from
    :func:`headkit_attention_forward` (every mechanism's ``forward`` takes one).

    queries [B, H, T, D]; keys and values [B, Hkv, S, ·], as the module's cache update returned them;
    attention_mask: the model's mask, or None; cache_layer: the mechanism's own entry in the cache
    (``mechanism.cache_layer(cache)``), None without a cache; base: the implementation unconverted layers run;
    scaling, dropout: the module's; options: every other keyword the module passed (position embeddings,
    ``output_attentions``, …); module: the stock attention module (what ``base_attention(base)`` takes first)."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    attention_mask: Any
    cache_layer: Any
    base: str
    scaling: float | None
    dropout: float
    options: dict[str, Any]
    module: nn.Module | None = None

    def scale(self, default: float) -> float:
        """The module's score scale where it passed one, else the mechanism's ``default``."""
        return default if self.scaling is None else self.scaling


def headkit_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    base: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered ``headkit_<base>`` attention, per module: key/value heads gathered for the query heads
    (``headkit_kv_head_index``: uneven grouped-query pruning; the cache has stored only the heads still read),
    then the module's mechanism (given an :class:`AttentionCall`, which tells it the base implementation: eager
    returns weights always, the others need not), else the base implementation, then each head's output scaled by the module's
    ``head_gate``. Outputs are [B, T, heads, head_dim], as every attention function returns them."""
    cache_layer = kwargs.pop(CACHE_LAYER_KEYWORD, None)
    index = getattr(module, KV_HEAD_INDEX, None)
    if index is not None:
        key, value = key.index_select(1, index), value.index_select(1, index)
    mechanism = mechanism_of(module)
    if mechanism is None:
        output, weights = base_attention(base)(module, query, key, value, attention_mask, **kwargs)
    else:
        scaling, dropout = kwargs.pop("scaling", None), kwargs.pop("dropout", 0.0)
        call = AttentionCall(
            query, key, value, attention_mask, cache_layer, base, scaling, dropout, kwargs, module
        )
        output, weights = mechanism(call)
    gate = getattr(module, HEAD_GATE, None)
    # A gate over no heads (a layer pruned empty) has nothing to scale.
    if gate is not None and getattr(gate, "num_heads", None) != 0:
        output = gate.scale_heads(output, head_dim=-2)
    return output, weights


def computes_attention_itself(module: nn.Module) -> bool:
    """Whether an attention module computes attention in its own forward rather than through transformers'
    attention interface (headkit's own layers declare ``computes_attention_itself``): it applies its ``head_gate``
    and key/value head index itself, in slots it declares, where a stock module's are applied by the registered
    ``headkit_<base>`` attention function."""
    return bool(getattr(module, "computes_attention_itself", False))


def needs_dispatch(module: nn.Module) -> bool:
    """Whether a stock attention module holds anything only ``headkit_<base>`` runs: a mechanism, a key/value
    head index or a head gate (a module that applies them natively runs none of them through it)."""
    if computes_attention_itself(module):
        return False
    return any(getattr(module, name, None) is not None for name in (MECHANISM, KV_HEAD_INDEX, HEAD_GATE))


def set_attention_implementation(model: nn.Module, implementation: str) -> None:
    """``model.set_attn_implementation`` for a model headkit may have changed: the implementation the layers
    run (``"eager"``, ``"sdpa"``, …), behind ``headkit_<implementation>`` wherever a module needs headkit's
    registered function (a plain ``set_attn_implementation("eager")`` would bypass it)."""
    base = implementation.removeprefix(PREFIX)
    needed = any(needs_dispatch(module) for module in model.modules())
    model.set_attn_implementation(implementation_name(base) if needed else base)


def use_dispatcher(model: nn.Module) -> None:
    """Switch the model to ``headkit_<base>`` (no-op when it runs it already)."""
    name = implementation_name(base_implementation(model))
    if attention_implementation(model) != name:
        model.set_attn_implementation(name)


def release_dispatcher(model: nn.Module) -> None:
    """Give the model back its base implementation once no module needs ``headkit_<base>``."""
    current = attention_implementation(model)
    if current.startswith(PREFIX) and not any(needs_dispatch(module) for module in model.modules()):
        model.set_attn_implementation(current[len(PREFIX) :])


def implementation_name(base: str) -> str:
    """Register ``headkit_<base>`` (attention and mask functions) once; return the name."""
    name = PREFIX + base
    if name not in AttentionInterface():

        def forward(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            return headkit_attention_forward(*args, base=base, **kwargs)

        AttentionInterface.register(name, forward)
    if name not in AttentionMaskInterface():
        register_base_mask(name, base)
    return name


def register_base_mask(name: str, base: str) -> None:
    """Make the model build, under implementation `name`, the masks it built under `base` (sdpa's for a base
    without a mask function of its own)."""
    masks = AttentionMaskInterface()
    AttentionMaskInterface.register(name, masks[base] if base in masks else masks["sdpa"])


class CacheLayerHook:
    """Forward pre-hook (``with_kwargs=True``) of a converted attention module whose mechanism keeps its own
    decoding state: passes ``mechanism.cache_layer(cache)`` to the attention function as the keyword
    ``headkit_cache_layer``. Holds only where the module's signature takes the cache, so it pickles and copies."""

    def __init__(self, module: nn.Module) -> None:
        self.name, self.position = cache_parameter(type(module).forward, CACHE_PARAMETER_NAMES)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cache = next((kwargs[name] for name in CACHE_PARAMETER_NAMES if kwargs.get(name) is not None), None)
        if cache is None and self.position is not None and len(args) > self.position:
            cache = args[self.position]
        cache = getattr(cache, "self_attention_cache", cache)
        if cache is not None:
            kwargs[CACHE_LAYER_KEYWORD] = mechanism_of(module).cache_layer(cache)
        return args, kwargs


class PositionEmbeddingsHook:
    """Forward pre-hook (``with_kwargs=True``) of a converted attention module whose mechanism reads the rotary
    tables (``needs_position_embeddings``): hands the (cos, sin) the decoder layer gives the module to the
    attention function as ``headkit_position_embeddings``, so the mechanism can undo rotations the module
    applied. Stateless, so it pickles and copies."""

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        embeddings = kwargs.get("position_embeddings")
        if embeddings is None and len(args) > 1:
            embeddings = args[1]
        kwargs[POSITION_EMBEDDINGS_KEYWORD] = embeddings
        return args, kwargs


def attach_mechanisms(model: nn.Module, planned: Iterable[tuple[nn.Module, nn.Module]]) -> None:
    """Give each attention module its mechanism and switch the model to ``headkit_<base>``. Call it once
    everything is built and checked: it only assigns (and adds the hooks that hand a mechanism its cache entry
    and, where it asks for them, the module's rotary tables)."""
    for module, mechanism in planned:
        module.add_module(MECHANISM, mechanism)
        if hasattr(mechanism, "cache_layer"):
            module.register_forward_pre_hook(CacheLayerHook(module), with_kwargs=True)
        if getattr(mechanism, "needs_position_embeddings", False):
            module.register_forward_pre_hook(PositionEmbeddingsHook(), with_kwargs=True)
    use_dispatcher(model)


def refuse_modules_off_the_interface(
    model: nn.Module, named_modules: list[tuple[str, nn.Module]], what: str
) -> None:
    """Refuse, before any work, attention modules that would silently ignore a mechanism: a custom ``forward``
    that does not dispatch through the interface, or one that drops its keyword arguments. `what` ends the
    error (e.g. "llama cannot be linearized"). The probe runs the model on two tokens, so only a model that
    takes ``input_ids`` is probed (ViT takes images; its attention dispatches through the interface)."""
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return
    calling = modules_calling_the_interface(model, [module for _, module in named_modules])
    custom = [(name, module) for name, module in named_modules if id(module) not in calling]
    if custom:
        names = ", ".join(f"{name} ({type(module).__name__})" for name, module in custom[:3])
        raise HeadkitError(
            f"headkit plugs into transformers' attention interface, but {names} do(es) not dispatch through it "
            f"(a custom forward) or drop(s) its keyword arguments: {what}"
        )


def modules_calling_the_interface(model: nn.Module, modules: list[nn.Module]) -> set[int]:
    """The ids of those `modules` whose forward dispatches through transformers' attention interface and hands
    it the keywords it was called with — what a mechanism needs. Found by running the model on two tokens
    under a probe implementation; the model is left as it was."""
    base = base_implementation(model)
    seen: set[int] = set()

    def probe(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if kwargs.pop(_PROBE, False):
            seen.add(id(module))
        return headkit_attention_forward(module, *args, base=base, **kwargs)

    def mark(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, _PROBE: True}

    AttentionInterface.register(_PROBE, probe)
    register_base_mask(_PROBE, base)
    previous = attention_implementation(model)
    handles = [module.register_forward_pre_hook(mark, with_kwargs=True) for module in modules]
    parameter = next(model.parameters())
    try:
        model.set_attn_implementation(_PROBE)
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=parameter.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        if attention_implementation(model) != previous:
            model.set_attn_implementation(previous)
    return seen


__all__ = [
    "AttentionCall",
    "CACHE_LAYER_KEYWORD",
    "HEAD_GATE",
    "KV_HEAD_INDEX",
    "CacheLayerHook",
    "MECHANISM",
    "computes_attention_itself",
    "attach_mechanisms",
    "base_attention",
    "base_implementation",
    "headkit_attention_forward",
    "implementation_name",
    "mechanism_of",
    "modules_calling_the_interface",
    "refuse_modules_off_the_interface",
    "needs_dispatch",
    "release_dispatcher",
    "set_attention_implementation",
    "use_dispatcher",
]


# Registered at import, so a pickled or reloaded model finds the implementation its config names.
for _base in ("sdpa", "eager"):
    implementation_name(_base)
