"""headkit: engineering attention heads on PyTorch and 🤗 Transformers.

Efficient attention you can train and decode with (softmax, linear, additive, CoCA, collaborative), and
surgery on pretrained models (collaborative heads, head gates and pruning).
"""

from headkit import logs  # noqa: F401  (first: quiets torchao's import-time noise before transformers loads it)
from headkit.analysis.importance import head_importance
from headkit.errors import HeadkitError
from headkit.layers.gates import HardConcreteGate
from headkit.models import (  # importing registers model_type "headkit" with the transformers Auto classes
    HeadkitConfig,
    HeadkitForCausalLM,
    HeadkitForSequenceClassification,
    HeadkitModel,
)
from headkit.runtime.fast import FastDecoder, fast_generate
from headkit.surgery.adapters import (
    ALBERTCollaborativeAdapter,
    BERTCollaborativeAdapter,
    DistilBERTCollaborativeAdapter,
)
from headkit.surgery.apply import apply_
from headkit.surgery.collaborative import CollaborativeConfig, swap_to_collaborative
from headkit.surgery.decompose import decompose_query_key
from headkit.surgery.gating import GateConfig, add_head_gates, l0_penalty, remove_head_gates
from headkit.surgery.io import from_pretrained
from headkit.surgery.latent import LatentKVConfig
from headkit.surgery.linearize import LinearizeConfig, linearize
from headkit.surgery.pruning import PruneConfig, prune_dead_heads, prune_heads

__version__ = "0.1.0"

__all__ = ["HeadkitError", "__version__", "apply_"]
__all__ += ["CollaborativeConfig", "GateConfig", "LatentKVConfig", "LinearizeConfig", "PruneConfig"]
__all__ += ["HeadkitConfig", "HeadkitForCausalLM", "HeadkitForSequenceClassification", "HeadkitModel"]
__all__ += ["HardConcreteGate", "add_head_gates", "l0_penalty", "remove_head_gates"]
__all__ += ["head_importance", "prune_dead_heads", "prune_heads"]
__all__ += ["ALBERTCollaborativeAdapter", "BERTCollaborativeAdapter", "DistilBERTCollaborativeAdapter"]
__all__ += ["decompose_query_key", "from_pretrained", "linearize", "swap_to_collaborative"]
__all__ += ["FastDecoder", "fast_generate"]
