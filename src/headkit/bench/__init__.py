"""headkit.bench: the measurements behind the docs/ pages, one ``headkit bench`` command per module.

Each benchmark module registers itself with :mod:`headkit.bench.registry` when imported; :func:`load_benchmarks`
imports them all, so adding a benchmark is adding a module. The registry imports no benchmark: the package does.
"""

import importlib
import pkgutil

from headkit.bench import registry


def load_benchmarks() -> dict[str, registry.Benchmark]:
    """Every registered benchmark: each public module of ``headkit.bench`` is imported (and so registers its
    own) — headkit's own in their order (:data:`~headkit.bench.registry.BUILTIN_BENCHMARKS`), then the others
    by module."""
    builtin = registry.BUILTIN_BENCHMARKS
    found = sorted(info.name for info in pkgutil.iter_modules(__path__))
    names = [*builtin, *(n for n in found if n not in builtin and n[0] != "_" and n != "registry")]
    modules = [f"{__name__}.{module}" for module in names]
    for module in modules:
        importlib.import_module(module)
    rank = {module: index for index, module in enumerate(modules)}
    ordered = sorted(
        registry.BENCHMARKS.values(), key=lambda benchmark: rank.get(benchmark.run.__module__, len(rank))
    )
    return {benchmark.name: benchmark for benchmark in ordered}


__all__ = ["load_benchmarks"]
