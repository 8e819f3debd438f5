"""headkit's latent keys/values (MHA2MLA partial RoPE + joint K/V SVD, multi-head latent attention) on the tiny
decoder families the registry marks ``latent``: exact at full size, each lossy step visible, absorbed == expanded
(outputs and gradients), cached == uncached, padded == alone, reload, refusals before any work."""

import itertools

import pytest
import torch
from family_models import family_inputs, family_model
from test_linearize_families import assert_cached_and_padded_decoding_agree

import headkit
import headkit.surgery.attention
import headkit.surgery.pruning
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.ops.latent import LatentProjection, latent_attention, naive_latent_attention
from headkit.surgery.attention import MECHANISM
from headkit.surgery.families import FAMILIES, LATENT
from headkit.surgery.latent import compress_kv_to_latent, latent_mechanisms, set_absorbed
from headkit.surgery.latent_fit import (
    allocate_by_error,
    allocate_ranks,
    candidate_ranks,
    expected_rotation,
    fold_rotation,
    rotation_moments,
)
from headkit.surgery.latent_heads import LatentCacheLayer

LATENT_FAMILIES = sorted(name for name, family in FAMILIES.items() if LATENT in family.operations)
HEAD_DIM, KV_HEADS = 16, 2


def calibration():
    return [{"input_ids": family_inputs(batch=4, length=16)}]


def test_the_families_include_llama():
    assert {"llama", "mistral", "qwen2"} <= set(LATENT_FAMILIES)


@pytest.mark.parametrize("model_type", LATENT_FAMILIES)
def test_exact_at_full_rank_with_every_dimension_rotary(model_type):
    model = family_model(model_type)
    tokens = family_inputs(length=12)
    with torch.no_grad():
        reference = model(tokens).logits
        report = compress_kv_to_latent(model, kv_rank=KV_HEADS * HEAD_DIM, rope_dims=HEAD_DIM)
        got = model(tokens).logits
    assert report.cache_numbers_after == report.cache_numbers_before and report.max_value_error < 1e-6
    assert (got - reference).abs().max() < 1e-5


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_full_rank_with_partial_rope_is_exact_in_rank_and_each_lossy_step_shows(model_type):
    tokens = family_inputs(length=12)
    errors = {}
    for rope_dims, rank in ((HEAD_DIM, 32), (4, KV_HEADS * (2 * HEAD_DIM - 4)), (4, 20)):
        model = family_model(model_type)
        with torch.no_grad():
            reference = model(tokens).logits
            report = compress_kv_to_latent(
                model, kv_rank=rank, rope_dims=rope_dims, calibration=calibration()
            )
            errors[rope_dims, rank] = float((model(tokens).logits - reference).abs().max())
        if rank == report.full_rank:
            assert report.max_key_error < 1e-6 and report.max_value_error < 1e-6
        else:
            assert report.max_key_error > 1e-3 or report.max_value_error > 1e-3
    assert errors[HEAD_DIM, 32] < 1e-5  # nothing dropped
    assert errors[4, 56] > 1e-4  # rotary dropped from 12 of 16 dimensions: a different model
    assert errors[4, 20] > 1e-4


def test_the_calibrated_rotary_pairs_follow_the_query_key_norms():
    model = family_model("llama")
    with torch.no_grad():  # make pair 5 of key/value head 1 dominate in layer 0
        k_proj = model.model.layers[0].self_attn.k_proj
        k_proj.weight[HEAD_DIM + 5] *= 50
        k_proj.weight[HEAD_DIM + 5 + HEAD_DIM // 2] *= 50
    report = compress_kv_to_latent(
        model, kv_rank=24, rope_dims=2, calibration=calibration(), rope_selection="norms"
    )
    assert report.sites[0].rope_pairs[1] == [5]
    assert report.rope_selection == "norms"


def test_a_slow_pair_with_a_large_norm_is_left_rotary_free_by_the_fitted_selection():
    # The slowest pair turns by ~0.005 rad over 16 tokens (rope_theta 10,000, head_dim 16): dropping its rotation
    # loses almost nothing however large it is. MHA2MLA's norms keep it rotary; the fitted residual does not.
    slowest = HEAD_DIM // 2 - 1
    chosen = {}
    for selection in ("norms", "fitted"):
        model = family_model("llama")
        with torch.no_grad():
            k_proj = model.model.layers[0].self_attn.k_proj
            k_proj.weight[HEAD_DIM + slowest] *= 50
            k_proj.weight[HEAD_DIM + slowest + HEAD_DIM // 2] *= 50
        report = compress_kv_to_latent(
            model, kv_rank=24, rope_dims=2, calibration=calibration(), rope_selection=selection
        )
        chosen[selection] = report.sites[0].rope_pairs[1]
        assert report.sites[0].rope_error is not None and 0 < report.sites[0].rope_error < 1
    assert chosen["norms"] == [slowest]
    assert chosen["fitted"] != [slowest]


def _pair_inputs(batch=2, length=7, heads=4, groups=2, head_dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, length, groups, head_dim, generator=generator, dtype=torch.float64)
    theta = torch.rand(head_dim // 2, generator=generator, dtype=torch.float64)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * theta
    cos = torch.cat((angles.cos(), angles.cos()), -1).expand(batch, length, head_dim)
    sin = torch.cat((angles.sin(), angles.sin()), -1).expand(batch, length, head_dim)
    return q, k, cos, sin


def test_rotation_moments_equal_the_attention_weighted_score_terms_as_complex_numbers():
    q, k, cos, sin = _pair_inputs()
    heads, groups, pairs, scale = q.shape[2], k.shape[2], q.shape[-1] // 2, 0.3
    got = rotation_moments(q, k, cos, sin, scale)
    # Reference: each pair as a complex number; z = q·conj(k) unrotated, s = Re(z e^{iθ(m−n)}) rotated.
    qc, kc = torch.complex(q[..., :pairs], q[..., pairs:]), torch.complex(k[..., :pairs], k[..., pairs:])
    turn = torch.complex(cos[..., :pairs], sin[..., :pairs])
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    expected = torch.zeros(groups, pairs, 3, 3, dtype=torch.float64)
    for head in range(heads):
        group = head // (heads // groups)
        z = qc[:, :, None, head] * kc[:, None, :, group].conj()
        rotated = (z * turn[:, :, None] * turn[:, None, :].conj()).real
        weights = (rotated.sum(-1) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        terms = torch.stack((z.real, -z.imag, rotated), dim=-1)
        expected[group] += torch.einsum("bmn,bmnpx,bmnpy->pxy", weights, terms, terms)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_the_fitted_rotation_is_the_least_squares_optimum_and_folds_into_the_keys():
    q, k, cos, sin = _pair_inputs(heads=2, groups=1)
    moments = rotation_moments(q, k, cos, sin, 0.3)
    fit = expected_rotation(moments)
    assert (fit.residual <= fit.unrotated_residual + 1e-9).all() and (fit.residual <= fit.energy + 1e-9).all()
    for pair in range(q.shape[-1] // 2):  # a nearby (a, b) leaves a larger weighted error
        for da, db in ((1e-3, 0), (0, 1e-3), (-1e-3, 0), (0, -1e-3)):
            a, b = fit.cos[0, pair] + da, fit.sin[0, pair] + db
            m = moments[0, pair]
            error = (
                m[2, 2]
                - 2 * (a * m[0, 2] + b * m[1, 2])
                + a * a * m[0, 0]
                + 2 * a * b * m[0, 1]
                + b * b * m[1, 1]
            )
            assert error >= fit.residual[0, pair] - 1e-9
    # Folded keys, unrotated, give Re(z·c) = a·Re z + b·(−Im z) for every query and key.
    folded = fold_rotation(k.permute(2, 3, 0, 1), fit.cos, fit.sin).permute(2, 3, 0, 1)
    half = q.shape[-1] // 2
    z = (
        torch.complex(q[..., :half], q[..., half:])[:, :, None, 0]
        * torch.complex(k[..., :half], k[..., half:])[:, None, :, 0].conj()
    )
    zf = (
        torch.complex(q[..., :half], q[..., half:])[:, :, None, 0]
        * torch.complex(folded[..., :half], folded[..., half:])[:, None, :, 0].conj()
    )
    torch.testing.assert_close(zf.real, fit.cos[0] * z.real - fit.sin[0] * z.imag)


def test_the_fitted_selection_leaves_less_score_error_than_leaving_pairs_unrotated():
    reports = {}
    for selection in ("norms", "fitted"):
        model = family_model("llama")
        reports[selection] = compress_kv_to_latent(
            model, kv_rank=56, rope_dims=4, calibration=calibration(), rope_selection=selection
        )
    for fitted, norms in zip(reports["fitted"].sites, reports["norms"].sites, strict=True):
        assert fitted.rope_error <= norms.rope_error + 1e-12


def converted(model_type, rank=20, rope_dims=4):
    model = family_model(model_type)
    compress_kv_to_latent(model, kv_rank=rank, rope_dims=rope_dims, calibration=calibration())
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_absorbed_equals_expanded_outputs_and_gradients(model_type):
    model = converted(model_type)
    tokens = family_inputs(length=9)
    results = {}
    for absorbed in (True, False):
        set_absorbed(model, absorbed)
        model.zero_grad()
        logits = model(tokens).logits
        logits.square().mean().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[absorbed] = (logits.detach(), grads)
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    assert results[True][1].keys() == results[False][1].keys()
    assert any("key_up" in name for name in results[True][1])
    for name, grad in results[True][1].items():
        torch.testing.assert_close(grad, results[False][1][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("new", [1, 3], ids=["one-new-token", "a-prompt"])
def test_the_op_equals_its_naive_twin_with_a_padding_mask(new):
    """One new token (the batched-product path) and a prompt (SDPA over the cache as every head's key and
    value): outputs equal the expanded reference's under a causal padding mask."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, groups, head_dim, rope, rank, past = 2, 4, 2, 8, 2, 6, 5
    rope_index = torch.tensor([[0, 4], [3, 7]])
    nope_index = torch.tensor([[1, 2, 3, 5, 6, 7], [0, 1, 2, 4, 5, 6]])
    cache = torch.randn(batch, past + new, rank + groups * rope, generator=generator)
    key_up = torch.randn(groups, head_dim - rope, rank, generator=generator)
    value_up = torch.randn(groups, head_dim, rank, generator=generator)
    bias = torch.randn(groups, head_dim, generator=generator)
    queries = torch.randn(batch, heads, new, head_dim, generator=generator)
    rows = torch.arange(past, past + new)[:, None]
    mask = (torch.arange(past + new)[None] <= rows)[None, None].repeat(batch, 1, 1, 1)
    mask[0, ..., :2] = False  # row 0 left-padded by two tokens
    per_head = heads // groups
    q_rope = queries.gather(
        -1, rope_index.repeat_interleave(per_head, 0)[None, :, None].expand(batch, -1, new, -1)
    )
    q_nope = queries.gather(
        -1, nope_index.repeat_interleave(per_head, 0)[None, :, None].expand(batch, -1, new, -1)
    )
    projection = LatentProjection(key_up, value_up, bias, rope_index, nope_index)
    got = latent_attention(q_nope, q_rope, cache, projection, mask, scale=0.3)
    expected = naive_latent_attention(queries, cache, projection, mask, scale=0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_cached_equals_uncached_and_padded_equals_alone(model_type):
    model = converted(model_type)
    assert_cached_and_padded_decoding_agree(model, family_inputs(batch=2, length=7), padding=3)


def test_the_cache_holds_the_latent_and_the_rotary_keys_only():
    model = converted("llama", rank=20, rope_dims=4)
    tokens = family_inputs(batch=2, length=7)
    with torch.no_grad():
        out = model(tokens, use_cache=True)
    cache = output_cache(out)
    layers = cache.layers
    assert all(isinstance(layer, LatentCacheLayer) for layer in layers)
    assert [tuple(layer.state.shape) for layer in layers] == [(2, 7, 20 + KV_HEADS * 4)] * 2
    assert cache.get_seq_length() == 7


def test_reload_gives_identical_logits_and_generates(tmp_path):
    model = converted("qwen2")
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = family_inputs(length=10)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
        options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(reloaded.generate(tokens, **options), model.generate(tokens, **options))
    assert len(latent_mechanisms(reloaded)) == 2


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_families_with_a_per_head_key_norm_are_refused_with_the_reason(model_type):
    model = family_model(model_type)
    with pytest.raises(HeadkitError, match="not linear in the latent"):
        compress_kv_to_latent(model, kv_rank=16, rope_dims=4)
    with pytest.raises(HeadkitError, match="k_norm"):
        compress_kv_to_latent(model, kv_rank=16, rope_dims=4, adapter="llama")
    assert not hasattr(model.model.layers[0].self_attn, MECHANISM)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_rank": 61, "rope_dims": 2}, r"kv_rank must be an integer in \[1, 60\]"),
        ({"kv_rank": 0, "rope_dims": 2}, r"\[1, 60\]"),
        ({"kv_rank": 8, "rope_dims": 3}, "whole number of rotary pairs"),
        ({"kv_rank": 8, "rope_dims": 18}, r"\[0, 16\]"),
        (
            {"kv_rank": 8, "rope_dims": 4, "rope_selection": "best"},
            r"rope_selection must be one of \('fitted'",
        ),
        ({"kv_rank": 8, "rope_dims": 4, "rope_selection": "fitted"}, "needs calibration|pass calibration"),
    ],
)
def test_bad_arguments_name_the_valid_range_and_leave_the_model_untouched(options, message):
    model = family_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadkitError, match=message):
        compress_kv_to_latent(model, **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_linearized_and_unevenly_pruned_models_are_refused_before_any_work():
    model = family_model("llama")
    headkit.linearize(model, window=4)
    with pytest.raises(HeadkitError, match="LinearizedHeads"):
        compress_kv_to_latent(model, kv_rank=8, rope_dims=4)
    model = converted("llama")
    with pytest.raises(HeadkitError, match="already latent"):
        compress_kv_to_latent(model, kv_rank=8, rope_dims=4)
    model = family_model("llama")
    headkit.surgery.pruning.prune_heads(model, {0: [0]})  # 2 query heads of one group, 1 of the other
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadkitError, match="pruned unevenly"):
        compress_kv_to_latent(model, kv_rank=8, rope_dims=4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_prompt_fed_in_two_chunks_equals_one_pass(implementation):
    model = converted("llama")
    headkit.surgery.attention.set_attention_implementation(model, implementation)
    tokens = family_inputs(batch=2, length=9)
    with torch.no_grad():
        whole = model(tokens).logits
        first = model(tokens[:, :5], use_cache=True)
        second = model(tokens[:, 5:], **cache_keyword(output_cache(first)), use_cache=True)
    torch.testing.assert_close(torch.cat((first.logits, second.logits), dim=1), whole, atol=1e-5, rtol=1e-5)
    assert output_cache(second).layers[0].state.shape[1] == 9


def test_allocated_ranks_minimise_the_summed_relative_error_under_the_same_total():
    generator = torch.Generator().manual_seed(0)
    spectra = [
        torch.sort(torch.rand(6, generator=generator) * scale, descending=True).values for scale in (1, 5, 2)
    ]
    ranks = allocate_ranks(spectra, 9)
    assert sum(ranks) == 9 and all(1 <= r <= 6 for r in ranks)

    def left(choice):
        return sum(float(s[r:].pow(2).sum() / s.pow(2).sum()) for s, r in zip(spectra, choice, strict=True))

    every = [c for c in itertools.product(range(1, 7), repeat=3) if sum(c) == 9]
    assert left(ranks) == pytest.approx(min(left(c) for c in every))
    with pytest.raises(HeadkitError, match=r"total must be in \[3, 18\]"):
        allocate_ranks(spectra, 2)


def test_allocation_by_error_curves_is_optimal_for_convex_curves_on_uneven_candidate_ranks():
    """Against every choice on the curves, linear between candidates: the error at each layer's rank."""
    curves = [
        ([2, 4, 8, 12], [9.0, 4.0, 1.0, 0.5]),
        ([2, 4, 8, 12], [3.0, 2.0, 1.5, 1.4]),
        ([1, 3, 9], [20.0, 5.0, 0.0]),
    ]

    def error(curve, rank):
        for (r0, e0), (r1, e1) in itertools.pairwise(zip(*curve, strict=True)):
            if r0 <= rank <= r1:
                return e0 + (e1 - e0) * (rank - r0) / (r1 - r0)
        raise AssertionError(rank)

    for total in (5, 12, 20, 33):
        ranks = allocate_by_error(curves, total)
        assert sum(ranks) == total and all(
            c[0][0] <= r <= c[0][-1] for c, r in zip(curves, ranks, strict=True)
        )
        choices = itertools.product(*(range(c[0][0], c[0][-1] + 1) for c in curves))
        best = min(
            sum(error(c, r) for c, r in zip(curves, choice, strict=True))
            for choice in choices
            if sum(choice) == total
        )
        assert sum(error(c, r) for c, r in zip(curves, ranks, strict=True)) == pytest.approx(best)
    # A curve that rises somewhere (noise) is followed along its lower convex hull: the units still add up.
    bumpy = [([2, 4, 6], [5.0, 6.0, 1.0]), ([2, 4, 6], [5.0, 3.0, 2.0])]
    assert sum(allocate_by_error(bumpy, 9)) == 9
    with pytest.raises(HeadkitError, match=r"total must be in \[5, 33\]"):
        allocate_by_error(curves, 34)
    assert candidate_ranks(48, 336) == [12, 24, 36, 48, 72, 96, 144]
    assert candidate_ranks(120, 312) == [30, 60, 90, 120, 180, 240, 312]


def test_sensitivity_allocation_gives_the_rank_to_the_layer_the_loss_feels(tmp_path):
    model = family_model("llama")
    with (
        torch.no_grad()
    ):  # layer 0's attention output barely reaches the residual stream: its errors cost little
        model.model.layers[0].self_attn.o_proj.weight.mul_(1e-3)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    report = compress_kv_to_latent(
        model, kv_rank=12, rope_dims=4, calibration=iter(calibration()), rank_allocation="sensitivity"
    )
    assert sum(report.kv_ranks) == 24 and report.kv_ranks[0] < 12 < report.kv_ranks[1]
    assert report.candidate_ranks == candidate_ranks(12, 56) and len(report.rank_errors) == 2
    # Each curve falls with the rank, and the layer the loss barely feels costs far less at every rank.
    for errors in report.rank_errors:
        assert errors[0] > errors[-1] >= 0
    assert all(a < 1e-3 * b for a, b in zip(*report.rank_errors, strict=True))
    assert [m.rank for m in latent_mechanisms(model)] == report.kv_ranks
    assert "by the loss-weighted output errors" in str(report)
    # The gradient pass leaves the flags of the parameters the conversion kept as they were.
    assert all(p.requires_grad == before[n] for n, p in model.named_parameters() if n in before)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = family_inputs(length=10)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
    untouched = family_model("llama")
    state = {k: v.clone() for k, v in untouched.state_dict().items()}
    for options, message in (
        ({}, "rank_allocation 'sensitivity' measures"),
        ({"statistics": []}, "not only statistics"),
    ):
        with pytest.raises(HeadkitError, match=message):
            compress_kv_to_latent(
                untouched, kv_rank=12, rope_dims=4, rank_allocation="sensitivity", **options
            )
    assert all(torch.equal(v, state[k]) for k, v in untouched.state_dict().items())


def test_spectrum_allocation_keeps_the_total_varies_the_ranks_and_reloads(tmp_path):
    model = family_model("llama")
    with torch.no_grad():  # layer 0's keys and values read few input directions: a low rank serves it
        for name in ("k_proj", "v_proj"):
            getattr(model.model.layers[0].self_attn, name).weight[:, 6:] *= 1e-3
    report = compress_kv_to_latent(
        model, kv_rank=12, rope_dims=4, calibration=calibration(), rank_allocation="spectrum"
    )
    assert sum(report.kv_ranks) == 12 * len(report.kv_ranks) and report.kv_ranks[0] < 12 < report.kv_ranks[1]
    assert [m.rank for m in latent_mechanisms(model)] == report.kv_ranks
    # each layer's cache holds its own rank plus the rotary keys
    assert [m.cache_width for m in latent_mechanisms(model)] == [r + KV_HEADS * 4 for r in report.kv_ranks]
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = family_inputs(length=10)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
    with pytest.raises(HeadkitError, match="rank_allocation 'spectrum'"):
        compress_kv_to_latent(family_model("llama"), kv_rank=12, rope_dims=4, rank_allocation="spectrum")
    with pytest.raises(HeadkitError, match="rank_allocation must be one of"):
        compress_kv_to_latent(family_model("llama"), kv_rank=12, rope_dims=4, rank_allocation="greedy")
