"""Configuration of headkit causal language models: a pre-norm decoder whose attention mechanism is a name.

``attention`` picks the mechanism of every layer; ``layer_types`` (one name per layer) makes hybrids, e.g. linear
attention with a few softmax layers. The other mechanisms' options are plain fields with defaults, read only by
the layers that use them.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from headkit.layers.feature_maps import valid_feature_map_names
from headkit.layers.registry import valid_attention_names

POSITION_EMBEDDING_TYPES = ("rope", "learned", "none")
MLP_TYPES = ("gated", "plain")
COLLABORATIVE_INITS = ("concatenate", "normal")
COCA_T_ACTIVATIONS = ("relu", "softplus")


@strict
class HeadkitConfig(PreTrainedConfig):
    r"""Configuration of :class:`~headkit.models.HeadkitForCausalLM` and its siblings (``model_type="headkit"``).

    Architecture:
        vocab_size, hidden_size, num_hidden_layers: the usual sizes.
        num_attention_heads, num_key_value_heads: query heads and key/value heads (grouped-query attention when
            fewer; default: as many as query heads).
        head_dim: per-head width; default ``hidden_size // num_attention_heads`` (which must divide exactly).
        num_attention_heads_per_layer, num_key_value_heads_per_layer: optional per-layer head counts overriding
            the two above (layers whose heads were pruned); lists of ``num_hidden_layers`` ints or None.
        intermediate_size: MLP width; default ``4 * hidden_size``.
        mlp_type: ``"gated"`` — down(act(gate(x)) · up(x)), SwiGLU with ``hidden_act="silu"`` — or ``"plain"`` —
            down(act(up(x))), e.g. the GELU MLP with ``hidden_act="gelu"``.
        hidden_act: activation name from ``transformers.activations.ACT2FN``.
        rms_norm_eps: epsilon of the pre-norm RMSNorms.
        attention_bias, mlp_bias: biases on the attention projections / MLP.
        causal: True for language models; False lets every token see the whole input (encoders, e.g. for
            sequence classification) and rules out caching and generation.

    Attention:
        attention: the mechanism of every layer — ``"softmax"``, ``"linear"``, ``"additive"``, ``"coca"``,
            ``"collaborative"``, ``"hybrid"`` or a name registered with :func:`headkit.layers.register_attention`.
        layer_types: one mechanism name per layer (a hybrid), or None for ``attention`` everywhere.
        feature_map, chunk_size: linear attention's feature map name and chunk length.
        additive_window: additive attention's causal window (None: global causal pooling).
        convolve, conv_kernel_size, conv_groups: additive attention's optional causal convolution block.
        dim_shared_query_key, collaborative_init: collaborative attention's shared query/key width
            (None: ``num_attention_heads * head_dim``) and mixing initialisation (``"concatenate"`` | ``"normal"``).
        coca_t_activation: how CoCA makes its t projection non-negative (``"relu"`` | ``"softplus"``).
        hybrid_window, hybrid_feature_map, hybrid_feature_dim: hybrid (LoLCATs) attention's softmax window W
            (tokens each query sees exactly, its own included), the feature map of its linear term (a learnable
            map such as ``"hedgehog"``, or a parameter-free one such as ``"elu"``; see
            :func:`headkit.layers.valid_feature_map_names`) and the learnable map's projection width (None:
            ``head_dim``; Hedgehog then has ``2 * hybrid_feature_dim`` features).

    Positions:
        position_embedding_type: ``"rope"`` (rotary, applied by the layers that use positions in attention:
            softmax, CoCA, hybrid), ``"learned"`` (absolute embeddings added to the token embeddings; inputs
            longer than ``max_position_embeddings`` are a ValueError) or ``"none"``.
        max_position_embeddings: the learned table's size, and the trained length dynamic-NTK RoPE scales from.
        rope_parameters: transformers' RoPE dict, e.g. ``{"rope_type": "linear", "factor": 2.0,
            "rope_theta": 10000.0}`` (``"default"``, ``"linear"`` or ``"dynamic"``). The older ``rope_theta=`` and
            ``rope_scaling=`` keyword arguments are accepted and folded into it.

    Training:
        attention_dropout, hidden_dropout: dropout on attention probabilities (where a mechanism has them) and on
            the embeddings and each block's attention/MLP output.
        initializer_range: std of the normal initialisation.
        label_smoothing: label smoothing of the causal LM loss while training (evaluation loss is plain
            cross-entropy, so perplexities stay comparable).
        tie_word_embeddings: share the input embedding and the LM head.
        pad_token_id, bos_token_id, eos_token_id, use_cache: as in transformers.
    """

    model_type = "headkit"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the output field, either name

    vocab_size: int = 32000
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_attention_heads_per_layer: list[int] | None = None
    num_key_value_heads_per_layer: list[int] | None = None
    intermediate_size: int | None = None
    mlp_type: str = "gated"
    hidden_act: str = "silu"
    rms_norm_eps: int | float = 1e-6
    attention_bias: bool = False
    mlp_bias: bool = False
    causal: bool = True

    attention: str = "softmax"
    layer_types: list[str] | None = None
    feature_map: str = "elu"
    chunk_size: int = 64
    additive_window: int | None = None
    convolve: bool = False
    conv_kernel_size: int = 3
    conv_groups: int = 1
    dim_shared_query_key: int | None = None
    collaborative_init: str = "concatenate"
    coca_t_activation: str = "relu"
    hybrid_window: int = 64
    hybrid_feature_map: str = "hedgehog"
    hybrid_feature_dim: int | None = None

    position_embedding_type: str = "rope"
    max_position_embeddings: int = 2048
    rope_parameters: dict | None = None

    attention_dropout: int | float = 0.0
    hidden_dropout: int | float = 0.0
    initializer_range: int | float = 0.02
    label_smoothing: int | float = 0.0
    tie_word_embeddings: bool = True
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            _check_positive(name, getattr(self, name))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or give head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        super().__post_init__(**kwargs)
        self.check_headkit_fields()

    def check_headkit_fields(self) -> None:
        """Raise ValueError naming the field for any invalid headkit setting (run on creation)."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "chunk_size",
            "conv_kernel_size",
            "conv_groups",
            "hybrid_window",
        ):
            _check_positive(name, getattr(self, name))
        for name in ("additive_window", "dim_shared_query_key", "hybrid_feature_dim"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        for name in ("attention_dropout", "hidden_dropout", "label_smoothing"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.hidden_size % self.conv_groups != 0:
            raise ValueError(f"conv_groups ({self.conv_groups}) must divide hidden_size ({self.hidden_size})")

        self._check_attention_names()
        self._check_head_counts()
        _check_choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        _check_choice("mlp_type", self.mlp_type, MLP_TYPES)
        _check_choice("hidden_act", self.hidden_act, tuple(sorted(ACT2FN)))
        _check_choice("collaborative_init", self.collaborative_init, COLLABORATIVE_INITS)
        _check_choice("coca_t_activation", self.coca_t_activation, COCA_T_ACTIVATIONS)
        _check_choice("hybrid_feature_map", self.hybrid_feature_map, tuple(valid_feature_map_names()))

    def _check_attention_names(self) -> None:
        valid = valid_attention_names()
        if self.attention not in valid:
            raise ValueError(
                f"unknown attention {self.attention!r}; valid attention types: {', '.join(valid)}"
            )
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must list one attention type per layer ({self.num_hidden_layers}), "
                f"got {len(self.layer_types)}: {self.layer_types}"
            )
        for layer_idx, name in enumerate(self.layer_types):
            if name not in valid:
                raise ValueError(
                    f"unknown layer type {name!r} at layer_types[{layer_idx}]; valid attention types: "
                    f"{', '.join(valid)}"
                )

    def _check_head_counts(self) -> None:
        for name in ("num_attention_heads_per_layer", "num_key_value_heads_per_layer"):
            per_layer = getattr(self, name)
            if per_layer is None:
                continue
            if len(per_layer) != self.num_hidden_layers:
                raise ValueError(
                    f"{name} must have one entry per layer ({self.num_hidden_layers}), got {len(per_layer)}"
                )
            for layer_idx, heads in enumerate(per_layer):
                _check_positive(f"{name}[{layer_idx}]", heads)
        for layer_idx in range(self.num_hidden_layers):
            heads, kv_heads = self.heads_for_layer(layer_idx)
            if heads % kv_heads != 0:
                raise ValueError(
                    f"the key/value heads ({kv_heads}) must divide the attention heads ({heads}) in layer "
                    f"{layer_idx} (num_key_value_heads / num_key_value_heads_per_layer)"
                )

    # transformers runs every validate_* method after __init__ (and on config.validate()); these replace the
    # base class's checks, which only know transformers' own layer types.
    def validate_layer_type(self) -> None:
        self._check_attention_names()

    def validate_architecture(self) -> None:
        self.check_headkit_fields()

    def attention_type(self, layer_idx: int) -> str:
        """The attention mechanism of layer ``layer_idx``."""
        return self.attention if self.layer_types is None else self.layer_types[layer_idx]

    def heads_for_layer(self, layer_idx: int) -> tuple[int, int]:
        """(attention heads, key/value heads) of layer ``layer_idx``, per-layer overrides first."""
        heads = self.num_attention_heads
        if self.num_attention_heads_per_layer is not None:
            heads = self.num_attention_heads_per_layer[layer_idx]
        kv_heads = self.num_key_value_heads
        if self.num_key_value_heads_per_layer is not None:
            kv_heads = self.num_key_value_heads_per_layer[layer_idx]
        elif self.num_attention_heads_per_layer is not None and kv_heads == self.num_attention_heads:
            # Plain multi-head attention stays multi-head when a layer's heads are pruned.
            kv_heads = heads
        return heads, kv_heads

    def rope_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`headkit.ops.rotary_cos_sin` (and CoCA): rope_theta, rope_scaling, max."""
        parameters = dict(self.rope_parameters or {})
        rope_theta = float(parameters.pop("rope_theta", 10000.0))
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        return {
            "rope_theta": rope_theta,
            "rope_scaling": None if rope_type == "default" else parameters,
            "max_position_embeddings": self.max_position_embeddings,
        }


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


__all__ = ["HeadkitConfig"]
