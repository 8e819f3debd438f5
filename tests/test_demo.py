import importlib
import json
import math

import pytest
import torch
import transformers
from rich.console import Console

import headkit.demo as demo
from headkit.errors import HeadkitError

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory, save_tiny_encoder):
    """A tiny random BERT with MiniLM's tokenizer, standing in for all-MiniLM-L6-v2."""
    return save_tiny_encoder(tmp_path_factory.mktemp("tiny_encoder"))


def _small_corpus(train_texts, held_out_texts, seed=0):
    # The real corpus reads the whole standard library; the demo's pieces only need a few distinct texts.
    words = "attention heads share query key projections mixing vectors collaborate instead of concatenate".split()
    generator = torch.Generator().manual_seed(seed)

    def text(i):
        return " ".join(
            words[j] for j in torch.randint(len(words), (6 + i % 5,), generator=generator).tolist()
        )

    return [text(i) for i in range(train_texts)], [text(1000 + i) for i in range(held_out_texts)]


TINY = dict(
    train_texts=8,
    held_out_texts=8,
    batch_size=4,
    max_length=16,
    als_iterations=3,
    recovery_steps=2,
    prune_steps=4,
    prune_finetune_steps=1,
    timing_repeats=1,
    decoder=False,
)


# The module, not the function headkit.recipes re-exports under the same name.
compress_recipe = importlib.import_module("headkit.recipes.compress")


@pytest.fixture(scope="module")
def report(tiny_encoder, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        # The demo reads its texts as the compress recipe does (prepare_encoder_text).
        patch.setattr(compress_recipe, "load_text", lambda data: None)
        patch.setattr(compress_recipe, "text_chunks", lambda corpus, a, b, seed=0: _small_corpus(a, b, seed))
        out = tmp_path_factory.mktemp("demo") / "demo"
        config = demo.DemoConfig(
            model=tiny_encoder,
            out=out,
            speed=True,
            speed_lengths=(32,),
            speed_mechanisms=("linear_causal",),
            **TINY,
        )
        return demo.run_demo(config, console=Console(quiet=True)), out


def test_full_size_swap_is_exact_and_compressions_shrink(report):
    result, _ = report
    exact, compressed, pruned = result["variants"]
    assert exact["name"] == "collaborative D̃=32"
    assert exact["mean_cosine"] > 1 - 1e-6 and exact["max_abs_diff"] < 1e-4
    assert compressed["name"].startswith("collaborative D̃=16")
    assert compressed["parameters"] < result["original"]["parameters"]
    assert pruned["name"] == "pruned to 4/8 heads"
    assert sum(pruned["details"]["heads_per_layer"].values()) == 4
    assert pruned["parameters"] < result["original"]["parameters"]
    # Half the heads gone and a few steps of training: not the original any more.
    assert pruned["max_abs_diff"] > 1e-4


def test_report_and_results_are_written_with_finite_numbers(report):
    result, out = report
    saved = json.loads((out / "results.json").read_text())
    numbers = [saved["original"]["forward_ms"], saved["seconds"]]
    for variant in saved["variants"]:
        numbers += [variant[k] for k in ("mean_cosine", "max_abs_diff", "forward_ms", "forward_ms_original")]
    assert all(math.isfinite(x) for x in numbers) and len(saved["variants"]) == 3
    assert "gate_log" not in saved["variants"][2]["details"]  # per-step gate values live in the plots
    for name in ("gates_over_training", "final_gates", "speed"):
        with open(saved["plots"][name], "rb") as plot:
            assert plot.read(4) == b"\x89PNG", name
    text = (out / "report.md").read_text()
    assert "| pruned to 4/8 heads |" in text and "## Quick kernel speed benchmark" in text
    assert "\n# " not in text.split("## Quick kernel speed benchmark")[1]  # its headings nest under ours
    assert (out / "speed" / "results.json").is_file()


def test_bad_settings_are_user_errors(tmp_path):
    with pytest.raises(HeadkitError, match="prune_steps"):
        demo.run_demo(demo.DemoConfig(out=tmp_path, prune_steps=0))
    with pytest.raises(HeadkitError, match="distill_lr"):
        demo.run_demo(demo.DemoConfig(out=tmp_path, distill_lr=0.0))


def test_cli_runs_the_tour(tiny_encoder, tmp_path, monkeypatch):
    from headkit.cli import main

    monkeypatch.setattr(compress_recipe, "load_text", lambda data: None)
    monkeypatch.setattr(
        compress_recipe, "text_chunks", lambda corpus, a, b, seed=0: _small_corpus(a, b, seed)
    )
    out = tmp_path / "cli"
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--model", str(tiny_encoder), "--no-decoder", "--threads", "1", "--out", str(out)])
        raise SystemExit(0)
    assert exit_info.value.code == 0
    saved = json.loads((out / "results.json").read_text())
    assert "speed" not in saved["plots"] and len(saved["variants"]) == 3
    assert saved["settings"]["threads"] == 1


def test_the_decoder_act_puts_pruned_and_linearized_models_side_by_side(save_tiny_causal_lm, tmp_path):
    decoder_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    config = demo.DemoConfig(
        decoder_model=decoder_dir,
        decoder_recovery_steps=1,
        decoder_transfer_steps=1,
        decoder_linearized_recovery_steps=1,
        decoder_window=16,
        decoder_held_out=2,
        decode_context=32,
        sample_tokens=3,
        seed=0,
    )
    section = demo.run_decoder_act(config, echo=lambda _line: None)
    original, pruned, linearized = section["rows"]
    assert (
        pruned["model"] == "pruned (2 of 4 heads per layer)" and pruned["parameters"] < original["parameters"]
    )
    assert pruned["cache_bytes"] == original["cache_bytes"] // 2  # one of two key/value groups left
    assert linearized["model"] == "linearized"
    assert all(row["perplexity"] > 0 and row["decode_ms_per_token"] > 0 for row in section["rows"])
    table = demo.render_decoder_table(section)
    assert table.count("\n|") >= 4 and "pruned (2 of 4 heads per layer)" in table
