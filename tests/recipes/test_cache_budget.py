"""`headkit compress --kv-budget`: the configuration chosen from the 🤗 config for a budget (8-bit, then 4-bit
storage, then the compressed cache, in bfloat16, 8 or 4 bits — its window in full precision where the budget
still holds it as large —, that keeps the most tokens), refused before any weight where nothing fits; the run
applies it, measures it, and saves a folder that headkit.from_pretrained reloads with the same logits."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig

import headkit
from headkit.cli import main
from headkit.compat import output_cache
from headkit.errors import HeadkitError
from headkit.recipes.cache_budget import cache_plan, default_retrieval_heads, parse_fraction
from headkit.surgery import CompressedCacheConfig, QuantizedKVConfig, bytes_per_token
from headkit.surgery.reconstruction import repetition_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery"))
from family_models import save_family_model  # noqa: E402

CONFIG = LlamaConfig(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, vocab_size=128, max_position_embeddings=8192,
)  # fmt: skip


def test_fractions_are_read_and_bad_ones_refused_naming_the_option():
    assert parse_fraction("1/8") == 0.125 and parse_fraction("0.5") == 0.5 and parse_fraction(1) == 1.0
    for bad in ("0", "3/2", "x", "1/0", "-1/4"):
        with pytest.raises(HeadkitError, match=r"--kv-budget must be a fraction in \(0, 1\]"):
            parse_fraction(bad)


def test_the_plan_is_8_bits_then_4_bits_then_the_compressed_cache_keeping_the_most_tokens():
    original = bytes_per_token(CONFIG, context=8192)
    plan = cache_plan(CONFIG, 0.6, 8192)
    assert plan.configs == (QuantizedKVConfig(bits=8),) and plan.bytes_per_token <= 0.6 * original
    plan = cache_plan(CONFIG, 0.4, 8192)
    assert plan.configs == (QuantizedKVConfig(bits=4),) and plan.bytes_per_token <= 0.4 * original
    # 1/8: 4 bits alone do not fit; the compressed cache in 4 bits, its window in bfloat16, keeps 2.7 times the
    # tokens of bfloat16
    plan = cache_plan(CONFIG, 1 / 8, 8192)
    made, bits = plan.configs
    assert isinstance(made, CompressedCacheConfig)
    assert bits == QuantizedKVConfig(bits=4, full_precision_window=True) and made.window == 256
    assert plan.bytes_per_token <= original / 8
    stored = made.sinks + made.window - 1 + made.budget  # what each head's cache holds
    # 1/8 of 8,192 tokens of 256 bytes per head in bfloat16: 1,024 tokens (262,144 bytes); the window's 255 in
    # bfloat16 (65,280), the rest at 80 bytes in 4 bits (2 · (32 codes + 2 scales and 2 zero points of 2 bytes)):
    # 255 + 2,460 = 2,715 (3,276 with the window quantized too)
    assert stored == 2715
    assert (
        "in 4 bits (its window in bfloat16), 2715 tokens per head of 8192 (1024 in bfloat16)" in plan.reason
    )
    bigger = CompressedCacheConfig(window=made.window, sinks=made.sinks, budget=made.budget + 1)
    assert bytes_per_token(CONFIG, [bigger, bits], context=8192) > original / 8  # the most that fits
    assert plan.bytes_per_token_8192 == plan.bytes_per_token and plan.to_dict()["fraction"] <= 1 / 8
    assert bytes_per_token(CONFIG, CompressedCacheConfig(window=256, sinks=4, budget=765), context=8192) == (
        original / 8
    )  # 4 + 255 + 765 = 1,024 tokens in bfloat16
    # at a shorter context the same fraction keeps fewer tokens; its bytes would hold no more than the window in
    # bfloat16, so the window is quantized too
    short, bits = cache_plan(CONFIG, 1 / 8, 2048).configs
    assert short.sinks + short.window - 1 + short.budget == 819 and bits == QuantizedKVConfig(bits=4)


def test_budgets_nothing_fits_and_bits_are_kept_where_they_alone_do_not_fit():
    with pytest.raises(HeadkitError, match=r"--kv-budget 1e-05 is below the smallest cache"):
        cache_plan(CONFIG, 1e-5, 8192)
    made, bits = cache_plan(CONFIG, 1 / 8, 8192, bits=8).configs  # 8 bits alone keep 0.57
    assert isinstance(made, CompressedCacheConfig)
    assert bits == QuantizedKVConfig(bits=8, full_precision_window=True)
    # (262,144 − 255 · 256) / 144 bytes of 8 bits = 1,367 tokens, and the window's 255
    assert made.sinks + made.window - 1 + made.budget == 1622
    assert cache_plan(CONFIG, 0.4, 8192, bits=4).configs == (QuantizedKVConfig(bits=4),)
    for bad in (5, 2, 32, True):
        with pytest.raises(HeadkitError, match=r"--kv-bits must be 8 or 4 \(quantized storage\) or 16"):
            cache_plan(CONFIG, 1 / 8, 8192, bits=bad)


def test_16_bits_keep_the_cache_in_bfloat16_the_compressed_cache_alone_at_every_budget():
    original = bytes_per_token(CONFIG, context=8192)
    # 0.6 would be 8-bit storage alone; in bfloat16 it is the compressed cache keeping 0.6 of the tokens
    (made,) = cache_plan(CONFIG, 0.6, 8192, bits=16).configs
    assert isinstance(made, CompressedCacheConfig)
    assert made.sinks + made.window - 1 + made.budget == int(0.6 * 8192)
    # 1/8: what the plan measures as the bfloat16 alternative, 1,024 tokens, no quantized storage
    plan = cache_plan(CONFIG, 1 / 8, 8192, bits=16)
    (made,) = plan.configs
    assert made.sinks + made.window - 1 + made.budget == 1024 and plan.bytes_per_token <= original / 8
    assert "the compressed cache, 1024 tokens per head" in plan.reason
    with pytest.raises(HeadkitError, match="--kv-bits 16 at --kv-budget 1 is the original cache"):
        cache_plan(CONFIG, 1, 8192, bits=16)


def test_retrieval_heads_are_counted_in_the_budget_and_refused_beyond_the_heads_there_are():
    original = bytes_per_token(CONFIG, context=8192)
    without, _ = cache_plan(CONFIG, 1 / 8, 8192).configs
    made, bits = cache_plan(CONFIG, 1 / 8, 8192, retrieval_heads=1).configs
    assert made.retrieval_heads == ((0, 0),) and bits == QuantizedKVConfig(bits=4, full_precision_window=True)
    plan = cache_plan(CONFIG, 1 / 8, 8192, retrieval_heads=1)
    assert plan.bytes_per_token <= original / 8 and "1 retrieval heads keep their whole cache" in plan.reason
    # one head of four keeps all 8,192 tokens: the other three keep fewer than without it
    assert made.budget < without.budget
    bigger = CompressedCacheConfig(
        window=made.window, sinks=made.sinks, budget=made.budget + 1, retrieval_heads=made.retrieval_heads
    )
    assert bytes_per_token(CONFIG, [bigger, bits], context=8192) > original / 8  # the most that fits
    # where quantized storage alone fits, every head keeps its whole cache anyway
    assert cache_plan(CONFIG, 0.6, 8192, retrieval_heads=2).configs == (QuantizedKVConfig(bits=8),)
    with pytest.raises(
        HeadkitError, match=r"--kv-retrieval-heads must be at most 4 \(the key/value heads of"
    ):
        cache_plan(CONFIG, 1 / 8, 8192, retrieval_heads=5)
    # 4 whole heads in 4 bits are 0.31 of the bytes: 1/8 cannot hold them, and the smallest cache named is the
    # one of the fewest bits allowed (bfloat16's would be 1)
    with pytest.raises(HeadkitError, match=r"\(0\.3125 of its bytes: .*4 retrieval heads whole, in 4 bits\)"):
        cache_plan(CONFIG, 1 / 8, 8192, retrieval_heads=4)
    with pytest.raises(
        HeadkitError, match=r"\(0\.5625 of its bytes: .*, in 8 bits\); .*or lower --kv-retriev"
    ):
        cache_plan(CONFIG, 1 / 8, 8192, bits=8, retrieval_heads=4)
    with pytest.raises(
        HeadkitError, match=r"\(0\.0004883 of its bytes: 4 sinks and one token per head, in bfloat16"
    ):
        cache_plan(CONFIG, 1e-5, 8192, bits=16)


def _refused(args, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    return errors[0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--kv-budget", "3"], "--kv-budget must be a fraction in (0, 1]"),
        (
            ["--kv-budget", "1/8", "--kv-rank", "8"],
            "--kv-budget chooses the cache itself, without training: drop --kv-rank",
        ),
        (["--kv-bits", "8"], "--kv-bits goes with --kv-budget"),
        (["--kv-budget", "1/8", "--kv-bits", "5"], "--kv-bits must be 8 or 4 (quantized storage) or 16"),
        (["--kv-budget", "1", "--kv-bits", "16"], "--kv-bits 16 at --kv-budget 1 is the original cache"),
        (["--kv-budget", "1/100000"], "is below the smallest cache"),
        (["--kv-retrieval-heads", "1"], "--kv-retrieval-heads goes with --kv-budget"),
        (["--kv-budget", "1/8", "--kv-retrieval-heads", "99"], "--kv-retrieval-heads must be at most"),
        (["--kv-budget", "1/8", "--kv-retrieval-heads", "-1"], "--kv-retrieval-heads"),
        (["--kv-selection", "reconstruction"], "--kv-selection goes with --kv-budget"),
        (
            ["--kv-budget", "1/8", "--kv-selection", "recall"],
            "--kv-selection must be one of question, reconstruction",
        ),
    ],
)
def test_bad_budgets_exit_2_in_one_line_before_loading_weights(
    tmp_path, capsys, monkeypatch, options, message
):
    folder = save_family_model("llama", tmp_path / "llama")
    recipe = sys.modules["headkit.recipes.steps"]
    monkeypatch.setattr(
        recipe, "load_model", lambda *a, **k: pytest.fail("weights were loaded before the refusal")
    )
    out = tmp_path / "out"
    assert message in _refused(["compress", str(folder), *options, "--out", str(out)], capsys)
    assert not out.exists()


def test_a_budget_run_saves_what_from_pretrained_reloads(save_tiny_causal_lm, tmp_path, capsys):
    folder = save_tiny_causal_lm(tmp_path / "tiny")
    out = tmp_path / "budget"
    main(["compress", str(folder), "--kv-budget", "1/4", "--eval-window", "200", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "KV budget 0.25" in printed and "compressed cache" in printed
    report = json.loads((out / "report.json").read_text())
    plan = report["plan"]
    assert plan["configs"][0]["config"] == "CompressedCacheConfig" and plan["fraction"] <= 0.25
    assert report["perplexity"] > 1 and report["perplexity_original"] > 1
    reloaded = headkit.from_pretrained(out)
    assert [entry["op"] for entry in reloaded.config.headkit_surgery] == ["compressed_cache"]
    tokens = torch.randint(3, reloaded.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    fresh = headkit.from_pretrained(folder)
    headkit.apply_(fresh, CompressedCacheConfig.from_record(plan["configs"][0]))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, fresh(tokens).logits)


def test_a_budget_run_chosen_by_reconstruction_records_the_request_and_reloads_its_scoring(
    save_tiny_causal_lm, tmp_path, capsys
):
    folder = save_tiny_causal_lm(tmp_path / "tiny")
    out = tmp_path / "budget"
    main(
        ["compress", str(folder), "--kv-budget", "1/4", "--kv-selection", "reconstruction", "--eval-window", "200",
         "--out", str(out)]
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    made = report["plan"]["configs"][0]
    assert made["selection"] == "reconstruction" and "chosen by reconstruction" in report["plan"]["reason"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tuple(made["reconstruction_prompt"]) == repetition_request(tokenizer) != ()
    question = cache_plan(headkit.from_pretrained(folder).config, 0.25, report["plan"]["context"])
    assert report["plan"]["bytes_per_token"] == question.bytes_per_token  # the choice costs no byte
    reloaded = headkit.from_pretrained(out)
    fresh = headkit.from_pretrained(folder)
    headkit.apply_(fresh, CompressedCacheConfig.from_record(made))
    tokens = torch.randint(
        3, reloaded.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        got = output_cache(reloaded(tokens, use_cache=True))
        expected = output_cache(fresh(tokens, use_cache=True))
    kept = [
        (a.state.sparse_scores, b.state.sparse_scores)
        for a, b in zip(got.layers, expected.layers, strict=True)
    ]
    assert all(torch.equal(a, b) for a, b in kept) and any(bool((a > 0).any()) for a, _ in kept)


def test_a_selection_is_kept_by_the_compressed_cache_and_said_where_every_token_is_kept():
    made = cache_plan(CONFIG, 1 / 8, 8192, selection="reconstruction").configs[0]
    assert isinstance(made, CompressedCacheConfig) and made.selection == "reconstruction"
    alone = cache_plan(CONFIG, 1 / 2, 8192, selection="reconstruction")
    assert isinstance(alone.configs[0], QuantizedKVConfig) and "no key is chosen" in alone.reason


def test_a_budget_run_keeps_the_originals_best_retrieval_heads_whole(save_tiny_causal_lm, tmp_path, capsys):
    folder = save_tiny_causal_lm(tmp_path / "tiny")
    out = tmp_path / "budget"
    main(
        ["compress", str(folder), "--kv-budget", "1/2", "--kv-retrieval-heads", "1", "--eval-window", "200",
         "--out", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "retrieval heads (passkey attention mass" in printed
    report = json.loads((out / "report.json").read_text())
    made = report["plan"]["configs"][0]
    assert made["config"] == "CompressedCacheConfig" and len(made["retrieval_heads"]) == 1
    (layer, head), *_ = made["retrieval_heads"]
    chosen = next(line for line in printed.splitlines() if line.startswith("retrieval heads"))
    assert chosen.split("): ")[1].startswith(
        f"{layer}:{head} "
    )  # the best-scored head, not the placeholder's
    assert "1 retrieval heads keep their whole cache" in report["plan"]["reason"]
    reloaded = headkit.from_pretrained(out)
    fresh = headkit.from_pretrained(folder)
    headkit.apply_(fresh, CompressedCacheConfig.from_record(made))
    tokens = torch.randint(3, reloaded.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, fresh(tokens).logits)


def test_the_default_keeps_about_9_percent_of_the_heads_whole_where_they_take_half_the_budget_at_most():
    """--kv-retrieval-heads unset: 8 of a 30-layer, 3-group model's 90 key/value heads (SmolLM2's shape) keep their
    whole cache at 1/8 (their 4-bit caches: 22% of the budget) and 1/16 (44%), none at 1/32 (89%); 0 asks for none;
    a model of 4 key/value heads gets none (9% of 4 rounds to 0)."""
    smol = LlamaConfig(
        hidden_size=576, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=128, max_position_embeddings=8192,
    )  # fmt: skip
    assert default_retrieval_heads(smol) == 8 and default_retrieval_heads(CONFIG) == 0
    plan = cache_plan(smol, 1 / 8, 8192)
    made, bits = plan.configs
    assert len(made.retrieval_heads) == 8 and bits.full_precision_window
    assert "8 retrieval heads keep their whole cache (the default" in plan.reason
    assert plan.bytes_per_token <= bytes_per_token(smol, context=8192) / 8
    assert cache_plan(smol, 1 / 8, 8192, retrieval_heads=0).configs[0].retrieval_heads == ()
    # 1/16: the row measured best there (docs/compressed-cache.md), its window quantized to keep 256 tokens
    (sixteenth, sixteenth_bits) = cache_plan(smol, 1 / 16, 8192).configs
    assert len(sixteenth.retrieval_heads) == 8 and not sixteenth_bits.full_precision_window
    assert (sixteenth.window, sixteenth.sinks, sixteenth.budget) == (256, 4, 740)
    (thirty_second, _) = cache_plan(smol, 1 / 32, 8192).configs
    assert thirty_second.retrieval_heads == ()
    assert cache_plan(smol, 1 / 32, 8192, retrieval_heads=8).configs[0].retrieval_heads != ()
    # where quantized storage alone fits, every head keeps its whole cache: no retrieval heads to name
    assert cache_plan(smol, 0.6, 8192).configs == (QuantizedKVConfig(bits=8),)
    # a budget that holds the cache but not the default heads: none, not a refusal naming an option not given
    (tight, _) = cache_plan(smol, 0.085, 16).configs
    assert tight.retrieval_heads == ()
    # a window of one token stores none: nothing to keep in full precision
    assert not cache_plan(CONFIG, 0.0002, 8192).configs[-1].full_precision_window
