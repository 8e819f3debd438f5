"""`headkit bench speed`: the registry, a tiny end-to-end run, argument errors, the CLI, atomic report writing."""

from __future__ import annotations

import io
import json
import math
import stat
import subprocess
import sys

import pytest
import torch
from results_keys import assert_results_keys
from rich.console import Console

from headkit.bench import speed
from headkit.bench._report import markdown_table
from headkit.bench.speed import MECHANISMS, SpeedSettings, Target, make_inputs, run_speed_benchmark
from headkit.cli import main
from headkit.files import regular_file_mode, write_atomic, write_json_atomic
from headkit.ops import KernelSpec, linear_attention
from headkit.ops.linear import causal_linear_attention_flops

# Sizes that differ from one another, so that a layout symbol mapped to the wrong size shows.
B, H, T, D = 2, 3, 5, 4
QKV = {"q": (B, H, T, D), "k": (B, H, T, D), "v": (B, H, T, D)}
# The shapes each kernel's signature documents (headkit.ops), written out independently of the registry.
DOCUMENTED_INPUT_SHAPES = {
    "sdpa_causal": QKV,
    "linear_causal": QKV,
    "linear_causal_chunked": QKV,
    "additive_causal": {"x": (B, H, T, D), "scores": (B, H, T)},
    "coca_causal": {"q": (B, H, T, D), "t": (B, H, T, D // 2), "v": (B, H, T, D)},
    "collaborative_causal": {
        "q_shared": (B, T, H * D),
        "k_shared": (B, T, H * D),
        "v": (B, H, T, D),
        "mixing": (H, H * D),
        "content_bias": (B, H, T),
    },
    "sdpa_causal_wide": {"q": (B, H, T, H * D), "k": (B, H, T, H * D), "v": (B, H, T, H * D)},
    "softmax_noncausal": QKV,
}
REAL_MECHANISMS = sorted(MECHANISMS)


# --- the registry --------------------------------------------------------------------------------------------


def test_registry_holds_the_baseline_and_every_documented_mechanism():
    assert set(MECHANISMS) == set(DOCUMENTED_INPUT_SHAPES)
    assert speed.BASELINE in MECHANISMS


@pytest.mark.parametrize("name", REAL_MECHANISMS)
def test_registry_inputs_have_the_documented_shapes(name):
    inputs = make_inputs(MECHANISMS[name], seq_len=T, batch=B, heads=H, head_dim=D, requires_grad=True)
    assert {key: tuple(value.shape) for key, value in inputs.items()} == DOCUMENTED_INPUT_SHAPES[name]
    assert all(
        value.dtype == torch.float32 and value.requires_grad and value.is_leaf for value in inputs.values()
    )
    if name == "coca_causal":
        assert bool((inputs["t"] >= 0).all()), "CoCA magnitudes t must be non-negative"


@pytest.mark.parametrize("name", REAL_MECHANISMS)
def test_registry_inputs_are_reproducible_from_the_seed(name):
    spec = MECHANISMS[name]
    first, again = make_inputs(spec, seq_len=T, seed=3), make_inputs(spec, seq_len=T, seed=3)
    other = make_inputs(spec, seq_len=T, seed=4)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not any(torch.equal(first[key], other[key]) for key in first)


@pytest.mark.parametrize("name", REAL_MECHANISMS)
def test_registry_run_returns_one_output_per_query(name):
    spec = MECHANISMS[name]
    output = spec.run(**make_inputs(spec, seq_len=T, batch=B, heads=H, head_dim=D))
    assert isinstance(output, torch.Tensor)
    # one output row per query, as wide as the values (all heads' width for the wide SDPA anchor)
    value_width = DOCUMENTED_INPUT_SHAPES[name].get("v", (B, H, T, D))[-1]
    assert tuple(output.shape) == (B, H, T, value_width)
    assert bool(torch.isfinite(output).all())


def test_resolve_layout_rejects_unknown_symbols():
    with pytest.raises(ValueError, match="unknown symbols"):
        speed.resolve_layout(("B", "X"), batch=1, heads=1, seq_len=1, head_dim=2)


# --- a tiny end-to-end run -----------------------------------------------------------------------------------

TINY_LENGTHS = [32, 64, 128]
OOM_FROM = 64


def _not_installed(q: torch.Tensor) -> torch.Tensor:
    raise ImportError("No module named 'fake_kernels'")  # an anchor whose library is not installed


def _runs_out_of_memory_from_64(q: torch.Tensor) -> torch.Tensor:
    if q.shape[2] >= OOM_FROM:
        raise torch.OutOfMemoryError("out of memory (simulated)")
    return q.exp()


EXTRA_TARGETS = (
    Target("always passes", "softmax_noncausal", "forward", 64, "time", 1e9),
    Target("always fails", "softmax_noncausal", "forward_backward", 128, "peak_memory", 1e-9),
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run shared by the tests below: every real mechanism that is available, plus two fakes."""
    out_dir = tmp_path_factory.mktemp("speed")
    console_file = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(
            MECHANISMS,
            "not_installed",
            KernelSpec("fake", {"q": ("B", "H", "T", "D")}, _not_installed),
        )
        patch.setitem(
            MECHANISMS,
            "oom_from_64",
            KernelSpec("fake", {"q": ("B", "H", "T", "D")}, _runs_out_of_memory_from_64),
        )
        patch.setattr(speed, "TARGETS", (*speed.TARGETS, *EXTRA_TARGETS))
        results = run_speed_benchmark(
            SpeedSettings(lengths=TINY_LENGTHS, repeats=1, out=out_dir, min_repeat_s=0.0),
            console=Console(file=console_file, width=200),
        )
    return out_dir, results, console_file.getvalue()


def _points(results, name):
    return [p for p in results["points"] if p["mechanism"] == name]


def _available(results):
    return [name for name in REAL_MECHANISMS if results["mechanisms"][name]["available"]]


def test_tiny_run_writes_results_json_equal_to_what_it_returns(tiny_run):
    out_dir, results, _ = tiny_run
    assert json.loads((out_dir / "results.json").read_text()) == results
    assert results["config"]["lengths"] == TINY_LENGTHS
    assert results["config"]["mechanisms"][0] == speed.BASELINE
    assert results["machine"]["device"] == "cpu"
    assert results["machine"]["torch_version"] == torch.__version__
    assert results["machine"]["torch_threads"] == torch.get_num_threads()
    assert results["machine"]["cpu_model"] and results["machine"]["logical_cores"] >= 1
    assert isinstance(results["command"], list) and results["command"]


def test_tiny_run_measures_every_available_mechanism_at_every_point(tiny_run):
    _, results, _ = tiny_run
    assert speed.BASELINE in _available(results)
    for name in _available(results):
        points = _points(results, name)
        assert sorted((p["seq_len"], p["mode"]) for p in points) == sorted(
            (n, mode) for n in TINY_LENGTHS for mode in speed.MODES
        )
        for point in points:
            assert point["error"] is None
            assert len(point["times_s"]) == 1 and point["calls_per_repeat"] == 1
            assert math.isfinite(point["median_s"]) and point["median_s"] > 0
            assert point["peak_bytes"] == point["input_bytes"] + point["extra_peak_bytes"]
            assert point["extra_peak_bytes"] >= 0 and point["input_bytes"] > 0


def test_tiny_run_counts_the_inputs_and_the_cotangent_in_peak_memory(tiny_run):
    _, results, _ = tiny_run
    for name in _available(results):
        for point in _points(results, name):
            inputs = make_inputs(MECHANISMS[name], seq_len=point["seq_len"])
            expected = sum(x.numel() for x in inputs.values()) * 4
            if point["mode"] == "forward_backward":  # the cotangent: one float per output element
                expected += MECHANISMS[name].run(**inputs).numel() * 4
            assert point["input_bytes"] == expected, (name, point["seq_len"], point["mode"])


def test_tiny_run_ratios_are_taken_against_the_baseline_at_the_same_point(tiny_run):
    _, results, _ = tiny_run
    baseline = {(p["seq_len"], p["mode"]): p for p in _points(results, speed.BASELINE)}
    for point in results["points"]:
        if point["error"]:
            assert point["time_ratio"] is None and point["memory_ratio"] is None
            continue
        reference = baseline[(point["seq_len"], point["mode"])]
        assert point["time_ratio"] == pytest.approx(point["median_s"] / reference["median_s"], rel=1e-12)
        assert point["memory_ratio"] == pytest.approx(
            point["peak_bytes"] / reference["peak_bytes"], rel=1e-12
        )
    assert all(p["time_ratio"] == 1.0 and p["memory_ratio"] == 1.0 for p in baseline.values())


def test_tiny_run_skips_a_mechanism_whose_library_is_missing_with_a_note(tiny_run):
    out_dir, results, console_text = tiny_run
    assert results["mechanisms"]["not_installed"]["available"] is False
    assert "not installed" in results["mechanisms"]["not_installed"]["note"]
    assert _points(results, "not_installed") == []
    assert "skipped not_installed" in console_text
    table = (out_dir / "table.md").read_text()
    assert "## Not measured" in table and "- not_installed: not installed" in table


def test_tiny_run_records_out_of_memory_and_skips_longer_lengths(tiny_run):
    _, results, _ = tiny_run
    by_length = {}
    for point in _points(results, "oom_from_64"):
        by_length.setdefault(point["seq_len"], []).append(point)
    assert all(p["error"] is None and p["median_s"] > 0 for p in by_length[32])
    assert all(p["error"].startswith("out of memory") and p["median_s"] is None for p in by_length[64])
    assert all(p["error"].startswith("skipped") and p["peak_bytes"] is None for p in by_length[128])


def test_tiny_run_evaluates_targets_on_the_measured_ratios(tiny_run):
    _, results, _ = tiny_run
    targets = {t["description"]: t for t in results["targets"]}
    for target in EXTRA_TARGETS:
        evaluated = targets[target.description]
        point = next(
            p
            for p in _points(results, target.mechanism)
            if (p["seq_len"], p["mode"]) == (target.seq_len, target.mode)
        )
        ratio = point["time_ratio"] if target.quantity == "time" else point["memory_ratio"]
        assert evaluated["measured_ratio"] == ratio
        assert evaluated["passed"] is (ratio <= target.max_ratio)
    assert targets["always passes"]["passed"] is True and targets["always fails"]["passed"] is False
    # The targets are at T = 512 … 8192, none of which this run measured.
    assert all(targets[t.description]["passed"] is None for t in speed.TARGETS)


def test_tiny_run_writes_a_markdown_table_and_a_png(tiny_run):
    out_dir, results, console_text = tiny_run
    assert sorted(p.name for p in out_dir.iterdir()) == ["results.json", "speed.png", "table.md"]
    table = (out_dir / "table.md").read_text()
    for name in _available(results):
        assert f"| {name} | fwd |" in table and f"| {name} | fwd+bwd |" in table
    assert all(f"T={n}" in table for n in TINY_LENGTHS)
    assert "| always passes |" in table and "| pass |" in table and "| FAIL |" in table
    png = (out_dir / "speed.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert "targets" in console_text and "always fails" in console_text


def test_quick_preset_shortens_lengths_and_repeats_and_the_run_always_measures_the_baseline(tmp_path):
    quick = SpeedSettings.quick(mechanisms=("softmax_noncausal",))
    assert (quick.lengths, quick.repeats) == ((512, 1024, 2048), 3)
    results = run_speed_benchmark(
        SpeedSettings.quick(lengths=(32,), mechanisms=("softmax_noncausal",), out=tmp_path, min_repeat_s=0.0),
        console=Console(file=io.StringIO()),
        show_progress=False,
    )
    assert_results_keys("speed", results)
    assert results["config"]["lengths"] == [32] and results["config"]["repeats"] == 3
    assert results["config"]["mechanisms"] == [speed.BASELINE, "softmax_noncausal"]
    assert {p["seq_len"] for p in results["points"]} == {32}
    assert all(len(p["times_s"]) == 3 for p in results["points"])


def test_a_baseline_out_of_memory_leaves_the_ratios_at_that_length_empty(tmp_path, monkeypatch):
    monkeypatch.setitem(
        MECHANISMS,
        speed.BASELINE,
        KernelSpec("fake baseline", {"q": ("B", "H", "T", "D")}, _runs_out_of_memory_from_64),
    )
    results = run_speed_benchmark(
        SpeedSettings(
            lengths=(32, 64), mechanisms=("softmax_noncausal",), repeats=1, out=tmp_path, min_repeat_s=0.0
        ),
        console=Console(file=io.StringIO()),
        show_progress=False,
    )
    at_64 = [p for p in _points(results, "softmax_noncausal") if p["seq_len"] == 64]
    assert all(p["error"] is None and p["median_s"] > 0 for p in at_64)
    assert all(p["time_ratio"] is None and p["memory_ratio"] is None for p in at_64)
    assert "| softmax_noncausal | fwd | " in (tmp_path / "table.md").read_text()


# --- bad arguments -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mechanisms": ("sdpa_causal", "nope")}, "'nope'.*valid names: sdpa_causal, linear_causal"),
        ({"device": "tpu"}, "--device must be 'cpu' or 'cuda'"),
        ({"device": "meta"}, "--device must be 'cpu' or 'cuda'"),
        ({"lengths": (64, 0)}, "--lengths"),
        ({"lengths": ()}, "--lengths"),
        ({"repeats": 0}, "--repeats"),
    ],
)
def test_bad_arguments_raise_before_anything_is_written(tmp_path, kwargs, message):
    out_dir = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        run_speed_benchmark(SpeedSettings(out=out_dir, **kwargs))
    assert not out_dir.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="CUDA is not available"):
        run_speed_benchmark(SpeedSettings(device="cuda", out=tmp_path))


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(NotADirectoryError, match="--out"):
        run_speed_benchmark(SpeedSettings(out=a_file))


# --- through the command line --------------------------------------------------------------------------------


def test_cli_unknown_mechanism_exits_2_with_one_line_on_stderr(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "speed", "--mechanisms", "nope", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "nope" in err and "sdpa_causal" in err


def test_cli_runs_the_benchmark(tmp_path):
    out_dir = tmp_path / "out"
    main(
        [
            "bench",
            "speed",
            "--lengths",
            "32",
            "--repeats",
            "1",
            "--mechanisms",
            "sdpa_causal",
            "--out",
            str(out_dir),
        ]
    )
    results = json.loads((out_dir / "results.json").read_text())
    assert results["config"]["lengths"] == [32] and results["config"]["repeats"] == 1
    assert [p["mode"] for p in results["points"]] == list(speed.MODES)


def test_python_dash_m_reaches_the_cli(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "headkit.bench.speed", "--mechanisms", "nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2
    assert "nope" in completed.stderr and "valid names" in completed.stderr


# --- atomic report writing (headkit.files) ----------------------------------------------------------------


def test_write_json_atomic_round_trips_and_creates_folders(tmp_path):
    path = tmp_path / "a" / "b" / "results.json"
    write_json_atomic(path, {"x": [1, 2.5, None]})
    assert json.loads(path.read_text()) == {"x": [1, 2.5, None]}
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]
    assert stat.S_IMODE(path.stat().st_mode) == regular_file_mode()


def test_failed_writes_leave_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "results.json"
    write_json_atomic(path, {"old": True})
    with pytest.raises(ValueError):
        write_json_atomic(path, {"not json": float("nan")})

    def crash_halfway(file) -> None:
        file.write(b'{"half": ')
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_atomic(path, crash_halfway)
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_markdown_table_escapes_pipes_and_checks_row_lengths():
    assert markdown_table(["a", "b"], [["x|y", 2]]) == "| a | b |\n| --- | --- |\n| x\\|y | 2 |\n"
    with pytest.raises(ValueError, match=r"rows\[0\] has 1 cells, expected 2"):
        markdown_table(["a", "b"], [["only one"]])


# --- the rate against the matmul rate, and the fast-transformers anchor ---------------------------------------


def test_tiny_run_reports_the_linear_forward_rate_against_the_matmul_rate_of_the_same_run(tiny_run):
    out_dir, results, console_text = tiny_run
    assert set(results["matmul_gflops_per_s"]) == {str(n) for n in TINY_LENGTHS}
    assert all(rate > 0 for rate in results["matmul_gflops_per_s"].values())
    assert results["config"]["threads"] == torch.get_num_threads()
    for point in _points(results, "linear_causal"):
        if point["mode"] != "forward":
            assert "gflops_per_s" not in point
            continue
        flops = causal_linear_attention_flops(speed.BATCH, speed.HEADS, point["seq_len"], speed.HEAD_DIM)
        matmul = results["matmul_gflops_per_s"][str(point["seq_len"])] * 1e9
        assert point["flops"] == flops
        assert point["gflops_per_s"] == pytest.approx(flops / point["median_s"] / 1e9, rel=1e-12)
        assert point["matmul_fraction"] == pytest.approx(flops / point["median_s"] / matmul, rel=1e-12)
        assert point["matmul_time_ratio"] == pytest.approx(1 / point["matmul_fraction"], rel=1e-12)
    assert all("gflops_per_s" not in p for p in _points(results, "softmax_noncausal"))  # counts no FLOPs
    assert "linear_causal fwd T=128:" in console_text and "of the fp32 matmul rate" in console_text
    assert "## Rate against the fp32 matmul rate" in (out_dir / "table.md").read_text()


def test_tiny_run_leaves_out_the_anchor_when_fast_transformers_is_absent(tiny_run):
    _, results, _ = tiny_run
    if speed.fast_transformers_installed():
        assert results["mechanisms"][speed.ANCHOR]["available"] is True
    else:
        assert speed.ANCHOR not in results["mechanisms"]


@pytest.mark.skipif(speed.fast_transformers_installed(), reason="fast_transformers is installed here")
def test_the_anchor_asked_for_without_fast_transformers_is_skipped_cleanly(tmp_path):
    console_file = io.StringIO()
    results = run_speed_benchmark(
        SpeedSettings(
            lengths=(32,), mechanisms=(speed.ANCHOR,), repeats=1, out=tmp_path, min_repeat_s=0.0, threads=1
        ),
        console=Console(file=console_file, width=200),
        show_progress=False,
    )
    info = results["mechanisms"][speed.ANCHOR]
    assert info["available"] is False and "not installed" in info["note"]
    assert _points(results, speed.ANCHOR) == []
    assert f"skipped {speed.ANCHOR}" in console_file.getvalue()
    targets = [t for t in results["targets"] if t["reference"] == speed.ANCHOR]
    assert targets and all(t["measured_ratio"] is None and t["passed"] is None for t in targets)
    assert results["config"]["threads"] == 1


def _naive_causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What fast_transformers.causal_product.causal_dot_product computes: Σ_{j ≤ i} (q_i·k_j) v_j."""
    return ((q @ k.transpose(-1, -2)).tril()) @ v


def test_the_anchor_computes_causal_linear_attention_and_its_targets_compare_with_it(tmp_path, monkeypatch):
    # A stand-in for the compiled kernel: the anchor's own wrapping (features, normaliser) is what is tested.
    fake = type(sys)("fast_transformers.causal_product")
    fake.causal_dot_product = _naive_causal_dot_product
    monkeypatch.setitem(sys.modules, "fast_transformers", type(sys)("fast_transformers"))
    monkeypatch.setitem(sys.modules, "fast_transformers.causal_product", fake)
    monkeypatch.setattr(speed, "fast_transformers_installed", lambda: True)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    expected, _ = linear_attention(q, k, v, causal=True)
    torch.testing.assert_close(speed.ANCHORS[speed.ANCHOR].run(q, k, v), expected, rtol=1e-5, atol=1e-6)

    against_anchor = Target("vs anchor", "linear_causal", "forward", 32, "time", 1e9, reference=speed.ANCHOR)
    rate = Target("rate", "linear_causal", "forward", 32, "matmul_time", 1e9)
    monkeypatch.setattr(speed, "TARGETS", (against_anchor, rate))
    results = run_speed_benchmark(
        SpeedSettings(lengths=(32,), mechanisms=(), repeats=1, out=tmp_path, min_repeat_s=0.0),
        console=Console(file=io.StringIO()),
        show_progress=False,
    )
    assert results["mechanisms"][speed.ANCHOR]["available"] is True  # in the default list once installed
    linear, anchor = (
        next(p for p in _points(results, name) if p["mode"] == "forward")
        for name in ("linear_causal", speed.ANCHOR)
    )
    evaluated = {t["description"]: t for t in results["targets"]}
    assert evaluated["vs anchor"]["measured_ratio"] == pytest.approx(linear["median_s"] / anchor["median_s"])
    assert evaluated["rate"]["measured_ratio"] == linear["matmul_time_ratio"]
    assert evaluated["vs anchor"]["passed"] is True and evaluated["rate"]["passed"] is True
