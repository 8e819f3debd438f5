"""The config of latent keys/values, :class:`LatentKVConfig`, in a module of its own without torch model code: its
fields are ``headkit compress``'s rotary-decoder options (headkit.runs.options), and the command line refuses a
bad R or D against a model's 🤗 config (its family, its widths) before any model code is imported. The conversion
is :mod:`headkit.surgery.latent`'s; a model's sites are read by :mod:`headkit.surgery.latent_sites`, imported when a
model is checked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from headkit.errors import HeadkitError
from headkit.surgery.families import LATENT, get_family, text_config
from headkit.surgery.heads import config_prunes_unevenly, config_records_gates, kv_head_counts
from headkit.surgery.records import fields_of_record

if TYPE_CHECKING:
    from headkit.surgery.adapters import AttentionAdapter, AttentionSite

# How the latent width is shared out over the layers (LatentKVConfig.rank_allocation).
UNIFORM, SPECTRUM, SENSITIVITY = "uniform", "spectrum", "sensitivity"
RANK_ALLOCATIONS = (UNIFORM, SPECTRUM, SENSITIVITY)
# Which rotary pairs stay rotary (LatentKVConfig.rope_selection; headkit.surgery.latent_fit computes them).
FITTED, NORMS, ROROPE, ROROPE_FITTED = "fitted", "norms", "rorope", "rorope_fitted"
ROPE_SELECTIONS = (FITTED, NORMS, ROROPE, ROROPE_FITTED)
MIXED_SELECTIONS = (ROROPE, ROROPE_FITTED)


def full_rank(hidden: int, num_kv_heads: int, head_dim: int, rope_dims: int) -> int:
    """The largest useful latent width: the rank of [W_K,nope ; W_V], at most G·(2·head_dim − D) and hidden."""
    return min(hidden, num_kv_heads * (2 * head_dim - rope_dims))


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
    # (headkit.runs.options: `headkit compress`).
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
        # the model's side, imported only for a model (the config's own checks stand on no model code)
        from headkit.surgery.latent_sites import latent_sites

        adapter, sites, hidden = latent_sites(model, adapter)
        for site in sites:
            check_latent_ranks(
                site.head_dim, site.num_kv_heads, hidden, self.kv_rank, self.rope_dims, self.rope_fold
            )
        return adapter, sites
