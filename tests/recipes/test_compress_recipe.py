import importlib
import json

import pytest
import torch
import transformers

import headkit
from headkit.cli import main
from headkit.errors import HeadkitError

# The module, not the function the package exports under the same name.
compress_recipe = importlib.import_module("headkit.recipes.compress")

transformers.logging.set_verbosity_error()


def _run(args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    return exit_info.value.code


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    for i in range(16):
        (folder / f"doc{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 31}" for j in range(300)))
    return folder


FAST = ["--window", "16", "--batch-size", "4", "--held-out", "2", "--timing-repeats", "1", "--max-iter", "5"]


def test_a_gpt2_language_model_keeps_its_lm_head_and_generates(save_tiny_causal_lm, text_folder, tmp_path):
    model_dir = save_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    out = tmp_path / "out"
    args = ["compress", str(model_dir), "--dim", "16", "--recovery-steps", "3", "--data", str(text_folder)]
    assert _run([*args, "--out", str(out), *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "causal_lm" and report["dim_shared_query_key"] == 16
    assert report["perplexity_original"] > 0 and report["perplexity_recovered"] > 0
    assert 0 <= report["top1_agreement"] <= 1 and len(report["distill_losses"]) == 3
    assert report["reload_max_abs_diff"] == 0.0
    model = headkit.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    ids = torch.tensor([[3, 9, 27, 81]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)


def test_full_width_gpt2_is_exact(save_tiny_causal_lm, text_folder, tmp_path):
    model_dir = save_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    out = tmp_path / "out"
    args = ["compress", str(model_dir), "--dim", "32", "--data", str(text_folder), "--max-iter", "100"]
    assert _run([*args, "--out", str(out), *FAST[:-2]]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["perplexity_after_swap"] == pytest.approx(report["perplexity_original"], rel=1e-4)


def test_rotary_models_refuse_collaborative_widths_and_nothing_is_written(
    save_tiny_causal_lm, text_folder, tmp_path, capsys
):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    out = tmp_path / "out"
    args = ["compress", str(model_dir), "--dim", "16", "--data", str(text_folder), "--out", str(out), *FAST]
    assert _run(args) == 2
    assert "--kv-rank" in capsys.readouterr().err and not out.exists()
    args = ["compress", str(model_dir), "--kv-rank", "29", "--rope-dims", "2", "--data", str(text_folder)]
    assert _run([*args, "--out", str(out), *FAST]) == 2
    assert (
        "kv_rank must be an integer in [1, 28]" in " ".join(capsys.readouterr().err.split())
        and not out.exists()
    )
    args = [
        "compress",
        str(model_dir),
        "--kv-rank",
        "6",
        "--rope-selection",
        "best",
        "--data",
        str(text_folder),
    ]
    assert _run([*args, "--out", str(out), *FAST]) == 2
    assert "--rope-selection must be one of fitted, norms" in capsys.readouterr().err and not out.exists()
    fold = [*args[:4], "--rope-dims", "2", "--rope-selection", "rorope", "--rope-fold", "3", *args[6:]]
    assert _run([*fold, "--out", str(out), *FAST]) == 2
    message = "rope_fold must divide head_dim/2 = 4 (one of [1, 2, 4]), got 3"
    assert message in " ".join(capsys.readouterr().err.split())
    assert not out.exists()
    args[args.index("--rope-selection") : args.index("--rope-selection") + 2] = ["--repair-precision", "half"]
    assert _run([*args, "--out", str(out), *FAST]) == 2
    assert (
        "--repair-precision must be one of auto, float32, bfloat16" in capsys.readouterr().err
        and not out.exists()
    )


def test_transmla_options_pass_through_to_the_conversion_and_its_report(
    save_tiny_causal_lm, text_folder, tmp_path
):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    out = tmp_path / "out"
    args = [
        "compress",
        str(model_dir),
        "--kv-rank",
        "6",
        "--rope-dims",
        "2",
        "--rope-selection",
        "rorope_fitted",
    ]
    args += ["--rope-fold", "2", "--balance-kv", "--no-repair", "--data", str(text_folder)]
    args += ["--calibration-windows", "4", "--eval-window", "24"]
    assert _run([*args, "--out", str(out), *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["rope_selection"], report["rope_fold"], report["balance_kv"]) == ("rorope_fitted", 2, True)
    entry = headkit.from_pretrained(out).config.headkit_surgery[-1]
    assert (entry["rope_selection"], entry["rope_fold"], entry["balance_kv"]) == ("rorope_fitted", 2, True)


def test_auto_repairs_in_bfloat16_only_where_the_device_computes_it_natively(monkeypatch):
    model = torch.nn.Linear(2, 2)
    for native in (True, False):
        monkeypatch.setattr(compress_recipe, "native_bfloat16", lambda device, native=native: native)
        expected = torch.bfloat16 if native else None
        assert compress_recipe.repair_precision("auto", model) == expected
        assert compress_recipe.repair_precision("bfloat16", model) == torch.bfloat16
        assert compress_recipe.repair_precision("float32", model) is None


def test_a_llama_gets_latent_keys_values_distils_reloads_and_generates(
    save_tiny_causal_lm, text_folder, tmp_path
):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    out = tmp_path / "out"
    args = ["compress", str(model_dir), "--kv-rank", "6", "--rope-dims", "2", "--recovery-steps", "2"]
    args += ["--data", str(text_folder), "--calibration-windows", "4", "--eval-window", "24"]
    assert _run([*args, "--out", str(out), *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "latent" and report["kv_rank"] == 6 and report["rope_dims"] == 2
    assert report["rope_selection"] == "rorope_fitted" and report["conversion"]["max_rope_error"] > 0
    # 2 layers × (6 + 2 kv heads × 2 rotary dims) float32 numbers, against 2 × 2 × 2 × 8.
    assert report["kv_bytes_per_token"] == 2 * 10 * 4 and report["kv_bytes_per_token_original"] == 2 * 32 * 4
    assert report["data"]["eval_window"] == 24 and len(report["distill_losses"]) == 2
    for key in (
        "perplexity_original",
        "perplexity_partial_rope",
        "perplexity_after_swap",
        "perplexity_recovered",
    ):
        assert report[key] > 0
    assert report["reload_max_abs_diff"] == 0.0
    model = headkit.from_pretrained(out)
    ids = torch.tensor([[3, 9, 27, 81]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)


def test_a_full_size_latent_llama_is_exact(save_tiny_causal_lm, text_folder, tmp_path):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    out = tmp_path / "out"
    args = ["compress", str(model_dir), "--kv-rank", "16", "--rope-dims", "8", "--data", str(text_folder)]
    assert _run([*args, "--out", str(out), "--calibration-windows", "4", *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["perplexity_after_swap"] == pytest.approx(report["perplexity_original"], rel=1e-5)
    assert report["perplexity_partial_rope"] == pytest.approx(report["perplexity_original"], rel=1e-5)
    assert report["kv_cache_fraction"] == 1.0


def test_latent_repair_fits_each_layer_before_recovery_and_no_repair_skips_it(
    save_tiny_causal_lm, text_folder, tmp_path
):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    args = ["compress", str(model_dir), "--kv-rank", "6", "--rope-dims", "2", "--recovery-steps", "0"]
    args += [
        "--data",
        str(text_folder),
        "--calibration-windows",
        "4",
        "--repair-windows",
        "8",
        "--repair-steps",
        "20",
    ]
    args += ["--rank-allocation", "spectrum", "--repair-precision", "bfloat16", *FAST]
    assert _run([*args, "--out", str(tmp_path / "on")]) == 0
    report = json.loads((tmp_path / "on" / "report.json").read_text())
    repair = report["repair"]
    assert repair["layers"] == [0, 1] and repair["steps"] == 20 and repair["tokens"] == 8 * 16
    assert repair["precision"] == "bfloat16"
    assert all(a <= b for a, b in zip(repair["error_after"], repair["error_before"], strict=True))
    # no recovery step: the result is the repaired model
    assert report["perplexity_recovered"] == pytest.approx(repair["perplexity"])
    assert "repair" in report["stage_seconds"] and report["reload_max_abs_diff"] == 0.0
    assert report["rank_allocation"] == "spectrum" and sum(report["kv_ranks"]) == 2 * 6
    assert _run([*args, "--out", str(tmp_path / "off"), "--no-repair"]) == 0
    off = json.loads((tmp_path / "off" / "report.json").read_text())
    assert off["repair"] is None and off["perplexity_recovered"] == off["perplexity_after_swap"]
    assert off["perplexity_after_swap"] == report["perplexity_after_swap"]


def test_too_few_training_windows_for_the_repair_are_refused_before_any_text_is_read(
    save_tiny_causal_lm, tmp_path, monkeypatch
):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")

    def no_text(*args, **kwargs):
        raise AssertionError("text was read")

    monkeypatch.setattr(compress_recipe, "load_text", no_text)
    with pytest.raises(HeadkitError, match="--repair-windows must be below the run's 10 training windows"):
        compress_recipe.compress(
            model=model_dir, kv_rank=6, rope_dims=2, train_texts=10, repair_windows=10, out=tmp_path / "out"
        )
    with pytest.raises(HeadkitError, match="the repair needs at least 2 training windows"):
        compress_recipe.compress(model=model_dir, kv_rank=6, rope_dims=2, train_texts=1, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # without --repair-windows, the training windows are shared out: 64 to fit and 8 to judge of the default 512
    assert compress_recipe.repair_split(compress_recipe.CompressSettings()) == (64, 8)
    assert compress_recipe.repair_split(compress_recipe.CompressSettings(train_texts=8)) == (4, 4)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("lr", 0.0, "--lr must be a positive number, got 0.0"),
        ("window", 1, "--window must be an integer ≥ 2, got 1"),
        ("train_texts", 0, "--train-texts must be a positive integer, got 0"),
        ("rope_selection", "best", "--rope-selection must be one of"),
        ("repair_precision", "float64", "--repair-precision must be one of auto, float32, bfloat16"),
        ("repair_lr", float("inf"), "--repair-lr must be a positive number"),
        ("kv_rank", 0, "--kv-rank must be a positive integer, got 0"),
    ],
)
def test_the_library_checks_compress_settings_as_their_fields_declare(field, value, message):
    from headkit.errors import HeadkitError
    from headkit.recipes.compress_settings import CompressSettings, check_settings

    with pytest.raises(HeadkitError, match=message):
        check_settings(CompressSettings(**{field: value}))
