"""Additive attention layer: Fastformer, in causal, windowed causal and bidirectional form.

Wu et al. 2021, "Fastformer: Additive Attention Can Be All You Need" (arXiv:2108.09084), §3.1, per head h with
head_dim d:

    q_i, k_i, v_i = W_q x_i, W_k x_i, W_v x_i
    α_i = softmax_i(w_qᵀ q_i / √d),        g_q = Σ_i α_i q_i              (Eq. 1–2, the global query)
    p_i = g_q ∗ k_i                                                       (Eq. 3)
    β_i = softmax_i(w_kᵀ p_i / √d),        g_k = Σ_i β_i p_i              (Eq. 4–5, the global key)
    u_i = g_k ∗ v_i                                                       (Eq. 6)
    output_i = W_o u_i + q_i                                              (the output transform and query residual)

where ∗ is the element-wise product and w_q, w_k are learned vectors (one per head). For a language model each
position pools only its prefix i ≤ t (g_q,t and g_k,t; the Additive-Attention LM's cumulative form), or only the
last ``additive_window`` positions; :func:`headkit.ops.additive_pool` computes every prefix exactly and in
parallel, :func:`headkit.ops.additive_pool_step` one more position from a constant-size state.

The optional causal convolution block of the Additive-Attention LM comes first: x ← x + Conv1d(x), a grouped
convolution over the last ``conv_kernel_size`` positions (left zero padding, so position i sees only inputs
≤ i). Padding tokens are zeroed before it, so a left-padded sequence is convolved exactly like the unpadded one.

Decoding state (:class:`AdditiveState`): the two pooling states (log-normaliser and pooled vector, or the last
window − 1 tokens when windowed) and the last kernel_size − 1 convolution inputs: constant in the context length.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from headkit.layers.base import HeadkitAttention, LayerInputs
from headkit.layers.cache import StateCacheLayer
from headkit.layers.registry import register_attention
from headkit.ops._validation import repeat_kv
from headkit.ops.additive import AdditivePoolState, additive_pool, additive_pool_step


class AdditiveState(NamedTuple):
    """Decoding state of one :class:`AdditiveAttention` layer (every tensor has the batch as dim 0).

    query_pool: the pooling of the queries so far (gives the global query g_q).
    key_pool: the pooling of the mixed keys p_i so far (gives the global key g_k).
    conv_inputs: the last conv_kernel_size − 1 inputs of the convolution [B, kernel_size − 1, hidden], zeros
        before the first token; None without the convolution block.
    """

    query_pool: AdditivePoolState
    key_pool: AdditivePoolState
    conv_inputs: torch.Tensor | None = None


@register_attention("additive")
class AdditiveAttention(HeadkitAttention):
    """Fastformer additive attention (``attention="additive"``).

    Uses the config's ``causal`` (prefix pooling) and ``additive_window`` (pool only the last ``window``
    positions; None = the whole prefix), ``convolve``, ``conv_kernel_size``, ``conv_groups`` (the causal
    convolution block; its output is dropped out with ``hidden_dropout`` in training), ``chunk_size`` (positions
    per chunk of the parallel pooling scan) and ``attention_bias``. Key/value heads may be fewer than query heads
    (each serves ``num_heads / num_key_value_heads`` query heads). The query residual needs
    ``num_heads * head_dim == hidden_size``. Parameters of its own: ``query_score_weight`` (w_q) and
    ``key_score_weight`` (w_k), [num_heads, head_dim] each, and ``conv`` when ``convolve``.
    """

    cache_layer_class = StateCacheLayer

    def __init__(self, config: Any, layer_idx: int, **head_overrides: int) -> None:
        super().__init__(config, layer_idx, **head_overrides)
        query_width = self.num_heads * self.head_dim
        if query_width != self.hidden_size:
            raise ValueError(
                f"additive attention adds its queries to its output (Fastformer's query residual), so "
                f"num_heads * head_dim ({self.num_heads} * {self.head_dim} = {query_width}) must equal "
                f"hidden_size ({self.hidden_size}) in layer {layer_idx}"
            )
        self.add_query_key_value_projections(config.attention_bias)
        self.query_score_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim))
        self.key_score_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim))
        self.window = config.additive_window
        self.chunk_size = config.chunk_size
        self.score_scale = self.head_dim**-0.5

        self.conv_kernel_size = config.conv_kernel_size if config.convolve else 0
        self.conv = None
        if config.convolve:
            # Padding is explicit (left only), so the conv itself pads nothing.
            self.conv = nn.Conv1d(
                self.hidden_size,
                self.hidden_size,
                kernel_size=config.conv_kernel_size,
                groups=config.conv_groups,
                bias=False,
            )
        self.conv_dropout = float(config.hidden_dropout)
        # A standalone layer is usable at once; inside a model, _init_weights initialises again.
        self.init_extra_parameters(config.initializer_range)

    def init_extra_parameters(self, std: float) -> None:
        init.normal_(self.query_score_weight, std=std)
        init.normal_(self.key_score_weight, std=std)

    def attend(self, hidden_states: torch.Tensor, inputs: LayerInputs) -> tuple[torch.Tensor, None]:
        batch, seq, cache = inputs.batch, inputs.seq, inputs.cache
        if cache is not None and not self.causal:
            raise ValueError("a cache needs a causal layer (config.causal=True): a state pools the past")
        new_tokens_mask = inputs.new_tokens_mask
        state = self.recurrent_state(inputs)
        # A decoding step (one token, a cache) marks a padding token by a −inf score rather than taking the mask;
        # the mask is inverted here once for both poolings.
        decoding = cache is not None and seq == 1
        step_padding = None if not decoding or new_tokens_mask is None else ~new_tokens_mask[:, None, :]

        conv_inputs = None
        if self.conv is not None:
            hidden_states, conv_inputs = self._convolve(
                hidden_states, new_tokens_mask, None if state is None else state.conv_inputs
            )

        queries, keys, values = self.project_queries_keys_values(hidden_states)
        keys = repeat_kv(keys, self.num_key_value_groups)
        values = repeat_kv(values, self.num_key_value_groups)

        def pool(x: torch.Tensor, score_weight: torch.Tensor, previous: AdditivePoolState | None):
            scores = self._scores(x, score_weight)
            return self._pool(x, scores, new_tokens_mask, step_padding, previous, cache)

        global_query, query_pool = pool(
            queries, self.query_score_weight, None if state is None else state.query_pool
        )
        mixed_keys = global_query * keys  # p_i = g_q ∗ k_i (Eq. 3)
        global_key, key_pool = pool(
            mixed_keys, self.key_score_weight, None if state is None else state.key_pool
        )
        head_outputs = global_key * values  # u_i = g_k ∗ v_i (Eq. 6)

        self.store_state(inputs, AdditiveState(query_pool, key_pool, conv_inputs))
        # Fastformer's query residual; undoing split_heads' transpose is a view, not a copy.
        flat_queries = queries.transpose(1, 2).reshape(batch, seq, self.hidden_size)
        return self.project_heads(head_outputs) + flat_queries, None

    def _scores(self, x: torch.Tensor, score_weight: torch.Tensor) -> torch.Tensor:
        """wᵀ x_i / √d for every head and position: [B, H, T, D] → [B, H, T]."""
        if score_weight.dtype != x.dtype:  # not a no-op .to() on every decoding step
            score_weight = score_weight.to(x.dtype)
        return (x * score_weight.unsqueeze(1)).sum(-1) * self.score_scale

    def _pool(
        self,
        x: torch.Tensor,
        scores: torch.Tensor,
        keep: torch.Tensor | None,
        step_padding: torch.Tensor | None,
        state: AdditivePoolState | None,
        cache: Any,
    ) -> tuple[torch.Tensor, AdditivePoolState | None]:
        """Softmax-pool x by its scores: [B, H, T, D] per position (causal) or [B, H, 1, D] (bidirectional).

        One token with a cache takes the recurrent step, which sees padding through step_padding [B, 1, 1]
        (True = padding); everything else takes the parallel scan with the key padding mask keep [B, T].
        """
        if not self.causal:
            pooled, _ = additive_pool(x, scores, causal=False, attention_mask=keep, validate=False)
            return pooled[:, :, None], None
        if cache is not None and x.shape[2] == 1:
            if step_padding is not None:
                scores = scores.masked_fill(step_padding, float("-inf"))
            return additive_pool_step(x, scores, state, window=self.window, validate=False)
        return additive_pool(
            x,
            scores,
            causal=True,
            window=self.window,
            attention_mask=keep,
            initial_state=state,
            output_final_state=cache is not None,
            chunk_size=self.chunk_size,
            validate=False,
        )

    def _convolve(
        self, hidden_states: torch.Tensor, keep: torch.Tensor | None, previous_inputs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x + Conv1d(x) over the last kernel_size inputs; returns it and the inputs the next call needs."""
        batch, _, hidden = hidden_states.shape
        if keep is not None:
            # A padding token becomes a zero input, exactly like the convolution's own left padding.
            hidden_states = hidden_states.masked_fill(~keep[..., None], 0.0)
        if previous_inputs is None:
            previous_inputs = hidden_states.new_zeros(batch, self.conv_kernel_size - 1, hidden)
        window = torch.cat([previous_inputs.to(hidden_states.dtype), hidden_states], dim=1)
        convolved = self.conv(window.transpose(1, 2)).transpose(1, 2)
        convolved = F.dropout(convolved, p=self.conv_dropout, training=self.training)
        last_inputs = window[:, window.shape[1] - (self.conv_kernel_size - 1) :]
        return hidden_states + convolved, last_inputs

    def extra_repr(self) -> str:
        conv = f", conv_kernel_size={self.conv_kernel_size}" if self.conv is not None else ""
        return f"{super().extra_repr()}, causal={self.causal}, window={self.window}{conv}"
