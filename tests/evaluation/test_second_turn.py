"""A passkey asked in a second turn: with a full key/value cache, splitting the prompt into two prefills changes
no answer; a turn that would cut the key is refused; the key-beyond-the-window test."""

import pytest

import headkit
from headkit.errors import HeadkitError
from headkit.evaluation.retrieval import (
    key_beyond_window,
    passkey_trials,
    retrieve_passkeys,
    second_turn_passkeys,
)

SENTENCES = [
    "The river runs past the old mill and into the valley below.",
    "Every morning the baker opens the shop before the sun is up.",
    "A small boat waits at the end of the wooden pier.",
    "The library keeps its rarest books in a cold quiet room.",
    "Children play in the square while their parents talk.",
] * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, save_tiny_causal_lm):
    import transformers

    folder = save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "llama")
    return headkit.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


def trials(tokenizer):
    return passkey_trials(tokenizer, SENTENCES, 160, 4, (0.0, 0.2), seed=3)


def test_a_full_cache_answers_the_second_turn_as_the_first(tiny):
    model, tokenizer = tiny
    made = trials(tokenizer)
    assert all(key_beyond_window(t, 64) for t in made) and not any(key_beyond_window(t, 160) for t in made)
    together = retrieve_passkeys(model, tokenizer, made, max_new_tokens=6)
    assert second_turn_passkeys(model, tokenizer, made, gap=50, max_new_tokens=6) == together


def test_a_turn_that_would_cut_the_key_is_refused(tiny):
    model, tokenizer = tiny
    with pytest.raises(HeadkitError, match="a second turn of 150 tokens must start after the key"):
        second_turn_passkeys(model, tokenizer, trials(tokenizer), gap=150)
