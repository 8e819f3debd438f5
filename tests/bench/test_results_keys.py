"""The results-keys snapshot covers every registered benchmark, and reads reports as it says."""

import json

from results_keys import SNAPSHOT, key_paths

from headkit.bench import load_benchmarks
from headkit.bench.registry import BUILTIN_BENCHMARKS


def test_every_one_of_headkits_benchmarks_has_a_results_keys_snapshot():
    modules = {f"headkit.bench.{module}" for module in BUILTIN_BENCHMARKS}
    names = [name for name, benchmark in load_benchmarks().items() if benchmark.run.__module__ in modules]
    assert sorted(names) == sorted(json.loads(SNAPSHOT.read_text()))


def test_key_paths_merge_list_items_and_data_keys():
    report = {
        "points": [{"a": 1}, {"b": {"128": 2.0}}],
        "timing": {"forward_ms": {"original": 1.0, "half": 2.0}},
        "name": "x",
    }
    assert key_paths(report) == {
        "points",
        "points[].a",
        "points[].b",
        "points[].b.*",
        "timing",
        "timing.forward_ms",
        "timing.forward_ms.*",
        "name",
    }
