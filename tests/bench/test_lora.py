import copy
import json
import math

import pytest
import torch
from results_keys import assert_results_keys

from headkit.bench import lora
from headkit.errors import HeadkitError
from headkit.recipes.distill import with_lora


def _adapted(base, rank):
    """A LoRA copy of `base` as the benchmark makes one (recipes' with_lora on its target modules)."""
    return with_lora(copy.deepcopy(base), list(lora.TARGET_MODULES), rank=rank, alpha=lora.LORA_ALPHA)


@pytest.fixture(scope="module")
def split():
    return lora.load_split(test_fraction=0.25, seed=0)


def test_split_shapes_and_ranges(split):
    assert split["train_x"].shape == (1348, 64) and split["test_x"].shape == (449, 64)
    assert split["train_y"].shape == (1348,) and split["test_y"].shape == (449,)
    assert split["train_x"].min() == 0 and split["train_x"].max() == 16
    assert set(split["test_y"].tolist()) == set(range(10))


@pytest.mark.parametrize("variant", ["original", *lora.VARIANTS])
def test_variants_stay_in_range_and_differ(split, variant):
    pixels = split["test_x"][:20]
    shifted = lora.make_variant(pixels, variant)
    assert shifted.shape == pixels.shape and shifted.min() >= 0 and shifted.max() <= 16
    assert torch.equal(shifted, pixels) == (variant == "original")


def test_variants_do_what_they_say():
    image = torch.arange(64, dtype=torch.float32).remainder(17)[None]
    assert set(lora.make_variant(image, "quantized").unique().tolist()) == {0.0, 16.0}
    assert torch.equal(lora.make_variant(image, "inverted"), 16 - image)
    rotated = lora.make_variant(image, "rotated").reshape(8, 8)
    # rot90 (counter-clockwise): the top row becomes the left column, read bottom to top.
    assert torch.equal(rotated[:, 0].flip(0), image.reshape(8, 8)[0])
    assert torch.equal(
        lora.make_variant(lora.make_variant(image, "rotated"), "rotated").reshape(8, 8),
        image.reshape(8, 8).flip(0).flip(1),
    )
    with pytest.raises(HeadkitError, match="variant"):
        lora.make_variant(image, "blurred")


@pytest.mark.parametrize("hidden_size", [8, 32])
@pytest.mark.parametrize("rank", [1, 2, 4, 8, 16, 32, 64])
def test_lora_trainable_parameters_equal_the_formula(hidden_size, rank):
    base = lora.DigitClassifier(hidden_size)
    adapted = _adapted(base, rank)
    expected = rank * ((64 + hidden_size) + (hidden_size + hidden_size) + (hidden_size + 10))
    assert lora.trainable_parameters(adapted) == expected
    # The base stays trainable (the adapted model is a copy) and the adapter starts as the identity (B = 0).
    assert lora.trainable_parameters(base) == sum(p.numel() for p in base.parameters())
    x = torch.rand(5, 64)
    torch.testing.assert_close(adapted(x), base(x), rtol=0, atol=0)


def test_lora_training_moves_only_the_factors(split):
    base = lora.DigitClassifier(16)
    adapted = _adapted(base, 2)
    frozen = {n: p.detach().clone() for n, p in adapted.named_parameters() if not p.requires_grad}
    losses = lora.train_classifier(
        adapted, split["train_x"][:256], split["train_y"][:256], epochs=3, batch_size=64, lr=1e-2, seed=0
    )
    assert losses[-1] < losses[0]
    for name, parameter in adapted.named_parameters():
        if name in frozen:
            assert torch.equal(parameter, frozen[name]), name


def test_full_training_learns_digits(split):
    torch.manual_seed(0)
    model = lora.DigitClassifier(32)
    lora.train_classifier(model, split["train_x"], split["train_y"], epochs=5, batch_size=64, lr=3e-3, seed=0)
    assert lora.accuracy(model, split["test_x"], split["test_y"]) > 0.85


def test_benchmark_writes_finite_results(tmp_path):
    from rich.console import Console

    config = lora.LoraConfig(
        out=tmp_path / "lora", ranks=(1, 4), hidden_size=16, pretrain_epochs=2, finetune_epochs=1
    )
    report = lora.run_lora_benchmark(config, console=Console(quiet=True))
    assert_results_keys("lora", report)
    saved = json.loads((tmp_path / "lora" / "results.json").read_text())
    assert saved["pretrained_accuracy"] == report["pretrained_accuracy"]
    assert set(saved["variants"]) == set(lora.VARIANTS)
    for variant in saved["variants"].values():
        assert [row["rank"] for row in variant["lora"]] == [1, 4]
        accuracies = [variant["accuracy_before"], variant["full_finetune_accuracy"]]
        accuracies += [row["accuracy"] for row in variant["lora"]]
        assert all(math.isfinite(a) and 0 <= a <= 1 for a in accuracies)
        assert variant["full_finetune_parameters"] == saved["classifier_parameters"]
        assert [row["trainable_parameters"] for row in variant["lora"]] == [
            r * (80 + 32 + 26) for r in (1, 4)
        ]
    assert len(saved["lora_from_scratch"]) == 2
    assert "| rotated |" in (tmp_path / "lora" / "table.md").read_text()
    assert (tmp_path / "lora" / "lora.png").read_bytes()[:4] == b"\x89PNG"
    assert torch.get_num_threads() == 1  # conftest's setting, restored after the run


def test_bad_settings_are_user_errors(tmp_path):
    with pytest.raises(HeadkitError, match="--ranks"):
        lora.run_lora_benchmark(lora.LoraConfig(out=tmp_path, ranks=(0,)))
    with pytest.raises(HeadkitError, match="--finetune-epochs"):
        lora.run_lora_benchmark(lora.LoraConfig(out=tmp_path, finetune_epochs=0))


def test_cli_runs_the_benchmark(tmp_path):
    from headkit.cli import main

    out = tmp_path / "cli"
    args = ["bench", "lora", "--ranks", "2", "--pretrain-epochs", "1", "--finetune-epochs", "1"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--out", str(out)])
        raise SystemExit(0)
    assert exit_info.value.code == 0
    saved = json.loads((out / "results.json").read_text())
    assert [row["rank"] for row in saved["lora_from_scratch"]] == [2]
    assert saved["settings"]["pretrain_epochs"] == 1
