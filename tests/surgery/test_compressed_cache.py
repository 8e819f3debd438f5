"""The compressed cache on every decoder family the registry marks linearizable: padded rows decode as each alone,
beam search runs, a reload gives identical logits, bfloat16 decodes, and the state does not grow."""

import pytest
import torch
from family_models import family_inputs, family_model

import headkit
from headkit.compat import output_cache
from headkit.surgery import CompressedCacheConfig
from headkit.surgery.families import FAMILIES, LINEARIZE
from headkit.surgery.linearize import decoding_state_bytes

FAMILY_NAMES = sorted(name for name, family in FAMILIES.items() if LINEARIZE in family.operations)
# Far smaller than the prompts and continuations below: keys are dropped from the second decoding step on.
CONFIG = CompressedCacheConfig(window=3, sinks=1, budget=2, observation=2)


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_padded_rows_decode_as_each_alone_beam_search_runs_and_the_state_is_bounded(model_type, tmp_path):
    model = family_model(model_type)
    headkit.apply_(model, CONFIG)
    prompts = family_inputs(batch=2, length=9)
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        padded = prompts.clone()
        padded[0, :3] = 0
        mask = torch.ones_like(padded)
        mask[0, :3] = 0
        together = model.generate(padded, attention_mask=mask, **options)
        alone = model.generate(padded[:1, 3:], **options)
        assert torch.equal(together[0, 3:], alone[0])
        beams = model.generate(prompts, num_beams=2, **options)
        assert beams.shape == (2, 9 + 6)
        sizes = [
            decoding_state_bytes(output_cache(model(family_inputs(batch=1, length=n), use_cache=True)))
            for n in (12, 40)
        ]
        assert sizes[0] == sizes[1] > 0
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    tokens = family_inputs(length=10)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
        low = headkit.from_pretrained(tmp_path, dtype=torch.bfloat16)
        decoded = low.generate(prompts, **options)
    assert decoded.shape == (2, 9 + 6)
