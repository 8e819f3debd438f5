"""Print which installed packages differ from a constraints file: `python .ci/version_drift.py constraints/newest.txt`.

`make test-latest` runs it after the suite, so a failure on tomorrow's releases comes with the list of what moved.
"""

import sys
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name


def pinned(path: Path) -> dict[str, str]:
    versions = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            versions[canonicalize_name(name)] = version.strip()
    return versions


def main(path: str) -> int:
    expected = pinned(Path(path))
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    rows = []
    for name in sorted(expected.keys() | installed.keys()):
        before, now = expected.get(name), installed.get(name)
        if before != now and name not in ("headkit", "torch", "pip", "setuptools", "wheel"):  # the project, TORCH, tools
            rows.append(f"  {name}: {before or '(not pinned)'} -> {now or '(not installed)'}")
    print(f"packages that differ from {path}:" if rows else f"every package is at its {path} version")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
