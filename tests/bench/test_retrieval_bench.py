"""`headkit bench retrieval` on a tiny causal LM and a linearized copy: the grid's points side by side (the
original, the linearized model reconfigured per point, the compressed-cache baseline of equal bytes), results
keys, table, and the refusals."""

import json
import sys
from pathlib import Path

import pytest

import headkit
from headkit.cli import main
from headkit.surgery.linearize import linearized_modules

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_keys import assert_results_keys  # noqa: E402

TINY = [
    "--lengths", "160", "--trials", "3", "--budgets", "4", "--retrieval-head-counts", "0,1", "--observation", "8",
    "--second-turn-gap", "40", "--perplexity-length", "64", "--held-out-windows", "1", "--state-context", "200",
    "--threads", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, save_tiny_causal_lm):
    folder = save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "llama")
    model = headkit.from_pretrained(folder)
    headkit.linearize(model, window=16, sinks=2, budget=4)
    linearized = tmp_path_factory.mktemp("tiny") / "linearized"
    model.save_pretrained(linearized)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (folder / name).exists():
            (linearized / name).write_bytes((folder / name).read_bytes())
    return folder, linearized


def test_the_grid_measures_original_linearized_and_equal_bytes_baseline(tiny_pair, tmp_path, capsys):
    folder, linearized = tiny_pair
    out = tmp_path / "retrieval"
    main(
        [
            "bench",
            "retrieval",
            "--model",
            str(folder),
            "--linearized",
            str(linearized),
            *TINY,
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "retrieval heads (best 16)" in printed
    results = json.loads((out / "results.json").read_text())
    names = [point["model"] for point in results["points"]]
    assert names[0] == "original (full KV cache)"
    assert names[1:3] == ["linearized G=4 R=0", names[2]] and names[2].startswith("compressed cache G′=")
    assert names[3] == "linearized G=4 R=1" and "(equal bytes)" in names[4]
    original, *rest = results["points"]
    for linear, baseline in zip(rest[::2], rest[1::2], strict=True):
        assert baseline["state_bytes"] <= linear["state_bytes"] < original["state_bytes"]
        for point in (linear, baseline):
            assert 0 <= point["passkey_160"]["accuracy"] <= 1 and point["perplexity"] > 1
    assert (
        results["points"][3]["state_bytes"] > results["points"][1]["state_bytes"]
    )  # a retrieval head's cache
    assert len(results["retrieval_head_scores"]) == 2 and results["window"] == 16
    assert "passkey @160" in (out / "table.md").read_text()
    assert_results_keys("retrieval", results)
    # The linearized folder was only read: it reloads as it was saved.
    assert [m.budget for m in linearized_modules(headkit.from_pretrained(linearized))] == [4, 4]


def test_without_a_linearized_model_the_baseline_points_are_measured(tiny_pair, tmp_path):
    folder, _ = tiny_pair
    out = tmp_path / "retrieval"
    main(["bench", "retrieval", "--model", str(folder), *TINY, "--window", "16", "--out", str(out)])
    names = [p["model"] for p in json.loads((out / "results.json").read_text())["points"]]
    assert names == ["original (full KV cache)", "compressed cache G=4 R=0", "compressed cache G=4 R=1"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--lengths", "9000"], "at most the model's context of 256"),
        (["--linearized", "/nope"], "does not exist"),
        (["--observation", "200"], "--observation must be shorter than the shortest prompt (160 tokens)"),
    ],
)
def test_bad_settings_are_refused(tiny_pair, tmp_path, capsys, arguments, message):
    folder, _ = tiny_pair
    with pytest.raises(SystemExit) as exc:
        main(["bench", "retrieval", "--model", str(folder), *TINY, *arguments, "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and message in " ".join(capsys.readouterr().err.split())
