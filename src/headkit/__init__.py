"""headkit: engineering attention heads on PyTorch and 🤗 Transformers.

Efficient attention you can train and decode with (softmax, linear, additive, CoCA, collaborative), and
surgery on pretrained models (``headkit.apply_`` with one config per operation: pruning, gates, collaborative
heads, latent keys/values, linearization).

Importing headkit registers its own model type with the transformers Auto classes (:mod:`headkit.models`; the
console script defers it to the paths that read a checkpoint); the other names below are imported when first used
(PEP 562). The ``headkit`` command lists its commands without
importing the package at all (the console script is :mod:`headkit_entry`).
"""

import importlib
import sys
from collections.abc import Callable
from types import ModuleType

from headkit import logs  # noqa: F401  (first: quiets torchao's import-time noise before transformers loads it)
from headkit.errors import HeadkitError
from headkit.lazy import lazy_names

# Registers model_type "headkit" with the transformers Auto classes: eager for every ``import headkit``, except
# under the ``headkit`` console script (:mod:`headkit_entry`, which says so before importing the package), whose
# refusals of a bad option must not pay seconds of model code first; there every path that reads a checkpoint
# imports headkit.models itself (headkit.runs.models, headkit.surgery.io).
if not getattr(sys.modules.get("headkit_entry"), "defer_models", False):
    from headkit import models  # noqa: F401

__version__ = "0.1.0"

# Where each public name lives: a literal import per module, so that the import graph (tests/test_layout.py) sees
# every edge the package root can take.
_MODULES: dict[tuple[str, ...], Callable[[], ModuleType]] = {
    ("apply_",): lambda: importlib.import_module("headkit.surgery.apply"),
    ("CollaborativeConfig", "swap_to_collaborative"): lambda: importlib.import_module(
        "headkit.surgery.collaborative"
    ),
    ("GateConfig", "add_head_gates", "l0_penalty", "remove_head_gates"): lambda: importlib.import_module(
        "headkit.surgery.gating"
    ),
    ("LatentKVConfig",): lambda: importlib.import_module("headkit.surgery.latent"),
    ("CompressedCacheConfig",): lambda: importlib.import_module("headkit.surgery.compressed_cache"),
    ("QuantizedKVConfig",): lambda: importlib.import_module("headkit.surgery.quantized_cache"),
    ("LinearizeConfig", "linearize"): lambda: importlib.import_module("headkit.surgery.linearize"),
    ("PruneConfig", "prune_dead_heads", "prune_heads"): lambda: importlib.import_module(
        "headkit.surgery.pruning"
    ),
    ("from_pretrained",): lambda: importlib.import_module("headkit.surgery.io"),
    ("decompose_query_key",): lambda: importlib.import_module("headkit.surgery.decompose"),
    (
        "ALBERTCollaborativeAdapter",
        "BERTCollaborativeAdapter",
        "DistilBERTCollaborativeAdapter",
    ): lambda: importlib.import_module("headkit.surgery.adapters"),
    (
        "HeadkitConfig",
        "HeadkitForCausalLM",
        "HeadkitForSequenceClassification",
        "HeadkitModel",
    ): lambda: importlib.import_module("headkit.models"),
    ("HardConcreteGate",): lambda: importlib.import_module("headkit.layers.gates"),
    ("head_importance",): lambda: importlib.import_module("headkit.analysis.importance"),
    ("FastDecoder", "fast_generate"): lambda: importlib.import_module("headkit.runtime.fast"),
}
# The subpackages, as attributes (``headkit.surgery.bytes_per_token``) without importing them first.
_SUBPACKAGES: dict[str, Callable[[], ModuleType]] = {
    "ops": lambda: importlib.import_module("headkit.ops"),
    "layers": lambda: importlib.import_module("headkit.layers"),
    "models": lambda: importlib.import_module("headkit.models"),
    "surgery": lambda: importlib.import_module("headkit.surgery"),
    "analysis": lambda: importlib.import_module("headkit.analysis"),
    "runs": lambda: importlib.import_module("headkit.runs"),
    "evaluation": lambda: importlib.import_module("headkit.evaluation"),
    "runtime": lambda: importlib.import_module("headkit.runtime"),
    "export": lambda: importlib.import_module("headkit.export"),
    "recipes": lambda: importlib.import_module("headkit.recipes"),
}
_WHERE = {name: load for names, load in _MODULES.items() for name in names}

__all__ = ["HeadkitError", "__version__", *_WHERE]


__getattr__, __dir__ = lazy_names(globals(), _WHERE, _SUBPACKAGES)
