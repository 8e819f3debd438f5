"""`headkit bench memory`: its options refused before any work, the shape models' configs at their published
sizes (no weights built), the quick run end to end on a tiny random llama (a process per row, every row a peak and
its stages), a refused recipe option a row with the error, and the preflight's estimate read where a report has one.
"""

import json
import sys
from pathlib import Path

import pytest

from headkit.bench import memory
from headkit.bench.memory import (
    COMPRESS_COLLABORATIVE,
    COMPRESS_LATENT,
    COMPRESSED_CACHE,
    LINEARIZE,
    PRUNE_GROUP,
    SHAPES,
    MemoryBenchSettings,
    PlannedRun,
    build_shape_model,
    measured_row,
    model_cache_folder,
    planned_runs,
    recipe_arguments,
    run_recipe,
    shape_summary,
    skip_reason,
)
from headkit.bench.registry import BENCHMARKS
from headkit.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_keys import assert_results_keys  # noqa: E402


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--models", "gpt-9"], "--models"),
        (["--recipes", "prune-query,distil"], "--recipes"),
        (["--growth-model", "gpt-9"], "--growth-model"),
        (["--dtype", "float16"], "--dtype"),
        (["--lora-rank", "0"], "--lora-rank"),
    ],
)
def test_bad_options_are_refused_in_one_line_before_any_work(tmp_path, capsys, monkeypatch, options, message):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was reached before the options were checked")

    monkeypatch.setattr(memory, "model_path", no_model)
    out = tmp_path / "memory"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "memory", "--quick", *options, "--out", str(out)])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1
    assert not out.exists()


def test_the_shape_models_have_the_published_sizes():
    llama = SHAPES["llama-3.2-1b"].config()
    assert (llama.model_type, llama.hidden_size, llama.intermediate_size) == ("llama", 2048, 8192)
    assert (llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads) == (16, 32, 8)
    assert (llama.head_dim, llama.vocab_size, llama.max_position_embeddings) == (64, 128256, 131072)
    assert llama.tie_word_embeddings and llama.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    qwen = SHAPES["qwen2.5-0.5b"].config()
    assert (qwen.model_type, qwen.hidden_size, qwen.intermediate_size) == ("qwen2", 896, 4864)
    assert (qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads) == (24, 14, 2)
    assert (qwen.vocab_size, qwen.max_position_embeddings, qwen.tie_word_embeddings) == (151936, 32768, True)
    assert qwen.rope_parameters["rope_theta"] == 1e6
    # the published parameter counts (1.24B and 0.49B, tied embeddings), counted on the meta device
    assert shape_summary(llama)["parameters"] == 1_235_814_400
    assert shape_summary(qwen)["parameters"] == 494_032_768


def test_the_plan_skips_collaborative_heads_on_a_rotary_decoder_and_adds_growth_rows():
    settings = MemoryBenchSettings(
        models=("tiny-llama",),
        recipes=(PRUNE_GROUP, COMPRESS_LATENT, COMPRESS_COLLABORATIVE),
        recovery_steps=(0, 30),
        calibration_batch_sizes=(2, 4, 8),
    )
    runs = planned_runs(settings)
    main = [run for run in runs if not run.growth]
    # the grouped pruning at batch 4 without recovery is the growth row of batch 4, in its place
    assert [(run.recipe, run.recovery_steps) for run in main] == [
        (PRUNE_GROUP, 30),
        (COMPRESS_LATENT, 0),
        (COMPRESS_LATENT, 30),
        (COMPRESS_COLLABORATIVE, 0),
        (COMPRESS_COLLABORATIVE, 30),
    ]
    assert runs[0].growth and runs[0].batch_size == 4
    growth = [run for run in runs if run.growth]
    assert [run.calibration_tokens for run in growth] == [2 * b * settings.window for b in (4, 2, 8)]
    shape = shape_summary(SHAPES["tiny-llama"].config())
    assert shape["rotary"] and skip_reason(main[3], shape) and skip_reason(main[1], shape) is None


def test_lora_rank_reaches_every_trained_row_and_not_the_cache():
    settings = MemoryBenchSettings(lora_rank=16)
    for recipe in (PRUNE_GROUP, COMPRESS_LATENT, COMPRESS_COLLABORATIVE, LINEARIZE):
        arguments = recipe_arguments(recipe, settings, 30, settings.batch_size)
        assert arguments[arguments.index("--lora-rank") + 1] == "16", recipe
    assert "--lora-rank" not in recipe_arguments(COMPRESSED_CACHE, settings, 0, settings.batch_size)
    # by default each recipe keeps its own recovery (prune's LoRA 16, compress's every weight)
    assert "--lora-rank" not in recipe_arguments(COMPRESS_LATENT, MemoryBenchSettings(), 30, 4)


def test_the_estimate_is_read_where_the_report_has_one():
    planned = PlannedRun("tiny-llama", PRUNE_GROUP, ("prune",), 30, 4)
    peaks = {"resident_bytes": 2 * 2**30, "stage": "recover", "stages": {"load": 2**30, "recover": 2 * 2**30}}
    report = {"peak_memory": peaks, "stage_seconds": {"load": 1.0, "recover": 60.0}}
    without = measured_row(planned, {}, {"report": report, "seconds": 70.0, "error": None})
    assert without["estimate_gib"] is None and without["estimate_ratio"] is None
    assert without["peak_gib"] == 2.0 and without["seconds_per_step"] == 2.0
    assert without["stages"] == [
        {"stage": "load", "peak_gib": 1.0, "seconds": 1.0},
        {"stage": "recover", "peak_gib": 2.0, "seconds": 60.0},
    ]
    estimate = {"bytes": int(2.4 * 2**30), "stage": "recover", "stages": {"recover": int(2.4 * 2**30)}}
    report["peak_memory"] = peaks | {"estimate": estimate}
    row = measured_row(planned, {}, {"report": report, "seconds": 70.0, "error": None})
    assert row["estimate_ratio"] == pytest.approx(1.2, rel=1e-6) and row["estimate_within_tolerance"]
    assert set(row) == set(without)  # every row has the same keys, estimate or not


def test_the_quick_run_measures_every_row_in_its_own_process(tmp_path):
    out = tmp_path / "memory"
    settings = MemoryBenchSettings.quick(out=out)
    report = BENCHMARKS["memory"].run(settings)
    assert len(report["rows"]) == 2  # the grouped pruning at batch 2 and the growth row at batch 1
    for row in report["rows"]:
        assert row["status"] == "ok" and row["error"] is None, row
        assert row["peak_gib"] > 0 and row["peak_stage"] in {s["stage"] for s in row["stages"]}
        assert {"convert", "measure"} <= {s["stage"] for s in row["stages"]}
        assert all(s["peak_gib"] > 0 and s["seconds"] >= 0 for s in row["stages"])
    assert [row["calibration_tokens"] for row in report["rows"]] == [64, 32]
    assert report["models"][0]["name"] == "tiny-llama" and report["models"][0]["layers"] == 2
    results = json.loads((out / "results.json").read_text())
    assert "Growth with calibration tokens" in (out / "table.md").read_text()
    assert not (out / "rows.partial.json").exists() and len(list((out / "logs").iterdir())) == 2
    assert_results_keys("memory", results)

    # the shape is built once: a second call returns the same folder, untouched
    folder = build_shape_model("tiny-llama", settings.seed, model_cache_folder(settings))
    weights = folder / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert build_shape_model("tiny-llama", settings.seed, model_cache_folder(settings)) == folder
    assert weights.stat().st_mtime_ns == written

    # an option the recipe refuses: a row with the recipe's error, not an exception
    refused = MemoryBenchSettings.quick(extra_arguments=("--micro-batch", "3"))
    arguments = recipe_arguments(PRUNE_GROUP, refused, 0, refused.batch_size)
    result = run_recipe(folder, arguments, timeout=120)
    assert result["report"] is None and "--micro-batch" in result["error"]
    row = measured_row(PlannedRun("tiny-llama", PRUNE_GROUP, arguments, 0, 2), {}, result)
    assert row["status"] == "failed" and row["peak_gib"] is None and row["stages"] == []
