import json

import pytest
import torch
import transformers

import headkit
from headkit.cli import main

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
    args = ["compress", str(model_dir), "--dim", "16", "--distill-steps", "3", "--data", str(text_folder)]
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


def test_rotary_models_are_refused_and_nothing_is_written(save_tiny_causal_lm, text_folder, tmp_path, capsys):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    out = tmp_path / "out"
    assert _run(["compress", str(model_dir), "--data", str(text_folder), "--out", str(out), *FAST]) == 2
    assert "rotary" in capsys.readouterr().err.lower()
    assert not out.exists()
