"""compare_speed alternates the two models round after round, reversing the order every other round."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headkit.evaluation import timing as measure


def test_compare_speed_reverses_the_order_every_other_round(monkeypatch):
    calls: list[tuple[str, str]] = []
    original, other = nn.Identity(), nn.Identity()
    name = {id(original): "original", id(other): "other"}

    def fake(kind, seconds):
        def measure_(model, _argument):
            calls.append((kind, name[id(model)]))
            return seconds[name[id(model)]]

        return measure_

    monkeypatch.setattr(measure, "prefill_seconds", fake("prefill", {"original": 0.2, "other": 0.1}))
    monkeypatch.setattr(
        measure, "decode_seconds_per_token", fake("decode", {"original": 0.004, "other": 0.001})
    )
    result = measure.compare_speed(
        original, other, prefill_ids=torch.zeros(1, 16, dtype=torch.long), decode_context=8, rounds=3
    )
    rounds = [c for c in calls if c[0] == "decode"]
    assert [model for _, model in rounds] == ["original", "other", "other", "original", "original", "other"]
    prefill_rounds = [c for c in calls if c[0] == "prefill"][2:]  # after the two warm-up calls
    assert [model for _, model in prefill_rounds] == [
        "original",
        "other",
        "other",
        "original",
        "original",
        "other",
    ]
    assert result["prefill_ratio"] == 0.5 and result["decode_ratio"] == 0.25


def test_decode_profile_prefills_one_logit_row_and_each_batch_holds_the_whole_prompt():
    model = _tiny_llama()
    rows = []
    forward = model.forward

    def spy(*args, **kwargs):
        output = forward(*args, **kwargs)
        rows.append((kwargs["input_ids"].shape, output.logits.shape[1]))
        return output

    model.forward = spy
    points = measure.decode_profile({"original": model}, 20, 2, batch_sizes=(1, 3, 2))
    assert rows[0] == (torch.Size([1, 20]), 1)  # the prompt's logits: its last position only
    sizes = [point["original"]["cache_bytes"] for point in points]
    assert sizes == [sizes[0], 3 * sizes[0], 2 * sizes[0]]  # the last batch size reuses the prompt's cache
    assert (
        sizes[0] == 2 * 2 * 2 * 20 * 8 * 4
    )  # layers × (keys, values) × KV heads × tokens × head width × 4 B


def _tiny_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _linearized():
    import headkit
    from headkit.surgery import LinearizeConfig

    model = _tiny_llama()
    headkit.apply_(model, LinearizeConfig(window=3, chunk_size=2))
    return model


@pytest.mark.parametrize("make", [_tiny_llama, _linearized], ids=["original", "linearized"])
def test_a_chunked_prefill_leaves_the_cache_of_the_whole_prompts(make):
    """Fed 16 tokens a forward onto the growing cache, the 40-token prompt leaves the same next token and the
    same next step (a key/value cache; a linearized model's window, sinks and linear state)."""
    from headkit.compat import cache_keyword

    model = make()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    steps = []
    for chunk in (None, 16):
        cache, token = measure.prefill(model, ids, chunk)
        with torch.no_grad():
            steps.append((token, model(input_ids=token, **cache_keyword(cache), use_cache=True).logits))
    assert torch.equal(steps[0][0], steps[1][0])
    torch.testing.assert_close(steps[1][1], steps[0][1], rtol=1e-5, atol=1e-5)

    calls = []
    forward = model.forward
    model.forward = lambda *a, **k: calls.append(k["input_ids"].shape[1]) or forward(*a, **k)
    measure.decode_profile({"m": model}, 40, 1, prefill_tokens=16)
    assert calls[:3] == [16, 16, 8]  # then the decoding steps, a token each
    assert set(calls[3:]) == {1}
