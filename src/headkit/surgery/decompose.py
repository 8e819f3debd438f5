"""Shared query/key projections for collaborative heads, by CP decomposition of the heads' bilinear forms.

Cordonnier, Loukas & Jaggi 2020, "Multi-Head Attention: Collaborate Instead of Concatenate", Sec. 4
(re-parametrising a trained layer). Head h scores tokens with the bilinear form X W_{Q,h} W_{K,h}ᵀ Xᵀ; stacking
the heads' forms gives the tensor T ∈ R^{hidden × heads × hidden}, T[:, h, :] = W_{Q,h} W_{K,h}ᵀ. Collaborative
heads share one query and one key projection of width D̃ and differ only by a mixing vector m_h (their Eq. for
collaborative attention: Head_h = Attention(X W̃_Q diag(m_h), X W̃_K, ...)), so they need a rank-D̃ CP
decomposition

    T[:, h, :] ≈ A diag(C[h]) Bᵀ,    A, B ∈ R^{hidden × D̃},  C ∈ R^{heads × D̃},

returned as w_q_shared = Aᵀ, mixing = C, w_k_shared = Bᵀ (``nn.Linear`` layout).

The fit is CP-ALS (Kolda & Bader 2009, "Tensor Decompositions and Applications", Sec. 3.4): each factor in turn
solves its linear least-squares problem, e.g. A (BᵀB ∗ CᵀC) = T_(1) (C ⊙ B). T itself is never formed: each slice
has rank head_dim, T_h = P_h Q_hᵀ with P_h = W_{Q,h}, Q_h = W_{K,h} ∈ R^{hidden × head_dim}, so every quantity ALS
needs comes from the per-head factors:

    MTTKRP for A:  Σ_h P_h (Q_hᵀ B) diag(C[h])                         (two [hidden, heads·head_dim] matmuls)
    MTTKRP for C:  C_rhs[h, r] = a_rᵀ T_h b_r = Σ_i (P_hᵀ A)[i, r] (Q_hᵀ B)[i, r]
    ‖T‖²        = Σ_h tr((P_hᵀ P_h)(Q_hᵀ Q_h))
    ⟨T, T̂⟩      = Σ_{h,r} C[h, r] C_rhs[h, r],   ‖T̂‖² = 1ᵀ (AᵀA ∗ BᵀB ∗ CᵀC) 1

at O(heads·head_dim·hidden·D̃) per sweep instead of O(hidden²·heads·D̃). :func:`naive_decompose_query_key` runs the
same algorithm on the dense tensor and is the reference the tests compare against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from headkit.ops._validation import check_positive_int

# Ridge added to the normal equations, relative to their mean diagonal: keeps rank-deficient solves finite
# while perturbing well-posed ones far below the accuracy anyone asks of a decomposition.
_RIDGE = 1e-10
_INIT = 'hosvd'


@dataclass(frozen=True)
class DecompositionInfo:
    """How a :func:`decompose_query_key` run went.

    relative_error: ‖T − T̂‖_F / ‖T‖_F of the returned factors (0 on the exact path and for an all-zero T).
    iterations: ALS sweeps run (0 on the exact path).
    converged: the stopping rule fired before ``max_iter`` (always True on the exact path).
    seconds: wall-clock time of the whole call.
    exact: D̃ ≥ heads·head_dim, so the concatenated heads were returned unchanged (no ALS).
    error_history: relative error after initialisation, then after each sweep.
    """

    relative_error: float
    iterations: int
    converged: bool
    seconds: float
    exact: bool
    error_history: tuple[float, ...]


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
) -> (
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecompositionInfo]
):
    """Factor every head's query/key bilinear form through shared projections (Cordonnier et al. 2020, Sec. 4).

    Finds w_q_shared [D̃, hidden], mixing [heads, D̃], w_k_shared [D̃, hidden] such that for every head h

        W_{Q,h} W_{K,h}ᵀ ≈ w_q_sharedᵀ diag(mixing[h]) w_k_shared,

    where W_{Q,h} = w_q[h·d:(h+1)·d, :]ᵀ, i.e. a rank-D̃ CP decomposition of T[:, h, :] = W_{Q,h} W_{K,h}ᵀ, fitted by
    CP-ALS on the per-head factors (see the module docstring); the dense tensor is never formed.

    * D̃ ≥ heads·head_dim is exact: the concatenated projections with a block 0/1 mixing (extra rows zero).
    * Otherwise ALS starts from an HOSVD-style initialisation (leading D̃ eigenvectors of the mode-1 and mode-3
      Gram matrices Σ_h T_h T_hᵀ and Σ_h T_hᵀ T_h, mixing by least squares) and stops when the relative error
      changes by less than ``tol`` relative to itself, falls below ``tol``, or after ``max_iter`` sweeps.
    * Computed in float64, returned in the weights' dtype. Components are sorted by weight (largest first), with a
      deterministic sign and equal norms of a_r, b_r and mixing[:, r].

    Args:
        w_q, w_k: ``nn.Linear`` weights of the query and key projections, [heads·head_dim, hidden], same shape.
        num_heads: number of heads; must divide the rows of the weights.
        dim_shared_query_key: D̃, the width of the shared projections.
        seed: seeds the random columns used when D̃ exceeds what the Gram matrices can supply (D̃ > hidden);
            the result is a deterministic function of the inputs and the seed.
        tol: stopping tolerance on the relative change of the relative error (0 runs all ``max_iter`` sweeps).
        max_iter: ALS sweep budget (0 returns the initialisation).
        return_info: also return a :class:`DecompositionInfo`.

    Returns:
        (w_q_shared, mixing, w_k_shared), plus the info when ``return_info``.
    """
    heads, head_dim, hidden = _check_inputs(w_q, w_k, num_heads, dim_shared_query_key, tol, max_iter)
    start = time.perf_counter()
    rank = dim_shared_query_key
    if rank >= heads * head_dim:
        result = _exact_factors(w_q, w_k, heads, head_dim, rank)
        return _finish(result, w_q.dtype, 0.0, 0, True, start, True, (0.0,), return_info)

    q = w_q.detach().to(torch.float64)
    k = w_k.detach().to(torch.float64)
    q_heads = q.reshape(heads, head_dim, hidden)  # row i of head h is column i of P_h
    k_heads = k.reshape(heads, head_dim, hidden)
    query_gram = q_heads @ q_heads.mT  # P_hᵀ P_h, [heads, d, d]
    key_gram = k_heads @ k_heads.mT
    tensor_norm_sq = float((query_gram * key_gram).sum())  # Σ_h tr(P_hᵀP_h Q_hᵀQ_h), both symmetric
    if tensor_norm_sq == 0.0:
        zeros = (w_q.new_zeros(rank, hidden), w_q.new_zeros(heads, rank), w_q.new_zeros(rank, hidden))
        return _finish(zeros, w_q.dtype, 0.0, 0, True, start, False, (0.0,), return_info)

    generator = torch.Generator(device="cpu").manual_seed(seed)
    # Σ_h T_h T_hᵀ = Σ_h P_h (Q_hᵀ Q_h) P_hᵀ and Σ_h T_hᵀ T_h = Σ_h Q_h (P_hᵀ P_h) Q_hᵀ, both [hidden, hidden].
    mode1_gram = q.T @ (key_gram @ q_heads).reshape(heads * head_dim, hidden)
    mode3_gram = k.T @ (query_gram @ k_heads).reshape(heads * head_dim, hidden)
    a = _leading_eigenvectors(mode1_gram, rank, generator)
    b = _leading_eigenvectors(mode3_gram, rank, generator)
    if _INIT != "hosvd" and rank <= hidden:
        u, v = a, b
        core = torch.einsum("hdr,hds->hrs", (q @ u).reshape(heads, head_dim, rank), (k @ v).reshape(heads, head_dim, rank))
        head_gram = torch.einsum("hrs,grs->hg", core, core)
        _, vecs = torch.linalg.eigh(head_gram)
        m_big = torch.einsum("h,hrs->rs", vecs[:, -1], core)
        m_small = torch.einsum("h,hrs->rs", vecs[:, -2], core) if heads > 1 else core[0]
        vals, x = torch.linalg.eig(torch.linalg.lstsq(m_big.T, m_small.T).solution.T)
        xr = torch.where(vals.imag[None, :] >= 0, x.real, x.imag)
        at = _unit_columns(xr)
        bt = _unit_columns(torch.linalg.lstsq(at, m_big).solution.T)
        ga, gb = u @ at, v @ bt
        ga, gb = _unit_columns(ga), _unit_columns(gb)
        if _INIT == "gevd":
            a, b = ga, gb
        else:
            def init_err(a, b):
                qa = (q @ a).reshape(heads, head_dim, rank); kb = (k @ b).reshape(heads, head_dim, rank)
                ag, bg = a.T @ a, b.T @ b
                rhs = (qa * kb).sum(dim=1); c = _solve_normal_equations(rhs, ag * bg)
                return _relative_error(tensor_norm_sq, c, rhs, ag, bg, c.T @ c)
            if init_err(ga, gb) < init_err(a, b):
                a, b = ga, gb

    qa = (q @ a).reshape(heads, head_dim, rank)  # P_hᵀ A
    kb = (k @ b).reshape(heads, head_dim, rank)  # Q_hᵀ B
    a_gram, b_gram = a.T @ a, b.T @ b
    mixing_rhs = (qa * kb).sum(dim=1)  # [heads, rank]: a_rᵀ T_h b_r
    c = _solve_normal_equations(mixing_rhs, a_gram * b_gram)
    c_gram = c.T @ c
    history = [_relative_error(tensor_norm_sq, c, mixing_rhs, a_gram, b_gram, c_gram)]

    extrapolation = _Extrapolation()
    previous = None
    converged = False
    sweeps = 0
    for sweeps in range(1, max_iter + 1):  # noqa: B007 - the count is reported
        mttkrp_a = q.T @ (kb * c[:, None, :]).reshape(heads * head_dim, rank)  # Σ_h P_h (Q_hᵀB) diag(C_h)
        a = _unit_columns(_solve_normal_equations(mttkrp_a, b_gram * c_gram))
        a_gram = a.T @ a
        qa = (q @ a).reshape(heads, head_dim, rank)

        mttkrp_b = k.T @ (qa * c[:, None, :]).reshape(heads * head_dim, rank)  # Σ_h Q_h (P_hᵀA) diag(C_h)
        b = _unit_columns(_solve_normal_equations(mttkrp_b, a_gram * c_gram))
        b_gram = b.T @ b
        kb = (k @ b).reshape(heads, head_dim, rank)

        mixing_rhs = (qa * kb).sum(dim=1)
        c = _solve_normal_equations(mixing_rhs, a_gram * b_gram)
        c_gram = c.T @ c
        error = _relative_error(tensor_norm_sq, c, mixing_rhs, a_gram, b_gram, c_gram)

        trial = extrapolation.propose(sweeps, previous, (a, b, c))
        if trial is not None:
            trial_a, trial_b, trial_c = trial
            trial_kb = (k @ trial_b).reshape(heads, head_dim, rank)
            trial_rhs = ((q @ trial_a).reshape(heads, head_dim, rank) * trial_kb).sum(dim=1)
            trial_grams = trial_a.T @ trial_a, trial_b.T @ trial_b, trial_c.T @ trial_c
            trial_error = _relative_error(tensor_norm_sq, trial_c, trial_rhs, *trial_grams)
            if extrapolation.judge(trial_error < error):
                a, b, c, kb, error = trial_a, trial_b, trial_c, trial_kb, trial_error
                a_gram, b_gram, c_gram = trial_grams
        previous = (a, b, c)

        history.append(error)
        if _has_converged(history, tol):
            converged = True
            break

    w_q_shared, mixing, w_k_shared = _canonical(a, c, b)
    return _finish(
        (w_q_shared, mixing, w_k_shared),
        w_q.dtype,
        history[-1],
        sweeps,
        converged,
        start,
        False,
        history,
        return_info,
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
) -> (
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecompositionInfo]
):
    """Test reference for :func:`decompose_query_key`: the same CP-ALS, written on the dense tensor.

    Forms T[i, h, j] = Σ_d W_{Q,h}[i, d] W_{K,h}[j, d] and takes every MTTKRP, Gram matrix and error straight from
    it with einsum (Kolda & Bader 2009, Sec. 3.4), so it costs O(hidden²·heads·D̃) per sweep and O(hidden²·heads)
    memory. Same initialisation, stopping rule and output convention as the fast version.
    """
    heads, head_dim, hidden = _check_inputs(w_q, w_k, num_heads, dim_shared_query_key, tol, max_iter)
    start = time.perf_counter()
    rank = dim_shared_query_key
    if rank >= heads * head_dim:
        result = _exact_factors(w_q, w_k, heads, head_dim, rank)
        return _finish(result, w_q.dtype, 0.0, 0, True, start, True, (0.0,), return_info)

    q_heads = w_q.detach().to(torch.float64).reshape(heads, head_dim, hidden)
    k_heads = w_k.detach().to(torch.float64).reshape(heads, head_dim, hidden)
    tensor = torch.einsum("hdi,hdj->ihj", q_heads, k_heads)  # [hidden, heads, hidden]
    tensor_norm = float(tensor.norm())
    if tensor_norm == 0.0:
        zeros = (w_q.new_zeros(rank, hidden), w_q.new_zeros(heads, rank), w_q.new_zeros(rank, hidden))
        return _finish(zeros, w_q.dtype, 0.0, 0, True, start, False, (0.0,), return_info)

    def relative_error(a: torch.Tensor, c: torch.Tensor, b: torch.Tensor) -> float:
        return float((tensor - torch.einsum("ir,hr,jr->ihj", a, c, b)).norm()) / tensor_norm

    generator = torch.Generator(device="cpu").manual_seed(seed)
    a = _leading_eigenvectors(torch.einsum("ihj,khj->ik", tensor, tensor), rank, generator)
    b = _leading_eigenvectors(torch.einsum("ihj,ihk->jk", tensor, tensor), rank, generator)
    c = _solve_normal_equations(torch.einsum("ihj,ir,jr->hr", tensor, a, b), (a.T @ a) * (b.T @ b))
    history = [relative_error(a, c, b)]

    extrapolation = _Extrapolation()
    previous = None
    converged = False
    sweeps = 0
    for sweeps in range(1, max_iter + 1):  # noqa: B007 - the count is reported
        a = _unit_columns(
            _solve_normal_equations(torch.einsum("ihj,hr,jr->ir", tensor, c, b), (b.T @ b) * (c.T @ c))
        )
        b = _unit_columns(
            _solve_normal_equations(torch.einsum("ihj,ir,hr->jr", tensor, a, c), (a.T @ a) * (c.T @ c))
        )
        c = _solve_normal_equations(torch.einsum("ihj,ir,jr->hr", tensor, a, b), (a.T @ a) * (b.T @ b))
        error = relative_error(a, c, b)
        trial = extrapolation.propose(sweeps, previous, (a, b, c))
        if trial is not None:
            trial_error = relative_error(trial[0], trial[2], trial[1])
            if extrapolation.judge(trial_error < error):
                (a, b, c), error = trial, trial_error
        previous = (a, b, c)
        history.append(error)
        if _has_converged(history, tol):
            converged = True
            break

    return _finish(
        _canonical(a, c, b), w_q.dtype, history[-1], sweeps, converged, start, False, history, return_info
    )


def _check_inputs(
    w_q: torch.Tensor, w_k: torch.Tensor, num_heads: int, dim_shared_query_key: int, tol: float, max_iter: int
) -> tuple[int, int, int]:
    for name, weight in (("w_q", w_q), ("w_k", w_k)):
        if not isinstance(weight, torch.Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor of shape [heads·head_dim, hidden], got {type(weight).__name__}"
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
            f"w_k must have the shape of w_q, [heads·head_dim, hidden] = {list(w_q.shape)}, got {list(w_k.shape)}"
        )
    if w_k.dtype != w_q.dtype:
        raise ValueError(f"w_k must have the dtype of w_q ({w_q.dtype}), got {w_k.dtype}")
    check_positive_int("num_heads", num_heads)
    check_positive_int("dim_shared_query_key", dim_shared_query_key)
    rows, hidden = w_q.shape
    if rows % num_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} must divide the rows of w_q [heads·head_dim, hidden] = {list(w_q.shape)}"
        )
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"max_iter must be a non-negative integer, got {max_iter!r}")
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not tol >= 0:
        raise ValueError(f"tol must be a non-negative number, got {tol!r}")
    if not (bool(torch.isfinite(w_q).all()) and bool(torch.isfinite(w_k).all())):
        raise ValueError("w_q and w_k must be finite (no NaN or inf entries)")
    return num_heads, rows // num_heads, hidden


def _exact_factors(
    w_q: torch.Tensor, w_k: torch.Tensor, heads: int, head_dim: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Component r = h·d + i is column i of head h: Σ_i w_q[r]ᵀ w_k[r] over head h's rows is exactly W_{Q,h}W_{K,h}ᵀ.
    rows, hidden = w_q.shape
    padding = w_q.new_zeros(rank - rows, hidden)
    mixing = w_q.new_zeros(heads, rank)
    mixing[:, :rows] = torch.block_diag(*[w_q.new_ones(1, head_dim)] * heads)
    return torch.cat([w_q.detach(), padding]), mixing, torch.cat([w_k.detach(), padding.clone()])


def _leading_eigenvectors(gram: torch.Tensor, rank: int, generator: torch.Generator) -> torch.Tensor:
    """[n, rank]: the eigenvectors of the PSD `gram` with the largest eigenvalues, sign-fixed; random unit
    columns (from `generator`) beyond n."""
    size = gram.shape[0]
    _, vectors = torch.linalg.eigh(gram)
    vectors = vectors.flip(-1)[:, : min(rank, size)]
    if rank > size:
        extra = torch.randn(size, rank - size, generator=generator, dtype=torch.float64).to(gram.device)
        vectors = torch.cat([vectors, _unit_columns(extra)], dim=1)
    return vectors * _sign_of_largest(vectors)


def _solve_normal_equations(rhs: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """X with X·gram = rhs for a symmetric PSD `gram` [rank, rank], lightly ridge-regularised (see _RIDGE)."""
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
    """[1, columns]: ±1 making each column's largest-magnitude entry positive (0 columns get +1)."""
    largest = matrix.gather(0, matrix.abs().argmax(dim=0, keepdim=True))
    return torch.where(largest < 0, -1.0, 1.0).to(matrix.dtype)


def _relative_error(
    tensor_norm_sq: float,
    c: torch.Tensor,
    mixing_rhs: torch.Tensor,
    a_gram: torch.Tensor,
    b_gram: torch.Tensor,
    c_gram: torch.Tensor,
) -> float:
    # ‖T − T̂‖² = ‖T‖² − 2⟨T, T̂⟩ + ‖T̂‖², with ⟨T, T̂⟩ = Σ_{h,r} C[h,r] a_rᵀT_h b_r. The difference cancels
    # catastrophically once the fit is near exact: float64 resolves the relative error down to about 1e-8.
    inner = float((c * mixing_rhs).sum())
    fit_norm_sq = float((a_gram * b_gram * c_gram).sum())
    return max(tensor_norm_sq - 2.0 * inner + fit_norm_sq, 0.0) ** 0.5 / tensor_norm_sq**0.5


class _Extrapolation:
    """Line-search acceleration of ALS (Bro 1998, "Multi-way Analysis in the Food Industry", PhD thesis; also
    tensorly's ``parafac(linesearch=True)``).

    ALS creeps along narrow valleys ("swamps"); after sweep k it pays to try the point
    X_{k−1} + k^{1/p} (X_k − X_{k−1}) for all three factors at once and keep it when it fits better. After
    ``_MAX_FAILURES`` rejected jumps in a row, p grows by one, so the jumps shrink.
    """

    _FIRST_SWEEP = 3  # the first sweeps move far from the initialisation; extrapolating them overshoots
    _MAX_FAILURES = 4

    def __init__(self) -> None:
        self.root = 2.0
        self.failures = 0

    def propose(
        self,
        sweep: int,
        previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        current: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if previous is None or sweep < self._FIRST_SWEEP:
            return None
        step = sweep ** (1.0 / self.root)
        a, b, c = (old + step * (new - old) for old, new in zip(previous, current, strict=True))
        # Same tensor, with unit columns in A and B like every ALS iterate, so the next jump compares like with like.
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
    # A relative error already below tol cannot improve by more than tol, and near zero the change is only
    # rounding noise (see _relative_error), which the relative-change test alone would chase until max_iter.
    return current <= tol or abs(previous - current) <= tol * previous


def _canonical(
    a: torch.Tensor, c: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CP factors fixed up to the decomposition's symmetries: components sorted by weight ‖a_r‖‖b_r‖‖c_r‖
    (largest first), a_r and b_r with a positive largest entry, and the weight spread evenly over the three
    factors so neither the projections nor the mixing carries the whole scale. Returns (Aᵀ, C, Bᵀ)."""
    a_norm, b_norm, c_norm = a.norm(dim=0), b.norm(dim=0), c.norm(dim=0)
    weight = a_norm * b_norm * c_norm
    order = torch.sort(weight, descending=True, stable=True).indices
    a, b, c = a[:, order], b[:, order], c[:, order]
    a_norm, b_norm, c_norm, weight = a_norm[order], b_norm[order], c_norm[order], weight[order]
    sign_a, sign_b = _sign_of_largest(a), _sign_of_largest(b)
    share = weight ** (1.0 / 3.0)

    def rescale(factor: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        return factor * torch.where(norm > 0, share / torch.where(norm > 0, norm, 1.0), 0.0)

    a = rescale(a * sign_a, a_norm)
    b = rescale(b * sign_b, b_norm)
    c = rescale(c * sign_a * sign_b, c_norm)
    return a.T, c, b.T


def _finish(
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    relative_error: float,
    iterations: int,
    converged: bool,
    start: float,
    exact: bool,
    history: list[float] | tuple[float, ...],
    return_info: bool,
) -> tuple[torch.Tensor, ...]:
    w_q_shared, mixing, w_k_shared = (factor.to(dtype).contiguous() for factor in factors)
    if not return_info:
        return w_q_shared, mixing, w_k_shared
    info = DecompositionInfo(
        relative_error=float(relative_error),
        iterations=iterations,
        converged=converged,
        seconds=time.perf_counter() - start,
        exact=exact,
        error_history=tuple(history),
    )
    return w_q_shared, mixing, w_k_shared, info
