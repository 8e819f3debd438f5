"""The original model with a compressed key/value cache, no training: attention sinks, a window, keys chosen by
the question, and retrieval heads with a full cache.

Each converted layer keeps, per key/value head, the first ``sinks`` tokens (StreamingLLM, Xiao et al. 2024), the
last ``window`` tokens, and ``budget`` more keys chosen when a prompt is prefilled: those its last
``observation`` queries attend to most (SnapKV, Li et al. 2024, §4: the votes of an observation window, pooled).
Every other key is dropped. ``retrieval_heads`` — (layer, key/value head) pairs, e.g. the highest of
:func:`headkit.analysis.retrieval.retrieval_head_scores` — keep their whole cache (DuoAttention, Xiao et al.
2025). Nothing is trained: the mechanism is the linearized layer's with nothing folded into a linear state
(:class:`headkit.surgery.linearize.LinearizedHeads` with ``fold=False``: no feature maps), so the fast decoder
runs it as it runs a linearized model.

``selection="reconstruction"`` chooses the budget's keys before any question instead: those the model reads most
to repeat the prompt after ``reconstruction_prompt`` (KVzip, Kim et al. 2025; :mod:`headkit.surgery.reconstruction`),
so that a second turn asking about something else finds it kept — at the cost of a scoring forward over the
prompt repeated, before each prefill.

``headkit.apply_(model, CompressedCacheConfig(window=256, sinks=4, budget=128))`` converts, and records the op
``compressed_cache`` so :func:`headkit.from_pretrained` rebuilds it; it composes after pruning
(``[PruneConfig(...), CompressedCacheConfig(...)]``).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from torch import nn

from headkit.errors import HeadkitError
from headkit.ops.key_selection import QUESTION, RECONSTRUCTION
from headkit.surgery.adapters import AttentionAdapter
from headkit.surgery.gating import config_head_dim, kv_head_counts, parse_head_pairs
from headkit.surgery.linearize import SURGERY_OP as LINEARIZE_OP
from headkit.surgery.linearize import LinearizeConfig, LinearizeReport, sliding_layers
from headkit.surgery.reconstruction import attach_reconstruction_prefill
from headkit.surgery.records import (
    SURGERY_KEY,
    SURGERY_OPS,
    conversion_of,
    fields_of_record,
    register_conversion,
)

SURGERY_OP = "compressed_cache"
# What the linearized layer's record holds beside its config's fields: the sites and rotary pairs it resolved.
RESOLVED = ("adapter", "layers", "sites", "unrotated_pairs", "rotary_pairs")
# How the budget's keys can be chosen without a linear state to recall them.
COMPRESSED_SELECTIONS = (QUESTION, RECONSTRUCTION)


class LayerTokens(NamedTuple):
    """One layer's cache in :meth:`CompressedCacheConfig.layer_tokens`."""

    kv_heads: int
    tokens: int  # kept, summed over the key/value heads
    compressed: bool
    retrieval_heads: int = 0  # of the compressed layer's key/value heads, those that keep their whole cache


@dataclass(frozen=True)
class CompressedCacheConfig:
    """How :func:`headkit.apply_` compresses a model's key/value cache: the one declaration of each option.

    Attributes:
        window: W ≥ 1, the last tokens every query sees (its own included).
        sinks: S ≥ 0, the first tokens of a sequence, kept.
        budget: B ≥ 0, keys kept beyond the window per layer and key/value head, chosen by the question.
        observation: the queries at the end of a prompt whose attention chooses the budget's keys (selection
            "question"; with "reconstruction", those of a later turn's tokens appended to a cache).
        selection: "question" (SnapKV: the prompt's last queries choose) or "reconstruction" (KVzip: the queries
            of the prompt repeated after ``reconstruction_prompt`` choose, before any question).
        reconstruction_prompt: the token ids of the request to repeat the prompt, between the prompt and its
            repetition (selection "reconstruction"; empty: the repetition follows the prompt directly).
        retrieval_heads: (layer, key/value head) pairs that keep their whole cache.
        layers: the layer indices whose cache is compressed; None: every global-attention layer.
    """

    # Each field's metadata makes it a command-line option where a command takes this config's fields.
    window: int = field(default=256, metadata={"help": "Last tokens every query sees, its own included."})
    sinks: int = field(default=4, metadata={"help": "First tokens of a sequence kept (attention sinks)."})
    budget: int = field(
        default=128,
        metadata={
            "help": "Keys kept beyond the window per layer and key/value head, chosen by the prompt's last "
            "--observation queries (SnapKV)."
        },
    )
    observation: int = field(
        default=32, metadata={"help": "Queries at the end of a prompt that choose the budget's keys."}
    )
    selection: str = field(
        default=QUESTION,
        metadata={
            "help": "How the budget's keys are chosen: 'question' (the prompt's last --observation queries, "
            "SnapKV) or 'reconstruction' (those the model reads most to repeat the prompt, before any question: "
            "KVzip; a scoring forward over the prompt repeated first).",
        },
    )
    reconstruction_prompt: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "Token ids of the request to repeat the prompt, between it and its repetition (--selection "
            "reconstruction; `headkit compress` fills it from the tokenizer).",
            "min": 0,
        },
    )
    retrieval_heads: tuple[tuple[int, int], ...] = field(
        default=(),
        metadata={
            "help": "Key/value heads that keep their whole cache, as layer:head pairs ('3:0,7:2').",
            "parse": parse_head_pairs,
        },
    )
    layers: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "Comma-separated layer indices to compress (default: all global-attention layers).",
            "min": 0,
        },
    )

    def __post_init__(self) -> None:
        if self.selection not in COMPRESSED_SELECTIONS:
            raise HeadkitError(
                f"selection must be one of {', '.join(COMPRESSED_SELECTIONS)}, got {self.selection!r}"
            )
        prompt = self.reconstruction_prompt
        if not isinstance(prompt, (tuple, list)) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in prompt
        ):
            raise HeadkitError(
                f"reconstruction_prompt must be token ids (non-negative integers), got {prompt!r}"
            )
        object.__setattr__(self, "reconstruction_prompt", tuple(prompt))
        # The equivalent linearized layer's config checks the types and ranges, named by these fields.
        linear = self.linearize_config()
        object.__setattr__(self, "retrieval_heads", linear.retrieval_heads)
        object.__setattr__(self, "layers", linear.layers)

    def linearize_config(self) -> LinearizeConfig:
        """The mechanism this cache is: the linearized layer's, nothing folded (a :class:`LinearizeConfig`)."""
        return LinearizeConfig(
            window=self.window, sinks=self.sinks, budget=self.budget, selection=self.selection,
            observation=self.observation, fold=False, retrieval_heads=self.retrieval_heads, layers=self.layers,
        )  # fmt: skip

    def check(self, model_or_config: Any) -> None:
        """What a model, or its 🤗 config, answers before any work: the window, budget and observation within its
        context, the layers and retrieval heads it has."""
        self.linearize_config().check(model_or_config)

    def record(self) -> dict[str, Any]:
        """The fields as JSON."""
        return asdict(self) | {
            "retrieval_heads": [list(pair) for pair in self.retrieval_heads],
            "reconstruction_prompt": list(self.reconstruction_prompt),
            "layers": None if self.layers is None else list(self.layers),
        }

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> CompressedCacheConfig:
        """The config a record was written from."""
        return cls(**fields_of_record(cls, entry))

    def layer_tokens(self, config: Any, context: int = 8192) -> list[LayerTokens] | None:
        """Per layer of a model with the 🤗 `config` (the pruning it records applied), after `context` tokens: its
        key/value heads, the tokens their cache keeps summed over them, and whether it is compressed — a compressed
        head keeps its S sinks, W − 1 window tokens (the query's own key is the W-th) and B chosen keys (at most
        the context), a retrieval head the whole context; a layer left alone its own cache (a sliding layer its
        window's W − 1 past tokens). None where the config does not state its heads."""
        counts, head_dim = kv_head_counts(config), config_head_dim(config)
        if counts is None or head_dim is None:
            return None
        compressed = set(self.linearize_config().layers_to_convert(config, len(counts)))
        sliding = set(sliding_layers(config, len(counts)))
        # transformers' sliding layer, like the window ring, keeps the window's W − 1 past tokens
        window = (getattr(config, "sliding_window", None) or context + 1) - 1
        kept = min(context, self.sinks + self.window - 1 + self.budget)
        layers = []
        for layer, kv_heads in enumerate(counts):
            if layer in compressed:
                exact = sum(1 for pair_layer, _ in self.retrieval_heads if pair_layer == layer)
                layers.append(LayerTokens(kv_heads, (kv_heads - exact) * kept + exact * context, True, exact))
            else:
                tokens = min(context, window) if layer in sliding else context
                layers.append(LayerTokens(kv_heads, kv_heads * tokens, False))
        return layers

    def bytes_per_token(self, config: Any, *, bytes_per_number: int = 2, context: int = 8192) -> float | None:
        """The cache's bytes per token of a `context`-token sequence for a model with the 🤗 `config`: a key and a
        value of head_dim numbers for every token :meth:`layer_tokens` keeps. The mechanism's bookkeeping (slot
        positions, flags: 1.1% of the state on SmolLM2, measured) is not counted."""
        layers, head_dim = self.layer_tokens(config, context), config_head_dim(config)
        if layers is None or head_dim is None:
            return None
        return sum(layer.tokens for layer in layers) * 2 * head_dim * bytes_per_number / context


def _compress_cache(
    model: nn.Module,
    config: CompressedCacheConfig,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> LinearizeReport:
    """:func:`headkit.apply_` of a :class:`CompressedCacheConfig`: each layer's mechanism is the linearized
    layer's with nothing folded; the record is this config's, with what the conversion resolved."""
    mechanism = config.linearize_config()
    report = conversion_of(mechanism).apply(model, mechanism, adapter=adapter)
    if config.selection == RECONSTRUCTION:
        # the linearized layers' conversion attached the scoring forward; the request is this config's
        attach_reconstruction_prefill(model, config.reconstruction_prompt)
    entries = list(getattr(model.config, SURGERY_KEY))
    resolved = entries[-1]
    entries[-1] = (
        {"op": SURGERY_OP} | config.record() | {name: resolved[name] for name in RESOLVED if name in resolved}
    )
    setattr(model.config, SURGERY_KEY, entries)
    return report


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded compressed cache: the linearized layer's replay, from the equivalent record."""
    config = CompressedCacheConfig.from_record(entry)
    equivalent = copy.deepcopy(entry) | config.linearize_config().record() | {"op": LINEARIZE_OP}
    equivalent["layers"] = entry["layers"]  # the layers the conversion resolved
    SURGERY_OPS[LINEARIZE_OP](model, equivalent)
    if config.selection == RECONSTRUCTION:
        attach_reconstruction_prefill(model, config.reconstruction_prompt)


register_conversion(CompressedCacheConfig, SURGERY_OP, _compress_cache, _reapply, replaces_attention=True)

__all__ = ["CompressedCacheConfig", "LayerTokens"]
