"""``headkit bench digits``: linear against softmax attention as autoregressive image models, on real digits.

Katharopoulos et al. 2020, "Transformers are RNNs" (ICML), Sec. 4.2 (MNIST generation) at laptop scale, with
scikit-learn's 8×8 ``load_digits`` as the images: pixel models of the same size and budget complete the hidden
bottom half of held-out digits (linear attention with its recurrent state, softmax with its KV cache); the
completion is timed, and a logistic-regression classifier trained on real digits judges it. Method and results:
docs/from-scratch.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headkit.bench._options import check_head_width
from headkit.bench._report import TABLE_FILE, column_table, figure_axes
from headkit.bench._training import train_each
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.errors import HeadkitError
from headkit.evaluation.quality import next_token_nats
from headkit.evaluation.sampling import generate_tokens
from headkit.evaluation.timing import time_call
from headkit.layers import attention_classes
from headkit.models import HeadkitConfig, HeadkitForCausalLM

PIXELS = 64  # 8 × 8
SIDE = 8
LEVELS = 17  # load_digits intensities are integers 0..16
BOS = LEVELS  # the start token, the only token that is not a pixel
VOCAB_SIZE = LEVELS + 1
VISIBLE = PIXELS // 2  # the top four rows are shown, the bottom four completed
MECHANISMS = ("linear", "softmax")  # the default comparison; any registered mechanism may be named
TEST_IMAGES = 300
DIGIT_IMAGES = 1797  # in scikit-learn's load_digits
GRID_FILE = "completions.png"
GRID_COLUMNS = 10  # test images in the figure


@dataclass
class DigitsConfig:
    """Settings of one ``headkit bench digits`` run."""

    out: Path = option(Path("results/digits"), "Output directory for results.json, table, grid.")
    steps: int = option(1500, "Training steps per model.", min=1, quick=450)
    batch_size: int = option(64, "Images per step.", min=1, quick=32)
    lr: float = setting(3e-3, positive=True)
    hidden_size: int = option(128, "Model width.", min=1, quick=64)
    layers: int = option(4, "Decoder layers.", min=1, quick=2)
    heads: int = setting(4, min=1)
    mechanisms: tuple[str, ...] = option(
        MECHANISMS,
        "Comma-separated registered attention mechanisms.",
        choices=attention_classes,
    )
    image_counts: tuple[int, ...] = option(
        (100, 200, 300),
        "Comma-separated image counts to time completion on.",
        flag="--images",
        min=1,
        max=1000,
        quick=(100,),
    )
    # Greedy completion by default; sampling draws from the model's distribution.
    sample: bool = option(False, "Complete by sampling instead of greedily.")
    timing_repeats: int = setting(3, min=1)
    seed: int = option(0, "Seed of the split, initialisation and batches.")
    # Tiny models: a second thread only adds synchronisation, and on shared cores it costs 10× (measured).
    threads: int = option(1, "torch threads (tiny models: 1 is fastest).", min=1)

    quick = quick_preset("Small models, short training, 100 images (< 3 minutes).")


@dataclass
class DigitsData:
    """The digits split into training and test images, as integer pixel arrays [N, 64] in 0..16."""

    train_pixels: np.ndarray
    train_labels: np.ndarray
    test_pixels: np.ndarray
    test_labels: np.ndarray


def load_digit_data(test_images: int = TEST_IMAGES, seed: int = 0) -> DigitsData:
    """scikit-learn's digits, shuffled reproducibly, the last `test_images` held out for testing."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = digits.data.astype(np.int64)
    labels = digits.target.astype(np.int64)
    if not 0 < test_images < len(pixels):
        raise HeadkitError(f"test_images must be in [1, {len(pixels) - 1}], got {test_images!r}")
    order = np.random.default_rng(seed).permutation(len(pixels))
    pixels, labels = pixels[order], labels[order]
    split = len(pixels) - test_images
    return DigitsData(pixels[:split], labels[:split], pixels[split:], labels[split:])


def to_sequences(pixels: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Token sequences [N, 65]: the start token, then the 64 pixel intensities (each its own token)."""
    pixels = torch.as_tensor(pixels, dtype=torch.long)
    if pixels.ndim != 2 or pixels.shape[1] != PIXELS:
        raise HeadkitError(f"pixels must have shape [N, {PIXELS}], got {tuple(pixels.shape)}")
    if pixels.numel() and (int(pixels.min()) < 0 or int(pixels.max()) >= LEVELS):
        raise HeadkitError(f"pixels must be integers in [0, {LEVELS - 1}]")
    start = torch.full((pixels.shape[0], 1), BOS, dtype=torch.long)
    return torch.cat([start, pixels], dim=1)


def occlude(pixels: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The prompts [N, 33] of the completion task: the start token and the top half (four rows) of each image."""
    return to_sequences(pixels)[:, : 1 + VISIBLE]


def build_model(mechanism: str, config: DigitsConfig) -> HeadkitForCausalLM:
    """A pixel model with `mechanism` attention; the same size and initialisation seed for every mechanism."""
    torch.manual_seed(config.seed)
    model_config = HeadkitConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        attention=mechanism,
        position_embedding_type="learned",
        max_position_embeddings=1 + PIXELS,
        bos_token_id=BOS,
        pad_token_id=None,
        eos_token_id=None,
    )
    return HeadkitForCausalLM(model_config)


def pixel_training(
    model: HeadkitForCausalLM, sequences: torch.Tensor, config: DigitsConfig
) -> dict[str, Any]:
    """How a pixel model trains (:func:`headkit.train.train_on_batches`' options but the step count): AdamW with
    a cosine decay, next-pixel cross-entropy on batches of `sequences` drawn at random with replacement, seeded
    with ``config.seed`` (every mechanism sees the same images in the same order)."""

    def draw(index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        batch = sequences[torch.randint(len(sequences), (config.batch_size,), generator=generator)]
        return {"input_ids": batch, "labels": batch}

    return {
        "draw": draw,
        "seed": config.seed,
        "param_groups": [{"params": list(model.parameters()), "lr": config.lr, "weight_decay": 0.01}],
        "schedule": lambda step: 0.5 * (1 + math.cos(math.pi * step / config.steps)),
    }


@torch.no_grad()
def bits_per_pixel(model: HeadkitForCausalLM, sequences: torch.Tensor) -> float:
    """Mean negative log2-likelihood of the pixels of `sequences` (lower is better; log2(17) ≈ 4.09 is chance)."""
    nats, predicted = next_token_nats(model, sequences, batch_size=len(sequences))
    return nats / (int(predicted.sum()) * math.log(2))


@torch.no_grad()
def complete_images(
    model: HeadkitForCausalLM, prompts: torch.Tensor, *, sample: bool = False, seed: int = 0
) -> torch.Tensor:
    """Completed images [N, 64] in 0..16: the prompts' top halves kept, the bottom halves generated.

    ``model.generate`` decodes with the model's cache — the recurrent state of linear attention, the KV cache of
    softmax attention. The start token is never a valid pixel, so it is masked out of the generated logits."""
    if prompts.ndim != 2 or prompts.shape[1] != 1 + VISIBLE:
        raise HeadkitError(f"prompts must have shape [N, {1 + VISIBLE}], got {tuple(prompts.shape)}")
    torch.manual_seed(seed)
    return generate_tokens(
        model, prompts, PIXELS - VISIBLE, BOS, exact=True, do_sample=sample, suppress_tokens=[BOS]
    )[:, 1:]


def train_classifier(pixels: np.ndarray, labels: np.ndarray) -> Any:
    """Logistic regression on the real digits' intensities (scaled to [0, 1]): the judge of the completions."""
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(max_iter=2000).fit(pixels / (LEVELS - 1), labels)


def classifier_accuracy(classifier: Any, pixels: np.ndarray | torch.Tensor, labels: np.ndarray) -> float:
    return float((classifier.predict(np.asarray(pixels) / (LEVELS - 1)) == labels).mean())


def render_markdown(report: dict[str, Any]) -> str:
    """The measured table: per mechanism, likelihood, the judge's accuracy and completion time per image count."""
    counts = sorted({int(count) for result in report["mechanisms"] for count in result["completion_seconds"]})
    columns = {
        "attention": lambda r: r["mechanism"],
        "parameters": lambda r: f"{r['parameters']:,}",
        "train s": lambda r: f"{r['train_seconds']:.1f}",
        "test bits/pixel": lambda r: f"{r['test_bits_per_pixel']:.3f}",
        "accuracy on completions": lambda r: f"{r['classifier_accuracy_completed']:.3f}",
    }
    for n in counts:  # the image counts are keys as JSON writes them: strings
        columns[f"complete {n} images (s)"] = lambda r, n=n: f"{r['completion_seconds'][str(n)]:.2f}"
    accuracy = f"{report['classifier_accuracy_original']:.3f}"
    original = ["original images", "", "", "", accuracy, *[""] * len(counts)]
    machine = report["machine"]
    return (
        f"Digits completion ({report['train_images']} training / {report['test_images']} test images, bottom half "
        f"completed {'by sampling' if report['settings']['sample'] else 'greedily'}); {machine['cpu_model']}, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch_version']}.\n\n"
        + column_table(columns, report["mechanisms"], last=[original])
    )


def plot_completion_grid(report: dict[str, Any]) -> Any:
    """A figure: a row of occluded inputs (hidden half red), a row per mechanism's completions, the originals."""
    from matplotlib import colormaps

    originals = np.asarray(report["grid_images"], dtype=float)
    occluded = originals.copy()
    occluded[:, VISIBLE:] = np.nan
    rows = {"occluded": occluded} | {r["mechanism"]: r["grid_completions"] for r in report["mechanisms"]}
    rows["original"] = originals
    figure, axes = figure_axes(
        (len(originals) * 0.9, len(rows) * 1.0), len(rows), len(originals), squeeze=False
    )
    cmap = colormaps["gray_r"].with_extremes(bad="#d62728")  # hidden pixels in red, never mistaken for ink
    for row, (name, images) in zip(axes, rows.items(), strict=True):
        for axis, image in zip(row, np.asarray(images, dtype=float), strict=True):
            axis.imshow(image.reshape(SIDE, SIDE), cmap=cmap, vmin=0, vmax=LEVELS - 1)
            axis.set_xticks([])
            axis.set_yticks([])
        row[0].set_ylabel(name, rotation=0, ha="right", va="center")
    figure.suptitle("bottom-half completion of held-out digits")
    return figure


@register_benchmark(
    "digits",
    DigitsConfig,
    check=lambda config: check_head_width(config.hidden_size, config.heads, even=False),
    render=render_markdown,
    files={"table": TABLE_FILE, "grid": GRID_FILE},
    plots={GRID_FILE: plot_completion_grid},
)
def run_digits_benchmark(config: DigitsConfig, console: Any) -> dict[str, Any]:
    """Linear vs softmax autoregressive pixel models on the 8×8 digits: bottom-half completion, its time and a
    classifier's accuracy on the completed images.

    Returns the dictionary written to ``results.json``."""
    data = load_digit_data(max(TEST_IMAGES, max(config.image_counts)), config.seed)
    train_sequences = to_sequences(data.train_pixels)
    test_sequences = to_sequences(data.test_pixels)
    classifier = train_classifier(data.train_pixels, data.train_labels)
    accuracy_original = classifier_accuracy(classifier, data.test_pixels, data.test_labels)
    console.print(
        f"digits: {len(data.train_pixels)} training, {len(data.test_pixels)} test images; "
        f"classifier accuracy on the original test images {accuracy_original:.3f}"
    )
    prompts = occlude(data.test_pixels)

    def evaluate(
        mechanism: str, model: HeadkitForCausalLM, trained: dict, update: Callable
    ) -> dict[str, Any]:
        update(description=f"completing with {mechanism}")
        completions = complete_images(model, prompts, sample=config.sample, seed=config.seed)
        seconds = {}  # images (as JSON writes them) -> seconds (median)
        for count in config.image_counts:
            call = partial(complete_images, model, prompts[:count], sample=config.sample)
            seconds[str(count)] = time_call(call, repeats=config.timing_repeats, warmup=0).median_s
        completed = classifier_accuracy(classifier, completions.numpy(), data.test_labels)
        bits = bits_per_pixel(model, test_sequences)
        result = {"mechanism": mechanism} | trained | {"test_bits_per_pixel": bits}
        result |= {"classifier_accuracy_completed": completed, "completion_seconds": seconds}
        result["grid_completions"] = completions[:GRID_COLUMNS].tolist()  # the figure's row
        result["losses"] = result.pop("losses")  # last: the longest entry
        times = ", ".join(f"{count} images {median:.2f} s" for count, median in seconds.items())
        console.print(
            f"{mechanism}: {bits:.3f} bits/pixel on test images, classifier accuracy on completions "
            f"{completed:.3f}; completion time {times}"
        )
        return result

    build = partial(build_model, config=config)
    train = partial(pixel_training, sequences=train_sequences, config=config)
    results = train_each(console, config.mechanisms, build, train, config.steps, evaluate)
    return {
        "train_images": len(data.train_pixels),
        "test_images": len(data.test_pixels),
        "classifier_accuracy_original": accuracy_original,
        "grid_images": data.test_pixels[:GRID_COLUMNS].tolist(),  # the test images the figure shows
        "mechanisms": results,
    }
