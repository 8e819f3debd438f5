"""Adapters: per-architecture knowledge of where attention lives in a 🤗 model (see ``API.md``).

Every module of this package is imported here, so an adapter registers itself by existing: adding an
architecture is adding one file.
"""

import importlib
import pkgutil

from headkit.surgery.adapters.base import (
    ADAPTERS,
    AttentionAdapter,
    AttentionSite,
    BiasOnly,
    NoHeads,
    ProjectionWeights,
    check_mask_is_tensor,
    checked_model_mask,
    count_parameters,
    get_adapter,
    linear_parameters,
    new_linear,
    register_adapter,
    supported_architectures,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from headkit.surgery.adapters.albert import AlbertAdapter, ALBERTCollaborativeAdapter  # noqa: E402
from headkit.surgery.adapters.bert import BertAdapter, BERTCollaborativeAdapter  # noqa: E402
from headkit.surgery.adapters.distilbert import DistilBertAdapter, DistilBERTCollaborativeAdapter  # noqa: E402
from headkit.surgery.adapters.gpt2 import GPT2Adapter  # noqa: E402
from headkit.surgery.adapters.llama import LlamaAdapter  # noqa: E402
from headkit.surgery.adapters.roberta import RobertaAdapter  # noqa: E402
from headkit.surgery.adapters.vit import ViTAdapter  # noqa: E402

__all__ = [
    "ADAPTERS",
    "ALBERTCollaborativeAdapter",
    "AlbertAdapter",
    "AttentionAdapter",
    "AttentionSite",
    "BERTCollaborativeAdapter",
    "BertAdapter",
    "BiasOnly",
    "DistilBERTCollaborativeAdapter",
    "DistilBertAdapter",
    "GPT2Adapter",
    "LlamaAdapter",
    "NoHeads",
    "ProjectionWeights",
    "RobertaAdapter",
    "ViTAdapter",
    "check_mask_is_tensor",
    "checked_model_mask",
    "count_parameters",
    "get_adapter",
    "linear_parameters",
    "new_linear",
    "register_adapter",
    "supported_architectures",
]
