"""HeadkitModel / HeadkitForCausalLM / HeadkitForSequenceClassification: caching, generation, losses, I/O."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, DynamicCache

from headkit.compat import cache_keyword, output_cache
from headkit.layers import HeadkitCache, StateCacheLayer, get_attention_class
from headkit.models import HeadkitForCausalLM, HeadkitForSequenceClassification

RUNNING_MEAN = "test_running_mean"  # the toy recurrent layer registered by the running_mean fixture

VARIANTS = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2, "tie_word_embeddings": False},
    "learned_positions": {"position_embedding_type": "learned", "mlp_type": "plain", "hidden_act": "gelu"},
    "hybrid_recurrent": {"layer_types": ["softmax", RUNNING_MEAN], "num_key_value_heads": 2},
    "all_recurrent": {"layer_types": [RUNNING_MEAN, RUNNING_MEAN], "position_embedding_type": "none"},
    # The shipped mechanisms; the prefill of 70 below is longer than one chunk (chunk_size 64).
    "linear": {"attention": "linear", "num_key_value_heads": 2},
    "additive_conv": {"attention": "additive", "convolve": True, "conv_kernel_size": 3, "conv_groups": 2},
    "additive_window": {"attention": "additive", "additive_window": 5, "position_embedding_type": "learned"},
    "coca": {"attention": "coca", "num_key_value_heads": 2},
    "collaborative": {"attention": "collaborative", "dim_shared_query_key": 16, "attention_bias": True},
    "hybrid_linear_softmax": {"layer_types": ["linear", "softmax"]},
    # LoLCATs' sliding-window + linear attention; the prefill of 70 also crosses its window many times.
    "lolcats": {"attention": "hybrid", "num_key_value_heads": 2, "hybrid_window": 8},
}


@pytest.fixture(params=sorted(VARIANTS))
def variant_config(request, make_config, running_mean):
    assert running_mean == RUNNING_MEAN
    return make_config(**VARIANTS[request.param])


def make_model(config, seed: int = 0, model_class=HeadkitForCausalLM):
    torch.manual_seed(seed)
    return model_class(config).eval()


def left_padded(batch_ids: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(ids) for ids in batch_ids)
    ids = torch.full((len(batch_ids), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch_ids), longest, dtype=torch.long)
    for row, sample in enumerate(batch_ids):
        ids[row, longest - len(sample) :] = sample
        mask[row, longest - len(sample) :] = 1
    return ids, mask


# --- save / load ---------------------------------------------------------------------------------------------


def test_save_pretrained_roundtrip_gives_identical_logits(variant_config, tmp_path):
    model = make_model(variant_config)
    ids = torch.randint(1, variant_config.vocab_size, (2, 9))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HeadkitForCausalLM
    assert loaded.config.layer_types == variant_config.layer_types
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_auto_classes_load_the_base_model_and_a_classifier(make_config, tmp_path):
    model = make_model(make_config())
    ids = torch.randint(1, 97, (2, 6))
    model.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path).eval()
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3).eval()
    assert type(classifier) is HeadkitForSequenceClassification
    with torch.no_grad():
        assert torch.equal(base(ids).last_hidden_state, model.model(ids).last_hidden_state)
        assert classifier(ids).logits.shape == (2, 3)


def test_tied_and_untied_word_embeddings(make_config):
    tied = make_model(make_config(tie_word_embeddings=True))
    untied = make_model(make_config(tie_word_embeddings=False))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


# --- incremental decoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill", [5, 70])
@pytest.mark.parametrize("padding", [False, True])
def test_incremental_decoding_equals_full_forward(variant_config, prefill, padding):
    model = make_model(variant_config)
    total = prefill + 4
    ids = torch.randint(1, variant_config.vocab_size, (2, total))
    mask = torch.ones(2, total, dtype=torch.long)
    if padding:
        mask[0, :3] = 0
        ids[0, :3] = 0

    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        cache = HeadkitCache(model)
        steps = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], cache=cache).logits]
        for t in range(prefill, total):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits)
    incremental = torch.cat(steps, dim=1)
    assert cache.get_seq_length() == total
    torch.testing.assert_close(incremental, full, atol=1e-4, rtol=0)


def test_model_creates_and_returns_its_cache(variant_config):
    model = make_model(variant_config)
    ids = torch.randint(1, variant_config.vocab_size, (2, 7))
    with torch.no_grad():
        output = model(ids, use_cache=True)
    cache = output_cache(output)
    assert isinstance(cache, HeadkitCache)
    assert cache.get_seq_length() == 7
    expected_recurrent = [
        issubclass(get_attention_class(variant_config.attention_type(i)).cache_layer_class, StateCacheLayer)
        for i in range(2)
    ]
    assert [isinstance(layer, StateCacheLayer) for layer in cache.layers] == expected_recurrent
    with torch.no_grad():
        assert output_cache(model(ids, use_cache=False)) is None


def test_a_dynamic_cache_serves_a_softmax_model(make_config):
    model = make_model(make_config(num_key_value_heads=2))
    ids = torch.randint(1, 97, (1, 8))
    with torch.no_grad():
        headkit_cache, dynamic_cache = HeadkitCache(model), DynamicCache()
        model(ids[:, :6], cache=headkit_cache)
        model(ids[:, :6], cache=dynamic_cache)
        expected = model(ids[:, 6:], cache=headkit_cache).logits
        actual = model(ids[:, 6:], cache=dynamic_cache).logits
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


def test_recurrent_layers_refuse_other_caches(make_config, running_mean):
    model = make_model(make_config(layer_types=["softmax", running_mean]))
    ids = torch.randint(1, 97, (1, 4))
    with pytest.raises(ValueError, match="HeadkitCache"):
        model(ids, cache=DynamicCache())
    with pytest.raises(ValueError, match="layers"):
        model(ids, cache=HeadkitCache(make_model(make_config(num_hidden_layers=3))))
    with pytest.raises(ValueError, match="StateCacheLayer"):
        model(ids, cache=HeadkitCache(make_model(make_config())))


def test_decoding_masks_must_cover_the_cached_tokens(make_config):
    model = make_model(make_config())
    cache = HeadkitCache(model)
    with torch.no_grad():
        model(torch.ones(1, 4, dtype=torch.long), cache=cache)
        with pytest.raises(
            ValueError, match="cover the 4 cached tokens and the 1 new ones: shape \\[1, 5\\]"
        ):
            model(torch.ones(1, 1, dtype=torch.long), attention_mask=torch.ones(1, 1), cache=cache)


def test_the_cache_is_taken_under_either_name_and_given_once(make_config):
    # transformers 5.24 renamed past_key_values to cache; generate() of either release, and user code written for
    # either, must reach the same cache. Both at once is ambiguous, as in transformers' own models.
    model = make_model(make_config(layer_types=["softmax", "linear"]))
    ids = torch.randint(1, 97, (2, 9))
    with torch.no_grad():
        new_name, old_name = HeadkitCache(model), HeadkitCache(model)
        model(ids[:, :6], cache=new_name)
        model(ids[:, :6], past_key_values=old_name)
        assert new_name.get_seq_length() == old_name.get_seq_length() == 6
        expected = model(ids[:, 6:], cache=new_name).logits
        actual = model(ids[:, 6:], past_key_values=old_name).logits
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
        with pytest.raises(ValueError, match="not both"):
            model(ids, cache=HeadkitCache(model), past_key_values=HeadkitCache(model))


def test_cache_with_use_cache_false_is_an_error(make_config):
    model = make_model(make_config())
    with pytest.raises(ValueError, match="use_cache=False"):
        model(torch.ones(1, 3, dtype=torch.long), cache=HeadkitCache(model), use_cache=False)


# --- generate() ----------------------------------------------------------------------------------------------


def test_greedy_generate_equals_manual_argmax_loop(variant_config):
    model = make_model(variant_config)
    ids = torch.randint(1, variant_config.vocab_size, (2, 6))
    generated = model.generate(ids, max_new_tokens=8, do_sample=False)

    manual = ids
    with torch.no_grad():
        for _ in range(8):
            next_token = model(manual, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            manual = torch.cat([manual, next_token], dim=1)
    assert torch.equal(generated, manual)


def test_generation_continues_from_a_user_cache(variant_config):
    model = make_model(variant_config)
    ids = torch.randint(1, variant_config.vocab_size, (2, 5))
    in_one_go = model.generate(ids, max_new_tokens=8, do_sample=False)
    cache = HeadkitCache(model)
    first_half = model.generate(ids, **cache_keyword(cache), max_new_tokens=4, do_sample=False)
    assert cache.get_seq_length() == 5 + 3  # the last generated token is not fed yet
    continued = model.generate(first_half, **cache_keyword(cache), max_new_tokens=4, do_sample=False)
    assert torch.equal(continued, in_one_go)


def test_batched_left_padded_generation_equals_per_sample_generation(variant_config):
    model = make_model(variant_config)
    prompts = [torch.randint(1, variant_config.vocab_size, (n,)) for n in (3, 7, 5)]
    ids, mask = left_padded(prompts)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=6, do_sample=False)
        assert torch.equal(batched[row, ids.shape[1] :], alone[0, len(prompt) :])


def test_sampling_is_seeded_and_respects_max_new_tokens(variant_config):
    model = make_model(variant_config)
    ids = torch.randint(1, variant_config.vocab_size, (2, 4))

    def sample(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return model.generate(ids, max_new_tokens=12, do_sample=True, top_k=0, temperature=1.5)

    first, again, other = sample(1), sample(1), sample(2)
    assert first.shape == (2, 4 + 12)
    assert torch.equal(first[:, :4], ids)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert int(first.max()) < variant_config.vocab_size


def test_beam_search_reorders_recurrent_states(make_config, running_mean):
    # Beam search reorders the cache every step; a wrong reorder would make the best beam's score disagree
    # with a fresh forward pass over the returned sequence.
    model = make_model(make_config(layer_types=[running_mean, "softmax"]))
    ids = torch.randint(1, 97, (1, 5))
    result = model.generate(
        ids, max_new_tokens=5, num_beams=3, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    sequence = result.sequences[0]
    with torch.no_grad():
        log_probs = model(sequence[None], use_cache=False).logits.log_softmax(-1)[0]
    new_tokens = sequence[5:]
    rescored = log_probs[4 : 4 + len(new_tokens)].gather(-1, new_tokens[:, None]).sum()
    torch.testing.assert_close(result.sequences_scores[0] * len(new_tokens), rescored, atol=1e-4, rtol=0)


def test_generate_needs_a_causal_model(make_config):
    model = make_model(make_config(causal=False))
    with pytest.raises(ValueError, match="causal"):
        model.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)


# --- positions and padding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned"])
def test_left_padding_does_not_shift_positions(make_config, position_embedding_type):
    model = make_model(make_config(position_embedding_type=position_embedding_type))
    prompt = torch.randint(1, 97, (6,))
    ids, mask = left_padded([prompt, torch.randint(1, 97, (9,))])
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits[0, 3:]
        alone = model(prompt[None]).logits[0]
        # Without the mask the pads count as tokens: positions shift and the logits change.
        shifted = model(ids).logits[0, 3:]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)
    assert (shifted - alone).abs().max() > 1e-3


def test_non_causal_model_sees_the_future(make_config):
    causal = make_model(make_config(causal=True))
    bidirectional = make_model(make_config(causal=False))
    ids = torch.randint(1, 97, (1, 6))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] % 96) + 1
    with torch.no_grad():
        assert torch.equal(causal(ids).logits[:, 0], causal(changed).logits[:, 0])
        assert not torch.allclose(bidirectional(ids).logits[:, 0], bidirectional(changed).logits[:, 0])


def test_learned_positions_reject_inputs_beyond_the_table(make_config):
    model = make_model(make_config(position_embedding_type="learned", max_position_embeddings=8))
    model(torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        model(torch.ones(1, 9, dtype=torch.long))


def test_inputs_embeds_equal_input_ids(make_config):
    model = make_model(make_config())
    ids = torch.randint(1, 97, (2, 5))
    with torch.no_grad():
        from_ids = model(ids).logits
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
    assert torch.equal(from_ids, from_embeds)


def test_output_attentions_and_hidden_states(make_config, running_mean):
    model = make_model(make_config(layer_types=["softmax", running_mean]))
    ids = torch.randint(1, 97, (2, 5))
    with torch.no_grad():
        output = model(ids, output_attentions=True, output_hidden_states=True)
        plain = model(ids)
    softmax_weights, recurrent_weights = output.attentions
    assert softmax_weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(softmax_weights.sum(-1), torch.ones(2, 4, 5))
    assert torch.all(softmax_weights.triu(1) == 0)
    assert recurrent_weights is None
    assert len(output.hidden_states) == 3
    torch.testing.assert_close(output.logits, plain.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(model.lm_head(output.hidden_states[-1]), plain.logits, atol=1e-6, rtol=0)


def test_return_dict_false_gives_a_tuple(make_config):
    model = make_model(make_config())
    ids = torch.randint(1, 97, (1, 4))
    with torch.no_grad():
        logits = model(ids, return_dict=False, use_cache=False)[0]
        assert torch.equal(logits, model(ids).logits)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention_mask": torch.ones(2, 4, dtype=torch.long)}, "attention_mask"),
        ({"attention_mask": torch.ones(2, 5)}, "attention_mask"),
        ({"position_ids": torch.arange(4)[None]}, "position_ids"),
        ({"position_ids": torch.zeros(2, 5)}, "position_ids"),
        ({"inputs_embeds": torch.zeros(2, 5, 32)}, "exactly one"),
        ({"past_key_values": ((torch.zeros(1), torch.zeros(1)),)}, "HeadkitCache"),
    ],
)
def test_bad_inputs_raise_value_error(make_config, kwargs, message):
    model = make_model(make_config())
    with pytest.raises(ValueError, match=message):
        model(torch.ones(2, 5, dtype=torch.long), **kwargs)


# --- losses --------------------------------------------------------------------------------------------------


def manual_shifted_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """Mean over labelled positions of (1 − ε)·NLL + ε·mean_k(−log p_k), predicting labels[t + 1] at t."""
    losses = []
    for row in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[row, t + 1])
            if target == -100:
                continue
            log_probs = logits[row, t].double().log_softmax(-1)
            losses.append((1 - smoothing) * -log_probs[target] + smoothing * -log_probs.mean())
    return torch.stack(losses).mean()


def test_labels_give_the_shifted_cross_entropy_and_stay_unchanged(make_config):
    model = make_model(make_config())
    ids = torch.randint(1, 97, (2, 7))
    labels = ids.clone()
    labels[0, 2:4] = -100
    labels_before, ids_before = labels.clone(), ids.clone()
    output = model(ids, labels=labels)
    expected = manual_shifted_loss(output.logits.detach(), labels)
    torch.testing.assert_close(output.loss.double(), expected, atol=1e-5, rtol=0)
    assert torch.equal(labels, labels_before) and torch.equal(ids, ids_before)


def test_label_smoothing_applies_in_training_only(make_config):
    model = make_model(make_config(label_smoothing=0.2))
    ids = torch.randint(1, 97, (2, 6))
    model.train()
    train_output = model(ids, labels=ids)
    model.eval()
    eval_output = model(ids, labels=ids)
    logits = eval_output.logits.detach()
    torch.testing.assert_close(
        train_output.loss.double(), manual_shifted_loss(logits, ids, 0.2), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(eval_output.loss.double(), manual_shifted_loss(logits, ids), atol=1e-5, rtol=0)


def test_num_items_in_batch_sums_then_divides(make_config):
    model = make_model(make_config())
    ids = torch.randint(1, 97, (2, 6))
    mean_loss = model(ids, labels=ids).loss
    summed_over_20 = model(ids, labels=ids, num_items_in_batch=20).loss
    torch.testing.assert_close(summed_over_20 * 20, mean_loss * 10)


@pytest.mark.parametrize(
    "labels, message",
    [
        (torch.zeros(2, 5, dtype=torch.long), "shape"),
        (torch.zeros(2, 7), "integer"),
        (torch.zeros(1, 6, dtype=torch.long), "shape"),
    ],
)
def test_bad_labels_raise_value_error(make_config, labels, message):
    model = make_model(make_config())
    with pytest.raises(ValueError, match=message):
        model(torch.ones(2, 6, dtype=torch.long), labels=labels)


def test_gradient_checkpointing_gives_the_same_gradients(make_config):
    model = make_model(make_config(num_key_value_heads=2))
    model.train()
    ids = torch.randint(1, 97, (2, 6))
    plain = torch.autograd.grad(model(ids, labels=ids).loss, list(model.parameters()))
    # activation_checkpointing_enable from transformers 5.24; gradient_checkpointing_enable, its old name, before
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = torch.autograd.grad(model(ids, labels=ids).loss, list(model.parameters()))
    for expected, actual in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


# --- sequence classification ---------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_classification_pools_the_last_real_token(make_config, side):
    config = make_config(num_labels=3)
    model = make_model(config, model_class=HeadkitForSequenceClassification)
    short, long = torch.randint(1, 97, (4,)), torch.randint(1, 97, (7,))
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    ids[1], mask[1] = long, 1
    if side == "left":
        ids[0, 3:], mask[0, 3:] = short, 1
    else:
        ids[0, :4], mask[0, :4] = short, 1
    labels = torch.tensor([2, 0])
    output = model(ids, attention_mask=mask, labels=labels)
    with torch.no_grad():
        alone = torch.cat([model(short[None]).logits, model(long[None]).logits])
        from_pad_id = model(ids).logits
    torch.testing.assert_close(output.logits.detach(), alone, atol=1e-5, rtol=0)
    if side == "right":
        # Without a mask the pad token id marks padding; right padding is invisible to a causal model.
        torch.testing.assert_close(from_pad_id, alone, atol=1e-5, rtol=0)
    expected_loss = -output.logits.detach().double().log_softmax(-1)[torch.arange(2), labels].mean()
    torch.testing.assert_close(output.loss.double(), expected_loss, atol=1e-6, rtol=0)
    loss_gradient = torch.autograd.grad(output.loss, model.score.weight)[0]
    assert loss_gradient.abs().sum() > 0


def test_sequence_classification_rejects_mismatched_labels(make_config):
    model = make_model(make_config(num_labels=2), model_class=HeadkitForSequenceClassification)
    with pytest.raises(ValueError, match="labels"):
        model(torch.ones(2, 4, dtype=torch.long), labels=torch.tensor([1, 0, 1]))


def test_model_outputs_are_finite_for_loss_gradients(make_config):
    # The loss gradient reaches every parameter (nothing is accidentally detached).
    model = make_model(make_config(num_key_value_heads=2))
    ids = torch.randint(1, 97, (2, 6))
    gradients = torch.autograd.grad(model(ids, labels=ids).loss, list(model.parameters()))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in gradients)


def test_f_cross_entropy_agrees_with_the_manual_reference(make_config):
    # Guards the manual reference itself: it must match torch's definition of smoothing.
    logits = torch.randn(1, 4, 11)
    labels = torch.randint(0, 11, (1, 4))
    torch_loss = F.cross_entropy(logits[0, :-1], labels[0, 1:], label_smoothing=0.3)
    torch.testing.assert_close(
        manual_shifted_loss(logits, labels, 0.3), torch_loss.double(), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_its_formula_in_values_and_gradients(dtype):
    """The fused float32 path (F.rms_norm) and the upcasting path both equal x / √(mean(x²) + ε) · g."""
    from headkit.models.modeling_headkit import HeadkitRMSNorm

    torch.manual_seed(0)
    norm = HeadkitRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = (torch.randn(3, 5, 48) * 3).to(dtype).requires_grad_(True)
    out = norm(x)
    reference_x = x.detach().double().requires_grad_(True)
    reference_weight = norm.weight.detach().double().requires_grad_(True)
    reference = reference_weight * reference_x * torch.rsqrt(reference_x.pow(2).mean(-1, keepdim=True) + 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference, atol=tolerance, rtol=tolerance)
    grad = torch.randn_like(reference)
    out.backward(grad.to(dtype))
    reference.backward(grad)
    torch.testing.assert_close(x.grad.double(), reference_x.grad, atol=tolerance * 10, rtol=tolerance * 10)
    torch.testing.assert_close(
        norm.weight.grad.double(), reference_weight.grad, atol=tolerance * 10, rtol=tolerance * 10
    )
