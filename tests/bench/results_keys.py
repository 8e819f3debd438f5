"""The results.json keys of every benchmark, as a snapshot: a refactoring that drops or renames a key fails here.

:func:`key_paths` reads a report as the set of its key paths (``encoder.points[].cosine``): list items merge into
``[]``, and keys that are data rather than names (numbers, such as layers, lengths or image counts, and the
names in :data:`DATA_KEYS`: variants, mechanisms, models timed) into ``*``. :func:`assert_results_keys` compares a
tiny run's report with ``results_keys.json``; ``HEADKIT_UPDATE_RESULTS_KEYS=1`` rewrites that benchmark's entry
(on purpose, as the options snapshot is updated on purpose).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).with_name("results_keys.json")
# Sections whose keys are the run's own names (what was measured), not the benchmark's vocabulary.
DATA_KEYS = {
    "forward_ms",
    "relative_to_original",
    "completion_seconds",
    "heads_per_layer",
    "heads_before",
    "heads_after",
    "kv_heads_before",
    "kv_heads_after",
    "kept",
    "pruned",
    "variants",
    "passkey_keys",
    "settings",  # the options, guarded by tests/test_cli_bench_options.py
    "stock_config",
    "scores",
}


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path of `value` (dicts and lists, nested)."""
    paths: set[str] = set()
    if isinstance(value, dict):
        data = prefix.rsplit(".", 1)[-1].removesuffix("[]") in DATA_KEYS
        for key, item in value.items():
            name = "*" if data or str(key).lstrip("-").replace(".", "").isdigit() else str(key)
            path = f"{prefix}.{name}" if prefix else name
            paths.add(path)
            paths |= key_paths(item, path)
    elif isinstance(value, list):
        for item in value:
            paths |= key_paths(item, f"{prefix}[]")
    return paths


def assert_results_keys(benchmark: str, report: dict[str, Any]) -> None:
    """`report`'s key paths are the snapshot's for `benchmark` (or, with HEADKIT_UPDATE_RESULTS_KEYS=1, become it)."""
    snapshot = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    found = sorted(key_paths(report))
    if os.environ.get("HEADKIT_UPDATE_RESULTS_KEYS") == "1":
        snapshot[benchmark] = found
        SNAPSHOT.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
        return
    assert benchmark in snapshot, (
        f"no results-keys snapshot for {benchmark!r}: run with HEADKIT_UPDATE_RESULTS_KEYS=1"
    )
    expected = set(snapshot[benchmark])
    missing, extra = sorted(expected - set(found)), sorted(set(found) - expected)
    assert not missing and not extra, f"{benchmark}: results keys missing {missing}, new {extra}"
