"""The architecture as tests: each tier imports only from the tiers beneath it; test files have unique names."""

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "headkit"
# "analysis" also holds the tier-less helpers data, devices and files; "top": bench, cli, demo, train and the package root.
TIERS = ["ops", "layers", "models", "surgery", "analysis", "recipes", "top"]
SUPPORT = {"data", "devices", "files"}
# Beneath every tier, importable by all: the error type, and the one module that meets transformers' releases.
TIERLESS = {"errors", "compat"}


def _tier(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "headkit" or len(parts) == 1:
        return "top" if module == "headkit" else None
    head = parts[1]
    if head in TIERS:
        return head
    if head in SUPPORT:
        return "analysis"
    return None if head in TIERLESS else "top"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _tier_files(tier: str) -> list[Path]:
    files = sorted((SOURCE / tier).rglob("*.py")) if (SOURCE / tier).is_dir() else []
    if tier == "analysis":
        files += [SOURCE / f"{name}.py" for name in sorted(SUPPORT)]
    return files


@pytest.mark.parametrize("tier", TIERS[:-1])
def test_each_tier_imports_only_from_the_tiers_beneath_it(tier):
    violations = []
    for path in _tier_files(tier):
        for name in _imports(path):
            target = _tier(name)
            if target is not None and TIERS.index(target) > TIERS.index(tier):
                violations.append(f"{path.relative_to(SOURCE)} imports {name}")
    assert not violations, "\n".join(violations)


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
