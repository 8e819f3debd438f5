"""headkit.surgery: rewrite the attention of pretrained 🤗 models.

- :mod:`headkit.surgery.adapters`: where attention lives in each architecture (shared by every surgery).
- :mod:`headkit.surgery.decompose`: CP decomposition of query/key projections into shared ones.
- :mod:`headkit.surgery.collaborative`: swap attention modules for collaborative heads
  (:func:`swap_to_collaborative` with a :class:`CollaborativeConfig`).
- :mod:`headkit.surgery.linearize`: softmax → sliding-window + linear attention in causal LMs (LoLCATs;
  :func:`headkit.linearize` with a :class:`LinearizeConfig`; the function is not re-exported here so that the
  module keeps its name).
- :mod:`headkit.surgery.latent`: latent keys/values in rotary decoders (MHA2MLA; :func:`compress_kv_to_latent`
  with a :class:`LatentKVConfig`); the mechanism and its cache in :mod:`headkit.surgery.latent_heads`, the
  calibration and factorization in :mod:`headkit.surgery.latent_fit`.
- :mod:`headkit.surgery.gating`, :mod:`headkit.surgery.pruning`: Hard Concrete head gates and physical head
  removal (:func:`add_head_gates` with a :class:`GateConfig`, :func:`prune_heads` with a :class:`PruneConfig`).
- :mod:`headkit.surgery.records`: record surgery in the config (each op registers how to re-apply it), the protocol
  every surgery's config implements (:class:`SurgeryConfig`).
- :mod:`headkit.surgery.apply`: :func:`apply_`, one entry point for every config (or a list of them, in order).
- :mod:`headkit.surgery.io`: reload saved models, surgery re-applied (:func:`from_pretrained`).
"""

import importlib
from collections.abc import Callable
from types import ModuleType

from headkit.lazy import lazy_names

# Where each name lives, imported when first used (PEP 562): importing one module of the package (a config, a
# settings class) loads no more than it needs. A literal import per module, so that the import graph
# (tests/test_layout.py) sees every edge.
_MODULES: dict[tuple[str, ...], Callable[[], ModuleType]] = {
    (
        "ALBERTCollaborativeAdapter",
        "AttentionAdapter",
        "AttentionSite",
        "BERTCollaborativeAdapter",
        "DistilBERTCollaborativeAdapter",
        "ProjectionWeights",
        "get_adapter",
        "register_adapter",
        "supported_architectures",
    ): lambda: importlib.import_module("headkit.surgery.adapters"),
    ("apply_", "bytes_per_token"): lambda: importlib.import_module("headkit.surgery.apply"),
    ("CollaborativeConfig", "CollaborativeHeads", "SwapReport", "swap_to_collaborative"): lambda: (
        importlib.import_module("headkit.surgery.collaborative")
    ),
    ("CompressedCacheConfig",): lambda: importlib.import_module("headkit.surgery.compressed_cache"),
    ("decompose_query_key",): lambda: importlib.import_module("headkit.surgery.decompose"),
    ("GateConfig", "add_head_gates", "l0_penalty", "remove_head_gates"): lambda: importlib.import_module(
        "headkit.surgery.gating"
    ),
    ("from_pretrained",): lambda: importlib.import_module("headkit.surgery.io"),
    ("LatentKVConfig", "LatentReport", "compress_kv_to_latent"): lambda: importlib.import_module(
        "headkit.surgery.latent"
    ),
    ("LinearizeConfig", "LinearizedHeads", "LinearizeReport", "reconfigure"): lambda: importlib.import_module(
        "headkit.surgery.linearize"
    ),
    ("PruneConfig", "prune_dead_heads", "prune_heads"): lambda: importlib.import_module(
        "headkit.surgery.pruning"
    ),
    ("QuantizedKVConfig",): lambda: importlib.import_module("headkit.surgery.quantized_cache"),
    ("SurgeryConfig", "record_surgery", "recorded_configs", "register_surgery_op"): lambda: (
        importlib.import_module("headkit.surgery.records")
    ),
    ("output_statistics", "reconstruct_attention", "refit_output_projections"): lambda: (
        importlib.import_module("headkit.surgery.repair")
    ),
}
_WHERE = {name: load for names, load in _MODULES.items() for name in names}

__all__ = [
    "ALBERTCollaborativeAdapter",
    "AttentionAdapter",
    "AttentionSite",
    "BERTCollaborativeAdapter",
    "CollaborativeConfig",
    "CompressedCacheConfig",
    "CollaborativeHeads",
    "DistilBERTCollaborativeAdapter",
    "GateConfig",
    "LatentKVConfig",
    "LatentReport",
    "LinearizeConfig",
    "LinearizeReport",
    "reconfigure",
    "LinearizedHeads",
    "ProjectionWeights",
    "PruneConfig",
    "QuantizedKVConfig",
    "SurgeryConfig",
    "SwapReport",
    "apply_",
    "bytes_per_token",
    "recorded_configs",
    "add_head_gates",
    "compress_kv_to_latent",
    "decompose_query_key",
    "from_pretrained",
    "get_adapter",
    "l0_penalty",
    "output_statistics",
    "prune_dead_heads",
    "prune_heads",
    "reconstruct_attention",
    "record_surgery",
    "refit_output_projections",
    "register_adapter",
    "register_surgery_op",
    "remove_head_gates",
    "supported_architectures",
    "swap_to_collaborative",
]


__getattr__, __dir__ = lazy_names(globals(), _WHERE)
