from __future__ import annotations

import warnings

import pytest
import torch

from headkit.layers.collaborative import concatenated_mixing
from headkit.surgery.decompose import DecompositionInfo, decompose_query_key, naive_decompose_query_key


def random_weights(rows: int, hidden: int, seed: int, dtype: torch.dtype = torch.float64):
    generator = torch.Generator().manual_seed(seed)
    w_q = torch.randn(rows, hidden, generator=generator, dtype=dtype) / hidden**0.5
    w_k = torch.randn(rows, hidden, generator=generator, dtype=dtype) / hidden**0.5
    return w_q, w_k


def head_forms(w_q: torch.Tensor, w_k: torch.Tensor, heads: int) -> torch.Tensor:
    """Dense [hidden, heads, hidden] T[:, h, :] = W_{Q,h} W_{K,h}ᵀ: the reference the library avoids."""
    rows, hidden = w_q.shape
    per_head = (w.double().reshape(heads, rows // heads, hidden) for w in (w_q, w_k))
    return torch.einsum("hdi,hdj->ihj", *per_head)


def shared_forms(w_q_shared: torch.Tensor, mixing: torch.Tensor, w_k_shared: torch.Tensor) -> torch.Tensor:
    """[hidden, heads, hidden]: w_q_sharedᵀ diag(mixing[h]) w_k_shared for every head."""
    return torch.einsum("ri,hr,rj->ihj", w_q_shared.double(), mixing.double(), w_k_shared.double())


def dense_relative_error(w_q, w_k, heads, factors) -> float:
    reference = head_forms(w_q, w_k, heads)
    return float((reference - shared_forms(*factors)).norm() / reference.norm())


def exact_cp_rank_weights(
    hidden: int, heads: int, head_dim: int, rank: int, seed: int, shared_components: bool
):
    """Query/key weights whose head forms have CP rank exactly `rank`, behind random per-head bases S_h.

    shared_components=False (rank ≤ head_dim): every head uses all components, W_{Q,h} = [A diag(C_h) | 0] S_h
    and W_{K,h} = [B | 0] S_h^{-T}. True (rank > head_dim allowed): head h uses only head_dim of the
    components, the situation collaborative heads are made for.
    """
    generator = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(hidden, rank, generator=generator, dtype=torch.float64) for _ in range(2))
    c = torch.randn(heads, rank, generator=generator, dtype=torch.float64)
    query_rows, key_rows = [], []
    for head in range(heads):
        if shared_components:
            used = torch.randperm(rank, generator=generator)[:head_dim]
            p, q = a[:, used] * c[head, used], b[:, used]
        else:
            padding = torch.zeros(hidden, head_dim - rank, dtype=torch.float64)
            p, q = torch.cat([a * c[head], padding], 1), torch.cat([b, padding], 1)
        basis = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        basis += 3 * torch.eye(head_dim, dtype=torch.float64)  # keep S_h well conditioned
        query_rows.append((p @ basis).T)
        key_rows.append((q @ torch.linalg.inv(basis).T).T)
    return torch.cat(query_rows), torch.cat(key_rows)


# ---------------------------------------------------------------------------------------------- exact path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_path_reproduces_every_head_at_full_size(dtype):
    heads, head_dim, hidden = 12, 64, 768
    w_q, w_k = random_weights(heads * head_dim, hidden, seed=1, dtype=dtype)
    *factors, info = decompose_query_key(w_q, w_k, heads, heads * head_dim, return_info=True)
    assert all(f.dtype == dtype for f in factors)
    w_q_shared, mixing, w_k_shared = factors
    for head in range(heads):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        expected = w_q[rows].double().T @ w_k[rows].double()
        got = w_q_shared.double().T @ torch.diag(mixing[head].double()) @ w_k_shared.double()
        assert float((got - expected).norm() / expected.norm()) < 1e-6
    assert info.exact and info.iterations == 0 and info.relative_error == 0.0


def test_exact_path_pads_extra_columns_with_zeros():
    heads, head_dim, hidden = 3, 4, 10
    w_q, w_k = random_weights(heads * head_dim, hidden, seed=2)
    w_q_shared, mixing, w_k_shared = decompose_query_key(w_q, w_k, heads, 17)
    assert (
        w_q_shared.shape == (17, hidden) and mixing.shape == (heads, 17) and w_k_shared.shape == (17, hidden)
    )
    assert (
        w_q_shared[12:].abs().max() == 0
        and w_k_shared[12:].abs().max() == 0
        and mixing[:, 12:].abs().max() == 0
    )
    assert dense_relative_error(w_q, w_k, heads, (w_q_shared, mixing, w_k_shared)) < 1e-12
    # the concatenate mixing of collaborative layers, over the heads' own rows
    assert torch.equal(mixing[:, :12], concatenated_mixing(heads, heads * head_dim))


# ------------------------------------------------------------------------------------ against the naive twin


@pytest.mark.parametrize(
    ("heads", "head_dim", "hidden", "rank", "max_iter"),
    [(4, 6, 20, 3, 12), (4, 6, 20, 11, 12), (3, 8, 16, 20, 8), (2, 5, 7, 9, 10), (5, 4, 12, 7, 0)],
)
def test_matches_naive_dense_als(heads, head_dim, hidden, rank, max_iter):
    # (3, 8, 16, 20): D̃ > hidden, so the starts need seeded random columns; (…, 0): the race's starts only.
    w_q, w_k = random_weights(heads * head_dim, hidden, seed=3)
    *fast, fast_info = decompose_query_key(w_q, w_k, heads, rank, max_iter=max_iter, tol=0, return_info=True)
    *naive, naive_info = naive_decompose_query_key(
        w_q, w_k, heads, rank, max_iter=max_iter, tol=0, return_info=True
    )
    for got, expected in zip(fast, naive, strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7 * float(expected.abs().max()))
    assert fast_info.iterations == naive_info.iterations == max_iter
    assert fast_info.start == naive_info.start
    torch.testing.assert_close(
        torch.tensor(fast_info.error_history), torch.tensor(naive_info.error_history), rtol=1e-7, atol=1e-9
    )


@pytest.mark.parametrize(
    ("heads", "head_dim", "hidden", "rank"), [(4, 6, 20, 5), (6, 4, 16, 10), (3, 8, 12, 14)]
)
def test_reported_error_equals_dense_error(heads, head_dim, hidden, rank):
    w_q, w_k = random_weights(heads * head_dim, hidden, seed=4)
    *factors, info = decompose_query_key(w_q, w_k, heads, rank, max_iter=60, return_info=True)
    dense = dense_relative_error(w_q, w_k, heads, factors)
    assert 0.01 < dense < 1  # a genuinely approximate fit, not a trivial one
    assert info.relative_error == pytest.approx(dense, rel=1e-9)
    assert info.error_history[-1] == pytest.approx(dense, rel=1e-9)  # ALS's cheaper running estimate


# ------------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize(
    ("hidden", "heads", "head_dim", "rank", "shared_components"),
    [(32, 4, 8, 8, False), (40, 6, 8, 5, False), (48, 4, 8, 8, False), (24, 6, 4, 10, True)],
)
def test_recovers_a_tensor_of_exact_cp_rank(hidden, heads, head_dim, rank, shared_components):
    w_q, w_k = exact_cp_rank_weights(
        hidden, heads, head_dim, rank, seed=5, shared_components=shared_components
    )
    *factors, info = decompose_query_key(w_q, w_k, heads, rank, return_info=True)
    assert info.converged and info.start == "gevd"  # the start built for exactly this case
    dense = dense_relative_error(w_q, w_k, heads, factors)
    assert dense < 1e-6
    # Even this close to zero the reported error is the true one, not the cancellation noise of ‖T‖² − ‖T̂‖².
    assert info.relative_error == pytest.approx(dense, rel=1e-3, abs=1e-12)

    # The attention scores a collaborative layer computes from the shared projections match the original ones.
    w_q_shared, mixing, w_k_shared = factors
    x, y = torch.randn(2, 9, hidden, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for head in range(heads):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        original = (x @ w_q[rows].T) @ (y @ w_k[rows].T).T
        collaborative = (x @ w_q_shared.T * mixing[head]) @ (y @ w_k_shared.T).T
        assert float((collaborative - original).abs().max()) < 1e-3 * float(original.abs().max())


def test_error_decreases_as_the_shared_dimension_grows():
    heads, head_dim, hidden = 4, 6, 24
    w_q, w_k = random_weights(heads * head_dim, hidden, seed=7)
    ranks = [1, 2, 4, 8, 12, 16, 20, 23, 24]
    errors = [
        dense_relative_error(w_q, w_k, heads, decompose_query_key(w_q, w_k, heads, rank, max_iter=300))
        for rank in ranks
    ]
    assert all(later <= earlier + 1e-9 for earlier, later in zip(errors, errors[1:], strict=False)), errors
    assert errors[0] > 0.5 and errors[-1] < 1e-12


@pytest.mark.parametrize(
    ("heads", "head_dim", "hidden", "rank", "budget"), [(4, 6, 20, 8, 20), (8, 4, 24, 10, 100)]
)
def test_at_least_as_accurate_as_tensorly_parafac(heads, head_dim, hidden, rank, budget):
    # Same rank, same sweep budget, tensorly's default init="svd". CP-ALS finds local optima, so on any one
    # random tensor either method can land in the better one; the claim is about the typical case: better on
    # average and on most tensors.
    tensorly = pytest.importorskip("tensorly")
    from tensorly.decomposition import parafac

    ours, theirs = [], []
    for seed in range(8):
        w_q, w_k = random_weights(heads * head_dim, hidden, seed=100 + seed)
        factors = decompose_query_key(w_q, w_k, heads, rank, max_iter=budget, tol=0)
        ours.append(dense_relative_error(w_q, w_k, heads, factors))
        dense = head_forms(w_q, w_k, heads).numpy()
        with (
            warnings.catch_warnings()
        ):  # tensorly warns that rank > heads leaves it random columns, as intended
            warnings.simplefilter("ignore", UserWarning)
            cp = parafac(dense, rank, n_iter_max=budget, init="svd", tol=0, random_state=seed)
        theirs.append(
            float(((dense - tensorly.cp_to_tensor(cp)) ** 2).sum() ** 0.5 / (dense**2).sum() ** 0.5)
        )
    assert sum(ours) <= sum(theirs), (ours, theirs)
    assert sum(o <= t * (1 + 1e-9) for o, t in zip(ours, theirs, strict=True)) >= 5, (ours, theirs)


def test_error_history_is_non_increasing():
    # Each ALS step solves a least-squares problem exactly and extrapolation is only kept when it helps.
    w_q, w_k = random_weights(30, 18, seed=9)
    *_, info = decompose_query_key(w_q, w_k, 5, 9, max_iter=80, tol=0, return_info=True)
    history = info.error_history
    assert len(history) == 81
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(history, history[1:], strict=False))


# ------------------------------------------------------------------------------------ contract and stopping


def test_output_shapes_dtype_and_determinism():
    heads, head_dim, hidden, rank = 4, 6, 20, 9
    w_q, w_k = random_weights(heads * head_dim, hidden, seed=10, dtype=torch.float32)
    w_q.requires_grad_(True)
    first = decompose_query_key(w_q, w_k, heads, rank, seed=3)
    second = decompose_query_key(w_q, w_k, heads, rank, seed=3)
    assert [tuple(f.shape) for f in first] == [(rank, hidden), (heads, rank), (rank, hidden)]
    assert all(f.dtype == torch.float32 and not f.requires_grad for f in first)
    assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))


def test_random_columns_follow_the_seed():
    # D̃ > hidden: the initialisation pads with random columns, so the seed matters, and only the seed.
    w_q, w_k = random_weights(24, 8, seed=11)
    run = lambda seed: decompose_query_key(w_q, w_k, 3, 12, seed=seed, max_iter=3)  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(run(5), run(5), strict=True))
    assert not torch.equal(run(5)[0], run(6)[0])


def test_components_are_sorted_signed_and_balanced():
    heads, head_dim, hidden, rank = 4, 6, 20, 9
    w_q, w_k = random_weights(heads * head_dim, hidden, seed=12)
    w_q_shared, mixing, w_k_shared = decompose_query_key(w_q, w_k, heads, rank, max_iter=50)
    q_norms, k_norms, m_norms = w_q_shared.norm(dim=1), w_k_shared.norm(dim=1), mixing.norm(dim=0)
    torch.testing.assert_close(q_norms, k_norms)
    torch.testing.assert_close(q_norms, m_norms)
    assert torch.all(q_norms[:-1] >= q_norms[1:])
    for factor in (w_q_shared, w_k_shared):
        largest = factor.gather(1, factor.abs().argmax(dim=1, keepdim=True))
        assert torch.all(largest > 0)


def test_stops_on_tolerance_and_on_budget():
    w_q, w_k = random_weights(24, 16, seed=13)
    *_, loose = decompose_query_key(w_q, w_k, 4, 6, tol=1e-3, max_iter=500, return_info=True)
    assert loose.converged and loose.iterations < 500
    last, before = loose.error_history[-1], loose.error_history[-2]
    assert abs(before - last) <= 1e-3 * before
    *_, capped = decompose_query_key(w_q, w_k, 4, 6, tol=0, max_iter=7, return_info=True)
    assert not capped.converged and capped.iterations == 7 and len(capped.error_history) == 8
    assert isinstance(capped, DecompositionInfo) and capped.seconds >= 0


def test_all_zero_weights_give_zero_factors():
    zeros = torch.zeros(12, 8)
    *factors, info = decompose_query_key(zeros, zeros, 3, 5, return_info=True)
    assert all(f.abs().max() == 0 for f in factors) and info.relative_error == 0.0


def test_rank_deficient_heads_stay_finite():
    # Heads that are exact copies of one another and more components than the tensor needs: singular Gram
    # matrices in ALS, which must not produce inf or NaN.
    w_q, w_k = random_weights(4, 10, seed=14)
    w_q, w_k = w_q.repeat(3, 1), w_k.repeat(3, 1)
    *factors, info = decompose_query_key(w_q, w_k, 3, 9, max_iter=50, return_info=True)
    assert all(bool(torch.isfinite(f).all()) for f in factors)
    assert dense_relative_error(w_q, w_k, 3, factors) < 1e-6


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("w_q", "w_k", "num_heads", "dim", "kwargs", "match"),
    [
        (torch.zeros(12, 8, 1), torch.zeros(12, 8), 3, 4, {}, r"w_q must be .*\[heads·head_dim, hidden\]"),
        (torch.zeros(12, 8), torch.zeros(12), 3, 4, {}, r"w_k must be .*\[heads·head_dim, hidden\]"),
        (torch.zeros(12, 8), torch.zeros(12, 9), 3, 4, {}, r"w_k must have the shape of w_q.*\[12, 8\]"),
        (torch.zeros(12, 8), torch.zeros(6, 8), 3, 4, {}, r"w_k must have the shape of w_q"),
        (torch.zeros(12, 8), torch.zeros(12, 8), 5, 4, {}, r"num_heads=5 must divide the rows of w_q"),
        (torch.zeros(12, 8), torch.zeros(12, 8), 0, 4, {}, r"num_heads must be a positive integer"),
        (
            torch.zeros(12, 8),
            torch.zeros(12, 8),
            3,
            0,
            {},
            r"dim_shared_query_key must be a positive integer",
        ),
        (
            torch.zeros(12, 8),
            torch.zeros(12, 8),
            3,
            -2,
            {},
            r"dim_shared_query_key must be a positive integer",
        ),
        (
            torch.zeros(12, 8),
            torch.zeros(12, 8),
            3,
            4.0,
            {},
            r"dim_shared_query_key must be a positive integer",
        ),
        (torch.zeros(12, 8, dtype=torch.long), torch.zeros(12, 8), 3, 4, {}, r"w_q must be a floating-point"),
        (
            torch.zeros(12, 8),
            torch.zeros(12, 8, dtype=torch.float64),
            3,
            4,
            {},
            r"w_k must have the dtype of w_q",
        ),
        (torch.zeros(12, 8), torch.zeros(12, 8), 3, 4, {"max_iter": -1}, r"max_iter must be a non-negative"),
        (torch.zeros(12, 8), torch.zeros(12, 8), 3, 4, {"tol": -1e-3}, r"tol must be a non-negative"),
        (torch.full((12, 8), float("nan")), torch.zeros(12, 8), 3, 4, {}, r"must be finite"),
        ([[0.0]], torch.zeros(12, 8), 3, 4, {}, r"w_q must be a torch.Tensor"),
    ],
)
@pytest.mark.parametrize("function", [decompose_query_key, naive_decompose_query_key])
def test_bad_input_raises_value_error(function, w_q, w_k, num_heads, dim, kwargs, match):
    with pytest.raises(ValueError, match=match):
        function(w_q, w_k, num_heads, dim, **kwargs)
