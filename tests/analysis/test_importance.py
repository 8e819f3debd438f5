import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery"))
from tiny_models import tiny_inputs, tiny_model  # noqa: E402

import headkit  # noqa: E402
from headkit.analysis.importance import (  # noqa: E402
    HeadImportance,
    attention_statistics,
    gradient_importance,
    normalize_importance,
    pad_to_matrix,
)
from headkit.analysis.plots import as_layer_head_matrix, plot_gate_history, plot_head_heatmap  # noqa: E402
from headkit.errors import HeadkitError  # noqa: E402
from headkit.surgery.adapters import get_adapter, supported_architectures  # noqa: E402
from headkit.surgery.pruning import prune_heads  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _probe_loss(kind):
    """A scalar loss of the outputs that every head influences (a fixed random projection, squared)."""
    direction = torch.randn(64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def loss_fn(model, batch):
        states = model(**batch).last_hidden_state
        if "attention_mask" in batch:
            states = states * batch["attention_mask"][..., None]
        return (
            (states.flatten(1)[:, : direction.numel()] @ direction[: states.flatten(1).shape[1]]).pow(2).sum()
        )

    return loss_fn


def _loss_with_head_scaled(model, loss_fn, batch, site_index, head, scale):
    """The naive twin of the mask probe: the loss with head `head` of site `site_index` multiplied by `scale`."""
    site = get_adapter(model).sites(model)[site_index]
    column_scale = torch.ones(site.num_heads * site.head_dim, dtype=torch.float64)
    column_scale[head * site.head_dim : (head + 1) * site.head_dim] = scale
    handle = site.output_projection.register_forward_pre_hook(
        lambda module, args: (args[0] * column_scale.to(args[0].dtype), *args[1:])
    )
    try:
        with torch.no_grad():
            return float(loss_fn(model, batch))
    finally:
        handle.remove()


def _naive_importance(model, loss_fn, batches):
    """Reference: Σ_batches |∂L/∂s| for a per-column scaling s = 1 of each output projection's input, summed over
    each head's columns (∂L/∂ξ_h = Σ_{columns c of h} ∂L/∂s_c)."""
    sites = get_adapter(model).sites(model)
    totals = [torch.zeros(site.num_heads, dtype=torch.float64) for site in sites]
    for batch in batches:
        scales = [
            torch.ones(site.num_heads * site.head_dim, dtype=torch.float64, requires_grad=True)
            for site in sites
        ]
        handles = [
            site.output_projection.register_forward_pre_hook(
                lambda module, args, s=scale: (args[0] * s.to(args[0].dtype), *args[1:])
            )
            for site, scale in zip(sites, scales, strict=True)
        ]
        try:
            gradients = torch.autograd.grad(loss_fn(model, batch), scales)
        finally:
            for handle in handles:
                handle.remove()
        for site, total, gradient in zip(sites, totals, gradients, strict=True):
            total += gradient.view(site.num_heads, site.head_dim).sum(-1).abs()
    return totals


@pytest.mark.parametrize("kind", supported_architectures())
def test_gradient_importance_matches_the_naive_gradient_and_finite_differences(kind):
    """I_h = Σ_batches |∂L/∂ξ_h| at ξ = 1: against per-column gradients summed per head (float64, tight), and
    against central differences of the loss (which some models compute partly in float32: looser)."""
    model = tiny_model(kind).double()
    batches = [tiny_inputs(kind, batch=2), {k: v.flip(0) for k, v in tiny_inputs(kind, batch=2).items()}]
    if kind == "vit":
        batches = [{"pixel_values": b["pixel_values"].double()} for b in batches]
    loss_fn = _probe_loss(kind)
    raw, num_batches = gradient_importance(model, batches, loss_fn)
    assert num_batches == 2
    assert all(p.grad is None for p in model.parameters())  # only the probes were differentiated
    naive = _naive_importance(model, loss_fn, batches)
    epsilon = 1e-3
    for site in get_adapter(model).sites(model):
        scale = naive[site.index].max()
        assert scale > 0
        torch.testing.assert_close(raw[site.index].double(), naive[site.index], rtol=1e-5, atol=1e-5 * scale)
        differences = torch.zeros(site.num_heads, dtype=torch.float64)
        for batch in batches:
            for head in range(site.num_heads):
                up = _loss_with_head_scaled(model, loss_fn, batch, site.index, head, 1 + epsilon)
                down = _loss_with_head_scaled(model, loss_fn, batch, site.index, head, 1 - epsilon)
                differences[head] += abs(up - down) / (2 * epsilon)
        torch.testing.assert_close(raw[site.index].double(), differences, rtol=2e-3, atol=1e-3 * scale)


def test_normalisations_follow_michel_et_al():
    raw = [torch.tensor([3.0, 4.0, 0.0]), torch.tensor([1.0, 1.0]), torch.zeros(0)]
    layer_wise = normalize_importance(raw, normalize_layers=True, normalize_global=False)
    torch.testing.assert_close(layer_wise[0], torch.tensor([0.6, 0.8, 0.0]))
    torch.testing.assert_close(layer_wise[1], torch.tensor([1.0, 1.0]) / math.sqrt(2))
    both = normalize_importance(raw)
    flat = torch.cat(layer_wise)
    torch.testing.assert_close(torch.cat(both), (flat - flat.min()) / (flat.max() - flat.min()))
    assert both[2].numel() == 0
    global_only = normalize_importance(raw, normalize_layers=False)
    torch.testing.assert_close(global_only[0], torch.tensor([0.75, 1.0, 0.0]))
    assert torch.equal(normalize_importance(raw, normalize_layers=False, normalize_global=False)[0], raw[0])


@pytest.mark.parametrize("kind", ["bert", "headkit"])
def test_uniform_attention_has_known_confidence_and_entropy(kind):
    """With zero queries every head attends uniformly over the real keys: confidence 1/n and entropy log n,
    averaged over the real query tokens (rows of 6 and 4 real tokens)."""
    model = tiny_model(kind)
    adapter = get_adapter(model)
    with torch.no_grad():
        for site in adapter.sites(model):
            query = site.module.get_submodule(adapter.query_name)
            query.weight.zero_()
            query.bias.zero_()
    inputs = tiny_inputs(kind)
    if kind == "headkit":  # a causal decoder: query i sees i + 1 keys
        inputs = {"input_ids": inputs["input_ids"]}
    implementation = getattr(model.config, "_attn_implementation", None)
    confidence, entropy = attention_statistics(model, [inputs])
    assert getattr(model.config, "_attn_implementation", None) == implementation  # switched back after
    if kind == "bert":
        counts = [6] * 6 + [4] * 4
    else:
        counts = [i + 1 for i in range(6)] * 2
    want_confidence = sum(1 / n for n in counts) / len(counts)
    want_entropy = sum(math.log(n) for n in counts) / len(counts)
    for layer in range(2):
        torch.testing.assert_close(confidence[layer], torch.full((len(confidence[layer]),), want_confidence))
        torch.testing.assert_close(entropy[layer], torch.full((len(entropy[layer]),), want_entropy))


def test_head_importance_bundles_every_score_and_handles_pruned_layers():
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=24,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    prune_heads(model, {1: [0, 1, 2, 3], 2: [1]}, allow_empty_layers=True)
    batches = [tiny_inputs("bert") | {"labels": torch.tensor([0, 2])} for _ in range(2)]
    result = headkit.head_importance(model, batches)
    assert result.num_batches == 2 and result.layers == [(0,), (1,), (2,)]
    assert [len(v) for v in result.importance] == [4, 0, 3]
    assert [len(v) for v in result.confidence] == [4, 0, 3] == [len(v) for v in result.entropy]
    flat = torch.cat(result.importance)
    assert flat.min() == 0.0 and flat.max() == 1.0
    matrix = result.matrix("confidence")
    assert matrix.shape == (3, 4) and torch.isnan(matrix[1]).all() and torch.isnan(matrix[2, 3])
    assert ((matrix[0] >= 1 / 6 - 1e-6) & (matrix[0] <= 1)).all()
    assert ((result.matrix("entropy")[0] >= 0) & (result.matrix("entropy")[0] <= math.log(6) + 1e-6)).all()
    without_stats = headkit.head_importance(model, batches, attention_stats=False, normalize_global=False)
    assert without_stats.confidence is None
    with pytest.raises(HeadkitError, match="not computed"):
        without_stats.matrix("entropy")
    for got, raw in zip(without_stats.importance, without_stats.raw_importance, strict=True):
        if len(raw):
            torch.testing.assert_close(got, raw / raw.norm())


def test_head_importance_refuses_batches_it_cannot_use():
    model = tiny_model("bert")
    with pytest.raises(HeadkitError, match="no loss"):
        headkit.head_importance(model, [tiny_inputs("bert")])
    with pytest.raises(HeadkitError, match="mapping"):
        headkit.head_importance(model, [torch.zeros(2, 6, dtype=torch.long)])
    with pytest.raises(HeadkitError, match="at least one batch"):
        headkit.head_importance(model, [], loss_fn=lambda m, b: torch.zeros(()))
    with pytest.raises(HeadkitError, match="re-iterable"):
        headkit.head_importance(model, iter([tiny_inputs("bert")]), loss_fn=lambda m, b: torch.zeros(()))
    with pytest.raises(HeadkitError, match="scalar"):
        headkit.head_importance(model, [tiny_inputs("bert")], loss_fn=lambda m, b: m(**b).last_hidden_state)
    assert not any(site.output_projection._forward_pre_hooks for site in get_adapter(model).sites(model))


def test_pruning_plan_keeps_the_most_important_heads():
    scores = HeadImportance(
        layers=[(0,), (1,)],
        importance=[torch.tensor([0.9, 0.1, 0.5]), torch.tensor([0.2, 0.05, 0.3])],
        raw_importance=[torch.zeros(3), torch.zeros(3)],
        confidence=None,
        entropy=None,
        num_batches=1,
    )
    assert scores.pruning_plan(4) == {0: [1], 1: [1]}
    assert scores.pruning_plan(2) == {0: [1, 2], 1: [0, 1]}  # layer 1 keeps its best head
    assert scores.pruning_plan(1, allow_empty_layers=True) == {0: [1, 2], 1: [0, 1, 2]}
    assert scores.pruning_plan(6) == {}
    for bad in (1, 7, True, 2.0):
        with pytest.raises(HeadkitError, match="heads_to_keep"):
            scores.pruning_plan(bad)


def test_pad_to_matrix_and_heatmap_inputs():
    matrix = pad_to_matrix([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert matrix.shape == (2, 2) and torch.isnan(matrix[1, 1]) and matrix[1, 0] == 3.0
    from_mapping = as_layer_head_matrix({0: [1.0, 2.0], 2: [5.0]})
    assert from_mapping.shape == (3, 2) and torch.isnan(from_mapping[1]).all()
    for bad in (torch.zeros(3), [], {}, [torch.zeros(2, 2)]):
        with pytest.raises(HeadkitError):
            as_layer_head_matrix(bad)


def test_heatmaps_are_written_atomically(tmp_path, monkeypatch):
    path = plot_head_heatmap([torch.rand(4), torch.rand(2)], tmp_path / "importance.png", title="importance")
    assert path == tmp_path / "importance.png" and path.read_bytes()[:8] == PNG_MAGIC
    original = path.read_bytes()

    from matplotlib.figure import Figure

    def broken_savefig(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(RuntimeError, match="disk full"):
        plot_head_heatmap(torch.rand(2, 4), path)
    assert path.read_bytes() == original  # the previous figure is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["importance.png"]  # no temporary file left


def test_gate_history_shows_snapshots_side_by_side(tmp_path):
    from matplotlib.image import imread

    steps = list(range(10, 110, 10))
    history = [{0: [1.0, 0.5 - step / 400, 0.0], 1: [step / 100, 1.0]} for step in steps]
    wide = plot_gate_history(history, steps, tmp_path / "wide.png", snapshots=6)
    narrow = plot_gate_history(history, steps, tmp_path / "narrow.png", snapshots=2)
    assert imread(wide).shape[1] > imread(narrow).shape[1]
    with pytest.raises(HeadkitError, match="equal length"):
        plot_gate_history(history, steps[:-1], tmp_path / "bad.png")
    with pytest.raises(HeadkitError, match="snapshots"):
        plot_gate_history(history, steps, tmp_path / "bad.png", snapshots=0)
