"""The compressed cache that keeps what the model reads to repeat the prompt (KVzip): the keys kept are the top of
the original model's own attention from the repetition (eager attention's weights, chunked as the prefill
chunks), a second turn is scored by its own queries, padded rows decode as each alone, a reload rebuilds the
scoring, and bad settings are refused."""

import pytest
import torch
from family_models import family_inputs, family_model

import headkit
from headkit.compat import output_cache
from headkit.errors import HeadkitError
from headkit.surgery import CompressedCacheConfig, LinearizeConfig
from headkit.surgery import reconstruction as reconstruction_module
from headkit.surgery.families import FAMILIES, LINEARIZE
from headkit.surgery.linearize import linearized_modules
from headkit.surgery.reconstruction import REPETITION_CHUNK, repetition_chunks

FAMILY_NAMES = sorted(name for name, family in FAMILIES.items() if LINEARIZE in family.operations)
PROMPT = (5, 6, 7)
CONFIG = CompressedCacheConfig(
    window=3, sinks=1, budget=3, observation=2, selection="reconstruction", reconstruction_prompt=PROMPT
)


def reference_scores(model_type: str, ids: torch.Tensor, chunks: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Per layer [B, Hkv, n]: the most attention any query of the repetition gives each prompt key, read off the
    original model's eager attention weights, the most over the chunks' forwards."""
    original = family_model(model_type, attn_implementation="eager")
    n, request = ids.shape[1], torch.tensor(PROMPT).expand(ids.shape[0], -1)
    best: list[torch.Tensor] = []
    for start, stop in chunks:
        sequence = torch.cat([ids, request, ids[:, start:stop]], dim=1)
        with torch.no_grad():
            attentions = original(sequence, output_attentions=True).attentions
        for layer, weights in enumerate(attentions):
            kv_heads = original.config.num_key_value_heads
            per_query_head = weights[:, :, n + len(PROMPT) :, :n].amax(dim=2)  # [B, H, n]
            scores = per_query_head.unflatten(1, (kv_heads, -1)).amax(dim=2)
            best.append(scores) if len(best) <= layer else best.__setitem__(
                layer, torch.maximum(best[layer], scores)
            )
    return best


def kept_scores(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    return [layer.state.sparse_scores for layer in cache.layers if hasattr(layer, "state")]


@pytest.mark.parametrize("chunk", [REPETITION_CHUNK, 4])
def test_the_kept_keys_are_those_the_repetition_attends_to_most(chunk, monkeypatch):
    monkeypatch.setattr(reconstruction_module, "REPETITION_CHUNK", chunk)
    ids = family_inputs(batch=2, length=12)
    model = family_model("llama")
    headkit.apply_(model, CONFIG)
    kept = kept_scores(model, ids)
    chunks = repetition_chunks(12, len(PROMPT), model.config.max_position_embeddings)
    assert len(chunks) == (1 if chunk == REPETITION_CHUNK else 3)
    # The budget's candidates: past the sink, before the window's last W − 1 = 2 tokens.
    for got, expected in zip(kept, reference_scores("llama", ids, chunks), strict=True):
        top = expected[..., 1:10].topk(CONFIG.budget, dim=-1).values.sort(dim=-1).values
        torch.testing.assert_close(got.sort(dim=-1).values.float(), top, rtol=1e-4, atol=1e-6)
    # The question's choice keeps other keys here: the test can tell the two apart.
    question = family_model("llama")
    headkit.apply_(question, CompressedCacheConfig(window=3, sinks=1, budget=3, observation=2))
    assert any(
        not torch.equal(a.sort(-1).values, b.sort(-1).values)
        for a, b in zip(kept, kept_scores(question, ids), strict=True)
    )


def test_a_second_turn_is_scored_by_its_own_queries_and_no_score_is_left_behind():
    model = family_model("llama")
    headkit.apply_(model, CONFIG)
    ids = family_inputs(batch=1, length=16)
    selections = [module.kept.selection for module in linearized_modules(model)]
    calls = []
    original_score = reconstruction_module.ReconstructionPrefill.score

    def counting(self, *args, **kwargs):
        calls.append(args[2].shape if args[2] is not None else None)
        return original_score(self, *args, **kwargs)

    reconstruction_module.ReconstructionPrefill.score = counting
    try:
        with torch.no_grad():
            cache = output_cache(model(ids[:, :10], use_cache=True))
            model(
                ids[:, 10:], use_cache=True, **headkit.compat.cache_keyword(cache)
            )  # a later turn: no scoring
            model(ids, use_cache=False)  # no cache: nothing to choose
            model(ids[:, :1], use_cache=True)  # one token: nothing to choose
    finally:
        reconstruction_module.ReconstructionPrefill.score = original_score
    assert calls == [torch.Size([1, 10])]
    assert all(selection.pending is None and selection.scoring is None for selection in selections)


def test_a_failed_prefill_leaves_no_score(monkeypatch):
    model = family_model("llama")
    headkit.apply_(model, CONFIG)
    selections = [module.kept.selection for module in linearized_modules(model)]

    def failing(*args, **kwargs):
        raise RuntimeError("lm head failed")

    monkeypatch.setattr(model.lm_head, "forward", failing)
    with pytest.raises(RuntimeError, match="lm head failed"), torch.no_grad():
        model(family_inputs(batch=1, length=12), use_cache=True)
    assert all(selection.pending is None and selection.scoring is None for selection in selections)


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_padded_rows_decode_as_each_alone_and_a_reload_scores_the_same(model_type, tmp_path):
    model = family_model(model_type)
    headkit.apply_(model, CONFIG)
    prompts = family_inputs(batch=2, length=11)
    options = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    padded, mask = prompts.clone(), torch.ones_like(prompts)
    padded[0, :3], mask[0, :3] = 0, 0
    with torch.no_grad():
        together = model.generate(padded, attention_mask=mask, **options)
        alone = model.generate(padded[:1, 3:], **options)
    assert torch.equal(together[0, 3:], alone[0])
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    for got, expected in zip(kept_scores(reloaded, prompts), kept_scores(model, prompts), strict=True):
        assert torch.equal(got, expected)
    with torch.no_grad():
        assert torch.equal(reloaded.generate(prompts, **options), model.generate(prompts, **options))
        beams = reloaded.generate(prompts, num_beams=2, **options)
        low = headkit.from_pretrained(tmp_path, dtype=torch.bfloat16).generate(prompts, **options)
    assert beams.shape == low.shape == (2, 11 + 5)


def test_repetition_chunks_fit_the_context():
    assert repetition_chunks(10, 3, 100) == [(0, 10)]
    assert repetition_chunks(4096, 10, 8192) == [(0, 2048), (2048, 4096)]
    assert repetition_chunks(6000, 10, 8192) == [(0, 2000), (2000, 4000), (4000, 6000)]
    assert repetition_chunks(5, 0, None) == [(0, 5)]
    assert repetition_chunks(7000, 10, 8192) == [
        (start, min(start + 1167, 7000)) for start in range(0, 7000, 1167)
    ]
    assert repetition_chunks(3584, 10, 8192) == [(0, 3584)]
    # Less room than SHORTEST_CHUNK: the repetition runs past the context, REPETITION_CHUNK tokens a forward at most.
    assert repetition_chunks(8100, 10, 8192) == [(0, 4050), (4050, 8100)]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"selection": "recall"}, "selection must be one of question, reconstruction"),
        ({"reconstruction_prompt": (1, -2)}, "reconstruction_prompt must be token ids"),
        ({"reconstruction_prompt": "repeat"}, "reconstruction_prompt must be token ids"),
    ],
)
def test_bad_settings_are_named(options, match):
    with pytest.raises(HeadkitError, match=match):
        CompressedCacheConfig(**options)


def test_a_linear_state_cannot_choose_by_reconstruction():
    with pytest.raises(HeadkitError, match="needs fold=False"):
        LinearizeConfig(budget=4, selection="reconstruction")


def test_a_prompt_given_as_embeddings_keeps_the_keys_its_ids_keep():
    model = family_model("llama")
    headkit.apply_(model, CONFIG)
    ids = family_inputs(batch=2, length=12)
    with torch.no_grad():
        cache = output_cache(model(inputs_embeds=model.get_input_embeddings()(ids), use_cache=True))
    from_embeddings = [layer.state.sparse_scores for layer in cache.layers]
    for got, expected in zip(from_embeddings, kept_scores(model, ids), strict=True):
        torch.testing.assert_close(got, expected)


def test_a_linearized_layer_that_drops_can_choose_by_reconstruction_too(tmp_path):
    """`headkit linearize --drop --selection reconstruction` and reconfigure(): the same scoring, no request."""
    ids = family_inputs(batch=2, length=12)
    linearized = family_model("llama")
    headkit.apply_(
        linearized, LinearizeConfig(window=3, sinks=1, budget=3, fold=False, selection="reconstruction")
    )
    compressed = family_model("llama")
    headkit.apply_(compressed, CompressedCacheConfig(window=3, sinks=1, budget=3, selection="reconstruction"))
    for got, expected in zip(kept_scores(linearized, ids), kept_scores(compressed, ids), strict=True):
        assert torch.equal(got, expected)
    question = family_model("llama")
    headkit.apply_(question, LinearizeConfig(window=3, sinks=1, budget=3, fold=False, selection="question"))
    headkit.surgery.linearize.reconfigure(question, selection="reconstruction")
    for got, expected in zip(kept_scores(question, ids), kept_scores(compressed, ids), strict=True):
        assert torch.equal(got, expected)
    linearized.save_pretrained(tmp_path)
    for got, expected in zip(
        kept_scores(headkit.from_pretrained(tmp_path), ids), kept_scores(compressed, ids), strict=True
    ):
        assert torch.equal(got, expected)
