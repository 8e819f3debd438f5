import json
import math

import pytest
import torch
from results_keys import assert_results_keys
from rich.console import Console
from typer.testing import CliRunner

from headkit.bench import lm
from headkit.errors import HeadkitError
from headkit.models import HeadkitForCausalLM

TINY = dict(
    steps=3,
    batch_size=2,
    seq_len=16,
    hidden_size=16,
    layers=1,
    heads=2,
    eval_every=2,
    eval_tokens=64,
    additive_window=4,
    threads=1,
)
WORDS = "def return class import self value index list dict for while if else none true".split()


@pytest.fixture
def corpus_dir(tmp_path):
    """A few dozen short documents of code-like text (held-out split by file name, like the stdlib corpus)."""
    generator = torch.Generator().manual_seed(0)
    root = tmp_path / "corpus"
    root.mkdir()
    for index in range(24):
        picks = torch.randint(0, len(WORDS) - 3, (20,), generator=generator).tolist()
        lines = [" ".join(WORDS[p : p + 4]) + ":" for p in picks]
        (root / f"module{index:02d}.py").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def tiny(tmp_path, corpus_dir, **overrides):
    return lm.LMBenchConfig(**(TINY | {"out": tmp_path / "lm", "corpus": corpus_dir} | overrides))


def test_variants_build_the_intended_configs():
    config = lm.LMBenchConfig(hidden_size=64, heads=4, layers=2, seq_len=32, additive_window=8)
    expected = {
        "softmax": dict(attention="softmax", position_embedding_type="rope"),
        "additive": dict(attention="additive", additive_window=None, convolve=False),
        "additive_window": dict(attention="additive", additive_window=8, convolve=False),
        "additive_conv": dict(attention="additive", additive_window=None, convolve=True, conv_groups=64),
        "additive_window_conv": dict(
            attention="additive", additive_window=8, convolve=True, conv_kernel_size=3
        ),
        "linear": dict(attention="linear", feature_map="elu", position_embedding_type="learned"),
        "coca": dict(attention="coca", position_embedding_type="rope"),
        "collaborative": dict(attention="collaborative", dim_shared_query_key=64),
    }
    assert tuple(expected) == lm.VARIANTS
    for variant, fields in expected.items():
        built = lm.model_config(variant, config)
        for name, value in fields.items():
            assert getattr(built, name) == value, (variant, name)
        # Everything but the attention is shared.
        assert (built.vocab_size, built.hidden_size, built.num_hidden_layers) == (259, 64, 2)
        assert (built.num_attention_heads, built.intermediate_size, built.mlp_type) == (4, 256, "gated")
        assert built.max_position_embeddings == 32 and built.layer_types is None
        rotary = variant in ("softmax", "coca")
        assert built.position_embedding_type == ("rope" if rotary else "learned"), variant
    narrow = lm.LMBenchConfig(hidden_size=64, heads=4, collaborative_dim=16)
    assert lm.model_config("collaborative", narrow).dim_shared_query_key == 16
    assert "D̃=16" in lm.describe_variant("collaborative", narrow)
    assert lm.describe_variant("additive_window_conv", config) == "additive, window 8, depthwise conv k=3"


@pytest.mark.parametrize("settings", [{}, {"quick": True}])
def test_variants_have_the_same_size_within_a_few_percent(settings):
    config = lm.LMBenchConfig.quick() if settings else lm.LMBenchConfig()
    sizes = {variant: lm.count_parameters(variant, config) for variant in lm.VARIANTS}
    # The spread comes from CoCA's half-width key projection and the learned position table (documented).
    tolerance = 1.10 if settings else 1.06
    assert max(sizes.values()) / min(sizes.values()) < tolerance, sizes
    # Counted on the meta device, yet the same as a real model's.
    torch.manual_seed(0)
    real = HeadkitForCausalLM(lm.model_config("additive_conv", config))
    assert sizes["additive_conv"] == sum(p.numel() for p in real.parameters())
    assert (
        sizes["additive_conv"] - sizes["additive"]
        == config.layers * config.conv_kernel_size * config.hidden_size
    )


def test_every_variant_sees_the_same_batches_in_the_same_order(tmp_path, corpus_dir, monkeypatch):
    import headkit.train

    seen: list[torch.Tensor] = []
    original = headkit.train.sample_batch

    def recording_sample_batch(*args, **kwargs):
        batch = original(*args, **kwargs)
        seen.append(batch.clone())
        return batch

    monkeypatch.setattr(headkit.train, "sample_batch", recording_sample_batch)
    config = tiny(tmp_path, corpus_dir, variants=("softmax", "additive_window_conv", "coca"))
    lm.run_lm_benchmark(config, console=Console(quiet=True))
    assert len(seen) == 3 * config.steps
    per_variant = [torch.stack(seen[i : i + config.steps]) for i in range(0, len(seen), config.steps)]
    assert all(torch.equal(per_variant[0], batches) for batches in per_variant[1:])


def test_curves_are_recorded_at_the_promised_steps_with_increasing_seconds(tmp_path, corpus_dir):
    config = tiny(tmp_path, corpus_dir, variants=("linear", "collaborative"), steps=7, eval_every=3)
    report = lm.run_lm_benchmark(config, console=Console(quiet=True))
    assert [result["variant"] for result in report["variants"]] == ["linear", "collaborative"]
    for result in report["variants"]:
        curve = result["curve"]
        assert [point["step"] for point in curve] == [0, 3, 6, 7]
        seconds = [point["train_seconds"] for point in curve]
        assert seconds[0] == 0.0 and all(a < b for a, b in zip(seconds, seconds[1:], strict=False))
        assert seconds[-1] == pytest.approx(result["train_seconds"])
        assert curve[0]["bits_per_byte"] == result["initial_bits_per_byte"]
        assert curve[-1]["bits_per_byte"] == result["final_bits_per_byte"]
        # An untrained byte model is near uniform over 259 tokens; the median step is below the total.
        assert abs(curve[0]["bits_per_byte"] - math.log2(259)) < 0.5
        assert 0 < result["median_step_ms"] / 1000 <= result["train_seconds"]
        assert len(result["losses"]) == 7


def test_tiny_run_writes_finite_results_table_and_plot(tmp_path, corpus_dir):
    config = tiny(tmp_path, corpus_dir, variants=("softmax", "additive"))
    report = lm.run_lm_benchmark(config, console=Console(quiet=True))
    out = tmp_path / "lm"
    assert_results_keys("lm", report)
    saved = json.loads((out / "results.json").read_text())
    assert saved["variants"] == report["variants"]
    assert saved["settings"]["steps"] == 3 and saved["settings"]["variants"] == ["softmax", "additive"]
    assert saved["positions"] == {"rope": ["softmax"], "learned": ["additive"]}
    assert {"cpu_model", "torch_threads"} <= set(saved["machine"])
    for result in saved["variants"]:
        numbers = [
            result["median_step_ms"],
            result["train_seconds"],
            result["final_bits_per_byte"],
            *(point["bits_per_byte"] for point in result["curve"]),
        ]
        assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in numbers)
        assert result["parameters"] > 0
    table = (out / "table.md").read_text()
    rows = [
        line for line in table.splitlines() if line.startswith("| softmax") or line.startswith("| additive")
    ]
    assert [row.split("|")[1].strip() for row in rows] == ["softmax", "additive"]
    assert f"{saved['variants'][1]['final_bits_per_byte']:.3f}" in rows[1]
    assert (out / lm.PLOT_FILE).read_bytes()[:4] == b"\x89PNG"


def test_a_diverged_variant_is_kept_as_null():
    assert lm._finite_or_none(float("nan")) is None and lm._finite_or_none(2.5) == 2.5
    report = {
        "settings": {
            "hidden_size": 16,
            "layers": 1,
            "heads": 2,
            "steps": 3,
            "batch_size": 2,
            "seq_len": 16,
            "lr": 1e-3,
            "seed": 0,
            "eval_tokens": 64,
        },
        "machine": {"cpu_model": "cpu", "torch_threads": 1, "torch_version": "x"},
        "corpus": {"train_bytes": 1, "held_out_bytes": 1},
        "variants": [
            {
                "variant": "linear",
                "description": "linear",
                "position_embedding_type": "learned",
                "parameters": 10,
                "median_step_ms": 1.0,
                "train_seconds": 0.1,
                "final_bits_per_byte": None,
                "curve": [{"step": 0, "train_seconds": 0.0, "bits_per_byte": None}],
            }
        ],
    }
    assert "| diverged |" in lm.render_markdown(report)
    assert lm.plot_curves(report) is not None


@pytest.mark.parametrize(
    "overrides, option",
    [
        ({"variants": ("softmax", "fastformer")}, "--variants"),
        ({"variants": ()}, "--variants"),
        ({"variants": ("linear", "linear")}, "--variants"),
        ({"steps": 0}, "--steps"),
        ({"seq_len": 1}, "--seq-len"),
        ({"eval_every": -1}, "--eval-every"),
        ({"hidden_size": 15}, "--hidden-size"),
        ({"hidden_size": 18, "heads": 3}, "--hidden-size"),  # head_dim 6 is fine, odd head_dim is not
        ({"lr": 0.0}, "--lr"),
        ({"collaborative_dim": 0}, "--collaborative-dim"),
        ({"corpus": "/no/such/corpus"}, "--corpus"),
    ],
)
def test_bad_settings_raise_before_any_work(tmp_path, corpus_dir, monkeypatch, overrides, option):
    import headkit.data

    def never(*args, **kwargs):
        raise AssertionError("the corpus was loaded before the settings were checked")

    monkeypatch.setattr(headkit.data, "load_corpus", never)
    if overrides == {"hidden_size": 18, "heads": 3}:
        lm.check_settings(tiny(tmp_path, corpus_dir, **overrides))  # head_dim 6: even, accepted
        overrides = {"hidden_size": 15, "heads": 3}  # head_dim 5: odd, refused (rotary pairs)
    with pytest.raises(HeadkitError, match=option):
        lm.run_lm_benchmark(tiny(tmp_path, corpus_dir, **overrides), console=Console(quiet=True))
    assert not (tmp_path / "lm").exists()


def test_cli_runs_the_benchmark(tmp_path, corpus_dir):
    from headkit.app import app

    out = tmp_path / "cli"
    arguments = ["bench", "lm", "--variants", "softmax, additive_window", "--steps", "2", "--seq-len", "16"]
    arguments += [
        "--batch-size",
        "2",
        "--hidden-size",
        "16",
        "--layers",
        "1",
        "--heads",
        "2",
        "--eval-every",
        "1",
    ]
    arguments += [
        "--eval-tokens",
        "64",
        "--additive-window",
        "4",
        "--threads",
        "1",
        "--corpus",
        str(corpus_dir),
    ]
    result = CliRunner().invoke(app, [*arguments, "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["variants"] == ["softmax", "additive_window"]
    assert saved["settings"]["additive_window"] == 4 and saved["settings"]["seq_len"] == 16
    assert [point["step"] for point in saved["variants"][1]["curve"]] == [0, 1, 2]
    assert (out / "table.md").is_file() and (out / lm.PLOT_FILE).is_file()


@pytest.mark.parametrize(
    "arguments, option",
    [
        (["--variants", "softmax,nope"], "--variants"),
        (["--variants", ","], "--variants"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_cli_bad_options_exit_2_naming_the_option(tmp_path, capsys, arguments, option):
    from headkit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "lm", "--quick", *arguments, "--out", str(tmp_path / "never")])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
