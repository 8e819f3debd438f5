"""The closed-form repair after head removal: each output projection refit by least squares equals a plain
least-squares solve on the original's captured activations, never reconstructs worse than slicing, and keeps
the pruned checkpoint's shapes."""

import copy

import pytest
import torch
from family_models import VOCAB, family_inputs, family_model

from headkit.errors import HeadkitError
from headkit.surgery import prune_heads
from headkit.surgery.adapters import get_adapter, linear_parameters
from headkit.surgery.latent import compress_kv_to_latent
from headkit.surgery.repair import (
    OutputStatistics,
    capture_attention_calls,
    fisher_weighted_error,
    output_statistics,
    reconstruct_attention,
    refit_error_scores,
    refit_output_projections,
    refit_sequentially,
    refit_weight,
)

REMOVED = {0: [1], 1: [0, 3]}


def _captured_inputs(model, batches=None):
    """Layer → the original's output-projection inputs [tokens, heads·head_dim] on the calibration batches."""
    sites = get_adapter(model).sites(model)
    captured = {}
    handles = [
        site.output_projection.register_forward_pre_hook(
            lambda module, args, i=i: captured.setdefault(i, []).append(
                args[0].reshape(-1, args[0].shape[-1])
            )
        )
        for i, site in enumerate(sites)
    ]
    with torch.no_grad():
        for batch in batches or _batches():
            model(**batch)
    for handle in handles:
        handle.remove()
    return {i: torch.cat(chunks).double() for i, chunks in captured.items()}


def _batches():
    return [
        {"input_ids": family_inputs(batch=2, length=24)},
        {"input_ids": family_inputs(batch=1, length=24) + 1},
    ]


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2"])
def test_the_refit_is_the_least_squares_solution_on_the_originals_activations(model_type):
    # llama (attention_bias) and gpt2 have an output bias, which the fit moves too (an intercept); qwen2 has none.
    teacher = family_model(model_type)
    statistics = output_statistics(teacher, _batches())
    inputs = _captured_inputs(teacher)
    student = copy.deepcopy(teacher)
    prune_heads(student, REMOVED)
    report = refit_output_projections(student, statistics, REMOVED, ridge=1e-9)  # λ → 0: least squares
    assert report.layers == [0, 1] and report.tokens == 72
    sites_before, sites_after = get_adapter(teacher).sites(teacher), get_adapter(student).sites(student)
    for layer, removed in REMOVED.items():
        d = sites_before[layer].head_dim
        kept = [h for h in range(sites_before[layer].num_heads) if h not in removed]
        columns = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kept])
        original, bias = linear_parameters(sites_before[layer].output_projection)
        original = original.double()
        target = inputs[layer] @ original.T
        h_k = inputs[layer][:, columns]
        if bias is not None:
            h_k = torch.cat([h_k, h_k.new_ones(len(h_k), 1)], dim=1)
        expected = torch.linalg.lstsq(h_k, target).solution.T
        got, got_bias = linear_parameters(sites_after[layer].output_projection)
        got = got.double()
        if bias is not None:
            assert got_bias is not None and not torch.equal(got_bias, bias)  # the bias absorbed a mean
            got = torch.cat([got, (got_bias - bias).double()[:, None]], dim=1)
        # Heads of one key/value group output vectors of one value subspace: H_K can be rank-deficient, so the
        # minimiser is not unique — what must agree is the residual it reaches (the least-squares optimum).
        residual = (h_k @ got.T - target).pow(2).sum()
        optimum = (h_k @ expected.T - target).pow(2).sum()
        assert residual <= optimum + 1e-6 * target.pow(2).sum(), (model_type, layer)
        # the report's errors are the layer-local errors measured on the activations themselves
        sliced = (inputs[layer][:, columns] @ original[:, columns].T - target).pow(2).sum() / target.pow(
            2
        ).sum()
        index = report.layers.index(layer)
        assert report.error_sliced[index] == pytest.approx(float(sliced), rel=1e-6)
        assert report.error_refit[index] == pytest.approx(
            float(residual / target.pow(2).sum()), rel=1e-3, abs=1e-9
        )
        assert report.error_refit[index] <= report.error_sliced[index]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_ridge_pulls_the_refit_towards_the_sliced_projection(model_type):
    # W' = argmin E‖H_K Wᵀ + c − H W_Oᵀ‖² + λ‖W − W_K‖² (c free where the projection has a bias: the fit is then on
    # the centred activations), solved here as the augmented least-squares problem.
    teacher = family_model(model_type)
    statistics = output_statistics(teacher, _batches())
    inputs = _captured_inputs(teacher)
    for ridge, layer in ((0.1, 0), (10.0, 1)):
        student = copy.deepcopy(teacher)
        prune_heads(student, REMOVED)
        refit_output_projections(student, statistics, REMOVED, ridge=ridge)
        site = get_adapter(teacher).sites(teacher)[layer]
        d, kept = site.head_dim, [h for h in range(site.num_heads) if h not in REMOVED[layer]]
        columns = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kept])
        original, bias = linear_parameters(site.output_projection)
        original, h = original.double(), inputs[layer]
        if bias is not None:
            h = h - h.mean(dim=0)
        h = h / len(h) ** 0.5
        h_k = h[:, columns]
        damping = ridge * float((h_k.T @ h_k).diagonal().mean())
        system = torch.cat([h_k, damping**0.5 * torch.eye(len(columns), dtype=h_k.dtype)])
        wanted = torch.cat([h @ original.T, damping**0.5 * original[:, columns].T])
        expected = torch.linalg.lstsq(system, wanted).solution.T
        got = linear_parameters(get_adapter(student).sites(student)[layer].output_projection)[0].double()
        assert torch.allclose(got, expected, atol=1e-5), (ridge, layer)


def test_untouched_and_emptied_layers_are_left_as_they_are():
    teacher = family_model("llama")
    statistics = output_statistics(teacher, _batches())
    student = copy.deepcopy(teacher)
    removed = {0: [0, 1, 2, 3]}
    prune_heads(student, removed, allow_empty_layers=True)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    report = refit_output_projections(student, statistics, removed)
    assert report.layers == []
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_a_refit_model_decodes_closer_to_the_original_than_a_sliced_one():
    teacher = family_model("llama")
    statistics = output_statistics(teacher, _batches())
    sliced, refit = copy.deepcopy(teacher), copy.deepcopy(teacher)
    prune_heads(sliced, REMOVED)
    prune_heads(refit, REMOVED)
    refit_output_projections(refit, statistics, REMOVED)
    ids = torch.cat([batch["input_ids"] for batch in _batches()])
    with torch.no_grad():
        target = teacher(ids).logits
        assert (refit(ids).logits - target).pow(2).mean() < (sliced(ids).logits - target).pow(2).mean()


def test_statistics_of_another_model_are_refused():
    teacher = family_model("llama")
    statistics = output_statistics(teacher, _batches())
    with pytest.raises(HeadkitError, match="one entry per attention layer"):
        refit_output_projections(family_model("llama", num_hidden_layers=3), statistics, REMOVED)
    with pytest.raises(HeadkitError, match="at least one batch"):
        output_statistics(teacher, [])


def test_the_sequential_refit_fits_each_layer_on_the_pruned_models_own_inputs():
    teacher = family_model("llama")
    student = copy.deepcopy(teacher)
    prune_heads(student, REMOVED)
    report = refit_sequentially(student, teacher, _batches(), REMOVED, ridge=1e-9)
    assert report.layers == [0, 1] and report.tokens == 72
    assert all(r <= s for r, s in zip(report.error_refit, report.error_sliced, strict=True))
    # layer 1 was fitted on what the student (layer 0 pruned and refit) gives it: refitting again changes nothing
    again = copy.deepcopy(student)
    second = refit_sequentially(again, teacher, _batches(), {1: REMOVED[1]}, ridge=1e-9)
    assert second.error_refit[0] == pytest.approx(report.error_refit[1], rel=1e-4, abs=1e-9)


def _latent_pair(rank=12, rope_dims=4, **config):
    """(original, the original with latent keys/values at a lossy rank)."""
    teacher = family_model("llama", **config)
    student = copy.deepcopy(teacher)
    compress_kv_to_latent(student, kv_rank=rank, rope_dims=rope_dims, calibration=_batches())
    return teacher, student


def _windows(seed, count):
    """`count` batches of 4 random windows of 32 tokens: the fit's calibration or its held-out check."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (4, 32), generator=generator)} for _ in range(count)]


def _held_out():
    return _windows(1, 2)


def test_layer_local_reconstruction_lowers_each_layers_held_out_error_and_trains_only_attention():
    teacher, student = _latent_pair()
    original = {k: v.clone() for k, v in teacher.state_dict().items()}
    before = {k: v.clone() for k, v in student.state_dict().items()}
    report = reconstruct_attention(student, teacher, _windows(0, 8), _held_out(), steps=60, lr=1e-3)
    assert report.layers == [0, 1] and report.tokens == 8 * 4 * 32
    for layer, (b, a) in enumerate(zip(report.error_before, report.error_after, strict=True)):
        assert a < b or layer in report.skipped
    assert report.skipped == [] and all(
        a < 0.9 * b for b, a in zip(report.error_before, report.error_after, strict=True)
    )
    # the error it reports is the module's error on the original's inputs, recomputed here
    calls = capture_attention_calls(teacher, _held_out(), [0])[0]
    module = student.get_submodule(get_adapter(teacher).sites(teacher)[0].name)
    with torch.no_grad():
        errors = [(module(*c.args, **c.kwargs)[0] - c.output).pow(2).sum() for c in calls]
    expected = sum(errors) / sum(c.output.pow(2).sum() for c in calls)
    assert float(expected) == pytest.approx(report.error_after[0], rel=1e-4)
    changed = {k for k, v in student.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(".self_attn." in k for k in changed)
    assert all(torch.equal(v, original[k]) for k, v in teacher.state_dict().items())
    assert all(not p.requires_grad for p in student.parameters()) == all(
        not p.requires_grad for p in teacher.parameters()
    )


def test_a_bfloat16_fit_computes_its_products_in_bfloat16_and_keeps_float32_weights():
    teacher, student = _latent_pair()
    reference = copy.deepcopy(student)
    seen = []
    site = get_adapter(teacher).sites(teacher)[0].name
    handle = student.get_submodule(f"{site}.o_proj").register_forward_hook(
        lambda module, args, output: seen.append(output.dtype)
    )
    mixed = reconstruct_attention(
        student, teacher, _windows(0, 8), _held_out(), steps=60, lr=1e-3, precision=torch.bfloat16
    )
    handle.remove()
    plain = reconstruct_attention(reference, teacher, _windows(0, 8), _held_out(), steps=60, lr=1e-3)
    # layer 0's 2 held-out calls before the fit and after it in float32, its 60 fit steps under autocast
    assert seen == [torch.float32] * 2 + [torch.bfloat16] * 60 + [torch.float32] * 2
    assert all(p.dtype == torch.float32 for p in student.parameters())
    assert mixed.precision == "bfloat16" and plain.precision == "float32" and "(bfloat16)" in str(mixed)
    for mixed_after, plain_after, before in zip(
        mixed.error_after, plain.error_after, plain.error_before, strict=True
    ):
        assert mixed_after < 0.9 * before and mixed_after == pytest.approx(plain_after, rel=0.1)


def test_reconstruction_trains_only_the_parameters_named_and_only_the_layers_given():
    teacher, student = _latent_pair()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    reconstruct_attention(
        student,
        teacher,
        _batches(),
        _held_out(),
        layers=[1],
        trainable=lambda n: n.startswith("v_proj"),
        steps=5,
    )
    changed = {k for k, v in student.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("model.layers.1.self_attn.v_proj") for k in changed)


def test_layers_captured_a_few_at_a_time_fit_exactly_as_all_at_once_and_the_head_never_runs():
    teacher, student = _latent_pair(num_hidden_layers=3)
    few = copy.deepcopy(student)
    sites = get_adapter(teacher).sites(teacher)
    runs = {"head": 0, **{site.name: 0 for site in sites}}
    handles = [
        teacher.get_output_embeddings().register_forward_hook(
            lambda *_: runs.__setitem__("head", runs["head"] + 1)
        )
    ] + [
        site.module.register_forward_hook(lambda *_, name=site.name: runs.__setitem__(name, runs[name] + 1))
        for site in sites
    ]
    at_once = reconstruct_attention(student, teacher, _windows(0, 8), _held_out(), steps=20, lr=1e-3)
    counts_at_once = dict(runs)
    runs.update({key: 0 for key in runs})
    one_a_pass = reconstruct_attention(
        few, teacher, _windows(0, 8), _held_out(), steps=20, lr=1e-3, capture_bytes=1
    )
    for handle in handles:
        handle.remove()
    assert at_once.error_after == one_a_pass.error_after and at_once.tokens == one_a_pass.tokens
    assert all(torch.equal(v, few.state_dict()[k]) for k, v in student.state_dict().items())
    # 10 batches a pass, each pass stopped after its last layer (the LM head never runs): layer 0 alone first,
    # which measures a layer, then the rest in one pass, or (1 byte) a layer a pass, through the layers before it
    names = [site.name for site in sites]
    assert counts_at_once == {"head": 0, names[0]: 20, names[1]: 10, names[2]: 10}
    assert runs == {"head": 0, names[0]: 30, names[1]: 20, names[2]: 10}


def test_a_fit_that_diverges_is_undone_and_reported():
    teacher, student = _latent_pair()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    report = reconstruct_attention(student, teacher, _batches(), _held_out(), steps=3, lr=1e6)
    assert report.skipped == [0, 1] and report.error_after == report.error_before
    assert all(torch.equal(v, before[k]) for k, v in student.state_dict().items())
    assert all(torch.isfinite(v).all() for v in student.state_dict().values())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"steps": 0}, "steps must be"),
        ({"lr": -1.0}, "lr must be"),
        ({"layers": [2]}, r"layers must be in \[0, 1\]"),
        ({"precision": torch.float32}, "precision must be torch.bfloat16, torch.float16 or None"),
        ({"capture_bytes": 0}, "capture_bytes must be a positive integer"),
    ],
)
def test_bad_reconstruction_arguments_are_refused_before_any_work(options, message):
    teacher, student = _latent_pair()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises(HeadkitError, match=message):
        reconstruct_attention(student, teacher, _batches(), _held_out(), **options)
    with pytest.raises(HeadkitError, match="converted copy of teacher"):
        reconstruct_attention(family_model("llama", num_hidden_layers=1), teacher, _batches(), _held_out())
    assert all(torch.equal(v, before[k]) for k, v in student.state_dict().items())


def _statistics(heads=4, head_dim=3, out=5, seed=0, silent=()):
    generator = torch.Generator().manual_seed(seed)
    activations = torch.randn(200, heads * head_dim, generator=generator, dtype=torch.float64)
    weight = torch.randn(out, heads * head_dim, generator=generator, dtype=torch.float64)
    for head in silent:  # a head whose output the projection ignores: removing it costs nothing
        weight[:, head * head_dim : (head + 1) * head_dim] = 0
    return OutputStatistics(gram=activations.T @ activations, tokens=200, weight=weight, head_dim=head_dim)


def test_refit_error_scores_rank_each_layer_by_the_error_left_after_the_repair():
    layers = [_statistics(seed=0, silent=(2,)), _statistics(seed=1)]
    kv = [[0, 0, 1, 1], [0, 0, 1, 1]]
    scores = refit_error_scores(layers, kv)
    assert scores[0][2] == 0 and scores[0].argmin() == 2  # the silent head goes first, for free
    # The first head each layer gives up is the one whose removal alone leaves the least refit error.
    for stats, layer_scores in zip(layers, scores, strict=True):
        alone = [refit_weight(stats, [h for h in range(4) if h != gone])[2] for gone in range(4)]
        assert layer_scores.argmin() == min(range(4), key=alone.__getitem__)
        assert layer_scores.min() == pytest.approx(min(alone))
    # Increments along each layer's order never fall: a ranking across layers keeps each layer's order.
    ordered = [sorted(s.tolist()) for s in scores]
    assert all(a <= b for row in ordered for a, b in zip(row, row[1:], strict=False))
    # Groups: every query head of a group shares its group's score.
    grouped = refit_error_scores(layers, kv, unit="group")
    assert all(s[0] == s[1] and s[2] == s[3] for s in grouped)
    with pytest.raises(HeadkitError, match="weighting must be one of relative, absolute, loss"):
        refit_error_scores(layers, kv, weighting="fisher")
    with pytest.raises(HeadkitError, match="gradients=True"):
        refit_error_scores(layers, kv, weighting="loss")


def _with_gradients(stats, seed=0, deaf=()):
    """`stats` with per-token activations and the gradients g of a made-up loss at the projection's output, as
    the input gradients W_Oᵀ g; `deaf` output rows get no gradient (the loss ignores them)."""
    generator = torch.Generator().manual_seed(seed)
    activations = torch.randn(stats.tokens, stats.gram.shape[0], generator=generator, dtype=torch.float64)
    gradients = torch.randn(stats.tokens, stats.weight.shape[0], generator=generator, dtype=torch.float64)
    gradients[:, list(deaf)] = 0
    stats.gram = activations.T @ activations
    stats.activations, stats.input_gradients = activations, gradients @ stats.weight
    return stats, gradients


def test_loss_weighted_scores_are_the_squared_first_order_loss_change_of_the_repaired_removal():
    stats, gradients = _with_gradients(_statistics(seed=2))
    kv = [[0, 0, 1, 1]]
    scores = refit_error_scores([stats], kv, weighting="loss")[0]

    def direct(kept):  # Σ_t (g_tᵀ Δ h_t)², Δ = [W' on K, 0 on R] − W_O, from the refit itself
        delta = -stats.weight.clone()
        delta[:, [c for h in kept for c in range(h * 3, h * 3 + 3)]] += refit_weight(stats, kept)[0]
        return float(((gradients @ delta) * stats.activations).sum(-1).pow(2).sum())

    first = min(range(4), key=lambda gone: direct([h for h in range(4) if h != gone]))
    assert scores.argmin() == first
    assert float(scores.min()) == pytest.approx(direct([h for h in range(4) if h != first]), rel=1e-4)


def test_the_loss_weighted_scores_taken_a_slice_of_tokens_at_a_time_are_the_whole_products(monkeypatch):
    import headkit.surgery.repair as repair

    stats, _ = _with_gradients(_statistics(seed=2))
    whole = refit_error_scores([stats], [[0, 0, 1, 1]], weighting="loss")[0]
    monkeypatch.setattr(repair, "SCORE_TOKENS", 3)  # slices of 3 tokens, the last one shorter
    sliced = refit_error_scores([stats], [[0, 0, 1, 1]], weighting="loss")[0]
    assert stats.tokens % 3 and torch.allclose(sliced, whole, rtol=1e-6)


def test_loss_weighting_keeps_the_head_the_loss_needs_where_the_relative_error_would_not():
    # Head 0 writes only to output rows the loss ignores; head 3 only to the rows it reads, and faintly.
    stats = _statistics(seed=3, out=4)
    stats.weight[:, 0:3] = 0
    stats.weight[:2, 0:3] = 5.0  # large, but into rows 0-1
    stats.weight[2:, 9:12] *= 0.05  # small, into rows 2-3
    stats.weight[:2, 9:12] = 0
    stats, _ = _with_gradients(stats, seed=3, deaf=(0, 1))
    relative = refit_error_scores([stats], [[0, 1, 2, 3]], weighting="relative")[0]
    loss = refit_error_scores([stats], [[0, 1, 2, 3]], weighting="loss")[0]
    assert relative.argmin() != 0 and loss.argmin() == 0


def _next_token_loss(model, batches):
    total = 0.0
    for batch in batches:
        logits = model(**batch).logits[:, :-1].double()
        total += float(
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["input_ids"][:, 1:].flatten(), reduction="sum"
            )
        )
    return total


def test_captured_gradients_are_the_losss_derivative_by_each_attention_output():
    """Checked against the loss itself: adding ε·δ to layer 1's attention output moves the summed next-token loss
    by ε Σ_t g_t·δ_t to first order (central difference, float64)."""
    model = family_model("llama").double()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    batches = _windows(3, 2)
    calls = capture_attention_calls(model, batches, [0, 1], gradients=True)
    assert all(c.gradient is not None and c.gradient.shape == c.output.shape for c in calls[1])
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    generator = torch.Generator().manual_seed(0)
    directions = [torch.randn(c.output.shape, generator=generator, dtype=torch.float64) for c in calls[1]]
    module = get_adapter(model).sites(model)[1].module
    epsilon = 1e-4

    def shifted_loss(scale):
        batch_index = iter(range(len(batches)))

        def shift(mod, args, output):
            return (output[0] + scale * directions[next(batch_index)], *output[1:])

        handle = module.register_forward_hook(shift)
        try:
            with torch.no_grad():
                return _next_token_loss(model, batches)
        finally:
            handle.remove()

    measured = (shifted_loss(epsilon) - shifted_loss(-epsilon)) / (2 * epsilon)
    predicted = sum(float((c.gradient * d).sum()) for c, d in zip(calls[1], directions, strict=True))
    assert measured == pytest.approx(predicted, rel=1e-5)
    # Without gradients the records carry none, and the weighted error refuses them.
    plain = capture_attention_calls(model, batches, [1])[1]
    assert all(c.gradient is None for c in plain)
    with pytest.raises(HeadkitError, match="gradients=True"):
        fisher_weighted_error(module, plain)


def test_output_statistics_with_gradients_keep_each_tokens_input_and_its_loss_gradient():
    model = family_model("llama").double()
    batches = _windows(3, 2)
    plain = output_statistics(model, batches)
    stats = output_statistics(model, batches, gradients=True)
    calls = capture_attention_calls(model, batches, [0, 1], gradients=True)
    inputs = _captured_inputs(model, batches)
    assert all(p.grad is None for p in model.parameters())
    for layer in (0, 1):
        assert torch.allclose(stats[layer].gram, plain[layer].gram)  # the same moments as without
        weight = get_adapter(model).sites(model)[layer].output_projection.weight.detach().double()
        expected = torch.cat([c.gradient.reshape(-1, c.gradient.shape[-1]) for c in calls[layer]]) @ weight
        activations, input_gradients = stats[layer].loss_samples()  # read back from the files, one layer
        assert input_gradients.dtype == torch.bfloat16
        assert torch.allclose(
            input_gradients.double(),
            expected,
            rtol=1e-2,
            atol=1e-3 * float(expected.abs().max()),
        )
        assert torch.allclose(activations.double(), inputs[layer], rtol=1e-2, atol=1e-2)
    assert not plain[0].has_loss_samples


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2"])
def test_the_chunked_gradient_pass_equals_the_plain_losss(model_type, monkeypatch):
    """The calibration's gradient pass, its loss computed from the LM head's input a chunk of tokens at a time and
    its batches in slices, gives every layer the gradients the model's own loss gives (Gemma 2's soft-capped
    logits included), with padding."""
    import headkit.surgery.repair as repair

    model = family_model(model_type).double()
    batches = _windows(3, 2)
    batches[1] = dict(batches[1], attention_mask=torch.ones_like(batches[1]["input_ids"]))
    batches[1]["attention_mask"][0, -3:] = 0
    assert repair._next_token_head(model) is not None  # the head's loss is reproduced: the chunked path runs
    monkeypatch.setattr(repair, "PASS_TOKENS", 5)  # slices of one row
    chunked = output_statistics(model, batches, gradients=True)
    monkeypatch.setattr(repair, "_next_token_head", lambda model: None)
    monkeypatch.setattr(repair, "PASS_TOKENS", 10**9)
    plain = output_statistics(model, batches, gradients=True)
    for got, want in zip(chunked, plain, strict=True):
        torch.testing.assert_close(got.gram, want.gram)
        for a, b in zip(got.loss_samples(), want.loss_samples(), strict=True):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-2, atol=1e-3 * float(b.abs().max()))


def test_the_fisher_weighted_error_is_the_squared_first_order_loss_change_per_token():
    teacher, student = _latent_pair()
    calls = capture_attention_calls(teacher, _windows(4, 1), [0], gradients=True)[0]
    module = student.get_submodule(get_adapter(teacher).sites(teacher)[0].name)
    with torch.no_grad():
        per_token = [((module(*c.args, **c.kwargs)[0] - c.output) * c.gradient).sum(-1) for c in calls]
    expected = sum(float(t.double().pow(2).sum()) for t in per_token)
    assert fisher_weighted_error(module, calls) == pytest.approx(expected, rel=1e-5) and expected > 0
    # The original's own module leaves no error.
    assert fisher_weighted_error(get_adapter(teacher).sites(teacher)[0].module, calls) == 0.0
