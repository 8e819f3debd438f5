"""Swap a pretrained model's attention for collaborative heads (Cordonnier, Loukas & Jaggi 2020, "Multi-Head
Attention: Collaborate Instead of Concatenate").

Head h of a trained layer scores query i against key j with

    s_h(i, j) = scale · (W_{Q,h} x_i + b_{Q,h})ᵀ (W_{K,h} x_j + b_{K,h})
              = scale · [x_iᵀ W_{Q,h}ᵀ W_{K,h} x_j  +  b_{Q,h}ᵀ W_{K,h} x_j  +  (terms constant over j)].

The terms constant over the keys cancel in the softmax (paper, Sec. 4), so the scores are those of
collaborative heads (their Eq. 6) with one shared query and one shared key projection of width D̃, a mixing
vector m_h per head and a per-head content bias:

    s_h(i, j) = scale · [(W̃_Q x_i ⊙ m_h)ᵀ (W̃_K x_j)  +  c_hᵀ x_j],   c_h = W_{K,h}ᵀ b_{Q,h},

given W_{Q,h}ᵀ W_{K,h} = W̃_Qᵀ diag(m_h) W̃_K for every head. At D̃ = heads·head_dim this holds exactly with the
concatenated projections and a block 0/1 mixing; below it, :func:`headkit.surgery.decompose.decompose_query_key`
finds the best rank-D̃ CP fit. The scale stays the model's own (1/√head_dim): the reference implementation's
rescaling by √(D̃/H) changes every compressed model's attention temperature.

Values, the output projection and everything outside attention are untouched. :func:`swap_to_collaborative`
validates everything and computes every new module before it replaces any, so a failure leaves the model as
it was; the swap is recorded in ``config.headkit_surgery`` so that ``headkit.from_pretrained`` can reload a
saved model.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.collaborative import collaborative_head_outputs
from headkit.ops._validation import check_positive_int
from headkit.surgery.adapters import (
    AttentionAdapter,
    AttentionSite,
    ReplacementAttention,
    checked_model_mask,
    count_parameters,
    get_adapter,
    new_linear,
)
from headkit.surgery.decompose import decompose_query_key
from headkit.surgery.io import record_surgery, register_surgery_op

SURGERY_OP = "collaborative"


class CollaborativeSelfAttention(ReplacementAttention):
    """Collaborative heads standing in for one attention module of a 🤗 model.

    Takes the replaced module's call (its signature, any of the mask forms transformers sends, its KV cache) and
    returns what it returned, ``(output, attention_weights or None)``; weights are computed only when the model
    asks for them (``output_attentions``). Children: ``query_shared`` and ``key_shared`` (``nn.Linear`` hidden → D̃,
    no bias), ``mixing`` [heads, D̃], ``content_bias`` (``nn.Linear`` hidden → heads, no bias, row h = c_h; None
    when the model has no query bias), the value projection and, when the replaced module ran them, its output
    projection / dropout / residual LayerNorm, all under the replaced module's attribute names.

    The heads themselves — KV cache layout, fused kernel or explicit weights — are
    :func:`headkit.layers.collaborative.collaborative_head_outputs`, the implementation behind headkit's own
    :class:`headkit.layers.CollaborativeAttention`; this class only holds the weights under a pretrained model's
    names and speaks its calling convention.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        dim_shared_query_key: int,
        value_name: str,
        value: nn.Module,
        has_content_bias: bool,
        scale: float,
        causal: bool,
        attention_dropout: float,
        layer_idx: int | None,
        call_signature: inspect.Signature,
        epilogue: dict[str, tuple[str, nn.Module]] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not super(): replace_attention may mix a 🤗 class into this one's bases
        self.num_heads = self.num_kv_heads = num_heads
        self.head_dim = head_dim
        self.dim_shared_query_key = dim_shared_query_key
        self.scale = scale
        self.is_causal = causal
        self.attention_dropout_p = attention_dropout
        self.layer_idx = layer_idx
        self.call_signature = call_signature
        factory = {"dtype": dtype, "device": device}
        self.query_shared = nn.Linear(hidden_size, dim_shared_query_key, bias=False, **factory)
        self.key_shared = nn.Linear(hidden_size, dim_shared_query_key, bias=False, **factory)
        self.mixing = nn.Parameter(torch.zeros(num_heads, dim_shared_query_key, **factory))
        self.content_bias = (
            nn.Linear(hidden_size, num_heads, bias=False, **factory) if has_content_bias else None
        )
        self.value_name = value_name
        self.add_module(value_name, value)
        self.add_epilogue(epilogue)  # output projection, dropout, residual norm: whatever ran after the heads

    def forward(
        self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        call = self.bind_call(hidden_states, args, kwargs)
        if call.encoder_hidden_states is not None:
            raise HeadkitError(
                "collaborative attention replaces self-attention only; got encoder_hidden_states"
            )
        batch, q_len, _ = hidden_states.shape
        values = getattr(self, self.value_name)(hidden_states)
        values = values.view(batch, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        # The content-bias scores [B, T, H], scaled like the mixed dot products they are added to.
        key_bias = None if self.content_bias is None else self.scale * self.content_bias(hidden_states)
        cache = call.cache
        if cache is not None:
            if self.layer_idx is None:
                raise HeadkitError("this attention module has no layer_idx, so it cannot use a KV cache")
            cache = getattr(cache, "self_attention_cache", cache)
        kv_len = q_len + (0 if cache is None else cache.get_seq_length(self.layer_idx))
        heads, weights = collaborative_head_outputs(
            self.query_shared(hidden_states),
            self.key_shared(hidden_states),
            key_bias,
            values,
            self.mixing,
            scale=self.scale,
            causal=self.is_causal,
            attention_mask=model_attention_mask(call.attention_mask, batch, q_len, kv_len),
            cache=cache,
            layer_idx=self.layer_idx,
            dropout=self.attention_dropout_p if self.training else 0.0,
            output_attentions=call.output_attentions,
        )
        output = heads.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)
        output = self._epilogue(output, hidden_states)
        return output, weights

    def _epilogue(self, output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        roles = self.epilogue_roles
        if "projection" in roles:
            output = getattr(self, roles["projection"])(output)
        if "dropout" in roles:
            output = getattr(self, roles["dropout"])(output)
        if "norm" in roles:
            output = getattr(self, roles["norm"])(hidden_states + output)
        return output

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, dim_shared_query_key={self.dim_shared_query_key}, "
            f"scale={self.scale:.6g}, causal={self.is_causal}"
        )


def model_attention_mask(attention_mask: Any, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """The mask a 🤗 model hands its attention module, in a form :func:`headkit.ops.collaborative_attention`
    takes without a [Tq, Tk] score mask where it can: None, a key padding mask [B, Tk], or a 4D mask
    [B, 1|H, 1|Tq, Tk] (bool True = keep, or additive float) reduced to one query row when every row is the same.

    🤗 encoders build the padding mask of a batch as a full [B, 1, Tq, Tk] tensor (sdpa: bool, eager: additive);
    combined with the per-head content bias it would become [B, H, Tq, Tk], so a mask that does not vary over
    the queries is passed on as its first row.
    """
    attention_mask = checked_model_mask(attention_mask, batch, q_len, kv_len)
    if attention_mask is None or attention_mask.dim() == 2:
        return attention_mask
    first_row = attention_mask[:, :, :1]
    if attention_mask.shape[2] > 1 and torch.equal(attention_mask, first_row.expand_as(attention_mask)):
        return first_row
    return attention_mask


# -- the swap ---------------------------------------------------------------------------------------------------


@dataclass
class SiteReport:
    """One swapped attention module: relative reconstruction error ‖T − T̂‖/‖T‖ of its heads' bilinear forms."""

    name: str
    layers: tuple[int, ...]
    relative_error: float
    iterations: int
    exact: bool
    seconds: float


@dataclass
class SwapReport:
    """What :func:`swap_to_collaborative` did."""

    architecture: str
    dim_shared_query_key: int
    parameters_before: int
    parameters_after: int
    seconds: float
    sites: list[SiteReport] = field(default_factory=list)

    @property
    def max_relative_error(self) -> float:
        return max((site.relative_error for site in self.sites), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"max_relative_error": self.max_relative_error}

    def __str__(self) -> str:
        lines = [
            f"collaborative swap ({self.architecture}, D̃={self.dim_shared_query_key}): "
            f"{len(self.sites)} attention modules in {self.seconds:.2f} s; parameters "
            f"{self.parameters_before:,} -> {self.parameters_after:,}"
        ]
        for site in self.sites:
            lines.append(
                f"  {site.name} (layers {','.join(map(str, site.layers))}): relative error {site.relative_error:.3e}"
                f"{' (exact)' if site.exact else f', {site.iterations} ALS sweeps'}"
            )
        return "\n".join(lines)


def swap_to_collaborative(
    model: nn.Module,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    *,
    dim_shared_query_key: int,
    seed: int = 0,
    tol: float = 1e-7,
    max_iter: int = 500,
) -> SwapReport:
    """Re-express every self-attention module of `model` with collaborative heads, in place.

    Args:
        model: a 🤗 model of a supported architecture (see :mod:`headkit.surgery.adapters`).
        adapter: the architecture's adapter (class, instance or name), as in the reference package's
            ``swap_to_collaborative(model, BERTCollaborativeAdapter, ...)``; detected from the model when None.
        dim_shared_query_key: D̃, the width of the shared query/key projections: heads·head_dim is exact,
            smaller compresses the query/key projections (by CP decomposition). At most the hidden size.
        seed, tol, max_iter: passed to :func:`headkit.surgery.decompose.decompose_query_key`.

    Returns:
        A :class:`SwapReport`: per-module relative reconstruction error, parameters before/after, time.

    Raises:
        HeadkitError / ValueError: unsupported architecture, D̃ out of range, a model already swapped, rotary or
        grouped-query attention. The model is then left untouched.
    """
    start = time.perf_counter()
    adapter = get_adapter(model, adapter)
    check_positive_int("dim_shared_query_key", dim_shared_query_key)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol must be a non-negative number, got {tol!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"max_iter must be a non-negative integer, got {max_iter!r}")
    sites = adapter.sites(model)
    _check_swappable(adapter, sites, dim_shared_query_key)

    parameters_before = count_parameters(model)
    planned = [
        _plan_site(
            adapter, site, dim_shared_query_key, decompose={"seed": seed, "tol": tol, "max_iter": max_iter}
        )
        for site in sites
    ]
    # Everything is computed: only now does the model change.
    for site, (module, _) in zip(sites, planned, strict=True):
        adapter.replace_attention(model, site, module)
    record_surgery(model, _surgery_entry(adapter, sites, dim_shared_query_key))
    return SwapReport(
        architecture=adapter.name,
        dim_shared_query_key=dim_shared_query_key,
        parameters_before=parameters_before,
        parameters_after=count_parameters(model),
        seconds=time.perf_counter() - start,
        sites=[report for _, report in planned],
    )


def _check_swappable(adapter: AttentionAdapter, sites: list[AttentionSite], dim_shared: int) -> None:
    if not sites:
        raise HeadkitError(f"the {adapter.name} adapter found no attention module in this model")
    if adapter.rotary:
        raise HeadkitError(
            f"{adapter.name} applies rotary position embeddings to queries and keys, so its scores are not a "
            "bilinear form of the hidden states and cannot be re-expressed with collaborative heads"
        )
    for site in sites:
        if isinstance(site.module, CollaborativeSelfAttention):
            raise HeadkitError(f"the model is already swapped to collaborative attention ({site.name})")
        if site.is_headkit:
            raise HeadkitError(
                f"{site.name} was already replaced by {type(site.module).__name__}; cannot swap it"
            )
        if site.num_kv_heads != site.num_heads:
            raise HeadkitError(
                f"{site.name} uses grouped-query attention ({site.num_heads} query, {site.num_kv_heads} key/value "
                "heads), which the collaborative swap does not support"
            )
        hidden = adapter.read_projections(site).q_weight.shape[1]
        full = site.num_heads * site.head_dim
        if dim_shared > hidden and dim_shared != full:
            raise HeadkitError(
                f"dim_shared_query_key must be at most the hidden size {hidden} (or heads·head_dim = {full}, "
                f"the exact size), got {dim_shared}"
            )


def _plan_site(
    adapter: AttentionAdapter, site: AttentionSite, dim_shared: int, *, decompose: dict[str, Any] | None
) -> tuple[CollaborativeSelfAttention, SiteReport]:
    """Build the replacement for one site without touching the model. With `decompose` None the shared
    projections are left at zero: the structure :func:`headkit.from_pretrained` loads saved weights into."""
    start = time.perf_counter()
    weights = adapter.read_projections(site)
    heads, head_dim = site.num_heads, site.head_dim
    hidden = weights.q_weight.shape[1]
    dtype, device = weights.q_weight.dtype, weights.q_weight.device

    if adapter.value_name in (adapter.query_name, adapter.key_name):  # fused projection: carve the values out
        value_name, value = "value", new_linear(weights.v_weight, weights.v_bias)
    else:
        value_name, value = adapter.value_name, site.module.get_submodule(adapter.value_name)
    module = CollaborativeSelfAttention(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        dim_shared_query_key=dim_shared,
        value_name=value_name,
        value=value,
        has_content_bias=weights.q_bias is not None,
        scale=site.scale,
        causal=site.causal,
        attention_dropout=adapter.attention_dropout(site.module),
        layer_idx=getattr(site.module, "layer_idx", None),
        call_signature=inspect.signature(type(site.module).forward),
        epilogue=adapter.epilogue_modules(site),
        dtype=dtype,
        device=device,
    )
    report = SiteReport(site.name, site.layers, relative_error=0.0, iterations=0, exact=False, seconds=0.0)
    if decompose is not None:
        w_q_shared, mixing, w_k_shared, info = decompose_query_key(
            weights.q_weight, weights.k_weight, heads, dim_shared, return_info=True, **decompose
        )
        with torch.no_grad():
            module.query_shared.weight.copy_(w_q_shared)
            module.key_shared.weight.copy_(w_k_shared)
            module.mixing.copy_(mixing)
            if module.content_bias is not None:
                module.content_bias.weight.copy_(content_bias_weight(weights.q_bias, weights.k_weight, heads))
        report.relative_error, report.iterations, report.exact = (
            info.relative_error,
            info.iterations,
            info.exact,
        )
    report.seconds = time.perf_counter() - start
    return module, report


def content_bias_weight(q_bias: torch.Tensor, k_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[heads, hidden]: row h is c_h = W_{K,h}ᵀ b_{Q,h}, the part of head h's score that the query bias adds and
    that varies over keys (computed in float64, returned in the weights' dtype)."""
    hidden = k_weight.shape[1]
    per_head_bias = q_bias.detach().to(torch.float64).view(num_heads, -1)
    per_head_key = k_weight.detach().to(torch.float64).view(num_heads, -1, hidden)
    return torch.einsum("hd,hdi->hi", per_head_bias, per_head_key).to(k_weight.dtype)


def _surgery_entry(adapter: AttentionAdapter, sites: list[AttentionSite], dim_shared: int) -> dict[str, Any]:
    return {
        "op": SURGERY_OP,
        "adapter": adapter.name,
        "dim_shared_query_key": dim_shared,
        "sites": [site.name for site in sites],
    }


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the collaborative structure recorded in `entry` on a freshly built model (weights load after)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = adapter.sites(model)
    if [site.name for site in sites] != list(entry["sites"]):
        raise HeadkitError(
            f"the recorded collaborative swap covered {entry['sites']}, but the rebuilt model has attention "
            f"modules {[site.name for site in sites]}"
        )
    dim_shared = int(entry["dim_shared_query_key"])
    _check_swappable(adapter, sites, dim_shared)
    planned = [_plan_site(adapter, site, dim_shared, decompose=None) for site in sites]
    for site, (module, _) in zip(sites, planned, strict=True):
        adapter.replace_attention(model, site, module)


register_surgery_op(SURGERY_OP, _reapply)
