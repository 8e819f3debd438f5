"""causal_softmax, the prefill of the compressed cache's exact heads and of a first prompt: the causal kernel (no
padding) and the masked form against a plain softmax written out, with and without cached keys; and how each
selection scores a later turn."""

from __future__ import annotations

import pytest
import torch

from headkit.layers.hybrid import SplitHeadsState
from headkit.layers.kept_exact import QuestionSelection, ReconstructionSelection, causal_softmax
from headkit.ops.key_selection import naive_observation_scores


def reference(queries, keys, values, keep, scale, cached):
    """Query t (after `cached` keys) attends to every real key up to its own position, itself always."""
    groups = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    out = torch.zeros(*queries.shape[:3], values.shape[-1], dtype=queries.dtype)
    for b in range(queries.shape[0]):
        for t in range(queries.shape[2]):
            position = cached + t
            seen = [j for j in range(position + 1) if keep[b, j] or j == position]
            scores = (queries[b, :, t, None, :] @ keys[b][:, seen].transpose(-1, -2))[:, 0] * scale
            weights = torch.softmax(scores, dim=-1)
            out[b, :, t] = (weights[:, None, :] @ values[b][:, seen])[:, 0]
    return out


@pytest.mark.parametrize("mask", ["none", "ones", "padded"])
@pytest.mark.parametrize("cached", [0, 3])
def test_causal_softmax_equals_the_softmax_written_out(mask, cached):
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 9, 8

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    queries, keys, values = (
        draw(batch, heads, seq, dim),
        draw(batch, kv_heads, seq, dim),
        draw(batch, kv_heads, seq, 6),
    )
    new_mask = None if mask == "none" else torch.ones(batch, seq, dtype=torch.bool)
    if mask == "padded":
        new_mask[1, :3] = False  # left padding
    state = None
    keep = torch.ones(batch, cached + seq, dtype=torch.bool)
    if cached:
        state = SplitHeadsState(None, draw(batch, kv_heads, cached, dim), draw(batch, kv_heads, cached, 6),
                                torch.ones(batch, cached, dtype=torch.bool))  # fmt: skip
    if new_mask is not None:
        keep[:, cached:] = new_mask
    all_keys = keys if state is None else torch.cat([state.keys, keys], dim=2)
    all_values = values if state is None else torch.cat([state.values, values], dim=2)
    out, (kept_keys, _, kept) = causal_softmax(queries, keys, values, new_mask, 0.3, state)
    expected = reference(queries, all_keys, all_values, keep, 0.3, cached)
    real = keep[:, cached:, None]  # a padded query's output is never used
    torch.testing.assert_close(out * real[:, None], expected * real[:, None], rtol=1e-10, atol=1e-10)
    assert torch.equal(kept_keys, all_keys) and torch.equal(kept, keep)


def test_each_selection_scores_a_later_turn_beside_the_stored_keys_on_its_own_scale():
    # The question's selection sums the voters' weights and pools (SnapKV); the repetition's takes the most any
    # voter gives, unpooled — KVzip's statistic, that its stored keys were kept by — and a scoring forward's
    # pending scores come first.
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(1, 4, 12, 8, generator=generator, dtype=torch.float64)
    keys = torch.randn(1, 2, 12, 8, generator=generator, dtype=torch.float64)
    past = (
        torch.randn(1, 2, 5, 8, generator=generator, dtype=torch.float64),
        torch.ones(1, 2, 5, dtype=torch.bool),
    )
    options = {
        "observation": 4,
        "attention_mask": None,
        "scale": 0.3,
        "past_keys": past[0],
        "past_mask": past[1],
    }
    question = QuestionSelection(observation=4).key_scores(queries, keys, None, 0.3, True, past)
    torch.testing.assert_close(question, naive_observation_scores(queries, keys, **options))
    repetition = ReconstructionSelection(observation=4)
    later = repetition.key_scores(queries, keys, None, 0.3, True, past)
    expected = naive_observation_scores(queries, keys, kernel=1, reduction="max", **options)
    torch.testing.assert_close(later, expected)
    assert (later <= 1).all() and (question.sum(-1) > later.sum(-1)).all()
    repetition.pending = torch.full((1, 2, 12), 0.5)
    assert (repetition.key_scores(queries, keys, None, 0.3, True, past) == 0.5).all()
    assert repetition.pending is None
    # a decoding step asks nothing: zeros either way
    assert not repetition.key_scores(queries[:, :, -1:], keys[:, :, -1:], None, 0.3, False).any()
