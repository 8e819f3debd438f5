"""``headkit linearize`` end to end through the CLI on a tiny checkpoint of every decoder family the registry
marks linearizable: the saved model reloads with identical logits, decodes cached == uncached, and its decoding
state is smaller than the original's cache. An unregistered family is refused in one line, nothing written."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery"))
from family_models import family_model  # noqa: E402

import headkit  # noqa: E402
from headkit.cli import main  # noqa: E402
from headkit.data import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer  # noqa: E402
from headkit.surgery.families import LINEARIZE, supported_families  # noqa: E402
from headkit.surgery.linearize import linearized_modules  # noqa: E402

# Two transfer steps and one LoRA step on 64-byte windows: the run, not the numbers, is tested; with sinks and a
# sparse cache (the recipe's mechanism by default); decoding at 96 tokens, where the state is the smaller.
FAST = [
    "--window", "8", "--sinks", "2", "--budget", "4", "--train-length", "64", "--train-windows", "4", "--batch-size", "4",
    "--transfer-steps", "2", "--recovery-steps", "1", "--eval-lengths", "64", "--held-out-windows", "2",
    "--decode-contexts", "96", "--decode-steps", "2", "--decode-batch-sizes", "1",
]  # fmt: skip


def _save(model, folder):
    model.save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    return folder


def _tiny(model_type):
    return family_model(
        model_type, vocab_size=ByteTokenizer().vocab_size, special_ids=(PAD_ID, BOS_ID, EOS_ID)
    )


@pytest.mark.parametrize("model_type", supported_families(LINEARIZE))
def test_linearize_runs_end_to_end_and_the_result_reloads_and_decodes(model_type, text_folder, tmp_path):
    source = _save(_tiny(model_type), tmp_path / "model")
    out = tmp_path / "linearized"
    with pytest.raises(SystemExit) as exit_info:
        main(["linearize", str(source), "--data", str(text_folder), *FAST, "--out", str(out)])
        raise SystemExit(0)
    assert exit_info.value.code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["reload_max_abs_diff"] == 0.0
    assert report["conversion"]["layers"] and not set(report["conversion"]["layers"]) & set(
        report["conversion"]["sliding_layers"]
    )
    point = report["decode"][0]
    assert point["linearized_cache_bytes"] < point["original_cache_bytes"]
    model = headkit.from_pretrained(out)
    assert [m.layer_idx for m in linearized_modules(model)] == report["conversion"]["layers"]
    prompt = torch.tensor([[BOS_ID, 104, 101, 97, 100, 115]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_an_unregistered_family_is_refused_in_one_line_with_nothing_written(tmp_path, capsys):
    import transformers

    config = transformers.BloomConfig(
        vocab_size=ByteTokenizer().vocab_size, hidden_size=32, n_layer=2, n_head=4
    )
    source = _save(transformers.BloomForCausalLM(config), tmp_path / "bloom")
    out = tmp_path / "out"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["linearize", str(source), "--data", str(source), *FAST, "--out", str(out)])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: unsupported decoder family BloomForCausalLM")
    assert not out.exists()


def test_convert_sliding_through_the_cli_converts_an_all_sliding_mistral(text_folder, tmp_path, capsys):
    model = family_model(
        "mistral",
        vocab_size=ByteTokenizer().vocab_size,
        special_ids=(PAD_ID, BOS_ID, EOS_ID),
        sliding_window=16,
    )
    source = _save(model, tmp_path / "model")
    refused = tmp_path / "refused"
    with pytest.raises(SystemExit) as exit_info:
        main(["linearize", str(source), "--data", str(text_folder), *FAST, "--out", str(refused)])
    assert exit_info.value.code == 2 and not refused.exists()
    assert "--convert-sliding" in capsys.readouterr().err
    out = tmp_path / "linearized"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "linearize",
                str(source),
                "--data",
                str(text_folder),
                *FAST,
                "--convert-sliding",
                "--out",
                str(out),
            ]
        )
        raise SystemExit(0)
    assert exit_info.value.code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["conversion"]["converted_sliding_layers"] == [0, 1] == report["conversion"]["layers"]
    assert report["reload_max_abs_diff"] == 0.0
