"""The measurements' forwards capped at a number of logits, and the agreement's KL taken a slice of positions at
a time: perplexity and agreement the same as in one forward."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery"))
from family_models import family_model  # noqa: E402

import headkit.evaluation.quality as quality  # noqa: E402


def test_capped_forwards_give_the_same_perplexity_and_agreement(monkeypatch):
    model, reference = family_model("llama").double(), family_model("qwen3").double()
    windows = torch.randint(3, 100, (5, 12))
    whole = quality.perplexity(model, windows, batch_size=8), quality.agreement(model, reference, windows, 8)
    seen = []
    forward = model.forward
    monkeypatch.setattr(
        model, "forward", lambda *a, **k: seen.append(k["input_ids"].shape[0]) or forward(*a, **k)
    )
    monkeypatch.setattr(quality, "LOGIT_ENTRIES", 1)  # one row a forward
    monkeypatch.setattr(quality, "KL_SLICE_ENTRIES", 7)  # the KL's softmaxes one position at a time
    capped = quality.perplexity(model, windows, batch_size=8), quality.agreement(model, reference, windows, 8)
    assert set(seen) == {1}
    assert capped[0] == pytest.approx(whole[0], rel=1e-5)  # float32 sums
    assert capped[1].top1 == whole[1].top1 and capped[1].kl == pytest.approx(whole[1].kl, rel=1e-5)


def test_the_agreements_kl_is_the_mean_over_positions_of_the_plain_kl():
    model, reference = family_model("llama").double(), family_model("qwen3").double()
    windows = torch.randint(3, 100, (3, 10))
    with torch.no_grad():
        got, expected = model(input_ids=windows).logits, reference(input_ids=windows).logits
    plain = (expected.softmax(-1) * (expected.log_softmax(-1) - got.log_softmax(-1))).sum(-1).mean()
    measured = quality.agreement(model, reference, windows, 8)
    assert measured.kl == pytest.approx(float(plain), rel=1e-5)  # the agreement computes in float32
    assert measured.top1 == float((got.argmax(-1) == expected.argmax(-1)).double().mean())
