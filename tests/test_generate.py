"""``headkit generate``: streams a continuation from every kind of model headkit writes or reads, then reports
tokens per second and the cache size; user errors are one line and exit status 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headkit.cli import main
from headkit.data import TOKENIZER_FILE, ByteTokenizer
from headkit.train import train_causal_lm

STATS = re.compile(r"(\d+) tokens in [\d.]+ s: [\d.]+ tokens/s; cache ([\d,]+) bytes for (\d+) tokens")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny headkit LM (linear attention) trained for a few steps by headkit.train, saved with its tokenizer."""
    root = tmp_path_factory.mktemp("generate")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"the cat sat on mat {i}. 猫 🙂\n" for i in range(60)), encoding="utf-8")
    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    train_causal_lm(
        tiny,
        corpus,
        steps=5,
        batch_size=4,
        seq_len=32,
        eval_tokens=0,
        out_dir=root / "lm",
        show_progress=False,
    )
    return root / "lm"


def run(capsys, *arguments):
    main(["generate", *map(str, arguments)])
    captured = capsys.readouterr()
    stats = STATS.search(captured.err)
    assert stats, captured.err
    return captured.out, int(stats[1]), int(stats[2].replace(",", "")), int(stats[3])


def test_streams_the_greedy_continuation_of_a_trained_headkit_lm(trained, capsys):
    from transformers import AutoModelForCausalLM

    text, new_tokens, cache, total = run(capsys, trained, "--prompt", "the cat 猫", "--max-new-tokens", 12)
    prompt = list("the cat 猫".encode())
    model = AutoModelForCausalLM.from_pretrained(trained).eval()
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0]
    assert text == ByteTokenizer().decode(expected) + "\n"
    assert new_tokens == len(expected) - len(prompt) and total == len(expected)
    assert cache > 0


def test_sampling_is_seeded(trained, capsys):
    options = ["--prompt", "the", "--max-new-tokens", 16, "--sample", "--temperature", 1.5, "--top-k", 50]
    first = run(capsys, trained, *options, "--seed", 1)[0]
    assert run(capsys, trained, *options, "--seed", 1)[0] == first
    assert {run(capsys, trained, *options, "--seed", seed)[0] for seed in (2, 3, 4)} != {first}


def test_a_folder_with_the_old_tokenizer_file_still_generates(trained, tmp_path, capsys):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(trained, old)
    (old / "tokenizer.json").unlink()
    (old / "tokenizer_config.json").unlink()
    description = {"type": "bytes", "vocab_size": 259, "pad": 256, "bos": 257, "eos": 258}
    (old / TOKENIZER_FILE).write_text(json.dumps(description))
    assert (
        run(capsys, old, "--prompt", "the cat", "--max-new-tokens", 5)[0]
        == run(capsys, trained, "--prompt", "the cat", "--max-new-tokens", 5)[0]
    )


@pytest.mark.parametrize("surgery", ["none", "pruned", "linearized"])
def test_stock_pruned_and_linearized_llama_folders(save_tiny_causal_lm, tmp_path, capsys, surgery):
    import transformers

    import headkit

    folder = save_tiny_causal_lm(tmp_path / "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if surgery != "none":
        model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        if surgery == "pruned":
            headkit.prune_heads(model, {0: [1], 1: [0, 3]})
        else:
            headkit.linearize(model, window=4)
        folder = tmp_path / surgery
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        assert json.loads((folder / "config.json").read_text())["headkit_surgery"]
    text, new_tokens, cache, total = run(capsys, folder, "--prompt", "hello world", "--max-new-tokens", 6)
    assert text.strip() and new_tokens == 6 and cache > 0
    prompt_tokens = len(tokenizer("hello world")["input_ids"])
    assert total == prompt_tokens + 6


def test_fast_path_decodes_the_eager_tokens_and_states_its_step(
    save_tiny_causal_lm, tmp_path, capsys, caplog
):
    import headkit

    folder = save_tiny_causal_lm(tmp_path / "llama")
    options = ["--prompt", "hello world", "--max-new-tokens", 6]
    eager_text = run(capsys, folder, *options)[0]
    main(["generate", str(folder), *options, "--fast", "--no-compile"])
    captured = capsys.readouterr()
    assert captured.out == eager_text
    assert "fast path, float32 weights, batch 1, cache 256 tokens: decoding step run eagerly" in captured.err
    assert re.search(r"model loaded in [\d.]+ s; ready [\d.]+ s later", captured.err)
    # The rate without the first step (the one that compiles): the 4 steps after it, 6 tokens in all.
    assert re.search(
        r"fast path after the first step: median [\d.]+ ms per token \([\d.]+ tokens/s\) over 4 steps",
        captured.err,
    )
    assert "fast decoding without compilation" in caplog.text  # announced by the library too
    own = headkit.HeadkitForCausalLM(
        headkit.HeadkitConfig(vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(headkit.HeadkitError, match="headkit's own HeadkitForCausalLM"):
        headkit.FastDecoder(own, compile=False)


def test_the_fast_step_is_compiled_once_then_loaded(save_tiny_causal_lm, tmp_path, capsys, monkeypatch):
    import shutil

    if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler for AOTInductor")
    monkeypatch.setenv("HEADKIT_CACHE", str(tmp_path / "cache"))
    folder = save_tiny_causal_lm(tmp_path / "llama")
    options = ["--prompt", "hello world", "--max-new-tokens", 4]
    eager_text = run(capsys, folder, *options)[0]
    compiled = tmp_path / "cache" / "compiled"
    for said in (
        r"compiled in [\d.]+ s and saved to (\S+\.pt2) \(once per machine",
        r"loaded from (\S+\.pt2) in",
    ):
        main(["generate", str(folder), *options, "--fast"])
        captured = capsys.readouterr()
        assert captured.out == eager_text
        found = re.search(said, captured.err)
        assert found and Path(found.group(1)).parent == compiled, captured.err
        assert re.search(r"model loaded in [\d.]+ s; ready [\d.]+ s later", captured.err)
    main(["cache", "--clear"])
    assert "removed 2 files" in capsys.readouterr().err
    assert not list(compiled.iterdir())


@pytest.mark.slow
def test_a_gguf_file(capsys):
    from headkit.runs.models import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    text, new_tokens, _, _ = run(capsys, path, "--prompt", "The capital of France is", "--max-new-tokens", 4)
    assert text.startswith("The capital of France is") and "Paris" in text and new_tokens == 4


@pytest.mark.parametrize(
    "options, message",
    [
        (["--prompt", "  "], "--prompt must not be empty"),
        (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompt", "a", "--sample", "--temperature", "0"], "--temperature"),
        (["--prompt", "a", "--sample", "--temperature", "nan"], "--temperature"),
        (["--prompt", "a", "--sample", "--top-k", "-1"], "--top-k"),
        (["--prompt", "a", "--temperature", "0.5"], "add --sample"),
        (["--prompt", "a", "--weights", "int8"], "--weights and --no-compile choose how --fast decodes"),
        (["--prompt", "a", "--fast", "--sample"], "--fast decodes greedily"),
        (["--prompt", "a", "--fast", "--weights", "int3"], "weights must be one of float32, bfloat16"),
    ],
)
def test_bad_options_are_one_line_errors(trained, capsys, options, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(trained), *options])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_missing_model_or_an_encoder_is_a_one_line_error(save_tiny_encoder, tmp_path, capsys):
    proc = subprocess.run(
        [sys.executable, "-m", "headkit", "generate", str(tmp_path / "nowhere"), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not exist" in lines[0]

    encoder = save_tiny_encoder(tmp_path / "bert")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(encoder), "--prompt", "hi"])
    assert exit_info.value.code == 2 and "not a causal LM" in capsys.readouterr().err


def _one_line_error(capsys, *arguments):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *map(str, arguments)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_a_prompt_beyond_learned_positions_is_a_one_line_error(save_tiny_causal_lm, tmp_path, capsys):
    """GPT-2 learns 256 positions here (n_positions): a longer text is refused before generating, naming the
    options and the limit; a text that fits still generates."""
    import transformers

    folder = save_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = " ".join(["cat"] * 300)
    length = len(tokenizer(prompt)["input_ids"])
    capsys.readouterr()  # the fixture's "Writing model shards" bar
    err = _one_line_error(capsys, folder, "--prompt", prompt, "--max-new-tokens", 3)
    assert f"--prompt is {length:,} tokens and --max-new-tokens 3 would reach position {length + 2:,}" in err
    assert "256 positions (max_position_embeddings)" in err
    fits = " ".join(["cat"] * 100)
    fitting = len(tokenizer(fits)["input_ids"])
    assert "--max-new-tokens 200" in _one_line_error(
        capsys, folder, "--prompt", fits, "--max-new-tokens", 200
    )
    assert run(capsys, folder, "--prompt", fits, "--max-new-tokens", 256 - fitting)[1] == 256 - fitting


def test_learned_positions_of_a_headkit_lm_are_a_limit_but_rotary_ones_are_not(
    trained, save_tiny_causal_lm, tmp_path, capsys
):
    import shutil

    from headkit.models import HeadkitConfig, HeadkitForCausalLM

    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    config = HeadkitConfig(
        vocab_size=259, **tiny, position_embedding_type="learned", max_position_embeddings=24
    )
    learned = tmp_path / "learned"
    torch.manual_seed(0)
    HeadkitForCausalLM(config).eval().save_pretrained(learned)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the byte tokenizer headkit.train wrote
        shutil.copy(trained / name, learned / name)
    capsys.readouterr()
    err = _one_line_error(capsys, learned, "--prompt", "the cat sat", "--max-new-tokens", 20)
    assert "would reach position 30, beyond this model's 24 positions" in err
    assert run(capsys, learned, "--prompt", "the cat sat", "--max-new-tokens", 13)[3] == 24
    # RoPE: max_position_embeddings is no hard limit, for headkit models or LLaMA (256 positions here).
    from headkit.runtime.generation import position_limit

    assert (
        position_limit(HeadkitForCausalLM(HeadkitConfig(vocab_size=259, **tiny, max_position_embeddings=24)))
        is None
    )
    folder = save_tiny_causal_lm(tmp_path / "llama")
    assert run(capsys, folder, "--prompt", " ".join(["cat"] * 300), "--max-new-tokens", 2)[1] == 2


def test_the_gguf_reader_bar_is_silenced_while_loading_only(
    save_tiny_causal_lm, tmp_path, monkeypatch, capsys
):
    """transformers' GGUF reader calls tqdm directly ("Converting and de-quantizing GGUF tensors"), outside
    transformers' progress-bar switch: a stand-in loader draws that bar the way the reader does."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    import headkit.runs.models as models

    folder = save_tiny_causal_lm(tmp_path / "llama")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"")
    capsys.readouterr()  # the fixture's "Writing model shards" bar
    bar_inside = []

    def load_model(path, *, kind=None, dtype=None):
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        bar_inside.append(transformers.utils.logging.is_progress_bar_enabled())
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        return models.LoadedModel(
            model, transformers.AutoTokenizer.from_pretrained(folder), models.CAUSAL_LM, path
        )

    monkeypatch.setattr(models, "load_model", load_model)
    original = gguf_utils.tqdm
    assert transformers.utils.logging.is_progress_bar_enabled()
    main(["generate", str(gguf), "--prompt", "hello world", "--max-new-tokens", "3"])
    err = capsys.readouterr().err
    assert "Converting and de-quantizing" not in err and STATS.search(err)[1] == "3"
    assert bar_inside == [False]
    assert gguf_utils.tqdm is original and transformers.utils.logging.is_progress_bar_enabled()
