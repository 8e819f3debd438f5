from __future__ import annotations

import json

import pytest
import torch
from results_keys import assert_results_keys
from rich.console import Console

from headkit.bench.decompose import DecomposeSettings, load_query_key_weights, run_decompose_benchmark
from headkit.errors import HeadkitError

QUIET = Console(quiet=True)

HEADS, HEAD_DIM, HIDDEN, LAYERS = 4, 4, 16, 2


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A BERT-style folder: two layers of random query/key/value weights and an embedding to skip."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("tiny_checkpoint")
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"encoder.layer.{layer}.attention.self.{name}.weight": torch.randn(
            HEADS * HEAD_DIM, HIDDEN, generator=generator
        )
        for layer in range(LAYERS)
        for name in ("query", "key", "value")
    }
    tensors["embeddings.word_embeddings.weight"] = torch.randn(10, HIDDEN, generator=generator)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": HEADS, "hidden_size": HIDDEN}))
    return folder


def test_loader_finds_every_layers_query_and_key(tiny_checkpoint):
    heads, weights = load_query_key_weights(tiny_checkpoint)
    assert heads == HEADS and sorted(weights) == list(range(LAYERS))
    from safetensors.torch import load_file

    stored = load_file(str(tiny_checkpoint / "model.safetensors"))
    for layer, (w_q, w_k) in weights.items():
        assert torch.equal(w_q, stored[f"encoder.layer.{layer}.attention.self.query.weight"])
        assert torch.equal(w_k, stored[f"encoder.layer.{layer}.attention.self.key.weight"])


def test_benchmark_writes_consistent_results(tiny_checkpoint, tmp_path):
    pytest.importorskip("tensorly")
    dims = [2, 6, HEADS * HEAD_DIM]
    settings = DecomposeSettings(model=tiny_checkpoint, dims=tuple(dims), max_iter=5, out=tmp_path)
    results = run_decompose_benchmark(settings, console=QUIET)
    assert_results_keys("decompose", results)

    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert (tmp_path / "decompose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {dim} |" in table for dim in dims)

    points = results["points"]
    assert len(points) == LAYERS * len(dims) * 2
    assert {(p["layer"], p["dim"], p["method"]) for p in points} == {
        (layer, dim, method) for layer in range(LAYERS) for dim in dims for method in ("headkit", "tensorly")
    }
    for point in points:
        assert 0 <= point["relative_error"] <= 1 and point["seconds"] >= 0
        if point["method"] == "headkit" and point["dim"] == HEADS * HEAD_DIM:
            assert point["relative_error"] < 1e-6 and point["start"] == "exact"  # the exact path
    for row in results["summary"]:
        for method in ("headkit", "tensorly"):
            errors = [p["relative_error"] for p in points if p["dim"] == row["dim"] and p["method"] == method]
            assert row[f"{method}_error"] == pytest.approx(sum(errors) / len(errors))
    # More shared width can only help headkit here: every layer's error falls from D̃ = 2 to D̃ = 6.
    headkit = {(p["layer"], p["dim"]): p["relative_error"] for p in points if p["method"] == "headkit"}
    assert all(headkit[(layer, 6)] < headkit[(layer, 2)] for layer in range(LAYERS))


def test_quick_mode_and_headkit_only(tiny_checkpoint, tmp_path):
    threads_before = torch.get_num_threads()
    settings = DecomposeSettings.quick(model=tiny_checkpoint, include_tensorly=False, threads=1, out=tmp_path)
    results = run_decompose_benchmark(settings, console=QUIET)
    assert torch.get_num_threads() == threads_before
    config = results["config"]
    assert config["threads"] == 1 and results["machine"]["torch_threads"] == 1
    # Quick: layer 0 and 10 sweeps; its widths (64, 384) exceed heads·head_dim = 16, leaving the full one.
    assert config["layers"] == [0] and config["max_iter"] == 10 and config["dims"] == [HEADS * HEAD_DIM]
    assert [p["method"] for p in results["points"]] == ["headkit"]
    assert results["summary"][0]["tensorly_error"] is None and "—" in (tmp_path / "table.md").read_text()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": (5,)}, r"layers \[5\] are not in the checkpoint"),
        ({"dims": ()}, r"--dims must be one or more integers ≥ 1"),
        ({"dims": (0,)}, r"--dims must be one or more integers ≥ 1"),
        ({"max_iter": 0}, r"--max-iter must be a positive integer"),
        ({"threads": 0}, r"threads must be a positive integer"),
    ],
)
def test_bad_settings_raise(tiny_checkpoint, tmp_path, kwargs, match):
    with pytest.raises(HeadkitError, match=match):
        settings = DecomposeSettings(model=tiny_checkpoint, include_tensorly=False, out=tmp_path, **kwargs)
        run_decompose_benchmark(settings, console=QUIET)
    assert not (tmp_path / "results.json").exists()


def test_folder_without_a_checkpoint_raises(tmp_path):
    with pytest.raises(HeadkitError, match="config.json and model.safetensors"):
        run_decompose_benchmark(DecomposeSettings(model=tmp_path, out=tmp_path / "out"), console=QUIET)
