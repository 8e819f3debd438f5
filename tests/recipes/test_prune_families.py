"""``headkit prune`` end to end on a tiny checkpoint of every registered decoder family (the registry drives the
matrix): query-head pruning, and uniform group pruning that gives the stock architecture where the family's
config can state it; ``headkit compress --kv-rank`` with its repair on every family that takes latent keys/values.
An unsupported decoder family is refused in one line before anything is written."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery"))
from family_models import save_family_model  # noqa: E402

import headkit  # noqa: E402
from headkit.cli import main  # noqa: E402
from headkit.data import ByteTokenizer  # noqa: E402
from headkit.surgery.families import FAMILIES, LATENT, PRUNE, UNIFORM, supported_families  # noqa: E402

# A handful of 16-byte windows, two recovery steps: the run, not the numbers, is tested.
FAST = ["--quick", "--window", "16", "--train-texts", "8", "--held-out", "4", "--batch-size", "4"]
FAST += ["--recovery-steps", "2"]


_save = save_family_model


def _run(args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    return exit_info.value.code


@pytest.mark.parametrize("model_type", supported_families(PRUNE))
def test_prune_query_and_uniform_group_run_end_to_end(model_type, text_folder, tmp_path, capsys):
    family = FAMILIES[model_type]
    model_folder = _save(model_type, tmp_path / "model")
    common = ["--data", str(text_folder), *FAST]

    query = tmp_path / "query"
    assert (
        _run(["prune", str(model_folder), "--unit", "query", "--heads", "5", "--out", str(query), *common])
        == 0
    )
    report = json.loads((query / "report.json").read_text())
    assert report["family"] == model_type and sum(report["heads_after"].values()) == 5
    assert report["reload_max_abs_diff"] == 0.0 and not report["stock_architecture"]
    if family.head_norm == "across_heads":
        assert "normalisation changed" in report["notes"][0] and "recovery absorbs" in report["notes"][0]
        assert "normalisation changed" in capsys.readouterr().out
    reloaded = headkit.from_pretrained(query)
    assert reloaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).shape == (1, 6)

    group = tmp_path / "group"
    args = ["prune", str(model_folder), "--unit", "group", "--uniform", "--heads", "4", "--out", str(group)]
    assert _run([*args, *common]) == 0
    report = json.loads((group / "report.json").read_text())
    config = json.loads((group / "config.json").read_text())
    assert report["heads_after"] == {"0": 2, "1": 2} and report["reload_max_abs_diff"] == 0.0
    assert report["stock_architecture"] == family.supports(UNIFORM)
    assert ("headkit_surgery" in config) != family.supports(UNIFORM)
    if family.supports(UNIFORM):
        assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
            2,
            1,
            16,
        )


def test_an_unsupported_decoder_family_is_refused_in_one_line(text_folder, tmp_path, capsys):
    import transformers

    tokenizer = ByteTokenizer()
    config = transformers.BloomConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, n_layer=1, n_head=4)
    folder = tmp_path / "bloom"
    transformers.BloomForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    capsys.readouterr()  # what saving printed
    out = tmp_path / "out"
    assert _run(["prune", str(folder), "--data", str(text_folder), "--out", str(out), *FAST]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1  # one line (transformers' loading progress bars aside)
    error = errors[0]
    assert "'bloom'" in error and "supported families: " in error and "qwen3" in error and "missing:" in error
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bloom"]


@pytest.mark.parametrize("model_type", supported_families(LATENT))
def test_compress_kv_rank_with_repair_runs_end_to_end(model_type, text_folder, tmp_path):
    """Latent keys/values with the repair stage on (its default) on every family that takes them."""
    model_folder = _save(model_type, tmp_path / "model")
    out = tmp_path / "latent"
    args = ["compress", str(model_folder), "--kv-rank", "12", "--rope-dims", "4", "--recovery-steps", "1"]
    args += ["--data", str(text_folder), "--window", "16", "--batch-size", "4", "--held-out", "2"]
    args += [
        "--calibration-windows",
        "4",
        "--repair-windows",
        "4",
        "--repair-steps",
        "3",
        "--timing-repeats",
        "1",
    ]
    assert _run([*args, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["repair"]["layers"] == [0, 1] and report["reload_max_abs_diff"] == 0.0
    reloaded = headkit.from_pretrained(out)
    assert reloaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
