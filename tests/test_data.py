"""headkit.data: the byte tokenizer, corpus loading and its deterministic split, token streams and batches."""

from __future__ import annotations

import pytest
import torch

from headkit.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ByteTokenizer,
    Document,
    count_text_bytes,
    encode_corpus,
    evaluation_windows,
    load_corpus,
    load_tokenizer,
    sample_batch,
    special_token_ids,
    stdlib_directory,
)
from headkit.errors import HeadkitError

TEXT = "héllo, wörld — 你好 🙂\n\tend"


# --- the byte tokenizer ----------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_any_text_through_utf8_bytes():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert max(ids) < 256 and len(tokenizer) == tokenizer.vocab_size == 259
    assert tokenizer.decode(ids) == TEXT
    assert torch.equal(tokenizer.encode_tensor(TEXT), torch.tensor(ids, dtype=torch.int32))
    assert tokenizer.encode_tensor("").numel() == 0


def test_byte_tokenizer_special_tokens_are_skipped_or_named():
    tokenizer = ByteTokenizer()
    ids = [BOS_ID, *tokenizer.encode("ab"), EOS_ID, PAD_ID]
    assert tokenizer.decode(ids) == "ab"
    assert tokenizer.decode(torch.tensor(ids), skip_special_tokens=False) == "<bos>ab<eos><pad>"
    # A window that cuts a multi-byte character decodes with a replacement character, not an error.
    assert tokenizer.decode(tokenizer.encode("é")[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="259"):
        tokenizer.decode([259])


def test_byte_tokenizer_saves_and_loads(tmp_path):
    ByteTokenizer().save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(HeadkitError, match="folder"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "headkit_byte_tokenizer.json").write_text('{"type": "words"}')
    with pytest.raises(HeadkitError, match="byte tokenizer"):
        load_tokenizer(tmp_path)


def test_a_locally_saved_transformers_tokenizer_is_used_as_is(tmp_path):
    from transformers import ByT5Tokenizer

    ByT5Tokenizer(extra_ids=0).save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert type(tokenizer).__name__.startswith("ByT5")
    stream = encode_corpus([Document("a", "abc"), Document("b", "dé")], tokenizer)
    # ByT5 shifts bytes by 3 (pad, eos, unk); documents end with its eos.
    expected = [b + 3 for b in b"abc"] + [tokenizer.eos_token_id] + [b + 3 for b in "dé".encode()]
    assert stream.tolist() == [*expected, tokenizer.eos_token_id]
    assert count_text_bytes(tokenizer, stream[:3]) == 3
    assert tokenizer.eos_token_id in special_token_ids(tokenizer)


# --- corpora ---------------------------------------------------------------------------------------------------


def write_files(root, names, text=lambda name: f"text of {name}\n" * 3):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text(name), encoding="utf-8")


NAMES = [f"dir{i % 7}/file{i}.txt" for i in range(120)]


def test_directory_split_is_deterministic_disjoint_and_independent_of_creation_order(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    write_files(first, NAMES)
    write_files(second, list(reversed(NAMES)))
    corpus = load_corpus(first, held_out_fraction=0.25)
    again = load_corpus(second, held_out_fraction=0.25)
    held_out = {d.name for d in corpus.held_out}
    train = {d.name for d in corpus.train}
    assert held_out == {d.name for d in again.held_out}
    assert not held_out & train and held_out | train == set(NAMES)
    assert 10 <= len(held_out) <= 60  # about a quarter of 120
    assert [d.name for d in corpus.train] == sorted(train)  # sorted, whatever the listing order
    assert corpus.summary()["held_out_bytes"] == corpus.num_bytes("held_out") > 0

    # Adding files never moves an existing one to the other side.
    write_files(first, ["new/extra1.txt", "new/extra2.txt"])
    grown = load_corpus(first, held_out_fraction=0.25)
    assert held_out <= {d.name for d in grown.held_out}
    assert train <= {d.name for d in grown.train}


def test_tiny_corpora_still_have_both_sides(tmp_path):
    write_files(tmp_path, ["one.txt", "two.txt"])
    corpus = load_corpus(tmp_path, held_out_fraction=0.01)
    assert len(corpus.train) == 1 and len(corpus.held_out) == 1


def test_a_single_file_is_split_by_lines_its_end_held_out(tmp_path):
    text = "".join(f"line {i}\n" for i in range(40))
    (tmp_path / "book.txt").write_text(text)
    corpus = load_corpus(tmp_path / "book.txt", held_out_fraction=0.1)
    (train,), (held_out,) = corpus.train, corpus.held_out
    assert train.text + held_out.text == text
    assert held_out.text == "".join(f"line {i}\n" for i in range(36, 40))
    # A folder with one text file is the same thing.
    assert load_corpus(tmp_path, held_out_fraction=0.1).held_out[0].text == held_out.text


def test_binary_hidden_and_empty_files_are_skipped(tmp_path):
    write_files(tmp_path, ["a.txt", "b.md", ".hidden/c.txt", ".d.txt"])
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00\x81" * 10)
    (tmp_path / "empty.txt").write_text("   \n")
    corpus = load_corpus(tmp_path)
    assert {d.name for d in corpus.train + corpus.held_out} == {"a.txt", "b.md"}


def test_max_bytes_caps_the_corpus(tmp_path):
    write_files(tmp_path, [f"f{i}.txt" for i in range(10)], text=lambda name: "x" * 1000)
    corpus = load_corpus(tmp_path, max_bytes=2500)
    assert corpus.num_bytes("train") + corpus.num_bytes("held_out") == 2500
    assert len(corpus.train) + len(corpus.held_out) == 3


def test_default_corpus_is_the_standard_library_source():
    corpus = load_corpus(max_bytes=300_000)
    documents = corpus.train + corpus.held_out
    assert corpus.held_out and corpus.train
    assert all(d.name.endswith(".py") and "site-packages" not in d.name for d in documents)
    assert all((stdlib_directory() / d.name).is_file() for d in documents)
    assert "standard library" in corpus.source


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"path": "/no/such/corpus"}, FileNotFoundError, "does not exist"),
        ({"held_out_fraction": 1.0}, HeadkitError, "held_out_fraction"),
        ({"max_bytes": 0}, HeadkitError, "max_bytes"),
    ],
)
def test_bad_corpus_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        load_corpus(**kwargs)


def test_an_empty_folder_or_a_one_line_file_is_an_error(tmp_path):
    with pytest.raises(HeadkitError, match="no UTF-8 text"):
        load_corpus(tmp_path)
    (tmp_path / "short.txt").write_text("just one line")
    with pytest.raises(HeadkitError, match="fewer than 2 lines"):
        load_corpus(tmp_path / "short.txt")


# --- streams and batches ---------------------------------------------------------------------------------------


def test_encode_corpus_separates_documents_with_eos():
    stream = encode_corpus([Document("a", "ab"), Document("b", "é")], ByteTokenizer())
    assert stream.dtype == torch.int32
    assert stream.tolist() == [97, 98, EOS_ID, 0xC3, 0xA9, EOS_ID]
    assert count_text_bytes(ByteTokenizer(), stream) == 4


def test_sample_batch_draws_seeded_contiguous_windows():
    stream = torch.arange(1000, dtype=torch.int32)
    batch = sample_batch(stream, 6, 17, torch.Generator().manual_seed(3))
    assert batch.shape == (6, 17) and batch.dtype == torch.long
    assert torch.equal(batch - batch[:, :1], torch.arange(17).expand(6, 17))  # consecutive tokens
    assert int(batch.max()) < 1000
    assert torch.equal(batch, sample_batch(stream, 6, 17, torch.Generator().manual_seed(3)))
    assert not torch.equal(batch, sample_batch(stream, 6, 17, torch.Generator().manual_seed(4)))
    with pytest.raises(HeadkitError, match="seq_len"):
        sample_batch(stream[:10], 2, 17, torch.Generator())


def test_evaluation_windows_are_non_overlapping_and_capped():
    stream = torch.arange(100, dtype=torch.int32)
    windows = evaluation_windows(stream, 16, max_tokens=70)
    assert windows.shape == (4, 16)
    assert torch.equal(windows.flatten(), torch.arange(64))
    assert evaluation_windows(stream[:10], 16).shape == (1, 10)  # shorter than a window: one short window
    with pytest.raises(HeadkitError, match="at least 2"):
        evaluation_windows(stream[:1], 16)


def test_spread_evaluation_windows_cover_the_whole_stream_without_overlap():
    stream = torch.arange(1000, dtype=torch.int32)
    windows = evaluation_windows(stream, 16, max_tokens=70, spread=True)
    assert windows.shape == (4, 16) and windows.dtype == torch.long
    starts = windows[:, 0].tolist()
    assert starts[0] == 0 and starts[-1] == 1000 - 16  # first and last token of the stream are both evaluated
    # No token is counted twice.
    assert all(later - earlier >= 16 for earlier, later in zip(starts, starts[1:], strict=False))
    for window in windows:  # each window is a contiguous run of the stream
        assert torch.equal(window, torch.arange(int(window[0]), int(window[0]) + 16))
    # A budget that covers the stream, or no budget, is the back-to-back prefix either way.
    assert torch.equal(evaluation_windows(stream, 16, spread=True), evaluation_windows(stream, 16))
    assert evaluation_windows(stream, 16, max_tokens=16, spread=True).shape == (1, 16)
    with pytest.raises(ValueError, match="seq_len"):
        evaluation_windows(stream, 0)
