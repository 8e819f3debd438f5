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
finds the best rank-D̃ CP fit. The scale stays the model's own (the ``scaling`` its module passes; 1/√head_dim
for most): the reference implementation's rescaling by √(D̃/H) changes every compressed model's attention
temperature.

**Through transformers' extension points** (:mod:`headkit.surgery.attention`). The stock attention module keeps
its class, forward, value and output projections, dropout, KV cache handling and masks. Its forward projects,
views each projection as ``[..., -1, head_dim]``, updates the cache and calls the attention interface; so:

* its query projection becomes a :class:`SharedProjection` computing W̃_Q x, and its key projection one computing
  [W̃_K x | C x] (C [heads, hidden]: row h = c_h, the content-bias logits), each zero-padded to a multiple of
  head_dim so that the stock view takes it as "heads" of head_dim. The cache so stores, per token, the shared
  key with its content logits (padded) as the keys and the stock values. GPT-2's fused ``c_attn`` becomes a
  :class:`FusedSharedProjection` [q̃ | k̃ | v] whose split widths the adapter sets
  (:meth:`~headkit.surgery.adapters.AttentionAdapter.set_fused_widths`);
* the module gains the :class:`CollaborativeHeads` mechanism (``headkit_attention``, holding ``mixing``), which
  the registered ``headkit_<base>`` attention runs in place of softmax: it flattens the views back, drops the
  padding and computes the heads with :func:`headkit.layers.collaborative.collaborative_head_outputs`, under the
  model's own mask, scale and dropout. It returns weights [B, H, Tq, Tk] where the base implementation would
  (eager: always) or where the model passes ``output_attentions``.

Values, the output projection and everything outside attention are untouched. :func:`swap_to_collaborative`
validates everything (its :class:`CollaborativeConfig`, checked against the model; :meth:`CollaborativeConfig.check`
also takes a 🤗 config, before the weights are loaded) and computes every new module before it changes any, so a
failure leaves the model as it was; the swap is recorded in ``config.headkit_surgery`` (the config, and the
modules swapped) so that ``headkit.from_pretrained`` replays it on a freshly built model and loads the saved
weights strictly.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.collaborative import (
    collaborative_head_outputs,
    content_bias_weight,
    pack_shared_keys,
    unpack_shared_keys,
)
from headkit.surgery.adapters import (
    AttentionAdapter,
    AttentionSite,
    checked_model_mask,
    count_parameters,
    get_adapter,
    new_linear,
)
from headkit.surgery.attention import (
    AttentionCall,
    attach_mechanisms,
    mechanism_of,
    refuse_modules_off_the_interface,
)
from headkit.surgery.decompose import decompose_query_key
from headkit.surgery.families import COMPRESS, FAMILIES, get_family
from headkit.surgery.records import (
    config_in_place_of,
    fields_of_record,
    given_config,
    record_surgery,
    register_conversion,
    say_deprecated,
)

SURGERY_OP = "collaborative"


def padded_width(width: int, head_dim: int) -> int:
    """`width` rounded up to a multiple of `head_dim` (what the stock view ``[..., -1, head_dim]`` takes)."""
    return -(-width // head_dim) * head_dim


class SharedProjection(nn.Module):
    """A shared query or key projection in place of a stock one: x ↦ [x W̃ᵀ | x Cᵀ | 0].

    ``weight`` [D̃, hidden] is W̃_Q or W̃_K; ``content_bias`` [heads, hidden] (key side only, None elsewhere) appends
    each head's content-bias logit c_hᵀ x, unscaled; zeros pad the output to ``out_features``, a multiple of
    head_dim, so that the stock module's view ``[..., -1, head_dim]`` and its KV cache take it unchanged. The
    padding holds no parameter.
    """

    def __init__(
        self,
        hidden_size: int,
        dim_shared_query_key: int,
        head_dim: int,
        *,
        content_heads: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.zeros(dim_shared_query_key, hidden_size, **factory))
        self.content_bias = (
            nn.Parameter(torch.zeros(content_heads, hidden_size, **factory)) if content_heads else None
        )
        self.in_features = hidden_size
        self.out_features = padded_width(dim_shared_query_key + content_heads, head_dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        content = None if self.content_bias is None else F.linear(hidden_states, self.content_bias)
        output = pack_shared_keys(F.linear(hidden_states, self.weight), content)
        padding = self.out_features - output.shape[-1]
        return F.pad(output, (0, padding)) if padding else output

    def extra_repr(self) -> str:
        content = 0 if self.content_bias is None else self.content_bias.shape[0]
        return (
            f"in_features={self.in_features}, dim_shared_query_key={self.weight.shape[0]}, "
            f"content_heads={content}, out_features={self.out_features}"
        )


class FusedSharedProjection(nn.Module):
    """A fused query/key/value projection (GPT-2's ``c_attn``) rebuilt as [q̃ | k̃ | v]: ``query`` and ``key``
    :class:`SharedProjection`, ``value`` the stock value projection carved out of the fused one. ``widths``
    are the three parts' widths, which the adapter tells the stock module to split by."""

    def __init__(
        self, query: SharedProjection, key: SharedProjection, value: nn.Module, value_width: int
    ) -> None:
        super().__init__()
        self.query, self.key, self.value = query, key, value
        self.value_width = value_width

    @property
    def widths(self) -> tuple[int, int, int]:
        return self.query.out_features, self.key.out_features, self.value_width

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [self.query(hidden_states), self.key(hidden_states), self.value(hidden_states)], dim=-1
        )


class CollaborativeHeads(nn.Module):
    """The mechanism of a layer with collaborative heads (``<attention module>.headkit_attention``).

    Called by the registered ``headkit_<base>`` attention with what the stock module computed: queries
    [B, ⌈D̃/head_dim⌉, Tq, head_dim] (the padded shared queries), keys [B, ⌈(D̃ + H')/head_dim⌉, Tk, head_dim] (the
    padded shared keys and content logits of every cached and current token; H' = heads with a content bias, 0
    without), values [B, H, Tk, head_dim]; returns ``(output [B, Tq, H, head_dim], weights [B, H, Tq, Tk] or
    None)``. Holds ``mixing`` [heads, D̃]; ``head_geometry`` tells the adapters the heads it defines.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        head_dim: int,
        dim_shared_query_key: int,
        has_content_bias: bool,
        scale: float,
        causal: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.dim_shared_query_key = dim_shared_query_key
        self.has_content_bias = has_content_bias
        self.scale = scale
        self.is_causal = causal
        self.mixing = nn.Parameter(torch.zeros(num_heads, dim_shared_query_key, dtype=dtype, device=device))

    @property
    def head_geometry(self) -> tuple[int, int, int]:
        """(num_heads, num_kv_heads, head_dim) of the heads this mechanism computes."""
        return self.num_heads, self.num_heads, self.head_dim

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        queries, keys, values = call.queries, call.keys, call.values
        batch, _, q_len, _ = queries.shape
        kv_len = keys.shape[2]
        dim_shared = self.dim_shared_query_key
        shared_queries = queries.transpose(1, 2).reshape(batch, q_len, -1)[..., :dim_shared]
        shared_keys, content_logits = unpack_shared_keys(
            keys.transpose(1, 2).reshape(batch, kv_len, -1),
            dim_shared,
            self.num_heads if self.has_content_bias else 0,
        )
        heads, weights = collaborative_head_outputs(
            shared_queries,
            shared_keys,
            content_logits,
            values,
            self.mixing,
            scale=call.scale(self.scale),
            causal=self.is_causal,
            attention_mask=model_attention_mask(call.attention_mask, batch, q_len, kv_len),
            dropout=call.dropout,
            # eager attention returns its weights always (GPT-2 drops the flag before its attention modules)
            output_attentions=bool(call.options.get("output_attentions")) or call.base == "eager",
        )
        return heads.transpose(1, 2), weights

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, dim_shared_query_key={self.dim_shared_query_key}, "
            f"content_bias={self.has_content_bias}, scale={self.scale:.6g}, causal={self.is_causal}"
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


@dataclass(frozen=True)
class CollaborativeConfig:
    """How :func:`swap_to_collaborative` re-expresses a model's attention: the one declaration of each option.

    Built, it checks its types and ranges; :meth:`check` checks it against a model, or only its 🤗 config (no
    rotary or grouped-query attention, D̃ within the hidden size), before any decomposition or weight change. The
    model's ``config.headkit_surgery`` records it (:meth:`record`), and :func:`headkit.from_pretrained` rebuilds
    the structure from that record (:meth:`from_record`), records written before the fit's fields were recorded
    included.

    Attributes:
        dim_shared_query_key: D̃ ≥ 1, the width of the shared query/key projections: heads·head_dim is exact,
            smaller compresses the query/key projections (by CP decomposition). At most the hidden size.
        seed, tol, max_iter: the fit's (:func:`headkit.surgery.decompose.decompose_query_key`): its random
            start, its relative-improvement tolerance (≥ 0) and its most ALS sweeps (≥ 0).
    """

    # Each field's metadata makes it a command-line option where a command takes this config's fields
    # (headkit.runs.options).
    dim_shared_query_key: int = field(
        metadata={
            "help": "Width D̃ of the shared query/key projections (heads·head_dim is exact; smaller compresses).",
            "min": 1,
        }
    )
    seed: int = field(default=0, metadata={"help": "Seed of the CP decomposition's start."})
    tol: float = field(
        default=1e-7, metadata={"help": "Relative-improvement tolerance of the CP decomposition.", "min": 0.0}
    )
    max_iter: int = field(
        default=500, metadata={"help": "Most ALS sweeps of the CP decomposition.", "min": 0}
    )

    def __post_init__(self) -> None:
        dim = self.dim_shared_query_key
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise HeadkitError(f"dim_shared_query_key must be a positive integer, got {dim!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise HeadkitError(f"seed must be an integer, got {self.seed!r}")
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise HeadkitError(f"tol must be a non-negative number, got {tol!r}")
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, int) or self.max_iter < 0:
            raise HeadkitError(f"max_iter must be a non-negative integer, got {self.max_iter!r}")

    def check(
        self,
        model_or_config: Any,
        adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ) -> None:
        """Everything that can refuse this swap, before any work: on a model, its adapter, attention modules (not
        swapped or converted already, no rotary, no grouped-query attention, projections all separate or all
        fused, through the attention interface) and D̃ against its hidden size; on a 🤗 config (before the
        weights are loaded), what it states: a registered decoder family that supports ``compress`` (none with
        rotary does), heads = key/value heads, D̃ against its hidden size."""
        if isinstance(model_or_config, nn.Module):
            self._check_model(model_or_config, adapter)
            return
        config = model_or_config
        if getattr(config, "model_type", None) in FAMILIES:
            # a registered decoder family: every one with rotary lacks ``compress``
            get_family(config, COMPRESS)
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads != heads:
            raise HeadkitError(
                f"the model uses grouped-query attention ({heads} query, {kv_heads} key/value heads), which the "
                "collaborative swap does not support"
            )
        widths = config_widths(config)
        if widths is not None:
            _check_width(self.dim_shared_query_key, *widths)

    def _check_model(
        self, model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None
    ) -> tuple[AttentionAdapter, list[AttentionSite]]:
        adapter = get_adapter(model, adapter)
        sites = adapter.sites(model)
        _check_swappable(adapter, sites, self.dim_shared_query_key)
        refuse_modules_off_the_interface(
            model, [(s.name, s.module) for s in sites], f"{adapter.name} cannot be swapped"
        )
        return adapter, sites

    @property
    def decompose(self) -> dict[str, Any]:
        """The keywords of :func:`headkit.surgery.decompose.decompose_query_key` (the fit)."""
        return {"seed": self.seed, "tol": self.tol, "max_iter": self.max_iter}

    def record(self) -> dict[str, Any]:
        """The fields as ``config.headkit_surgery`` keeps them."""
        return asdict(self)

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> CollaborativeConfig:
        """The config a record was written from (a field the record predates takes its default: a record written
        before the fit's fields were recorded holds D̃ only)."""
        return cls(**fields_of_record(cls, entry))


def _collaborative_config_of(
    adapter: CollaborativeConfig | AttentionAdapter | type[AttentionAdapter] | str | None,
    config: CollaborativeConfig | None,
    options: dict[str, Any],
) -> tuple[CollaborativeConfig, AttentionAdapter | type[AttentionAdapter] | str | None]:
    """The config of a :func:`swap_to_collaborative` call (given in the adapter's place or as ``config=``, or
    built from the keywords: the call's API before the config) and the adapter."""
    adapter, config = config_in_place_of(CollaborativeConfig, adapter, config)
    if config is None:
        return CollaborativeConfig(**options), adapter
    return given_config(CollaborativeConfig, config, options), adapter


def swap_to_collaborative(
    model: nn.Module,
    adapter: CollaborativeConfig | AttentionAdapter | type[AttentionAdapter] | str | None = None,
    *,
    config: CollaborativeConfig | None = None,
    **options: Any,
) -> SwapReport:
    """Re-express every self-attention module of `model` with collaborative heads, in place.

    Args:
        model: a 🤗 model of a supported architecture (see :mod:`headkit.surgery.adapters`) whose attention modules
            dispatch through transformers' attention interface.
        adapter: the architecture's adapter (class, instance or name), as in the reference package's
            ``swap_to_collaborative(model, BERTCollaborativeAdapter, ...)``; detected from the model when None. A
            :class:`CollaborativeConfig` in its place is the config (``swap_to_collaborative(model, config)``).
        config: how (:class:`CollaborativeConfig`); or its fields as keywords, not both:
            ``dim_shared_query_key`` (D̃, the width of the shared query/key projections: heads·head_dim is exact,
            smaller compresses the query/key projections by CP decomposition; at most the hidden size) and
            ``seed``, ``tol``, ``max_iter`` (passed to :func:`headkit.surgery.decompose.decompose_query_key`).

    Returns:
        A :class:`SwapReport`: per-module relative reconstruction error, parameters before/after, time.

    Raises:
        HeadkitError: unsupported architecture, D̃ out of range, a model already swapped or converted otherwise,
        rotary or grouped-query attention, attention that does not go through the interface. The model is then
        left untouched.
    """
    say_deprecated("swap_to_collaborative", CollaborativeConfig)
    config, adapter = _collaborative_config_of(adapter, config, options)
    return _swap(model, config, adapter=adapter)


def _swap(
    model: nn.Module,
    config: CollaborativeConfig,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> SwapReport:
    """:func:`headkit.apply_` of a :class:`CollaborativeConfig` (see :func:`swap_to_collaborative`)."""
    start = time.perf_counter()
    adapter, sites = config._check_model(model, adapter)
    dim_shared = config.dim_shared_query_key

    parameters_before = count_parameters(model)
    planned = [_plan_site(adapter, site, dim_shared, decompose=config.decompose) for site in sites]
    # Everything is computed and checked: only now does the model change.
    _apply(model, adapter, planned)
    record_surgery(model, _surgery_entry(adapter, sites, config))
    return SwapReport(
        architecture=adapter.name,
        dim_shared_query_key=dim_shared,
        parameters_before=parameters_before,
        parameters_after=count_parameters(model),
        seconds=time.perf_counter() - start,
        sites=[plan.report for plan in planned],
    )


def config_widths(config: Any) -> tuple[int, int] | None:
    """(hidden size, heads·head_dim — the exact D̃) as a model's 🤗 config states them; None where it does not
    say."""
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        return None
    return hidden, heads * (getattr(config, "head_dim", None) or hidden // heads)


def _check_width(dim_shared: int, hidden: int, full: int) -> None:
    if dim_shared > hidden and dim_shared != full:
        raise HeadkitError(
            f"dim_shared_query_key must be at most the hidden size {hidden} (or heads·head_dim = {full}, "
            f"the exact size), got {dim_shared}"
        )


def _check_swappable(adapter: AttentionAdapter, sites: list[AttentionSite], dim_shared: int) -> None:
    if not sites:
        raise HeadkitError(f"the {adapter.name} adapter found no attention module in this model")
    if adapter.rotary:
        raise HeadkitError(
            f"{adapter.name} applies rotary position embeddings to queries and keys, so its scores are not a "
            "bilinear form of the hidden states and cannot be re-expressed with collaborative heads"
        )
    fused = {adapter.query_name, adapter.key_name, adapter.value_name}
    if len(fused) == 2:
        raise HeadkitError(
            f"the {adapter.name} adapter fuses some of the query/key/value projections ({adapter.query_name}, "
            f"{adapter.key_name}, {adapter.value_name}) but not all: the collaborative swap needs all three "
            "separate or all three fused"
        )
    if len(fused) == 1 and type(adapter).set_fused_widths is AttentionAdapter.set_fused_widths:
        raise HeadkitError(
            f"the {adapter.name} adapter cannot re-split its fused projection {adapter.query_name} "
            "(it does not implement set_fused_widths), which the collaborative swap needs"
        )
    for site in sites:
        mechanism = mechanism_of(site.module)
        if isinstance(mechanism, CollaborativeHeads):
            raise HeadkitError(f"the model is already swapped to collaborative attention ({site.name})")
        if mechanism is not None:
            raise HeadkitError(
                f"{site.name} already runs a headkit mechanism ({type(mechanism).__name__}); cannot swap it"
            )
        if site.num_kv_heads != site.num_heads:
            raise HeadkitError(
                f"{site.name} uses grouped-query attention ({site.num_heads} query, {site.num_kv_heads} key/value "
                "heads), which the collaborative swap does not support"
            )
        hidden = adapter.read_projections(site).q_weight.shape[1]
        _check_width(dim_shared, hidden, site.num_heads * site.head_dim)


@dataclass
class _SitePlan:
    """What one site becomes: its new projections (attribute path on the attention module → module), its
    mechanism, and the report of the fit."""

    site: AttentionSite
    projections: dict[str, nn.Module]
    mechanism: CollaborativeHeads
    report: SiteReport


def _plan_site(
    adapter: AttentionAdapter, site: AttentionSite, dim_shared: int, *, decompose: dict[str, Any] | None
) -> _SitePlan:
    """Build the new projections and mechanism of one site without touching the model. With `decompose` None
    the shared projections are left at zero: the structure :func:`headkit.from_pretrained` loads saved weights
    into."""
    start = time.perf_counter()
    weights = adapter.read_projections(site)
    heads, head_dim = site.num_heads, site.head_dim
    hidden = weights.q_weight.shape[1]
    has_content_bias = weights.q_bias is not None
    factory = {"dtype": weights.q_weight.dtype, "device": weights.q_weight.device}
    query = SharedProjection(hidden, dim_shared, head_dim, **factory)
    key = SharedProjection(
        hidden, dim_shared, head_dim, content_heads=heads if has_content_bias else 0, **factory
    )
    mechanism = CollaborativeHeads(
        num_heads=heads,
        head_dim=head_dim,
        dim_shared_query_key=dim_shared,
        has_content_bias=has_content_bias,
        scale=site.scale,
        causal=site.causal,
        **factory,
    )
    if adapter.query_name == adapter.key_name:  # one fused projection: carve the values out, keep them stock
        fused = site.module.get_submodule(adapter.query_name)
        value = new_linear(weights.v_weight, weights.v_bias, like=fused)
        projections: dict[str, nn.Module] = {
            adapter.query_name: FusedSharedProjection(query, key, value, weights.v_weight.shape[0])
        }
    else:
        projections = {adapter.query_name: query, adapter.key_name: key}
    report = SiteReport(site.name, site.layers, relative_error=0.0, iterations=0, exact=False, seconds=0.0)
    if decompose is not None:
        w_q_shared, mixing, w_k_shared, info = decompose_query_key(
            weights.q_weight, weights.k_weight, heads, dim_shared, return_info=True, **decompose
        )
        with torch.no_grad():
            query.weight.copy_(w_q_shared)
            key.weight.copy_(w_k_shared)
            mechanism.mixing.copy_(mixing)
            if key.content_bias is not None:
                key.content_bias.copy_(content_bias_weight(weights.q_bias, weights.k_weight, heads))
        report.relative_error, report.iterations, report.exact = (
            info.relative_error,
            info.iterations,
            info.exact,
        )
    for module in (*projections.values(), mechanism):
        module.train(site.module.training)
    report.seconds = time.perf_counter() - start
    return _SitePlan(site, projections, mechanism, report)


def _apply(model: nn.Module, adapter: AttentionAdapter, planned: list[_SitePlan]) -> None:
    """Put the planned projections in place and attach the mechanisms (assignments only: nothing can fail
    halfway that the checks did not rule out)."""
    for plan in planned:
        module = plan.site.module
        for path, projection in plan.projections.items():
            parent_path, _, name = path.rpartition(".")
            setattr(module.get_submodule(parent_path) if parent_path else module, name, projection)
            if isinstance(projection, FusedSharedProjection):
                adapter.set_fused_widths(module, projection.widths)
    attach_mechanisms(model, [(plan.site.module, plan.mechanism) for plan in planned])


def collaborative_mechanisms(model: nn.Module) -> list[CollaborativeHeads]:
    """The :class:`CollaborativeHeads` mechanisms of a swapped model, in module order (shared modules once)."""
    return list({id(m): m for m in model.modules() if isinstance(m, CollaborativeHeads)}.values())


def _surgery_entry(
    adapter: AttentionAdapter, sites: list[AttentionSite], config: CollaborativeConfig
) -> dict[str, Any]:
    return (
        {"op": SURGERY_OP, "adapter": adapter.name}
        | config.record()
        | {"sites": [site.name for site in sites]}
    )


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the collaborative structure recorded in `entry` on a freshly built model (weights load after)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = adapter.sites(model)
    if [site.name for site in sites] != list(entry["sites"]):
        raise HeadkitError(
            f"the recorded collaborative swap covered {entry['sites']}, but the rebuilt model has attention "
            f"modules {[site.name for site in sites]}"
        )
    dim_shared = CollaborativeConfig.from_record(entry).dim_shared_query_key
    _check_swappable(adapter, sites, dim_shared)
    _apply(model, adapter, [_plan_site(adapter, site, dim_shared, decompose=None) for site in sites])


register_conversion(CollaborativeConfig, SURGERY_OP, _swap, _reapply, replaces_attention=True)

__all__ = [
    "CollaborativeConfig",
    "CollaborativeHeads",
    "FusedSharedProjection",
    "SharedProjection",
    "SiteReport",
    "SwapReport",
    "collaborative_mechanisms",
    "content_bias_weight",
    "model_attention_mask",
    "swap_to_collaborative",
]
