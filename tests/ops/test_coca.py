"""CoCA attention: the fast SDPA path against the paper's definition, relative positions, masks, argument checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import headkit.ops.coca as coca_module
from headkit.ops.coca import coca_attention, naive_coca_attention, naive_coca_scores

HEAD_DIM = 8


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Max error within `rel` of the reference's scale."""
    assert actual.shape == expected.shape
    error = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1e-12)
    assert error <= rel * scale, f"max error {error:.3e} vs scale {scale:.3e}"


def make_inputs(batch=2, heads=4, kv_heads=4, q_len=6, kv_len=6, head_dim=HEAD_DIM, value_dim=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=generator).requires_grad_()
    t = torch.rand(batch, kv_heads, kv_len, head_dim // 2, generator=generator).requires_grad_()
    v = torch.randn(batch, kv_heads, kv_len, value_dim, generator=generator).requires_grad_()
    return q, t, v


def padding_mask(batch: int, kv_len: int, kind: str) -> torch.Tensor | None:
    if kind == "none":
        return None
    keep = torch.ones(batch, kv_len, dtype=torch.bool)
    if kind == "left":  # batched generation pads on the left: early queries of row 1 see nothing at all
        keep[1, :3] = False
    elif kind == "int":
        keep[0, -2:] = False
        return keep.long()
    return keep


def count_sdpa_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


def assert_matches_naive(q, t, v, **kwargs):
    out = coca_attention(q, t, v, **kwargs)
    reference = naive_coca_attention(q, t, v, **kwargs)
    assert torch.isfinite(out).all()
    assert_close_rel(out, reference)
    upstream = torch.randn_like(reference)
    grads = torch.autograd.grad(out, (q, t, v), upstream)
    reference_grads = torch.autograd.grad(reference, (q, t, v), upstream)
    for grad, reference_grad in zip(grads, reference_grads, strict=True):
        assert torch.isfinite(grad).all()
        assert_close_rel(grad, reference_grad)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "q_len", "kv_len"),
    [(4, 4, 7, 7), (4, 2, 7, 7), (6, 3, 1, 9), (4, 1, 3, 10), (2, 2, 9, 5)],
    ids=["mha", "gqa", "decode-one", "decode-mqa", "more-queries"],
)
@pytest.mark.parametrize("mask", ["none", "left", "int"])
def test_matches_the_definition(causal, heads, kv_heads, q_len, kv_len, mask):
    q, t, v = make_inputs(heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len)
    assert_matches_naive(q, t, v, causal=causal, attention_mask=padding_mask(2, kv_len, mask))


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"type": "dynamic", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 8.0, "original_max_position_embeddings": 12},
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_matches_the_definition_with_scaling_and_explicit_positions(rope_scaling, causal):
    q, t, v = make_inputs(heads=4, kv_heads=2, q_len=5, kv_len=9, head_dim=16, value_dim=16)
    key_positions = torch.stack([torch.arange(9), torch.arange(40, 49)])
    query_positions = key_positions[:, -5:]
    assert_matches_naive(
        q,
        t,
        v,
        causal=causal,
        position_ids=query_positions,
        key_position_ids=key_positions,
        rope_theta=500.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=16,
        scale=0.3,
    )


@pytest.mark.parametrize("value_dim", [HEAD_DIM, 5], ids=["queries-in-output", "queries-per-group"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_head_groups_match_the_definition(monkeypatch, value_dim, heads, kv_heads):
    """A tiny workspace budget forces one SDPA call per key/value head (no autograd: preallocated output)."""
    monkeypatch.setattr(coca_module, "_MIN_WORKSPACE_BYTES", 0)
    monkeypatch.setattr(coca_module, "_WORKSPACE_FRACTION", 1e-9)
    calls = count_sdpa_calls(monkeypatch)
    q, t, v = make_inputs(heads=heads, kv_heads=kv_heads, q_len=8, kv_len=8, value_dim=value_dim)
    keep = padding_mask(2, 8, "left")
    with torch.no_grad():
        out = coca_attention(q, t, v, attention_mask=keep)
        reference = naive_coca_attention(q, t, v, attention_mask=keep)
    assert len(calls) == kv_heads
    assert_close_rel(out, reference)


def test_large_calls_group_heads_by_default(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1024, 64, generator=generator)
    t = torch.rand(1, 8, 1024, 32, generator=generator)
    v = torch.randn(1, 8, 1024, 64, generator=generator)
    one_call = coca_attention(q, t, v.requires_grad_()).detach()  # autograd: a single SDPA call
    calls = count_sdpa_calls(monkeypatch)
    with torch.no_grad():
        grouped = coca_attention(q, t, v)
    assert len(calls) >= 2
    assert_close_rel(grouped, one_call, 1e-6)


def test_autograd_makes_one_call(monkeypatch):
    monkeypatch.setattr(coca_module, "_MIN_WORKSPACE_BYTES", 0)
    calls = count_sdpa_calls(monkeypatch)
    q, t, v = make_inputs(heads=4, kv_heads=4)
    out = coca_attention(q, t, v)
    assert len(calls) == 1 and out.requires_grad


def test_head_groups_under_bfloat16_autocast(monkeypatch):
    q, t, v = make_inputs(heads=4, kv_heads=2, q_len=16, kv_len=16, value_dim=HEAD_DIM)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        one_call = coca_attention(q, t, v)
        monkeypatch.setattr(coca_module, "_MIN_WORKSPACE_BYTES", 0)
        monkeypatch.setattr(coca_module, "_WORKSPACE_FRACTION", 1e-9)
        calls = count_sdpa_calls(monkeypatch)
        grouped = coca_attention(q, t, v)
    assert len(calls) == 2
    assert one_call.dtype == grouped.dtype == torch.bfloat16
    assert torch.equal(grouped, one_call)
    assert_close_rel(grouped.float(), naive_coca_attention(q, t, v).detach(), 5e-2)


def test_naive_scores_are_the_papers_formula():
    """score(m, n) = scale · Σ_i t_n,i (q_m,i² + q_m,i+D/2²) cos((m − n) θ_i), written out with loops."""
    q, t, _ = make_inputs(batch=1, heads=2, kv_heads=1, q_len=3, kv_len=4)
    query_positions, key_positions = torch.tensor([5, 9, 2]), torch.tensor([0, 3, 7, 11])
    scores = naive_coca_scores(q, t, query_positions=query_positions, key_positions=key_positions, scale=0.5)
    half = HEAD_DIM // 2
    theta = [10000.0 ** (-2 * i / HEAD_DIM) for i in range(half)]
    for head in range(2):
        for m_index, m in enumerate(query_positions.tolist()):
            for n_index, n in enumerate(key_positions.tolist()):
                expected = 0.5 * sum(
                    t[0, 0, n_index, i].item()
                    * (q[0, head, m_index, i].item() ** 2 + q[0, head, m_index, i + half].item() ** 2)
                    * math.cos((m - n) * theta[i])
                    for i in range(half)
                )
                assert abs(scores[0, head, m_index, n_index].item() - expected) <= 1e-5 * (1 + abs(expected))


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0}])
@pytest.mark.parametrize("causal", [True, False])
def test_shifting_every_position_changes_nothing(rope_scaling, causal):
    q, t, _ = make_inputs(q_len=6, kv_len=6, head_dim=32)
    positions = torch.arange(6)
    kwargs = {"rope_scaling": rope_scaling, "causal": causal}

    def naive_scores(offset):
        return naive_coca_scores(
            q,
            t,
            query_positions=positions + offset,
            key_positions=positions + offset,
            rope_scaling=rope_scaling,
        )

    assert_close_rel(naive_scores(1000), naive_scores(0), 1e-4)
    # One-hot values make the output the attention weights themselves.
    one_hot = torch.eye(6).expand(2, 4, 6, 6)
    weights = coca_attention(q, t, one_hot, position_ids=positions, key_position_ids=positions, **kwargs)
    shifted = coca_attention(
        q, t, one_hot, position_ids=positions + 1000, key_position_ids=positions + 1000, **kwargs
    )
    assert_close_rel(shifted, weights, 1e-4)
    assert (
        weights - weights.mean(dim=-1, keepdim=True)
    ).abs().max() > 1e-3  # not uniform: positions do matter


def test_decoding_step_equals_the_last_row_of_the_full_call():
    q, t, v = make_inputs(q_len=10, kv_len=10)
    keep = padding_mask(2, 10, "left")
    full = coca_attention(q, t, v, attention_mask=keep)
    step = coca_attention(q[:, :, -2:], t, v, attention_mask=keep)  # default positions: the newest two tokens
    assert_close_rel(step, full[:, :, -2:], 1e-6)
    misplaced = coca_attention(q[:, :, -2:], t, v, attention_mask=keep, position_ids=torch.arange(2))
    assert (misplaced - full[:, :, -2:]).abs().max() > 1e-3


def test_fully_padded_rows_are_zero_with_finite_gradients():
    q, t, v = make_inputs(q_len=5, kv_len=5)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1] = False
    out = coca_attention(q, t, v, attention_mask=keep)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0
    grads = torch.autograd.grad(out.sum(), (q, t, v))
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))


def test_large_inputs_stay_finite_under_bfloat16_autocast():
    generator = torch.Generator().manual_seed(0)
    seq = 8192
    q = 100 * torch.randn(1, 1, seq, 16, generator=generator)
    t = 100 * torch.rand(1, 1, seq, 8, generator=generator)
    v = 100 * torch.randn(1, 1, seq, 16, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = coca_attention(q, t, v)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert out.float().abs().max() > 1.0


def test_bfloat16_inputs_track_float32():
    q, t, v = make_inputs(q_len=16, kv_len=16)
    out = coca_attention(q.bfloat16(), t.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    assert_close_rel(out.float(), coca_attention(q, t, v), 5e-2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"q": torch.randn(2, 4, 6, 7)}, "head_dim"),
        ({"t": torch.rand(2, 4, 6, 8)}, "t must have shape"),
        ({"q": torch.randn(4, 6, 8)}, "q"),
        ({"t": torch.rand(4, 6, 4)}, "t"),
        ({"v": torch.randn(4, 6, 5)}, "v"),
        ({"t": torch.rand(2, 3, 6, 4), "v": torch.randn(2, 3, 6, 5)}, "does not divide"),
        ({"v": torch.randn(2, 4, 7, 5)}, "v must have shape"),
        ({"t": -torch.rand(2, 4, 6, 4)}, "non-negative"),
        ({"t": torch.rand(2, 4, 6, 4, dtype=torch.float64)}, "dtype"),
        ({"attention_mask": torch.ones(2, 6)}, "attention_mask"),
        ({"attention_mask": torch.ones(2, 5, dtype=torch.bool)}, "attention_mask"),
        ({"position_ids": torch.arange(5)}, "position_ids"),
        ({"position_ids": torch.arange(6.0)}, "position_ids"),
        ({"key_position_ids": torch.zeros(3, 6, dtype=torch.long)}, "key_position_ids"),
        ({"rope_scaling": {"rope_type": "ntk", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "max_position_embeddings"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -1.0}}, "factor"),
        ({"scale": math.inf}, "scale"),
        ({"causal": None}, "causal"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(change, match):
    arguments = {"q": torch.randn(2, 4, 6, 8), "t": torch.rand(2, 4, 6, 4), "v": torch.randn(2, 4, 6, 5)}
    arguments.update(change)
    q, t, v = arguments.pop("q"), arguments.pop("t"), arguments.pop("v")
    with pytest.raises(ValueError, match=match):
        coca_attention(q, t, v, **arguments)
