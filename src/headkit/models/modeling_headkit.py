"""🤗-native headkit models: a pre-norm decoder whose attention layers come from the registry.

Each block is x + Attn(RMSNorm(x)) then x + MLP(RMSNorm(x)) (pre-norm, Xiong et al. 2020, "On Layer
Normalization in the Transformer Architecture"; RMSNorm, Zhang & Sennrich 2019; SwiGLU MLP, Shazeer 2020),
with the attention layer built by :func:`headkit.layers.build_attention` from ``config.attention_type(i)``.
The models follow transformers' conventions (``PreTrainedModel``, ``GenerationMixin``, ``Cache``), so
``Trainer``, PEFT and ``generate()`` work unchanged; generation state lives in a
:class:`~headkit.layers.HeadkitCache` that the model creates itself.

Padding: ``attention_mask`` [B, past + T] marks real tokens over the whole sequence so far (as ``generate()``
passes it); positions count real tokens only (cumsum of the mask, as in LLaMA), so a left-padded sequence
gets the same positions, hence the same logits, as the unpadded one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, GradientCheckpointingLayer, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)

from headkit.compat import CACHE_ARGUMENT_NAMES, accepts_cache_alias, cache_output, output_cache
from headkit.layers import HeadkitAttention, HeadkitCache, StateCacheLayer, build_attention
from headkit.models.configuration_headkit import HeadkitConfig
from headkit.ops._validation import check_batch_position_ids, check_padding_mask, check_rank


class HeadkitRMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019, Eq. 4): x / √(mean(x²) + ε) · g, computed in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op instead of seven: at batch 1 a decoding step is made of per-op overheads.
            return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.eps)
        as_float = hidden_states.float()
        normalised = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normalised.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class HeadkitMLP(nn.Module):
    """The feed-forward block: gated — down(act(gate(x)) ⊙ up(x)), SwiGLU for act=silu (Shazeer 2020, Eq. 6) —
    or plain — down(act(up(x))), the GELU MLP of GPT-2/BERT for act=gelu."""

    def __init__(self, config: HeadkitConfig) -> None:
        super().__init__()
        width, bias = config.intermediate_size, config.mlp_bias
        self.gate_proj = (
            nn.Linear(config.hidden_size, width, bias=bias) if config.mlp_type == "gated" else None
        )
        self.up_proj = nn.Linear(config.hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act_fn(self.up_proj(hidden_states)))
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class HeadkitDecoderLayer(GradientCheckpointingLayer):
    """One pre-norm block: attention of the configured type, then the MLP, each with a residual connection."""

    def __init__(self, config: HeadkitConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = HeadkitRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = build_attention(config, layer_idx)
        self.post_attention_layernorm = HeadkitRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = HeadkitMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    @accepts_cache_alias
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # HeadkitModel.forward has checked the mask and the positions once, for every layer: say so to a layer
        # that can skip its own checks (per call, so the layer on its own checks them again).
        trusted = (
            {"inputs_validated": True} if getattr(self.self_attn, "takes_inputs_validated", False) else {}
        )
        attention_output, attention_weights = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            output_attentions=output_attentions,
            **trusted,
        )
        hidden_states = hidden_states + self.dropout(attention_output)
        hidden_states = hidden_states + self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
        return hidden_states, attention_weights


class HeadkitPreTrainedModel(PreTrainedModel):
    """Weight initialisation, cache policy and the transformers class attributes shared by headkit models.

    The embedding accessors are transformers' own: ``embed_tokens`` (on the model, or on its ``model``) and
    ``lm_head``.
    """

    config_class = HeadkitConfig
    config: HeadkitConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HeadkitDecoderLayer"]
    _skip_keys_device_placement = list(CACHE_ARGUMENT_NAMES)

    def _init_weights(self, module: nn.Module) -> None:
        # Linear/Embedding/RMSNorm are handled by transformers (normal(0, initializer_range), ones, zeros);
        # mechanism-specific parameters by the layer itself.
        super()._init_weights(module)
        if isinstance(module, HeadkitAttention):
            module.init_extra_parameters(self.config.initializer_range)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not create a DynamicCache: recurrent layers need a HeadkitCache, which
        # HeadkitModel.forward creates on the first step and returns for the following ones.
        return False

    @property
    def _is_stateful(self) -> bool:
        # Recurrent states cannot be rolled back, which rules out assisted generation.
        return any(
            issubclass(module.cache_layer_class, StateCacheLayer)
            for module in self.modules()
            if isinstance(module, HeadkitAttention)
        )


class HeadkitModel(HeadkitPreTrainedModel):
    """The decoder stack without a head: embeddings → blocks → final RMSNorm."""

    def __init__(self, config: HeadkitConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned"
            else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(
            [HeadkitDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = HeadkitRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    @accepts_cache_alias
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> BaseModelOutputWithPast | tuple:
        """Run the decoder.

        Args:
            input_ids: token ids [B, T] (or ``inputs_embeds`` [B, T, hidden_size] instead).
            attention_mask: [B, past + T] bool or 0/1, 1 = real token, covering the cached tokens and the new ones.
            position_ids: [B or 1, T]; default: from the mask's cumulative sum, else past, …, past + T − 1.
            cache: a :class:`HeadkitCache`, updated in place; created when ``use_cache`` and None. Also taken
                as ``past_key_values`` (transformers' name before 5.24).
            use_cache: default: True when a cache is given or, outside training, ``config.use_cache``.
            output_attentions: per layer, its attention weights [B, H, T, past + T] (None for mechanisms
                without explicit weights).
            output_hidden_states: the embeddings, then each block's output; the last entry is after the
                final norm (what the LM head reads).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(
                "pass exactly one of input_ids [batch, seq] or inputs_embeds [batch, seq, hidden_size]"
            )
        if inputs_embeds is None:
            check_rank("input_ids", input_ids, 2, "[batch, seq]")
            inputs_embeds = self.embed_tokens(input_ids)
        else:
            check_rank("inputs_embeds", inputs_embeds, 3, "[batch, seq, hidden_size]")
        batch, seq = inputs_embeds.shape[:2]
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        return_dict = config.return_dict if return_dict is None else return_dict

        use_cache = self._resolve_use_cache(use_cache, cache)
        if use_cache and cache is None:
            cache = HeadkitCache(self)
        self._check_cache(cache)
        past_length = 0 if cache is None else cache.get_seq_length()

        if past_length and isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] == seq:
            raise ValueError(
                f"attention_mask must cover the {past_length} cached tokens and the {seq} new ones: shape "
                f"[{batch}, {past_length + seq}] (as generate() passes it), got {tuple(attention_mask.shape)}"
            )
        key_mask = check_padding_mask(attention_mask, batch, past_length + seq)
        if key_mask is not None:
            key_mask = key_mask.to(inputs_embeds.device)
        position_ids = self._position_ids(
            position_ids, key_mask, batch, seq, past_length, inputs_embeds.device
        )

        hidden_states = inputs_embeds
        if self.embed_positions is not None:
            longest = int(position_ids.max()) + 1 if position_ids.numel() else 0
            if longest > config.max_position_embeddings:
                raise ValueError(
                    f"the input reaches position {longest - 1}, beyond max_position_embeddings="
                    f"{config.max_position_embeddings} (learned absolute positions cannot extrapolate)"
                )
            hidden_states = hidden_states + self.embed_positions(position_ids)
        hidden_states = self.dropout(hidden_states)

        all_hidden_states: tuple[torch.Tensor, ...] = ()
        all_attentions: tuple[torch.Tensor | None, ...] = ()
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, attention_weights = layer(
                hidden_states,
                attention_mask=key_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                output_attentions=output_attentions,
            )
            if output_attentions:
                all_attentions += (attention_weights,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            **cache_output(cache if use_cache else None),
            hidden_states=all_hidden_states if output_hidden_states else None,
            attentions=all_attentions if output_attentions else None,
        )
        return output if return_dict else output.to_tuple()

    def _resolve_use_cache(self, use_cache: bool | None, cache: Any) -> bool:
        if not self.config.causal:
            if use_cache or cache is not None:
                raise ValueError("use_cache / cache need a causal model (config.causal=True)")
            return False
        if use_cache is None:
            return cache is not None or (self.config.use_cache and not self.training)
        if not use_cache and cache is not None:
            raise ValueError("a cache was given with use_cache=False; pass use_cache=True to use it")
        return bool(use_cache)

    def _check_cache(self, cache: Any) -> None:
        if cache is None:
            return
        if not isinstance(cache, Cache):
            raise ValueError(f"cache must be a headkit.layers.HeadkitCache, got {type(cache).__name__}")
        attention_layers = [layer.self_attn for layer in self.layers]
        if isinstance(cache, HeadkitCache):
            if len(cache.layers) != len(attention_layers):
                raise ValueError(f"cache has {len(cache.layers)} layers, the model {len(attention_layers)}")
            for attention, entry in zip(attention_layers, cache.layers, strict=True):
                if not isinstance(entry, attention.cache_layer_class):
                    raise ValueError(
                        f"cache layer {attention.layer_idx} is a {type(entry).__name__}, but "
                        f"{type(attention).__name__} needs a {attention.cache_layer_class.__name__}; "
                        "build the cache with HeadkitCache(model)"
                    )
        elif any(issubclass(a.cache_layer_class, StateCacheLayer) for a in attention_layers):
            raise ValueError(
                f"this model has recurrent attention layers, which need a headkit.layers.HeadkitCache; got "
                f"{type(cache).__name__}"
            )

    @staticmethod
    def _position_ids(
        position_ids: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        batch: int,
        seq: int,
        past_length: int,
        device: torch.device,
    ) -> torch.Tensor:
        if position_ids is not None:
            return check_batch_position_ids(position_ids, batch, seq).to(device).expand(batch, seq)
        if key_mask is None:
            return torch.arange(past_length, past_length + seq, device=device)[None].expand(batch, seq)
        # Count real tokens only, so left padding does not shift positions; padding itself gets position 0.
        positions = key_mask.long().cumsum(-1) - 1
        return positions.masked_fill(~key_mask, 0)[:, -seq:]


class HeadkitForCausalLM(HeadkitPreTrainedModel, GenerationMixin):
    """A headkit decoder with a language-modelling head; ``labels`` give the shifted cross-entropy loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Trainer passes num_items_in_batch, so gradient accumulation weighs every token equally.
    accepts_loss_kwargs = True

    def __init__(self, config: HeadkitConfig) -> None:
        super().__init__(config)
        self.model = HeadkitModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @accepts_cache_alias
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits [B, T, vocab] (the last ``logits_to_keep`` positions when non-zero) and, with ``labels`` [B, T]
        (-100 = ignored), the loss of predicting token t + 1 from positions ≤ t, averaged over labelled tokens
        (or summed and divided by ``num_items_in_batch`` when given)."""
        if labels is not None:
            reference = input_ids if input_ids is not None else inputs_embeds
            if reference is not None:
                _check_labels(labels, tuple(reference.shape[:2]))
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                raise ValueError("labels need the logits of every position: leave logits_to_keep=0")
        return_dict = self.config.return_dict if return_dict is None else return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.lm_head(_last_positions(outputs.last_hidden_state, logits_to_keep))

        loss = None
        if labels is not None:
            label_smoothing = self.config.label_smoothing if self.training else 0.0
            loss = causal_lm_loss(
                logits, labels, label_smoothing=label_smoothing, num_items_in_batch=num_items_in_batch
            )
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **cache_output(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


class HeadkitForSequenceClassification(HeadkitPreTrainedModel):
    """A headkit decoder with a linear classifier on the last real token of each sequence.

    The last real token is the rightmost position with ``attention_mask`` = 1 (left or right padding), else
    the rightmost token that is not ``config.pad_token_id``, else the last position. ``labels`` follow
    transformers' ``problem_type`` rules (regression, single- or multi-label classification).
    """

    def __init__(self, config: HeadkitConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = HeadkitModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> SequenceClassifierOutputWithPast | tuple:
        return_dict = self.config.return_dict if return_dict is None else return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        hidden_states = outputs.last_hidden_state
        batch, seq = hidden_states.shape[:2]
        if labels is not None and labels.shape[0] != batch:
            raise ValueError(
                f"labels must have {batch} rows (one per sequence), got shape {tuple(labels.shape)}"
            )

        real_tokens = None
        if attention_mask is not None:
            real_tokens = attention_mask.bool()
        elif input_ids is not None and self.config.pad_token_id is not None:
            real_tokens = input_ids != self.config.pad_token_id
        if real_tokens is None:
            last_token = torch.full((batch,), seq - 1, device=hidden_states.device)
        else:
            token_index = torch.arange(seq, device=hidden_states.device)
            last_token = (token_index * real_tokens.to(hidden_states.device)).argmax(-1)
        pooled_logits = self.score(
            hidden_states[torch.arange(batch, device=hidden_states.device), last_token]
        )

        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=pooled_logits, config=self.config)
        output = SequenceClassifierOutputWithPast(
            loss=loss,
            logits=pooled_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Next-token cross-entropy: logits[:, t] predict labels[:, t + 1]; ``ignore_index`` labels are skipped.

    Mean over the labelled tokens, or their sum divided by ``num_items_in_batch`` (Trainer's count over the
    whole gradient-accumulation batch). Computed in float32; the inputs are only read.
    """
    vocab = logits.shape[-1]
    shifted_logits = logits[:, :-1].reshape(-1, vocab).float()
    shifted_labels = labels[:, 1:].reshape(-1).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(
        shifted_logits,
        shifted_labels,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


def _last_positions(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions the LM head reads, as transformers' ``logits_to_keep`` means them: 0 keeps every position,
    an int n the last n, a 1D tensor those sequence indices."""
    if isinstance(logits_to_keep, int):
        return hidden_states if logits_to_keep == 0 else hidden_states[:, -logits_to_keep:]
    return hidden_states[:, logits_to_keep]


def _check_labels(labels: Any, expected_shape: tuple[int, int]) -> None:
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(
            f"labels must be an integer tensor of shape [batch, seq] = {list(expected_shape)}, got {got}"
        )
    if tuple(labels.shape) != expected_shape:
        raise ValueError(
            f"labels must have the input's shape [batch, seq] = {list(expected_shape)}, got {tuple(labels.shape)}"
        )


__all__ = [
    "HeadkitDecoderLayer",
    "HeadkitForCausalLM",
    "HeadkitForSequenceClassification",
    "HeadkitMLP",
    "HeadkitModel",
    "HeadkitPreTrainedModel",
    "HeadkitRMSNorm",
    "causal_lm_loss",
]
