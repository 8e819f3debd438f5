"""headkit.train and ``headkit train``: the loss falls, held-out bits per byte are right and fall, the model saves."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from headkit.cli import main
from headkit.data import EOS_ID, ByteTokenizer, evaluation_windows, load_corpus
from headkit.errors import HeadkitError
from headkit.models import HeadkitForCausalLM
from headkit.train import REPORT_FILE, _lr_factor, default_config, held_out_bits_per_byte, train_causal_lm

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
WORDS = "the cat sat on a mat and the dog ran to the red door while birds sang".split()


@pytest.fixture
def corpus_dir(tmp_path):
    """A few dozen short documents of predictable English-like text."""
    generator = torch.Generator().manual_seed(0)
    root = tmp_path / "corpus"
    root.mkdir()
    for index in range(24):
        picks = torch.randint(0, len(WORDS) - 3, (30,), generator=generator).tolist()
        lines = [" ".join(WORDS[p : p + 4]) + "." for p in picks]
        (root / f"doc{index:02d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def test_training_lowers_the_loss_and_held_out_bits_per_byte_and_saves(corpus_dir, tmp_path):
    out = tmp_path / "model"
    result = train_causal_lm(
        {**TINY, "attention": "additive"},
        corpus_dir,
        steps=40,
        batch_size=8,
        seq_len=32,
        lr=1e-2,
        eval_tokens=1024,
        out_dir=out,
        show_progress=False,
    )
    # An untrained byte model is close to uniform over 259 tokens: log2(259) ≈ 8.02 bits per byte.
    assert abs(result.initial_bits_per_byte - math.log2(259)) < 0.3
    assert result.held_out_bits_per_byte < result.initial_bits_per_byte - 2.0
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 1.0
    assert result.tokens_seen == 40 * 8 * 32

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(loaded, HeadkitForCausalLM) and loaded.config.attention == "additive"
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, result.model(ids).logits, atol=0, rtol=0)
    assert isinstance(load_tokenizer_from(out), ByteTokenizer)
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["held_out_bits_per_byte"] == result.held_out_bits_per_byte
    assert report["corpus"]["held_out_documents"] >= 1 and len(report["losses"]) == 40


def load_tokenizer_from(folder):
    from headkit.data import load_tokenizer

    return load_tokenizer(folder)


def test_bits_per_byte_match_a_manual_computation_and_skip_separators():
    torch.manual_seed(0)
    model = HeadkitForCausalLM(default_config(ByteTokenizer(), **TINY, attention="softmax")).eval()
    stream = torch.tensor([*b"abc def", EOS_ID, *b"ghij", EOS_ID, *b"klm"], dtype=torch.int32)
    windows = evaluation_windows(stream, 8)
    assert windows.shape == (2, 8)
    expected_nats, expected_bytes = 0.0, 0
    with torch.no_grad():
        for window in windows:
            log_probs = model(window[None]).logits[0].double().log_softmax(-1)
            for t in range(1, len(window)):
                if int(window[t]) < 256:  # separators are neither predicted nor counted
                    expected_nats -= float(log_probs[t - 1, window[t]])
                    expected_bytes += 1
    ignored = torch.tensor([256, 257, 258])
    actual = held_out_bits_per_byte(model, windows, ByteTokenizer(), ignored, batch_size=1)
    assert expected_bytes == 12  # 14 predicted positions, 2 of them separators
    assert actual == pytest.approx(expected_nats / (math.log(2) * expected_bytes), rel=1e-5)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    factors = [_lr_factor(step, warmup=10, total=100) for step in range(101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(factors[:10], factors[1:10], strict=False))
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
    assert factors[100] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "overrides, kwargs, message",
    [
        ({"vocab_size": 100}, {}, "vocab_size"),
        (
            {"position_embedding_type": "learned", "max_position_embeddings": 16},
            {},
            "max_position_embeddings",
        ),
        ({}, {"steps": 0}, "steps"),
        ({}, {"lr": -1.0}, "lr"),
    ],
)
def test_bad_settings_are_value_errors(corpus_dir, overrides, kwargs, message):
    with pytest.raises(ValueError, match=message):
        train_causal_lm({**TINY, **overrides}, corpus_dir, **{"steps": 1, "seq_len": 32, **kwargs})


def test_a_corpus_shorter_than_a_window_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("tiny\ntext\n")
    with pytest.raises(HeadkitError, match="seq_len"):
        train_causal_lm(TINY, load_corpus(tmp_path), steps=1, seq_len=64, show_progress=False)


def test_cli_trains_a_hybrid_and_refuses_to_overwrite(corpus_dir, tmp_path, capsys):
    out = tmp_path / "cli-model"
    arguments = [
        "train",
        "--quick",
        "--corpus",
        str(corpus_dir),
        "--layer-types",
        "additive,softmax",
        "--set",
        "additive_window=4",
        "--set",
        "intermediate_size=32",
        "--hidden-size",
        "16",
        "--steps",
        "3",
        "--seq-len",
        "16",
        "--eval-tokens",
        "128",
        "--out",
        str(out),
    ]
    main(arguments)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["additive", "softmax"] and config["additive_window"] == 4
    assert config["intermediate_size"] == 32 and config["vocab_size"] == 259
    assert (out / REPORT_FILE).is_file() and (out / "tokenizer.json").is_file()
    assert "bits/byte" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    assert "--overwrite" in capsys.readouterr().err
