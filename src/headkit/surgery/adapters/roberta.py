"""RoBERTa: BERT's attention layout under its own model_type."""

from __future__ import annotations

from headkit.surgery.adapters.base import register_adapter
from headkit.surgery.adapters.bert import BertAdapter


@register_adapter
class RobertaAdapter(BertAdapter):
    name = "roberta"
