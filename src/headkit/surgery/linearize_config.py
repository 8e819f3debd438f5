"""The config of linearization, :class:`LinearizeConfig`, in a module of its own without torch model code: its
fields are command-line options (``headkit linearize``, ``headkit bench linearize``: headkit.runs.options), and
the command line refuses a bad one against a model's 🤗 config (its context, layers, sliding-window layers,
key/value heads) before any model code is imported. The conversion it configures is
:mod:`headkit.surgery.linearize`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from headkit.errors import HeadkitError
from headkit.ops.feature_maps import BUILTIN_LEARNABLE_FEATURE_MAPS, FEATURE_MAPS
from headkit.ops.key_selection import RECONSTRUCTION, SELECTION_NAMES
from headkit.surgery.families import text_config
from headkit.surgery.heads import parse_head_pairs
from headkit.surgery.records import fields_of_record

if TYPE_CHECKING:
    from torch import nn


def valid_feature_map_name(name: Any) -> bool:
    """Whether `name` is a feature map :func:`headkit.layers.build_feature_map` builds: a parameter-free map of
    :data:`headkit.ops.FEATURE_MAPS`, one of headkit's learnable maps, or one registered since (the registry of
    learnable maps, headkit.layers.feature_maps, is imported only for a name outside the first two)."""
    if not isinstance(name, str):
        return False
    if name in FEATURE_MAPS or name in BUILTIN_LEARNABLE_FEATURE_MAPS:
        return True
    from headkit.layers.feature_maps import valid_feature_map_names

    return name in valid_feature_map_names()


def max_context(model: nn.Module | Any) -> int | None:
    """The longest context a model's config (or the config itself) allows (``max_position_embeddings``; GPT-2's
    ``n_positions``)."""
    return _config_context(getattr(model, "config", model))


def sliding_layers(config: Any, count: int) -> list[int]:
    """The layers that attend through a sliding window: ``config.layer_types`` where the config lists them
    (Gemma 2/3, Qwen2, SmolLM3, …), else every layer when ``config.sliding_window`` is set (Mistral). None when
    the window spans the model's whole context (``max_position_embeddings``): such a layer attends globally."""
    window, context = (
        getattr(config, "sliding_window", None),
        getattr(config, "max_position_embeddings", None),
    )
    if isinstance(window, int) and isinstance(context, int) and window >= context:
        return []
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) >= count:
        return [i for i in range(count) if layer_types[i] in ("sliding_attention", "chunked_attention")]
    return list(range(count)) if isinstance(window, int) and window > 0 else []


@dataclass(frozen=True)
class LinearizeConfig:
    """Everything that says how :func:`linearize` converts a model: the one declaration of each option.

    It validates itself when it is built (types and ranges, no model needed) and against a model with
    :meth:`check` (its context, its layers, its sliding-window layers: what the 🤗 config answers, so a recipe
    runs it before any weight or text is loaded). The model's ``config.headkit_surgery`` records it
    (:meth:`record`), and :func:`headkit.from_pretrained` rebuilds the model from that record
    (:meth:`from_record`), records written before a field existed included.

    Attributes:
        window: W ≥ 1, the keys each query sees exactly (its own included), at most the model's context.
        feature_map: the linear term's feature map: a learnable one ("hedgehog") or a fixed one ("elu", …).
        layers: the layer indices to convert; None converts every global-attention layer. Layers not listed keep
            their softmax attention and key/value cache (a hybrid model); sliding-window layers cannot be listed.
        feature_dim: the learnable map's projection width (None: head_dim; Hedgehog then has 2·head_dim features).
        chunk_size: queries per chunk of the parallel form (speed/memory only).
        convert_sliding: convert the sliding-window layers too (by default they keep softmax and their bounded
            cache). Then `layers`, if given, must list every sliding layer: the model builds one mask per layer
            type from one layer's cache entry, so the sliding layers are converted all or none.
        sinks: S ≥ 0, the first S tokens of a sequence kept exact (softmax) in every converted layer once they
            leave the window (attention sinks, StreamingLLM).
        budget: G ≥ 0, exact keys and values kept per layer and key/value head beyond the window, chosen
            online as tokens leave it by how badly the linear state recalls their values (LoLA); the others, and
            those evicted, fold into the linear state (:mod:`headkit.ops.hybrid.sparse`). With S = G = 0 the
            mechanism is the plain window + linear hybrid.
        selection: how the sparse cache's keys are chosen: "recall" (online, LoLA's criterion above) or
            "question" (SnapKV: when a prompt is prefilled, the keys its last `observation` queries attend to
            most; :class:`LinearizedHeads`).
        observation: the queries at the end of a prompt that choose its keys under selection="question".
        fold: False drops the keys that are not kept instead of folding them into a linear state: the original
            model with a compressed key/value cache of the same mechanism (no feature maps, nothing to train) —
            the baseline a linear state must beat at equal bytes.
        retrieval_heads: (layer, key/value head) pairs that keep softmax attention with a full key/value cache
            (retrieval heads, DuoAttention; chosen by :func:`headkit.analysis.retrieval.retrieval_head_scores`);
            their query heads follow them. Their cache grows with the context and counts in the state.
        feature_wavelength: L ≥ 0 tokens. The feature maps of the linear term read the queries and keys with
            every rotary pair whose wavelength 2π/θ_i exceeds L rotated back to angle 0 (the window term keeps
            every rotation). Trained on windows of L tokens, a slow pair's angle covers less than one turn, and
            beyond L the maps would meet angles they never saw: measured on SmolLM2 (docs/linearize.md), that is
            what breaks a model trained at 1,024 tokens at 4,096. The recipe sets L to its training length; 0
            keeps every pair rotated (LoLCATs). A model without rotary embeddings is unaffected.
    """

    # Each field's metadata makes it an option of `headkit linearize` and `headkit bench linearize`
    # (headkit.runs.options): help, and the command line's name and parsing where they are not the default's.
    window: int = field(
        default=64, metadata={"help": "Tokens each query sees exactly through softmax, its own included."}
    )
    feature_map: str = field(
        default="hedgehog",
        metadata={
            "help": "Feature map of the linear term: 'hedgehog' (learnable, default) or a fixed one ('elu', …)."
        },
    )
    layers: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "Comma-separated layer indices to convert (default: all; the others keep softmax).",
            "min": 0,
        },
    )
    feature_dim: int | None = field(
        default=None, metadata={"help": "Learnable feature map's projection width (default head_dim)."}
    )
    chunk_size: int = field(default=64, metadata={"help": "Queries per chunk of the parallel form."})
    convert_sliding: bool = field(
        default=False,
        metadata={
            "help": "Convert sliding-window layers too (default: keep them, their cache is bounded already).",
            "flag": "--convert-sliding/--keep-sliding",
        },
    )
    sinks: int = field(
        default=0,
        metadata={
            "help": "First tokens of a sequence kept exact (attention sinks) in every converted layer."
        },
    )
    budget: int = field(
        default=0,
        metadata={
            "help": "Exact keys kept beyond the window per layer and key/value head, chosen online by how badly "
            "the linear state recalls them (LoLA); the others fold into the linear state.",
            "removed": ("--sparse-cache",),
        },
    )
    selection: str = field(
        default="recall",
        metadata={
            "help": "How the sparse cache's keys are chosen: 'recall' (online, those the linear state recalls "
            "worst; LoLA) or 'question' (when a prompt is prefilled, those its last --observation queries "
            "attend to most; SnapKV)."
        },
    )
    observation: int = field(
        default=32,
        metadata={
            "help": "Queries at the end of a prompt that choose its exact keys (--selection question)."
        },
    )
    fold: bool = field(
        default=True,
        metadata={
            "help": "Fold the keys not kept exact into the linear state; --drop discards them: the original "
            "model with a compressed key/value cache (nothing to train), the baseline at equal bytes.",
            "flag": "--fold/--drop",
        },
    )
    feature_wavelength: int = field(
        default=0,
        metadata={
            "help": "The linear term's feature maps read rotary pairs whose wavelength exceeds this many tokens "
            "rotated back to angle 0, so that positions beyond training show them no angle they were not trained "
            "on (0: every pair as rotated, LoLCATs)."
        },
    )
    retrieval_heads: tuple[tuple[int, int], ...] = field(
        default=(),
        metadata={
            "help": "Key/value heads kept softmax with a full cache, as layer:head pairs ('3:0,7:2'); the "
            "recipe's --retrieval-head-count chooses them instead.",
            "parse": parse_head_pairs,
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.convert_sliding, bool):
            raise HeadkitError(f"convert_sliding must be a bool, got {self.convert_sliding!r}")
        _check_count("window", self.window, 1)
        if not valid_feature_map_name(self.feature_map):
            from headkit.layers.feature_maps import valid_feature_map_names

            raise HeadkitError(
                f"unknown feature map {self.feature_map!r}; valid: {', '.join(valid_feature_map_names())}"
            )
        if self.feature_dim is not None:
            _check_count("feature_dim", self.feature_dim, 1, "a positive integer or None")
        _check_count("chunk_size", self.chunk_size, 1)
        for name in ("sinks", "budget"):
            _check_count(name, getattr(self, name), 0, "a non-negative integer (0: none)")
        if self.selection not in SELECTION_NAMES:
            raise HeadkitError(
                f"selection must be one of {', '.join(SELECTION_NAMES)}, got {self.selection!r}"
            )
        if self.selection == RECONSTRUCTION and self.fold:
            raise HeadkitError(
                "selection 'reconstruction' drops what it does not keep: it needs fold=False (the compressed "
                "cache, CompressedCacheConfig)"
            )
        _check_count("observation", self.observation, 1)
        _check_count("feature_wavelength", self.feature_wavelength, 0, "a non-negative integer (0: off)")
        if not isinstance(self.fold, bool):
            raise HeadkitError(f"fold must be a bool, got {self.fold!r}")
        pairs = []
        for pair in self.retrieval_heads or ():
            if (
                not isinstance(pair, (tuple, list))
                or len(pair) != 2
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in pair)
            ):
                raise HeadkitError(
                    f"retrieval_heads must be (layer, key/value head) pairs of non-negative integers, got {pair!r}"
                )
            pairs.append((pair[0], pair[1]))
        if len(set(pairs)) != len(pairs):
            raise HeadkitError(f"retrieval_heads lists a head twice: {pairs}")
        object.__setattr__(self, "retrieval_heads", tuple(sorted(pairs)))
        if self.layers is not None:
            indices = [self.layers] if isinstance(self.layers, (int, str, bytes)) else list(self.layers)
            if not indices:
                raise HeadkitError("layers must name at least one layer to convert (None converts all)")
            bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int)]
            if bad:  # the range is the model's: check() names it
                raise HeadkitError(f"layers must be layer indices (integers), got {bad}")
            if len(set(indices)) != len(indices):
                raise HeadkitError(f"layers lists a layer twice: {indices}")
            object.__setattr__(self, "layers", tuple(indices))

    def check(self, model_or_config: Any) -> None:
        """The checks a model's 🤗 config answers (a model, or its config), before any weight is loaded
        (:meth:`layers_to_convert`)."""
        self.layers_to_convert(model_or_config)

    def layers_to_convert(self, model_or_config: Any, count: int | None = None) -> list[int]:
        """The indices of the layers to convert, sorted, checked against what a model's 🤗 config answers (a
        model, or its config; `count`: its layer count, read from the config when None): the window against the
        context, the layers against the layer count and the sliding-window layers, the retrieval heads against
        the key/value heads."""
        config = getattr(model_or_config, "config", model_or_config)
        context = _config_context(config)
        for name in ("window", "budget", "observation"):
            if context is not None and getattr(self, name) > context:
                raise HeadkitError(
                    f"{name} must be at most the model's context of {context} tokens, got {getattr(self, name)}"
                )
        kv_heads = config_kv_heads(config)
        bad = [pair for pair in self.retrieval_heads if kv_heads is not None and pair[1] >= kv_heads]
        if bad:
            raise HeadkitError(
                f"retrieval_heads must name key/value heads in [0, {kv_heads}) (the model has {kv_heads} per "
                f"layer), got {bad}"
            )
        count = count if count is not None else _config_layer_count(config)
        if count is not None and any(layer >= count for layer, _ in self.retrieval_heads):
            raise HeadkitError(
                f"retrieval_heads must name layers in [0, {count}), got "
                f"{[pair for pair in self.retrieval_heads if pair[0] >= count]}"
            )
        if count is None:
            return list(self.layers or ())
        sliding = sliding_layers(config, count)
        if self.layers is None:
            indices = [i for i in range(count) if self.convert_sliding or i not in sliding]
            if not indices:
                raise HeadkitError(
                    f"every layer of this model attends through a sliding window (sliding_window="
                    f"{getattr(config, 'sliding_window', None)}): its cache is bounded already, and a sliding "
                    "layer keeps its softmax by default; pass convert_sliding=True (--convert-sliding) to convert "
                    "them"
                )
            return self._converted_with_retrieval_heads(indices)
        bad = [i for i in self.layers if not 0 <= i < count]
        if bad:
            raise HeadkitError(
                f"layers must be indices in [0, {count}) (the model has {count} layers), got {bad}"
            )
        slides = [i for i in self.layers if i in sliding]
        if slides and not self.convert_sliding:
            raise HeadkitError(
                f"layers {slides} attend through a sliding window: their cache is bounded already; pass "
                "convert_sliding=True (--convert-sliding) to convert them"
            )
        missing = [i for i in sliding if i not in self.layers]
        if self.convert_sliding and missing:
            raise HeadkitError(
                f"with convert_sliding, layers must list every sliding-window layer (the model builds one mask "
                f"per layer type from one layer's cache entry); missing {missing}"
            )
        return self._converted_with_retrieval_heads(sorted(self.layers))

    def _converted_with_retrieval_heads(self, chosen: list[int]) -> list[int]:
        outside = [pair for pair in self.retrieval_heads if pair[0] not in chosen]
        if outside:
            raise HeadkitError(
                f"retrieval_heads must name heads of converted layers ({chosen}), got {outside}"
            )
        return chosen

    def record(self) -> dict[str, Any]:
        """The fields as JSON (``config.headkit_surgery`` keeps them, ``layers`` there being the layers actually
        converted)."""
        return asdict(self) | {
            "layers": None if self.layers is None else list(self.layers),
            "retrieval_heads": [list(pair) for pair in self.retrieval_heads],
        }

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> LinearizeConfig:
        """The config a record was written from (a field the record predates takes its default: a record
        written before sinks and the sparse cache existed is the plain hybrid)."""
        # A record written before the budget had the compressed cache's name (2026-11-29) calls it sparse_cache.
        entry = {("budget" if name == "sparse_cache" else name): value for name, value in entry.items()}
        return cls(**fields_of_record(cls, entry))


def _check_count(name: str, value: Any, minimum: int, expected: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = expected or ("a positive integer" if minimum == 1 else f"an integer ≥ {minimum}")
        raise HeadkitError(f"{name} must be {expected}, got {value!r}")


def _first_positive_int(config: Any, names: Sequence[str]) -> int | None:
    """The first of the `names` attributes of `config` that is a positive integer; None where none is."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _config_context(config: Any) -> int | None:
    return _first_positive_int(config, ("max_position_embeddings", "n_positions"))


def config_kv_heads(config: Any) -> int | None:
    return _first_positive_int(text_config(config), ("num_key_value_heads", "num_attention_heads", "n_head"))


def _config_layer_count(config: Any) -> int | None:
    return _first_positive_int(text_config(config), ("num_hidden_layers", "n_layer"))
