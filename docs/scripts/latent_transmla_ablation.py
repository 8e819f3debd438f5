"""SmolLM2-135M held-out perplexity of latent keys/values before any training step: today's method (the fitted
rotary selection) against TransMLA's RoRoPE, + BKV, + FreqFold (docs/latent-kv.md, issue 54).

Run from the repository root (one thread, nothing downloaded):

    PYTHONPATH=src python docs/scripts/latent_transmla_ablation.py --fraction 1/2 --variants fitted rorope ...

The data are the recipe's own (``headkit compress``'s windows: 256-token training windows, the first 16 for
calibration, held-out windows of 1,024 tokens from other documents, seed 0); the calibration statistics are
collected once per model and shared by every variant."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from headkit.evaluation.quality import perplexity
from headkit.recipes.compress import (
    CompressSettings,
    calibration_batches,
    latent_statistics,
    latent_student,
    latent_windows,
    load_teacher,
    rope_report_rank,
)
from headkit.runs.models import smollm2_gguf_path

FRACTIONS = {"1/2": (120, 24), "1/4": (48, 16), "1/8": (24, 8)}
# name: (rope_selection, rope_fold, balance_kv)
VARIANTS = {
    "fitted": ("fitted", 1, False),
    "fitted+bkv": ("fitted", 1, True),
    "rorope": ("rorope", 1, False),
    "rorope+bkv": ("rorope", 1, True),
    "rorope+fold2": ("rorope", 2, False),
    "rorope+fold2+bkv": ("rorope", 2, True),
    "rorope+fold4+bkv": ("rorope", 4, True),
    "rorope_fitted": ("rorope_fitted", 1, False),
    "rorope_fitted+bkv": ("rorope_fitted", 1, True),
    "rorope_fitted+fold2": ("rorope_fitted", 2, False),
    "rorope_fitted+fold2+bkv": ("rorope_fitted", 2, True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fraction", action="append", choices=sorted(FRACTIONS), required=True)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--calibration-windows", type=int, default=16)
    parser.add_argument("--rank", type=int, help="override R (with a single --fraction)")
    parser.add_argument("--rope-dims", type=int, help="override D (with a single --fraction)")
    parser.add_argument("--full-rank", action="store_true", help="R at its full width: the rotary step alone")
    parser.add_argument("--statistics", help="a file to keep the calibration statistics in between runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    settings = CompressSettings(
        window=256,
        eval_window=1024,
        held_out_texts=args.held_out,
        calibration_windows=args.calibration_windows,
    )
    teacher = load_teacher(smollm2_gguf_path(), "float32")
    train, held_out, _ = latent_windows(teacher, settings)
    calibration = calibration_batches(train, settings.calibration_windows)
    if args.statistics and Path(args.statistics).exists():
        statistics, original = torch.load(args.statistics, weights_only=False)
    else:
        statistics = latent_statistics(teacher, calibration)
        original = perplexity(teacher.model, held_out, 8)
        if args.statistics:
            torch.save((statistics, original), args.statistics)
    print(f"original {original:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    for fraction in args.fraction:
        rank, rope_dims = FRACTIONS[fraction]
        rank, rope_dims = args.rank or rank, args.rope_dims or rope_dims
        if args.full_rank:
            rank = rope_report_rank(teacher, rope_dims)
        for name in args.variants:
            selection, fold, balance = VARIANTS[name]
            began = time.perf_counter()
            student, report = latent_student(
                teacher,
                rank,
                rope_dims,
                calibration,
                selection,
                statistics,
                rope_fold=fold,
                balance_kv=balance,
            )
            value = perplexity(student, held_out, 8)
            row = {
                "fraction": fraction,
                "R": rank,
                "D": rope_dims,
                "variant": name,
                "perplexity": round(value, 3),
                "ratio": round(value / original, 3),
                "cache_fraction": round(report.cache_fraction, 4),
                "max_key_error": round(report.max_key_error, 3),
                "max_value_error": round(report.max_value_error, 3),
                "seconds": round(time.perf_counter() - began, 1),
            }
            print(json.dumps(row), flush=True)
            del student
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
