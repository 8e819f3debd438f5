"""headkit.train and ``headkit train``: the loss falls, held-out bits per byte are right and fall, the model saves."""

from __future__ import annotations

import json
import math
from pathlib import Path

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


# -- bad options of ``headkit train``: one-line errors, exit 2, before anything is loaded or trained ----------------

QUICK_TINY = [
    "train",
    "--quick",
    "--hidden-size",
    "16",
    "--layers",
    "1",
    "--set",
    "intermediate_size=32",
    "--steps",
    "1",
    "--seq-len",
    "16",
    "--eval-tokens",
    "0",
]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a tokenizer or a corpus fails the test: the options must be refused before."""

    def refuse(*args, **kwargs):
        raise AssertionError("loaded before the options were checked")

    monkeypatch.setattr("headkit.data.load_tokenizer", refuse)
    monkeypatch.setattr("headkit.data.load_corpus", refuse)


def _exit_2(arguments, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "device, message",
    [
        ("cuda", "--device 'cuda' asked for, but CUDA is not available here; use --device cpu"),
        ("cuda:0", "--device 'cuda:0' asked for, but CUDA is not available here"),
        ("foo", "--device must be 'cpu' or 'cuda' (or 'cuda:N'), got 'foo'"),
        ("cpu:x", "--device must be"),
    ],
)
def test_cli_refuses_a_device_that_is_not_there(
    device, message, tmp_path, capsys, monkeypatch, nothing_loads
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _exit_2(["train", "--quick", "--device", device, "--out", str(tmp_path / "m")], capsys)
    assert message in err
    assert not (tmp_path / "m").exists()


def test_train_causal_lm_checks_the_device_first(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "foo", torch.device("cuda")):
        with pytest.raises(HeadkitError, match="--device"):
            train_causal_lm(TINY, "/nonexistent/corpus", steps=1, device=device, show_progress=False)


def test_bench_and_train_share_one_device_check():
    from headkit.bench import decode, speed
    from headkit.devices import check_device

    assert speed.check_device is check_device and decode.check_device is check_device
    assert check_device("cpu") == torch.device("cpu")


def test_cli_overwrite_replaces_the_folder_whole(corpus_dir, tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("old run\n")
    (out / "old").mkdir()
    (out / "old" / "weights.bin").write_bytes(b"x")
    main([*QUICK_TINY, "--corpus", str(corpus_dir), "--out", str(out), "--overwrite"])
    assert not (out / "notes.txt").exists() and not (out / "old").exists()
    assert (out / "config.json").is_file() and (out / REPORT_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "model"]  # no staging folder left


def test_a_failed_save_leaves_the_old_folder_untouched(corpus_dir, tmp_path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("old run\n")

    def broken(self, folder, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ByteTokenizer, "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        train_causal_lm(
            TINY,
            corpus_dir,
            steps=1,
            seq_len=16,
            eval_tokens=0,
            out_dir=out,
            overwrite=True,
            show_progress=False,
        )
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # the model's config.json never landed here
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "model"]


def test_train_causal_lm_refuses_a_non_empty_out_dir_without_overwrite(corpus_dir, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("old run\n")
    with pytest.raises(HeadkitError, match="--overwrite"):
        train_causal_lm(
            TINY, corpus_dir, steps=1, seq_len=16, eval_tokens=0, out_dir=out, show_progress=False
        )
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_cli_refuses_an_out_that_is_a_file_even_with_overwrite(overwrite, tmp_path, capsys, nothing_loads):
    out = tmp_path / "results.txt"
    out.write_text("keep me\n")
    err = _exit_2([*QUICK_TINY, "--out", str(out), *overwrite], capsys)
    assert f"--out {str(out)!r} exists and is not a folder" in err
    assert out.read_text() == "keep me\n"


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_cli_refuses_an_out_that_would_replace_the_corpus(where, corpus_dir, capsys, nothing_loads):
    out = {"same": corpus_dir, "parent": corpus_dir.parent, "inside": corpus_dir / "model"}[where]
    before = sorted(p.name for p in corpus_dir.iterdir())
    err = _exit_2([*QUICK_TINY, "--corpus", str(corpus_dir), "--out", str(out), "--overwrite"], capsys)
    assert "--out" in err and "--corpus" in err
    assert sorted(p.name for p in corpus_dir.iterdir()) == before


def test_cli_refuses_an_unknown_set_field(tmp_path, capsys, nothing_loads):
    err = _exit_2([*QUICK_TINY, "--set", "nonsense=3", "--out", str(tmp_path / "m")], capsys)
    assert "--set" in err and "unknown HeadkitConfig field 'nonsense'" in err
    assert not (tmp_path / "m").exists()


def test_set_accepts_every_headkit_config_field():
    import dataclasses

    from headkit.models import HeadkitConfig
    from headkit.train import check_config_fields, config_fields

    fields = config_fields()
    check_config_fields(fields)
    expected = {f.name for f in dataclasses.fields(HeadkitConfig)} - {"transformers_version"}
    assert set(fields) == expected
    assert {"additive_window", "intermediate_size", "tie_word_embeddings", "rope_parameters"} <= set(fields)


def test_cli_eval_tokens_names_the_option_and_its_minimum(tmp_path, capsys, nothing_loads):
    arguments = [*QUICK_TINY[:-2], "--eval-tokens", "1", "--out", str(tmp_path / "m")]
    err = _exit_2(arguments, capsys)
    assert "--eval-tokens must be 0 (no evaluation) or at least 2" in err and "got 1" in err


def test_train_causal_lm_eval_tokens_of_one_is_refused_up_front():
    with pytest.raises(HeadkitError, match="eval_tokens must be 0 .* at least 2"):
        train_causal_lm(TINY, "/nonexistent/corpus", steps=1, eval_tokens=1, show_progress=False)


# -- the options are TrainSettings' fields: one declaration for the command line and the library ----------------


def test_every_train_option_is_a_train_settings_field():
    from typer.main import get_command

    from headkit.app import app
    from headkit.runs.options import option_fields, option_name
    from headkit.train import TrainSettings

    command = get_command(app).commands["train"]
    flags = {flag for parameter in command.params for flag in parameter.opts}
    declared = {option_name(field) for field in option_fields(TrainSettings)}
    assert declared <= flags and flags - declared == {"--quick"}
    assert TrainSettings.quick().steps == 100 and TrainSettings().steps == 300


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"steps": 0}, "--steps must be a positive integer, got 0"),
        ({"seq_len": 1}, "--seq-len must be an integer ≥ 2, got 1"),
        ({"eval_tokens": 1}, "--eval-tokens must be 0 \\(no evaluation\\) or at least 2"),
        ({"attention": "nope"}, "--attention: unknown attention 'nope'"),
        ({"layer_types": ("softmax", "nope")}, "--layer-types: unknown layer types 'nope'"),
        ({"set_fields": ("not_a_field=1",)}, "--set: unknown HeadkitConfig field 'not_a_field'"),
        ({"set_fields": ("no-equals",)}, "--set takes KEY=VALUE"),
        ({"corpus": Path("/nonexistent/corpus")}, "--corpus '/nonexistent/corpus' does not exist"),
    ],
)
def test_train_settings_are_checked_as_their_fields_declare(overrides, message, tmp_path):
    from headkit.train import TrainSettings, check_train_settings

    with pytest.raises(HeadkitError, match=message):
        check_train_settings(TrainSettings(out=tmp_path / "m", **overrides))


def test_set_takes_a_json_value_with_commas(corpus_dir, tmp_path):
    out = tmp_path / "m"
    main(
        [
            *QUICK_TINY,
            "--layers",
            "2",
            "--corpus",
            str(corpus_dir),
            "--set",
            'layer_types=["softmax", "linear"]',
            "--out",
            str(out),
        ]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["softmax", "linear"] and config["num_hidden_layers"] == 2
