"""headkit.recipes: end-to-end workflows on pretrained models, as a library API (what the CLI commands run).

- :func:`distill`: teacher → student distillation on 🤗 ``Trainer`` — the one training loop of every recovery
  (DDP/FSDP-ready, optional LoRA through PEFT merged afterwards), with the objectives of
  :mod:`headkit.recipes.objectives`.
- :func:`prune`: choose heads (importance or L0 gates), remove them physically (GQA-aware, optionally to the
  stock architecture), recover by distillation, report and save.
- :func:`compress`: collaborative heads at a shared query/key width, distilled and reported.
"""

from headkit.recipes.compress import CompressResult, CompressSettings, compress
from headkit.recipes.distill import DistillResult, distill, lora_target_modules, split_batches
from headkit.recipes.models import (
    LoadedModel,
    check_output_folder,
    default_encoder_path,
    load_model,
    model_kind,
)
from headkit.recipes.objectives import CausalLMObjective, EncoderObjective, next_token_kl
from headkit.recipes.prune import PruneResult, PruneSettings, plan_pruning, prune

__all__ = [
    "CausalLMObjective",
    "CompressResult",
    "CompressSettings",
    "DistillResult",
    "EncoderObjective",
    "LoadedModel",
    "PruneResult",
    "PruneSettings",
    "check_output_folder",
    "compress",
    "default_encoder_path",
    "distill",
    "load_model",
    "lora_target_modules",
    "model_kind",
    "next_token_kl",
    "plan_pruning",
    "prune",
    "split_batches",
]
