"""Names a package imports when first used (PEP 562): the ``__getattr__`` and ``__dir__`` of headkit's package
roots, written once. Importing a package then costs only its own module, and a command that needs one config does
not import every surgery (the refusals of a bad option stop before any torch model code)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

Loader = Callable[[], ModuleType]


def lazy_names(
    namespace: dict[str, Any], where: Mapping[str, Loader], modules: Mapping[str, Loader] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package whose globals are `namespace`: a name of `where` is read from the
    module its loader imports, a name of `modules` is the (sub)module its loader imports; each is kept in the
    package's globals once loaded, so it is imported once."""
    package, modules = namespace["__name__"], dict(modules or {})

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(where[name](), name)
        elif name in modules:
            value = modules[name]()
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where) | set(modules))

    return __getattr__, __dir__


__all__ = ["Loader", "lazy_names"]
