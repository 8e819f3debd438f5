import json
import subprocess
import sys

import pytest
import torch
import transformers

import headkit
from headkit.cli import main
from headkit.errors import HeadkitError
from headkit.recipes.prune_plan import heads_to_keep, plan_pruning

transformers.logging.set_verbosity_error()

# Tiny settings: a few windows of 16 tokens from a small folder of text.
FAST = ["--quick", "--window", "16", "--train-texts", "16", "--batch-size", "4", "--recovery-steps", "3"]


def _run(args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    return exit_info.value.code


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


# -- choosing heads --------------------------------------------------------------------------------------------


KV = [[0, 0, 1, 1], [0, 0, 1, 1]]  # two layers, 4 query heads over 2 key/value heads


def test_query_plan_keeps_the_top_heads_over_all_layers():
    scores = [torch.tensor([0.9, 0.1, 0.5, 0.2]), torch.tensor([0.3, 0.8, 0.05, 0.7])]
    assert plan_pruning(scores, KV, 4) == {0: [1, 3], 1: [0, 2]}


def test_uniform_query_plan_keeps_as_many_heads_in_every_group():
    scores = [torch.tensor([0.9, 0.8, 0.5, 0.2]), torch.tensor([0.3, 0.8, 0.05, 0.7])]
    assert plan_pruning(scores, KV, 4, uniform=True) == {0: [1, 3], 1: [0, 2]}


def test_group_plans_remove_whole_key_value_groups():
    scores = [torch.tensor([0.9, 0.8, 0.5, 0.2]), torch.tensor([0.3, 0.1, 0.9, 0.7])]
    assert plan_pruning(scores, KV, 4, unit="group", uniform=True) == {0: [2, 3], 1: [0, 1]}
    assert plan_pruning(scores, KV, 4, unit="group") == {0: [2, 3], 1: [0, 1]}
    assert plan_pruning(scores, KV, 6, unit="group") == {1: [0, 1]}


def test_the_refit_method_prunes_and_repairs(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "refit"
    args = ["prune", str(tiny_llama), "--data", str(text_folder), *FAST, "--recovery-steps", "0"]
    uniform = [*args, "--heads", "4", "--unit", "group", "--uniform"]
    assert _run([*uniform, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["selection"]["method"] == "refit"  # the default with the repair
    assert report["selection"]["weighting"] == "loss"
    assert report["repair"]["perplexity"] <= report["perplexity_pruned"]
    for name, extra, method in (
        ("sliced", [*uniform, "--no-repair"], "importance"),
        ("uneven", [*args, "--heads", "5"], "refit"),  # the loss-weighted scores set the counts too
        ("uneven-importance", [*args, "--heads", "5", "--method", "importance"], "importance"),
    ):
        assert _run([*extra, "--out", str(tmp_path / name)]) == 0
        assert json.loads((tmp_path / name / "report.json").read_text())["selection"]["method"] == method


@pytest.mark.parametrize(
    "keep, options, match",
    [
        (0, {}, "--heads must be in"),
        (9, {}, "--heads must be in"),
        (3, {"uniform": True}, "same number in each"),
        (2, {"uniform": True}, "spread evenly"),
        (3, {"unit": "group"}, "whole number of key/value groups"),
        (6, {"unit": "group", "uniform": True}, "whole number of key/value groups"),
        (4, {"unit": "layer"}, "unit must be one of"),
    ],
)
def test_bad_counts_are_refused(keep, options, match):
    with pytest.raises(HeadkitError, match=match):
        plan_pruning([torch.rand(4), torch.rand(4)], KV, keep, **options)


def test_uniform_query_pruning_of_multi_head_attention_points_to_whole_groups():
    one_head_per_group = [[0, 1, 2, 3], [0, 1, 2, 3]]  # GPT-2/BERT: every query head its own key/value head
    with pytest.raises(HeadkitError, match="its own key/value head .* pass --unit group"):
        plan_pruning([torch.rand(4), torch.rand(4)], one_head_per_group, 4, uniform=True)
    assert plan_pruning([torch.rand(4), torch.rand(4)], one_head_per_group, 4, unit="group", uniform=True)


# -- the recipe on causal LMs ----------------------------------------------------------------------------------


def test_group_uniform_pruning_gives_a_stock_model_that_loads_without_headkit(
    tiny_llama, text_folder, tmp_path
):
    out = tmp_path / "pruned"
    code = _run(
        ["prune", str(tiny_llama), "--heads", "4", "--unit", "group", "--uniform", "--data", str(text_folder)]
        + ["--out", str(out), *FAST]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "headkit_surgery" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 8)
    assert report["stock_architecture"] and report["kv_cache_bytes_per_token_after"] == pytest.approx(
        report["kv_cache_bytes_per_token_before"] / 2
    )
    assert report["reload_max_abs_diff"] == 0.0
    for key in ("perplexity_original", "perplexity_pruned", "perplexity_recovered", "top1_agreement"):
        assert report[key] > 0
    assert report["recovery"]["steps"] == 3 and len(report["recovery"]["losses"]) == 3

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    torch.save({"ids": ids, "logits": _logits(model, ids)}, tmp_path / "expected.pt")
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 11)
    # A Python in which headkit cannot be imported loads the folder with plain transformers, same logits.
    script = f"""
import sys, importlib.abc
class NoHeadkit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "headkit" or name.startswith("headkit."):
            raise ImportError("headkit is not importable here")
sys.meta_path.insert(0, NoHeadkit())
import torch, transformers
torch.set_num_threads(1)  # as the test process: the same reduction order
try:
    import headkit
except ImportError:
    pass
else:
    raise SystemExit("headkit was importable")
expected = torch.load({str(tmp_path / "expected.pt")!r})
model = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})
assert type(model).__name__ == "LlamaForCausalLM"
with torch.no_grad():
    assert torch.allclose(model(input_ids=expected["ids"]).logits, expected["logits"], atol=1e-6, rtol=0)
print("stock ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "stock ok" in result.stdout


def test_uneven_query_pruning_with_lora_recovery_reloads_with_headkit(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "pruned"
    args = ["prune", str(tiny_llama), "--heads", "5", "--lora-rank", "2", "--data", str(text_folder)]
    assert _run([*args, "--out", str(out), *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert sum(report["heads_after"].values()) == 5 and not report["stock_architecture"]
    model = headkit.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged before saving
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 10)
    assert report["reload_max_abs_diff"] == 0.0


@pytest.mark.parametrize(("given", "echoed", "embedding_trained"), [([], "(LoRA rank 16)", False), (["--lora-rank", "0"], "(every weight)", True)])  # fmt: skip
def test_a_causal_lm_recovers_through_lora_by_default_and_lora_rank_0_trains_every_weight(
    given, echoed, embedding_trained, tiny_llama, text_folder, tmp_path, capsys
):
    """LoRA adapts the linear layers only (merged after): the embedding stays the original's unless every weight
    trains."""
    from headkit.recipes.prune_settings import PruneSettings, recovery_lora_rank, recovery_lr
    from headkit.runs.models import CAUSAL_LM, ENCODER

    assert [recovery_lora_rank(PruneSettings(lora_rank=r), CAUSAL_LM) for r in (None, 0, 4)] == [16, None, 4]
    assert [recovery_lora_rank(PruneSettings(lora_rank=r), ENCODER) for r in (None, 0, 4)] == [None, None, 4]
    assert (recovery_lr(PruneSettings(), CAUSAL_LM), recovery_lr(PruneSettings(), ENCODER)) == (1e-3, 1e-4)
    out = tmp_path / "pruned"
    args = ["prune", str(tiny_llama), "--heads", "5", "--data", str(text_folder), *given]
    assert _run([*args, "--out", str(out), *FAST]) == 0
    assert f"recovery: 3 distillation steps {echoed}" in capsys.readouterr().out
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).get_input_embeddings().weight
    pruned = headkit.from_pretrained(out).get_input_embeddings().weight
    assert torch.equal(original, pruned) is not embedding_trained


def test_l0_gates_select_heads_of_a_gpt2_language_model(tiny_gpt2, text_folder, tmp_path):
    out = tmp_path / "pruned"
    args = [
        "prune",
        str(tiny_gpt2),
        "--heads",
        "4",
        "--method",
        "l0",
        "--steps",
        "4",
        "--data",
        str(text_folder),
    ]
    assert _run([*args, "--out", str(out), *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["selection"]["method"] == "l0" and sum(report["heads_after"].values()) == 4
    model = headkit.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.lm_head.weight.shape[0] > 0
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--heads", "0"], "--heads must be in"),
        (["--heads", "3", "--unit", "group"], "whole number of key/value groups"),
        (["--heads", "6", "--unit", "group", "--uniform"], "whole number of key/value groups"),
        (["--unit", "layer"], "unit must be one of query, group"),
    ],
)
def test_bad_options_fail_before_any_work(tiny_llama, text_folder, tmp_path, capsys, extra, match):
    existing = tmp_path / "out"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    args = ["prune", str(tiny_llama), "--data", str(text_folder), "--out", str(existing), "--overwrite"]
    assert _run([*args, *extra, *FAST]) == 2
    assert match in capsys.readouterr().err
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_bad_inputs_name_the_problem(tiny_llama, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(["prune", str(tiny_llama), "--data", str(empty), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "--data" in capsys.readouterr().err
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"GGUF not really")
    assert _run(["prune", str(fake), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err  # checked before its tokenizer is read
    t5 = tmp_path / "t5"
    transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2)
    ).save_pretrained(t5)
    assert _run(["prune", str(t5), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "supported" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_default_settings_are_valid():
    from headkit.recipes.prune import PruneSettings
    from headkit.recipes.prune_settings import check_settings

    check_settings(PruneSettings())  # held-out count and LoRA rank default to "not set"
    check_settings(PruneSettings.quick())
    with pytest.raises(HeadkitError, match="--held-out"):
        check_settings(PruneSettings(held_out_texts=0))
    with pytest.raises(HeadkitError, match="--steps"):
        check_settings(PruneSettings(gate_steps=-1))


def test_stock_conversion_refuses_head_counts_the_config_rejects():
    from headkit.surgery.pruning import prune_heads, to_stock_architecture

    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
    )
    model = transformers.LlamaForCausalLM(config)
    prune_heads(model, {0: [3]})  # 3 heads left, and LlamaConfig wants hidden_size (32) % heads == 0
    before = model.config.to_dict()
    with pytest.raises(HeadkitError, match="refuses"):
        to_stock_architecture(model)
    assert model.config.to_dict() == before  # untouched


def test_held_out_defaults_to_the_model_kinds_count_and_the_corpus_provides_it():
    """Without --held-out, encoders measure on 256 texts and causal LMs on 64 windows (a full-budget run once
    crashed comparing the unset count); the embedded corpus has the held-out texts an encoder run asks for."""
    from headkit.recipes.prune import PruneSettings
    from headkit.recipes.prune_settings import held_out_count
    from headkit.runs.models import CAUSAL_LM, ENCODER
    from headkit.runs.text import load_text, text_chunks

    assert held_out_count(PruneSettings(), ENCODER) == 256
    assert held_out_count(PruneSettings(), CAUSAL_LM) == 64
    assert held_out_count(PruneSettings(held_out_texts=5), ENCODER) == 5
    train, held_out = text_chunks(load_text(None), 16, held_out_count(PruneSettings(), ENCODER))
    assert len(train) == 16 and len(held_out) == 256 and not set(train) & set(held_out)


def test_a_model_changed_by_other_surgery_is_refused_before_any_work(
    tiny_gpt2, text_folder, tmp_path, capsys
):
    import shutil

    from headkit.surgery.collaborative import swap_to_collaborative

    swapped = tmp_path / "collaborative"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    swap_to_collaborative(model, dim_shared_query_key=8, max_iter=3)
    model.save_pretrained(swapped)
    for tokenizer_file in tiny_gpt2.iterdir():
        if "token" in tokenizer_file.name or tokenizer_file.suffix in (".txt", ".model"):
            shutil.copy(tokenizer_file, swapped / tokenizer_file.name)
    out = tmp_path / "out"
    assert _run(["prune", str(swapped), "--data", str(text_folder), "--out", str(out), *FAST]) == 2
    assert "prune before other surgery" in capsys.readouterr().err
    assert not out.exists()


def test_an_out_folder_under_a_file_is_refused_before_any_work(tiny_llama, text_folder, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    out = a_file / "sub"
    assert _run(["prune", str(tiny_llama), "--data", str(text_folder), "--out", str(out), *FAST]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert a_file.read_text() == "mine"


def test_the_report_of_a_model_without_a_kv_cache_prints():
    from headkit.recipes.prune_report import format_report

    report = {
        "heads_before": {0: 4},
        "heads_after": {0: 2},
        "parameters_before": 100,
        "parameters_after": 90,
        "kind": "causal_lm",
        "perplexity_original": 2.0,
        "perplexity_pruned": 3.0,
        "perplexity_recovered": 2.5,
        "speed": {"prefill_tokens": 16, "prefill_ratio": 0.9, "decode_context": 64, "decode_ratio": 0.95},
        "kv_cache_bytes_per_token_before": 0.0,
        "kv_cache_bytes_per_token_after": 0.0,
        "top1_agreement": 0.5,
        "stock_architecture": False,
        "sample_original": "a",
        "sample_recovered": "b",
    }
    assert "recurrent state, no KV cache" in format_report(report)


def test_a_held_out_count_below_the_batch_size_is_named(save_tiny_encoder, text_folder, tmp_path, capsys):
    encoder = save_tiny_encoder(tmp_path / "encoder")
    out = tmp_path / "out"
    args = ["prune", str(encoder), "--data", str(text_folder), "--out", str(out), "--quick"]
    assert _run([*args, "--train-texts", "8", "--held-out", "1", "--batch-size", "4"]) == 2
    assert "--held-out or --train-texts" in capsys.readouterr().err
    assert not out.exists()


def test_heads_to_keep_follows_the_unit():
    heads, kv = dict.fromkeys(range(30), 9), dict.fromkeys(range(30), 3)
    assert heads_to_keep(heads, kv, "query", 0.25, False) == 202
    assert heads_to_keep(heads, kv, "group", 1 / 3, True) == 180
    assert heads_to_keep(heads, kv, "query", 1 / 3, True) == 180


def test_the_repair_refits_the_output_projections_before_recovery_and_keeps_a_stock_model(
    tiny_llama, text_folder, tmp_path
):
    common = ["--data", str(text_folder), "--unit", "group", "--uniform", "--heads", "4", *FAST]
    common += ["--recovery-steps", "0", "--method", "importance"]  # the same heads: only the repair differs
    repaired, sliced = tmp_path / "repaired", tmp_path / "sliced"
    assert _run(["prune", str(tiny_llama), "--out", str(repaired), *common]) == 0
    assert _run(["prune", str(tiny_llama), "--no-repair", "--out", str(sliced), *common]) == 0
    with_repair = json.loads((repaired / "report.json").read_text())
    without = json.loads((sliced / "report.json").read_text())
    assert without["repair"] is None
    repair = with_repair["repair"]
    assert repair["layers"] == [0, 1] and repair["tokens"] > 0 and repair["seconds"] >= 0
    assert all(r <= s for r, s in zip(repair["error_refit"], repair["error_sliced"], strict=True))
    # the same heads were removed; only the output projections differ, and the result is still stock
    assert with_repair["pruned"] == without["pruned"]
    assert with_repair["perplexity_pruned"] == without["perplexity_pruned"]
    assert with_repair["stock_architecture"] and with_repair["reload_max_abs_diff"] == 0.0
    assert with_repair["perplexity_recovered"] == repair["perplexity"]  # no recovery step: the repaired model
    from safetensors.torch import load_file

    first, second = load_file(repaired / "model.safetensors"), load_file(sliced / "model.safetensors")
    changed = {name for name in first if not torch.equal(first[name], second[name])}
    assert changed and all("o_proj" in name for name in changed)


def test_an_encoders_pruned_layers_are_refit_on_its_own_inputs_before_recovery(save_tiny_encoder, tmp_path):
    encoder = save_tiny_encoder(tmp_path / "encoder")
    # The embedded corpus: the text folder is too short for an encoder's held-out texts.
    common = ["prune", str(encoder), "--heads", "4", "--steps", "4", *FAST]
    common += ["--recovery-steps", "0", "--train-texts", "16", "--held-out", "8"]
    repaired, plain = tmp_path / "repaired", tmp_path / "plain"
    assert _run([*common, "--out", str(repaired)]) == 0
    assert _run([*common, "--no-repair", "--out", str(plain)]) == 0
    report, without = (json.loads((path / "report.json").read_text()) for path in (repaired, plain))
    assert without["repair"] is None
    repair = report["repair"]
    assert repair["layers"] and repair["tokens"] > 0
    assert all(r <= s for r, s in zip(repair["error_refit"], repair["error_sliced"], strict=True))
    # Kept only where it helps the held-out texts; either way the report says which.
    if "skipped" in repair:
        assert report["fidelity_mean_cosine"] == pytest.approx(without["fidelity_mean_cosine"])
    else:
        assert repair["fidelity_mean_cosine"] >= report["fidelity_mean_cosine_pruned"]
        assert report["fidelity_mean_cosine"] == pytest.approx(repair["fidelity_mean_cosine"])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method", "magnitude", "--method must be one of importance, l0, refit, got 'magnitude'"),
        ("window", 1, "--window must be an integer ≥ 2, got 1"),
        ("gate_steps", -1, "--steps must be a non-negative integer, got -1"),
        ("held_out_texts", 0, "--held-out must be a positive integer, got 0"),
        ("max_memory", 0.0, "--max-memory must be a positive number, got 0.0"),
        ("temperature", 0.0, "--temperature must be a positive number"),
        ("lr", -1e-3, "--lr must be a number ≥ 0.0"),
    ],
)
def test_the_library_checks_prune_settings_as_their_fields_declare(field, value, message):
    from headkit.errors import HeadkitError
    from headkit.recipes.prune_settings import PruneSettings, check_settings

    with pytest.raises(HeadkitError, match=message):
        check_settings(PruneSettings(**{field: value}))
