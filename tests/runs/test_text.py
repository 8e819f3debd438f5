import json
import pickle

import pytest

from headkit.data import load_corpus
from headkit.errors import HeadkitError
from headkit.runs.text import lm_windows, load_text, text_chunks, text_halves


def test_jsonl_documents_split_by_name_and_never_mix(tmp_path):
    path = tmp_path / "texts.jsonl"
    rows = [{"text": f"document {i} " + "word " * 50, "id": i} for i in range(40)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    corpus = load_corpus(path)
    assert len(corpus.train) + len(corpus.held_out) == 40 and corpus.held_out and corpus.train
    assert not {d.text for d in corpus.train} & {d.text for d in corpus.held_out}
    assert load_corpus(path) == corpus


@pytest.mark.parametrize(
    "content, match",
    [("", "no non-empty"), ('{"body": "x"}\n', '"text"'), ("not json\n", "not a JSON object")],
)
def test_bad_jsonl_is_refused_with_the_line(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(HeadkitError, match=match):
        load_text(path)


def test_empty_or_missing_data_names_the_option(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadkitError, match="--data"):
        load_text(tmp_path / "empty")
    with pytest.raises(HeadkitError, match="--data .* does not exist"):
        load_text(tmp_path / "missing")


def test_held_out_text_is_never_trained_on(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(30):
        (folder / f"doc{i}.txt").write_text("\n".join(f"line {i} {j} " + "x" * (j % 7) for j in range(40)))
    corpus = load_text(folder)
    train, held_out = text_chunks(corpus, 20, 5, seed=1)
    assert not set(train) & set(held_out)
    assert text_chunks(corpus, 20, 5, seed=1) == (train, held_out)


def test_lm_windows_come_from_their_own_split(save_tiny_causal_lm, tmp_path):
    from transformers import AutoTokenizer

    folder = save_tiny_causal_lm(tmp_path / "lm")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(20):
        (docs / f"d{i}.txt").write_text(f"alpha{i} " * 40)
    corpus = load_text(docs)
    windows = lm_windows(tokenizer, corpus, length=16, train_windows=12, held_out_windows=3, seed=0)
    assert len(windows.train) == 12 and windows.held_out.shape[1] == 16
    held_out_words = {w for d in corpus.held_out for w in d.text.split()}
    train_words = {w for d in corpus.train for w in d.text.split()}
    decoded = {w for row in windows.held_out for w in tokenizer.decode(row).split()}
    assert decoded <= held_out_words | {"[SEP]"} and not (decoded & train_words)
    # Each training window owns its tokens, so a pickle of the windows (a recipe's snapshot) holds them once.
    for window in windows.train:
        assert window["input_ids"].untyped_storage().nbytes() == 16 * window["input_ids"].element_size()
    assert len(pickle.dumps(windows.train)) < 12 * 2 * 16 * 8 + 12 * 2048


def test_jsonl_records_may_hold_unicode_line_separators(tmp_path):
    path = tmp_path / "texts.jsonl"
    rows = [{"text": f"paragraph {i}\u2028second line\u2029end\x85"} for i in range(10)]
    path.write_text("\n".join(json.dumps(row, ensure_ascii=False) for row in rows), encoding="utf-8")
    corpus = load_corpus(path)
    assert len(corpus.train) + len(corpus.held_out) == 10


def test_text_halves_split_each_text_in_two():
    firsts, seconds = text_halves(["a b c d e", "x y"])
    assert firsts == ["a b", "x"] and seconds == ["c d e", "y"]
    assert [f"{a} {b}" for a, b in zip(firsts, seconds, strict=True)] == ["a b c d e", "x y"]
