"""Perplexity of a continuation read through the cache: with a full key/value cache it is the plain forward's
perplexity of the same tokens, whatever the chunks; a quantized cache changes it, within its error; bad
arguments are refused naming them."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import headkit
from headkit.errors import HeadkitError
from headkit.evaluation.quality import continuation_perplexity
from headkit.surgery import QuantizedKVConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, save_tiny_causal_lm):
    folder = save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "llama")
    return headkit.from_pretrained(folder).eval()


def plain_continuation_perplexity(model, windows, scored):
    """exp of the mean NLL of each window's last `scored` tokens, from one forward without a cache."""
    with torch.no_grad():
        logits = model(input_ids=windows, use_cache=False).logits[:, -scored - 1 : -1]
    nats = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, -scored:].flatten(), reduction="sum")
    return math.exp(float(nats) / windows[:, -scored:].numel())


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_a_full_cache_gives_the_plain_forwards_perplexity(tiny, chunk):
    windows = torch.randint(3, tiny.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    expected = plain_continuation_perplexity(tiny, windows, 20)
    assert continuation_perplexity(tiny, windows, scored=20, chunk=chunk) == pytest.approx(expected, rel=1e-5)


def test_a_quantized_cache_changes_it_within_its_error(tiny):
    windows = torch.randint(3, tiny.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    full = continuation_perplexity(tiny, windows, scored=32, chunk=4)
    quantized = copy.deepcopy(tiny)
    headkit.apply_(quantized, QuantizedKVConfig(bits=4, group_size=8, residual=0))
    got = continuation_perplexity(quantized, windows, scored=32, chunk=4)
    assert got != full  # the continuation reads 4-bit keys and values
    assert got == pytest.approx(full, rel=0.2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scored": 0}, r"scored must be an integer in \[1, 47\]"),
        ({"scored": 48}, r"scored must be an integer in \[1, 47\]"),
        ({"scored": 8, "chunk": 0}, "chunk must be a positive integer"),
    ],
)
def test_bad_arguments_are_refused_naming_them(tiny, options, message):
    with pytest.raises(HeadkitError, match=message):
        continuation_perplexity(tiny, torch.zeros(1, 48, dtype=torch.long), **options)
