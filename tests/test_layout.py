"""The architecture as tests: no import circle, each tier imports only from the tiers beneath it; test files have
unique names."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "headkit"

# Each top-level module's tier, lowest first; a module imports only from its own tier and the tiers beneath it
# (and from TIERLESS). Modules of one tier may import each other (no circle: test_the_import_graph_is_acyclic).
TIERS: dict[str, int] = {
    "ops": 0,
    "layers": 1,
    "models": 2,
    "surgery": 3,
    # Support of the tiers above: text and tokenizers, devices, output files (analysis' plots write files).
    "data": 4,
    "devices": 4,
    "files": 4,
    "analysis": 5,
    # What every run stands on: loading a model (a folder or a GGUF file) and its dtype, text and windows, the
    # losses, the main-process helpers of a launched run, and a command line's errors and exit statuses.
    "runs": 6,
    # What is not a workflow, each package by what it does, beside each other (runtime's fast decoder times its
    # steps with evaluation's clock): the measurements (evaluation), the fast decoder and text generation
    # (runtime), the GGUF export and llama.cpp measurements (export). They read models and text through runs.
    "evaluation": 7,
    "runtime": 7,
    "export": 7,
    # The workflows, which report those measurements and export, and the training command beside them (both
    # train through recipes.loop).
    "recipes": 8,
    "train": 8,
    # Measurement only: the benchmarks run the recipes and the packages beneath them, never the command line
    # (`python -m headkit.bench.<module>` is headkit.bench.registry.run_as_script).
    "bench": 9,
    # The package root re-exports the library: it may import anything beneath the command line.
    "headkit": 10,
    # The command line (its entry point, cli, and the app that declares every command) and the demo it runs,
    # beside each other; `python -m headkit` above them.
    "cli": 11,
    "app": 11,
    "demo": 11,
    "__main__": 12,
}
# Beneath every tier, importable by all: the error type, the one module that meets transformers' releases, the log
# filters, and the lazy package names.
TIERLESS = {"errors", "compat", "logs", "lazy"}


def module_name(path: Path) -> str:
    """The dotted name of a source file; a package's ``__init__`` is the package."""
    parts = ("headkit", *path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def tier_of(module: str) -> str | None:
    """The tier a headkit module belongs to (its top-level module or package), None for a tierless one."""
    parts = module.split(".")
    head = "headkit" if len(parts) == 1 else parts[1]
    if head in TIERLESS:
        return None
    assert head in TIERS, f"{module} has no tier: add {head!r} to TIERS (or TIERLESS)"
    return head


def resolve(name: str) -> str | None:
    """The headkit module an imported name belongs to: ``headkit.x.y`` where ``y`` is a name in ``headkit.x``
    (a function, a class) is ``headkit.x``; None outside headkit."""
    if name.split(".")[0] != "headkit":
        return None
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _is_main_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def imported_names(
    source: str, module: str, *, package: bool = False, main_blocks: bool = False
) -> list[str]:
    """Every name `source` (the text of `module`) imports: ``import a.b``, ``from a import b`` (absolute or
    relative) at any depth — in functions, methods, ``TYPE_CHECKING`` blocks — and
    ``importlib.import_module("literal")`` (a computed name: :data:`COMPUTED`); ``from a import b`` gives ``a.b``
    (:func:`resolve` tells a module from a name in it). The body of ``if __name__ == "__main__":`` is left out
    unless `main_blocks`: it runs only when the file is the program (``python -m``), as the module ``__main__``,
    which nothing imports, so no circle can pass through it — but what it imports is still the module's
    dependency, which the tiers count."""
    base = module if package else module.rpartition(".")[0]
    tree = ast.parse(source)
    skipped = (
        set()
        if main_blocks
        else {id(n) for top in ast.walk(tree) if _is_main_guard(top) for n in ast.walk(top)}
    )
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                origin = f"{anchor}.{origin}" if origin else anchor
            names += [f"{origin}.{alias.name}" for alias in node.names]
        elif _is_import_module_call(node):
            argument = node.args[0] if node.args else None
            literal = isinstance(argument, ast.Constant) and isinstance(argument.value, str)
            names.append(argument.value if literal else COMPUTED)
    return names


# What imported_names gives for ``importlib.import_module(<a computed name>)``: import_graph reads it as the
# package importing each of its own modules (the one use headkit makes of it, checked by a test).
COMPUTED = "<computed>"


def _is_import_module_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"
    )


def import_graph(*, main_blocks: bool = False) -> dict[str, set[str]]:
    """headkit's modules and the headkit modules each imports (edges to itself left out; the imports of
    ``__main__`` blocks too with `main_blocks`)."""
    graph = {}
    for module, path in MODULES.items():
        package = path.name == "__init__.py"
        names = imported_names(path.read_text(), module, package=package, main_blocks=main_blocks)
        if COMPUTED in names:  # a package discovering its modules (pkgutil) imports every one of them
            names += [name for name in MODULES if name.rpartition(".")[0] == module]
        graph[module] = {target for target in map(resolve, names) if target not in (None, module)}
    return graph


def test_only_a_package_imports_modules_by_a_computed_name():
    # import_graph can follow a computed importlib.import_module name only as "the package imports each of its
    # own modules" (headkit.bench and headkit.surgery.adapters find theirs with pkgutil); anywhere else the
    # edge would be invisible, so a module elsewhere names what it imports.
    computed = [
        str(path.relative_to(SOURCE))
        for module, path in MODULES.items()
        if COMPUTED in imported_names(path.read_text(), module) and path.name != "__init__.py"
    ]
    assert not computed, (
        f"importlib.import_module with a computed name outside a package's __init__: {computed}"
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_is_acyclic():
    """No circle among headkit's modules, counting every import :func:`imported_names` sees (function-local and
    importlib ones too). A package's ``__init__`` is the package's module: its imports of its own modules —
    re-exports, or a computed import of each (pkgutil discovery) — are edges like any other. No module here
    imports its package back (it imports the sibling module that defines what it needs, e.g. a benchmark
    imports headkit.bench.registry, not headkit.bench), so a circle through an ``__init__`` is a real one:
    it would leave a module reading a half-initialised package. Python's own implicit import of the parent
    package before a submodule is not an edge: it runs the ``__init__`` first, whatever the submodule imports."""
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# What the import graph cannot see: Python runs a package's __init__ before any module in it (an implicit
# import, no edge), so a module that imports a module of a package whose __init__ leads back to the importer
# would meet it half-initialised. Across tiers the tier test rules that out (the __init__ imports only from its
# tier and beneath, the importer's or lower); within a tier only these imports, each first in a fresh
# interpreter, check it: the packages beside each other in the tier beneath the recipes.
@pytest.mark.parametrize(
    "module", ["headkit.evaluation.quality", "headkit.evaluation.tasks", "headkit.runtime", "headkit.export"]
)
def test_a_package_beside_others_imports_first_in_a_fresh_interpreter(module):
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]


@pytest.mark.parametrize(
    "graph, acyclic",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, True),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, False),
        ({"a": {"a2"}, "a2": set(), "b": {"a", "a2"}}, True),
        ({"a": {"b"}, "b": {"b2"}, "b2": {"a"}}, False),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, acyclic):
    assert (find_cycle(graph) is None) is acyclic


def test_the_import_graph_follows_every_kind_of_import():
    source = """
import headkit.layers.cache
from headkit.recipes.settings import QuickSettings
from . import steps
from ..surgery import io
import importlib
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from headkit.models import HeadkitConfig
def later():
    from headkit.bench.registry import option
    importlib.import_module("headkit.train")
if __name__ == "__main__":
    from headkit.cli import main
"""
    names = imported_names(source, "headkit.recipes.linearize")
    expected = [
        "headkit.bench.registry",
        "headkit.layers.cache",
        "headkit.models",
        "headkit.recipes.settings",
        "headkit.recipes.steps",
        "headkit.surgery.io",
        "headkit.train",
    ]
    assert sorted(filter(None, map(resolve, names))) == expected
    with_main = imported_names(source, "headkit.recipes.linearize", main_blocks=True)
    assert sorted(filter(None, map(resolve, with_main))) == sorted([*expected, "headkit.cli"])


def tier_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each edge of `graph` from a module to a module of a higher tier (a tierless module: beneath every tier)."""
    violations = []
    for module, targets in graph.items():
        tier = tier_of(module)
        for target in sorted(targets):
            beneath = tier_of(target)
            if beneath is not None and (tier is None or TIERS[beneath] > TIERS[tier]):
                violations.append(f"{module} ({tier or 'tierless'}) imports {target} ({beneath})")
    return violations


def test_each_module_imports_only_from_its_own_tier_and_the_tiers_beneath_it():
    # Function-local imports count, and a `__main__` block's too: what a module needs to run as the program is
    # its dependency as much as what it needs when imported (a benchmark's never reaches the command line).
    violations = tier_violations(import_graph(main_blocks=True))
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize(
    "module, source",
    [
        # the infrastructure reaching up, at its top or inside a function
        ("headkit.runs.models", "from headkit.recipes.settings import QuickSettings"),
        ("headkit.evaluation.quality", "def f():\n    from headkit.recipes.distill import distill"),
        ("headkit.runtime.generation", "def f():\n    import headkit.train"),
        # a benchmark reaching the command line, even only as the program
        ("headkit.bench.speed", "if __name__ == '__main__':\n    from headkit.cli import main"),
        ("headkit.bench.registry", "def f():\n    import headkit.cli"),
    ],
)
def test_an_upward_import_is_a_violation(module, source):
    names = imported_names(source, module, main_blocks=True)
    graph = {module: {target for target in map(resolve, names) if target not in (None, module)}}
    assert tier_violations(graph), source


def test_no_benchmark_imports_the_command_line():
    # bench's own guard, whatever the tiers' numbers become: `python -m headkit.bench.<module>` runs its command
    # through headkit.bench.registry.run_as_script, not through headkit.cli.
    graph = import_graph(main_blocks=True)
    reached = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith("headkit.bench")
        for target in targets
        if tier_of(target) in ("cli", "app", "demo", "__main__")
    )
    assert not reached, "\n".join(reached)


def test_test_file_names_are_unique():
    # Test folders are not packages: two files with one name make pytest refuse to collect either.
    tests = Path(__file__).resolve().parent
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name"
        seen[path.name] = path


def test_no_module_imports_another_modules_private_names():
    # A name with a leading underscore is its module's own business: share it under a public name instead.
    violations = []
    for path in sorted(SOURCE.rglob("*.py")):
        here = ".".join(("headkit", *path.relative_to(SOURCE).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("headkit"):
                if node.module == here.removesuffix(".__init__"):
                    continue
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                if private:
                    violations.append(f"{path.relative_to(SOURCE)} imports {private} from {node.module}")
    assert not violations, "\n".join(violations)


# None left: issue 13 removed the last (bench/lm.py and demo.py each defined their own VariantResult).
ALLOWED_DUPLICATE_CLASS_NAMES: set[str] = set()


def test_public_class_names_are_unique():
    # One name, one class: a reader (and a search) should never have to ask which `Foo` an import means.
    defined: dict[str, list[str]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(str(path.relative_to(SOURCE)))
    duplicates = {
        name: places
        for name, places in defined.items()
        if len(places) > 1 and name not in ALLOWED_DUPLICATE_CLASS_NAMES
    }
    assert not duplicates, "\n".join(f"{name}: {', '.join(places)}" for name, places in duplicates.items())


# transformers' public API: what its top level exports, and the modules it documents for extending it. Anything
# else — an underscore name, a family's ``models.<family>.modeling_*`` file, loading internals — can change in any
# release; headkit reaches such things only in headkit/compat.py, the one module exempt from this test.
PUBLIC_TRANSFORMERS_MODULES = {
    "transformers",
    "transformers.activations",
    "transformers.cache_utils",
    "transformers.generation",
    "transformers.integrations",
    "transformers.masking_utils",
    "transformers.modeling_outputs",
}
PRIVATE_ACCESS_MODULE = SOURCE / "compat.py"


def private_transformers_imports(tree: ast.AST) -> list[str]:
    """The imports in `tree` that reach past transformers' public API."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules, names = [node.module], [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module.split(".")[0] != "transformers":
                continue
            if module not in PUBLIC_TRANSFORMERS_MODULES or any(name.startswith("_") for name in names):
                found.append(f"line {node.lineno}: {module} {names or ''}".rstrip())
    return found


def test_src_imports_only_public_transformers_api_outside_the_compat_module():
    violations = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path == PRIVATE_ACCESS_MODULE:
            continue
        violations += [
            f"{path.relative_to(SOURCE)} {hit}"
            for hit in private_transformers_imports(ast.parse(path.read_text()))
        ]
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize(
    "source, private",
    [
        ("from transformers.utils.output_capturing import _active_collector", True),
        ("from transformers.models.llama.modeling_llama import apply_rotary_pos_emb", True),
        ("import transformers.core_model_loading", True),
        ("from transformers import _something", True),
        ("from transformers.cache_utils import Cache", False),
        ("from transformers import AutoModel", False),
        ("import numpy._core", False),
    ],
)
def test_the_private_import_check_tells_private_from_public(source, private):
    assert bool(private_transformers_imports(ast.parse(source))) is private
