"""Zero- and few-shot task accuracy through EleutherAI's lm-evaluation-harness (``lm-eval``), on any causal LM
headkit loads or writes — the figures papers report beside perplexity.

lm-eval evaluates a model already in memory (``HFLM(pretrained=model, tokenizer=tokenizer)``), so a converted
model (linearized, latent keys/values, pruned unevenly) is measured exactly as headkit loaded it. Its tasks are
YAML files: the built-in ones (hellaswag, arc_easy, …), whose data comes from the 🤗 Hub, and any folder of
your own (``--include-path``), whose data may be local JSON Lines (``dataset_path: json`` and
``dataset_kwargs: {data_files: …}``).

The order of work makes every mistake cheap: :func:`check_task_settings` (the numbers, the folder, lm-eval itself),
then :func:`load_tasks` (each task's name and its data, before any model loads), then :func:`run_tasks` on each
model. :func:`measure_tasks` runs them all on several models (a model and its reference, a recipe's original and
its result) and returns what reports hold under ``tasks``.

Nothing is downloaded unless the hub is online: with ``HF_HUB_OFFLINE=1`` (or ``HF_DATASETS_OFFLINE=1``) a task
whose data is not on this machine fails in one line that names it and says what to do.

lm-eval is the optional extra ``headkit[eval]``; without it, asking for tasks says how to install it.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import importlib.metadata
import json
import logging
import math
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.runs.processes import on_main_process

INSTALL_HINT = "pip install 'headkit[eval]'"
# The first release that runs on transformers 5 (headkit's range); pyproject.toml pins the one tested.
MIN_LM_EVAL = "0.4.10"


@dataclass(frozen=True)
class TaskSettings:
    """Which lm-eval tasks to run, and how (the options keep lm-eval's names).

    ``prefix`` is how the command names its options in messages: ``"--"`` for ``headkit eval`` (``--tasks``,
    ``--include-path``), ``"--eval-"`` for the recipes (``--eval-tasks``, ``--eval-include-path``)."""

    tasks: tuple[str, ...]
    include_path: Path | None = None  # a folder of task YAML files, searched besides lm-eval's own
    num_fewshot: int | None = None  # None: each task's own default (0 when it names none)
    limit: int | None = None  # examples per task at most (None: all)
    batch_size: int = 1
    prefix: str = "--"

    def option(self, name: str) -> str:
        return f"{self.prefix}{name.replace('_', '-')}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tasks": list(self.tasks),
            "include_path": None if self.include_path is None else str(self.include_path),
            "num_fewshot": self.num_fewshot,
            "limit": self.limit,
            "batch_size": self.batch_size,
        }


# -- the recipes: prune, linearize and compress report task scores before and after ------------------------------

# The recipes' help for their two options (`headkit prune|linearize|compress --eval-tasks …`).
EVAL_TASKS_HELP = (
    "lm-evaluation-harness tasks, NAME[,NAME…], scored on the original and the result beside perplexity "
    f"(needs {INSTALL_HINT}; data downloads only with the hub online)."
)
EVAL_INCLUDE_PATH_HELP = (
    "A folder of lm-eval task YAML files for --eval-tasks (local data: dataset_path: json)."
)
ENCODER_TASKS_ERROR = "--eval-tasks scores causal LMs (lm-eval's log-likelihoods); MODEL is an encoder"


def recipe_task_settings(settings: Any) -> TaskSettings:
    """The tasks of a recipe's settings (``eval_tasks``, ``eval_include_path``), named as its options are."""
    include = settings.eval_include_path
    return TaskSettings(
        tasks=as_task_names(settings.eval_tasks, "--eval-tasks"),
        include_path=None if include is None else Path(include),
        prefix="--eval-",
    )


def check_recipe_tasks(settings: Any, *, default_is_causal_lm: bool) -> None:
    """A recipe's check of ``eval_tasks``, before any work: the option, a causal LM (``settings.model``, or the
    recipe's default model when None: an encoder for prune and compress, SmolLM2 for linearize), lm-eval, each
    task's name and its data (:func:`load_tasks`; the measure step loads them again, from lm-eval's cached index
    and 🤗 datasets' cache)."""
    from headkit.runs.models import CAUSAL_LM, model_kind

    if settings.eval_include_path is not None and not settings.eval_tasks:
        raise HeadkitError("--eval-include-path holds tasks for --eval-tasks: add --eval-tasks")
    if not settings.eval_tasks:
        return
    kind = CAUSAL_LM if default_is_causal_lm else None
    if settings.model is not None:
        try:
            kind = model_kind(settings.model)
        except HeadkitError:  # not a model: the recipe's own check says so, in its words
            kind = CAUSAL_LM
    if kind != CAUSAL_LM:
        raise HeadkitError(ENCODER_TASKS_ERROR)
    load_tasks(recipe_task_settings(settings))


def recipe_tasks(
    settings: Any,
    original: nn.Module,
    result: nn.Module,
    tokenizer: Any,
    name: str,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """A recipe's measure step on its ``eval_tasks``: the original and the result (`name`: "pruned",
    "linearized", "compressed") on the same examples, and the result's difference from the original — what the
    report holds under ``tasks`` (:func:`measure_tasks`)."""
    return measure_tasks(
        {"original": (original, tokenizer), name: (result, tokenizer)},
        recipe_task_settings(settings),
        reference="original",
        echo=echo,
    )


def with_task_table(text: str, report: dict[str, Any]) -> str:
    """A recipe's printed report `text`, followed by its task table when it measured tasks."""
    return text if not report.get("tasks") else f"{text}\n{format_task_table(report['tasks']).rstrip()}"


# -- checks, before anything loads ---------------------------------------------------------------------------------


def require_lm_eval() -> str:
    """lm-eval's version; a one-line HeadkitError saying how to install it when it is missing or too old."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise HeadkitError(f"task evaluation needs lm-eval, which is not installed: {INSTALL_HINT}") from None
    from packaging.version import Version

    version = importlib.metadata.version("lm_eval")
    if Version(version) < Version(MIN_LM_EVAL):
        raise HeadkitError(
            f"task evaluation needs lm-eval ≥ {MIN_LM_EVAL} (transformers 5), found {version}: {INSTALL_HINT}"
        )
    return version


def check_task_settings(settings: TaskSettings) -> None:
    """The checks that need neither a model nor a task's data: each a one-line error naming its option."""
    tasks_option = settings.option("tasks")
    names = settings.tasks
    if isinstance(names, str) or not isinstance(names, (tuple, list)) or not names:
        raise HeadkitError(f"{tasks_option} must name at least one task, got {names!r}")
    if any(not isinstance(name, str) or not name.strip() or "," in name for name in names):
        raise HeadkitError(f"{tasks_option} must be comma-separated task names, got {list(names)!r}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise HeadkitError(f"{tasks_option} names {', '.join(repeated)} more than once")
    for name, minimum in (("num_fewshot", 0), ("limit", 1), ("batch_size", 1)):
        value = getattr(settings, name)
        if value is None and name != "batch_size":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a non-negative integer" if minimum == 0 else "a positive integer"
            raise HeadkitError(f"{settings.option(name)} must be {kind}, got {value!r}")
    if settings.include_path is not None and not Path(settings.include_path).is_dir():
        what = "is not a folder" if Path(settings.include_path).exists() else "does not exist"
        raise HeadkitError(
            f"{settings.option('include_path')} {str(settings.include_path)!r} {what} (a folder of task YAML files)"
        )
    require_lm_eval()


# -- the tasks and their data --------------------------------------------------------------------------------------


@dataclass
class LoadedTasks:
    """The tasks of :class:`TaskSettings` built by lm-eval, their data loaded: what :func:`run_tasks` evaluates.

    ``objects`` are lm-eval's Task and Group objects, one entry per name asked for (a group keeps its children, so
    lm-eval aggregates it); each run builds its requests afresh and reseeds the few-shot sampler, so one
    :class:`LoadedTasks` serves every model of a comparison, which therefore sees the same examples.
    ``manager``: a TaskManager that built them (simple_evaluate takes built tasks through one)."""

    settings: TaskSettings
    manager: Any  # lm_eval.tasks.TaskManager
    objects: list[Any]


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval logs a warning for each metric a task leaves at its default, and for a model handed over already
    loaded — the very thing headkit does: noise around headkit's own lines. Errors still show; LMEVAL_LOG_LEVEL,
    lm-eval's own switch, is honoured when set."""
    logger = logging.getLogger("lm_eval")
    previous = logger.level
    if not os.environ.get("LMEVAL_LOG_LEVEL"):
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


@contextlib.contextmanager
def _no_dataset_bars() -> Iterator[None]:
    """🤗 datasets' progress bars off while tasks load (a local file loads in an instant; a bar before an error
    would make it more than one line), then as they were."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _folder_signature(folder: Path | None) -> tuple:
    """What the task index of `folder` depends on: each YAML file's path, size and modification time."""
    if folder is None:
        return ()
    return tuple(
        (str(path), stat.st_size, stat.st_mtime_ns)
        for path in sorted(folder.rglob("*.yaml"))
        for stat in [path.stat()]
    )


@functools.lru_cache(maxsize=8)
def _folder_tasks(folder: str, signature: tuple) -> Any:
    # A recipe's check and its measure step share one index of the folder; `signature` makes a changed folder a
    # new one.
    from lm_eval.tasks import TaskManager

    with quiet_lm_eval():
        return TaskManager(include_path=folder, include_defaults=False)


@functools.cache
def _built_in_tasks() -> Any:
    """lm-eval's own tasks, indexed once per process (~15,000 YAML files: seconds), and only when a name is not
    in --include-path."""
    from lm_eval.tasks import TaskManager

    with quiet_lm_eval():
        return TaskManager()


def load_tasks(settings: TaskSettings) -> LoadedTasks:
    """Build every task of `settings` and load its data, before any model: an unknown name, data that is not
    on this machine with the hub offline, or a task lm-eval cannot build each fail here in one line naming the
    task (:class:`~headkit.errors.HeadkitError`).

    A name found in the --include-path folder is built from the folder alone (it shadows a built-in task of the
    same name, as in lm-eval), so a run on local tasks never indexes lm-eval's built-in ones; any other name is
    looked up among those. (A group in the folder is therefore made of the folder's tasks: name built-in tasks
    in --tasks itself.)"""
    check_task_settings(settings)
    folder = None if settings.include_path is None else Path(settings.include_path).resolve()
    signature = _folder_signature(folder)
    local = None if folder is None else _folder_tasks(str(folder), signature)
    chosen = {}
    for name in settings.tasks:
        if local is not None and (name in local.all_tasks or _is_task_file(name)):
            chosen[name] = local
        elif name in _built_in_tasks().all_tasks or _is_task_file(name):
            chosen[name] = _built_in_tasks()
        else:
            raise HeadkitError(_unknown_task(name, [local, _built_in_tasks()], settings))
    objects = []
    with quiet_lm_eval(), _no_dataset_bars():
        for name, manager in chosen.items():
            try:
                built = manager.load([name])
            except Exception as exc:  # lm-eval and datasets raise anything from KeyError to ConnectionError
                raise HeadkitError(_unloadable_task(name, exc, settings)) from None
            groups = built.get("groups") or {}
            objects += [groups[name]] if name in groups else list(built["tasks"].values())
    return LoadedTasks(settings, next(iter(chosen.values())), objects)


def _is_task_file(name: str) -> bool:
    # lm-eval also takes the path of a task's YAML file for its name.
    return name.endswith((".yaml", ".yml")) and Path(name).is_file()


def _unknown_task(name: str, managers: list[Any], settings: TaskSettings) -> str:
    where = "lm-eval's tasks, groups and tags"
    if settings.include_path is not None:
        # lm-eval skips, silently, a YAML file it cannot parse: say so, it is the likely cause.
        where += (
            f" nor in {settings.option('include_path')} {str(settings.include_path)!r} (a YAML file lm-eval "
            "cannot parse is skipped)"
        )
    names = sorted({task for manager in managers if manager is not None for task in manager.all_tasks})
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"{settings.option('tasks')}: unknown task {name!r}: not among {where}{hint}"


def hub_offline() -> bool:
    """Whether 🤗 datasets may not download (HF_HUB_OFFLINE, or HF_DATASETS_OFFLINE which overrides it)."""
    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        value = os.environ.get(variable)
        if value is not None:
            return value.strip().upper() in {"1", "ON", "YES", "TRUE"}
    return False


def _unloadable_task(name: str, exc: BaseException, settings: TaskSettings) -> str:
    option = settings.option("tasks")
    detail = " ".join(str(exc).split()) or type(exc).__name__
    local = (
        f"point {settings.option('include_path')} at a folder with the task's YAML and local data files "
        "(dataset_path: json, dataset_kwargs: data_files)"
    )
    if isinstance(exc, FileNotFoundError):
        return (
            f"{option} {name}: its data files are missing ({detail}); a relative data_files path is read from "
            "the current folder, not the YAML's: give an absolute path"
        )
    if isinstance(exc, ConnectionError) or "OfflineModeIsEnabled" in detail:
        if hub_offline():
            return (
                f"{option} {name}: its data is not on this machine and the hub is offline (HF_HUB_OFFLINE / "
                f"HF_DATASETS_OFFLINE): {local}, or run with the hub online to download it ({detail})"
            )
        return f"{option} {name}: its data could not be downloaded ({detail}): {local}"
    return f"{option} {name}: lm-eval could not build the task ({type(exc).__name__}: {detail})"


# -- running -------------------------------------------------------------------------------------------------------


def special_token_options(tokenizer: Any) -> dict[str, Any]:
    """HFLM's options for how `tokenizer` marks a text's ends.

    lm-eval encodes a context and the context with its continuation and takes the tokens past the first as the
    continuation: right for a tokenizer that adds nothing or a BOS, wrong for one that appends a token (BERT's
    [SEP], an EOS), whose every continuation would lose its first token and end with the appended one. Such a
    tokenizer encodes without special tokens (``add_bos_token=False``). A text with no context starts with
    ``prefix_token_id``, lm-eval's BOS or else EOS; a tokenizer with neither starts with the token it puts
    before any text ([CLS]), as headkit's passkey prompts do."""
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    starts = [i for i in range(len(with_special)) if with_special[i : i + len(plain)] == plain]
    if not plain or not starts:
        return {}
    leading, trailing = with_special[: starts[0]], with_special[starts[0] + len(plain) :]
    options: dict[str, Any] = {}
    if trailing:
        options["add_bos_token"] = False
    if tokenizer.bos_token_id is None and tokenizer.eos_token_id is None and leading:
        options["prefix_token_id"] = leading[-1]
    return options


@contextlib.contextmanager
def _kept_generators_and_mode(model: nn.Module) -> Iterator[None]:
    """lm-eval seeds Python's, NumPy's and torch's global generators and puts the model in evaluation mode:
    both are restored after, so a recipe's later steps draw and train as they would have without tasks."""
    python_state, numpy_state, was_training = random.getstate(), np.random.get_state(), model.training
    try:
        with torch.random.fork_rng():  # the CPU's generator and each CUDA device's
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        model.train(was_training)


def run_tasks(
    model: nn.Module, tokenizer: Any, tasks: LoadedTasks, *, log_samples: bool = False
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of `model` (a causal LM in memory) and `tokenizer` on `tasks`: its result
    dictionary as lm-eval returns it (``results``, ``n-shot``, ``n-samples``, …; per-example ``samples`` with
    `log_samples`). The model is left as it was; lm-eval gets its own copy of the tokenizer, to which it may add
    a pad token."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    settings = tasks.settings
    with quiet_lm_eval(), _kept_generators_and_mode(model):
        lm = HFLM(
            pretrained=model,
            tokenizer=copy.deepcopy(tokenizer),
            batch_size=settings.batch_size,
            # log-probabilities in float32 at least, as headkit's perplexity: a bfloat16 log-softmax rounds
            # choices that differ by less than its 8-bit mantissa to one value.
            softmax_dtype=torch.float32,
            **special_token_options(tokenizer),
        )
        # lm-eval prints some progress ("bootstrapping for stddev") to standard output, where a command writes
        # its table: it joins lm-eval's progress bars on standard error.
        with contextlib.redirect_stdout(sys.stderr):
            results = simple_evaluate(
                model=lm,
                tasks=list(tasks.objects),
                task_manager=tasks.manager,
                num_fewshot=settings.num_fewshot,
                limit=settings.limit,
                log_samples=log_samples,
            )
    for task in _leaf_task_names(tasks):
        metrics = _metrics(results.get("results", {}).get(task, {}))
        if not metrics:  # never a silent zero: a task that scored nothing is an error, not a row of blanks
            raise HeadkitError(f"{settings.option('tasks')} {task}: lm-eval returned no metric for it")
    return results


def _leaf_task_names(tasks: LoadedTasks) -> list[str]:
    names = []
    for item in tasks.objects:
        names += (
            [task.task_name for task in item.get_all_tasks()]
            if hasattr(item, "get_all_tasks")
            else [item.task_name]
        )
    return names


def _metrics(entry: dict[str, Any]) -> list[tuple[str, str]]:
    """(metric, filter) of each score in one task's lm-eval results, in lm-eval's order (stderrs left out)."""
    found = []
    for key, value in entry.items():
        metric, comma, filter_name = key.partition(",")
        if comma and not metric.endswith("_stderr") and _number(value) is not None:
            found.append((metric, filter_name))
    return found


def _number(value: Any) -> float | None:
    """A finite float, or None for what is not one (lm-eval writes "N/A" for a stderr it did not compute)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _json_ready(value: Any) -> Any:
    """`value` as JSON: what lm-eval's own writer makes of a non-serialisable value (a function in a task's
    config), and None for NaN and infinity (report.json refuses them)."""
    from lm_eval.utils import handle_non_serializable

    def clean(item: Any) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            return None
        if isinstance(item, dict):
            return {str(k): clean(v) for k, v in item.items()}
        if isinstance(item, list):
            return [clean(v) for v in item]
        return item

    return clean(json.loads(json.dumps(value, default=handle_non_serializable)))


# What a report keeps of lm-eval's result dictionary: the scores, then what they were measured on (shared by
# every model of a comparison).
SUMMARY_KEYS = ("results", "n-shot", "n-samples", "versions", "higher_is_better", "configs")


def measure_tasks(
    models: dict[str, tuple[nn.Module, Any]],
    settings: TaskSettings,
    *,
    reference: str | None = None,
    tasks: LoadedTasks | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every model of `models` (name → (model, tokenizer)) on the tasks of `settings` (`tasks`: already loaded by
    :func:`load_tasks`), and what a report holds under ``tasks``: lm-eval's version, the settings, lm-eval's
    ``results`` per model, the shared ``n-shot``, ``n-samples``, ``versions``, ``higher_is_better`` and
    ``configs``, ``loglikelihoods`` (per model, :func:`example_loglikelihoods`: the figures behind the scores,
    so that two models can be compared example by example), and ``rows``: one per task and metric, each model's
    value and standard error and, with `reference` (one of the names), each other model's difference from it."""
    version = require_lm_eval()
    tasks = tasks or load_tasks(settings)
    summaries: dict[str, dict[str, Any]] = {}
    for name, (model, tokenizer) in models.items():

        def work(model: nn.Module = model, tokenizer: Any = tokenizer) -> dict[str, Any]:
            result = run_tasks(model, tokenizer, tasks, log_samples=True)
            summary = {key: _json_ready(result.get(key, {})) for key in SUMMARY_KEYS}
            return summary | {"loglikelihoods": example_loglikelihoods(result.get("samples", {}))}

        # Under torchrun / accelerate launch lm-eval answers on local rank 0 only: the main process runs the
        # tasks and the others receive its figures, so every process ends with the same report.
        summaries[name] = on_main_process(work)
        echo(
            f"tasks ({name}): "
            + "; ".join(_score(summaries[name], task) for task in summaries[name]["results"])
        )
    first = next(iter(summaries.values()))
    report: dict[str, Any] = {
        "lm_eval_version": version,
        "settings": settings.to_dict(),
        "reference": reference,
        "results": {name: summary["results"] for name, summary in summaries.items()},
        "loglikelihoods": {name: summary["loglikelihoods"] for name, summary in summaries.items()},
    }
    for key in SUMMARY_KEYS[1:]:
        report[key] = first[key]
    report["rows"] = task_rows(report)
    return report


def example_loglikelihoods(samples: dict[str, list[dict[str, Any]]]) -> dict[str, list[list[float | None]]]:
    """Per task of lm-eval's ``samples`` (``log_samples=True``), each example's log-likelihoods in ``doc_id``
    order: one per request lm-eval scored (a multiple-choice question: one per choice; a log-likelihood or
    rolling-perplexity task: one), None for a non-finite one. A task whose answers are generated text has none.
    """
    found: dict[str, list[list[float | None]]] = {}
    for task, examples in samples.items():
        # resps: per request, lm-eval's answers (one per repeat) — (log-likelihood, greedy) for a loglikelihood
        # request, a float for a rolling one, a string for generated text.
        answers = [
            [resp[0][0] if isinstance(resp[0], (tuple, list)) else resp[0] for resp in example["resps"]]
            for example in sorted(examples, key=lambda example: example["doc_id"])
        ]
        if all(isinstance(value, (int, float)) for row in answers for value in row):
            found[task] = [[_number(value) for value in row] for row in answers]
    return found


def _score(results: dict[str, Any], task: str) -> str:
    entry = results["results"][task]
    parts = []
    for metric, filter_name in _metrics(entry):
        stderr = _number(entry.get(f"{metric}_stderr,{filter_name}"))
        parts.append(
            f"{metric} {entry[f'{metric},{filter_name}']:.4g}"
            + (f" ± {stderr:.2g}" if stderr is not None else "")
        )
    return f"{task} " + ", ".join(parts)


def task_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric of a ``tasks`` report: each model's value and stderr (None where lm-eval has
    none), and with a reference each other model's difference from it."""
    results, reference = report["results"], report.get("reference")
    names = list(results)
    first = results[names[0]]
    rows = []
    for task, entry in first.items():
        for metric, filter_name in _metrics(entry):
            key, stderr_key = f"{metric},{filter_name}", f"{metric}_stderr,{filter_name}"
            row: dict[str, Any] = {
                "task": task,
                "metric": metric if filter_name == "none" else f"{metric} ({filter_name})",
                "higher_is_better": report.get("higher_is_better", {}).get(task, {}).get(metric),
                "samples": (report.get("n-samples", {}).get(task) or {}).get("effective"),
                "n_shot": report.get("n-shot", {}).get(task),
            }
            for name in names:
                values = results[name].get(task, {})
                row[name] = _number(values.get(key))
                row[f"{name}_stderr"] = _number(values.get(stderr_key))
            if reference is not None:
                for name in names:
                    if name != reference and row[name] is not None and row[reference] is not None:
                        row[f"{name}_minus_{reference}"] = row[name] - row[reference]
            rows.append(row)
    return rows


def format_task_table(report: dict[str, Any]) -> str:
    """A ``tasks`` report as a Markdown table: one row per task and metric, each model's value ± its standard
    error, and the difference from the reference."""
    names = list(report["results"])
    reference = report.get("reference")
    others = [name for name in names if name != reference]
    header = ["task", "metric", "n", "shots"] + [f"{name} ± stderr" for name in names]
    header += [f"{name} − {reference}" for name in others] if reference else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def value(row: dict[str, Any], name: str) -> str:
        if row[name] is None:
            return "—"
        stderr = row[f"{name}_stderr"]
        return f"{row[name]:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")

    for row in report["rows"]:
        cells = [row["task"], row["metric"], str(row["samples"] or "—"), str(row["n_shot"])]
        cells += [value(row, name) for name in names]
        if reference:
            cells += [
                f"{row[key]:+.4f}" if (key := f"{name}_minus_{reference}") in row else "—" for name in others
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def task_names(text: str, option: str = "--tasks") -> tuple[str, ...]:
    """A comma-separated list of task names (NAME[,NAME…]) as a tuple."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise HeadkitError(f"{option} must name at least one task, got {text!r}")
    return names


def as_task_names(value: Any, option: str = "--tasks") -> tuple[str, ...]:
    """A settings field of task names as a tuple: a sequence of names, or one comma-separated string (a bare
    string is not split into its letters)."""
    if isinstance(value, str):
        return task_names(value, option) if value.strip() else ()
    return tuple(value or ())
