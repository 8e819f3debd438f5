"""What the pruning recipe's steps share for both kinds of model (:class:`PruneSteps`): the checks of the loaded
model, the kept count and the GGUF export extra. :class:`headkit.recipes.prune_causal.CausalLMPruneSteps` and
:class:`headkit.recipes.prune_encoder.EncoderPruneSteps` build on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from headkit.export.gguf import export_gguf
from headkit.recipes.prune_settings import target_heads
from headkit.recipes.steps import Steps
from headkit.surgery.adapters import get_adapter
from headkit.surgery.families import PRUNE, get_family
from headkit.surgery.pruning import check_prunable, heads_per_layer


class PruneSteps(Steps):
    """What both kinds of model share: the checks of the loaded model, the kept count and the export extra."""

    result_name = "pruned"

    def check(self) -> None:
        if self.loaded.is_causal_lm:  # an unsupported decoder family fails here, in one line, before any work
            get_family(self.teacher, PRUNE)
        self.adapter = get_adapter(self.teacher)  # so does any other unsupported architecture
        check_prunable(self.adapter.sites(self.teacher))  # so does a layer that earlier surgery replaced
        self.heads_before = heads_per_layer(self.teacher, self.adapter)
        self.keep = target_heads(sum(self.heads_before.values()), self.settings)

    def extras(self) -> list[Callable[[Path, dict[str, Any]], None]]:
        settings, model_path = self.settings, self.model_path
        if settings.export_gguf is None:
            return []

        # Inside the staging: a failed export leaves no folder either.
        def export(staging: Path, report: dict[str, Any]) -> None:
            report["gguf"] = export_gguf(
                self.student,
                settings.export_gguf,
                type=settings.export_type,
                overwrite=settings.overwrite,
                tokenizer=self.tokenizer,
                tokenizer_from=model_path if model_path.is_file() else None,
            ).to_dict()
            self.echo(f"wrote {settings.export_gguf} ({report['gguf']['arch']}, {settings.export_type})")

        return [export]


__all__ = [
    "PruneSteps",
]
