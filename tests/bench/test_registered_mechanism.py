"""A mechanism registered in one place (its layer and its kernel) is found by bench speed, decode, lm, digits."""

from __future__ import annotations

import json

import pytest

from headkit.bench import decode, lm
from headkit.cli import main
from headkit.layers import ATTENTION_LAYERS, LinearAttention, register_attention
from headkit.ops import KERNELS, register_kernel
from headkit.ops.registry import QKV


@pytest.fixture
def toy():
    """ "toy": linear attention under another name (so a constant-size decoding state), and a toy kernel."""

    @register_attention("toy")
    class ToyAttention(LinearAttention):
        pass

    register_kernel(
        "toy_causal",
        "cumulative sums (a toy)",
        inputs={"q": QKV, "k": QKV, "v": QKV},
        run=lambda q, k, v: ((q * k).sum(-1, keepdim=True) * v).cumsum(2),
    )
    yield
    ATTENTION_LAYERS.pop("toy")
    KERNELS.pop("toy_causal")


def test_bench_speed_times_a_registered_kernel(toy, tmp_path):
    main(["bench", "speed", "--mechanisms", "toy_causal", "--lengths", "16", "--repeats", "1"]
         + ["--out", str(tmp_path)])  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["mechanisms"]["toy_causal"]["available"]
    assert {p["mechanism"] for p in results["points"]} == {"sdpa_causal", "toy_causal"}
    assert "| toy_causal | fwd |" in (tmp_path / "table.md").read_text()


def test_bench_decode_compares_a_registered_constant_state_mechanism_by_default(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(
        decode,
        "MODEL_SIZE",
        dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
    )
    main(["bench", "decode", "--prompts", "8", "--new-tokens", "2", "--repeats", "1", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["mechanisms"] == ["softmax", "linear", "additive", "toy"]
    assert "toy" in {target["mechanism"] for target in results["targets"]}


def test_bench_lm_trains_a_registered_mechanism(toy, tmp_path):
    assert "toy" in lm.variants() and lm.variant_fields("toy", lm.LMBenchConfig()) == {
        "attention": "toy",
        "position_embedding_type": "learned",
    }
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(4):
        (corpus / f"f{index}.py").write_text("def f(x):\n    return x + 1\n" * 40)
    main(["bench", "lm", "--variants", "toy", "--steps", "2", "--seq-len", "16", "--batch-size", "2"]
         + ["--hidden-size", "16", "--layers", "1", "--heads", "2", "--eval-every", "1", "--eval-tokens", "32"]
         + ["--threads", "1", "--corpus", str(corpus), "--out", str(tmp_path / "lm")])  # fmt: skip
    results = json.loads((tmp_path / "lm" / "results.json").read_text())
    assert [v["variant"] for v in results["variants"]] == ["toy"] and results["variants"][0][
        "attention"
    ] == "toy"


def test_bench_digits_accepts_a_registered_mechanism_and_refuses_unknown_ones(toy, capsys):
    from headkit.bench import digits

    digits.build_model("toy", digits.DigitsConfig(hidden_size=8, layers=1, heads=2))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "digits", "--mechanisms", "toy,nope"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--mechanisms" in error and "'nope'" in error and "toy" in error


def test_a_mechanism_not_compared_is_accepted_by_name_but_left_out_of_the_default_runs():
    assert "hybrid" in lm.variants() and "hybrid" not in lm.VARIANTS
    assert "hybrid" not in decode.constant_state_mechanisms()  # a constant-size state, but compared=False


def test_the_fixture_unregisters_the_toy():
    assert "toy" not in lm.variants() and "toy" not in decode.constant_state_mechanisms()
    assert "toy_causal" not in KERNELS
