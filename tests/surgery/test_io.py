import json

import pytest
import torch
import transformers
from collab_models import VOCAB, model_inputs, tiny_model
from torch import nn

import headkit
from headkit.errors import HeadkitError
from headkit.surgery import io
from headkit.surgery.collaborative import CollaborativeHeads, swap_to_collaborative


def _outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _with_head(kind):
    """Models with task heads (tied LM heads, a classifier) around the tiny encoders/decoders."""
    base = tiny_model(kind)
    classes = {
        "bert": transformers.BertForMaskedLM,  # decoder tied to the word embeddings
        "gpt2": transformers.GPT2LMHeadModel,  # lm_head tied to wte
        "albert": transformers.AlbertForMaskedLM,
        "distilbert": transformers.DistilBertForSequenceClassification,
        "vit": transformers.ViTForImageClassification,
    }
    model = classes[kind](base.config).eval()
    missing, _ = model.base_model.load_state_dict(
        base.state_dict(), strict=False
    )  # MLM heads drop the pooler
    assert not missing
    return model


@pytest.mark.parametrize(
    ("kind", "dim_shared"), [("bert", 12), ("gpt2", 32), ("albert", 8), ("distilbert", 20), ("vit", 16)]
)
def test_swapped_model_reloads_with_identical_outputs(tmp_path, kind, dim_shared):
    model = _with_head(kind)
    inputs = model_inputs(kind)
    swap_to_collaborative(model, dim_shared_query_key=dim_shared)
    expected = _outputs(model, inputs)
    model.save_pretrained(tmp_path)

    saved = json.loads((tmp_path / "config.json").read_text())["headkit_surgery"]
    assert saved == [
        {
            "op": "collaborative",
            "adapter": kind,
            # the CollaborativeConfig's fields (headkit.surgery.collaborative.CollaborativeConfig.record)
            "dim_shared_query_key": dim_shared,
            "seed": 0,
            "tol": 1e-7,
            "max_iter": 500,
            "sites": [site["name"] for site in _site_names(model)],
        }
    ]
    # The implementation the model ran (the eager default of the tiny models; transformers would pick sdpa): the
    # collaborative heads run under it, so other kernels give other roundings.
    reloaded = headkit.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(reloaded) is type(model) and not reloaded.training
    assert any(isinstance(m, CollaborativeHeads) for m in reloaded.modules())
    assert torch.equal(_outputs(reloaded, inputs), expected)
    assert reloaded.config.headkit_surgery == saved


def _site_names(model):
    from headkit.surgery.adapters import get_adapter

    return [{"name": site.name} for site in get_adapter(model).sites(model)]


def test_plain_models_load_through_the_same_loader(tmp_path):
    model = _with_head("bert")
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path, attn_implementation="eager")
    inputs = model_inputs("bert")
    assert torch.equal(_outputs(reloaded, inputs), _outputs(model, inputs))
    assert reloaded.config._attn_implementation == "eager"


def test_reload_can_pick_the_attention_implementation(tmp_path):
    model = tiny_model("gpt2", "eager")
    swap_to_collaborative(model, dim_shared_query_key=16)
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert reloaded.config._attn_implementation == "headkit_sdpa"  # the mechanisms on top of sdpa
    inputs = model_inputs("gpt2")
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(
        _outputs(reloaded, inputs)[keep], _outputs(model, inputs)[keep], atol=1e-5, rtol=1e-5
    )


def _drop_pooler_bias(model, entry):
    pooler = model.pooler.dense
    model.pooler.dense = nn.Linear(pooler.in_features, pooler.out_features, bias=False)


def test_registered_ops_are_recorded_and_reapplied_in_order(tmp_path, monkeypatch):
    monkeypatch.setitem(io.SURGERY_OPS, "drop_pooler_bias", _drop_pooler_bias)
    model = tiny_model("bert")
    _drop_pooler_bias(model, {})
    io.record_surgery(model, {"op": "drop_pooler_bias", "why": "test"})
    swap_to_collaborative(model, dim_shared_query_key=8)
    assert [entry["op"] for entry in io.recorded_surgery(model)] == ["drop_pooler_bias", "collaborative"]
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert reloaded.pooler.dense.bias is None
    inputs = model_inputs("bert")
    # The reload attends through headkit's sdpa form where the converted model kept its eager one: the same
    # function, summed in another order (6e-8 apart on an AMD EPYC, bit-equal on others).
    torch.testing.assert_close(
        reloaded(**inputs).pooler_output, model(**inputs).pooler_output, atol=1e-6, rtol=1e-6
    )


def test_bad_records_and_paths_are_clear_errors(tmp_path, monkeypatch):
    model = tiny_model("bert")
    with pytest.raises(HeadkitError, match="registered surgery op"):
        io.record_surgery(model, {"op": "no_such_op"})
    monkeypatch.setitem(io.SURGERY_OPS, "toy", lambda model, entry: None)
    with pytest.raises(HeadkitError, match="JSON"):
        io.record_surgery(model, {"op": "toy", "tensor": torch.zeros(1)})
    assert io.recorded_surgery(model) == []

    with pytest.raises(HeadkitError, match="config.json"):
        headkit.from_pretrained(tmp_path / "missing")
    model.config.headkit_surgery = [{"op": "no_such_op"}]
    model.save_pretrained(tmp_path)
    with pytest.raises(HeadkitError, match="no_such_op"):
        headkit.from_pretrained(tmp_path)


def test_weights_that_do_not_fit_are_refused(tmp_path):
    model = tiny_model("bert")
    swap_to_collaborative(model, dim_shared_query_key=8)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["headkit_surgery"][0]["dim_shared_query_key"] = 12  # the saved shared projections are 8 wide
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((HeadkitError, RuntimeError), match="size mismatch|do not fit"):
        headkit.from_pretrained(tmp_path)


def test_vocab_constant_matches_models():
    # Guard for the helpers the io tests rely on: every tiny text model shares one vocabulary size.
    assert tiny_model("bert").config.vocab_size == VOCAB


def test_a_pruned_headkit_causal_lm_reloads_as_its_own_class_with_identical_logits(tmp_path):
    import torch

    import headkit
    from headkit.models import HeadkitConfig, HeadkitForCausalLM

    config = HeadkitConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    model = HeadkitForCausalLM(config).eval()
    headkit.prune_heads(model, {0: [1], 1: [0, 3]})
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path)
    assert type(reloaded) is HeadkitForCausalLM
    tokens = torch.randint(0, 50, (2, 7))
    assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


def _swapped_gpt2(dtype):
    """A GPT-2 LM (head tied to the embeddings) after collaborative-heads surgery, in `dtype`."""
    model = _with_head("gpt2")
    swap_to_collaborative(model, dim_shared_query_key=32)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sharded_save_after_surgery_reloads_identically_a_few_tensors_at_a_time(
    tmp_path, monkeypatch, dtype
):
    import gc
    import weakref

    model = _swapped_gpt2(dtype)
    inputs = model_inputs("gpt2")
    expected = _outputs(model, inputs)
    model.save_pretrained(tmp_path, max_shard_size="16KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "model.safetensors.index.json").is_file()

    read_shards, alive, sizes = [], [], []
    original_read = io._read_pieces
    monkeypatch.setattr(io, "LOAD_BYTES", 4096)

    def counting_read(file, device):
        read_shards.append(file.name)
        for piece in original_read(file, device):
            gc.collect()
            # every tensor read before has been released: one piece's tensors at a time
            assert not [ref for ref in alive if ref() is not None]
            alive.extend(weakref.ref(tensor) for tensor in piece.values())
            sizes.append([t.numel() * t.element_size() for t in piece.values()])
            yield piece

    monkeypatch.setattr(io, "_read_pieces", counting_read)
    reloaded = headkit.from_pretrained(tmp_path, attn_implementation="eager")  # the implementation it ran
    assert sorted(read_shards) == [shard.name for shard in shards]  # each shard once
    assert len(sizes) > len(shards) and all(sum(piece) <= 4096 or len(piece) == 1 for piece in sizes)
    assert {p.dtype for p in reloaded.parameters()} == {dtype}  # the saved dtype
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight  # the tied head, as before the save
    assert torch.equal(_outputs(reloaded, inputs), expected)


def test_a_model_after_surgery_reloads_in_the_dtype_asked_for(tmp_path):
    model = _swapped_gpt2(torch.float32)
    inputs = model_inputs("gpt2")
    model.save_pretrained(tmp_path, max_shard_size="16KB")
    reloaded = headkit.from_pretrained(tmp_path, dtype="bfloat16", device_map="cpu")
    assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}
    assert torch.equal(_outputs(reloaded, inputs), _outputs(model.to(torch.bfloat16), inputs))
    with pytest.raises(HeadkitError, match="one device"):
        headkit.from_pretrained(tmp_path, device_map="auto")


def test_a_plain_model_passes_dtype_and_device_map_to_transformers(tmp_path, monkeypatch):
    model = _with_head("bert")
    model.save_pretrained(tmp_path)
    reloaded = headkit.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu")
    assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}
    assert reloaded.device == torch.device("cpu")


def test_a_shard_that_misses_weights_is_refused(tmp_path):
    model = _swapped_gpt2(torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="16KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    dropped = {name: file for name, file in index["weight_map"].items() if file != first}
    index["weight_map"] = dropped
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HeadkitError, match="do not fit"):
        headkit.from_pretrained(tmp_path)
