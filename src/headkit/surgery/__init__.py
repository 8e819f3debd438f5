"""headkit.surgery: rewrite the attention of pretrained 🤗 models.

- :mod:`headkit.surgery.adapters`: where attention lives in each architecture (shared by every surgery).
- :mod:`headkit.surgery.decompose`: CP decomposition of query/key projections into shared ones.
- :mod:`headkit.surgery.collaborative`: swap attention modules for collaborative heads.
- :mod:`headkit.surgery.linearize`: softmax → sliding-window + linear attention in causal LMs (LoLCATs;
  :func:`headkit.linearize`, not re-exported here so that the module keeps its name).
- :mod:`headkit.surgery.records`: record surgery in the config (each op registers how to re-apply it).
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
from headkit.surgery.collaborative import CollaborativeHeads, SwapReport, swap_to_collaborative
from headkit.surgery.decompose import decompose_query_key
from headkit.surgery.io import from_pretrained
from headkit.surgery.linearize import LinearizedHeads, LinearizeReport
from headkit.surgery.records import record_surgery, register_surgery_op

__all__ = [
    "ALBERTCollaborativeAdapter",
    "AttentionAdapter",
    "AttentionSite",
    "BERTCollaborativeAdapter",
    "CollaborativeHeads",
    "DistilBERTCollaborativeAdapter",
    "LinearizeReport",
    "LinearizedHeads",
    "ProjectionWeights",
    "SwapReport",
    "decompose_query_key",
    "from_pretrained",
    "get_adapter",
    "record_surgery",
    "register_adapter",
    "register_surgery_op",
    "supported_architectures",
    "swap_to_collaborative",
]
