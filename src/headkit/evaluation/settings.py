"""What ``headkit eval`` measures, declared once: :class:`EvalSettings`, whose fields with help are the command's
options (headkit.runs.options) and whose checks are those the fields declare, made before any model loads
(:func:`check_eval_settings`). No model code, so ``headkit --help`` stays light."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from headkit.errors import HeadkitError
from headkit.evaluation.tasks import (
    TaskSettings,
    as_task_names,
    check_task_settings,
    task_names,
)
from headkit.files import check_output_folder
from headkit.runs.options import check_options, existing_path, parse_list

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def check_depths(depths: Sequence[float]) -> None:
    """Passkey depths: distinct numbers in [0, 1] (0: the key first, 1: last)."""
    if not depths or any(
        isinstance(d, bool) or not isinstance(d, int | float) or not 0.0 <= d <= 1.0 for d in depths
    ):
        raise HeadkitError(
            f"--depths must be numbers in [0, 1] (0: the key first, 1: last), got {list(depths)}"
        )
    if len(set(depths)) != len(depths):
        raise HeadkitError(f"--depths must be distinct, got {list(depths)}")


def _lengths_or_none(flag: str, text: str) -> tuple[int, ...]:
    """A list of lengths: "none" skips the measurement (an empty tuple); otherwise integers ≥ 2."""
    return () if text.strip().lower() == "none" else parse_list(flag, text, minimum=2)


def _check_dtype(dtype: str) -> None:
    from headkit.runs.models import dtype_name

    dtype_name(dtype)


@dataclass
class EvalSettings:
    """What ``headkit eval`` measures. A length list left None is its default cut to the model's context (see
    :func:`headkit.surgery.linearize.max_context`); an empty one skips that measurement. With ``tasks``, a
    measurement whose lengths are left None is skipped: --tasks replaces the default measurements, and runs
    beside those asked for."""

    model: Path = field(
        metadata={
            "help": "A causal LM: a folder headkit wrote (prune, compress, linearize, train), a stock 🤗 folder, "
            "or a GGUF file such as SmolLM2's.",
            "argument": True,
            "flag": "MODEL",
            "check": existing_path("MODEL"),
        }
    )
    reference: Path | None = field(
        default=None,
        metadata={
            "help": "The original to compare with: top-1 agreement, KL, and its own numbers beside MODEL's.",
            "check": existing_path("--reference"),
        },
    )
    data: Path | None = field(
        default=None,
        metadata={
            "help": "Text for perplexity and passkey filler: a file, a folder or JSON Lines (default: the "
            "standard library's held-out source; its docstrings and comments as filler).",
            "check": existing_path("--data"),
        },
    )
    lengths: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "Comma-separated held-out perplexity lengths, or none (default: 256,512,1024,2048,4096,8192 "
            "up to the model's context).",
            "parse": _lengths_or_none,
        },
    )
    eval_tokens: int = field(
        default=8192, metadata={"help": "Held-out tokens scored at each perplexity length.", "min": 1}
    )
    passkey_lengths: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "Comma-separated passkey prompt lengths, or none (default: 512,1024,2048,4096 up to the "
            "context).",
            "parse": _lengths_or_none,
        },
    )
    depths: tuple[float, ...] = field(
        default=DEFAULT_DEPTHS,
        metadata={"help": "Comma-separated key depths in [0, 1].", "check": check_depths},
    )
    trials: int = field(
        default=20, metadata={"help": "Passkey prompts per length, spread evenly over the depths.", "min": 1}
    )
    max_new_tokens: int = field(default=8, metadata={"min": 1})  # of each passkey answer
    decode_contexts: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "Comma-separated contexts of the decode time and state size, or none (default: "
            "256,1024,4096 up to the context).",
            "parse": _lengths_or_none,
        },
    )
    decode_steps: int = field(default=8, metadata={"min": 1})
    batch_tokens: int = field(default=8192, metadata={"min": 1})  # tokens per forward in perplexity, passkey
    seed: int = field(
        default=0, metadata={"help": "Seed of the held-out windows, passkey keys, depths and filler."}
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Precision the model is loaded (a GGUF file dequantized), trained and decoded in: float32 or "
            "bfloat16.",
            "check": _check_dtype,
        },
    )
    threads: int | None = field(
        default=None,
        metadata={
            "help": "torch threads while measuring (default: torch's; 1 is faster on busy shared cores).",
            "min": 1,
        },
    )
    out: Path | None = field(
        default=Path("results/eval"),
        metadata={"help": "Output folder for report.json and passkey.png."},
    )  # None (the library): write nothing
    tasks: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "lm-evaluation-harness tasks, NAME[,NAME…] (needs pip install 'headkit[eval]'): their scores "
            "instead of the default measurements; --lengths, --passkey-lengths or --decode-contexts given run "
            "beside them. Data is downloaded only with the hub online; offline, use --include-path with local "
            "files.",
            "parse": lambda flag, text: task_names(text, flag),
        },
    )
    include_path: Path | None = field(
        default=None,
        metadata={
            "help": "A folder of lm-eval task YAML files (data local: dataset_path: json, data_files)."
        },
    )
    num_fewshot: int | None = field(
        default=None, metadata={"help": "Few-shot examples per prompt (default: each task's own).", "min": 0}
    )
    limit: int | None = field(
        default=None, metadata={"help": "Examples per task at most (default: all).", "min": 1}
    )
    batch_size: int | None = field(
        default=None, metadata={"help": "Requests per forward in the tasks (default 1).", "min": 1}
    )

    @property
    def task_settings(self) -> TaskSettings:
        return TaskSettings(
            tasks=as_task_names(self.tasks),
            include_path=self.include_path,
            num_fewshot=self.num_fewshot,
            limit=self.limit,
            batch_size=1 if self.batch_size is None else self.batch_size,
        )


def check_eval_settings(settings: EvalSettings) -> None:
    """The checks that need no model, before anything loads: those the fields declare, then the task options
    against --tasks and the output folder against the inputs."""
    check_options(settings)
    if settings.tasks:
        check_task_settings(settings.task_settings)
    elif (settings.include_path, settings.num_fewshot, settings.limit, settings.batch_size) != (None,) * 4:
        raise HeadkitError(
            "--include-path, --num-fewshot, --limit and --batch-size shape --tasks: add --tasks"
        )
    if settings.out is not None:
        inputs = {"model": settings.model} | (
            {"--reference": settings.reference} if settings.reference else {}
        )
        check_output_folder(settings.out, True, inputs)
