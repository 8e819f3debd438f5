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
from headkit.layers.base import KV_HEAD_INDEX
from headkit.surgery.adapters import AttentionAdapter, AttentionSite, count_parameters, get_adapter
from headkit.surgery.attention import (
    HEAD_GATE,
    attach_mechanisms,
    mechanism_of,
    refuse_modules_off_the_interface,
)
from headkit.surgery.collaborative import SharedProjection
from headkit.surgery.families import LATENT, get_family, text_config
from headkit.surgery.gating import config_prunes_unevenly, config_records_gates, kv_head_counts
from headkit.surgery.latent_fit import (
    FITTED,
    MIXED_SELECTIONS,
    NORMS,
    ROPE_SELECTIONS,
    ROROPE_FITTED,
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
from headkit.surgery.records import (
    fields_of_record,
    given_config,
    record_surgery,
    register_conversion,
    say_deprecated,
)
from headkit.surgery.repair import capture_attention_calls, fisher_weighted_error

SURGERY_OP = "latent_kv"
UNIFORM, SPECTRUM, SENSITIVITY = "uniform", "spectrum", "sensitivity"
RANK_ALLOCATIONS = (UNIFORM, SPECTRUM, SENSITIVITY)


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


def attention_widths(config: Any) -> tuple[int, int, int]:
    """(hidden size, key/value heads, head_dim) as a decoder's 🤗 config states them (its text config)."""
    text = text_config(config)
    heads = text.num_attention_heads
    return (
        text.hidden_size,
        getattr(text, "num_key_value_heads", None) or heads,
        getattr(text, "head_dim", None) or text.hidden_size // heads,
    )


def check_latent_ranks(
    head_dim: int,
    num_kv_heads: int,
    hidden: int,
    kv_rank: Any,
    rope_dims: Any,
    rope_fold: int = 1,
) -> None:
    """:func:`check_latent_arguments` from the widths alone (a model's 🤗 config is enough)."""
    if (head_dim // 2) % rope_fold:
        divisors = [d for d in range(1, head_dim // 2 + 1) if (head_dim // 2) % d == 0]
        raise HeadkitError(
            f"rope_fold must divide head_dim/2 = {head_dim // 2} (one of {divisors}), got {rope_fold}"
        )
    if isinstance(rope_dims, bool) or not isinstance(rope_dims, int) or not 0 <= rope_dims <= head_dim:
        raise HeadkitError(f"rope_dims must be an integer in [0, {head_dim}] (head_dim), got {rope_dims!r}")
    if rope_dims % 2:
        raise HeadkitError(
            f"rope_dims must be a whole number of rotary pairs (even: 0, 2, …, {head_dim}), got {rope_dims}"
        )
    top = full_rank(hidden, num_kv_heads, head_dim, rope_dims)
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 1 <= kv_rank <= top:
        raise HeadkitError(
            f"kv_rank must be an integer in [1, {top}] (the full width min(hidden {hidden}, kv_heads "
            f"{num_kv_heads} × (2·head_dim {2 * head_dim} − rope_dims {rope_dims}))), got {kv_rank!r}"
        )


def _check_not_latent(model: nn.Module) -> None:
    # Before the adapter reads the projections: a latent layer's are no longer nn.Linear.
    converted = [m.layer_idx for m in latent_mechanisms(model)]
    if converted:
        raise HeadkitError(f"the model's keys and values are already latent (layers {converted})")


def _check_sites(model: nn.Module, adapter: AttentionAdapter) -> list[AttentionSite]:
    sites = adapter.sites(model)
    if not sites:
        raise HeadkitError(f"the {adapter.name} adapter found no attention module in this model")
    for site in sites:
        mechanism = mechanism_of(site.module)
        if isinstance(mechanism, LatentKVHeads):
            raise HeadkitError(f"the model's keys and values are already latent ({site.name})")
        if mechanism is not None:
            raise HeadkitError(
                f"{site.name} already runs {type(mechanism).__name__} (earlier surgery: linearized or swapped); "
                "latent keys/values need the stock softmax attention"
            )
        if getattr(site.module, KV_HEAD_INDEX, None) is not None or getattr(site.module, HEAD_GATE, None):
            raise HeadkitError(
                f"{site.name} is pruned unevenly (a key/value head index) or gated: latent keys/values need "
                "every layer's stock key/value heads; prune uniformly (a stock architecture) instead"
            )
        if len(site.layers) != 1 or site.head_dim % 2 or site.num_heads % site.num_kv_heads:
            raise HeadkitError(
                f"{site.name} is not one layer of grouped-query attention with an even head_dim"
            )
        for name in ("k_norm", "q_norm"):
            if isinstance(getattr(site.module, name, None), nn.Module):
                raise HeadkitError(
                    f"{site.name} normalises each head's {name[0]} after the projection ({name}): the norm of "
                    "[k_rope ; K c] is not linear in the latent, so the key up-projection cannot be absorbed"
                )
    return sites


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


@dataclass(frozen=True)
class LatentKVConfig:
    """How :func:`compress_kv_to_latent` converts a model: the one declaration of each option.

    Built, it checks its types and ranges; :meth:`check` checks it against a model (family, attention modules,
    the ranks their widths allow) before any calibration text is read or weight changed. The model's
    ``config.headkit_surgery`` records it, with the rotary pairs each layer kept.

    Attributes:
        kv_rank: R, the latent width per layer, in [1, min(hidden, G·(2·head_dim − rope_dims))]; the top is exact.
        rope_dims: D, rotary dimensions kept per key/value head (whole pairs: even, ≤ head_dim); head_dim keeps
            every one (exact).
        rope_selection: ``"fitted"``: keep rotary where the fitted fixed rotation
            leaves the largest score error, and fold that rotation into the rotary-free keys
            (:func:`~headkit.surgery.latent_fit.expected_rotation`); ``"norms"`` (the default without): MHA2MLA's
            2-norm criterion, rotary-free pairs left unrotated; ``"rorope"``: TransMLA's RoRoPE (Meng et al. 2025,
            arXiv:2502.07864, Sec. 4.2, Eq. 19): per frequency one orthogonal matrix mixes the key/value heads'
            2-D components (the same for both coordinates, so it commutes with the rotation), chosen by PCA, and
            the G·D/2 principal components of largest key energy stay rotary
            (:func:`~headkit.surgery.latent_fit.rotary_mixing`; the queries get the matching mix);
            ``"rorope_fitted"`` (the default with calibration): RoRoPE's mix, the components kept rotary ranked by
            energy × their frequency's fixed-rotation residual share, the fitted rotation folded into the rest.
            None: the default for the calibration given.
        rope_fold: TransMLA's FreqFold (their App. C), with ``rope_selection="rorope"`` only: that many neighbouring
            frequencies share one PCA, so the kept rotary dims gather more of the keys' energy; a merged dim is
            rotated at its slot's frequency, so the scores change even before the cut (1: none, exact).
        balance_kv: TransMLA's BKV (their Sec. 4.3, Eq. 20): the joint factorization of the rotary-free keys and
            the values sees the keys scaled to the values' norm, and the scale is folded back into the key
            up-projection (:func:`~headkit.surgery.latent_fit.joint_latent_factors`).
        rank_allocation: ``"uniform"``: every layer gets R. ``"spectrum"`` (needs calibration): the same total,
            L·R, shared out by the error each choice leaves in the keys and values
            (:func:`~headkit.surgery.latent_fit.allocate_ranks`: the layers whose keys and values are hardest to
            compress get more of it). ``"sensitivity"`` (needs
            calibration batches): shared out by what each choice costs the model — each layer's attention-output
            error at candidate ranks, weighted by the loss gradient (:func:`rank_error_curves`,
            :func:`~headkit.surgery.latent_fit.allocate_by_error`).
    """

    # Each field's metadata makes it a command-line option where a command takes this config's fields
    # (headkit.recipes.options: `headkit compress`).
    kv_rank: int = field(
        metadata={
            "help": "Rotary decoders (LLaMA, SmolLM2, Mistral, Qwen 2): latent width R of the shared key/value "
            "latent per layer (MHA2MLA).",
            "min": 1,
        }
    )
    rope_dims: int = field(
        metadata={
            "help": "Rotary decoders: rotary dimensions kept per key/value head, whole pairs.",
            "min": 0,
        }
    )
    rope_selection: str | None = field(
        default=None,
        metadata={
            "help": "Rotary decoders: 'fitted' keeps rotary where a fixed rotation fitted on the calibration text "
            "errs most and folds that rotation into the other pairs' keys; 'norms' is MHA2MLA's 2-norm ranking; "
            "'rorope' is TransMLA's RoRoPE (per frequency, a PCA across the key/value heads concentrates their "
            "rotary energy into the dims kept rotary; scores unchanged before the cut); 'rorope_fitted' (the "
            "default with calibration text) ranks RoRoPE's components by the error a fixed rotation would leave "
            "and folds that rotation into the rest."
        },
    )
    rope_fold: int = field(
        default=1,
        metadata={
            "help": "Rotary decoders, with rope_selection 'rorope': TransMLA's FreqFold, this many neighbouring "
            "frequencies share one PCA (1: none; must divide head_dim/2); each merged dim is rotated at its "
            "slot's frequency, an approximation.",
            "min": 1,
        },
    )
    balance_kv: bool = field(
        default=False,
        metadata={
            "help": "Rotary decoders: TransMLA's balanced key/value PCA: the rotary-free keys scaled to the "
            "values' norm before the joint factorization, the scale folded back into the key up-projection."
        },
    )
    rank_allocation: str = field(
        default=UNIFORM,
        metadata={
            "help": "Rotary decoders: 'uniform' gives every layer R; 'spectrum' shares the same total out by each "
            "layer's key/value spectrum on the calibration text (the error each rank leaves in the keys and "
            "values); 'sensitivity' by what each rank costs the model (each layer's attention-output error at 7 "
            "candidate ranks, weighted by the loss gradient)."
        },
    )

    def __post_init__(self) -> None:
        # Types here; the ranges are the model's (its head_dim and widths), which check() names.
        for name in ("kv_rank", "rope_dims", "rope_fold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise HeadkitError(f"{name} must be an integer, got {value!r}")
        if self.rope_fold < 1:
            raise HeadkitError(
                f"rope_fold must be an integer ≥ 1 (a divisor of head_dim/2), got {self.rope_fold}"
            )
        if self.rope_fold > 1 and self.rope_selection is not None and not self.mixed:
            raise HeadkitError(
                f"rope_fold {self.rope_fold} folds frequencies for RoRoPE's PCA: it needs rope_selection 'rorope' "
                f"or 'rorope_fitted', got {self.rope_selection!r}; or rope_fold=1"
            )
        if not isinstance(self.balance_kv, bool):
            raise HeadkitError(f"balance_kv must be True or False, got {self.balance_kv!r}")
        if self.rank_allocation not in RANK_ALLOCATIONS:
            raise HeadkitError(
                f"rank_allocation must be one of {RANK_ALLOCATIONS}, got {self.rank_allocation!r}"
            )
        if self.rope_selection is not None and self.rope_selection not in ROPE_SELECTIONS:
            raise HeadkitError(
                f"rope_selection must be one of {ROPE_SELECTIONS}, got {self.rope_selection!r}"
            )

    @property
    def mixed(self) -> bool:
        """Whether the conversion mixes the key/value heads' rotary keys (RoRoPE), as far as the config says (a
        record always does: it holds the selection used)."""
        return self.rope_selection in MIXED_SELECTIONS

    def selection(self, calibrated: bool) -> str:
        """The rotary-pair selection for a conversion with (`calibrated`) or without calibration text."""
        if self.rank_allocation == SPECTRUM and not calibrated:
            raise HeadkitError(
                "rank_allocation 'spectrum' shares the ranks out by the calibration text's key/value spectra: pass "
                "calibration=..., or rank_allocation='uniform'"
            )
        if self.rank_allocation == SENSITIVITY and not calibrated:
            raise HeadkitError(
                "rank_allocation 'sensitivity' measures each layer's cost on calibration text: pass "
                "calibration=..., or rank_allocation='uniform'"
            )
        # With calibration, RoRoPE with the fitted criterion measured best (SmolLM2, docs/latent-kv.md).
        selection = self.rope_selection or (ROROPE_FITTED if calibrated else NORMS)
        if selection in (FITTED, ROROPE_FITTED) and not calibrated:
            raise HeadkitError(
                f"rope_selection {selection!r} fits each rotary-free pair's rotation on calibration text: pass "
                "calibration=..., or rope_selection='norms' / 'rorope'"
            )
        if self.rope_fold > 1 and selection not in MIXED_SELECTIONS:
            raise HeadkitError(
                f"rope_fold {self.rope_fold} folds frequencies for RoRoPE's PCA, but without calibration text the "
                f"rotary selection is {selection!r}: pass rope_selection='rorope', or rope_fold=1"
            )
        return selection

    def check(
        self,
        model_or_config: Any,
        adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ) -> None:
        """Everything that can refuse this conversion, before any work. On a 🤗 config (before the weights are
        loaded): the family takes latent keys/values, and R and D fit the widths it states. On a model also its
        attention modules (:meth:`sites_to_convert`)."""
        if isinstance(model_or_config, nn.Module):
            self.sites_to_convert(model_or_config, adapter)
            return
        get_family(model_or_config, LATENT)
        if config_records_gates(model_or_config) or config_prunes_unevenly(model_or_config):
            uneven = config_prunes_unevenly(model_or_config)
            raise HeadkitError(
                f"the model is {f'pruned unevenly in layers {uneven}' if uneven else 'gated'}: latent keys/values "
                "need every layer's stock key/value heads; prune whole key/value groups, or remove the gates first"
            )
        hidden, kv_heads, head_dim = attention_widths(model_or_config)
        check_latent_ranks(head_dim, kv_heads, hidden, self.kv_rank, self.rope_dims, self.rope_fold)

    def record(self) -> dict[str, Any]:
        """The fields as JSON (``config.headkit_surgery`` keeps them, ``rope_selection`` there being the one
        used, with the ranks, sites and rotary pairs the conversion chose)."""
        return asdict(self)

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> LatentKVConfig:
        """The config a record was written from (a field the record predates takes its default)."""
        return cls(**fields_of_record(cls, entry))

    def bytes_per_token(self, config: Any, *, bytes_per_number: int = 2, context: int = 8192) -> int | None:
        """The latent cache's bytes per token of context for a model with the 🤗 `config`: per layer R latent
        numbers and D rotary ones per key/value head (the pruning the config records applied)."""
        counts = kv_head_counts(config)
        if counts is None:
            return None
        return sum(self.kv_rank + kv * self.rope_dims for kv in counts) * bytes_per_number

    def sites_to_convert(
        self, model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
    ) -> tuple[AttentionAdapter, list[AttentionSite]]:
        """The adapter and the attention sites to convert, checked: the model's family, its attention modules
        (stock softmax, one layer of grouped-query attention each, no per-head k/q norm) and the ranks their
        widths allow."""
        _check_not_latent(model)
        if adapter is None:
            get_family(model, LATENT)
        adapter = get_adapter(model, adapter)
        sites = _check_sites(model, adapter)
        hidden = adapter.read_projections(sites[0]).k_weight.shape[1]
        for site in sites:
            check_latent_arguments(site, hidden, self.kv_rank, self.rope_dims, self.rope_fold)
        return adapter, sites


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


def latent_mechanisms(model: nn.Module) -> list[LatentKVHeads]:
    """The model's :class:`~headkit.surgery.latent_heads.LatentKVHeads`, in layer order."""
    found = {id(m): m for m in model.modules() if isinstance(m, LatentKVHeads)}
    return sorted(found.values(), key=lambda mechanism: mechanism.layer_idx)


def set_absorbed(model: nn.Module, absorbed: bool) -> None:
    """Run every latent layer absorbed (True, the default) or through the expanded reference (False)."""
    for mechanism in latent_mechanisms(model):
        mechanism.absorbed = bool(absorbed)


def _reapply(model: nn.Module, entry: dict[str, Any]) -> None:
    """Rebuild the recorded conversion on a freshly built model (the weights are loaded afterwards)."""
    adapter = get_adapter(model, entry["adapter"])
    sites = _check_sites(model, adapter)
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
