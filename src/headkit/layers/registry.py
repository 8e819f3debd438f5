"""The attention registry: mechanism names → layer classes.

A mechanism becomes available to :class:`~headkit.models.HeadkitConfig` (``attention="name"`` or a
``layer_types`` entry) by decorating its layer class::

    @register_attention("softmax")
    class SoftmaxAttention(HeadkitAttention): ...

:func:`build_attention` is the only place that turns a name into a layer, so models never branch on
mechanism names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headkit.layers.base import HeadkitAttention

# The mechanisms headkit ships. A config may name them even before their module registers them (the
# configuration is valid, only building the layer needs the class); names registered by users are valid too.
BUILTIN_ATTENTION_NAMES: tuple[str, ...] = (
    "softmax",
    "linear",
    "additive",
    "coca",
    "collaborative",
    "hybrid",
)

ATTENTION_LAYERS: dict[str, type[HeadkitAttention]] = {}


def register_attention(name: str, *, rotary: bool = False, compared: bool = True):
    """Class decorator: make the layer class available under ``name`` and record the name on the class.

    Two facts the benchmarks that compare mechanisms (``headkit bench decode``, ``lm``, ``digits``) read, set
    on the class as ``rotary`` and ``compared``:

    * ``rotary``: the layer applies rotary positions inside attention (``position_embedding_type="rope"``);
      the models built to compare mechanisms give the other layers learned absolute positions;
    * ``compared``: the mechanism is in those benchmarks' default runs (it is accepted by name either way).
    """
    check_registration("attention", ATTENTION_LAYERS, name)

    def register(layer_class: type[HeadkitAttention]) -> type[HeadkitAttention]:
        check_registration("attention", ATTENTION_LAYERS, name, layer_class)
        layer_class.attention_name = name
        layer_class.rotary, layer_class.compared = rotary, compared
        ATTENTION_LAYERS[name] = layer_class
        return layer_class

    return register


def check_registration(what: str, registry: Mapping[str, type], name: str, cls: type | None = None) -> None:
    """Check a class registry's new entry: ``name`` a non-empty string, and no other class registered under it
    (``cls`` given). Re-registering the same class (a module imported twice, e.g. under importlib.reload) is
    harmless."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")
    existing = registry.get(name)
    if cls is not None and existing is not None and _full_name(existing) != _full_name(cls):
        raise ValueError(f"{what} {name!r} is already registered to {_full_name(existing)}")


def _full_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def valid_attention_names() -> list[str]:
    """Every name a config may use: the built-in mechanisms and anything registered."""
    return sorted(set(BUILTIN_ATTENTION_NAMES) | set(ATTENTION_LAYERS))


def attention_classes() -> dict[str, type[HeadkitAttention]]:
    """The registered layer classes by name: headkit's own in :data:`BUILTIN_ATTENTION_NAMES` order, then the
    others in the order they were registered."""
    order = [name for name in BUILTIN_ATTENTION_NAMES if name in ATTENTION_LAYERS]
    order += [name for name in ATTENTION_LAYERS if name not in BUILTIN_ATTENTION_NAMES]
    return {name: ATTENTION_LAYERS[name] for name in order}


def get_attention_class(name: str) -> type[HeadkitAttention]:
    """The layer class registered under ``name``; ValueError listing the registered names otherwise."""
    if name in ATTENTION_LAYERS:
        return ATTENTION_LAYERS[name]
    registered = ", ".join(sorted(ATTENTION_LAYERS)) or "none"
    if name in BUILTIN_ATTENTION_NAMES:
        raise ValueError(
            f"attention {name!r} is a headkit mechanism whose layer is not available in this installation "
            f"(its module did not register it); registered attention layers: {registered}"
        )
    raise ValueError(f"unknown attention {name!r}; registered attention layers: {registered}")


def build_attention(config: Any, layer_idx: int) -> HeadkitAttention:
    """The attention layer of block ``layer_idx``, of the type ``config.attention_type(layer_idx)`` names."""
    return get_attention_class(config.attention_type(layer_idx))(config, layer_idx)
