"""Fixtures the recipe tests share: a folder of text to train and measure on, and tiny saved causal LMs."""

import pytest
import torch


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    words = "heads share keys values queries groups prune recover distil attention layers tokens".split()
    generator = torch.Generator().manual_seed(0)
    for i in range(24):
        picks = torch.randint(len(words), (200,), generator=generator).tolist()
        (folder / f"doc{i}.txt").write_text(" ".join(words[j] for j in picks))
    return folder


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, save_tiny_causal_lm):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("llama") / "model", "llama")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, save_tiny_causal_lm):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("gpt2") / "model", "gpt2")
