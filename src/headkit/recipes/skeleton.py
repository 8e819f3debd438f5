"""The save step every recipe shares, written once (staging folder, reload check, report, atomic move), which
:func:`headkit.recipes.steps.run_recipe` ends with.

Under ``torchrun`` / ``accelerate launch`` every process runs the whole recipe (:mod:`headkit.runs.processes`),
and only the main process writes: it builds the staging folder, reloads the result, writes the report and moves
the folder into place, while the others wait; the completed report, or the error it met, reaches every process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.files import staged_folder, write_json_atomic
from headkit.runs.faults import fault_point
from headkit.runs.processes import on_main_process
from headkit.runs.resident import Peak, stage_peaks

REPORT_FILE = "report.json"
# An input every model of any vocabulary can embed (ids below 100), for the reload check.
RELOAD_CHECK_IDS = torch.arange(1, 17)[None] % 100


@torch.no_grad()
def reload_difference(folder: Path, model: nn.Module, *, stock: bool = False) -> float:
    """Max |Δ| of the outputs (logits, or an encoder's last hidden state) of `model` and its copy saved in
    `folder`, reloaded the way a user would: plain transformers for a stock causal LM (`stock`),
    :func:`headkit.from_pretrained` otherwise."""
    from headkit.surgery.io import from_pretrained

    if stock:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=model.dtype)
    else:
        reloaded = from_pretrained(folder)
    first, second = model(input_ids=RELOAD_CHECK_IDS), reloaded.eval()(input_ids=RELOAD_CHECK_IDS)
    name = "logits" if getattr(first, "logits", None) is not None else "last_hidden_state"
    return float((getattr(first, name) - getattr(second, name)).abs().max())


def save_result(
    out: str | Path,
    model: nn.Module,
    tokenizer: Any,
    report: dict[str, Any],
    *,
    started: float,
    stock: bool = False,
    extras: Iterable[Callable[[Path, dict[str, Any]], None]] = (),
    peaks: dict[str, Peak] | None = None,
) -> dict[str, Any]:
    """The save step of every recipe, on the main process only (:func:`on_main_process`): the model and its
        tokenizer into a staging folder beside `out`, ``reload_max_abs_diff`` (:func:`reload_difference`), each of
        `extras` (``extra(staging, report)``: a plot, a GGUF export — inside the staging, so a failure leaves no
        folder), ``seconds`` since `started`, ``peak_memory`` (`peaks`: each stage's :class:`~headkit.runs.resident.Peak`, the
    save's so far), ``report.json``; then the staging folder becomes `out` atomically. The
        report, completed, is returned on every process (and `report` updated in place). The staging folder, each
        file written atomically and `out` are listed under ``$HEADKIT_WRITE_LOG`` when it is set
        (:func:`headkit.files.record_write`), in the main process's list only."""

    def write() -> dict[str, Any]:
        try:
            return staged_write()
        except OSError as exc:
            # A full disk, a folder gone read-only: one line naming the file; the staging folder is gone and
            # `out` as it was (staged_folder).
            what = exc.strerror or str(exc) or type(exc).__name__
            where = f" ({exc.filename})" if exc.filename else ""
            raise HeadkitError(
                f"cannot write --out {str(out)!r}: {what}{where}; it was left as it was"
            ) from exc

    def staged_write() -> dict[str, Any]:
        save_started = time.perf_counter()
        with staged_folder(out) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            report["reload_max_abs_diff"] = reload_difference(staging, model, stock=stock)
            for extra in extras:
                extra(staging, report)
            if "stage_seconds" in report:
                report["stage_seconds"]["save"] = time.perf_counter() - save_started
            report["seconds"] = time.perf_counter() - started
            if peaks is not None:
                if "save" in peaks:
                    peaks["save"].update()  # the save's peak so far
                estimate = (report.get("peak_memory") or {}).get("estimate")  # the preflight's, kept
                report["peak_memory"] = stage_peaks(peaks) | ({"estimate": estimate} if estimate else {})
            write_json_atomic(staging / REPORT_FILE, report)
            fault_point("save")
        return report

    report.update(on_main_process(write))
    return report
