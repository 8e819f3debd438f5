"""``headkit bench decode``: the timed loop is greedy generation, a tiny end-to-end run, targets, argument errors."""

from __future__ import annotations

import io
import json

import pytest
import torch
from results_keys import assert_results_keys
from rich.console import Console

from headkit.bench import decode
from headkit.bench.decode import DecodeSettings, _time_decoding, evaluate_targets, run_decode_benchmark
from headkit.cli import main
from headkit.errors import HeadkitError
from headkit.models import HeadkitForCausalLM

# The default run: the softmax baseline and the registered mechanisms with a constant-size decoding state.
MECHANISMS = ("softmax", *decode.constant_state_mechanisms())
TINY_SIZE = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


@pytest.fixture
def tiny_models(monkeypatch):
    """The benchmark's models shrunk to one small layer, so an end-to-end run takes a second."""
    monkeypatch.setattr(decode, "MODEL_SIZE", TINY_SIZE)


def test_the_default_run_compares_softmax_with_linear_and_additive():
    assert MECHANISMS == ("softmax", "linear", "additive")


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_timed_loop_generates_what_greedy_generate_generates(mechanism, tiny_models):
    torch.manual_seed(0)
    model = HeadkitForCausalLM(decode.model_config(mechanism, max_positions=64)).eval()
    for parameter in model.parameters():  # sharper logits than the default init: no near-ties in the argmax
        torch.nn.init.normal_(parameter, std=0.5)
    prompt = torch.randint(0, 256, (2, 9))
    prefill_s, step_s, generated = _time_decoding(model, prompt, 6)
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=256)
    assert torch.equal(generated, expected[:, 9:])
    assert len(step_s) == 5 and prefill_s > 0 and all(s > 0 for s in step_s)


def test_a_tiny_run_writes_results_table_and_plot(tiny_models, tmp_path):
    console = Console(file=io.StringIO(), width=120)
    results = run_decode_benchmark(
        DecodeSettings(
            prompt_lengths=(8, 24), new_tokens=3, repeats=2, batch_size=2, threads=1, out=tmp_path
        ),
        console=console,
        show_progress=False,
    )
    assert {(p["mechanism"], p["prompt_length"]) for p in results["points"]} == {
        (m, n) for m in MECHANISMS for n in (8, 24)
    }
    assert_results_keys("decode", results)
    for point in results["points"]:
        assert len(point["step_s"]) == 2 * 2  # two repeats of new_tokens − 1 timed steps
        assert 0 < point["min_token_s"] <= point["median_token_s"] and point["prefill_s"] > 0
        assert point["min_token_s"] == min(point["step_s"])
    assert results["config"]["threads"] == 1 and results["config"]["batch_size"] == 2
    assert len(results["targets"]) == 4
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["points"] == results["points"]
    table = (tmp_path / "table.md").read_text()
    assert "| mechanism | P=8 | P=24 |" in table and "## Targets" in table
    assert (tmp_path / "decode.png").read_bytes()[:4] == b"\x89PNG"
    assert "wrote results.json" in console.file.getvalue()


def point(mechanism: str, prompt_length: int, seconds: float, median: float | None = None) -> dict:
    median = 2 * seconds if median is None else median
    return {
        "mechanism": mechanism,
        "prompt_length": prompt_length,
        "min_token_s": seconds,
        "median_token_s": median,
    }


def test_targets_compare_flatness_and_speedup():
    points = [
        point("softmax", 256, 0.010),
        point("softmax", 4096, 0.040),
        point("linear", 256, 0.005),
        point("linear", 4096, 0.0055, median=0.022),  # 1.1× (≤ 1.2) and 7.3× faster on the fastest steps
        point("additive", 256, 0.005),
        point("additive", 4096, 0.020),  # 4× slower at 4096, only 2× faster than softmax
    ]
    targets = {(t["mechanism"], t["kind"]): t for t in evaluate_targets(points, [256, 4096])}
    assert targets["linear", "flatness"]["measured"] == pytest.approx(1.1)
    assert targets["linear", "flatness"]["passed"] and targets["linear", "speedup"]["passed"]
    assert targets["linear", "speedup"]["measured"] == pytest.approx(0.040 / 0.0055)
    # The verdict is on the fastest steps; the median ratio is reported beside it.
    assert targets["linear", "flatness"]["measured_median"] == pytest.approx(0.022 / 0.010)
    assert targets["linear", "speedup"]["measured_median"] == pytest.approx(0.080 / 0.022)
    assert not targets["additive", "flatness"]["passed"] and not targets["additive", "speedup"]["passed"]
    # Without the baseline there is no speed-up to judge.
    without_softmax = evaluate_targets([p for p in points if p["mechanism"] != "softmax"], [256, 4096])
    assert [t["passed"] for t in without_softmax if t["kind"] == "speedup"] == [None, None]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mechanisms": ("softmax", "mamba")}, "--mechanisms: unknown mechanism.*'mamba'"),
        ({"prompt_lengths": (0,)}, "--prompts"),
        ({"new_tokens": 1}, "--new-tokens"),
        ({"batch_size": 0}, "--batch-size"),
        ({"device": "tpu"}, "--device"),
    ],
)
def test_bad_arguments_are_headkit_errors(kwargs, message, tmp_path):
    with pytest.raises(HeadkitError, match=message):
        run_decode_benchmark(DecodeSettings(out=tmp_path, **kwargs), show_progress=False)


def test_cli_reports_bad_prompt_lengths_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--prompts", "256,x"])
    assert exit_info.value.code == 2
    assert "--prompts" in capsys.readouterr().err


def test_cli_runs_the_benchmark(tiny_models, tmp_path):
    main(
        [
            "bench",
            "decode",
            "--prompts",
            "8",
            "--new-tokens",
            "2",
            "--mechanisms",
            "linear,additive",
            "--out",
            str(tmp_path),
        ]
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["mechanisms"] == ["linear", "additive"]
    assert [t["passed"] for t in results["targets"]] == [None, None, None, None]  # one length, no softmax


def test_compile_decodes_every_model_through_torch_compile(tiny_models, tmp_path, monkeypatch):
    """--compile wraps each model in torch.compile (here with dynamo's eager backend: no C++ toolchain needed),
    for decoding and for the timed training step, and reports the speed-ups over the eager models."""
    compiled = []
    real_compile = torch.compile

    def compile_eagerly(model):
        compiled.append(type(model).__name__)
        return real_compile(model, backend="eager")

    monkeypatch.setattr(decode.torch, "compile", compile_eagerly)
    results = run_decode_benchmark(
        DecodeSettings(
            prompt_lengths=(4, 8),
            new_tokens=3,
            repeats=1,
            threads=1,
            compile=True,
            out=tmp_path,
            train_batch=2,
            train_length=6,
        ),
        console=Console(file=io.StringIO()),
        show_progress=False,
    )
    assert compiled == ["HeadkitForCausalLM"] * (2 * len(MECHANISMS))  # decoding, then the training step
    assert results["config"]["compiled"] is True
    table = (tmp_path / "table.md").read_text()
    assert (
        "models under torch.compile" in table and "training step (forward + backward, 2 × 6 tokens)" in table
    )
    speedups = results["compile_speedup"]
    for kind in ("decode", "train_step"):
        assert [row["mechanism"] for row in speedups[kind]] == list(MECHANISMS)
        for row in speedups[kind]:
            assert row["eager_s"] > 0 and row["compiled_s"] > 0
            assert row["speedup"] == pytest.approx(row["eager_s"] / row["compiled_s"])
    assert all(row["prompt_length"] == 8 for row in speedups["decode"])
    assert all(row["loss_difference"] < 1e-5 for row in speedups["train_step"])


def test_smollm2_engine_targets_are_ratios_of_one_run_and_none_where_a_side_is_missing():
    from headkit.bench._engines import LLAMA_CPP, engine_targets

    points = [
        {"engine": LLAMA_CPP, "batch": 1, "context": 512, "token_s": 0.010},
        {"engine": LLAMA_CPP, "batch": 1, "context": 8192, "token_s": 0.030},
        {"engine": "linearized bfloat16", "batch": 1, "context": 512, "token_s": 0.012},
        {"engine": "linearized bfloat16", "batch": 1, "context": 8192, "token_s": 0.0126},
        {"engine": "fast int8", "batch": 1, "context": 512, "token_s": 0.025},
        {"engine": "fast int8", "batch": 8, "context": 512, "token_s": 0.001},  # another batch: not a target
    ]
    quality = {"fast float32": {"perplexity": 10.0}, "fast bfloat16": {"perplexity": 10.2}}
    targets = {t["description"].split(" (")[0]: t for t in engine_targets(points, quality, (512, 2048, 8192))}
    assert targets["linearized bfloat16 @8192 vs llama.cpp Q4_1 @8192"]["measured"] == pytest.approx(0.42)
    assert targets["linearized bfloat16 @8192 vs llama.cpp Q4_1 @8192"]["passed"] is True
    assert targets["linearized bfloat16 flat: @8192 / @512"]["measured"] == pytest.approx(1.05)
    assert targets["fast int8 @512 vs llama.cpp Q4_1 @512"]["passed"] is False  # 2.5× > 2×
    assert targets["bfloat16 held-out perplexity / float32"]["passed"] is False  # 2% > 1%
    missing = targets["int8 held-out perplexity / float32"]
    assert missing["measured"] is None and missing["passed"] is None
    assert targets["fast bfloat16 speed-up over fast float32 @512"]["passed"] is None
    first_token = [
        {"engine": "fast float32", "start": "cold", "load_s": 2.0, "ready_s": 70.0, "step": "compiled"},
        {"engine": "fast float32", "start": "warm", "load_s": 2.0, "ready_s": 1.5, "step": "loaded"},
    ]
    targets = engine_targets(points, quality, (512, 8192), first_token)
    (warm,) = [t for t in targets if "a second process" in t["description"]]
    assert warm["measured"] == 1.5 and warm["passed"] is True  # the cold start is reported, not a target


def test_a_fresh_process_compiles_cold_and_loads_warm(save_tiny_causal_lm, tmp_path):
    import shutil

    from headkit.bench._engines import fresh_process_first_token

    if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler for AOTInductor")
    model = save_tiny_causal_lm(tmp_path / "llama")
    cold = fresh_process_first_token(model, "float32", 1, tmp_path / "cache", timeout=600)
    warm = fresh_process_first_token(model, "float32", 1, tmp_path / "cache", timeout=600)
    assert cold["step"] == "compiled" and warm["step"] == "loaded", (cold, warm)
    assert warm["ready_s"] < cold["ready_s"] and warm["load_s"] > 0
    broken = fresh_process_first_token(tmp_path / "absent", "float32", 1, tmp_path / "cache")
    assert "does not exist" in broken["error"]
