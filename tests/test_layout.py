"""The architecture as tests: each tier imports only from the tiers beneath it; test files have unique names."""

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "headkit"
TIERS = ["ops", "layers", "models", "surgery", "top"]  # "top": analysis, bench, cli and the package root
TOP = {"analysis", "bench", "cli", "demo", "data", "train", "__init__", "__main__"}


def _tier(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "headkit" or len(parts) == 1:
        return "top" if module == "headkit" else None
    head = parts[1]
    if head in TIERS:
        return head
    return None if head == "errors" else "top"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("tier", TIERS[:-1])
def test_each_tier_imports_only_from_the_tiers_beneath_it(tier):
    violations = []
    for path in sorted((SOURCE / tier).rglob("*.py")):
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
