"""Question-chosen exact keys (SnapKV): the observation-window score against its written-out reference, over
chunks, padding, grouped heads and pooling widths (the sparse hybrid with given scores: test_sparse_hybrid)."""

from __future__ import annotations

import pytest
import torch

from headkit.ops.key_selection import (
    naive_observation_scores,
    naive_reconstruction_scores,
    observation_scores,
    reconstruction_scores,
)


def make_inputs(heads=4, kv_heads=2, seq=23, head_dim=8, batch=2):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=generator, dtype=torch.float64)
    return q, k


def padding_mask(batch, seq):
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[-1, : min(5, seq - 1)] = False
    mask[0, seq // 3] = False
    return mask


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "observation", "kernel", "padded"),
    [(4, 2, 23, 5, 5, False), (3, 3, 17, 40, 1, True), (4, 1, 30, 1, 3, True), (2, 2, 9, 9, 7, False)],
)
def test_observation_scores_equal_the_reference(heads, kv_heads, seq, observation, kernel, padded):
    q, k = make_inputs(heads=heads, kv_heads=kv_heads, seq=seq)
    mask = padding_mask(2, seq) if padded else None
    options = {"observation": observation, "kernel": kernel, "attention_mask": mask}
    expected = naive_observation_scores(q, k, **options)
    for chunk in (1, 4, 1024):
        torch.testing.assert_close(
            observation_scores(q, k, chunk_size=chunk, **options), expected, rtol=1e-12, atol=1e-14
        )
    if mask is not None and kernel == 1:
        assert (observation_scores(q, k, **options)[~mask[:, None].expand(-1, kv_heads, -1)] == 0).all()


@pytest.mark.parametrize(("heads", "kv_heads", "padded"), [(4, 2, False), (3, 3, True), (4, 1, True)])
def test_observation_scores_beside_stored_keys_equal_the_reference(heads, kv_heads, padded):
    # A later turn: the voters' softmax spans the cache's stored keys (some slots empty) and the new keys.
    q, k = make_inputs(heads=heads, kv_heads=kv_heads, seq=19)
    past_keys = torch.randn(
        2, kv_heads, 11, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    past_mask = torch.rand(2, kv_heads, 11, generator=torch.Generator().manual_seed(2)) > 0.3
    options = {"observation": 6, "kernel": 3, "attention_mask": padding_mask(2, 19) if padded else None}
    options |= {"past_keys": past_keys, "past_mask": past_mask}
    expected = naive_observation_scores(q, k, **options)
    for chunk in (1, 5, 1024):
        torch.testing.assert_close(
            observation_scores(q, k, chunk_size=chunk, **options), expected, rtol=1e-12, atol=1e-14
        )
    # The stored keys take their share of every voter's mass: the new keys score less than alone, and an
    # all-empty store changes nothing.
    options.pop("past_keys"), options.pop("past_mask")
    alone = observation_scores(q, k, **options)
    assert (expected <= alone + 1e-12).all() and (expected < alone - 1e-6).any()
    empty = torch.zeros_like(past_mask)
    beside_nothing = observation_scores(q, k, past_keys=past_keys, past_mask=empty, **options)
    torch.testing.assert_close(beside_nothing, alone, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "padded", "stored"), [(4, 2, False, True), (3, 3, True, False)]
)
def test_the_largest_weight_equals_the_reference_and_the_repetitions_statistic(
    heads, kv_heads, padded, stored
):
    # reduction="max": each key the most weight any voter gives it (a later turn of KVzip's cache).
    q, k = make_inputs(heads=heads, kv_heads=kv_heads, seq=19)
    mask = padding_mask(2, 19) if padded else None
    options = {"observation": 6, "kernel": 1, "attention_mask": mask, "reduction": "max"}
    if stored:
        past_keys = torch.randn(
            2, kv_heads, 11, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        )
        options |= {"past_keys": past_keys, "past_mask": torch.ones(2, kv_heads, 11, dtype=torch.bool)}
    expected = naive_observation_scores(q, k, **options)
    for chunk in (1, 5, 1024):
        torch.testing.assert_close(
            observation_scores(q, k, chunk_size=chunk, **options), expected, rtol=1e-12, atol=1e-14
        )
    summed = naive_observation_scores(q, k, **(options | {"reduction": "sum"}))
    assert (expected <= summed + 1e-12).all() and (expected < summed - 1e-6).any() and (expected <= 1).all()
    if not stored:
        # with no stored keys, the last `observation` queries voting: KVzip's score over the same voters
        voters = torch.zeros(2, 19, dtype=torch.bool)
        voters[:, -6:] = True
        kvzip = reconstruction_scores(q, k, voters=voters, attention_mask=mask)
        torch.testing.assert_close(expected, kvzip, rtol=1e-12, atol=1e-14)


def test_stored_keys_are_checked():
    q, k = make_inputs(seq=8)
    with pytest.raises(ValueError, match="past_keys and past_mask"):
        observation_scores(q, k, observation=4, past_keys=torch.zeros(2, 2, 3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="past_keys must be"):
        observation_scores(
            q,
            k,
            observation=4,
            past_keys=torch.zeros(2, 2, 3, 4),
            past_mask=torch.ones(2, 2, 3, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="past_mask must be"):
        observation_scores(
            q,
            k,
            observation=4,
            past_keys=torch.zeros(2, 2, 3, 8),
            past_mask=torch.ones(2, 2, 4, dtype=torch.bool),
        )


def test_the_question_finds_the_key_it_attends_to():
    # The last query is built to point at key 7: its score is the largest after pooling.
    q, k = make_inputs(heads=2, kv_heads=1, seq=32)
    q, k = q * 0.1, k * 0.1
    k[:, :, 7] = 1.0
    q[:, :, -1] = 5.0
    scores = observation_scores(q, k, observation=1, kernel=1)
    assert (scores.argmax(-1) == 7).all()


@pytest.mark.parametrize("change", ["observation", "kernel", "mask", "shape", "reduction"])
def test_bad_arguments_are_named(change):
    q, k = make_inputs(seq=8)
    options = {"observation": 4}
    if change == "reduction":
        options["reduction"] = "mean"
    elif change == "observation":
        options["observation"] = 0
    elif change == "kernel":
        options["kernel"] = 4
    elif change == "mask":
        options["attention_mask"] = torch.ones(2, 7, dtype=torch.bool)
    else:
        k = k[:, :, :5]
    with pytest.raises(ValueError, match=change if change != "shape" else "k must be"):
        observation_scores(q, k, **options)


# -- reconstruction (KVzip) --


def voting_mask(batch, seq, first):
    voters = torch.zeros(batch, seq, dtype=torch.bool)
    voters[:, first:] = True
    voters[0, first] = False  # a row's voters need not be one span
    return voters


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "first", "padded"),
    [(4, 2, 23, 12, False), (3, 3, 17, 8, True), (4, 1, 30, 15, True), (2, 2, 9, 1, False)],
)
def test_reconstruction_scores_equal_the_reference(heads, kv_heads, seq, first, padded):
    q, k = make_inputs(heads=heads, kv_heads=kv_heads, seq=seq)
    mask = padding_mask(2, seq) if padded else None
    options = {"voters": voting_mask(2, seq, first), "attention_mask": mask}
    expected = naive_reconstruction_scores(q, k, **options)
    assert expected.abs().sum() > 0
    for chunk in (1, 3, 1024):
        torch.testing.assert_close(
            reconstruction_scores(q, k, chunk_size=chunk, **options), expected, rtol=1e-12, atol=1e-14
        )
    if mask is not None:
        padded_keys = ~mask[:, None].expand(-1, kv_heads, -1)
        assert (reconstruction_scores(q, k, **options)[padded_keys] == 0).all()


def test_the_repetition_finds_the_key_it_copies_and_ignores_the_other_queries():
    # A voting query points at key 7; a query that does not vote points at key 3.
    q, k = make_inputs(heads=2, kv_heads=1, seq=32)
    q, k = q * 0.1, k * 0.1
    k[:, :, 7], k[:, :, 3] = 1.0, -1.0
    q[:, :, 25], q[:, :, 14] = 5.0, -5.0
    voters = torch.zeros(2, 32, dtype=torch.bool)
    voters[:, 20:] = True
    scores = reconstruction_scores(q, k, voters=voters)[..., :16]
    assert (scores.argmax(-1) == 7).all()
    assert (scores[..., 3] < 0.1).all()


@pytest.mark.parametrize("voters", [torch.ones(2, 7, dtype=torch.bool), torch.ones(2, 8)])
def test_bad_voters_are_named(voters):
    q, k = make_inputs(seq=8)
    with pytest.raises(ValueError, match="voters must be"):
        reconstruction_scores(q, k, voters=voters)
