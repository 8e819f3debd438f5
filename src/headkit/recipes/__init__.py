"""headkit.recipes: end-to-end workflows on pretrained models, as a library API (what the CLI commands run).

- :func:`train_loop`: the one training loop of the library, on 🤗 ``Trainer`` (DDP/FSDP-ready): recovery,
  head gates, ``headkit train`` and the from-scratch benchmarks all run through it.
- :func:`distill`: teacher → student distillation on that loop — every recovery (optional LoRA through PEFT
  merged afterwards), with the objectives of :mod:`headkit.runs.objectives`.
- :func:`train_gates_to_budget`: Hard Concrete head gates trained to a head budget under the L0 constraint.
- :func:`prune`: choose heads (importance or L0 gates), remove them physically (GQA-aware, optionally to the
  stock architecture), recover by distillation, report and save.
- :func:`compress`: collaborative heads at a shared query/key width, distilled and reported.

What they stand on — loading a model, text and windows, the objectives, the main-process helpers — is
:mod:`headkit.runs`, beneath the recipes and the measurements alike.
"""

import importlib
from collections.abc import Callable
from types import ModuleType

from headkit.lazy import lazy_names

# Where each name lives, imported when first used (PEP 562): importing one module of the package (a config, a
# settings class) loads no more than it needs. A literal import per module, so that the import graph
# (tests/test_layout.py) sees every edge.
_MODULES: dict[tuple[str, ...], Callable[[], ModuleType]] = {
    ("CompressResult", "CompressSettings", "compress"): lambda: importlib.import_module(
        "headkit.recipes.compress"
    ),
    ("DistillResult", "distill", "lora_target_modules", "split_batches"): lambda: importlib.import_module(
        "headkit.recipes.distill"
    ),
    ("GateTrainingLog", "train_gates_to_budget"): lambda: importlib.import_module("headkit.recipes.gates"),
    ("LoopResult", "train_loop"): lambda: importlib.import_module("headkit.recipes.loop"),
    ("PruneResult", "PruneSettings", "prune"): lambda: importlib.import_module("headkit.recipes.prune"),
    ("plan_pruning",): lambda: importlib.import_module("headkit.recipes.prune_plan"),
}
_WHERE = {name: load for names, load in _MODULES.items() for name in names}

__all__ = [
    "CompressResult",
    "CompressSettings",
    "DistillResult",
    "GateTrainingLog",
    "LoopResult",
    "PruneResult",
    "PruneSettings",
    "compress",
    "distill",
    "lora_target_modules",
    "plan_pruning",
    "prune",
    "split_batches",
    "train_gates_to_budget",
    "train_loop",
]


__getattr__, __dir__ = lazy_names(globals(), _WHERE)
