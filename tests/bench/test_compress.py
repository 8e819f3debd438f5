import importlib
import json

import pytest
import torch
import transformers

import headkit
from headkit.cli import main

# The module: the package exports a function of that name.
compress = importlib.import_module("headkit.recipes.compress")

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory, save_tiny_encoder):
    """A tiny random BERT with random biases and peaked attention, MiniLM's tokenizer."""
    return save_tiny_encoder(tmp_path_factory.mktemp("tiny_encoder"), bias_std=0.3)


def _small_corpus(train_texts, held_out_texts, seed=0):
    # The real corpus reads the whole standard library; these tests only need a few distinct texts.
    words = "attention heads share query key projections mixing vectors collaborate instead of concatenate".split()
    generator = torch.Generator().manual_seed(seed)

    def text(i):
        picks = torch.randint(len(words), (8 + i % 7,), generator=generator).tolist()
        return " ".join(words[j] for j in picks)

    return [text(i) for i in range(train_texts)], [text(i) for i in range(held_out_texts)]


def _run(args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    return exit_info.value.code


FAST = ["--held-out", "16", "--batch-size", "8", "--max-length", "24", "--timing-repeats", "1"]


def test_full_size_compress_is_exact_and_reloads(tiny_encoder, tmp_path, monkeypatch):
    monkeypatch.setattr(compress, "load_text", lambda data: None)
    monkeypatch.setattr(compress, "text_chunks", lambda corpus, a, b, seed=0: _small_corpus(a, b, seed))
    out = tmp_path / "out"
    assert _run(["compress", str(tiny_encoder), "--dim", "32", "--out", str(out), *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["dim_shared_query_key"] == report["full_dim"] == 32
    assert report["fidelity"]["mean_cosine"] > 1 - 1e-6
    assert report["fidelity"]["max_abs_diff"] < 1e-5
    assert report["reload_max_abs_diff"] == 0.0
    assert report["max_relative_error"] < 1e-6
    saved = json.loads((out / "config.json").read_text())
    assert saved["headkit_surgery"][0]["op"] == "collaborative"
    reloaded = headkit.from_pretrained(out)
    assert any(isinstance(m, headkit.surgery.CollaborativeHeads) for m in reloaded.modules())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left behind


def test_distillation_recovers_fidelity_of_a_compressed_model(tiny_encoder, tmp_path, monkeypatch):
    monkeypatch.setattr(compress, "load_text", lambda data: None)
    monkeypatch.setattr(compress, "text_chunks", lambda corpus, a, b, seed=0: _small_corpus(a, b, seed))
    out = tmp_path / "out"
    args = [
        "compress",
        str(tiny_encoder),
        "--dim",
        "6",
        "--recovery-steps",
        "40",
        "--lr",
        "1e-3",
        "--out",
        str(out),
    ]
    assert _run([*args, *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    before, after = report["fidelity_after_swap"], report["fidelity"]
    assert before["mean_cosine"] < 1 - 1e-6  # D̃ = 6 of 32 is lossy
    assert (
        after["mean_cosine"] > 0.999
    )  # mean-pooled cosines of this tiny model are ≈ 1 − 2e-5 after the swap
    assert report["distill_losses"][-1] < report["distill_losses"][0]
    per_layer_removed = 2 * (32 * 32 + 32) - (2 * 6 * 32 + 4 * 6 + 4 * 32)
    assert report["parameters_before"] - report["parameters_after"] == 2 * per_layer_removed
    assert report["forward_ms_before"] > 0 and report["forward_ms_after"] > 0
    assert report["reload_max_abs_diff"] == 0.0


def test_refuses_to_write_over_the_input(tiny_encoder, capsys):
    before = sorted(p.name for p in tiny_encoder.iterdir())
    for target in (tiny_encoder, tiny_encoder / "inside"):
        assert _run(["compress", str(tiny_encoder), "--dim", "8", "--out", str(target), *FAST]) == 2
        assert "must not be the model" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_encoder.iterdir()) == before


def test_bad_dimension_is_a_clear_error(tiny_encoder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compress, "load_text", lambda data: None)
    monkeypatch.setattr(compress, "text_chunks", lambda corpus, a, b, seed=0: _small_corpus(a, b, seed))
    assert _run(["compress", str(tiny_encoder), "--dim", "64", "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "at most the hidden size 32" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
