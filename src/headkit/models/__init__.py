"""🤗-native headkit models, registered with the transformers Auto classes on import.

After ``import headkit``, ``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` and
``AutoModelForSequenceClassification`` know ``model_type="headkit"``, so ``save_pretrained`` /
``from_pretrained`` round-trip through the Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from headkit.models.configuration_headkit import HeadkitConfig
from headkit.models.fastformer import FastformerForCausalLM, FastformerLMConfig
from headkit.models.modeling_headkit import (
    HeadkitForCausalLM,
    HeadkitForSequenceClassification,
    HeadkitModel,
    HeadkitPreTrainedModel,
    causal_lm_loss,
)

AutoConfig.register(HeadkitConfig.model_type, HeadkitConfig, exist_ok=True)
AutoModel.register(HeadkitConfig, HeadkitModel, exist_ok=True)
AutoModelForCausalLM.register(HeadkitConfig, HeadkitForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(HeadkitConfig, HeadkitForSequenceClassification, exist_ok=True)

__all__ = [
    "FastformerForCausalLM",
    "FastformerLMConfig",
    "HeadkitConfig",
    "HeadkitForCausalLM",
    "HeadkitForSequenceClassification",
    "HeadkitModel",
    "HeadkitPreTrainedModel",
    "causal_lm_loss",
]
