"""The interface every headkit attention layer implements, and the one place where heads are gated.

A mechanism is a subclass of :class:`HeadkitAttention` registered by name::

    @register_attention("mine")
    class MyAttention(HeadkitAttention):
        def __init__(self, config, layer_idx, **head_overrides):
            super().__init__(config, layer_idx, **head_overrides)       # head counts, head_dim, o_proj, head_gate
            self.add_query_key_value_projections(config.attention_bias)  # or nn.Linear modules of your own
            ...

        def attend(self, hidden_states, inputs):                       # inputs: the validated LayerInputs
            ...                                                        # per-head outputs [B, H, T, Dv]
            return self.project_heads(head_outputs), None

The base class's ``forward`` validates the padding mask and the positions once and hands them to ``attend``; a
mechanism may instead override ``forward`` itself (the same contract, reading the inputs through
:meth:`~HeadkitAttention.key_padding_mask` and :meth:`~HeadkitAttention.positions`, which check them; such a
forward may take ``inputs_validated`` too, and pass it on as their ``validated``).

The contract, for every mechanism:

* **Projections** are ``nn.Linear`` modules named ``q_proj``, ``k_proj``, ``v_proj`` wherever the mechanism has
  them (so ``peft.LoraConfig(target_modules=["q_proj", "v_proj"])`` finds them); the base class creates
  ``o_proj`` ([num_heads · head_dim → hidden_size]).
* **Head counts** come from the layer's own attributes ``num_heads`` / ``num_key_value_heads`` / ``head_dim``,
  which the constructor takes from the config's per-layer entries (:meth:`HeadkitConfig.heads_for_layer`) or
  from keyword overrides — never from the global config at forward time — so layers of one model may have
  different head counts (physical head pruning).
* **forward** takes ``hidden_states`` [B, T, hidden_size] and returns ``(output [B, T, hidden_size],
  attention weights [B, H, Tq, Tk] or None)``; weights only when ``output_attentions`` and the mechanism has
  them. ``attention_mask`` is the key padding mask [B, past + T] over every token the layer has seen plus the
  current ones (bool or 0/1 integers, True = real token; left padding in batched generation), or None.
  ``position_ids`` [B or 1, T] are the absolute positions of the current tokens, counted over real tokens only
  (left padding does not shift them); None means ``past, …, past + T − 1``. They are validated once: by the
  layer's forward (:meth:`key_padding_mask`, :meth:`positions`), except when the caller says it has
  (``inputs_validated=True``: a :class:`~headkit.models.HeadkitModel`'s blocks, whose forward has validated them
  for every layer; the same layer called on its own checks them again). The projections are right by
  construction, so the ops a layer calls skip their own checks (``validate=False``).
* **Per-head outputs** [B, H, T, Dv] go through :meth:`project_heads`, the single place where a head gate
  (``self.head_gate``, a :class:`headkit.layers.gates.HeadkitGate` or None) scales them before ``o_proj``.
* **Caching**: ``cache`` (also accepted as ``past_key_values``, transformers' name before 5.24) is a :class:`headkit.layers.cache.HeadkitCache` (or any transformers
  ``Cache`` for key/value layers) updated in place whenever it is given; ``use_cache`` is then True. Key/value
  layers call ``cache.update(keys, values, self.layer_idx)`` and attend over what it returns.
  Recurrent layers set ``cache_layer_class = StateCacheLayer`` (the entry surgery's mechanisms use too) and
  read and keep their state with :meth:`recurrent_state` / :meth:`store_state`.
* **Parameters** that are not inside ``nn.Linear`` / ``nn.Embedding`` / ``nn.Conv1d`` / RMSNorm modules (pooling
  vectors, mixing matrices, biases of their own) are initialised in :meth:`init_extra_parameters` with the
  ``transformers.initialization`` functions, which skip tensors loaded from a checkpoint.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from headkit.compat import accepts_cache_alias
from headkit.layers.cache import DynamicLayer
from headkit.ops._validation import (
    check_batch_position_ids,
    check_padding_mask,
    check_positive_int,
    check_rank,
    repeat_kv,
)

# The buffer of an attention module pruned to uneven grouped-query heads (headkit's layers and, through the
# registered attention function, stock ones): for each query head, the key/value head it reads.
KV_HEAD_INDEX = "headkit_kv_head_index"


class LayerInputs(NamedTuple):
    """What :meth:`HeadkitAttention.forward` hands :meth:`HeadkitAttention.attend`, validated."""

    batch: int
    seq: int  # T, the current tokens
    past_length: int  # tokens the layer has seen before (0 without a cache)
    key_mask: torch.Tensor | None  # [B, past + T] bool on hidden_states' device (True = real token), or None
    positions: torch.Tensor | None  # [B or 1, T] positions of the current tokens; None unless use_rope
    cache: Any  # updated in place, or None
    output_attentions: bool

    @property
    def new_tokens_mask(self) -> torch.Tensor | None:
        """The current tokens' part of key_mask, [B, T] (what a recurrent state has not seen yet), or None."""
        return None if self.key_mask is None else self.key_mask[:, self.past_length :]


class HeadkitAttention(nn.Module):
    """Base class of the attention layers: head bookkeeping, head gating and the output projection.

    Args:
        config: a :class:`~headkit.models.HeadkitConfig` (anything with its fields and ``heads_for_layer``).
        layer_idx: this layer's index in the model (its slot in the cache).
        num_heads, num_key_value_heads, head_dim: override the config's values for this layer.
    """

    attention_name: ClassVar[str] = ""  # set by @register_attention, with the two facts below
    rotary: ClassVar[bool] = False  # applies rotary positions inside attention
    compared: ClassVar[bool] = True  # in the default runs of the benchmarks that compare mechanisms
    # The per-layer cache entry this mechanism needs; recurrent mechanisms use StateCacheLayer (or a subclass).
    cache_layer_class: ClassVar[type] = DynamicLayer
    # Whether forward takes ``inputs_validated`` (a subclass that overrides forward with the plain signature does
    # not): set per class, so a model reads one attribute per call to know whether it may pass it.
    takes_inputs_validated: ClassVar[bool] = True
    # Attributes a mechanism adds to the layer's repr (after the head geometry).
    repr_fields: ClassVar[tuple[str, ...]] = ()
    # Attention is computed here, not through transformers' attention interface: the layer applies its head gate
    # (project_heads), key/value head index (project_queries_keys_values) and a pruned-empty layer's placeholder
    # head itself, in slots it declares, so surgery sets those and attaches no mechanism of its own.
    computes_attention_itself: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "takes_inputs_validated" in cls.__dict__:  # said by the class itself (surgery's replacements)
            return
        parameters = inspect.signature(cls.forward).parameters.values()
        cls.takes_inputs_validated = any(
            parameter.name == "inputs_validated" or parameter.kind is inspect.Parameter.VAR_KEYWORD
            for parameter in parameters
        )

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        *,
        num_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
    ) -> None:
        super().__init__()
        config_heads, config_kv_heads = config.heads_for_layer(layer_idx)
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = check_positive_int("num_heads", config_heads if num_heads is None else num_heads)
        self.num_key_value_heads = check_positive_int(
            "num_key_value_heads", config_kv_heads if num_key_value_heads is None else num_key_value_heads
        )
        self.head_dim = check_positive_int("head_dim", config.head_dim if head_dim is None else head_dim)
        if self.num_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_heads ({self.num_heads}) "
                f"in layer {layer_idx} (grouped-query attention)"
            )
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.attention_dropout = float(config.attention_dropout)
        self.causal = bool(config.causal)
        # Whether attend reads positions; layers that can do without rotary positions set it from the config.
        self.use_rope = self.rotary

        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=config.attention_bias)
        # The head-gating hook: None, or a module whose scale_heads([B, H, T, Dv]) multiplies each head's output.
        self.register_module("head_gate", None)
        # Uneven grouped-query pruning: None, or for each query head the key/value head it reads (persistent,
        # so a checkpoint says what the layer computes).
        self.register_buffer(KV_HEAD_INDEX, None, persistent=True)

    @accepts_cache_alias
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        inputs_validated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T, hidden_size] → ([B, T, hidden_size], attention weights [B, H, Tq, Tk] or None).

        Validates ``attention_mask`` and ``position_ids`` and calls :meth:`attend`. ``inputs_validated=True`` is
        for a caller that has checked them already (a model, once for all its layers): per call, so a layer
        taken out of a model checks them again.
        """
        batch, seq, _ = hidden_states.shape
        past_length = self.past_length(cache)
        key_mask = self.key_padding_mask(attention_mask, batch, past_length + seq, validated=inputs_validated)
        if key_mask is not None:
            key_mask = key_mask.to(hidden_states.device)
        positions = None
        if self.use_rope:
            positions = self.positions(
                position_ids, batch, seq, past_length, hidden_states.device, validated=inputs_validated
            )
        inputs = LayerInputs(batch, seq, past_length, key_mask, positions, cache, output_attentions)
        return self.attend(hidden_states, inputs)

    def attend(
        self, hidden_states: torch.Tensor, inputs: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mechanism itself, on validated inputs: what :meth:`forward` returns."""
        raise NotImplementedError(f"{type(self).__name__} must implement attend (or forward)")

    def split_heads(self, projected: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[B, T, num_heads · D] → [B, num_heads, T, D]."""
        batch, seq, width = projected.shape
        return projected.view(batch, seq, num_heads, width // num_heads).transpose(1, 2)

    def add_query_key_value_projections(self, bias: bool) -> None:
        """``q_proj`` [hidden → H·D] and ``k_proj``/``v_proj`` [hidden → H_kv·D]: the usual (GQA) widths."""
        key_value_width = self.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(self.hidden_size, key_value_width, bias=bias)
        self.v_proj = nn.Linear(self.hidden_size, key_value_width, bias=bias)

    def project_queries_keys_values(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, hidden] → queries [B, H, T, D], keys and values [B, H_kv, T, D] (KV heads not repeated; after
        uneven pruning, gathered to one per query head by ``headkit_kv_head_index``)."""
        queries = self.split_heads(self.q_proj(hidden_states), self.num_heads)
        index = getattr(self, KV_HEAD_INDEX)
        if index is None:
            return (
                queries,
                self.split_heads(self.k_proj(hidden_states), self.num_key_value_heads),
                self.split_heads(self.v_proj(hidden_states), self.num_key_value_heads),
            )
        stored = self.k_proj.out_features // self.head_dim
        keys = self.split_heads(self.k_proj(hidden_states), stored).index_select(1, index)
        return queries, keys, self.split_heads(self.v_proj(hidden_states), stored).index_select(1, index)

    def project_heads(self, head_outputs: torch.Tensor) -> torch.Tensor:
        """Gate each head, merge the heads and apply ``o_proj``: [B, H, T, Dv] → [B, T, hidden_size].

        Every layer ends here, so a gate set on ``self.head_gate`` acts on every mechanism the same way.
        """
        check_rank("head_outputs", head_outputs, 4, "[batch, heads, seq, head_dim_v]")
        batch, heads, seq, head_dim = head_outputs.shape
        if heads * head_dim != self.o_proj.in_features:
            raise ValueError(
                f"head_outputs must have shape [batch, {self.num_heads}, seq, {self.head_dim}] to match o_proj "
                f"({self.o_proj.in_features} inputs), got {tuple(head_outputs.shape)}"
            )
        # A gate over no heads (a layer pruned empty, running a placeholder head) has nothing to scale.
        if self.head_gate is not None and getattr(self.head_gate, "num_heads", None) != 0:
            head_outputs = self.head_gate.scale_heads(head_outputs)
        merged = head_outputs.transpose(1, 2).reshape(batch, seq, heads * head_dim)
        return self.o_proj(merged)

    def past_length(self, cache: Any) -> int:
        """How many tokens this layer has already seen (0 without a cache)."""
        return 0 if cache is None else cache.get_seq_length(self.layer_idx)

    def positions(
        self,
        position_ids: torch.Tensor | None,
        batch: int,
        seq: int,
        past_length: int,
        device: torch.device,
        *,
        validated: bool = False,
    ) -> torch.Tensor:
        """Validated positions [B or 1, T] of the current tokens (``validated``: checked by the caller already);
        ``past, …, past + T − 1`` when None."""
        if position_ids is None:
            return torch.arange(past_length, past_length + seq, device=device)[None]
        return position_ids if validated else check_batch_position_ids(position_ids, batch, seq)

    def state_entry(self, cache: Any) -> Any:
        """A recurrent layer's entry in ``cache`` (its ``cache_layer_class``, a
        :class:`~headkit.layers.cache.StateCacheLayer`), or None without a cache."""
        return None if cache is None else self.cache_layer_class.in_cache(cache, self.layer_idx)

    def recurrent_state(self, inputs: LayerInputs) -> Any:
        """A recurrent layer's state from the cache: None without a cache, or before its first token."""
        entry = self.state_entry(inputs.cache)
        return None if entry is None else entry.get_state()

    def store_state(self, inputs: LayerInputs, state: Any) -> None:
        """Keep a recurrent layer's state after this call's tokens in the cache (if there is one)."""
        entry = self.state_entry(inputs.cache)
        if entry is not None:
            entry.set_state(state, inputs.seq)

    def finish_recurrent(
        self, inputs: LayerInputs, state: Any, head_outputs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """The end of a recurrent layer's ``attend``: its state kept (:meth:`store_state`), its heads projected
        (:meth:`project_heads`); no attention weights."""
        self.store_state(inputs, state)
        return self.project_heads(head_outputs), None

    def key_padding_mask(
        self, attention_mask: torch.Tensor | None, batch: int, total_length: int, *, validated: bool = False
    ) -> torch.Tensor | None:
        """The validated [B, past + T] key padding mask as bool (True = real token), or None (``validated``:
        checked by the caller already, and returned as it is)."""
        if validated:
            return attention_mask
        return check_padding_mask(attention_mask, batch, total_length)

    def init_extra_parameters(self, std: float) -> None:
        """Initialise parameters that are not in nn.Linear/nn.Embedding/nn.Conv1d/RMSNorm modules (none here).

        Called by ``HeadkitPreTrainedModel._init_weights`` with the config's ``initializer_range``; use
        ``transformers.initialization`` (``init.normal_``, ``init.zeros_``, ``init.copy_``, …) so that tensors
        loaded from a checkpoint are left alone.
        """

    def extra_repr(self) -> str:
        fields = "".join(f", {name}={getattr(self, name)!r}" for name in self.repr_fields)
        return (
            f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, "
            f"num_key_value_heads={self.num_key_value_heads}, head_dim={self.head_dim}{fields}"
        )


def fused_unless_weights_needed(
    fused: Callable[[], torch.Tensor],
    explicit_weights: Callable[[], torch.Tensor],
    values: torch.Tensor,
    *,
    dropout: float,
    output_attentions: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-head outputs [B, H, Tq, Dv] and the weights when asked for: the one place a layer chooses its path.

    The fused kernel (``fused()``) never forms the [Tq, Tk] weights, so it runs unless the caller asks for them
    (``output_attentions``) or dropout has to act on them; then ``explicit_weights()`` [B, H, Tq, Tk] (in the
    values' dtype) are computed, dropped out and applied to ``values`` [B, Hkv, Tk, Dv], repeated to the H
    query heads (grouped-query attention). Pass ``dropout=0`` outside training.
    """
    if not output_attentions and dropout == 0.0:
        return fused(), None
    weights = explicit_weights()
    values = repeat_kv(values, weights.shape[1] // values.shape[1])
    head_outputs = F.dropout(weights, p=dropout, training=True) @ values
    return head_outputs, (weights if output_attentions else None)
