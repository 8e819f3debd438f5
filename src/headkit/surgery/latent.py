"""Compress a rotary, grouped-query decoder's keys and values into a shared latent (multi-head latent attention).

MHA2MLA (Ji et al. 2025, "Towards Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in Any
Transformer-based LLMs", arXiv:2502.14837), on the stock modules of a 🤗 decoder, per layer:

1. **Partial RoPE**: per key/value head g, rotary stays on D/2 frequency pairs (i, i + head_dim/2); the other
   n = head_dim − D dimensions become rotary-free. Which pairs (``rope_selection``):

   * ``"norms"`` — MHA2MLA's (their Sec. 3.2, "S_2-norm"): the largest query-key contribution
     Σ_{h∈g} E‖q_{h,i}‖ · E‖k_{g,i}‖ of the pair's 2-norms over calibration tokens (without calibration text,
     the Frobenius norms of the pair's projection rows), the rest left unrotated (q·k at every distance).
   * ``"fitted"`` (headkit's): a pair's score term Re(q·conj(k)·e^{iθ(m−n)})
     is replaced by Re(q·conj(k)·c) with the one complex factor c that minimises its squared error weighted by
     the model's own attention probabilities on calibration text
     (:func:`~headkit.surgery.latent_fit.expected_rotation`: c ≈ 1 for slow pairs, as MHA2MLA assumes, but damped
     and turned for fast ones, whose rotation averages out over the distances attention looks at). c is folded
     into the rotary-free key rows before the factorization (:func:`~headkit.surgery.latent_fit.fold_rotation`:
     free at run time), and the pairs kept rotary are those whose residual error is largest. On SmolLM2-135M at D = 16 it takes the partial-RoPE perplexity from 7.2x to 1.9x the original
     (docs/latent-kv.md).
   * ``"rorope"`` — TransMLA's RoRoPE (Meng et al. 2025, "TransMLA: Multi-Head Latent Attention Is All You Need",
     arXiv:2502.07864, Sec. 4.2, Eq. 19, App. B): rotary stays not on pairs of each head but on principal
     components across the key/value heads. Per frequency, one orthogonal G×G matrix mixes the heads' 2-D
     components, the same for both coordinates, so it commutes with the rotation and leaves every score unchanged;
     chosen by PCA of the keys, it concentrates their energy, and the G·D/2 components of largest energy (over all
     frequencies) stay rotary in G "virtual" heads of D dims (:func:`~headkit.surgery.latent_fit.rotary_mixing`).
     Every query head reads every virtual head's rotary keys through the matching mix of its query
     (:class:`~headkit.surgery.latent_heads.LatentKVHeads` ``rope_mix``); the rest of each head's keys (the
     components left unrotated, in the head's own coordinates) goes to the latent. ``rope_fold`` > 1 is their
     FreqFold (App. C): the PCA over that many neighbouring frequencies at once, each merged component rotated at
     its slot's frequency (an approximation: the scores change before any cut).
   * ``"rorope_fitted"`` (headkit's, the default with calibration text): RoRoPE's mix, with the components kept rotary ranked by energy × their
     frequency's share of score error that a fixed rotation leaves (:func:`~headkit.surgery.latent_fit.
     rotation_residual_shares`), and the fitted rotation folded into what stays unrotated, as ``"fitted"`` does.
2. **Joint low rank** (their Sec. 3.3, "SVD_joint"): the rotary-free key rows and the value rows of every
   key/value head, stacked into W = [W_K,nope ; W_V] (G·(n + head_dim) rows), are factored as W ≈ U_R (U_Rᵀ W):
   the down-projection W_down = U_Rᵀ W [R, hidden] writes the latent c = W_down x, the up-projections are
   U_R's rows (K_g [n, R], V_g [head_dim, R]). U_R are the leading left singular vectors of W Σ^{1/2}, Σ the
   second moment of the layer's attention inputs on calibration text (ASVD/SVD-LLM-style activation weighting: it
   minimises ‖(W − U_R U_Rᵀ W) X‖, the error of the keys and values the layer actually computes; with
   Σ = I it is MHA2MLA's plain joint SVD). At R = G·(n + head_dim) ≤ hidden, U_R U_Rᵀ = I: exact.
   ``balance_kv`` is TransMLA's BKV (their Sec. 4.3, Eq. 20): the key rows scaled to the values' weighted norm
   before the SVD, the scale divided back out of the key up-projection.

The key bias of the rotary-free dimensions adds q · b to every score of a query: constant over the keys, it
cancels in the softmax and is dropped. The value bias is added after the weighted sum (the weights sum to one).

**Through transformers' extension points** (:mod:`headkit.surgery.attention`), like the collaborative swap:
``v_proj`` becomes a :class:`~headkit.surgery.collaborative.SharedProjection` writing the latent c (zero-padded to a
multiple of head_dim, so that the stock view takes it as "heads"), ``k_proj`` a
:class:`~headkit.surgery.latent_heads.RotaryKeyProjection` writing only the D rotary dimensions, and the module
gains the :class:`~headkit.surgery.latent_heads.LatentKVHeads` mechanism, which caches one row [c ; k_rope] of
R + G·D numbers per token — instead of 2·G·head_dim — and attends with the up-projections absorbed
(:mod:`headkit.surgery.latent_heads`).

This module holds the conversion: its config (:class:`LatentKVConfig`) and checks, :func:`compress_kv_to_latent`,
its report, the per-layer cost curves of the ``"sensitivity"`` rank allocation (:func:`rank_error_curves`, which
converts copies of the model) and the replay of a recorded conversion. The calibration statistics, the rotation fit,
the factorization and the rank allocators are :mod:`headkit.surgery.latent_fit`.

Refused, with the reason, before any work: families whose keys are normalised per head after the projection
(Qwen 3, Gemma 3's ``k_norm``: the norm of [k_rope ; K_g c] is not linear in the latent, so K_g cannot be absorbed
into the query), and those whose attention is not the LLaMA layout with full rotary (see
:data:`headkit.surgery.families.FAMILIES`, operation ``latent``); a model already carrying a headkit mechanism,
uneven key/value pruning or head gates. A model pruned uniformly is a stock model and is supported.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.surgery.adapters import AttentionAdapter, AttentionSite, count_parameters, get_adapter
from headkit.surgery.attention import (
    attach_mechanisms,
    refuse_modules_off_the_interface,
)
from headkit.surgery.collaborative import SharedProjection

# The config (no model code) and the model's sites, each in a module of its own; their names stay here too.
from headkit.surgery.latent_config import (  # noqa: F401  (the names latent has always offered)
    RANK_ALLOCATIONS,
    SENSITIVITY,
    SPECTRUM,
    UNIFORM,
    LatentKVConfig,
    attention_widths,
    check_latent_ranks,
)
from headkit.surgery.latent_fit import (
    MIXED_SELECTIONS,
    SiteKeys,
    SiteStatistics,
    allocate_by_error,
    allocate_ranks,
    candidate_ranks,
    collect_statistics,
    full_rank,
    joint_latent_factors,
    latent_spectrum,
    site_keys,
    weight_statistics,
)
from headkit.surgery.latent_heads import LatentKVHeads, RotaryKeyProjection, rope_indices
from headkit.surgery.latent_sites import (  # noqa: F401
    check_latent_sites,
    check_not_latent,
    latent_mechanisms,
)
from headkit.surgery.records import (
    given_config,
    record_surgery,
    register_conversion,
    say_deprecated,
)
from headkit.surgery.repair import capture_attention_calls, fisher_weighted_error

SURGERY_OP = "latent_kv"


@dataclass
class LatentSiteReport:
    name: str
    layer: int
    rope_pairs: list[list[int]]  # per key/value head, the frequency pairs kept rotary
    key_error: float
    value_error: float
    # The rotary-free pairs' share of the score terms' energy that the partial RoPE loses (attention-weighted
    # squared error / Σ a s² over every pair, on calibration text); None without calibration. RoRoPE
    # ("rorope", "rorope_fitted"): the share of the keys' energy left without rotation (RotaryMixing.lost_energy).
    rope_error: float | None = None


@dataclass
class LatentReport:
    """What :func:`compress_kv_to_latent` did."""

    architecture: str
    kv_rank: int  # the mean over layers
    kv_ranks: list[int]  # per layer (all kv_rank unless the ranks were allocated)
    rope_dims: int
    full_rank: int
    calibrated: bool
    rope_selection: str
    cache_numbers_before: int  # per token per layer: 2·G·head_dim
    cache_numbers_after: int  # R + G·D
    parameters_before: int
    parameters_after: int
    seconds: float
    sites: list[LatentSiteReport] = field(default_factory=list)
    rank_allocation: str = UNIFORM
    # "sensitivity": the candidate ranks and, per layer, the loss-weighted error at each (rank_error_curves)
    candidate_ranks: list[int] | None = None
    rank_errors: list[list[float]] | None = None

    @property
    def cache_fraction(self) -> float:
        return self.cache_numbers_after / self.cache_numbers_before

    @property
    def max_key_error(self) -> float:
        return max((site.key_error for site in self.sites), default=0.0)

    @property
    def max_value_error(self) -> float:
        return max((site.value_error for site in self.sites), default=0.0)

    @property
    def max_rope_error(self) -> float | None:
        errors = [site.rope_error for site in self.sites if site.rope_error is not None]
        return max(errors) if errors else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "cache_fraction": self.cache_fraction,
            "max_key_error": self.max_key_error,
            "max_value_error": self.max_value_error,
            "max_rope_error": self.max_rope_error,
        }

    def __str__(self) -> str:
        return (
            f"latent keys/values ({self.architecture}): rank {self.kv_rank} of {self.full_rank}{self._allocation()}, "
            f"{self.rope_dims} "
            f"rotary dims per key/value head ({self._selection_words()}), "
            f"{len(self.sites)} layers in {self.seconds:.1f} s; cache per token and layer "
            f"{self.cache_numbers_before} -> {self.cache_numbers_after} numbers ({self.cache_fraction:.1%}); "
            f"max relative error: keys {self.max_key_error:.3g}, values {self.max_value_error:.3g}; parameters "
            f"{self.parameters_before:,} -> {self.parameters_after:,}"
        )

    def _allocation(self) -> str:
        if len(set(self.kv_ranks)) <= 1:
            return ""
        by = "the loss-weighted output errors" if self.rank_allocation == SENSITIVITY else "the spectra"
        return f" (mean; per layer {min(self.kv_ranks)}–{max(self.kv_ranks)}, by {by})"

    def _selection_words(self) -> str:
        if not self.calibrated:
            return "weight norms"
        if self.max_rope_error is None:
            return f"calibrated, {self.rope_selection}"
        if self.rope_selection in MIXED_SELECTIONS:
            return f"calibrated, {self.rope_selection}: up to {self.max_rope_error:.3g} of the keys' energy unrotated"
        return f"calibrated, {self.rope_selection}: score-term error up to {self.max_rope_error:.3g}"


def check_latent_arguments(
    site: AttentionSite, hidden: int, kv_rank: Any, rope_dims: Any, rope_fold: int = 1
) -> None:
    """Name the valid range of `rope_dims` (whole rotary pairs), of `rope_fold` (FreqFold) and of `kv_rank` (given
    rope_dims: with RoRoPE too the rotary-free keys span G·(head_dim − D) dimensions)."""
    check_latent_ranks(site.head_dim, site.num_kv_heads, hidden, kv_rank, rope_dims, rope_fold)


@dataclass
class _SitePlan:
    site: AttentionSite
    key: RotaryKeyProjection
    value: SharedProjection
    mechanism: LatentKVHeads
    report: LatentSiteReport


def _plan_site(
    adapter: AttentionAdapter,
    site: AttentionSite,
    kv_rank: int,
    pairs: torch.Tensor,
    statistics: SiteStatistics | None,
    keys: SiteKeys | None = None,
    *,
    mixed: bool = False,
    balance: bool = False,
) -> _SitePlan:
    """The new projections and mechanism of one site; with `statistics` None, left at zero (the structure
    :func:`headkit.from_pretrained` loads saved weights into). `keys`: the site's key rows split into the rotary
    and the rotary-free ones (:func:`~headkit.surgery.latent_fit.site_keys`, with `pairs` its kept pairs); `mixed`:
    RoRoPE's (their rotary keys mixed across the key/value heads); `balance`: TransMLA's balanced joint
    factorization (:func:`~headkit.surgery.latent_fit.joint_latent_factors`)."""
    weights = adapter.read_projections(site)
    groups, head_dim = site.num_kv_heads, site.head_dim
    hidden = weights.k_weight.shape[1]
    factory = {"dtype": weights.k_weight.dtype, "device": weights.k_weight.device}
    rope_index = rope_indices(pairs, head_dim)
    key = RotaryKeyProjection(hidden, rope_index, head_dim, bias=weights.k_bias is not None, **factory)
    value = SharedProjection(hidden, kv_rank, head_dim, **factory)
    mechanism = LatentKVHeads(
        num_heads=site.num_heads,
        num_kv_heads=groups,
        head_dim=head_dim,
        rank=kv_rank,
        rope_index=rope_index,
        value_bias=weights.v_bias is not None,
        scale=site.scale,
        layer_idx=site.layers[0],
        mixed=mixed,
        **factory,
    )
    report = LatentSiteReport(site.name, site.layers[0], pairs.tolist(), 0.0, 0.0)
    if statistics is not None and keys is not None:
        report.rope_error = keys.rope_error
        factors = joint_latent_factors(
            keys.nope_rows,
            weights.v_weight.detach().reshape(groups, head_dim, hidden),
            kv_rank,
            statistics.input_moment,
            balance,
        )
        with torch.no_grad():
            key.weight.copy_(keys.rope_rows)
            if key.bias is not None:
                key.bias.copy_(keys.rope_bias)
            value.weight.copy_(factors.down)
            mechanism.key_up.copy_(factors.key_up)
            mechanism.value_up.copy_(factors.value_up)
            if mechanism.value_bias is not None:
                mechanism.value_bias.copy_(weights.v_bias.detach().reshape(groups, head_dim))
            if mechanism.rope_mix is not None:
                mechanism.rope_mix.copy_(keys.mixing.query_mix())
        report.key_error, report.value_error = factors.key_error, factors.value_error
    for module in (key, value, mechanism):
        module.train(site.module.training)
    return _SitePlan(site, key, value, mechanism, report)


def _apply(model: nn.Module, adapter: AttentionAdapter, planned: list[_SitePlan]) -> None:
    """Put the planned projections in place and attach the mechanisms (assignments only)."""
    for plan in planned:
        setattr(plan.site.module, adapter.key_name, plan.key)
        setattr(plan.site.module, adapter.value_name, plan.value)
    attach_mechanisms(model, [(plan.site.module, plan.mechanism) for plan in planned])


def compress_kv_to_latent(
    model: nn.Module,
    config: LatentKVConfig | None = None,
    *,
    calibration: Iterable[dict] | None = None,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    statistics: list[SiteStatistics] | None = None,
    **options: Any,
) -> LatentReport:
    """Convert every attention layer of a rotary, grouped-query causal LM to latent keys and values, in place.

    Args:
        model: a causal LM of a family registered for ``latent`` (:mod:`headkit.surgery.families`).
        config: how (:class:`LatentKVConfig`); or its fields as keywords (``kv_rank=…, rope_dims=…``).
        calibration: batches (dicts with ``input_ids``, optionally ``attention_mask``) on which the rotary pairs
            are ranked and the SVD weighted; None ranks by weight norms and uses the plain joint SVD.
        adapter: the architecture's adapter; detected when None.
        statistics: the calibration's per-layer statistics already collected
            (:func:`~headkit.surgery.latent_fit.collect_statistics` on this model, or on a model with the same
            weights): they do not depend on the rank, so a curve over R collects them once. Given, `calibration`
            is not run again for them (it still says the conversion is calibrated; ``rank_allocation="sensitivity"``
            runs it, with gradients).

    Returns a :class:`LatentReport`. Raises :class:`HeadkitError` for an unsupported family, an argument out of
    range, a model already converted or pruned unevenly — the model is then untouched.
    """
    say_deprecated("compress_kv_to_latent", LatentKVConfig)
    config = LatentKVConfig(**options) if config is None else given_config(LatentKVConfig, config, options)
    return _compress(model, config, calibration=calibration, adapter=adapter, statistics=statistics)


def _compress(
    model: nn.Module,
    config: LatentKVConfig,
    *,
    calibration: Iterable[dict] | None = None,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    statistics: list[SiteStatistics] | None = None,
) -> LatentReport:
    """:func:`headkit.apply_` of a :class:`LatentKVConfig` (see :func:`compress_kv_to_latent`)."""
    start = time.perf_counter()
    calibrated = calibration is not None or statistics is not None
    rope_selection = config.selection(calibrated)
    if config.rank_allocation == SENSITIVITY and calibration is None:
        raise HeadkitError(
            "rank_allocation 'sensitivity' runs the calibration batches with gradients: pass calibration=..., "
            "not only statistics"
        )
    calibration = None if calibration is None else list(calibration)  # read twice for 'sensitivity'
    kv_rank, rope_dims = config.kv_rank, config.rope_dims
    mixed = rope_selection in MIXED_SELECTIONS
    adapter, sites = config.sites_to_convert(model, adapter)
    hidden = adapter.read_projections(sites[0]).k_weight.shape[1]
    if statistics is not None and len(statistics) != len(sites):
        raise HeadkitError(
            f"statistics must hold one entry per attention layer ({len(sites)}), got {len(statistics)}"
        )
    refuse_modules_off_the_interface(
        model, [(s.name, s.module) for s in sites], f"{adapter.name} cannot be converted"
    )
    before = count_parameters(model)
    if statistics is None:
        statistics = (
            [weight_statistics(adapter, site) for site in sites]
            if calibration is None
            else collect_statistics(model, sites, adapter, calibration)
        )
    top = full_rank(hidden, sites[0].num_kv_heads, sites[0].head_dim, rope_dims)
    keys = [
        site_keys(
            adapter.read_projections(site).k_weight,
            adapter.read_projections(site).k_bias,
            stats,
            rope_dims,
            rope_selection,
            config.rope_fold,
        )
        for site, stats in zip(sites, statistics, strict=True)
    ]
    ranks = [kv_rank] * len(sites)
    candidates, rank_errors = None, None
    if config.rank_allocation == SPECTRUM:
        spectra = [
            latent_spectrum(
                split.nope_rows,
                adapter.read_projections(site)
                .v_weight.detach()
                .reshape(site.num_kv_heads, site.head_dim, -1),
                stats,
                config.balance_kv,
            )
            for site, split, stats in zip(sites, keys, statistics, strict=True)
        ]
        ranks = allocate_ranks(spectra, kv_rank * len(sites))
    elif config.rank_allocation == SENSITIVITY:
        candidates = candidate_ranks(kv_rank, top)
        rank_errors = rank_error_curves(model, config, calibration, statistics, adapter, candidates)
        ranks = allocate_by_error([(candidates, errors) for errors in rank_errors], kv_rank * len(sites))
    planned = [
        _plan_site(adapter, site, rank, split.pairs, stats, split, mixed=mixed, balance=config.balance_kv)
        for site, rank, split, stats in zip(sites, ranks, keys, statistics, strict=True)
    ]
    # Everything is computed and checked: only now does the model change.
    _apply(model, adapter, planned)
    record_surgery(
        model,
        {"op": SURGERY_OP, "adapter": adapter.name}
        | config.record()
        | {
            "rope_selection": rope_selection,
            "kv_ranks": ranks,
            "sites": [site.name for site in sites],
            "rope_pairs": [plan.report.rope_pairs for plan in planned],
        },
    )
    site = sites[0]
    return LatentReport(
        architecture=adapter.name,
        kv_rank=kv_rank,
        kv_ranks=ranks,
        rope_dims=rope_dims,
        full_rank=top,
        calibrated=calibrated,
        rope_selection=rope_selection,
        cache_numbers_before=2 * site.num_kv_heads * site.head_dim,
        cache_numbers_after=kv_rank + site.num_kv_heads * rope_dims,
        parameters_before=before,
        parameters_after=count_parameters(model),
        seconds=time.perf_counter() - start,
        sites=[plan.report for plan in planned],
        rank_allocation=config.rank_allocation,
        candidate_ranks=candidates,
        rank_errors=rank_errors,
    )


def rank_error_curves(
    model: nn.Module,
    config: LatentKVConfig,
    calibration: list[dict],
    statistics: list[SiteStatistics],
    adapter: AttentionAdapter,
    ranks: list[int],
) -> list[list[float]]:
    """Per layer, the loss-weighted error its attention output is left with at each of `ranks`
    (:func:`headkit.surgery.repair.fisher_weighted_error` on `calibration`): what each choice costs the model,
    in the loss's units, so layers compare. Each rank converts a copy of `model` (every layer at that rank;
    `model` untouched), and each layer is judged on the original's own inputs, so no error crosses layers."""
    sites = adapter.sites(model)
    calls = capture_attention_calls(model, calibration, range(len(sites)), adapter, gradients=True)
    curves: list[list[float]] = [[] for _ in sites]
    uniform = dataclasses.replace(config, rank_allocation=UNIFORM)
    for rank in ranks:
        candidate = copy.deepcopy(model)
        _compress(
            candidate, dataclasses.replace(uniform, kv_rank=rank), statistics=statistics, adapter=adapter
        )
        for layer, site in enumerate(sites):
            curves[layer].append(fisher_weighted_error(candidate.get_submodule(site.name), calls[layer]))
        del candidate
    return curves


def set_absorbed(model: nn.Module, absorbed: bool) -> None:
    """Run every latent layer absorbed (True, the default) or through the expanded reference (False)."""
    for mechanism in latent_mechanisms(model):
        mechanism.absorbed = bool(absorbed)


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded conversion on a freshly built model (the weights are loaded afterwards)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = check_latent_sites(model, adapter)
    if [site.name for site in sites] != list(entry["sites"]):
        raise HeadkitError(
            f"the recorded latent conversion covered {entry['sites']}, but the rebuilt model has attention modules "
            f"{[site.name for site in sites]}"
        )
    config = LatentKVConfig.from_record(entry)
    rope_dims = config.rope_dims
    # Records written before ranks could be allocated per layer hold one rank for all.
    ranks = [int(rank) for rank in entry.get("kv_ranks") or [config.kv_rank] * len(sites)]
    hidden = adapter.read_projections(sites[0]).k_weight.shape[1]
    for site, rank in zip(sites, ranks, strict=True):
        check_latent_arguments(site, hidden, rank, rope_dims, config.rope_fold)
    planned = [
        _plan_site(
            adapter,
            site,
            rank,
            torch.tensor(pairs, dtype=torch.long).reshape(site.num_kv_heads, rope_dims // 2),
            None,
            mixed=config.mixed,
        )
        for site, rank, pairs in zip(sites, ranks, entry["rope_pairs"], strict=True)
    ]
    _apply(model, adapter, planned)


register_conversion(LatentKVConfig, SURGERY_OP, _compress, _reapply, replaces_attention=True)

__all__ = [
    "RANK_ALLOCATIONS",
    "SENSITIVITY",
    "SPECTRUM",
    "UNIFORM",
    "LatentKVConfig",
    "LatentReport",
    "attention_widths",
    "check_latent_arguments",
    "check_latent_ranks",
    "compress_kv_to_latent",
    "latent_mechanisms",
    "rank_error_curves",
    "set_absorbed",
]
