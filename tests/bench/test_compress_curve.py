"""``headkit bench compress``: the collaborative-heads fidelity curve, on a tiny BERT standing in for MiniLM."""

import json
import math
import statistics

import pytest
import transformers
from results_keys import assert_results_keys
from rich.console import Console
from typer.testing import CliRunner

import headkit.bench.compress as compress
from headkit.app import app
from headkit.cli import main
from headkit.errors import HeadkitError

transformers.logging.set_verbosity_error()

FULL = 32  # the tiny encoder: 4 heads of 8
LAYERS = 2
TINY = dict(
    recovery_steps=3,
    batch_size=4,
    max_length=16,
    train_texts=12,
    held_out_texts=8,
    max_iter=10,
    timing_repeats=3,
)


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory, save_tiny_encoder):
    return save_tiny_encoder(tmp_path_factory.mktemp("tiny_encoder_curve"), bias_std=0.3)


@pytest.fixture(scope="module")
def curve(tiny_encoder, tmp_path_factory):
    out = tmp_path_factory.mktemp("curve") / "compress"
    config = compress.CompressBenchmarkConfig(model=tiny_encoder, out=out, dims=(FULL, 8), **TINY)
    return compress.run_compress_benchmark(config, console=Console(quiet=True)), out


def test_results_keys_stay(curve):
    assert_results_keys("compress", curve[0])


def _numbers(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_writes_results_table_and_plot(curve):
    report, out = curve
    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert [width["dim"] for width in saved["widths"]] == [FULL, 8]
    assert all(math.isfinite(x) for width in saved["widths"] for x in _numbers(width))
    table = (out / "table.md").read_text()
    assert f"| {FULL} (full) |" in table and "| 8 |" in table
    assert (out / compress.PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == sorted(["results.json", "table.md", compress.PLOT_FILE])


def test_full_width_is_exact_before_distillation(curve):
    full = curve[0]["widths"][0]
    assert full["exact"] and full["decomposition_max_relative_error"] < 1e-6
    assert full["fidelity_after_swap"]["mean_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert full["fidelity_after_swap"]["min_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert full["fidelity_after_swap"]["max_abs_diff"] < 1e-4


def test_fidelity_is_a_cosine_and_the_compressed_width_loses_some(curve):
    report, _ = curve
    for width in report["widths"]:
        for stage in ("fidelity_after_swap", "fidelity_after_distillation"):
            fidelity = width[stage]
            assert -1 - 1e-6 <= fidelity["min_cosine"] <= fidelity["mean_cosine"] <= 1 + 1e-6
            assert fidelity["max_abs_diff"] >= 0
    compressed = report["widths"][1]
    assert not compressed["exact"] and compressed["fidelity_after_swap"]["mean_cosine"] < 1 - 1e-6


def test_same_budget_for_every_width_and_sizes_match_a_plain_count(curve):
    report, _ = curve
    for width in report["widths"]:
        assert len(width["distill_losses"]) == TINY["recovery_steps"]
        assert width["parameter_ratio"] == pytest.approx(width["parameters"] / report["parameters_original"])
        assert width["forward_ms"] > 0 and width["forward_ms_original"] > 0
        rounds = zip(width["forward_ms_original_rounds"], width["forward_ms_rounds"], strict=True)
        assert width["forward_time_ratio"] == pytest.approx(statistics.median(s / o for o, s in rounds))
        assert len(width["forward_ms_rounds"]) == TINY["timing_repeats"]
        assert width["forward_ms"] == pytest.approx(statistics.median(width["forward_ms_rounds"]))
    # Per layer: query and key (weights and biases) out; shared pair [D̃, 32], mixing [4, D̃], content bias [4, 32] in.
    for width in report["widths"]:
        dim = width["dim"]
        removed = 2 * (FULL * FULL + FULL) - (2 * dim * FULL + 4 * dim + 4 * FULL)
        assert report["parameters_original"] - width["parameters"] == LAYERS * removed


def test_a_width_measures_the_same_alone_as_within_the_curve(curve, tiny_encoder, tmp_path):
    """Every width starts from a fresh copy with the same batches and seed: the other widths change nothing."""
    config = compress.CompressBenchmarkConfig(model=tiny_encoder, out=tmp_path, dims=(8,), **TINY)
    alone = compress.run_compress_benchmark(config, console=Console(quiet=True))["widths"][0]
    within = curve[0]["widths"][1]
    for key in ("distill_losses", "fidelity_after_swap", "fidelity_after_distillation", "parameters"):
        assert alone[key] == within[key], key


@pytest.mark.parametrize("dims", [(0,), (FULL + 1,), (8.5,), ("8",), (), (8, 8), "8"])
def test_bad_dims_are_named(dims, tiny_encoder, tmp_path):
    config = compress.CompressBenchmarkConfig(model=tiny_encoder, out=tmp_path / "o", dims=dims, **TINY)
    with pytest.raises(HeadkitError, match="--dims"):
        compress.run_compress_benchmark(config, console=Console(quiet=True))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("setting", "value", "flag"),
    [
        ("threads", 0, "--threads"),
        ("recovery_steps", -1, "--recovery-steps"),
        ("batch_size", 0, "--batch-size"),
        ("lr", 0.0, "--lr"),
    ],
)
def test_bad_settings_are_named(setting, value, flag, tiny_encoder, tmp_path):
    config = compress.CompressBenchmarkConfig(
        model=tiny_encoder, out=tmp_path, dims=(8,), **(TINY | {setting: value})
    )
    with pytest.raises(HeadkitError, match=flag):
        compress.run_compress_benchmark(config)


def test_refuses_the_model_folder_as_output(tiny_encoder):
    before = sorted(p.name for p in tiny_encoder.iterdir())
    config = compress.CompressBenchmarkConfig(model=tiny_encoder, out=tiny_encoder, dims=(8,), **TINY)
    with pytest.raises(HeadkitError, match="--out"):
        compress.run_compress_benchmark(config)
    assert sorted(p.name for p in tiny_encoder.iterdir()) == before


def test_keeps_a_model_saved_by_the_job_in_the_same_folder(tiny_encoder, tmp_path):
    from headkit.recipes.compress import CompressSettings
    from headkit.recipes.compress import compress as compress_recipe

    assert CompressSettings().out != compress.CompressBenchmarkConfig().out
    out = tmp_path / "compress"
    job = CompressSettings(
        model=tiny_encoder, out=out, dim=8, batch_size=4, max_length=16, held_out_texts=8, timing_repeats=1
    )
    compress_recipe(job, echo=lambda _line: None)
    saved = {p.name: p.read_bytes() for p in out.iterdir()}
    config = compress.CompressBenchmarkConfig(model=tiny_encoder, out=out, dims=(8,), **TINY)
    compress.run_compress_benchmark(config, console=Console(quiet=True))
    assert {name: (out / name).read_bytes() for name in saved} == saved
    assert {"results.json", "table.md", compress.PLOT_FILE} <= {p.name for p in out.iterdir()}


def test_cli_runs_the_quick_curve_with_overrides(tiny_encoder, tmp_path):
    out = tmp_path / "cli"
    args = ["bench", "compress", "--model", str(tiny_encoder), "--dims", f"{FULL},4", "--recovery-steps", "2"]
    result = CliRunner().invoke(app, [*args, "--quick", "--out", str(out), "--seed", "3"])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["dims"] == [FULL, 4] and saved["settings"]["recovery_steps"] == 2
    assert saved["settings"]["seed"] == 3 and saved["settings"]["threads"] == 1
    assert saved["settings"]["batch_size"] == compress.CompressBenchmarkConfig.quick().batch_size
    assert (out / compress.PLOT_FILE).is_file()


@pytest.mark.parametrize("dims", ["0", "x", "8,abc", str(FULL + 1)])
def test_cli_bad_dims_exit_2_naming_the_option(dims, tiny_encoder, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["bench", "compress", "--model", str(tiny_encoder), "--dims", dims, "--out", str(tmp_path / "o")]
        )
    assert exit_info.value.code == 2
    assert "--dims" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
