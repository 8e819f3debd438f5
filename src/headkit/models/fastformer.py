"""Seed compatibility with the Additive-Attention language model package (``FastformerLMConfig``).

That package's causal LM stacks Fastformer blocks (Wu et al. 2021, "Fastformer: Additive Attention Can Be All
You Need", Eq. 3–6, made causal by cumulative pooling) with an optional causal convolution, learned absolute
positions, a GELU MLP and tied embeddings. :class:`FastformerLMConfig` accepts its argument names and maps them
onto :class:`HeadkitConfig` with ``attention="additive"``; :class:`FastformerForCausalLM` is a
:class:`HeadkitForCausalLM` built from it, so scripts written for the package run on headkit. Weights are not
converted: the module layout is headkit's.
"""

from __future__ import annotations

from typing import Any

from headkit.models.configuration_headkit import HeadkitConfig
from headkit.models.modeling_headkit import HeadkitForCausalLM

# The package's names → HeadkitConfig's.
FASTFORMER_ARGUMENT_NAMES = {
    "n_positions": "max_position_embeddings",
    "n_heads": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "groups": "conv_groups",
    "kernel_size": "conv_kernel_size",
    "hidden_dropout_prob": "hidden_dropout",
}

# The package's defaults, and the architecture choices its model makes.
FASTFORMER_DEFAULTS: dict[str, Any] = {
    "attention": "additive",
    "hidden_size": 256,
    "vocab_size": 32100,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "num_hidden_layers": 4,
    "convolve": False,
    "conv_kernel_size": 4,
    "conv_groups": 1,
    "hidden_dropout": 0.1,
    "initializer_range": 0.02,
    "label_smoothing": 0.0,
    "position_embedding_type": "learned",
    "mlp_type": "plain",
    "hidden_act": "gelu",
    "tie_word_embeddings": True,
    "pad_token_id": 0,
}


class FastformerLMConfig(HeadkitConfig):
    """A :class:`HeadkitConfig` that also accepts the Additive-Attention LM package's argument names.

    ``n_positions``, ``n_heads``, ``n_layer``, ``groups``, ``kernel_size`` and ``hidden_dropout_prob`` map to
    ``max_position_embeddings``, ``num_attention_heads``, ``num_hidden_layers``, ``conv_groups``,
    ``conv_kernel_size`` and ``hidden_dropout``; ``hidden_size``, ``vocab_size``, ``convolve``,
    ``num_hidden_layers``, ``label_smoothing`` and ``initializer_range`` keep their names. Defaults are the
    package's (hidden 256, 4 heads, 4 layers, 1024 positions, kernel 4, dropout 0.1). It saves as a plain
    ``model_type="headkit"`` config, so the Auto classes load what it saves.

    Example::

        config = FastformerLMConfig(hidden_size=128, vocab_size=5000, n_positions=512, n_heads=4, convolve=True,
                                    groups=2, kernel_size=3, num_hidden_layers=2, hidden_dropout_prob=0.0)
    """

    def __init__(self, **kwargs: Any) -> None:
        for package_name, headkit_name in FASTFORMER_ARGUMENT_NAMES.items():
            if package_name not in kwargs:
                continue
            value = kwargs.pop(package_name)
            if headkit_name in kwargs and kwargs[headkit_name] != value:
                raise ValueError(
                    f"{package_name}={value!r} and {headkit_name}={kwargs[headkit_name]!r} name the same setting "
                    "with different values; pass one of them"
                )
            kwargs[headkit_name] = value
        super().__init__(**{**FASTFORMER_DEFAULTS, **kwargs})


class FastformerForCausalLM(HeadkitForCausalLM):
    """:class:`HeadkitForCausalLM` configured by a :class:`FastformerLMConfig` (additive attention)."""

    config_class = FastformerLMConfig


__all__ = ["FASTFORMER_ARGUMENT_NAMES", "FastformerForCausalLM", "FastformerLMConfig"]
