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

from headkit.recipes.compress import CompressResult, CompressSettings, compress
from headkit.recipes.distill import DistillResult, distill, lora_target_modules, split_batches
from headkit.recipes.gates import GateTrainingLog, train_gates_to_budget
from headkit.recipes.loop import LoopResult, train_loop
from headkit.recipes.prune import PruneResult, PruneSettings, prune
from headkit.recipes.prune_plan import plan_pruning

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
