import json
import math

import numpy as np
import pytest
import torch
from results_keys import assert_results_keys

from headkit.bench import digits
from headkit.errors import HeadkitError
from headkit.train import train_on_batches

TINY = dict(steps=3, batch_size=8, hidden_size=16, layers=1, heads=2, image_counts=(4,), timing_repeats=1)


def test_digit_data_split_and_value_range():
    data = digits.load_digit_data(test_images=50, seed=1)
    assert data.train_pixels.shape == (1797 - 50, 64) and data.test_pixels.shape == (50, 64)
    assert data.train_labels.shape == (1797 - 50,) and data.test_labels.shape == (50,)
    for pixels in (data.train_pixels, data.test_pixels):
        assert pixels.min() >= 0 and pixels.max() == 16 and np.issubdtype(pixels.dtype, np.integer)
    assert set(data.test_labels.tolist()) <= set(range(10))
    # The split is a permutation: no image is lost or duplicated across it.
    assert len(data.train_pixels) + len(data.test_pixels) == 1797


def test_sequences_start_with_bos_then_pixels():
    pixels = np.array([np.arange(64) % 17, np.full(64, 16)])
    sequences = digits.to_sequences(pixels)
    assert sequences.shape == (2, 65) and sequences.dtype == torch.long
    assert (sequences[:, 0] == digits.BOS).all()
    assert torch.equal(sequences[:, 1:], torch.as_tensor(pixels))
    assert digits.occlude(pixels).shape == (2, 33)


@pytest.mark.parametrize("bad", [np.full((1, 64), 17), np.full((1, 64), -1), np.zeros((1, 63), dtype=int)])
def test_sequences_reject_bad_pixels(bad):
    with pytest.raises(HeadkitError, match="pixels"):
        digits.to_sequences(bad)


@pytest.mark.parametrize("mechanism", digits.MECHANISMS)
@pytest.mark.parametrize("sample", [False, True])
def test_completion_keeps_visible_half_and_yields_pixels(mechanism, sample):
    config = digits.DigitsConfig(**TINY)
    model = digits.build_model(mechanism, config).eval()
    data = digits.load_digit_data(test_images=6)
    completed = digits.complete_images(model, digits.occlude(data.test_pixels), sample=sample)
    assert completed.shape == (6, 64)
    assert torch.equal(completed[:, : digits.VISIBLE], torch.as_tensor(data.test_pixels[:, : digits.VISIBLE]))
    assert completed.min() >= 0 and completed.max() <= 16  # the start token never appears as a pixel


def test_greedy_completion_is_the_argmax_of_the_full_forward():
    """generate() with the cache (recurrent state / KV cache) must agree with the cache-free forward pass."""
    config = digits.DigitsConfig(**TINY)
    for mechanism in digits.MECHANISMS:
        model = digits.build_model(mechanism, config).eval()
        prompts = digits.occlude(digits.load_digit_data(test_images=3).test_pixels)
        completed = digits.complete_images(model, prompts)
        sequences = digits.to_sequences(completed)
        with torch.no_grad():
            logits = model(input_ids=sequences).logits[:, digits.VISIBLE : -1]
        logits[..., digits.BOS] = -math.inf
        assert torch.equal(logits.argmax(-1), sequences[:, 1 + digits.VISIBLE :]), mechanism


def test_models_have_the_same_size_and_training_lowers_the_loss():
    config = digits.DigitsConfig(**(TINY | {"steps": 30, "lr": 1e-2}))
    sizes = {m: sum(p.numel() for p in digits.build_model(m, config).parameters()) for m in digits.MECHANISMS}
    assert len(set(sizes.values())) == 1
    model = digits.build_model("linear", config)
    sequences = digits.to_sequences(digits.load_digit_data().train_pixels[:64])
    before = digits.bits_per_pixel(model.eval(), sequences)
    train_on_batches(model, steps=config.steps, **digits.pixel_training(model, sequences, config))
    assert digits.bits_per_pixel(model, sequences) < before - 0.5


def test_classifier_judges_real_digits_well():
    data = digits.load_digit_data()
    classifier = digits.train_classifier(data.train_pixels, data.train_labels)
    assert digits.classifier_accuracy(classifier, data.test_pixels, data.test_labels) > 0.9
    noise = np.random.default_rng(0).integers(0, 17, data.test_pixels.shape)
    assert digits.classifier_accuracy(classifier, noise, data.test_labels) < 0.3


def test_benchmark_writes_finite_results(tmp_path):
    from rich.console import Console

    config = digits.DigitsConfig(**(TINY | {"out": tmp_path / "digits"}))
    report = digits.run_digits_benchmark(config, console=Console(quiet=True))
    assert_results_keys("digits", report)
    saved = json.loads((tmp_path / "digits" / "results.json").read_text())
    assert [m["mechanism"] for m in saved["mechanisms"]] == list(digits.MECHANISMS)
    for result in saved["mechanisms"]:
        numbers = [
            result["test_bits_per_pixel"],
            result["train_seconds"],
            *result["completion_seconds"].values(),
        ]
        assert all(math.isfinite(x) and x > 0 for x in numbers)
        assert 0 <= result["classifier_accuracy_completed"] <= 1
        assert list(result["completion_seconds"]) == ["4"]
    assert saved["classifier_accuracy_original"] == report["classifier_accuracy_original"] > 0.9
    assert "| linear |" in (tmp_path / "digits" / "table.md").read_text()
    assert (tmp_path / "digits" / "completions.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_settings_are_user_errors(tmp_path):
    with pytest.raises(HeadkitError, match="--hidden-size"):
        digits.run_digits_benchmark(digits.DigitsConfig(**(TINY | {"hidden_size": 15, "out": tmp_path})))
    with pytest.raises(HeadkitError, match="--steps"):
        digits.run_digits_benchmark(digits.DigitsConfig(**(TINY | {"steps": 0, "out": tmp_path})))


def test_cli_runs_the_benchmark(tmp_path):
    from headkit.cli import main

    out = tmp_path / "cli"
    args = ["bench", "digits", "--steps", "2", "--hidden-size", "16", "--layers", "1", "--images", "3,5"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--out", str(out)])
        raise SystemExit(0)
    assert exit_info.value.code == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["steps"] == 2 and saved["settings"]["image_counts"] == [3, 5]
    assert all(list(m["completion_seconds"]) == ["3", "5"] for m in saved["mechanisms"])
