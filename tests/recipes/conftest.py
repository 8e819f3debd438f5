"""Fixtures the recipe tests share: tiny saved causal LMs."""

import pytest


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, save_tiny_causal_lm):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("llama") / "model", "llama")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, save_tiny_causal_lm):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("gpt2") / "model", "gpt2")
