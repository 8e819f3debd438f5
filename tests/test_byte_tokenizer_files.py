"""The byte tokenizer as 🤗 files: ``AutoTokenizer`` loads what ``headkit train`` saves, offline and without
headkit, and encodes and decodes exactly like :class:`headkit.data.ByteTokenizer`; old folders still load."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from headkit.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_FILE,
    ByteTokenizer,
    is_byte_tokenizer_folder,
    load_tokenizer,
)
from headkit.errors import HeadkitError
from headkit.train import train_causal_lm

TEXTS = [
    "plain ASCII, with punctuation: (a+b)*c = 42!",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "中文、日本語、한국어",
    "lines\nand\ttabs\r\nand  double  spaces ",
    "  leading and trailing  ",
    "é vs e\u0301 (combining), ß, Ωμέγα, привет",
    "special-looking text: <eos> <pad> <bos> <0x41> <unk>",
    "\x00 control \x1b[0m bytes \x7f",
    "",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    ByteTokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_autotokenizer_encodes_and_decodes_like_the_byte_tokenizer(saved, text):
    ours, theirs = ByteTokenizer(), AutoTokenizer.from_pretrained(saved, local_files_only=True)
    ids = ours.encode(text)
    assert theirs(text)["input_ids"] == ids  # no special tokens added, "<eos>" typed is bytes
    assert theirs.encode(text) == ids
    assert theirs.decode(ids) == ours.decode(ids) == text
    with_specials = [BOS_ID, *ids, EOS_ID, PAD_ID]
    assert theirs.decode(with_specials, skip_special_tokens=True) == text
    assert theirs.decode(with_specials, skip_special_tokens=False) == ours.decode(
        with_specials, skip_special_tokens=False
    )


def test_invalid_utf8_decodes_like_the_byte_tokenizer(saved):
    # What a model may generate: cut or stray multi-byte sequences, bytes that never occur in UTF-8, specials.
    ours, theirs = ByteTokenizer(), AutoTokenizer.from_pretrained(saved, local_files_only=True)
    generator = random.Random(0)
    for _ in range(500):
        ids = [
            generator.choice(
                [generator.randrange(256), generator.randrange(0x80, 0x100), generator.randrange(256, 259)]
            )
            for _ in range(generator.randrange(1, 16))
        ]
        for skip in (True, False):
            assert theirs.decode(ids, skip_special_tokens=skip) == ours.decode(
                ids, skip_special_tokens=skip
            ), ids
    assert theirs.decode([*"猫".encode()[:2], *b" ok"]) == "\ufffd ok"


def test_special_tokens_and_vocabulary(saved):
    tokenizer = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    assert type(tokenizer).__module__.startswith("transformers.")
    assert len(tokenizer) == ByteTokenizer.vocab_size == 259
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        PAD_ID,
        BOS_ID,
        EOS_ID,
    )
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert sorted(tokenizer.all_special_ids) == [PAD_ID, BOS_ID, EOS_ID]
    # GPT-2's byte alphabet: printable bytes stand for themselves, the others for characters from U+0100 on.
    assert tokenizer.convert_ids_to_tokens([0, 32, 65, 255]) == ["Ā", "Ġ", "A", "ÿ"]
    batch = tokenizer(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[97, 98, PAD_ID, PAD_ID], [97, 98, 99, 100]]


def test_to_transformers_is_what_autotokenizer_loads(saved):
    built = ByteTokenizer().to_transformers()
    loaded = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    for text in TEXTS:
        assert built(text)["input_ids"] == loaded(text)["input_ids"]
    assert built.decode([104, 105, EOS_ID], skip_special_tokens=False) == "hi<eos>"


def test_load_tokenizer_reads_new_and_old_folders(saved, tmp_path):
    assert is_byte_tokenizer_folder(saved) and isinstance(load_tokenizer(saved), ByteTokenizer)
    old = tmp_path / "old"
    old.mkdir()
    description = {"type": "bytes", "vocab_size": 259, "pad": 256, "bos": 257, "eos": 258}
    (old / TOKENIZER_FILE).write_text(json.dumps(description))
    assert is_byte_tokenizer_folder(old) and isinstance(load_tokenizer(old), ByteTokenizer)
    assert isinstance(ByteTokenizer.from_pretrained(old), ByteTokenizer)
    with pytest.raises(HeadkitError, match="holds no byte tokenizer"):
        ByteTokenizer.from_pretrained(tmp_path)


def test_another_tokenizer_json_is_not_taken_for_the_byte_tokenizer(tmp_path):
    from transformers import ByT5Tokenizer

    ByT5Tokenizer(extra_ids=0).save_pretrained(tmp_path / "byt5")
    assert not is_byte_tokenizer_folder(tmp_path / "byt5")
    data = json.loads(ByteTokenizer.backend().to_str())
    data["model"]["vocab"]["A"], data["model"]["vocab"]["B"] = 66, 65  # the same tokens with other ids
    (tmp_path / "swapped").mkdir()
    (tmp_path / "swapped" / "tokenizer.json").write_text(json.dumps(data))
    assert not is_byte_tokenizer_folder(tmp_path / "swapped")


def test_autotokenizer_loads_a_trained_models_folder_without_headkit(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "".join(f"line {i}: the cat sat on the mat, 猫 🙂\n" for i in range(40)), encoding="utf-8"
    )
    out = tmp_path / "model"
    tiny = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    train_causal_lm(
        tiny, corpus, steps=1, batch_size=2, seq_len=16, eval_tokens=0, out_dir=out, show_progress=False
    )
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)\n"
        "text = sys.argv[2]\n"
        "ids = tokenizer(text)['input_ids']\n"
        "print(json.dumps({'ids': ids, 'text': tokenizer.decode(ids), 'eos': tokenizer.eos_token_id,\n"
        "                  'headkit': any(name.startswith('headkit') for name in sys.modules)}))\n"
    )
    text = "naïve café 🙂 <eos>\n\tend"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(out), text], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == {"ids": list(text.encode("utf-8")), "text": text, "eos": EOS_ID, "headkit": False}
