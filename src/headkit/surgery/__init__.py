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

from headkit.surgery.adapters import (
    ALBERTCollaborativeAdapter,
    AttentionAdapter,
    AttentionSite,
    BERTCollaborativeAdapter,
    DistilBERTCollaborativeAdapter,
    ProjectionWeights,
    get_adapter,
    register_adapter,
    supported_architectures,
)
from headkit.surgery.apply import apply_, bytes_per_token
from headkit.surgery.collaborative import (
    CollaborativeConfig,
    CollaborativeHeads,
    SwapReport,
    swap_to_collaborative,
)
from headkit.surgery.compressed_cache import CompressedCacheConfig
from headkit.surgery.decompose import decompose_query_key
from headkit.surgery.gating import GateConfig, add_head_gates, l0_penalty, remove_head_gates
from headkit.surgery.io import from_pretrained
from headkit.surgery.latent import LatentKVConfig, LatentReport, compress_kv_to_latent
from headkit.surgery.linearize import LinearizeConfig, LinearizedHeads, LinearizeReport, reconfigure
from headkit.surgery.pruning import PruneConfig, prune_dead_heads, prune_heads
from headkit.surgery.quantized_cache import QuantizedKVConfig
from headkit.surgery.records import SurgeryConfig, record_surgery, recorded_configs, register_surgery_op
from headkit.surgery.repair import output_statistics, reconstruct_attention, refit_output_projections

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
