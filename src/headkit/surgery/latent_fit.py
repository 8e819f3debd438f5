"""How a latent layer's weights are computed: calibration statistics, the rotation fit, the joint factorization and
the rank allocators (MHA2MLA, Ji et al. 2025, arXiv:2502.14837; the method: :mod:`headkit.surgery.latent`).

* **Calibration** (:func:`collect_statistics`, or :func:`weight_statistics` without text): per layer the second
  moment of the attention inputs, each rotary pair's query and key 2-norms, and the attention-weighted moments of
  each pair's score terms (:func:`rotation_moments`).
* **Partial RoPE**: :func:`expected_rotation` fits, per pair, the fixed complex factor that best replaces its
  relative rotation, :func:`fold_rotation` folds it into the key rows, and :func:`select_rotary_pairs` chooses the
  pairs that stay rotary (``"fitted"``: the largest residual; ``"norms"``: MHA2MLA's 2-norm criterion).
* **Joint low rank**: :func:`joint_latent_factors`, the activation-weighted SVD of the stacked rotary-free key and
  value rows (:func:`latent_spectrum`: its singular values; :func:`full_rank`: the width at which it is exact).
* **Rank allocation**: :func:`allocate_ranks` (by the spectra) and :func:`allocate_by_error` (by any error curves,
  at :func:`candidate_ranks`) share a total latent width out over the layers.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.ops.rotary import apply_rotary
from headkit.surgery.adapters import AttentionAdapter, AttentionSite
from headkit.surgery.latent_config import (  # noqa: F401  (the names latent_fit has always offered)
    FITTED,
    MIXED_SELECTIONS,
    NORMS,
    ROPE_SELECTIONS,
    ROROPE,
    ROROPE_FITTED,
    full_rank,
)
from headkit.surgery.latent_heads import nope_indices, rope_indices

# -- calibration ------------------------------------------------------------------------------------------------


@dataclass
class SiteStatistics:
    """What the conversion of one layer measures on calibration text."""

    input_moment: torch.Tensor  # [hidden, hidden] float64: E[x xᵀ] of the attention inputs
    query_pair_norms: torch.Tensor  # [H, head_dim/2]: E‖(q_i, q_{i+head_dim/2})‖ per query head
    key_pair_norms: torch.Tensor  # [G, head_dim/2]
    tokens: int
    rotation_moments: torch.Tensor | None = None  # [G, head_dim/2, 3, 3] (rotation_moments); None: no text

    @functools.cached_property
    def rotation_fit(self) -> RotationFit | None:
        """:func:`expected_rotation` of the moments, once for the pair selection and the fold; None without text."""
        return None if self.rotation_moments is None else expected_rotation(self.rotation_moments)


def pair_norms(projected: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[..., heads·head_dim] → [heads, head_dim/2]: the 2-norm of each rotary pair, averaged over the leading
    dimensions (rotation keeps it, so the unrotated projection gives the rotated pair's norm)."""
    per_head = projected.reshape(-1, heads, 2, head_dim // 2)
    return per_head.double().norm(dim=2).mean(dim=0)


# The score terms of one frequency pair, as bilinear forms in the query features (q1, q2, q̂1, q̂2) at m and the key
# features (k1, k2, k̂1, k̂2) at n (hats: rotated; pair i is dims i and i + head_dim/2): Re z = q1k1 + q2k2 and
# −Im z = q1k2 − q2k1 for z = q·conj(k) unrotated, and the rotated score term s = q̂1k̂1 + q̂2k̂2.
_SCORE_TERMS = torch.zeros(3, 4, 4, dtype=torch.float64)
_SCORE_TERMS[0, 0, 0] = _SCORE_TERMS[0, 1, 1] = 1.0
_SCORE_TERMS[1, 0, 1], _SCORE_TERMS[1, 1, 0] = 1.0, -1.0
_SCORE_TERMS[2, 2, 2] = _SCORE_TERMS[2, 3, 3] = 1.0


def _pair_features(x: torch.Tensor, rotated: torch.Tensor) -> torch.Tensor:
    """[B, T, heads, head_dim] (unrotated and rotated) → [B, T, heads, P, 4]: each pair's (x1, x2, x̂1, x̂2)."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:], rotated[..., :half], rotated[..., half:]), dim=-1)


def rotation_moments(
    queries: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float
) -> torch.Tensor:
    """[G, P, 3, 3] float64: per key/value group and frequency pair, Σ_h∈g Σ_{m ≥ n} a_h,mn t tᵀ with
    t = (Re z, −Im z, s) the pair's score terms (:data:`_SCORE_TERMS`) and a_h,mn the model's own attention
    probabilities — the normal equations of the attention-weighted least-squares fit in :func:`expected_rotation`.

    queries [B, T, H, head_dim] and keys [B, T, G, head_dim] as the projections write them (before rotary);
    cos/sin [B, T, head_dim] as the decoder layer hands them to attention. Causal, every position attended."""
    batch, length, heads, head_dim = queries.shape
    groups, pairs = keys.shape[2], head_dim // 2
    per_group = heads // groups
    # 🤗's cos/sin repeat the pair angles in both halves; apply_rotary takes them once.
    cos, sin = cos[..., :pairs].float(), sin[..., :pairs].float()
    queries, keys = queries.float(), keys.float()
    rotated_q, rotated_k = (
        apply_rotary(x.transpose(1, 2), cos, sin, validate=False).transpose(1, 2) for x in (queries, keys)
    )
    query_features = _pair_features(queries, rotated_q)  # [B, T, H, P, 4]
    key_features = _pair_features(keys, rotated_k)  # [B, T, G, P, 4]
    rotated_k = rotated_k.repeat_interleave(per_group, dim=2)
    scores = torch.einsum("bmhd,bnhd->bhmn", rotated_q, rotated_k) * scale
    causal = torch.ones(length, length, dtype=torch.bool, device=queries.device).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [B, H, T, T]
    key_products = (key_features[..., :, None] * key_features[..., None, :]).flatten(-2)  # [B, T, G, P, 16]
    key_products = key_products.repeat_interleave(per_group, dim=2).permute(0, 2, 1, 3, 4)
    weighted = weights @ key_products.reshape(batch, heads, length, pairs * 16)  # Σ_n a_mn B_j B_j'(n)
    query_products = (query_features[..., :, None] * query_features[..., None, :]).flatten(-2)
    moments = torch.einsum(
        "bmhpx,bhmpy->hpxy", query_products.double(), weighted.view(batch, heads, length, pairs, 16).double()
    ).view(heads, pairs, 4, 4, 4, 4)  # [h, p, i, i', j, j']: Σ a (A_i A_i')(m) (B_j B_j')(n)
    terms = _SCORE_TERMS.to(moments.device)
    per_head = torch.einsum("xij,yab,hpiajb->hpxy", terms, terms, moments)
    return per_head.view(groups, per_group, pairs, 3, 3).sum(dim=1)


@dataclass
class RotationFit:
    """:func:`expected_rotation`'s result, per key/value group g and frequency pair i ([G, P] each)."""

    cos: torch.Tensor  # a: the fixed rotation's cosine part (scaled)
    sin: torch.Tensor  # b
    residual: torch.Tensor  # the pair's weighted squared score error with the fitted (a, b)
    unrotated_residual: torch.Tensor  # … with (a, b) = (1, 0): the pair merely left unrotated
    energy: torch.Tensor  # … with (a, b) = (0, 0): the pair dropped; Σ a s²


def expected_rotation(moments: torch.Tensor) -> RotationFit:
    """Replace a rotary pair's relative rotation e^{iθ(m−n)} by the one fixed complex factor c = a + ib that best
    reproduces its score terms: (a, b) minimise Σ a_mn (s − a·Re z − b·(−Im z))², the attention-weighted squared
    error of the pair's contribution to the scores (``moments`` from :func:`rotation_moments`).

    Why: a rotary-free pair of partial RoPE (MHA2MLA) contributes Re z = q·k unrotated to every score — exact only
    at distance 0. A slow pair is well served by c ≈ 1 (what MHA2MLA does), but a fast one whose rotation averages
    out over the distances attention looks at wants c ≈ 0, and anything in between a damped, turned factor.
    c folds into the key projection (:func:`fold_rotation`), so it costs nothing at run time; the residual is
    the error the pair leaves, the criterion for which pairs stay rotary."""
    normal = moments[..., :2, :2]
    target = moments[..., :2, 2]
    ridge = 1e-12 * normal.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-300)[..., None, None]
    identity = torch.eye(2, dtype=normal.dtype, device=normal.device)
    solution = torch.linalg.solve(normal + ridge * identity, target)
    energy = moments[..., 2, 2]
    return RotationFit(
        cos=solution[..., 0],
        sin=solution[..., 1],
        residual=(energy - (solution * target).sum(-1)).clamp_min(0),
        unrotated_residual=(energy - 2 * moments[..., 0, 2] + moments[..., 0, 0]).clamp_min(0),
        energy=energy,
    )


def fold_rotation(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Key rows [G, head_dim, …] (weight rows or bias) with every pair i multiplied by conj(a_i + i b_i), so that
    q·k' unrotated equals Re(q·conj(k)·c) (:func:`expected_rotation`). cos/sin [G, P]; pairs to keep as they
    are get (1, 0)."""
    half = rows.shape[1] // 2
    shape = (*cos.shape, *([1] * (rows.dim() - 2)))
    a, b = (part.reshape(shape).to(rows.device, rows.dtype) for part in (cos, sin))
    first, second = rows[:, :half], rows[:, half:]
    return torch.cat((a * first + b * second, a * second - b * first), dim=1)


def collect_statistics(
    model: nn.Module, sites: list[AttentionSite], adapter: AttentionAdapter, batches: Iterable[dict]
) -> list[SiteStatistics]:
    """Run `model` on the calibration `batches` (dicts of model inputs) and return each site's statistics, read
    by forward hooks on its projections (their inputs: the attention inputs; their outputs: queries and keys
    before rotary). Padding tokens are counted too (calibration windows have none)."""
    sums: list[dict[str, Any]] = [
        {"moment": 0.0, "q": 0.0, "k": 0.0, "rotation": 0.0, "tokens": 0, "calls": 0} for _ in sites
    ]
    handles = []
    seen: list[dict[str, Any]] = [{} for _ in sites]  # this call's queries, keys and cos/sin, per site

    def hook(index: int, which: str, heads: int, head_dim: int):
        def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            entry = sums[index]
            if which == "v":
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
                entry["moment"] = entry["moment"] + x.T @ x
                entry["tokens"] += x.shape[0]
            else:
                seen[index][which] = output.detach().unflatten(-1, (heads, head_dim))
                entry[which] = entry[which] + pair_norms(output.detach(), heads, head_dim)
                if which == "q":
                    entry["calls"] += 1

        return record

    def embeddings(index: int):
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            found = kwargs.get("position_embeddings")
            seen[index]["rotary"] = args[1] if found is None and len(args) > 1 else found

        return record

    def moments(index: int, scale: float):
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # The stock module has run its projections: the rotation fit reads what they wrote.
            call = seen[index]
            if call.get("rotary") is not None and "q" in call and "k" in call:
                sums[index]["rotation"] = (
                    sums[index]["rotation"]
                    + rotation_moments(call["q"], call["k"], *call["rotary"], scale).cpu()
                )
            call.clear()

        return record

    for index, site in enumerate(sites):
        module = site.module
        handles.append(module.register_forward_pre_hook(embeddings(index), with_kwargs=True))
        handles.append(module.register_forward_hook(moments(index, site.scale), with_kwargs=True))
        for which, name, heads in (
            ("q", adapter.query_name, site.num_heads),
            ("k", adapter.key_name, site.num_kv_heads),
            ("v", adapter.value_name, site.num_kv_heads),
        ):
            projection = module.get_submodule(name)
            handles.append(projection.register_forward_hook(hook(index, which, heads, site.head_dim)))
    try:
        with torch.no_grad():
            for batch in batches:
                model(
                    **{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")},
                    use_cache=False,
                )
    finally:
        for handle in handles:
            handle.remove()
    if not sums or sums[0]["tokens"] == 0:
        raise HeadkitError("calibration needs at least one batch of text")
    return [
        SiteStatistics(
            input_moment=entry["moment"] / entry["tokens"],
            query_pair_norms=entry["q"] / entry["calls"],
            key_pair_norms=entry["k"] / entry["calls"],
            tokens=entry["tokens"],
            rotation_moments=entry["rotation"] if isinstance(entry["rotation"], torch.Tensor) else None,
        )
        for entry in sums
    ]


def weight_statistics(adapter: AttentionAdapter, site: AttentionSite) -> SiteStatistics:
    """Data-free stand-in for :func:`collect_statistics`: pair norms of the projection rows (‖W_{q,i}‖_F for the
    pair's two rows) and an identity input moment (plain joint SVD, MHA2MLA's own)."""
    weights = adapter.read_projections(site)
    hidden = weights.q_weight.shape[1]
    q = weights.q_weight.detach().double().reshape(site.num_heads, 2, site.head_dim // 2, hidden)
    k = weights.k_weight.detach().double().reshape(site.num_kv_heads, 2, site.head_dim // 2, hidden)
    return SiteStatistics(
        input_moment=torch.eye(hidden, dtype=torch.float64),
        query_pair_norms=q.pow(2).sum(dim=(1, 3)).sqrt(),
        key_pair_norms=k.pow(2).sum(dim=(1, 3)).sqrt(),
        tokens=0,
    )


def select_rotary_pairs(statistics: SiteStatistics, pairs: int, selection: str = NORMS) -> torch.Tensor:
    """[G, pairs]: per key/value head, the frequency pairs to keep rotary, ascending. Ties go to the lower
    (faster-rotating) frequency.

    ``"norms"``: the largest Σ_{h∈g} E‖q_{h,i}‖ · E‖k_{g,i}‖ (MHA2MLA's 2-norm criterion). ``"fitted"``: the largest
    residual of :func:`expected_rotation` — the score error a pair would leave rotary-free, after its fixed
    rotation is folded into the keys (needs ``statistics.rotation_moments``)."""
    if selection == FITTED:
        if statistics.rotation_fit is None:
            raise HeadkitError("rope_selection 'fitted' needs calibration text (calibration=...)")
        contribution = statistics.rotation_fit.residual
    else:
        queries, keys = statistics.query_pair_norms, statistics.key_pair_norms
        groups = keys.shape[0]
        contribution = queries.reshape(groups, -1, queries.shape[-1]).sum(dim=1) * keys
    order = torch.argsort(-contribution, dim=1, stable=True)
    return order[:, :pairs].sort(dim=1).values


# -- the factorization ------------------------------------------------------------------------------------------


@dataclass
class LatentFactors:
    """W ≈ up @ down for the stacked rotary-free key and value rows W [G·(n + head_dim), hidden]."""

    down: torch.Tensor  # [R, hidden]
    key_up: torch.Tensor  # [G, n, R]
    value_up: torch.Tensor  # [G, head_dim, R]
    key_error: float  # ‖(W_K,nope − K̂) Σ^{1/2}‖ / ‖W_K,nope Σ^{1/2}‖ (0 when no dimension is rotary-free)
    value_error: float  # the same for the values


def _weighted_rows(
    key_nope: torch.Tensor, value: torch.Tensor, input_moment: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, W Σ^{1/2}) in float64: the stacked rotary-free key and value rows, and the same weighted by the
    square root of the input moment (what the joint SVD factors)."""
    hidden = key_nope.shape[-1]
    stacked = torch.cat((key_nope.reshape(-1, hidden), value.reshape(-1, hidden)), dim=0).double()
    moment = input_moment.double()
    # Σ^{1/2}, regularised so that directions no calibration token spanned keep a little weight.
    eigenvalues, eigenvectors = torch.linalg.eigh(
        moment + 1e-6 * moment.diagonal().mean() * torch.eye(hidden)
    )
    root = (eigenvectors * eigenvalues.clamp_min(0).sqrt()) @ eigenvectors.T
    return stacked, stacked @ root


def allocate_by_error(curves: list[tuple[list[int], list[float]]], total: int) -> list[int]:
    """Share `total` latent dimensions out over the layers so that Σ_ℓ e_ℓ(R_ℓ) is smallest, where curve ℓ gives
    the error e_ℓ at candidate ranks (ascending) and is taken linear between them; each layer's rank stays within
    its candidates' range. Every layer starts at its smallest candidate, then the unit steps that lower the
    summed error most are taken first, along each curve's lower convex hull: optimal for convex curves (where
    the hull is the curve), and for the hull otherwise. Ties go to the earlier layer."""
    low = sum(ranks[0] for ranks, _ in curves)
    high = sum(ranks[-1] for ranks, _ in curves)
    if not curves or not low <= total <= high:
        raise HeadkitError(
            f"total must be in [{low}, {high}] (every layer between its smallest and largest candidate rank), "
            f"got {total}"
        )
    steps = []
    for layer, (ranks, errors) in enumerate(curves):
        hull: list[tuple[int, float]] = []
        for point in zip(ranks, errors, strict=True):
            # Lower hull, left to right: drop the last point while it lies on or above the chord to this one.
            while len(hull) > 1 and (hull[-1][0] - hull[-2][0]) * (point[1] - hull[-2][1]) <= (
                hull[-1][1] - hull[-2][1]
            ) * (point[0] - hull[-2][0]):
                hull.pop()
            hull.append(point)
        for (r0, e0), (r1, e1) in itertools.pairwise(hull):
            steps += [((e0 - e1) / (r1 - r0), layer)] * (r1 - r0)
    allocated = [ranks[0] for ranks, _ in curves]
    for _, layer in sorted(steps, key=lambda step: -step[0])[: total - low]:
        allocated[layer] += 1
    return allocated


def allocate_ranks(spectra: list[torch.Tensor], total: int) -> list[int]:
    """Share `total` latent dimensions out over the layers whose weighted key/value singular values are
    `spectra`, so that the sum over layers of the relative error each layer is left with,
    Σ_{j>R_ℓ} σ_{ℓj}² / Σ_j σ_{ℓj}² (the activation-weighted key/value error of :func:`joint_latent_factors`), is
    smallest (:func:`allocate_by_error`; the error is convex in R_ℓ, the σ being sorted). Every layer keeps at
    least one dimension and at most as many as its spectrum has."""
    curves = []
    for spectrum in spectra:
        energy = spectrum.double().pow(2)
        share = energy / energy.sum().clamp_min(1e-300)
        left = share.flip(0).cumsum(0).flip(0).tolist()  # left[r] = Σ_{j≥r} share_j: the error at rank r
        curves.append((list(range(1, len(spectrum) + 1)), left[1:] + [0.0]))
    return allocate_by_error(curves, total)


# The candidate ranks whose errors :func:`headkit.surgery.latent.rank_error_curves` measures, as multiples of the
# uniform rank R.
SENSITIVITY_MULTIPLES = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def candidate_ranks(kv_rank: int, top: int) -> list[int]:
    """The ranks (ascending, within [1, top]) at which each layer's sensitivity is measured: R itself and
    :data:`SENSITIVITY_MULTIPLES` of it."""
    return sorted({min(top, max(1, round(kv_rank * multiple))) for multiple in SENSITIVITY_MULTIPLES})


def balance_scale(weighted: torch.Tensor, split: int) -> float:
    """TransMLA's balanced key/value PCA (BKV; Meng et al. 2025, arXiv:2502.07864, Sec. 4.3, Eq. 20): the factor
    α = ‖W_V Σ^{1/2}‖_F / ‖W_K,nope Σ^{1/2}‖_F that gives the weighted key rows (the first `split` rows of
    `weighted`) the values' norm — the root mean square of the keys and values the layer computes on the
    calibration text —, so that the joint factorization does not spend the rank on whichever is larger.
    1 where either part is zero."""
    keys, values = weighted[:split].norm(), weighted[split:].norm()
    return float(values / keys) if keys > 0 and values > 0 else 1.0


def joint_latent_factors(
    key_nope: torch.Tensor,
    value: torch.Tensor,
    rank: int,
    input_moment: torch.Tensor,
    balance: bool = False,
) -> LatentFactors:
    """MHA2MLA's joint SVD (their Eq. 7), weighted by the input moment Σ (:mod:`headkit.surgery.latent`): U_R the leading left
    singular vectors of [W_K,nope ; W_V] Σ^{1/2}, down = U_Rᵀ W, up = U_R. key_nope [G, n, hidden], value
    [G, head_dim, hidden]; computed in float64, returned in value's dtype.

    With `balance` (TransMLA's BKV, :func:`balance_scale`): the SVD of [α W_K,nope ; W_V] Σ^{1/2} instead, down =
    U_Rᵀ [α W_K,nope ; W_V] and the key up-projection U_R,K / α — the scale folded back exactly (at full rank the
    product is W again); only which rank-R subspace is kept changes."""
    groups, nope, hidden = key_nope.shape
    head_dim = value.shape[1]
    stacked, weighted = _weighted_rows(key_nope, value, input_moment)
    split = groups * nope
    alpha = balance_scale(weighted, split) if balance else 1.0
    if alpha != 1.0:
        stacked, weighted = stacked.clone(), weighted.clone()
        stacked[:split] *= alpha
        weighted[:split] *= alpha
    left, _, _ = torch.linalg.svd(weighted, full_matrices=False)
    up = left[:, :rank]
    down = up.T @ stacked
    # Relative errors per part: the same whether measured on the balanced rows or on the original ones.
    residual = (weighted - up @ (up.T @ weighted)).reshape(-1, hidden)
    up = torch.cat((up[:split] / alpha, up[split:]), dim=0)

    def relative(rows: slice) -> float:
        total = weighted[rows].norm()
        return float(residual[rows].norm() / total) if total > 0 else 0.0

    dtype = value.dtype
    return LatentFactors(
        down=down.to(dtype),
        key_up=up[:split].reshape(groups, nope, rank).to(dtype),
        value_up=up[split:].reshape(groups, head_dim, rank).to(dtype),
        key_error=relative(slice(0, split)),
        value_error=relative(slice(split, None)),
    )


def key_rows(
    k_weight: torch.Tensor, pairs: torch.Tensor, statistics: SiteStatistics, fold: bool
) -> tuple[torch.Tensor, float | None]:
    """The key projection's rows per key/value head [G, head_dim, hidden], with the fitted fixed rotation folded
    into the rotary-free pairs when `fold` (:func:`fold_rotation`), and the score-term error the rotary-free
    pairs leave (None without a rotation fit)."""
    groups, hidden = pairs.shape[0], k_weight.shape[1]
    k_weight = k_weight.detach().reshape(groups, -1, hidden)
    kept = torch.zeros(groups, k_weight.shape[1] // 2, dtype=torch.bool).scatter_(1, pairs.cpu(), True)
    fit = statistics.rotation_fit
    if fit is None:
        return k_weight, None
    lost = torch.where(kept, 0.0, fit.residual if fold else fit.unrotated_residual)
    if fold:
        # Kept pairs stay as they are (their rotation is applied at run time, exactly).
        cos = torch.where(kept, 1.0, fit.cos)
        sin = torch.where(kept, 0.0, fit.sin)
        k_weight = fold_rotation(k_weight.double(), cos, sin).to(k_weight.dtype)
    return k_weight, float(lost.sum() / fit.energy.sum().clamp_min(1e-300))


def gather_rows(k_weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [G, n] of each key/value head's key rows k_weight [G, head_dim, hidden]."""
    return k_weight.gather(1, index[..., None].expand(-1, -1, k_weight.shape[-1]))


def latent_spectrum(
    key_nope: torch.Tensor, value: torch.Tensor, statistics: SiteStatistics, balance: bool = False
) -> torch.Tensor:
    """The singular values of one site's weighted rotary-free key and value rows [W_K,nope ; W_V] Σ^{1/2} (what
    :func:`joint_latent_factors` cuts at R; with `balance`, the keys scaled by :func:`balance_scale`): the error
    each rank leaves. key_nope [G, n, hidden] (:attr:`SiteKeys.nope_rows`), value [G, head_dim, hidden]."""
    _, weighted = _weighted_rows(key_nope, value, statistics.input_moment)
    if balance:
        split = key_nope.shape[0] * key_nope.shape[1]
        weighted = weighted.clone()
        weighted[:split] *= balance_scale(weighted, split)
    return torch.linalg.svdvals(weighted)


# -- RoRoPE and FreqFold (TransMLA) ------------------------------------------------------------------------------


@dataclass
class RotaryMixing:
    """TransMLA's RoRoPE, with FreqFold (Meng et al. 2025, arXiv:2502.07864, Sec. 4.2, Eq. 19, App. B–C), for one
    layer of G key/value heads with P = head_dim/2 frequency pairs (:func:`rotary_mixing`).

    Pair component (g, f) — key head g's 2-D vector (k_{g,f}, k_{g,f+P}) at frequency f — is indexed g·P + f, and
    so is slot (c, p): "virtual" key head c's pair at frequency p. ``mix`` [G·P, G·P] is orthogonal and maps
    components to slots, the same coefficient for both coordinates of a pair: k'_{c,p} = Σ_{g,f} mix[(c,p),(g,f)]
    k_{g,f}. Without folding it mixes each frequency's components among themselves only (f = p), so it commutes
    with the rotation and every score is unchanged (Eq. 19); with a fold of F it mixes the F neighbouring
    frequencies of a block too, and slot (c, p) is rotated at θ_p (the approximation FreqFold makes)."""

    mix: torch.Tensor  # [G·P, G·P] float64, rows slots (c, p), columns components (g, f)
    pairs: torch.Tensor  # [G, D/2]: per virtual head c, the frequencies p of its slots kept rotary, ascending
    energy: torch.Tensor  # [G, P] float64: each slot's key energy E‖k'_{c,p}‖² on the calibration text
    fold: int

    @property
    def kept(self) -> torch.Tensor:
        """[G, P] bool: the slots kept rotary."""
        groups, pairs = self.energy.shape
        return torch.zeros(groups, pairs, dtype=torch.bool).scatter_(1, self.pairs, True)

    @property
    def lost_energy(self) -> float:
        """The share of the keys' energy left without rotation (the rotary-free slots')."""
        return float(self.energy[~self.kept].sum() / self.energy.sum().clamp_min(1e-300))

    def key_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Key rows [G, head_dim, …] (weight rows or bias) → the virtual heads' rows k' (same shape)."""
        groups, head_dim = rows.shape[:2]
        half = head_dim // 2
        split = rows.double().reshape(groups, 2, half, -1).transpose(0, 1).reshape(2, groups * half, -1)
        mixed = (self.mix @ split).reshape(2, groups, half, -1).transpose(0, 1)
        return mixed.reshape(rows.shape).to(rows.dtype)

    def rest_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The part of key rows [G, head_dim, …] that the rotary-free slots carry, in the original heads'
        coordinates: mixᵀ (1 − kept) mix k. Head g's query dotted with it is exactly the rotary-free slots' share
        of the scores against head g (the mix is orthogonal), so it is what the latent must reproduce."""
        groups, head_dim = rows.shape[:2]
        half = head_dim // 2
        free = (~self.kept).flatten().to(self.mix.dtype)
        projector = self.mix.T @ (free[:, None] * self.mix)
        split = rows.double().reshape(groups, 2, half, -1).transpose(0, 1).reshape(2, groups * half, -1)
        rest = (projector @ split).reshape(2, groups, half, -1).transpose(0, 1)
        return rest.reshape(rows.shape).to(rows.dtype)

    def query_mix(self) -> torch.Tensor:
        """[G, D/2, G, P]: per kept slot (c, s) — virtual head c's s-th rotary pair —, the coefficient of query
        group g's pair f in the query against it (mix[(c, pairs[c, s]), (g, f)]); the query is mixed before it is
        rotated at the slot's frequency."""
        groups, half = self.energy.shape
        grid = self.mix.reshape(groups, half, groups, half)
        index = self.pairs[:, :, None, None].expand(-1, -1, groups, half)
        return grid.gather(1, index)


def key_pair_moments(rows: torch.Tensor, input_moment: torch.Tensor) -> torch.Tensor:
    """[G·P, G·P] float64: E[Σ_coord k_{g,f,coord} k_{g',f',coord}] of the key pair components (indexed g·P + f,
    both coordinates summed) from the key rows [G, head_dim, hidden] and the input moment Σ = E[x xᵀ] (the bias
    is not counted: the PCA's criterion only, the mix stays exact)."""
    groups, head_dim, hidden = rows.shape
    half = head_dim // 2
    split = rows.double().reshape(groups, 2, half, hidden).transpose(0, 1).reshape(2, groups * half, hidden)
    moment = input_moment.double().to(split.device)
    return torch.einsum("xah,hk,xbk->ab", split, moment, split)


def rotary_mixing(
    rows: torch.Tensor,
    input_moment: torch.Tensor,
    rope_dims: int,
    fold: int = 1,
    frequency_weights: torch.Tensor | None = None,
) -> RotaryMixing:
    """TransMLA's RoRoPE (+ FreqFold) for one layer (see :class:`RotaryMixing`), from the key rows
    [G, head_dim, hidden] and the input moment (:func:`key_pair_moments`).

    Per block of `fold` neighbouring frequencies, the PCA of its G·fold pair components (the eigenvectors of their
    second moment, largest first): the principal components carry the keys' rotary energy in as few slots as the
    spectrum allows. The G·D/2 slots kept rotary are the components of largest energy over all blocks, so each
    layer keeps rotary where its keys' energy is (not D/2 pairs of each original head). To keep D dims per virtual
    head (the cache's layout), a block's kept components are spread evenly over its frequencies and those over
    the virtual heads cyclically; the component-to-slot assignment is free (any permutation keeps the mix
    orthogonal), so this costs nothing.

    `frequency_weights` [P] (None: all 1): the kept components are those of largest energy × weight of their
    block (the mean over its frequencies) — with :func:`rotation_residual_shares`, the score error a component
    would leave rotary-free once its fitted rotation is folded in, instead of its energy."""
    groups, head_dim, _ = rows.shape
    half = head_dim // 2
    if fold < 1 or half % fold:
        raise HeadkitError(f"rope_fold must divide head_dim/2 = {half}, got {fold}")
    moments = key_pair_moments(rows, input_moment).reshape(groups, half, groups, half)
    blocks = half // fold
    vectors, values = [], []
    for block in range(blocks):
        span = slice(block * fold, (block + 1) * fold)
        local = moments[:, span, :, span].reshape(groups * fold, groups * fold)
        eigenvalues, eigenvectors = torch.linalg.eigh(local)
        order = torch.argsort(eigenvalues, descending=True, stable=True)
        values.append(eigenvalues[order].clamp_min(0))
        vectors.append(eigenvectors[:, order])  # columns: components (g, f in block) → principal component j
    # The G·D/2 components of largest energy stay rotary: a prefix of each block's (its values are sorted).
    energies = torch.stack(values)  # [blocks, G·fold]
    criterion = energies
    if frequency_weights is not None:
        criterion = energies * frequency_weights.double().reshape(blocks, fold).mean(dim=1, keepdim=True)
    flat = torch.argsort(-criterion.flatten(), stable=True)[: groups * rope_dims // 2]
    kept_per_block = torch.bincount(flat // (groups * fold), minlength=blocks).tolist()
    mix = torch.zeros(groups * half, groups * half, dtype=torch.float64)
    energy = torch.zeros(groups, half, dtype=torch.float64)
    kept_slots: list[list[int]] = [[] for _ in range(groups)]
    head = 0
    for block, count in enumerate(kept_per_block):
        frequencies = range(block * fold, (block + 1) * fold)
        per_frequency = [count // fold + (i < count % fold) for i in range(fold)]
        kept, free = [], []
        for frequency, many in zip(frequencies, per_frequency, strict=True):
            chosen = {(head + j) % groups for j in range(many)}
            head = (head + many) % groups
            kept += [(c, frequency) for c in sorted(chosen)]
            free += [(c, frequency) for c in range(groups) if c not in chosen]
        columns = torch.tensor([g * half + f for g in range(groups) for f in frequencies])
        for component, (c, p) in enumerate(kept + free):
            mix[c * half + p, columns] = vectors[block][:, component]
            energy[c, p] = values[block][component]
        for c, p in kept:
            kept_slots[c].append(p)
    pairs = torch.tensor([sorted(slots) for slots in kept_slots], dtype=torch.long).reshape(
        groups, rope_dims // 2
    )
    return RotaryMixing(mix=mix, pairs=pairs, energy=energy, fold=fold)


def naive_rotary_mixing(
    keys: torch.Tensor, rope_dims: int, fold: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`rotary_mixing`'s PCA from key samples keys [N, G, head_dim] (before rotary): per block
    of `fold` frequencies, loop by loop, the sample matrix of its pair components with both coordinates as
    separate samples, its eigen-decomposition, the energies sorted. Returns (energies [P/fold, G·fold] largest
    first, and the kept count per block) — what the fast path must reproduce from E[x xᵀ]."""
    samples, groups, head_dim = keys.shape
    half = head_dim // 2
    energies, counts = [], []
    for block in range(half // fold):
        columns = []
        for g in range(groups):
            for f in range(block * fold, (block + 1) * fold):
                columns.append(torch.cat((keys[:, g, f], keys[:, g, f + half])).double())
        matrix = torch.stack(columns, dim=1)  # [2N, G·fold]
        energies.append(torch.linalg.eigvalsh(matrix.T @ matrix / samples).flip(0).clamp_min(0))
    stacked = torch.stack(energies)
    chosen = torch.argsort(-stacked.flatten(), stable=True)[: groups * rope_dims // 2]
    counts = torch.bincount(chosen // stacked.shape[1], minlength=stacked.shape[0])
    return stacked, counts


@dataclass
class SiteKeys:
    """One layer's key rows split for the latent form (:func:`site_keys`)."""

    pairs: torch.Tensor  # [G, D/2]: per (virtual, with RoRoPE) key head, the frequency pairs kept rotary
    rope_rows: torch.Tensor  # [G·D, hidden]: the rotary key rows the cache stores, head by head
    rope_bias: torch.Tensor | None  # [G·D]
    nope_rows: (
        torch.Tensor
    )  # [G, n, hidden]: what the latent reproduces (n = head_dim − D; head_dim with RoRoPE)
    rope_error: float | None  # see LatentSiteReport.rope_error
    mixing: RotaryMixing | None = None


def rotation_residual_shares(fit: RotationFit) -> torch.Tensor:
    """[P]: per frequency, the share of its score terms' energy that a fixed rotation leaves as error
    (Σ_g residual / Σ_g energy of :func:`expected_rotation`): near 0 for the slow pairs a fixed factor serves, near
    1 for the fast ones whose rotation matters at every distance."""
    return (fit.residual.sum(0) / fit.energy.sum(0).clamp_min(1e-300)).clamp(0, 1)


def site_keys(
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    statistics: SiteStatistics,
    rope_dims: int,
    selection: str,
    fold: int = 1,
) -> SiteKeys:
    """The key rows of one layer (k_weight [G·head_dim, hidden], k_bias [G·head_dim] or None) split into the rotary
    ones the cache keeps and the rotary-free ones the latent reproduces, by the rotary `selection`: per head
    (``"fitted"``, ``"norms"``: :func:`select_rotary_pairs`, :func:`key_rows`), or across heads (``"rorope"``:
    :func:`rotary_mixing` with a fold of `fold`)."""
    groups = statistics.key_pair_norms.shape[0]
    hidden = k_weight.shape[1]
    rows = k_weight.detach().reshape(groups, -1, hidden)
    head_dim = rows.shape[1]
    bias = None if k_bias is None else k_bias.detach().reshape(groups, head_dim)
    if selection in MIXED_SELECTIONS:
        fit = statistics.rotation_fit if selection == ROROPE_FITTED else None
        if selection == ROROPE_FITTED and fit is None:
            raise HeadkitError("rope_selection 'rorope_fitted' needs calibration text (calibration=...)")
        weights = None if fit is None else rotation_residual_shares(fit)
        mixing = rotary_mixing(rows, statistics.input_moment, rope_dims, fold, weights)
        rest = mixing.rest_rows(rows)
        if fit is not None:
            # The rotary-free part of each head's keys gets that head's fitted rotation per pair
            # (fold_rotation): what the kept slots leave of a pair is served as the "fitted" selection serves a
            # whole pair.
            rest = fold_rotation(rest.double(), fit.cos, fit.sin).to(rest.dtype)
        rope_index = rope_indices(mixing.pairs, head_dim)
        virtual = mixing.key_rows(rows)
        return SiteKeys(
            pairs=mixing.pairs,
            rope_rows=gather_rows(virtual, rope_index).reshape(-1, hidden),
            rope_bias=None if bias is None else mixing.key_rows(bias).gather(1, rope_index).flatten(),
            nope_rows=rest,
            rope_error=mixing.lost_energy,
            mixing=mixing,
        )
    pairs = select_rotary_pairs(statistics, rope_dims // 2, selection)
    folded, rope_error = key_rows(k_weight, pairs, statistics, selection == FITTED)
    rope_index = rope_indices(pairs, head_dim)
    return SiteKeys(
        pairs=pairs,
        rope_rows=gather_rows(folded, rope_index).reshape(-1, hidden),
        rope_bias=None if bias is None else bias.gather(1, rope_index).flatten(),
        nope_rows=gather_rows(folded, nope_indices(rope_index, head_dim)),
        rope_error=rope_error,
    )


__all__ = [
    "FITTED",
    "LatentFactors",
    "NORMS",
    "ROPE_SELECTIONS",
    "MIXED_SELECTIONS",
    "ROROPE",
    "ROROPE_FITTED",
    "RotaryMixing",
    "RotationFit",
    "SENSITIVITY_MULTIPLES",
    "SiteKeys",
    "SiteStatistics",
    "allocate_by_error",
    "allocate_ranks",
    "balance_scale",
    "candidate_ranks",
    "collect_statistics",
    "expected_rotation",
    "fold_rotation",
    "full_rank",
    "gather_rows",
    "joint_latent_factors",
    "key_pair_moments",
    "key_rows",
    "latent_spectrum",
    "naive_rotary_mixing",
    "pair_norms",
    "rotary_mixing",
    "rotation_moments",
    "rotation_residual_shares",
    "select_rotary_pairs",
    "site_keys",
    "weight_statistics",
]
