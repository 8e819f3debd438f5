"""The one place headkit meets what changes between transformers releases, and what transformers offers only
under private names.

headkit declares a range of transformers releases (``pyproject.toml``) and tests its two ends (``make test``
runs the suite on the pinned newest release, then a leg on the oldest admitted one). Everything that differs
inside that range is answered here, by asking the installed transformers what it does — never by comparing
version strings — so the rest of ``src/`` writes one code path:

* **The cache keyword.** transformers 5.24 renamed the cache argument of every model call (and the field of
  every model output) from ``past_key_values`` to ``cache``; its own models take both names through a
  deprecation decorator. headkit's forwards use ``cache`` and take ``past_key_values`` too
  (:func:`accepts_cache_alias`); calls into stock models and reads of their outputs go through
  :func:`cache_keyword` and :func:`output_cache`, which use whatever name the installed release uses.
* **Activation checkpointing.** transformers 5.24 renamed ``gradient_checkpointing_enable`` / ``_disable`` to
  ``activation_checkpointing_enable`` / ``_disable`` (the old names warn); :func:`set_activation_checkpointing`
  calls whichever the installed release has.
* **Private access, fenced.** Where transformers has no public way to do what headkit needs, the access lives
  in this module and nowhere else (``tests/test_layout.py`` fails on a private transformers import anywhere
  else); each is tested on both legs, and each says below why nothing public serves.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

# The keyword the installed transformers passes the cache under: generate() calls the model with what its own
# prepare_inputs_for_generation returns, and that method takes the cache under the current name.
CACHE_ARGUMENT: str = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
# The field that model outputs carry the cache in (generate() reads the cache back from it).
CACHE_OUTPUT_FIELD: str = (
    "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"
)
# Every name a caller may pass a cache under, newest first.
CACHE_ARGUMENT_NAMES: tuple[str, ...] = ("cache", "past_key_values")


def accepts_cache_alias(forward: Callable) -> Callable:
    """Let a ``forward(self, ..., cache=None, ...)`` also be called with ``past_key_values=`` — as transformers
    5.22–5.23's ``generate()`` and older user code call it — the way transformers' own models take the
    deprecated name (without the warning: headkit cannot know which release its caller was written for).

    Passing both names is an error naming both, as transformers' own decorator does.
    """

    @functools.wraps(forward)
    def forward_taking_both_names(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "past_key_values" in kwargs:
            legacy = kwargs.pop("past_key_values")
            if kwargs.get("cache") is not None and legacy is not None:
                raise ValueError("pass the cache once: as cache= or as past_key_values=, not both")
            if legacy is not None or "cache" not in kwargs:
                kwargs["cache"] = legacy
        return forward(self, *args, **kwargs)

    return forward_taking_both_names


def cache_keyword(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for calling a stock 🤗 model: ``model(ids, **cache_keyword(cache), use_cache=True)``."""
    return {CACHE_ARGUMENT: cache}


def cache_output(cache: Any) -> dict[str, Any]:
    """``{field: cache}`` for building a model output the installed ``generate()`` reads the cache back from."""
    return {CACHE_OUTPUT_FIELD: cache}


def output_cache(output: Any) -> Any:
    """The cache a model output carries (``output.cache``, or ``output.past_key_values`` before 5.24)."""
    return getattr(output, CACHE_OUTPUT_FIELD, None)


def pop_cache_argument(arguments: dict[str, Any]) -> Any:
    """Remove and return the cache from a call's keyword arguments, under whichever name it came."""
    found = None
    for name in CACHE_ARGUMENT_NAMES:
        value = arguments.pop(name, None)
        found = value if found is None else found
    return found


def cache_parameter(
    forward: Callable, names: tuple[str, ...] = CACHE_ARGUMENT_NAMES
) -> tuple[str | None, int | None]:
    """The name (the first of `names` it has) of a module ``forward``'s cache parameter, and its position among
    the arguments after ``self``; ``(None, None)`` where it has none of them."""
    parameters = list(inspect.signature(forward).parameters)
    name = next((candidate for candidate in names if candidate in parameters), None)
    return name, (None if name is None else parameters.index(name) - 1)


# -- private access, fenced ------------------------------------------------------------------------------------


def attention_implementation(model: Any) -> str:
    """The attention implementation a 🤗 model runs (``"sdpa"``, ``"eager"``, a registered name, …).

    Private: transformers keeps it in ``config._attn_implementation`` and offers only the setter
    (``model.set_attn_implementation``), no public getter.
    """
    return str(model.config._attn_implementation)


def checkpoint_key_renamer(model: Any) -> Callable[[str, Mapping[str, Any]], tuple[str, bool]] | None:
    """A function mapping a checkpoint tensor name to the name `model` uses — ``rename(name, model_state_dict)``
    → ``(new_name, needs_conversion)`` — or None where the installed transformers has no renaming rules.

    ``save_pretrained`` writes some architectures (ViT) under legacy names that ``from_pretrained`` renames
    back while loading. headkit's loader rebuilds a model whose surgery changed its shapes, which
    ``from_pretrained`` cannot load, so it replays the same renaming itself. Private: the rules live in
    ``transformers.conversion_mapping`` and ``core_model_loading``, with no public entry point.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(key: str, expected: Mapping[str, Any]) -> tuple[str, bool]:
        new_key, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        return new_key, converter is not None

    return rename


def set_activation_checkpointing(model: Any, enabled: bool) -> None:
    """Turn 🤗 activation checkpointing of `model`'s decoder layers on (non-reentrant) or off, under the name the
    installed transformers uses. Turning it off also removes the hook on the input embeddings that turning it on
    installed (a local function: a model carrying it cannot be pickled)."""
    if enabled:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    disable = getattr(model, "activation_checkpointing_disable", None)
    (disable or model.gradient_checkpointing_disable)()
    model.disable_input_require_grads()


__all__ = [
    "CACHE_ARGUMENT",
    "CACHE_ARGUMENT_NAMES",
    "CACHE_OUTPUT_FIELD",
    "accepts_cache_alias",
    "attention_implementation",
    "cache_keyword",
    "cache_output",
    "cache_parameter",
    "checkpoint_key_renamer",
    "output_cache",
    "pop_cache_argument",
    "set_activation_checkpointing",
]
