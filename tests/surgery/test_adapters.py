import copy
import inspect

import pytest
import torch
import transformers
from collab_models import (
    ARCHITECTURES,
    assert_untouched,
    model_inputs,
    state_snapshot,
    tiny_model,
    valid_positions,
)
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from headkit.errors import HeadkitError
from headkit.surgery.adapters import (
    ADAPTERS,
    AlbertAdapter,
    BertAdapter,
    ProjectionWeights,
    count_parameters,
    get_adapter,
    linear_parameters,
    supported_architectures,
)
from headkit.surgery.collaborative import swap_to_collaborative


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs).last_hidden_state


def test_registry_detects_every_architecture():
    assert set(ARCHITECTURES) <= set(supported_architectures())
    for kind in ARCHITECTURES:
        model = tiny_model(kind)
        adapter = get_adapter(model)
        assert adapter.name == kind
        assert type(get_adapter(model, kind)) is type(adapter)
        assert type(get_adapter(model, ADAPTERS[kind])) is type(adapter)
        assert get_adapter(model, adapter) is adapter


def test_unsupported_architecture_names_the_supported_ones():
    model = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=20, d_model=16, d_kv=4, d_ff=20, num_layers=1, num_heads=4)
    )
    with pytest.raises(HeadkitError) as error:
        get_adapter(model)
    message = str(error.value)
    assert "t5" in message and "register_adapter" in message
    for name in ARCHITECTURES:
        assert name in message
    with pytest.raises(HeadkitError, match="unknown adapter 'nope'"):
        get_adapter(model, "nope")
    with pytest.raises(HeadkitError, match="adapter must be"):
        get_adapter(model, 3)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_sites_describe_the_attention_modules(kind):
    model = tiny_model(kind)
    sites = get_adapter(model).sites(model)
    if kind == "albert":  # one layer shared by all three
        assert len(sites) == 1 and sites[0].layers == (0, 1, 2)
    else:
        assert [site.layers for site in sites] == [(0,), (1,)]
    for site in sites:
        assert model.get_submodule(site.name) is site.module
        assert model.get_submodule(site.output_projection_name) is site.output_projection
        assert (site.num_heads, site.head_dim) == (4, 8)
        assert site.num_kv_heads == (2 if kind == "llama" else 4)
        assert site.scale == pytest.approx(8**-0.5)
        assert site.causal == (kind in ("gpt2", "llama"))
        assert not site.is_headkit


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_read_projections_reproduce_the_attention_output(kind):
    """The queries, keys and values the model hands transformers' attention interface, and its output projection,
    computed by hand from the adapter's nn.Linear-convention weights (checks the layouts: fused Conv1D, head
    order, GQA grouping)."""
    model = tiny_model(kind)
    adapter = get_adapter(model)
    inputs = model_inputs(kind)
    calls, seen, outputs = [], [], []
    site = adapter.sites(model)[0]
    name = "headkit_test_recording"

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        output, weights = AttentionInterface()["sdpa"](module, query, key, value, attention_mask, **kwargs)
        if module is site.module:
            seen.append((query, key, value, output))
        return output, weights

    AttentionInterface.register(name, recording_attention)
    AttentionMaskInterface.register(name, AttentionMaskInterface()["sdpa"])
    model.set_attn_implementation(name)

    def record_call(module, args, kwargs):
        calls.append((args[0] if args else kwargs["hidden_states"], kwargs.get("position_embeddings")))

    handles = [
        site.module.register_forward_pre_hook(record_call, with_kwargs=True),
        site.output_projection.register_forward_hook(lambda module, args, output: outputs.append(output)),
    ]
    _run(model, inputs)
    for handle in handles:
        handle.remove()

    w = adapter.read_projections(site)
    heads, kv_heads, head_dim = site.num_heads, site.num_kv_heads, site.head_dim
    assert len(calls) == len(seen) == len(outputs) == len(site.layers)
    for (x, position_embeddings), (query, key, value, context), output in zip(
        calls, seen, outputs, strict=True
    ):

        def split(t, n):
            return t.unflatten(-1, (n, head_dim)).transpose(1, 2)

        q = split(x @ w.q_weight.T + w.q_bias, heads)
        k = split(x @ w.k_weight.T + w.k_bias, kv_heads)
        if kind == "llama":
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        torch.testing.assert_close(query, q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(key, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(value, split(x @ w.v_weight.T + w.v_bias, kv_heads), atol=1e-5, rtol=1e-5)
        merged = context.flatten(-2)
        torch.testing.assert_close(output, merged @ w.o_weight.T + w.o_bias, atol=1e-5, rtol=1e-5)


def _prune_plan(kind):
    # LLaMA groups query heads (0, 1) on key/value head 0 and (2, 3) on 1: dropping a whole group frees kv head 1.
    if kind == "llama":
        return [0, 1], [0]
    return [0, 2], [0, 2]


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_write_projections_prunes_heads_like_zeroing_them(kind):
    model = tiny_model(kind)
    inputs = model_inputs(kind)
    adapter = get_adapter(model)
    keep_q, keep_kv = _prune_plan(kind)

    zeroed = copy.deepcopy(model)
    zeroed_site = adapter.sites(zeroed)[0]
    dropped = [h for h in range(zeroed_site.num_heads) if h not in keep_q]

    def zero_heads(module, args):
        heads = args[0].unflatten(-1, (zeroed_site.num_heads, zeroed_site.head_dim)).clone()
        heads[..., dropped, :] = 0
        return (heads.flatten(-2),)

    zeroed_site.output_projection.register_forward_pre_hook(zero_heads)
    expected = _run(zeroed, inputs)

    site = adapter.sites(model)[0]
    w = adapter.read_projections(site)
    parameters_before = count_parameters(model)
    d = site.head_dim

    def rows(heads):
        return torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])

    q_rows, kv_rows = rows(keep_q), rows(keep_kv)
    pruned = ProjectionWeights(
        w.q_weight[q_rows],
        w.k_weight[kv_rows],
        w.v_weight[kv_rows],
        w.o_weight[:, q_rows],
        w.q_bias[q_rows],
        w.k_bias[kv_rows],
        w.v_bias[kv_rows],
        w.o_bias,
    )
    new_site = adapter.write_projections(model, site, pruned)

    assert (new_site.num_heads, new_site.num_kv_heads) == (len(keep_q), len(keep_kv))
    hidden = w.q_weight.shape[1]
    removed_q = (site.num_heads - len(keep_q)) * d
    removed_kv = (site.num_kv_heads - len(keep_kv)) * d
    removed = removed_q * (hidden + 1) + 2 * removed_kv * (hidden + 1) + removed_q * w.o_weight.shape[0]
    assert parameters_before - count_parameters(model) == removed
    read_back = adapter.read_projections(new_site)
    for name in ("q_weight", "k_weight", "v_weight", "o_weight", "q_bias", "k_bias", "v_bias", "o_bias"):
        assert torch.equal(getattr(read_back, name), getattr(pruned, name)), name
    out = _run(model, inputs)
    keep = valid_positions(inputs, out)
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-5, rtol=1e-5)


def test_write_projections_rejects_bad_shapes_and_leaves_the_model_untouched():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    site = adapter.sites(model)[0]
    w = adapter.read_projections(site)
    snapshot, types = state_snapshot(model), [type(m) for m in model.modules()]
    uneven = ProjectionWeights(  # 3 query heads cannot share 2 key/value heads evenly
        w.q_weight[:24],
        w.k_weight,
        w.v_weight,
        w.o_weight[:, :24],
        w.q_bias[:24],
        w.k_bias,
        w.v_bias,
        w.o_bias,
    )
    with pytest.raises(HeadkitError, match="split evenly"):
        adapter.write_projections(model, site, uneven)
    ragged = ProjectionWeights(
        w.q_weight[:5], w.k_weight, w.v_weight, w.o_weight, w.q_bias[:5], w.k_bias, w.v_bias, w.o_bias
    )
    with pytest.raises(HeadkitError, match="q_weight must have shape"):
        adapter.write_projections(model, site, ragged)
    no_bias = ProjectionWeights(
        w.q_weight, w.k_weight, w.v_weight, w.o_weight, None, w.k_bias, w.v_bias, w.o_bias
    )
    with pytest.raises(HeadkitError, match="bias"):
        adapter.write_projections(model, site, no_bias)
    assert_untouched(model, snapshot, types)


def test_linear_parameters_transposes_conv1d():
    conv = transformers.pytorch_utils.Conv1D(6, 4)  # nf=6 outputs, nx=4 inputs
    weight, bias = linear_parameters(conv)
    x = torch.randn(2, 4)
    torch.testing.assert_close(x @ weight.T + bias, conv(x))


def test_a_collaborative_swap_keeps_the_stock_module_and_its_hooks():
    model = tiny_model("bert")
    site = BertAdapter().sites(model)[0]
    seen = []
    site.module.register_forward_hook(lambda module, args, output: seen.append(module))
    swap_to_collaborative(model, BertAdapter, dim_shared_query_key=32)
    seen.clear()  # the swap probed the model once (does its attention dispatch through the interface?)
    module = model.get_submodule(site.name)
    assert module is site.module
    assert type(module) is transformers.models.bert.modeling_bert.BertSelfAttention
    _run(model, model_inputs("bert"))
    assert seen == [module]
    assert BertAdapter().sites(model)[0].is_headkit
    with pytest.raises(HeadkitError, match="already runs CollaborativeHeads"):
        BertAdapter().read_projections(BertAdapter().sites(model)[0])


def test_albert_with_two_groups_has_two_sites():
    config = transformers.AlbertConfig(
        vocab_size=20,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=4,
        num_hidden_groups=2,
        num_attention_heads=2,
        intermediate_size=20,
    )
    model = transformers.AlbertModel(config)
    sites = AlbertAdapter().sites(model)
    assert [site.layers for site in sites] == [(0, 1), (2, 3)]


def _reference_arguments(signature, *args, **kwargs):
    """What Signature.bind reads from a call, after (self, hidden_states): the slow path, spelled out."""

    bound = signature.bind(*args, **kwargs)
    arguments = {}
    for name, value in list(bound.arguments.items())[2:]:
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        else:
            arguments[name] = value
    return arguments
