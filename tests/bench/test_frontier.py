"""`headkit bench frontier` on a tiny causal LM: every method's rows at the budgets they reach, bytes from the
configs within each budget, the best per budget, results keys, table, plots — and the refusals before any work."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from headkit.bench import frontier
from headkit.bench.frontier import largest_fitting
from headkit.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_keys import assert_results_keys  # noqa: E402

TINY = [
    "--budgets", "2,4", "--lengths", "160", "--trials", "2", "--retrieval-head-counts", "0,1", "--window", "16",
    "--observation", "8", "--second-turn-gap", "40", "--perplexity-lengths", "64", "--scored-tokens", "16",
    "--chunk", "4", "--held-out-windows", "1", "--calibration-windows", "2", "--group-size", "8",
    "--residual", "8", "--state-context", "200", "--threads", "1", "--speed-contexts", "48,96",
    "--decode-steps", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, save_tiny_causal_lm):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "llama")


def test_every_method_fits_its_budget_and_the_best_is_chosen_among_them(tiny, tmp_path, capsys):
    out = tmp_path / "frontier"
    main(
        [
            "bench",
            "frontier",
            "--model",
            str(tiny),
            "--methods",
            "quantized,compressed,latent",
            *TINY,
            "--out",
            str(out),
        ]
    )
    results = json.loads((out / "results.json").read_text())
    points = results["points"]
    original = points[0]
    assert original["method"] == "original" and original["fraction_inverse"] == 1
    methods = [p["method"] for p in points]
    assert methods.count("quantized") == 2  # int8, int4: one point each, whatever the budgets
    # compressed: per budget and retrieval-head count that fits (a retrieval head's whole cache is a quarter of the
    # bytes at 1/4 alone); latent: per budget it reaches
    assert methods.count("compressed") == 3 and methods.count("latent") == 2
    for point in points[1:]:
        assert point["bytes"] < original["bytes"]
        if point["budget"] is not None:
            assert point["bytes"] <= original["bytes"] / point["budget"] + 1e-6, point["label"]
        assert point["perplexity_64"] > 1 and 0 <= point["passkey_160"]["accuracy"] <= 1
    for point in points:  # time to first token and per decoded token, at each speed context
        assert point["first_token_seconds_48"] > 0 and point["decode_ms_96"] > 0, point["label"]
    int8, int4 = (p for p in points if p["method"] == "quantized")
    assert int4["bytes"] < int8["bytes"]
    halves = {p["label"][-3:]: p for p in points if p["method"] == "compressed" and p["budget"] == 2}
    # a retrieval head's full cache leaves fewer tokens to the others
    assert halves["R=1"]["records"][0]["budget"] < halves["R=0"]["records"][0]["budget"]
    for entry in results["best_per_budget"]:
        fitting = [p for p in points if p["bytes"] <= original["bytes"] / entry["budget"] + 1e-6]
        best = min(fitting, key=lambda p: p["perplexity_64"])
        assert (entry["method"], entry["label"]) == (best["method"], best["label"])
    table = (out / "table.md").read_text()
    assert "Best measured per budget" in table and "ppl @64" in table and "ms/token @96" in table
    assert (out / "perplexity.png").stat().st_size > 0 and (out / "passkey.png").stat().st_size > 0
    assert_results_keys("frontier", results)
    assert "latent R=" in capsys.readouterr().out
    # each row was saved as it was measured: a run stopped early keeps the rows it finished
    header, *lines = (out / "points.jsonl").read_text().splitlines()
    assert json.loads(header)["settings"]["budgets"] == [2, 4]  # the settings its rows were measured with
    saved = [json.loads(line) for line in lines]
    assert [(p["method"], p["label"], p["perplexity_64"]) for p in saved] == [
        (p["method"], p["label"], p["perplexity_64"]) for p in points
    ]


def test_speed_contexts_none_measures_the_quality_columns_only(tiny, tmp_path):
    out = tmp_path / "frontier"
    options = [*TINY, "--budgets", "4", "--retrieval-head-counts", "0", "--speed-contexts", "none"]
    main(["bench", "frontier", "--model", str(tiny), "--methods", "compressed", *options, "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert results["speed_contexts"] == [] and results["device"] == "cpu"
    for point in results["points"]:
        assert point["perplexity_64"] > 1 and not any(key.startswith("decode_ms") for key in point)
    assert "ms/token" not in (out / "table.md").read_text()
    # one prompt a batch answers as the default's batches do
    alone = tmp_path / "alone"
    main(["bench", "frontier", "--model", str(tiny), "--methods", "compressed", *options, "--batch-tokens", "160",
          "--out", str(alone)])  # fmt: skip
    singles = json.loads((alone / "results.json").read_text())["points"]
    for batched, single in zip(results["points"], singles, strict=True):
        assert single["passkey_160"]["correct"] == batched["passkey_160"]["correct"]
        assert single["second_turn"]["correct"] == batched["second_turn"]["correct"]


def test_a_second_turn_no_prompt_can_hold_is_left_out(tiny, tmp_path):
    """A second turn as long as the prompts: no key comes before it, so no second turn is asked (not an error)."""
    out = tmp_path / "frontier"
    options = [*TINY, "--budgets", "4", "--retrieval-head-counts", "0", "--second-turn-gap", "160"]
    main(["bench", "frontier", "--model", str(tiny), "--methods", "compressed", *options, "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert results["second_turn_trials"] == 0
    assert all(p["second_turn"] is None and p["passkey_160"]["trials"] == 2 for p in results["points"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_measured_on_cuda_agree_with_the_cpu(tiny, tmp_path):
    """--device cuda: the same rows, converted on the CPU and measured on the GPU, score as on the CPU (float32;
    the GPU's reductions in another order)."""
    options = [*TINY, "--budgets", "4", "--bits", "4", "--retrieval-head-counts", "0,1", "--speed-contexts", "48"]  # fmt: skip
    methods = ["--methods", "quantized,compressed,compressed+quantized,latent"]
    reports = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        main(
            [
                "bench",
                "frontier",
                "--model",
                str(tiny),
                *methods,
                *options,
                "--device",
                device,
                "--out",
                str(out),
            ]
        )
        reports[device] = json.loads((out / "results.json").read_text())
    cpu, cuda = (reports[d]["points"] for d in ("cpu", "cuda"))
    assert [p["label"] for p in cpu] == [p["label"] for p in cuda]
    for on_cpu, on_cuda in zip(cpu, cuda, strict=True):
        assert on_cuda["perplexity_64"] == pytest.approx(on_cpu["perplexity_64"], rel=1e-3), on_cpu["label"]
        assert on_cuda["passkey_160"]["trials"] == on_cpu["passkey_160"]["trials"]


def test_the_compressed_cache_in_fewer_bits_keeps_more_tokens_at_the_same_budget(tiny, tmp_path):
    """compressed+quantized rows: at a budget 4-bit storage alone does not fit (1/4), the compressed cache in 4
    bits keeps more tokens than in bfloat16, within the same bytes; with its window in full precision
    (--window-storages full), fewer than with it quantized, more than in bfloat16."""
    out = tmp_path / "frontier"
    options = [*TINY, "--budgets", "4", "--bits", "4", "--retrieval-head-counts", "0"]
    main(["bench", "frontier", "--model", str(tiny), "--methods", "compressed,compressed+quantized", *options,
          "--window-storages", "quantized,full", "--out", str(out)])  # fmt: skip
    points = json.loads((out / "results.json").read_text())["points"]
    assert [p["method"] for p in points] == ["original", "compressed", *["compressed+quantized"] * 2]
    original, alone, both, full_window = points
    assert full_window["label"].endswith("window bf16") and full_window["records"][1]["full_precision_window"]
    assert not both["records"][1]["full_precision_window"]
    assert full_window["bytes"] <= original["bytes"] / 4 + 1e-6
    assert both["configs"] == ["CompressedCacheConfig", "QuantizedKVConfig"] and both["label"].startswith(
        "int4 "
    )
    assert alone["bytes"] <= original["bytes"] / 4 + 1e-6 and both["bytes"] <= original["bytes"] / 4 + 1e-6

    def kept(point):
        record = point["records"][0]
        return record["sinks"] + record["window"] - 1 + record["budget"]  # the slots a head stores

    # head width 16 in groups of 8: 2 · (8 code bytes + 2 · 2 · 2 of scales and zero points) = 32 bytes a token
    # against bfloat16's 64: twice the tokens
    assert kept(both) == 2 * kept(alone)
    assert kept(alone) < kept(full_window) < kept(both)
    assert both["perplexity_64"] > 1


@pytest.fixture(scope="module")
def tiny_with_a_bpe_tokenizer(tmp_path_factory):
    """A tiny llama with SmolLM2's byte-level BPE tokenizer (what the GGUF export converts), heads 32 wide (a
    llama.cpp q8_0/q4_0 block)."""
    import transformers

    from headkit.runs.models import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("bpe") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the llamacpp extra)"
)
def test_llama_cpp_rows_keep_its_cache_at_f16_q8_0_and_q4_0(tiny_with_a_bpe_tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "frontier"
    model = str(tiny_with_a_bpe_tokenizer)
    command = ["bench", "frontier", "--model", model, "--methods", "llama.cpp", *TINY, "--out", str(out)]
    main(command)
    points = json.loads((out / "results.json").read_text())["points"]
    assert [p["label"] for p in points] == ["full KV cache", "KV f16", "KV q8_0", "KV q4_0"]
    original, f16, q8, q4 = points
    assert f16["bytes"] == original["bytes"] and q8["bytes"] == original["bytes"] * 34 / 64
    assert q4["bytes"] == original["bytes"] * 18 / 64
    # llama.cpp at f16 reads the same weights: its perplexity is headkit's float32 one within f16's rounding
    assert f16["perplexity_64"] == pytest.approx(original["perplexity_64"], rel=0.02)
    assert all(p["passkey_160"]["trials"] == 2 for p in points)
    assert all(p["decode_ms_48"] > 0 and p["first_token_seconds_96"] > 0 for p in points)

    # resumed with every row saved: nothing is measured again, and nothing is exported to measure it with
    def no_export(*args, **kwargs):
        raise AssertionError("exported the GGUF with no llama.cpp row left to measure")

    monkeypatch.setattr(frontier, "export_gguf", no_export)
    main([*command, "--resume"])
    assert json.loads((out / "results.json").read_text())["points"] == points


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--bits", "3"], "bits must be one of"),
        (["--methods", "kvpress"], "--kvpress-python"),
        (["--methods", "telepathy"], "--methods"),
        (["--scored-tokens", "64"], "--scored-tokens must be shorter"),
        (["--budgets", "1"], "--budgets"),
        (["--decode-steps", "48"], "--decode-steps must be fewer"),
        (["--fast-batch-sizes", "0"], "--fast-batch-sizes"),
        (["--fast-weights", "fp8"], "--fast-weights must be one of float32, bfloat16, int8, int4"),
        (["--speed-contexts", "1"], "--speed-contexts"),
        (["--device", "tpu"], "--device must be"),
        (["--window-storages", "bf16"], "--window-storages"),
        (
            ["--methods", "compressed", "--window-storages", "full"],
            "--window-storages full applies to the compressed+quantized rows",
        ),
    ],
)
def test_bad_options_are_refused_in_one_line_before_any_work(tiny, tmp_path, capsys, options, message):
    out = tmp_path / "frontier"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "frontier", "--model", str(tiny), *TINY, *options, "--out", str(out)])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_largest_fitting_is_the_largest_n_within_the_target():
    assert largest_fitting(lambda n: [n], lambda c: 10 + 3 * c[0], 40, 100) == 10
    assert largest_fitting(lambda n: [n], lambda c: 10 + 3 * c[0], 9, 100) is None
    assert largest_fitting(lambda n: [n], lambda c: 10 + 3 * c[0], 10**6, 100) == 100


def test_the_fast_path_times_the_rows_it_runs_and_says_which_it_skips(tiny, tmp_path, capsys):
    """--fast-batch-sizes: the original, the compressed cache and the compressed cache in 4 bits decode through
    the fixed-size step at each context and batch; a stock model's quantized cache, which it refuses, is said so."""
    out = tmp_path / "frontier"
    options = [
        *TINY,
        "--budgets",
        "4",
        "--bits",
        "4",
        "--retrieval-head-counts",
        "0",
        "--speed-contexts",
        "96",
    ]
    options += ["--fast-batch-sizes", "1,2", "--no-fast-compile"]
    main(["bench", "frontier", "--model", str(tiny), "--methods", "quantized,compressed,compressed+quantized",
          *options, "--out", str(out)])  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    timed = {p["method"]: p for p in results["points"] if "fast_decode_ms_96_b2" in p}
    assert sorted(timed) == ["compressed", "compressed+quantized", "original"]
    for point in timed.values():
        assert point["fast_decode_ms_96_b1"] > 0 and point["fast_decode_ms_96_b2"] > 0
    assert "fast path skipped" in capsys.readouterr().out  # the int4 KIVI row
    # the weights llama.cpp's rows read (an f16 GGUF): bfloat16 unless --fast-weights says otherwise
    assert results["fast_weights"] == "bfloat16"
    assert results["fast_packaged"] is False  # --no-fast-compile: the same step, eagerly
    table = (out / "table.md").read_text()
    assert "fast (bfloat16) ms/token @96 ×2" in table
    # the least bytes a step reads: the bfloat16 weights once, and each row's cache of 96 tokens
    per_row = {
        method: point["fast_read_bytes_96_b2"] - point["fast_read_bytes_96_b1"]
        for method, point in timed.items()
    }
    original = timed["original"]
    assert per_row["original"] == pytest.approx(96 * original["bytes"] / results["state_context"])
    weights = {method: point["fast_read_bytes_96_b1"] - per_row[method] for method, point in timed.items()}
    # the original's weights in every row (a converted layer adds a few numbers of its own)
    assert all(0 <= weights[method] - weights["original"] < 1e-3 * weights["original"] for method in weights)
    assert per_row["compressed+quantized"] < per_row["original"]
    assert results["read_bandwidth"] > 0 and "GB/s" in table


def test_rows_chosen_by_reconstruction_keep_the_bytes_and_ask_for_the_repetition(tiny, tmp_path):
    out = tmp_path / "frontier"
    options = [*TINY, "--budgets", "4", "--retrieval-head-counts", "0", "--speed-contexts", "none"]
    main(
        ["bench", "frontier", "--model", str(tiny), "--methods", "compressed", *options,
         "--selections", "question,reconstruction", "--out", str(out)]
    )  # fmt: skip
    points = json.loads((out / "results.json").read_text())["points"]
    question, reconstruction = (p for p in points if p["method"] == "compressed")
    assert reconstruction["label"] == question["label"] + " by reconstruction"
    assert reconstruction["bytes"] == question["bytes"]
    made = reconstruction["records"][0]
    assert made["selection"] == "reconstruction" and made["reconstruction_prompt"]
    assert question["records"][0]["selection"] == "question"
    assert reconstruction["second_turn"]["trials"] == question["second_turn"]["trials"] > 0


def _quantized_rows_only(model) -> list[str]:
    """The command of a frontier of the original and quantized storage alone, no time columns."""
    return [
        "bench",
        "frontier",
        "--model",
        str(model),
        "--methods",
        "quantized",
        *TINY,
        "--speed-contexts",
        "none",
    ]


def test_a_killed_run_resumes_with_the_rows_it_saved_and_measures_the_rest(tiny, tmp_path, capsys):
    """points.jsonl states the settings, then one row per line as measured; --resume keeps the rows a run saved
    before it was killed (here: the original and one row, a third cut mid-line) and measures only the others."""
    out = tmp_path / "frontier"
    command = _quantized_rows_only(tiny)
    main([*command, "--out", str(out)])
    progress = out / "points.jsonl"
    header, *rows = progress.read_text().splitlines()
    assert json.loads(header)["settings"]["methods"] == ["quantized"]
    assert len(rows) == 3  # original, int8, int4
    # killed while it wrote int4's row
    progress.write_text("\n".join([header, *rows[:2], rows[2][:40]]) + "\n")
    (out / "results.json").unlink()
    capsys.readouterr()
    main([*command, "--resume", "--out", str(out)])
    said = capsys.readouterr().out
    assert said.count("kept from the earlier run") == 2
    results = json.loads((out / "results.json").read_text())
    saved = [json.loads(row) for row in rows]
    # kept as saved (their seconds, not measured again); the cut row measured anew, to the same numbers
    assert results["points"][:2] == saved[:2]
    assert results["points"][2]["label"] == saved[2]["label"]
    assert results["points"][2]["perplexity_64"] == pytest.approx(saved[2]["perplexity_64"], rel=1e-6)
    # without --resume a run starts its rows anew
    main([*command, "--out", str(out)])
    assert len(progress.read_text().splitlines()) == 4


def test_a_run_resumed_with_more_rows_keeps_the_rows_both_choose(tiny, tmp_path, capsys):
    """Another choice of rows (here --bits 8, then 8 and 4) is not another setting: the original's row and int8's,
    measured the same way by both runs, are kept; only int4's is measured."""
    out = tmp_path / "frontier"
    command = _quantized_rows_only(tiny)
    main([*command, "--bits", "8", "--out", str(out)])
    first = [json.loads(row) for row in (out / "points.jsonl").read_text().splitlines()[1:]]
    assert [point["label"] for point in first] == ["full KV cache", "int8 g8 r8"]
    capsys.readouterr()
    main([*command, "--bits", "8,4", "--resume", "--out", str(out)])
    assert capsys.readouterr().out.count("kept from the earlier run") == 2
    results = json.loads((out / "results.json").read_text())
    assert results["points"][:2] == first
    assert results["points"][2]["label"].startswith("int4")
    assert len((out / "points.jsonl").read_text().splitlines()) == 4


def test_resuming_rows_measured_under_other_settings_is_refused_before_any_work(tiny, tmp_path, capsys):
    out = tmp_path / "frontier"
    command = _quantized_rows_only(tiny)
    main([*command, "--out", str(out)])
    before = (out / "points.jsonl").read_text()
    with pytest.raises(SystemExit) as exited:
        main([*command, "--seed", "1", "--resume", "--out", str(out)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--resume: the rows in" in error and "other --seed:" in error
    assert (out / "points.jsonl").read_text() == before
    # another kvpress interpreter may hold another kvpress: a setting, not a choice of rows
    with pytest.raises(SystemExit):
        main([*command, "--kvpress-python", sys.executable, "--resume", "--out", str(out)])
    assert "other --kvpress-python:" in capsys.readouterr().err
    assert (out / "points.jsonl").read_text() == before
