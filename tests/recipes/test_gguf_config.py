"""The preflight's GGUF config, read from the metadata alone, equals what transformers' reader builds."""

import time

import numpy as np
import pytest
from transformers import AutoConfig

from headkit.errors import HeadkitError
from headkit.recipes.models import (
    GGUF_METADATA_ARCHITECTURES,
    StringArray,
    gguf_config,
    read_gguf_header,
    read_model_config,
    smollm2_gguf_path,
)

gguf = pytest.importorskip("gguf")

# What the preflights read of a config (recipes.prune, .linearize, .compress and the surgery configs' check).
PREFLIGHT_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "head_dim",
    "max_position_embeddings",
    "sliding_window",
    "layer_types",
    "tie_word_embeddings",
    "vocab_size",
)

# One value per GGUF key suffix transformers maps to a config field: a consistent small model.
VALUES = {
    "context_length": 128,
    "block_count": 2,
    "feed_forward_length": 96,
    "embedding_length": 64,
    "rope.dimension_count": 16,
    "rope.freq_base": 10000.0,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.key_length": 16,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "attention.layer_norm_epsilon": 1e-5,
    "attention.sliding_window": 32,
}


def _reference(path):
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def _write(path, architecture, *, name="tiny", vocab_size=None, output_weight=False, tokens=40):
    """A GGUF of metadata (and an output projection, with `output_weight`): the keys transformers maps for `architecture`, a vocabulary."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    for suffix, value in VALUES.items():
        key = f"{architecture}.{suffix}"
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    if vocab_size is not None:
        writer.add_uint32(f"{architecture}.vocab_size", vocab_size)
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.add_token_types([1] * tokens)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_array("general.languages", ["en"])
    if output_weight:  # llama.cpp writes the output projection only when it is not the embedding matrix
        writer.add_tensor("output.weight", np.zeros((tokens, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", GGUF_METADATA_ARCHITECTURES)
@pytest.mark.parametrize("vocab_size, output_weight", [(None, False), (48, True)])
def test_the_metadata_config_equals_transformers_gguf_config(
    architecture, vocab_size, output_weight, tmp_path
):
    path = _write(tmp_path / "model.gguf", architecture, vocab_size=vocab_size, output_weight=output_weight)
    fast, reference = gguf_config(path), _reference(path)
    assert type(fast) is type(reference)
    assert fast.to_dict() == reference.to_dict()
    if vocab_size is None:
        assert fast.vocab_size == 40  # the vocabulary's length, which stays unread
    assert fast.tie_word_embeddings is not output_weight


def test_a_llama_file_named_mistral_reads_as_mistral_and_others_fall_back_to_transformers(tmp_path):
    path = _write(tmp_path / "mistral.gguf", "llama", name="mistral")
    assert gguf_config(path).model_type == _reference(path).model_type == "mistral"
    assert gguf_config(path).to_dict() == _reference(path).to_dict()
    falcon = _write(tmp_path / "falcon.gguf", "falcon")  # not one of GGUF_METADATA_ARCHITECTURES
    assert gguf_config(falcon).to_dict() == _reference(falcon).to_dict()


def test_the_header_reads_scalars_lists_and_leaves_string_arrays_unread(tmp_path):
    header = read_gguf_header(_write(tmp_path / "model.gguf", "llama"))
    assert header.metadata["general.architecture"] == "llama" and header.metadata["llama.block_count"] == 2
    assert header.metadata["tokenizer.ggml.tokens"] == StringArray(40)
    assert header.metadata["general.languages"] == StringArray(1)
    assert header.metadata["tokenizer.ggml.token_type"] == [1] * 40 and header.tensor_names == ()
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(tmp_path / "not.gguf")
    assert read_model_config(tmp_path / "not.gguf") is None
    (tmp_path / "short.gguf").write_bytes((tmp_path / "model.gguf").read_bytes()[:100])
    assert read_model_config(tmp_path / "short.gguf") is None


def test_the_smollm2_gguf_config_is_read_in_well_under_a_second_and_equals_transformers():
    try:
        path = smollm2_gguf_path()
    except HeadkitError as exc:
        pytest.skip(str(exc))
    started = time.perf_counter()
    fast = read_model_config(path)
    seconds = time.perf_counter() - started
    reference = _reference(path)
    assert {name: getattr(fast, name, None) for name in PREFLIGHT_FIELDS} == {
        name: getattr(reference, name, None) for name in PREFLIGHT_FIELDS
    }
    assert fast.to_dict() == reference.to_dict()
    assert seconds < 0.5, seconds  # transformers' reader parses the 49k-token vocabulary: ~3 s


def test_the_export_target_check_reads_a_gguf_models_architecture_from_its_header(tmp_path):
    from headkit.export.gguf import check_export_target

    check_export_target(_write(tmp_path / "llama.gguf", "llama"), tmp_path / "out.gguf", "f16", False)
    with pytest.raises(HeadkitError, match="MODEL is a 'falcon' model, which has no llama.cpp mapping"):
        check_export_target(_write(tmp_path / "falcon.gguf", "falcon"), tmp_path / "out.gguf", "f16", False)
