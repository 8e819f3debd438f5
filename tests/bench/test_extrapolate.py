import json
import math

import numpy as np
import pytest
import torch
from results_keys import assert_results_keys

from headkit.bench import extrapolate
from headkit.errors import HeadkitError
from headkit.train import train_on_batches

TINY = dict(
    steps=3,
    batch_size=4,
    hidden_size=16,
    layers=1,
    heads=2,
    lengths=(128, 256),
    passkey_trials=3,
    eval_tokens=512,
    corpus_bytes=300_000,
)


def tiny_config(**overrides):
    return extrapolate.ExtrapolateConfig(**(TINY | overrides))


def _text(document) -> str:
    return bytes(document.input_ids).decode("ascii")


@pytest.mark.parametrize("length", [extrapolate.MIN_DOCUMENT_LENGTH, 128, 300, 2048])
def test_passkey_documents_have_exact_length_key_and_answer_after_question(length):
    from headkit.evaluation.retrieval import min_passkey_length

    assert (
        min_passkey_length(extrapolate.byte_tokenizer(), extrapolate.PASSKEY_FORMAT) + extrapolate.KEY_DIGITS
        == extrapolate.MIN_DOCUMENT_LENGTH
    )
    rng = np.random.default_rng(0)
    for document in extrapolate.passkey_documents(length, 3, [0.0, 0.3, 1.0], rng):
        prompt, key = _text(document), document.key
        assert len(prompt) + len(key) == length and document.length == length and prompt.isascii()
        assert prompt.endswith(" What is the pass key? The pass key is ") and key.isdigit() and len(key) == 5
        # The key is stated once in the body (twice in its sentence) before the question.
        body = prompt[: -len(" What is the pass key? The pass key is ")]
        assert body.count(f"The pass key is {key}. Remember it. {key} is the pass key.") == 1
        assert body.index(f"The pass key is {key}") == document.key_position + 1


def test_passkey_depth_moves_the_key():
    rng = np.random.default_rng(1)
    offsets = [d.key_position for d in extrapolate.passkey_documents(1024, 3, [0.0, 0.5, 1.0], rng)]
    filler = 1024 - extrapolate.MIN_DOCUMENT_LENGTH
    # The key sentence goes between two filler sentences (each at most 22 bytes) nearest the depth.
    assert offsets[0] == 0 and abs(offsets[1] - 0.5 * filler) <= 11 and offsets[2] == filler
    documents = extrapolate.passkey_trials(512, 8, seed=0)
    depths = [doc.depth for doc in documents]
    # Stratified depths: one per eighth of the document, so they vary and cover it.
    assert [int(depth * 8) for depth in depths] == list(range(8))
    assert len({doc.key for doc in documents}) > 1
    assert documents == extrapolate.passkey_trials(512, 8, seed=0)
    assert [_text(d) for d in documents] != [_text(d) for d in extrapolate.passkey_trials(512, 8, seed=1)]


def test_passkey_documents_reject_bad_input():
    rng = np.random.default_rng(0)
    with pytest.raises(HeadkitError, match="lengths"):
        extrapolate.passkey_documents(extrapolate.MIN_DOCUMENT_LENGTH - 1, 1, [0.5], rng)
    with pytest.raises(HeadkitError, match="depths"):
        extrapolate.passkey_documents(128, 1, [1.5], rng)


def test_passkey_training_batch_decodes_to_documents():
    batch = extrapolate.passkey_batch(5, 128, np.random.default_rng(0))
    assert batch.shape == (5, 128) and batch.dtype == torch.long
    for row in batch:
        text = bytes(row.tolist()).decode("ascii")
        key = text[-5:]
        assert key.isdigit() and f"The pass key is {key}. Remember it." in text
    assert extrapolate.passkey_batch(0, 128, np.random.default_rng(0)).shape == (0, 128)


def test_scores_count_exact_and_per_digit_matches():
    assert extrapolate.score_answers(["12345", "12399", "?????"], ["12345", "12345", "12345"]) == (
        pytest.approx(1 / 3),
        pytest.approx(8 / 15),
    )


@pytest.mark.parametrize("attention", extrapolate.MODELS)
def test_scalings_agree_where_they_must(attention):
    config = tiny_config()
    model = extrapolate.build_model(attention, config).eval()
    assert not any("rotary" in name or "inv_freq" in name for name in model.state_dict())
    inputs = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    longer = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(input_ids=inputs).logits
        trained_long = model(input_ids=longer).logits

        def logits(scaling, length, ids):
            return extrapolate.scaled_model(model, scaling, length, config)(input_ids=ids).logits

        # "none" is the trained model; linear with factor 1 (L = 128) and dynamic at L ≤ 128 are plain RoPE.
        assert torch.equal(logits("none", 128, inputs), trained)
        assert torch.equal(logits("none", 256, longer), trained_long)
        assert torch.equal(logits("linear", 128, inputs), trained)
        assert torch.equal(logits("dynamic", 128, inputs), trained)
        assert torch.equal(logits("dynamic", 2048, inputs), trained)
        # Beyond the trained length both scalings really change the positions.
        assert not torch.allclose(logits("linear", 256, longer), trained_long)
        assert not torch.allclose(logits("dynamic", 256, longer), trained_long)
        # Inside the trained length, the first 128 tokens of a longer input see unscaled positions in "none".
        assert torch.allclose(trained_long[:, :128], model(input_ids=longer[:, :128]).logits, atol=1e-5)


def test_linear_scaling_divides_positions():
    config = tiny_config()
    parameters = extrapolate.rope_parameters("linear", 512, config)
    assert parameters == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    assert extrapolate.rope_parameters("linear", 128, config)["factor"] == 1.0
    dynamic = extrapolate.rope_parameters("dynamic", 512, config)
    assert dynamic["rope_type"] == "dynamic" and dynamic["factor"] == 2.0  # max(lengths) 256 / 128
    assert extrapolate.model_config("coca", config, "dynamic", 512).max_position_embeddings == 128
    with pytest.raises(HeadkitError, match="scaling"):
        extrapolate.rope_parameters("yarn", 512, config)


def test_models_have_the_same_shape_and_see_the_same_batches():
    config = tiny_config(steps=2)
    stream = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0)).int()
    first = {}
    for attention in extrapolate.MODELS:
        model = extrapolate.build_model(attention, config)
        assert model.config.hidden_size == 16 and model.config.num_hidden_layers == 1
        seen = []
        original = model.forward

        def recording_forward(*args, original=original, seen=seen, **kwargs):
            seen.append(kwargs["input_ids"].clone())
            return original(*args, **kwargs)

        model.forward = recording_forward
        training = extrapolate.lm_training(model, stream, config)
        losses = train_on_batches(model, steps=config.steps, **training).losses
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
        first[attention] = seen
    assert all(torch.equal(a, b) for a, b in zip(first["softmax"], first["coca"], strict=True))
    passkey_rows = round(config.passkey_fraction * config.batch_size)
    last_row = bytes(first["coca"][0][-1].tolist()).decode("ascii")
    assert passkey_rows >= 1 and "What is the pass key? The pass key is " in last_row


def test_evaluation_windows_are_the_same_tokens_at_every_length():
    stream = torch.arange(3000, dtype=torch.int32) % 250
    windows = {n: extrapolate.held_out_windows(stream, n, 1024) for n in (128, 256, 512)}
    for length, cut in windows.items():
        assert cut.shape == (1024 // length, length)
        assert torch.equal(cut.reshape(-1), stream[:1024].long())
    with pytest.raises(HeadkitError, match="corpus"):
        extrapolate.held_out_windows(stream[:100], 128, 1024)


def test_greedy_retrieval_is_the_argmax_of_the_full_forward():
    config = tiny_config()
    model = extrapolate.build_model("coca", config).eval()
    documents = extrapolate.passkey_trials(256, 2, seed=0)
    answers = extrapolate.retrieve_passkeys(model, documents)
    assert len(answers) == 2 and all(len(answer) == 5 for answer in answers)
    prompt = torch.tensor([documents[0].input_ids])
    for _ in range(5):
        with torch.no_grad():
            token = model(input_ids=prompt).logits[0, -1].argmax()
        prompt = torch.cat([prompt, token.view(1, 1)], dim=1)
    expected = extrapolate.byte_tokenizer().decode(prompt[0, -5:].tolist(), skip_special_tokens=True)
    assert answers[0] == expected.ljust(5, "?")[:5]


def test_benchmark_writes_finite_results(tmp_path):
    from rich.console import Console

    out = tmp_path / "extrapolate"
    report = extrapolate.run_extrapolate_benchmark(tiny_config(out=out), console=Console(quiet=True))
    assert_results_keys("extrapolate", report)
    saved = json.loads((out / "results.json").read_text())
    assert saved["perplexity"] == report["perplexity"]
    combinations = {
        (a, s, n) for a in extrapolate.MODELS for s in extrapolate.SCALINGS for n in TINY["lengths"]
    }
    assert {(r["attention"], r["scaling"], r["length"]) for r in saved["perplexity"]} == combinations
    assert {(r["attention"], r["scaling"], r["length"]) for r in saved["passkey"]} == combinations
    for row in saved["perplexity"]:
        assert math.isfinite(row["bits_per_byte"]) and row["bits_per_byte"] > 0
        assert row["perplexity"] == pytest.approx(2 ** row["bits_per_byte"])
        assert row["tokens"] == 512 and row["windows"] == 512 // row["length"]
    for row in saved["passkey"]:
        assert 0 <= row["accuracy"] <= row["digit_accuracy"] <= 1
        assert row["trials"] == 3 and len(row["answers"]) == 3
    by_key = {(r["attention"], r["scaling"], r["length"]): r["bits_per_byte"] for r in saved["perplexity"]}
    for attention in extrapolate.MODELS:  # the scalings change nothing at the trained length
        assert (
            by_key[attention, "none", 128]
            == by_key[attention, "linear", 128]
            == by_key[attention, "dynamic", 128]
        )
    table = (out / "table.md").read_text()
    assert "| coca | dynamic |" in table and "L = 256" in table
    for plot in ("perplexity.png", "passkey.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"steps": 0}, "--steps"),
        ({"hidden_size": 18, "heads": 4}, "--hidden-size"),
        ({"lengths": (64, 128)}, "--lengths"),
        ({"lengths": ()}, "--lengths"),
        ({"passkey_trials": 0}, "--passkey-trials"),
        ({"threads": 0}, "--threads"),
        ({"corpus": "/nonexistent/corpus"}, "--corpus"),
        ({"batch_size": 1, "passkey_fraction": 0.9}, "--batch-size"),
    ],
)
def test_bad_settings_are_user_errors(tmp_path, overrides, name):
    with pytest.raises(HeadkitError, match=name):
        extrapolate.run_extrapolate_benchmark(tiny_config(out=tmp_path, **overrides))
    assert not (tmp_path / "results.json").exists()


def test_cli_runs_the_benchmark(tmp_path):
    from typer.testing import CliRunner

    from headkit.app import app

    out = tmp_path / "cli"
    args = [
        "bench",
        "extrapolate",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--hidden-size",
        "16",
        "--layers",
        "1",
    ]
    args += ["--lengths", "128,192", "--passkey-trials", "2", "--quick", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["steps"] == 2 and saved["settings"]["lengths"] == [128, 192]
    assert saved["settings"]["passkey_trials"] == 2 and saved["settings"]["hidden_size"] == 16


@pytest.mark.parametrize(
    ("args", "name"), [(["--lengths", "64,128"], "--lengths"), (["--lengths", "128,x"], "--lengths")]
)
def test_cli_bad_option_is_a_one_line_error(tmp_path, capsys, args, name):
    from headkit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "extrapolate", *args, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert name in capsys.readouterr().err
