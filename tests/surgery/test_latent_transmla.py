"""TransMLA's training-free steps in headkit's latent keys/values (Meng et al. 2025, arXiv:2502.07864): RoRoPE
(``rope_selection="rorope"``), FreqFold (``rope_fold``) and the balanced key/value PCA (``balance_kv``), each
against a naive reference: scores unchanged before any truncation, the PCA equal to a loop over key samples, the
balance folded back exactly, the fold's energy gain; the mechanism absorbed == expanded, cached == uncached,
reloaded; the options recorded, replayed, refused with their range and offered on the command line."""

import dataclasses

import pytest
import torch
from family_models import family_inputs, family_model
from test_linearize_families import assert_cached_and_padded_decoding_agree

import headkit
from headkit.errors import HeadkitError
from headkit.ops.latent import LatentProjection, latent_attention, naive_shared_rope_latent_attention
from headkit.ops.rotary import apply_rotary
from headkit.surgery.adapters import get_adapter
from headkit.surgery.latent import LatentKVConfig, latent_mechanisms, set_absorbed
from headkit.surgery.latent_fit import (
    NORMS,
    collect_statistics,
    joint_latent_factors,
    key_pair_moments,
    naive_rotary_mixing,
    rotary_mixing,
    rotation_residual_shares,
    select_rotary_pairs,
)

HEAD_DIM, KV_HEADS, HEADS = 16, 2, 4


def calibration():
    return [{"input_ids": family_inputs(batch=4, length=16)}]


def rorope(rank, rope_dims, selection="rorope", **options):
    return LatentKVConfig(kv_rank=rank, rope_dims=rope_dims, rope_selection=selection, **options)


def captured(model, tokens):
    """Layer 0's queries and keys as its projections write them (before rotary), its cos/sin and its inputs."""
    attention = model.model.layers[0].self_attn
    seen = {}
    hooks = [
        attention.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o.detach())),
        attention.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o.detach())),
        attention.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0].detach())),
        attention.register_forward_pre_hook(
            lambda m, a, k: seen.__setitem__("rotary", k["position_embeddings"]), with_kwargs=True
        ),
    ]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    batch, length = tokens.shape
    q = seen["q"].reshape(batch, length, HEADS, HEAD_DIM).double()
    k = seen["k"].reshape(batch, length, KV_HEADS, HEAD_DIM).double()
    return q, k, seen["rotary"], seen["x"].double()


def rotate(x, cos, sin):
    """x [B, T, heads, head_dim] rotated as the stock module does (rotate-half)."""
    half = HEAD_DIM // 2
    return apply_rotary(x.transpose(1, 2), cos[..., :half].double(), sin[..., :half].double()).transpose(1, 2)


def naive_scores(q, k, cos, sin):
    """Every head's scores [B, H, T, T] written out: rotated query against its group's rotated key."""
    keys = rotate(k, cos, sin).repeat_interleave(HEADS // KV_HEADS, dim=2)
    return torch.einsum("bmhd,bnhd->bhmn", rotate(q, cos, sin), keys)


def naive_mixed_scores(q, k, cos, sin, mixing):
    """The same scores after the mix, before any truncation, as a loop over slots: slot (c, p) holds the virtual
    key k'_{c,p} = Σ mix[(c,p),(g,f)] k_{g,f} and head h's query q'_{h,c,p} = Σ_f mix[(c,p),(g(h),f)] q_{h,f}, both
    rotated at θ_p; the score is the sum over slots of their 2-D dot products."""
    half = HEAD_DIM // 2
    angles = torch.atan2(sin[..., :half].double(), cos[..., :half].double())  # [B, T, P]
    batch, length = q.shape[:2]
    scores = torch.zeros(batch, HEADS, length, length, dtype=torch.float64)
    mix = mixing.mix.reshape(KV_HEADS, half, KV_HEADS, half)

    def pair(x, f):
        return torch.stack((x[..., f], x[..., f + half]), dim=-1)

    def turned(v, p):
        c, s = angles[..., p].cos(), angles[..., p].sin()
        return torch.stack((v[..., 0] * c - v[..., 1] * s, v[..., 1] * c + v[..., 0] * s), dim=-1)

    for c in range(KV_HEADS):
        for p in range(half):
            key = sum(mix[c, p, g, f] * pair(k[:, :, g], f) for g in range(KV_HEADS) for f in range(half))
            key = turned(key, p)  # [B, T, 2]
            for h in range(HEADS):
                g = h // (HEADS // KV_HEADS)
                query = turned(sum(mix[c, p, g, f] * pair(q[:, :, h], f) for f in range(half)), p)
                scores[:, h] += query @ key.transpose(1, 2)
    return scores


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("rope_dims", [4, HEAD_DIM])
def test_rorope_leaves_every_attention_score_unchanged_before_truncation(model_type, rope_dims):
    model = family_model(model_type)
    tokens = family_inputs(batch=2, length=10)
    q, k, (cos, sin), x = captured(model, tokens)
    rows = model.model.layers[0].self_attn.k_proj.weight.detach().reshape(KV_HEADS, HEAD_DIM, -1)
    moment = x.reshape(-1, x.shape[-1]).T @ x.reshape(-1, x.shape[-1]) / x[..., 0].numel()
    mixing = rotary_mixing(rows, moment, rope_dims)
    identity = torch.eye(KV_HEADS * HEAD_DIM // 2, dtype=torch.float64)
    torch.testing.assert_close(mixing.mix @ mixing.mix.T, identity)  # orthogonal
    grid = mixing.mix.reshape(KV_HEADS, HEAD_DIM // 2, KV_HEADS, HEAD_DIM // 2)
    across = ~torch.eye(HEAD_DIM // 2, dtype=torch.bool)[None, :, None, :].expand_as(grid)
    assert grid[across].abs().max() == 0  # no fold: each frequency mixed with itself only
    assert not torch.allclose(grid, torch.eye(KV_HEADS, dtype=grid.dtype)[:, None, :, None] * (~across))
    expected = naive_scores(q, k, cos, sin)
    got = naive_mixed_scores(q, k, cos, sin, mixing)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_freqfold_changes_the_scores_by_the_merged_frequencies_alone():
    """With a fold the mix crosses neighbouring frequencies and slot (c, p) turns at θ_p: the scores change even
    with nothing cut — the approximation FreqFold makes, small where neighbouring frequencies are close."""
    model = family_model("llama")
    tokens = family_inputs(batch=2, length=10)
    q, k, (cos, sin), x = captured(model, tokens)
    rows = model.model.layers[0].self_attn.k_proj.weight.detach().reshape(KV_HEADS, HEAD_DIM, -1)
    moment = x.reshape(-1, x.shape[-1]).T @ x.reshape(-1, x.shape[-1]) / x[..., 0].numel()
    expected = naive_scores(q, k, cos, sin)
    errors = {}
    for fold in (1, 2, 4):
        mixing = rotary_mixing(rows, moment, HEAD_DIM, fold)
        got = naive_mixed_scores(q, k, cos, sin, mixing)
        errors[fold] = float((got - expected).abs().max() / expected.abs().max())
    assert errors[1] < 1e-6 and 1e-4 < errors[2] < 1.0 and errors[4] > 1e-4


@pytest.mark.parametrize("fold", [1, 2])
def test_the_pca_from_the_input_moment_equals_the_loop_over_key_samples(fold):
    generator = torch.Generator().manual_seed(0)
    hidden, samples = 24, 400
    rows = torch.randn(KV_HEADS, HEAD_DIM, hidden, generator=generator, dtype=torch.float64)
    x = torch.randn(samples, hidden, generator=generator, dtype=torch.float64) * torch.linspace(
        0.2, 2, hidden
    )
    keys = (x @ rows.reshape(-1, hidden).T).reshape(samples, KV_HEADS, HEAD_DIM)
    moment = x.T @ x / samples
    mixing = rotary_mixing(rows, moment, 6, fold)
    energies, counts = naive_rotary_mixing(keys, 6, fold)
    torch.testing.assert_close(mixing.energy.flatten().sort().values, energies.flatten().sort().values)
    kept = mixing.kept.reshape(KV_HEADS, -1, fold).sum(dim=(0, 2))
    assert kept.tolist() == counts.tolist() and mixing.pairs.shape == (KV_HEADS, 3)
    # The virtual keys' energies are the eigenvalues: within a block their moment is diagonal.
    virtual = key_pair_moments(mixing.key_rows(rows), moment).reshape(KV_HEADS, -1, KV_HEADS, HEAD_DIM // 2)
    block = torch.arange(HEAD_DIM // 2) // fold
    same = (block[:, None] == block[None, :])[None, :, None, :].expand_as(virtual)
    expected = torch.diag(mixing.energy.flatten()).reshape(virtual.shape)
    torch.testing.assert_close(virtual[same], expected[same], atol=1e-9, rtol=1e-9)


def test_rorope_keeps_more_key_energy_than_any_per_head_choice_and_the_fold_more_still():
    model = family_model("llama")
    sites = get_adapter(model).sites(model)
    statistics = collect_statistics(model, sites, get_adapter(model), calibration())[0]
    rows = model.model.layers[0].self_attn.k_proj.weight.detach().reshape(KV_HEADS, HEAD_DIM, -1)
    kept = {}
    for fold in (1, 2, 4):
        mixing = rotary_mixing(rows, statistics.input_moment, 4, fold)
        kept[fold] = float(mixing.energy[mixing.kept].sum())
    total = float(mixing.energy.sum())
    # Per head: MHA2MLA's choice and the best one, each head's D/2 pairs of largest key energy.
    moments = torch.diagonal(key_pair_moments(rows, statistics.input_moment)).reshape(KV_HEADS, -1)
    pairs = select_rotary_pairs(statistics, 2, NORMS)
    per_head = float(moments.gather(1, pairs).sum())
    best_per_head = float(moments.topk(2, dim=1).values.sum())
    assert per_head <= best_per_head < kept[1] <= kept[2] + 1e-9 <= kept[4] + 2e-9 <= total
    assert (
        abs(float(torch.diagonal(key_pair_moments(rows, statistics.input_moment)).sum()) - total)
        < 1e-6 * total
    )


@pytest.mark.parametrize(
    ("model_type", "selection"), [("llama", "rorope"), ("qwen2", "rorope"), ("mistral", "rorope_fitted")]
)
def test_rorope_at_full_width_gives_the_original_logits(model_type, selection):
    model = family_model(model_type)
    tokens = family_inputs(length=12)
    with torch.no_grad():
        reference = model(tokens).logits
        report = headkit.apply_(
            model, rorope(KV_HEADS * HEAD_DIM, HEAD_DIM, selection), calibration=calibration()
        )
        got = model(tokens).logits
    assert report.rope_selection == selection and report.max_value_error < 1e-6
    assert (got - reference).abs().max() < 1e-5
    assert all(m.rope_mix is not None for m in latent_mechanisms(model))


def converted(model_type, selection="rorope", **options):
    model = family_model(model_type)
    headkit.apply_(model, rorope(20, 4, selection, **options), calibration=calibration())
    return model


@pytest.mark.parametrize(
    ("model_type", "selection", "fold"), [("llama", "rorope", 1), ("qwen2", "rorope_fitted", 2)]
)
def test_rorope_absorbed_equals_expanded_outputs_and_gradients(model_type, selection, fold):
    model = converted(model_type, selection, rope_fold=fold, balance_kv=True)
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
    assert any("rope_mix" in name for name in results[True][1])
    for name, grad in results[True][1].items():
        torch.testing.assert_close(grad, results[False][1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_shared_rope_op_equals_its_naive_twin_with_a_padding_mask_and_one_new_token():
    generator = torch.Generator().manual_seed(0)
    batch, heads, groups, head_dim, rope, rank, past = 2, 4, 2, 8, 2, 6, 5
    cache = torch.randn(batch, past + 1, rank + groups * rope, generator=generator)
    key_up = torch.randn(groups, head_dim, rank, generator=generator)
    value_up = torch.randn(groups, head_dim, rank, generator=generator)
    bias = torch.randn(groups, head_dim, generator=generator)
    query_nope = torch.randn(batch, heads, 1, head_dim, generator=generator)
    query_rope = torch.randn(batch, heads, 1, groups * rope, generator=generator)
    mask = torch.ones(batch, 1, 1, past + 1, dtype=torch.bool)
    mask[0, ..., :2] = False
    every = torch.arange(head_dim).expand(groups, -1)
    projection = LatentProjection(key_up, value_up, bias, torch.tensor([[0, 4], [1, 5]]), every)
    got = latent_attention(query_nope, query_rope, cache, projection, mask, scale=0.3, shared_rope=True)
    expected = naive_shared_rope_latent_attention(query_nope, query_rope, cache, projection, mask, scale=0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_rorope_cached_equals_uncached_and_padded_equals_alone(model_type):
    model = converted(model_type, "rorope_fitted", rope_fold=2)
    assert_cached_and_padded_decoding_agree(model, family_inputs(batch=2, length=7), padding=3)


def test_rorope_reload_gives_identical_logits_and_records_the_options(tmp_path):
    model = converted("qwen2", rope_fold=2, balance_kv=True)
    entry = model.config.headkit_surgery[-1]
    assert (entry["rope_selection"], entry["rope_fold"], entry["balance_kv"]) == ("rorope", 2, True)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = family_inputs(length=10)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
    assert all(m.rope_mix is not None for m in latent_mechanisms(reloaded))


def test_a_record_from_before_the_options_replays_with_their_defaults():
    entry = dataclasses.asdict(LatentKVConfig(kv_rank=20, rope_dims=4)) | {"op": "latent_kv"}
    for name in ("rope_fold", "balance_kv"):
        entry.pop(name)
    config = LatentKVConfig.from_record(entry)
    assert (config.rope_fold, config.balance_kv, config.mixed) == (1, False, False)


def test_balanced_factors_fold_the_scale_back_and_ignore_how_keys_and_values_are_scaled():
    generator = torch.Generator().manual_seed(0)
    hidden = 40
    key = torch.randn(KV_HEADS, 12, hidden, generator=generator, dtype=torch.float64)
    value = torch.randn(KV_HEADS, HEAD_DIM, hidden, generator=generator, dtype=torch.float64)
    moment = torch.eye(hidden, dtype=torch.float64)
    full = joint_latent_factors(key, value, hidden, moment, balance=True)
    torch.testing.assert_close(torch.einsum("gnr,rh->gnh", full.key_up, full.down), key)  # exact at full rank
    torch.testing.assert_close(torch.einsum("gnr,rh->gnh", full.value_up, full.down), value)
    # Naive reference: the keys scaled to the values' Frobenius norm, a plain SVD, the scale divided back out.
    alpha = value.norm() / key.norm()
    stacked = torch.cat((alpha * key.reshape(-1, hidden), value.reshape(-1, hidden)))
    up = torch.linalg.svd(stacked, full_matrices=False).U[:, :20]
    approximated = up @ up.T @ stacked
    balanced = joint_latent_factors(key, value, 20, moment, balance=True)
    keys = torch.einsum("gnr,rh->gnh", balanced.key_up, balanced.down)
    torch.testing.assert_close(keys.reshape(-1, hidden), approximated[: key[..., 0].numel()] / alpha)
    # Keys 100x louder: the balanced factorization is the same model scaled; the plain one spends R on the keys.
    loud = joint_latent_factors(100 * key, value, 20, moment, balance=True)
    torch.testing.assert_close(loud.value_error, balanced.value_error)
    plain = joint_latent_factors(100 * key, value, 20, moment)
    assert plain.value_error > balanced.value_error + 0.1 and plain.key_error < balanced.key_error


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"rope_selection": "rorope", "rope_fold": 3},
            r"rope_fold must divide head_dim/2 = 8 \(one of \[1, 2, 4, 8\]\)",
        ),
        (
            {"rope_fold": 2, "rope_selection": "fitted"},
            "rope_fold 2 folds frequencies for RoRoPE's PCA: it needs rope_selection 'rorope'",
        ),
        ({"rope_selection": "rorope", "rope_fold": 0}, r"rope_fold must be an integer ≥ 1"),
        ({"balance_kv": "yes"}, "balance_kv must be True or False"),
        (
            {"rope_selection": "twist"},
            r"rope_selection must be one of \('fitted', 'norms', 'rorope', 'rorope_fitted'\)",
        ),
    ],
)
def test_bad_options_name_the_field_and_its_range_before_any_work(options, message):
    model = family_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadkitError, match=message):
        config = LatentKVConfig(kv_rank=8, rope_dims=4, **options)
        config.check(model.config)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_options_are_command_line_options_with_help():
    from headkit.recipes.compress import CompressSettings
    from headkit.runs.options import command_parameters

    parameters = {p.name: p for p in command_parameters(CompressSettings)}
    for name in ("rope_fold", "balance_kv"):
        assert name in parameters
        assert "TransMLA" in str(parameters[name].default.help)


def test_the_fitted_rorope_keeps_rotary_where_a_fixed_rotation_errs_and_needs_calibration():
    """rorope_fitted ranks the principal components by energy × their frequency's residual share
    (rotation_residual_shares), so the slow frequencies a fixed rotation serves give their slots up."""
    model = family_model("llama")
    adapter = get_adapter(model)
    statistics = collect_statistics(model, adapter.sites(model), adapter, calibration())[0]
    rows = model.model.layers[0].self_attn.k_proj.weight.detach().reshape(KV_HEADS, HEAD_DIM, -1)
    shares = rotation_residual_shares(statistics.rotation_fit)
    plain = rotary_mixing(rows, statistics.input_moment, 4)
    fitted = rotary_mixing(rows, statistics.input_moment, 4, 1, shares)
    slots = lambda m: set(map(tuple, torch.nonzero(m.kept).tolist()))  # noqa: E731
    assert slots(plain) != slots(fitted)
    weight = lambda m: float((m.energy * shares)[m.kept].sum())  # noqa: E731
    assert weight(fitted) >= weight(plain)
    with pytest.raises(HeadkitError, match="rorope_fitted.*calibration"):
        headkit.apply_(family_model("llama"), rorope(20, 4, "rorope_fitted"))


def test_a_fold_with_the_default_selection_needs_calibration_text_to_be_rorope():
    model = family_model("llama")
    config = LatentKVConfig(
        kv_rank=20, rope_dims=4, rope_fold=2
    )  # the default: rorope_fitted with calibration
    with pytest.raises(HeadkitError, match="without calibration text the rotary selection is 'norms'"):
        headkit.apply_(model, config)
    report = headkit.apply_(model, config, calibration=calibration())
    assert report.rope_selection == "rorope_fitted"
    assert model.config.headkit_surgery[-1]["rope_fold"] == 2


def test_rorope_needs_no_calibration_text_its_pca_then_reads_the_weights_alone():
    model = family_model("llama")
    tokens = family_inputs(length=12)
    with torch.no_grad():
        reference = model(tokens).logits
        report = headkit.apply_(model, rorope(KV_HEADS * HEAD_DIM, HEAD_DIM))
        exact = float((model(tokens).logits - reference).abs().max())
    assert not report.calibrated and report.rope_selection == "rorope" and exact < 1e-5
