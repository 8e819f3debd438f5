"""Shared query/key projections for collaborative heads, by CP decomposition of the heads' bilinear forms.

Cordonnier, Loukas & Jaggi 2020, "Multi-Head Attention: Collaborate Instead of Concatenate", Sec. 4
(re-parametrising a trained layer). Head h scores tokens with the bilinear form X W_{Q,h} W_{K,h}ᵀ Xᵀ;
stacking the heads' forms gives the tensor T ∈ R^{hidden × heads × hidden}, T[:, h, :] = W_{Q,h} W_{K,h}ᵀ.
Collaborative heads share one query and one key projection of width D̃ and differ only by a mixing vector m_h
(Head_h = Attention(X W̃_Q diag(m_h), X W̃_K, ...)), so re-parametrising needs a rank-D̃ CP decomposition

    T[:, h, :] ≈ A diag(C[h]) Bᵀ,    A, B ∈ R^{hidden × D̃},  C ∈ R^{heads × D̃},

returned as w_q_shared = Aᵀ, mixing = C, w_k_shared = Bᵀ (``nn.Linear`` layout).

The fit is CP-ALS (Kolda & Bader 2009, "Tensor Decompositions and Applications", Sec. 3.4): each factor in
turn solves its linear least-squares problem, e.g. A (BᵀB ∗ CᵀC) = T_(1) (C ⊙ B). T itself is never formed:
each slice has rank head_dim, T_h = P_h Q_hᵀ with P_h = W_{Q,h}, Q_h = W_{K,h} ∈ R^{hidden × head_dim}, so
every quantity ALS needs comes from the per-head factors (:class:`_PerHeadTensor`):

    MTTKRP for A:  Σ_h T_h B diag(C[h]) = Σ_h P_h (Q_hᵀ B) diag(C[h])   (two hidden × heads·head_dim matmuls)
    MTTKRP for C:  a_rᵀ T_h b_r = Σ_i (P_hᵀ A)[i, r] (Q_hᵀ B)[i, r]
    ‖T‖²        = Σ_h tr((P_hᵀ P_h)(Q_hᵀ Q_h))
    ⟨T, T̂⟩      = Σ_{h,r} C[h, r] a_rᵀ T_h b_r,     ‖T̂‖² = 1ᵀ (AᵀA ∗ BᵀB ∗ CᵀC) 1

at O(heads·head_dim·hidden·D̃) per sweep instead of O(hidden²·heads·D̃). :func:`naive_decompose_query_key`
runs the same algorithm with every one of those quantities taken from the dense tensor
(:class:`_DenseTensor`); it is the reference the tests compare against.

ALS only finds a local optimum, so the start matters. Three are raced for ``_RACE_SWEEPS`` sweeps and the one
ahead continues:
  * "hosvd": A and B are the leading D̃ eigenvectors of Σ_h T_h T_hᵀ and Σ_h T_hᵀ T_h (the mode-1 and mode-3
    unfoldings' left singular vectors), the mixing their least-squares solution.
  * "svd" (tensorly's ``init="svd"``): the same B, the mixing from the leading eigenvectors of the heads' Gram
    matrix ⟨T_h, T_g⟩ (seeded random columns beyond the number of heads), A its least-squares solution. It
    does not pair a_r with b_r by eigenvalue order as "hosvd" does; on trained weights the two end within ~1%
    of each other, either ahead.
  * "gevd" (Leurgans, Ross & Abel 1993, "A decomposition for three-way arrays"): within the "hosvd" subspaces,
    two combinations of the heads' slices M = Ã diag(·) B̃ᵀ share Ã as the eigenvectors of M₂ M₁⁻¹. Exact in
    one step when T has CP rank D̃ ≤ hidden (e.g. weights that came out of a collaborative layer); behind on
    trained weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from headkit.layers.collaborative import concatenated_mixing
from headkit.ops._validation import check_positive_int

# Ridge added to the normal equations, relative to their mean diagonal: keeps rank-deficient solves finite
# while perturbing well-posed ones far below the accuracy anyone asks of a decomposition.
_RIDGE = 1e-10
# Sweeps each start gets before the better one is kept: on trained weights the final ranking shows by then.
_RACE_SWEEPS = 10

Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DecompositionInfo:
    """How a :func:`decompose_query_key` run went.

    relative_error: ‖T − T̂‖_F / ‖T‖_F of the returned factors, computed from the factors to ~1e-13 (0 on the
        exact path and for an all-zero T).
    iterations: ALS sweeps behind the returned factors (0 on the exact path); the starts that lost the race
        ran up to ``_RACE_SWEEPS`` sweeps each on top.
    converged: the stopping rule fired before ``max_iter`` (always True on the exact path).
    seconds: wall-clock time of the whole call.
    start: the start ALS continued from, "hosvd", "svd" or "gevd" (module docstring); "exact" for
        D̃ ≥ heads·head_dim, "zero" for all-zero weights.
    error_history: relative error of the start, then after each sweep, as ALS estimates it: resolved to ~1e-7
        only, so near an exact fit it can sit above ``relative_error``.
    """

    relative_error: float
    iterations: int
    converged: bool
    seconds: float
    start: str
    error_history: tuple[float, ...]

    @property
    def exact(self) -> bool:
        return self.start == "exact"


def decompose_query_key(
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    num_heads: int,
    dim_shared_query_key: int,
    *,
    seed: int = 0,
    tol: float = 1e-7,
    max_iter: int = 500,
    return_info: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Factor each head's query/key bilinear form through shared projections (Cordonnier et al. 2020, Sec. 4).

    Finds w_q_shared [D̃, hidden], mixing [heads, D̃], w_k_shared [D̃, hidden] such that for every head h

        W_{Q,h} W_{K,h}ᵀ ≈ w_q_sharedᵀ diag(mixing[h]) w_k_shared,

    where W_{Q,h} = w_q[h·d:(h+1)·d, :]ᵀ, i.e. a rank-D̃ CP decomposition of T[:, h, :] = W_{Q,h} W_{K,h}ᵀ,
    fitted by CP-ALS on the per-head factors (see the module docstring); the dense tensor is never formed.

    * D̃ ≥ heads·head_dim is exact: the concatenated projections with a block 0/1 mixing (extra rows zero).
    * Otherwise ALS continues from the best of three starts after a short race (module docstring) and stops
      when the relative error changes by less than ``tol`` times itself, falls below ``tol``, or after
      ``max_iter`` sweeps. Each sweep also tries an extrapolated step (Bro 1998) and keeps it when it fits
      better.
    * Computed in float64, returned in the weights' dtype, without autograd history. Components are sorted by
      weight (largest first), signed so the largest entry of each shared projection row is positive, and
      scaled so a row of w_q_shared, the same row of w_k_shared and the column of mixing have equal norms.

    Args:
        w_q, w_k: ``nn.Linear`` weights of the query and key projections, [heads·head_dim, hidden] each.
        num_heads: number of heads; must divide the rows of the weights.
        dim_shared_query_key: D̃, the width of the shared projections.
        seed: seeds the random columns the starts need where D̃ exceeds the number of eigenvectors available
            (D̃ > heads for the "svd" start's mixing, D̃ > hidden for the others); the result is a
            deterministic function of the inputs and the seed.
        tol: stopping tolerance on the relative change of the relative error (0 runs all ``max_iter`` sweeps).
        max_iter: ALS sweep budget (0 returns the start).
        return_info: also return a :class:`DecompositionInfo`.

    Returns:
        (w_q_shared, mixing, w_k_shared), plus the info when ``return_info``.
    """
    return _decompose(
        _PerHeadTensor, w_q, w_k, num_heads, dim_shared_query_key, seed, tol, max_iter, return_info
    )


def naive_decompose_query_key(
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    num_heads: int,
    dim_shared_query_key: int,
    *,
    seed: int = 0,
    tol: float = 1e-7,
    max_iter: int = 500,
    return_info: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Test reference for :func:`decompose_query_key`: the same CP-ALS on the dense [hidden, heads, hidden]
    tensor.

    Every MTTKRP, Gram matrix, compressed slice and error comes straight from T by einsum (Kolda & Bader 2009,
    Sec. 3.4), at O(hidden²·heads·D̃) per sweep and O(hidden²·heads) memory.
    """
    return _decompose(
        _DenseTensor, w_q, w_k, num_heads, dim_shared_query_key, seed, tol, max_iter, return_info
    )


def _decompose(
    tensor_class: type[_PerHeadTensor] | type[_DenseTensor],
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    num_heads: int,
    rank: int,
    seed: int,
    tol: float,
    max_iter: int,
    return_info: bool,
) -> tuple[torch.Tensor, ...]:
    heads, head_dim, hidden = _check_inputs(w_q, w_k, num_heads, rank, tol, max_iter)
    started = time.perf_counter()
    dtype = w_q.dtype

    def finish(factors: Factors, error: float, sweeps: int, converged: bool, start: str, history) -> tuple:
        w_q_shared, mixing, w_k_shared = (factor.detach().to(dtype).contiguous() for factor in factors)
        if not return_info:
            return w_q_shared, mixing, w_k_shared
        info = DecompositionInfo(
            relative_error=float(error),
            iterations=sweeps,
            converged=converged,
            seconds=time.perf_counter() - started,
            start=start,
            error_history=tuple(history),
        )
        return w_q_shared, mixing, w_k_shared, info

    if rank >= heads * head_dim:
        return finish(_exact_factors(w_q, w_k, heads, rank), 0.0, 0, True, "exact", (0.0,))

    tensor = tensor_class(w_q.detach().to(torch.float64), w_k.detach().to(torch.float64), heads)
    if tensor.norm_sq == 0.0:
        zeros = w_q.new_zeros(rank, hidden), w_q.new_zeros(heads, rank), w_q.new_zeros(rank, hidden)
        return finish(zeros, 0.0, 0, True, "zero", (0.0,))

    generator = torch.Generator(device="cpu").manual_seed(seed)
    fit = _fit_cp(tensor, rank, generator, tol, max_iter)
    error = tensor.precise_relative_error(fit.a, fit.b, fit.c)
    return finish(_canonical(fit.a, fit.b, fit.c), error, fit.sweeps, fit.converged, fit.start, fit.history)


# ------------------------------------------------------------------------------------ the tensor, two ways


class _PerHeadTensor:
    """T[:, h, :] = P_h Q_hᵀ held as its per-head factors; every ALS quantity in O(heads·head_dim·hidden·D̃).

    The projections P_hᵀA and Q_hᵀB of the last factors seen are cached: a sweep asks for each of them twice.
    """

    def __init__(self, w_q: torch.Tensor, w_k: torch.Tensor, heads: int) -> None:
        rows, self.hidden = w_q.shape
        self.heads, self.head_dim = heads, rows // heads
        self.w_q, self.w_k = w_q, w_k  # row h·d + i is column i of P_h (resp. Q_h)
        self._query_heads = w_q.reshape(heads, self.head_dim, self.hidden)
        self._key_heads = w_k.reshape(heads, self.head_dim, self.hidden)
        self._query_gram = self._query_heads @ self._query_heads.mT  # P_hᵀ P_h, [heads, d, d]
        self._key_gram = self._key_heads @ self._key_heads.mT
        # Σ_h tr(P_hᵀP_h Q_hᵀQ_h), an elementwise sum because both Gram matrices are symmetric.
        self.norm_sq = float((self._query_gram * self._key_gram).sum())
        self._cache: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def mode_grams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The [hidden, hidden] Gram matrices of the mode-1 and mode-3 unfoldings:
        Σ_h T_h T_hᵀ = Σ_h P_h (Q_hᵀQ_h) P_hᵀ and Σ_h T_hᵀ T_h = Σ_h Q_h (P_hᵀP_h) Q_hᵀ."""
        rows = self.heads * self.head_dim
        query_side = self.w_q.T @ (self._key_gram @ self._query_heads).reshape(rows, self.hidden)
        key_side = self.w_k.T @ (self._query_gram @ self._key_heads).reshape(rows, self.hidden)
        return query_side, key_side

    def head_gram(self) -> torch.Tensor:
        """[heads, heads]: ⟨T_h, T_g⟩ = tr(P_h Q_hᵀ Q_g P_gᵀ) = Σ (P_hᵀP_g) ∗ (Q_hᵀQ_g)."""
        query_cross = torch.einsum("hdi,gei->hgde", self._query_heads, self._query_heads)
        key_cross = torch.einsum("hdi,gei->hgde", self._key_heads, self._key_heads)
        return (query_cross * key_cross).sum(dim=(2, 3))

    def compressed_slices(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[heads, R, R]: Uᵀ T_h V = (P_hᵀU)ᵀ (Q_hᵀV)."""
        return self._query_projection(u).mT @ self._key_projection(v)

    def mttkrp_query(self, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """[hidden, R]: Σ_h T_h B diag(C[h]) = Σ_h P_h (Q_hᵀB) diag(C[h])."""
        weighted = self._key_projection(b) * c[:, None, :]
        return self.w_q.T @ weighted.reshape(self.heads * self.head_dim, -1)

    def mttkrp_key(self, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """[hidden, R]: Σ_h T_hᵀ A diag(C[h]) = Σ_h Q_h (P_hᵀA) diag(C[h])."""
        weighted = self._query_projection(a) * c[:, None, :]
        return self.w_k.T @ weighted.reshape(self.heads * self.head_dim, -1)

    def mixing_rhs(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[heads, R]: a_rᵀ T_h b_r = Σ_i (P_hᵀA)[i, r] (Q_hᵀB)[i, r]."""
        return (self._query_projection(a) * self._key_projection(b)).sum(dim=1)

    def relative_error(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, grams: Factors) -> float:
        """From the factors and their Gram matrices (AᵀA, BᵀB, CᵀC), which ALS has at hand anyway."""
        # ‖T − T̂‖² = ‖T‖² − 2⟨T, T̂⟩ + ‖T̂‖² cancels once the fit is close to exact: float64 then resolves
        # the relative error only to ~1e-7 (~1e-6 with ill-conditioned components). Good enough to steer ALS;
        # the error finally reported comes from precise_relative_error.
        inner = float((c * self.mixing_rhs(a, b)).sum())
        a_gram, b_gram, c_gram = grams
        fit_norm_sq = float((a_gram * b_gram * c_gram).sum())
        return max(self.norm_sq - 2.0 * inner + fit_norm_sq, 0.0) ** 0.5 / self.norm_sq**0.5

    def precise_relative_error(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> float:
        """relative_error without its cancellation, for the error reported at the end (~1e-13 resolution).

        Split the key space along B = O Z (reduced QR, O orthonormal): Q_h = O X_h + Q⊥_h with X_h = OᵀQ_h.
        Then T_h − T̂_h = (P_h X_hᵀ − A diag(C[h]) Zᵀ) Oᵀ + P_h Q⊥_hᵀ, two terms with orthogonal row spaces,
        so ‖T_h − T̂_h‖² = ‖P_h X_hᵀ − A diag(C[h]) Zᵀ‖² + tr(P_hᵀP_h Q⊥_hᵀQ⊥_h): one entrywise difference and
        a sum of non-negative terms. Costs O(heads·hidden·D̃²), about two sweeps.
        """
        basis, triangle = torch.linalg.qr(b)
        key_in_basis = self._key_heads @ basis  # X_hᵀ, [heads, d, m]
        inside = self._query_heads.mT @ key_in_basis - torch.einsum("ir,hr,mr->him", a, c, triangle)
        key_outside = self._key_heads.mT - basis @ key_in_basis.mT  # Q⊥_h, [heads, hidden, d]
        outside = (self._query_gram * (key_outside.mT @ key_outside)).sum()
        return float((inside**2).sum() + outside) ** 0.5 / self.norm_sq**0.5

    def _query_projection(self, a: torch.Tensor) -> torch.Tensor:  # P_hᵀ A, [heads, d, R]
        return self._projection("query", self.w_q, a)

    def _key_projection(self, b: torch.Tensor) -> torch.Tensor:  # Q_hᵀ B, [heads, d, R]
        return self._projection("key", self.w_k, b)

    def _projection(self, side: str, weight: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        recent = self._cache.setdefault(side, [])
        for seen, projection in recent:
            if seen is factor:
                return projection
        projection = (weight @ factor).reshape(self.heads, self.head_dim, -1)
        # Two entries: a rejected extrapolation must not evict the current iterate's projection.
        recent[:] = [(factor, projection), *recent[:1]]
        return projection


class _DenseTensor:
    """The naive twin of :class:`_PerHeadTensor`: T formed densely, every quantity by einsum over it."""

    def __init__(self, w_q: torch.Tensor, w_k: torch.Tensor, heads: int) -> None:
        rows, self.hidden = w_q.shape
        self.heads = heads
        per_head = (w.reshape(heads, rows // heads, self.hidden) for w in (w_q, w_k))
        self.tensor = torch.einsum("hdi,hdj->ihj", *per_head)  # [hidden, heads, hidden]
        self.norm_sq = float((self.tensor**2).sum())

    def mode_grams(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tensor
        return torch.einsum("ihj,khj->ik", t, t), torch.einsum("ihj,ihk->jk", t, t)

    def head_gram(self) -> torch.Tensor:
        return torch.einsum("ihj,igj->hg", self.tensor, self.tensor)

    def compressed_slices(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ihj,ir,js->hrs", self.tensor, u, v)

    def mttkrp_query(self, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ihj,hr,jr->ir", self.tensor, c, b)

    def mttkrp_key(self, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ihj,ir,hr->jr", self.tensor, a, c)

    def mixing_rhs(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ihj,ir,jr->hr", self.tensor, a, b)

    def relative_error(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, grams: Factors) -> float:
        return self.precise_relative_error(a, b, c)  # the Gram matrices are not needed here

    def precise_relative_error(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> float:
        residual = self.tensor - torch.einsum("ir,hr,jr->ihj", a, c, b)
        return float((residual**2).sum()) ** 0.5 / self.norm_sq**0.5


# ----------------------------------------------------------------------------------------------- CP-ALS


def _fit_cp(
    tensor: _PerHeadTensor | _DenseTensor, rank: int, generator: torch.Generator, tol: float, max_iter: int
) -> _Trajectory:
    query_basis, key_basis = (_leading_eigenvectors(gram, rank, generator) for gram in tensor.mode_grams())
    runs = [
        _Trajectory(tensor, query_basis, key_basis, "hosvd"),
        _Trajectory(tensor, *_svd_start(tensor, key_basis, rank, generator), "svd"),
    ]
    if rank <= tensor.hidden and tensor.heads > 1:
        gevd = _gevd_start(tensor, query_basis, key_basis)
        if gevd is not None:
            runs.append(_Trajectory(tensor, *gevd, "gevd"))
    for run in runs:
        run.advance(min(_RACE_SWEEPS, max_iter), tol)
    best = min(runs, key=lambda run: run.history[-1])  # a tie keeps the earlier start
    best.advance(max_iter, tol)
    return best


class _Trajectory:
    """One CP-ALS run (Kolda & Bader 2009, Sec. 3.4) from a start (A, B), with extrapolation (Bro 1998).

    A and B keep unit columns; C carries the scale. Each sweep solves for A, then B, then C, each from the
    normal equations of its least-squares problem, so the error never increases.
    """

    def __init__(
        self, tensor: _PerHeadTensor | _DenseTensor, a: torch.Tensor, b: torch.Tensor, start: str
    ) -> None:
        self.tensor, self.start = tensor, start
        a_gram, b_gram = a.T @ a, b.T @ b
        c = _solve_normal_equations(tensor.mixing_rhs(a, b), a_gram * b_gram)
        self.a, self.b, self.c = a, b, c
        self.grams = a_gram, b_gram, c.T @ c  # kept with the factors: they cost as much as the big matmuls
        self.history = [tensor.relative_error(a, b, c, self.grams)]
        self.converged = False
        self._extrapolation = _Extrapolation()

    @property
    def sweeps(self) -> int:
        return len(self.history) - 1

    def advance(self, max_sweeps: int, tol: float) -> None:
        while self.sweeps < max_sweeps and not self.converged:
            self._sweep()
            self.converged = _has_converged(self.history, tol)

    def _sweep(self) -> None:
        tensor, b, c = self.tensor, self.b, self.c
        _, b_gram, c_gram = self.grams
        a = _unit_columns(_solve_normal_equations(tensor.mttkrp_query(b, c), b_gram * c_gram))
        a_gram = a.T @ a
        b = _unit_columns(_solve_normal_equations(tensor.mttkrp_key(a, c), a_gram * c_gram))
        b_gram = b.T @ b
        c = _solve_normal_equations(tensor.mixing_rhs(a, b), a_gram * b_gram)
        grams = a_gram, b_gram, c.T @ c
        error = tensor.relative_error(a, b, c, grams)

        trial = self._extrapolation.propose(self.sweeps + 1, (self.a, self.b, self.c), (a, b, c))
        if trial is not None:
            trial_grams = tuple(factor.T @ factor for factor in trial)
            trial_error = tensor.relative_error(*trial, trial_grams)
            if self._extrapolation.judge(trial_error < error):
                (a, b, c), grams, error = trial, trial_grams, trial_error
        self.a, self.b, self.c, self.grams = a, b, c, grams
        self.history.append(error)


class _Extrapolation:
    """Line-search acceleration of ALS (Bro 1998, "Multi-way Analysis in the Food Industry", PhD thesis; also
    tensorly's ``parafac(linesearch=True)``).

    ALS creeps along narrow valleys ("swamps"); after sweep k it pays to try the point
    X_{k−1} + k^{1/p} (X_k − X_{k−1}) for all three factors at once and keep it when it fits better. After
    ``_MAX_FAILURES`` rejected jumps in a row, p grows by one, so the jumps shrink.
    """

    _FIRST_SWEEP = 3  # the first sweeps move far from the start; extrapolating them overshoots
    _MAX_FAILURES = 4

    def __init__(self) -> None:
        self.root = 2.0
        self.failures = 0

    def propose(self, sweep: int, previous: Factors, current: Factors) -> Factors | None:
        if sweep < self._FIRST_SWEEP:
            return None
        step = sweep ** (1.0 / self.root)
        a, b, c = (old + step * (new - old) for old, new in zip(previous, current, strict=True))
        # The same tensor with unit columns in A and B, like every ALS iterate, so that jumps stay comparable.
        a_norm, b_norm = _safe_norms(a), _safe_norms(b)
        return a / a_norm, b / b_norm, c * (a_norm * b_norm)

    def judge(self, accepted: bool) -> bool:
        if accepted:
            self.failures = 0
            return True
        self.failures += 1
        if self.failures == self._MAX_FAILURES:
            self.root += 1.0
            self.failures = 0
        return False


def _has_converged(history: list[float], tol: float) -> bool:
    previous, current = history[-2], history[-1]
    # A relative error already below tol cannot improve by more than tol, and near zero its change is rounding
    # noise (see _PerHeadTensor.relative_error), which the relative-change test alone would chase to max_iter.
    return current <= tol or abs(previous - current) <= tol * previous


# ------------------------------------------------------------------------------------------------ starts


def _leading_eigenvectors(gram: torch.Tensor, rank: int, generator: torch.Generator) -> torch.Tensor:
    """[n, rank]: eigenvectors of the PSD `gram` with the largest eigenvalues, sign-fixed; random unit columns
    (from `generator`) beyond n."""
    size = gram.shape[0]
    vectors = torch.linalg.eigh(gram).eigenvectors.flip(-1)[:, : min(rank, size)]
    if rank > size:
        extra = torch.randn(size, rank - size, generator=generator, dtype=torch.float64).to(gram.device)
        vectors = torch.cat([vectors, _unit_columns(extra)], dim=1)
    return vectors * _sign_of_largest(vectors)


def _svd_start(
    tensor: _PerHeadTensor | _DenseTensor, key_basis: torch.Tensor, rank: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """tensorly's init="svd": B the leading key-side eigenvectors, the mixing the leading eigenvectors of the
    heads' Gram matrix (random beyond the number of heads); A is then their least-squares solution, so the
    start is (A, B) like the others."""
    mixing = _leading_eigenvectors(tensor.head_gram(), rank, generator)
    gram = (key_basis.T @ key_basis) * (mixing.T @ mixing)
    return _unit_columns(_solve_normal_equations(tensor.mttkrp_query(key_basis, mixing), gram)), key_basis


def _gevd_start(
    tensor: _PerHeadTensor | _DenseTensor, query_basis: torch.Tensor, key_basis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Leurgans, Ross & Abel 1993: if T_h = A diag(C[h]) Bᵀ with A = U Ã, B = V B̃ (U, V the HOSVD bases), two
    combinations of the compressed slices M_i = Σ_h w_ih Uᵀ T_h V = Ã diag(Cᵀw_i) B̃ᵀ satisfy
    M₂ M₁⁻¹ = Ã diag(Cᵀw₂ / Cᵀw₁) Ã⁻¹, and then Ã⁺ M₁ = diag(Cᵀw₁) B̃ᵀ. w₁, w₂ are the two dominant
    combinations of heads. Returns (A, B) with unit columns, or None when the eigenproblem breaks down."""
    slices = tensor.compressed_slices(query_basis, key_basis)
    head_weights = torch.linalg.eigh(torch.einsum("hrs,grs->hg", slices, slices)).eigenvectors
    dominant = torch.einsum("h,hrs->rs", head_weights[:, -1], slices)
    second = torch.einsum("h,hrs->rs", head_weights[:, -2], slices)
    values, vectors = torch.linalg.eig(second @ torch.linalg.pinv(dominant))
    a_small = _unit_columns(_real_basis(values, vectors))
    b_small = (torch.linalg.pinv(a_small) @ dominant).T
    a, b = _unit_columns(query_basis @ a_small), _unit_columns(key_basis @ b_small)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return None
    return a * _sign_of_largest(a), b * _sign_of_largest(b)


def _real_basis(values: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """Real columns spanning the same invariant subspaces as complex eigenvectors, in a canonical order: a
    conjugate pair x, x̄ becomes Re x, −Im x (noise makes a few eigenvalues of M₂M₁⁻¹ complex on real
    weights)."""
    order = torch.argsort(values.imag, stable=True)
    order = order[torch.argsort(values.real[order], stable=True)]
    values, vectors = values[order], vectors[:, order]
    # Eigenvectors are defined up to a complex phase: fix it by making the largest entry real and positive.
    largest = vectors.gather(0, vectors.abs().argmax(dim=0, keepdim=True))
    vectors = vectors * (largest.abs() / torch.where(largest.abs() > 0, largest, torch.ones_like(largest)))
    return torch.where(values.imag[None, :] >= 0, vectors.real, vectors.imag)


def _exact_factors(w_q: torch.Tensor, w_k: torch.Tensor, heads: int, rank: int) -> Factors:
    # Component r = h·d + i is row i of head h: summed over head h's rows, w_q[r]ᵀ w_k[r] is W_{Q,h} W_{K,h}ᵀ.
    rows, hidden = w_q.shape
    padding = w_q.new_zeros(rank - rows, hidden)
    mixing = w_q.new_zeros(heads, rank)
    mixing[:, :rows] = concatenated_mixing(heads, rows)  # head h owns rows h·d … (h+1)·d − 1
    return torch.cat([w_q.detach(), padding]), mixing, torch.cat([w_k.detach(), padding])


# --------------------------------------------------------------------------------------------- helpers


def _solve_normal_equations(rhs: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """X with X·gram = rhs for a symmetric PSD `gram` [R, R], lightly ridge-regularised (see _RIDGE)."""
    scale = float(gram.diagonal().mean())
    ridge = _RIDGE * scale if scale > 0 else 1.0
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    factor, info = torch.linalg.cholesky_ex(gram + ridge * eye)
    if int(info) == 0:
        return torch.cholesky_solve(rhs.T, factor).T
    # Only reachable when rounding makes the Gram indefinite: the pseudo-inverse is the safe answer.
    return rhs @ torch.linalg.pinv(gram, hermitian=True)


def _unit_columns(matrix: torch.Tensor) -> torch.Tensor:
    return matrix / _safe_norms(matrix)


def _safe_norms(matrix: torch.Tensor) -> torch.Tensor:
    # Dead (all-zero) columns get norm 1, so dividing by it leaves them zero rather than NaN.
    norms = matrix.norm(dim=0)
    return torch.where(norms > 0, norms, torch.ones_like(norms))


def _sign_of_largest(matrix: torch.Tensor) -> torch.Tensor:
    """[1, columns]: ±1 making each column's largest-magnitude entry positive (zero columns get +1)."""
    largest = matrix.gather(0, matrix.abs().argmax(dim=0, keepdim=True))
    return torch.where(largest < 0, -1.0, 1.0).to(matrix.dtype)


def _canonical(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Factors:
    """CP factors fixed up to the decomposition's symmetries, returned as (Aᵀ, C, Bᵀ): components sorted by
    weight ‖a_r‖‖b_r‖‖c_r‖ (largest first), a_r and b_r with a positive largest entry, and the weight spread
    evenly over the three factors so neither the projections nor the mixing carries the whole scale."""
    a_norm, b_norm, c_norm = a.norm(dim=0), b.norm(dim=0), c.norm(dim=0)
    order = torch.sort(a_norm * b_norm * c_norm, descending=True, stable=True).indices
    a, b, c = a[:, order], b[:, order], c[:, order]
    a_norm, b_norm, c_norm = a_norm[order], b_norm[order], c_norm[order]
    share = (a_norm * b_norm * c_norm) ** (1.0 / 3.0)

    def rescale(factor: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        return factor * torch.where(norm > 0, share / torch.where(norm > 0, norm, 1.0), 0.0)

    sign_a, sign_b = _sign_of_largest(a), _sign_of_largest(b)
    a, b, c = rescale(a * sign_a, a_norm), rescale(b * sign_b, b_norm), rescale(c * sign_a * sign_b, c_norm)
    return a.T, c, b.T


def _check_inputs(
    w_q: torch.Tensor, w_k: torch.Tensor, num_heads: int, dim_shared_query_key: int, tol: float, max_iter: int
) -> tuple[int, int, int]:
    for name, weight in (("w_q", w_q), ("w_k", w_k)):
        if not isinstance(weight, torch.Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor of shape [heads·head_dim, hidden], "
                f"got {type(weight).__name__}"
            )
        if weight.dim() != 2:
            raise ValueError(
                f"{name} must be an nn.Linear weight of shape [heads·head_dim, hidden] (2 dims), "
                f"got shape {tuple(weight.shape)}"
            )
        if not weight.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {weight.dtype}")
    if w_k.shape != w_q.shape:
        raise ValueError(
            f"w_k must have the shape of w_q, [heads·head_dim, hidden] = {list(w_q.shape)}, "
            f"got {list(w_k.shape)}"
        )
    if w_k.dtype != w_q.dtype:
        raise ValueError(f"w_k must have the dtype of w_q ({w_q.dtype}), got {w_k.dtype}")
    if w_k.device != w_q.device:
        raise ValueError(f"w_k must be on the device of w_q ({w_q.device}), got {w_k.device}")
    check_positive_int("num_heads", num_heads)
    check_positive_int("dim_shared_query_key", dim_shared_query_key)
    rows, hidden = w_q.shape
    if rows % num_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} must divide the rows of w_q [heads·head_dim, hidden] = {list(w_q.shape)}"
        )
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"max_iter must be a non-negative integer, got {max_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol must be a non-negative number, got {tol!r}")
    if not (bool(torch.isfinite(w_q).all()) and bool(torch.isfinite(w_k).all())):
        raise ValueError("w_q and w_k must be finite (no NaN or inf entries)")
    return num_heads, rows // num_heads, hidden
