"""``--dtype float32|bfloat16`` of prune, compress, linearize and generate, and ``dtype`` in the library API
(load_model, the recipes' settings): the model loads, trains, is saved and decodes in that dtype; a wrong value is
a one-line error (exit status 2) before any work."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

import headkit
from headkit.cli import main
from headkit.errors import HeadkitError
from headkit.recipes.compress import CompressSettings
from headkit.recipes.linearize import LinearizeSettings
from headkit.recipes.prune import PruneSettings
from headkit.runs import models
from headkit.runs.models import load_model

transformers.logging.set_verbosity_error()

PRUNE = ["--quick", "--window", "16", "--train-texts", "16", "--batch-size", "4", "--recovery-steps", "3"]
COMPRESS = [
    "--window",
    "16",
    "--batch-size",
    "4",
    "--held-out",
    "2",
    "--timing-repeats",
    "1",
    "--max-iter",
    "5",
]
LINEARIZE = [
    "--window", "8", "--train-length", "64", "--train-windows", "8", "--batch-size", "4",
    "--transfer-steps", "3", "--recovery-steps", "2", "--eval-lengths", "64", "--held-out-windows", "2",
    "--decode-contexts", "32", "--decode-steps", "2", "--decode-batch-sizes", "1",
]  # fmt: skip
STATS = re.compile(r"(\d+) tokens in [\d.]+ s")


def _exit_code(args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    return exit_info.value.code


def _dtypes(model):
    return {p.dtype for p in model.parameters()}


# -- the library API -------------------------------------------------------------------------------------------


def test_load_model_loads_in_the_dtype_asked_for(tiny_llama):
    assert _dtypes(load_model(tiny_llama).model) == {torch.float32}  # the default, as before
    assert _dtypes(load_model(tiny_llama, dtype="bfloat16").model) == {torch.bfloat16}
    assert _dtypes(load_model(tiny_llama, dtype=torch.bfloat16).model) == {torch.bfloat16}
    with pytest.raises(HeadkitError, match="--dtype must be one of float32, bfloat16, got 'float16'"):
        load_model(tiny_llama, dtype="float16")


@pytest.mark.parametrize("settings_class", [PruneSettings, CompressSettings, LinearizeSettings])
def test_every_recipe_settings_carries_a_checked_dtype(settings_class):
    assert settings_class().dtype == "float32"
    assert settings_class(dtype=torch.bfloat16).dtype == "bfloat16"  # stored by name: report.json holds it
    if hasattr(settings_class, "quick"):
        assert settings_class.quick(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(HeadkitError, match="--dtype must be one of float32, bfloat16, got 'fp16'"):
        settings_class(dtype="fp16")


# -- the commands ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["prune", "compress", "linearize", "generate"])
def test_a_wrong_dtype_is_a_one_line_error_before_any_work(
    command, tiny_llama, tmp_path, capsys, monkeypatch
):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before --dtype was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    args = [command, str(tiny_llama), "--dtype", "float16"]
    args += ["--prompt", "hi"] if command == "generate" else ["--out", str(tmp_path / "out")]
    assert _exit_code(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--dtype must be one of float32, bfloat16, got 'float16'" in err
    assert not (tmp_path / "out").exists()


def test_prune_in_bfloat16_trains_saves_and_reloads_in_bfloat16(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "pruned"
    args = ["prune", str(tiny_llama), "--heads", "5", "--data", str(text_folder), "--out", str(out), *PRUNE]
    assert _exit_code([*args, "--dtype", "bfloat16"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["dtype"] == "bfloat16"
    assert report["recovery"]["steps"] == 3 and all(loss == loss for loss in report["recovery"]["losses"])
    assert report["reload_max_abs_diff"] == 0.0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = headkit.from_pretrained(out)
    assert _dtypes(reloaded) == {torch.bfloat16}
    assert reloaded.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=4, do_sample=False).shape == (1, 7)


def test_compress_in_bfloat16(tiny_gpt2, text_folder, tmp_path):
    out = tmp_path / "compressed"
    args = ["compress", str(tiny_gpt2), "--dim", "16", "--recovery-steps", "2", "--data", str(text_folder)]
    assert _exit_code([*args, "--out", str(out), *COMPRESS, "--dtype", "bfloat16"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["dtype"] == "bfloat16" and report["reload_max_abs_diff"] == 0.0
    assert report["perplexity_recovered"] > 0 and len(report["distill_losses"]) == 2
    assert _dtypes(headkit.from_pretrained(out)) == {torch.bfloat16}


def test_linearize_in_bfloat16(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "linearized"
    args = ["linearize", str(tiny_llama), *LINEARIZE, "--data", str(text_folder), "--out", str(out)]
    assert _exit_code([*args, "--dtype", "bfloat16"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["reload_max_abs_diff"] == 0.0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert _dtypes(headkit.from_pretrained(out)) == {torch.bfloat16}


@pytest.mark.parametrize("surgery", ["none", "pruned"])
def test_generate_in_bfloat16_decodes_what_the_bfloat16_model_generates(
    tiny_llama, tmp_path, capsys, surgery
):
    folder = tiny_llama
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    if surgery == "pruned":
        headkit.prune_heads(model, {0: [1], 1: [0, 3]})
        folder = tmp_path / "pruned"
        model.save_pretrained(folder)
        transformers.AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(folder)
    main(["generate", str(folder), "--prompt", "hello world", "--max-new-tokens", "6", "--dtype", "bfloat16"])
    captured = capsys.readouterr()
    assert int(STATS.search(captured.err)[1]) == 6
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("hello world", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.to(torch.bfloat16).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False
        )
    assert captured.out.strip() == tokenizer.decode(expected[0], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_the_smollm2_gguf_dequantizes_to_bfloat16_and_generates(capsys):
    try:
        path = models.smollm2_gguf_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    loaded = load_model(path, dtype="bfloat16")
    assert _dtypes(loaded.model) == {torch.bfloat16} and not loaded.model.is_quantized
    main(
        [
            "generate",
            str(path),
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "4",
            "--dtype",
            "bfloat16",
        ]
    )
    assert "Paris" in capsys.readouterr().out


def test_linearize_in_bfloat16_converts_decodes_and_reloads_in_bfloat16(tiny_llama, tmp_path):
    import headkit
    from headkit.surgery.linearize import linearized_modules

    model = load_model(tiny_llama, dtype="bfloat16").model
    headkit.linearize(model, window=4)
    assert _dtypes(model) == {torch.bfloat16}
    assert all(p.dtype == torch.bfloat16 for m in linearized_modules(model) for p in m.parameters())
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert _dtypes(reloaded) == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(reloaded(prompt).logits, model(prompt).logits)
