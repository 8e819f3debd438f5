"""CoCA attention layer: rotary attention whose keys are collinear with the queries.

Zhu et al. 2023, "CoCA: Fusing Position Embedding with Collinear Constrained Attention in Transformers for Long
Context Window Extending" (arXiv:2309.08646), §2. Each head projects queries q_m = W_q x_m, values v_n = W_v x_n
and, instead of keys, one non-negative magnitude per rotary pair, t_n = act(W_t x_n) ∈ ℝ^{d/2}, act = relu or
softplus. Inside rotary pair i the key that query m sees at position n is t_n,i · q̃_m,i (collinear with the
query), so with RoPE (Su et al. 2021, RoFormer Eq. 34) the score is

    score(m, n) = Σ_i t_n,i · |q̃_m,i|² · cos((m − n)·θ_i) / √d,

which depends on the relative position m − n only and cannot turn negative through a rotation of the key
(the paper's fix of RoPE's long-context anomaly). :func:`headkit.ops.coca_attention` evaluates it at the cost
of ordinary attention. Rotary scaling (linear position interpolation or dynamic NTK) comes from the config's
``rope_parameters``.

The t projection is ``k_proj`` (width num_key_value_heads · head_dim / 2), so LoRA/PEFT target names and the
other projection conventions hold. The key/value cache stores t and v; cached keys' positions are recomputed
from the newest token's position and the padding mask (positions count real tokens only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.layers.base import HeadkitAttention, LayerInputs, fused_unless_weights_needed
from headkit.layers.registry import register_attention
from headkit.layers.softmax import softmax_attention_weights
from headkit.ops.coca import coca_attention
from headkit.ops.rotary import dynamic_rope_length, rotary_cos_sin

T_ACTIVATIONS = {"relu": F.relu, "softplus": F.softplus}


@register_attention("coca", rotary=True)
class CoCAAttention(HeadkitAttention):
    """Collinear constrained attention (``attention="coca"``), always with rotary positions.

    Uses the config's ``coca_t_activation`` ("relu" | "softplus", what makes t ≥ 0), ``rope_parameters`` and
    ``max_position_embeddings`` (via ``config.rope_kwargs()``; dynamic NTK scales for the longest position of a
    call), ``attention_bias``, ``attention_dropout`` (on the attention probabilities, in training) and
    ``causal``. ``head_dim`` must be even (rotary pairs). Attention weights are materialised only for
    ``output_attentions`` or dropout.
    """

    repr_fields = ("t_activation",)

    def __init__(self, config: Any, layer_idx: int, **head_overrides: int) -> None:
        super().__init__(config, layer_idx, **head_overrides)
        if self.head_dim % 2:
            raise ValueError(
                f"CoCA needs an even head_dim (rotary pairs (i, i + head_dim/2)), got {self.head_dim} "
                f"in layer {layer_idx}"
            )
        if config.coca_t_activation not in T_ACTIVATIONS:
            raise ValueError(
                f"coca_t_activation must be one of {', '.join(T_ACTIVATIONS)}; got {config.coca_t_activation!r}"
            )
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        # One magnitude per rotary pair: tying the pair is built into the projection's width.
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim // 2, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.t_activation = config.coca_t_activation
        self.scale = self.head_dim**-0.5
        self.rope_kwargs = config.rope_kwargs()

    def attend(
        self, hidden_states: torch.Tensor, inputs: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        queries = self.split_heads(self.q_proj(hidden_states), self.num_heads)
        magnitudes = T_ACTIVATIONS[self.t_activation](
            self.split_heads(self.k_proj(hidden_states), self.num_key_value_heads)
        )
        values = self.split_heads(self.v_proj(hidden_states), self.num_key_value_heads)

        positions = inputs.positions.to(hidden_states.device).expand(inputs.batch, inputs.seq)
        if inputs.cache is not None:
            magnitudes, values = inputs.cache.update(magnitudes, values, self.layer_idx)
        key_positions = cached_key_positions(positions, inputs.key_mask, inputs.past_length)

        positional = {
            "causal": self.causal,
            "position_ids": positions,
            "key_position_ids": key_positions,
            "attention_mask": inputs.key_mask,
            "scale": self.scale,
            **self.rope_kwargs,
        }
        head_outputs, weights = fused_unless_weights_needed(
            lambda: coca_attention(queries, magnitudes, values, **positional, validate=False),
            lambda: coca_attention_weights(queries, magnitudes, **positional).to(values.dtype),
            values,
            dropout=self.attention_dropout if self.training else 0.0,
            output_attentions=inputs.output_attentions,
        )
        return self.project_heads(head_outputs), weights


def cached_key_positions(
    positions: torch.Tensor, key_mask: torch.Tensor | None, past_length: int
) -> torch.Tensor:
    """Positions [B, past + T] of every key: the cached ones recomputed, then the current ``positions`` [B, T].

    Positions count real tokens only, so a real cached key j lies (number of real keys after j, up to the newest
    token) positions before the newest token. Padding keys get position ≥ 0 too (they are masked anyway).
    """
    if past_length == 0:
        return positions
    batch, seq = positions.shape
    real = (
        torch.ones(batch, past_length + seq, dtype=torch.long, device=positions.device)
        if key_mask is None
        else key_mask.long()
    )
    real_after = real.flip(-1).cumsum(-1).flip(-1) - real  # real keys in (j, newest]
    past_positions = (positions[:, -1:] - real_after[:, :past_length]).clamp_min(0)
    return torch.cat([past_positions, positions], dim=1)


def coca_attention_weights(
    q: torch.Tensor,
    t: torch.Tensor,
    *,
    causal: bool,
    position_ids: torch.Tensor,
    key_position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """The CoCA attention probabilities [B, H, Tq, Tk], computed explicitly (float32 inside).

    The score Σ_i t_n,i |q̃_m,i|² cos((m − n)θ_i) is the dot product of Q'_m = [a_m cos mθ, a_m sin mθ]
    (a_m,i = |q̃_m,i|²) and K'_n = [t_n cos nθ, t_n sin nθ]; masks as in :func:`softmax_attention_weights`.
    ``position_ids`` [B, Tq] and ``key_position_ids`` [B, Tk]; dynamic NTK scales for the largest of them.
    """
    head_dim = q.shape[-1]
    half = head_dim // 2
    # Queries and keys rotate with the same frequencies: one length for both (read only under dynamic NTK).
    longest = dynamic_rope_length(
        rope_scaling, rope_theta, max_position_embeddings, position_ids, key_position_ids
    )
    rotary = dict(
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        seq_len=longest,
    )
    query_cos, query_sin = rotary_cos_sin(position_ids, head_dim, **rotary)
    key_cos, key_sin = rotary_cos_sin(key_position_ids, head_dim, **rotary)
    q = q.float()
    energy = q[..., :half].square() + q[..., half:].square()
    collinear_queries = torch.cat([energy * query_cos[:, None], energy * query_sin[:, None]], dim=-1)
    t = t.float()
    collinear_keys = torch.cat([t * key_cos[:, None], t * key_sin[:, None]], dim=-1)
    return softmax_attention_weights(
        collinear_queries, collinear_keys, causal=causal, attention_mask=attention_mask, scale=scale
    )
