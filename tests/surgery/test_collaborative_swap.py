import copy

import pytest
import torch
import transformers
from collab_models import (
    SWAPPABLE,
    assert_untouched,
    minilm_dir,
    model_inputs,
    state_snapshot,
    tiny_model,
    valid_positions,
)

import headkit.surgery.collaborative as collaborative
from headkit.compat import cache_keyword, output_cache
from headkit.errors import HeadkitError
from headkit.layers.collaborative import collaborative_head_outputs
from headkit.ops.collaborative import naive_collaborative_attention
from headkit.surgery.adapters import (
    ALBERTCollaborativeAdapter,
    BERTCollaborativeAdapter,
    DistilBERTCollaborativeAdapter,
    get_adapter,
)
from headkit.surgery.attention import mechanism_of
from headkit.surgery.collaborative import (
    CollaborativeHeads,
    FusedSharedProjection,
    SharedProjection,
    model_attention_mask,
    swap_to_collaborative,
)

REFERENCE_ADAPTERS = {
    "bert": BERTCollaborativeAdapter,
    "distilbert": DistilBERTCollaborativeAdapter,
    "albert": ALBERTCollaborativeAdapter,
}


def _forward(model, inputs, **kwargs):
    with torch.no_grad():
        return model(**inputs, **kwargs)


def _eager_copy(model):
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    return reference


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", SWAPPABLE)
def test_full_size_swap_is_exact(kind, attn_implementation):
    model = tiny_model(kind, attn_implementation)
    inputs = model_inputs(kind)
    expected = _forward(_eager_copy(model), inputs, output_attentions=True)

    adapter = REFERENCE_ADAPTERS.get(kind)  # positional adapter class, as in the reference package
    report = (
        swap_to_collaborative(model, adapter, dim_shared_query_key=32)
        if adapter
        else swap_to_collaborative(model, dim_shared_query_key=32)
    )
    assert report.max_relative_error < 1e-6 and all(site.exact for site in report.sites)
    stock = type(_eager_copy(tiny_model(kind)).get_submodule(report.sites[0].name))
    for site in get_adapter(model).sites(model):  # the stock module, with its mechanism
        assert type(site.module) is stock and isinstance(mechanism_of(site.module), CollaborativeHeads)
        assert site.is_headkit and (site.num_heads, site.num_kv_heads, site.head_dim) == (4, 4, 8)
    assert model.config._attn_implementation == f"headkit_{attn_implementation}"

    plain = _forward(model, inputs).last_hidden_state
    with_weights = _forward(model, inputs, output_attentions=True)
    keep = valid_positions(inputs, plain)
    assert (plain - expected.last_hidden_state)[keep].abs().max() < 1e-5
    assert (with_weights.last_hidden_state - expected.last_hidden_state)[keep].abs().max() < 1e-5
    if kind == "gpt2" and attn_implementation == "sdpa":
        # GPT-2 drops output_attentions before its attention modules, which return weights only where the base
        # implementation does (eager), like the stock model under sdpa.
        assert with_weights.attentions == () and _forward(tiny_model(kind, "sdpa"), inputs).attentions is None
        return
    # output_attentions works under every implementation for the encoders, which pass the flag on.
    assert len(with_weights.attentions) == len(expected.attentions) == (3 if kind == "albert" else 2)
    for got, want in zip(with_weights.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_full_size_swap_of_the_real_minilm():
    model_dir = minilm_dir()
    model = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = (
        "Collaborative heads share one query and one key projection, and each head re-weights the shared "
        "dimensions with its own mixing vector, so that the layer needs fewer parameters for the same scores."
    )
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    input_ids = torch.full((3, 25), tokenizer.pad_token_id)
    attention_mask = torch.zeros(3, 25, dtype=torch.long)
    for row, length in enumerate((25, 10, 3)):
        input_ids[row, :length] = torch.tensor(
            [tokenizer.cls_token_id, *tokens[: length - 2], tokenizer.sep_token_id]
        )
        attention_mask[row, :length] = 1
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    expected = _forward(model, inputs).last_hidden_state

    report = swap_to_collaborative(model, dim_shared_query_key=384)
    assert len(report.sites) == 6 and report.max_relative_error < 1e-6
    got = _forward(model, inputs).last_hidden_state
    assert (got - expected)[attention_mask.bool()].abs().max() < 1e-5


def _exact_rank_bert(rank: int):
    """A tiny BERT whose heads' bilinear forms W_{Q,h}ᵀW_{K,h} = Aᵀ diag(c_h) B have CP rank `rank` (≤ head_dim)."""
    model = tiny_model("bert")
    adapter = get_adapter(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for site in adapter.sites(model):
            a = torch.randn(rank, 32, generator=generator)
            b = torch.randn(rank, 32, generator=generator)
            mixing = torch.randn(site.num_heads, rank, generator=generator)
            q = torch.zeros(site.num_heads, site.head_dim, 32)
            k = torch.zeros(site.num_heads, site.head_dim, 32)
            q[:, :rank] = mixing[:, :, None] * a
            k[:, :rank] = b
            site.module.query.weight.copy_(q.reshape(-1, 32) / 2)
            site.module.key.weight.copy_(k.reshape(-1, 32) / 2)
    return model


def test_exact_cp_rank_layer_is_reproduced_at_that_rank():
    rank = 6
    model = _exact_rank_bert(rank)
    inputs = model_inputs("bert")
    expected = _forward(model, inputs).last_hidden_state
    report = swap_to_collaborative(model, dim_shared_query_key=rank)
    assert report.max_relative_error < 1e-4
    got = _forward(model, inputs).last_hidden_state
    keep = inputs["attention_mask"].bool()
    assert (got - expected)[keep].abs().max() < 1e-3


def test_compression_shrinks_query_key_parameters_and_error_falls_with_width():
    errors = {}
    for dim_shared in (4, 16, 24):
        model = tiny_model("bert")
        report = swap_to_collaborative(model, dim_shared_query_key=dim_shared, seed=1)
        heads, hidden, layers = 4, 32, 2
        # Per layer: query and key (weights + biases) go; shared projections, mixing and content bias come.
        removed = 2 * (hidden * hidden + hidden) - (
            2 * dim_shared * hidden + heads * dim_shared + heads * hidden
        )
        assert report.parameters_before - report.parameters_after == layers * removed
        assert report.dim_shared_query_key == dim_shared and report.architecture == "bert"
        assert [site.name for site in report.sites] == [f"encoder.layer.{i}.attention.self" for i in range(2)]
        errors[dim_shared] = report.max_relative_error
        assert (
            f"D̃={dim_shared}" in str(report) and report.to_dict()["max_relative_error"] == errors[dim_shared]
        )
    assert 0 < errors[24] < errors[16] < errors[4] < 1


@pytest.mark.parametrize("dim_shared", [12, 4])
def test_compressed_model_keeps_padding_invariance(dim_shared):
    """Padding masks are preserved: a sentence's embedding does not depend on how much padding follows it."""
    model = tiny_model("distilbert")
    swap_to_collaborative(model, dim_shared_query_key=dim_shared)
    padded = model_inputs("distilbert")
    alone = {"input_ids": padded["input_ids"][1:2, :10], "attention_mask": padded["attention_mask"][1:2, :10]}
    batched = _forward(model, padded).last_hidden_state[1, :10]
    single = _forward(model, alone).last_hidden_state[0]
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)


def test_gradients_of_the_full_size_swap_match_the_original():
    model = tiny_model("bert")
    swapped = copy.deepcopy(model)
    swap_to_collaborative(swapped, dim_shared_query_key=32)
    inputs = model_inputs("bert")
    embeddings = model.embeddings.word_embeddings(inputs["input_ids"]).detach()
    cotangent = torch.randn(3, 25, 32) * inputs["attention_mask"][..., None]

    def input_gradient(m):
        leaf = embeddings.clone().requires_grad_(True)
        out = m(inputs_embeds=leaf, attention_mask=inputs["attention_mask"]).last_hidden_state
        value_weight = m.encoder.layer[0].attention.self.value.weight
        return torch.autograd.grad(out, [leaf, value_weight], cotangent)

    for got, want in zip(input_gradient(swapped), input_gradient(model), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "padding", "bool", "float", "causal_bool"])
def test_fast_heads_match_the_naive_reference(causal, with_bias, mask_kind):
    """Every mask form a 🤗 model sends, through model_attention_mask and the shared collaborative core: the fused
    path, the explicit-weights path and the head-by-head reference agree (outputs and gradients)."""
    generator = torch.Generator().manual_seed(5)
    batch, heads, seq, dim_shared, head_dim = 2, 3, 5, 7, 4

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    q, k, v, mixing = (
        leaf(batch, seq, dim_shared),
        leaf(batch, seq, dim_shared),
        leaf(batch, heads, seq, head_dim),
        leaf(heads, dim_shared),
    )
    content_logits = leaf(batch, seq, heads) if with_bias else None
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    rows = keep.bool()[:, None, None, :].expand(batch, 1, seq, seq)
    raw_mask = {
        None: None,
        "padding": keep,
        "bool": rows.contiguous(),  # sdpa: materialised, the same for every query
        "float": torch.zeros(batch, 1, seq, seq).masked_fill(~rows, torch.finfo(torch.float32).min),  # eager
        "causal_bool": rows & torch.ones(seq, seq, dtype=torch.bool).tril(),  # varies over the queries
    }[mask_kind]
    mask = model_attention_mask(raw_mask, batch, seq, seq)
    if mask_kind in ("bool", "float"):
        assert mask.shape == (batch, 1, 1, seq)  # reduced to one row: no [Tq, Tk] mask reaches the kernel
    settings = dict(scale=0.4, causal=causal, attention_mask=mask)
    fast, no_weights = collaborative_head_outputs(q, k, content_logits, v, mixing, **settings)
    explicit, weights = collaborative_head_outputs(
        q, k, content_logits, v, mixing, output_attentions=True, **settings
    )
    # the logits are scaled like the mixed dot products: the op adds its content bias as it is
    content_bias = None if content_logits is None else settings["scale"] * content_logits.transpose(1, 2)
    naive = naive_collaborative_attention(q, k, v, mixing, content_bias=content_bias, **settings)
    assert no_weights is None
    torch.testing.assert_close(fast, naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit, naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(batch, heads, seq))
    leaves = [t for t in (q, k, v, mixing, content_logits) if t is not None]
    cotangent = torch.randn(fast.shape, generator=generator)
    want = torch.autograd.grad(naive, leaves, cotangent)
    for result in (fast, explicit):
        for got, expected in zip(torch.autograd.grad(result, leaves, cotangent), want, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# D̃ = 4 < the sequence length: the fused kernel rather than explicit scores.
@pytest.mark.parametrize("dim_shared", [16, 4])
def test_gpt2_incremental_decoding_matches_a_full_forward(dim_shared):
    model = tiny_model("gpt2", "sdpa")
    swap_to_collaborative(model, dim_shared_query_key=dim_shared)
    input_ids = model_inputs("gpt2")["input_ids"][:2, :9]
    full = _forward(model, {"input_ids": input_ids}).last_hidden_state
    with torch.no_grad():
        prefix = model(input_ids[:, :6], use_cache=True)
        steps, cache = [prefix.last_hidden_state], output_cache(prefix)
        for t in range(6, 9):
            step = model(input_ids[:, t : t + 1], **cache_keyword(cache), use_cache=True)
            steps.append(step.last_hidden_state)
            cache = output_cache(step)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim_shared", [32, 12, 4])
def test_gpt2_keeps_its_module_and_generates_the_same_with_and_without_cache(dim_shared):
    model = transformers.GPT2LMHeadModel(tiny_model("gpt2", "sdpa").config).eval()
    reference = copy.deepcopy(model)
    swap_to_collaborative(model, dim_shared_query_key=dim_shared)
    attention = model.transformer.h[0].attn
    assert type(attention) is transformers.models.gpt2.modeling_gpt2.GPT2Attention
    fused = attention.c_attn
    assert isinstance(fused, FusedSharedProjection) and isinstance(fused.query, SharedProjection)
    padded_key = -(-(dim_shared + 4) // 8) * 8  # shared key + one content logit per head, padded to head_dim
    assert attention.split_size == [-(-dim_shared // 8) * 8, padded_key, 32]
    assert type(fused.value) is type(reference.transformer.h[0].attn.c_attn)  # the stock Conv1D
    prompt = model_inputs("gpt2")["input_ids"][:2, :5]
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **settings)
        uncached = model.generate(prompt, use_cache=False, **settings)
        original = reference.generate(prompt, use_cache=True, **settings)
    assert torch.equal(cached, uncached)
    if dim_shared == 32:
        assert torch.equal(cached, original)


def test_a_linearized_model_is_refused_and_a_swapped_one_cannot_be_linearized():
    import headkit

    model = tiny_model("gpt2")
    headkit.linearize(model, window=4, chunk_size=4)
    state, surgery = model.state_dict(), list(model.config.headkit_surgery)
    with pytest.raises(HeadkitError, match="already runs a headkit mechanism"):
        swap_to_collaborative(model, dim_shared_query_key=16)
    assert model.state_dict().keys() == state.keys() and model.config.headkit_surgery == surgery
    swapped = tiny_model("gpt2")
    swap_to_collaborative(swapped, dim_shared_query_key=16)
    with pytest.raises(HeadkitError, match="already runs CollaborativeHeads"):
        headkit.linearize(swapped, window=4)


def test_training_mode_applies_attention_dropout():
    model = tiny_model("bert")
    swap_to_collaborative(model, dim_shared_query_key=32)
    inputs = model_inputs("bert")
    evaluated = _forward(model, inputs).last_hidden_state
    model.train()
    for module in model.modules():  # only layer 0's dropout on the attention weights stays on
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.encoder.layer[0].attention.self.dropout.p = 0.5  # the stock module's own attention dropout
    dropped = _forward(model, inputs).last_hidden_state
    model.encoder.layer[0].attention.self.dropout.p = 0.0
    undropped = _forward(model, inputs).last_hidden_state
    assert not torch.allclose(dropped, evaluated, atol=1e-3)
    torch.testing.assert_close(undropped, evaluated, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dim_shared", "error", "match"),
    [
        (0, ValueError, "positive integer"),
        (-3, ValueError, "positive integer"),
        (33, HeadkitError, "at most the hidden size"),
    ],
)
def test_bad_dimensions_leave_the_model_untouched(dim_shared, error, match):
    model = tiny_model("bert")
    snapshot, types = state_snapshot(model), [type(m) for m in model.modules()]
    with pytest.raises(error, match=match):
        swap_to_collaborative(model, dim_shared_query_key=dim_shared)
    assert_untouched(model, snapshot, types)


def test_unsupported_rotary_and_already_swapped_models_are_refused():
    llama = tiny_model("llama")
    snapshot, types = state_snapshot(llama), [type(m) for m in llama.modules()]
    with pytest.raises(HeadkitError, match="rotary"):
        swap_to_collaborative(llama, dim_shared_query_key=16)
    assert_untouched(llama, snapshot, types)

    t5 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=20, d_model=16, d_kv=4, d_ff=20, num_layers=1, num_heads=4)
    )
    with pytest.raises(HeadkitError, match="unsupported architecture.*bert.*distilbert"):
        swap_to_collaborative(t5, dim_shared_query_key=8)

    model = tiny_model("bert")
    swap_to_collaborative(model, dim_shared_query_key=16)
    snapshot, types = state_snapshot(model), [type(m) for m in model.modules()]
    surgery = list(model.config.headkit_surgery)
    with pytest.raises(HeadkitError, match="already swapped"):
        swap_to_collaborative(model, dim_shared_query_key=16)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in snapshot.items())
    assert [type(m) for m in model.modules()] == types and model.config.headkit_surgery == surgery


def test_a_failure_midway_leaves_the_model_untouched(monkeypatch):
    model = tiny_model("bert")
    snapshot, types = state_snapshot(model), [type(m) for m in model.modules()]
    calls = []
    real = collaborative.decompose_query_key

    def fail_on_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("decomposition failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(collaborative, "decompose_query_key", fail_on_second_layer)
    with pytest.raises(RuntimeError, match="decomposition failed"):
        swap_to_collaborative(model, dim_shared_query_key=8)
    assert len(calls) == 2
    assert_untouched(model, snapshot, types)


def test_the_swap_uses_the_layers_content_bias_and_key_layout():
    """One content bias c_h = W_{K,h}ᵀ b_{Q,h} and one packed key layout for the layer and the swap."""
    import headkit.layers.collaborative as layers

    assert collaborative.content_bias_weight is layers.content_bias_weight
    model = tiny_model("bert", "sdpa")
    attention = model.encoder.layer[0].attention.self
    q_bias, k_weight = attention.query.bias.detach().clone(), attention.key.weight.detach().clone()
    swap_to_collaborative(model, dim_shared_query_key=32)
    key = attention.key
    assert torch.equal(key.content_bias.detach(), layers.content_bias_weight(q_bias, k_weight, 4))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        shared, logits = layers.unpack_shared_keys(key(x), 32, 4)
        torch.testing.assert_close(shared, x @ key.weight.T)
        torch.testing.assert_close(logits, x @ key.content_bias.T)
