"""``headkit bench lora``: low-rank adaptation (LoRA, through PEFT) against full fine-tuning, on real digits.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (ICLR 2022), Eq. 3: h = W₀x + (α/r)·B A x with
W₀ frozen, so a layer trains r·(d_in + d_out) parameters instead of d_in·d_out. An MLP classifier of scikit-learn's
``load_digits`` is pretrained, then on three shifted variants of the digits (quantized, rotated, inverted)
evaluated as is, fully fine-tuned and adapted with LoRA per rank; and, per rank, LoRA alone on a random frozen
MLP. Method and results: docs/from-scratch.md. Writes ``results.json``, ``table.md`` and ``lora.png``.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.bench._report import figure_axes, markdown_table, progress_bar
from headkit.bench.digits import DIGIT_IMAGES, LEVELS, PIXELS, SIDE, load_digit_data
from headkit.bench.registry import option, quick_preset, register_benchmark, setting
from headkit.errors import HeadkitError
from headkit.recipes.distill import with_lora
from headkit.recipes.loop import train_loop

MAX_INTENSITY = LEVELS - 1  # load_digits intensities are integers 0..16
RANKS = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = ("quantized", "rotated", "inverted")
TARGET_MODULES = ("fc1", "fc2", "fc3")
# α of the update (α/r)·BA, fixed across ranks as Hu et al. (Sec. 4.1) do, so a larger rank is not a larger step.
LORA_ALPHA = 8
PLOT_FILE = "lora.png"


@dataclass
class LoraConfig:
    """Settings of one ``headkit bench lora`` run."""

    out: Path = option(Path("results/lora"), "Output directory for results.json, table, plot.")
    ranks: tuple[int, ...] = option(
        RANKS,
        "Comma-separated LoRA ranks.",
        min=1,
        quick=(1, 4, 16, 64),
    )
    hidden_size: int = setting(128, min=1)
    pretrain_epochs: int = option(60, "Epochs on the original digits.", min=1, quick=30)
    finetune_epochs: int = option(30, "Epochs per fine-tuning run.", min=1, quick=20)
    batch_size: int = setting(64, min=1)
    lr: float = setting(3e-3, positive=True)
    lora_lr: float = setting(
        1e-2, positive=True
    )  # B starts at zero: the factors need a larger step than full fine-tuning
    test_fraction: float = 0.25
    seed: int = option(0, "Seed of the split, initialisation and batches.")
    # Tiny models: a second thread only adds synchronisation, and on shared cores it costs 10× (measured).
    threads: int = option(1, "torch threads (a tiny MLP: 1 is fastest).", min=1)

    quick = quick_preset("Four ranks and fewer epochs (< 2 minutes).")


class DigitClassifier(nn.Module):
    """An MLP 64 → hidden → hidden → 10 with ReLU, on pixel intensities scaled to [0, 1]."""

    def __init__(self, hidden_size: int = 128) -> None:
        super().__init__()
        self.fc1 = nn.Linear(PIXELS, hidden_size)
        self.fc2 = nn.Linear(hidden_size, hidden_size)
        self.fc3 = nn.Linear(hidden_size, 10)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(pixels)))))


def load_split(test_fraction: float = 0.25, seed: int = 0) -> dict[str, torch.Tensor]:
    """The digits as float pixels [N, 64] in 0..16 and labels [N], shuffled and split as ``headkit bench digits``
    does (:func:`load_digit_data`), ``test_fraction`` of them held out."""
    if not 0 < test_fraction < 1:
        raise HeadkitError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    data = load_digit_data(DIGIT_IMAGES - round(DIGIT_IMAGES * (1 - test_fraction)), seed)
    return {
        "train_x": torch.as_tensor(data.train_pixels, dtype=torch.float32),
        "train_y": torch.as_tensor(data.train_labels),
        "test_x": torch.as_tensor(data.test_pixels, dtype=torch.float32),
        "test_y": torch.as_tensor(data.test_labels),
    }


def make_variant(pixels: torch.Tensor, variant: str) -> torch.Tensor:
    """A shifted copy of `pixels` [N, 64] (intensities 0..16): quantized, rotated or inverted, still in 0..16."""
    if pixels.ndim != 2 or pixels.shape[1] != PIXELS:
        raise HeadkitError(f"pixels must have shape [N, {PIXELS}], got {tuple(pixels.shape)}")
    if variant == "original":
        return pixels.clone()
    if variant == "quantized":
        # Two levels: a binarised scan keeps the strokes and loses every grey.
        return torch.where(pixels >= MAX_INTENSITY / 2, float(MAX_INTENSITY), 0.0)
    if variant == "rotated":
        images = pixels.reshape(-1, SIDE, SIDE)
        return torch.rot90(images, k=1, dims=(1, 2)).reshape(-1, PIXELS).contiguous()
    if variant == "inverted":
        return MAX_INTENSITY - pixels
    raise HeadkitError(f"variant must be one of original, {', '.join(VARIANTS)}; got {variant!r}")


def train_classifier(
    model: nn.Module,
    pixels: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> list[float]:
    """``epochs`` passes of Adam on the cross-entropy of the parameters that require gradients, in shuffled
    batches (seeded; the last incomplete batch of a pass left out), on headkit's one training loop; returns the
    mean loss of each pass."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise HeadkitError("the model has no trainable parameter")
    examples = [{"pixels": x, "labels": y} for x, y in zip(pixels / MAX_INTENSITY, labels, strict=True)]
    per_epoch = max(1, len(examples) // batch_size)

    def loss(model: nn.Module, batch: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        return F.cross_entropy(model(batch["pixels"]), batch["labels"])

    trained = train_loop(
        model,
        loss,
        examples,
        steps=epochs * per_epoch,
        batch_size=batch_size,
        param_groups=[{"params": trainable, "lr": lr}],
        dropout=True,
        seed=seed,
    )
    losses = trained.losses
    return [sum(losses[i : i + per_epoch]) / per_epoch for i in range(0, len(losses), per_epoch)]


@torch.no_grad()
def accuracy(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    return float((model(pixels / MAX_INTENSITY).argmax(-1) == labels).float().mean())


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _ranks(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"r={row['rank']} {row['accuracy']:.3f}" for row in rows)


def render_markdown(report: dict[str, Any]) -> str:
    """Accuracy per variant and method, with the trainable parameters of each method."""
    first = next(iter(report["variants"].values()))
    headers = ["data", "pretrained as is", "full fine-tuning"]
    headers += [f"LoRA r={row['rank']}" for row in report["lora_from_scratch"]]
    rows = [["trainable parameters", "0", f"{first['full_finetune_parameters']:,}"]]
    rows[0] += [f"{row['trainable_parameters']:,}" for row in first["lora"]]
    for name, variant in report["variants"].items():
        rows.append([name, f"{variant['accuracy_before']:.3f}", f"{variant['full_finetune_accuracy']:.3f}"])
        rows[-1] += [f"{row['accuracy']:.3f}" for row in variant["lora"]]
    rows.append(["original, LoRA only from scratch", "", ""])
    rows[-1] += [f"{row['accuracy']:.3f}" for row in report["lora_from_scratch"]]
    machine = report["machine"]
    return (
        f"Test accuracy ({report['train_images']} training / {report['test_images']} test digits; classifier of "
        f"{report['classifier_parameters']:,} parameters, {report['pretrained_accuracy']:.3f} on the original "
        f"digits); {machine['cpu_model']}, {machine['torch_threads']} torch threads, torch "
        f"{machine['torch_version']}.\n\n" + markdown_table(headers, rows)
    )


def plot_results(report: dict[str, Any]) -> Any:
    """Accuracy against LoRA rank (log₂ axis), one line per variant, full fine-tuning dashed in the same colour."""

    def by_rank(rows: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
        return [row["rank"] for row in rows], [row["accuracy"] for row in rows]

    figure, axis = figure_axes((7, 4.5))
    for index, (name, variant) in enumerate(report["variants"].items()):
        axis.plot(*by_rank(variant["lora"]), "o-", color=f"C{index}", label=f"{name}: LoRA")
        axis.axhline(
            variant["full_finetune_accuracy"], color=f"C{index}", linestyle="--", label=f"{name}: full"
        )
    scratch = "original: LoRA only, from scratch"
    axis.plot(*by_rank(report["lora_from_scratch"]), "s:", color="black", label=scratch)
    axis.set(
        xlabel="LoRA rank r", ylabel="test accuracy", title="LoRA against full fine-tuning on shifted digits"
    )
    axis.set_xscale("log", base=2)
    axis.legend(fontsize=7, loc="lower right")
    return figure


@register_benchmark("lora", LoraConfig, render=render_markdown, plots={PLOT_FILE: plot_results})
def run_lora_benchmark(config: LoraConfig, console: Any) -> dict[str, Any]:
    """LoRA (through PEFT) against full fine-tuning of a digits classifier on quantized, rotated and inverted digits,
    per rank, with trainable parameter counts; and LoRA-only training from scratch.

    Returns the dictionary written to ``results.json``."""
    data = load_split(config.test_fraction, config.seed)
    train = functools.partial(train_classifier, batch_size=config.batch_size, seed=config.seed)
    variants: dict[str, dict[str, Any]] = {}
    jobs = 1 + len(VARIANTS) * (1 + len(config.ranks)) + len(config.ranks)
    with progress_bar(console, transient=True) as progress:
        task = progress.add_task("fine-tuning", total=jobs)

        def fit(
            model: nn.Module, variant: str, lr: float, label: str, epochs: int = config.finetune_epochs
        ) -> float:
            """Train `model` on `variant` of the training digits; its accuracy on that variant of the test digits."""
            progress.update(task, description=f"{variant}: {label}")
            train(model, make_variant(data["train_x"], variant), data["train_y"], epochs=epochs, lr=lr)
            progress.advance(task)
            return accuracy(model, make_variant(data["test_x"], variant), data["test_y"])

        torch.manual_seed(config.seed)
        pretrained = DigitClassifier(config.hidden_size)
        base_accuracy = fit(pretrained, "original", config.lr, "pretraining", config.pretrain_epochs)
        console.print(f"pretrained classifier: accuracy {base_accuracy:.3f} on the original test digits")

        def lora_sweep(base: nn.Module, variant: str, label: str) -> list[dict[str, Any]]:
            """Per rank, a LoRA copy of `base` fitted to `variant`: its trainable parameters and accuracy."""
            rows = []
            for rank in config.ranks:
                torch.manual_seed(config.seed)  # A's random initialisation
                adapted = with_lora(copy.deepcopy(base), list(TARGET_MODULES), rank=rank, alpha=LORA_ALPHA)
                parameters = trainable_parameters(adapted)
                score = fit(adapted, variant, config.lora_lr, label.format(rank=rank))
                rows.append({"rank": rank, "trainable_parameters": parameters, "accuracy": score})
            return rows

        for variant in VARIANTS:
            before = accuracy(pretrained, make_variant(data["test_x"], variant), data["test_y"])
            full = copy.deepcopy(pretrained)
            full_accuracy = fit(full, variant, config.lr, "full fine-tuning")
            lora = lora_sweep(pretrained, variant, "LoRA r={rank}")
            variants[variant] = {
                "accuracy_before": before,
                "full_finetune_accuracy": full_accuracy,
                "full_finetune_parameters": trainable_parameters(full),
                "lora": lora,
            }
            console.print(
                f"{variant}: {before:.3f} before, {full_accuracy:.3f} fully fine-tuned, LoRA {_ranks(lora)}"
            )

        torch.manual_seed(config.seed + 1)
        from_scratch = lora_sweep(
            DigitClassifier(config.hidden_size), "original", "LoRA only r={rank}, from scratch"
        )
    console.print(f"LoRA only, from scratch: {_ranks(from_scratch)}")

    return {
        "train_images": len(data["train_x"]),
        "test_images": len(data["test_x"]),
        "classifier_parameters": sum(p.numel() for p in pretrained.parameters()),
        "pretrained_accuracy": base_accuracy,
        "variants": variants,
        "lora_from_scratch": from_scratch,
    }
