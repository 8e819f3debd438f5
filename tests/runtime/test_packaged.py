"""headkit.runtime.packaged: the fast decoder's step compiled once per machine (AOTInductor packages).

A step built by one decoder is loaded by the next one — and by another process — and decodes the eager model's
greedy tokens, for other prompts and lengths than the one it was built on; a changed model, another torch, CPU
or thread count is another key; a truncated package is rebuilt with one line; an unwritable folder compiles in
memory with one line; clearing removes only headkit's files."""

from __future__ import annotations

import json
import logging
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headkit.files import regular_file_mode
from headkit.runtime import packaged
from headkit.runtime.fast import FastDecoder
from headkit.runtime.packaged import (
    artifact_key,
    buffers_installed,
    cache_buffers,
    clear_artifacts,
    weights_digest,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_fast import NEW, VOCAB, eager_greedy, linearized, prompts, tiny_llama  # noqa: E402

pytestmark = pytest.mark.skipif(
    not any(shutil.which(name) for name in ("g++", "c++", "clang++")),
    reason="no C++ compiler for AOTInductor",
)


def one_layer() -> torch.nn.Module:
    return tiny_llama(layers=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A folder holding the step of a one-layer LLaMA (batch 2, one bucket), built by a first decoder."""
    folder = tmp_path_factory.mktemp("compiled")
    model = one_layer()
    ids, mask = prompts()
    decoder = FastDecoder(model, artifacts=folder)
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(got, eager_greedy(model, ids, mask))
    assert list(decoder.step_sources.values()) == ["compiled"]
    (package,) = folder.glob("*.pt2")
    assert stat.S_IMODE(package.stat().st_mode) == regular_file_mode()  # not the temporary file's 0600
    return folder


def other_prompt(length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))


def test_a_second_decoder_loads_the_step_and_decodes_other_prompts(built):
    model = one_layer()
    decoder = FastDecoder(model, artifacts=built)
    for length in (4, 17):  # shorter and longer than the prompt it was built on, in the same bucket
        ids = other_prompt(length)
        got = decoder.generate(ids, max_new_tokens=NEW)
        assert torch.equal(got, eager_greedy(model, ids, torch.ones_like(ids)))
    assert list(decoder.step_sources.values()) == ["loaded"]
    assert len(list(built.glob("*.pt2"))) == 1  # nothing rebuilt


def test_another_process_loads_the_step(built):
    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
torch.set_num_threads(1)
from test_fast import NEW, tiny_llama, prompts, eager_greedy
from headkit.runtime.fast import FastDecoder
model = tiny_llama(layers=1)
ids, mask = prompts()
decoder = FastDecoder(model, artifacts={str(built)!r})
got = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW)
print(list(decoder.step_sources.values())[0], torch.equal(got, eager_greedy(model, ids, mask)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["loaded", "True"]


def test_a_linearized_model_with_exact_keys_round_trips(tmp_path):
    # Sinks, question-chosen slots and a retrieval head: every fixed buffer is an input the package writes.
    model = linearized(sinks=1, budget=4, selection="question", observation=4, retrieval_heads=[(0, 1)])
    ids, mask = prompts()
    expected = eager_greedy(model, ids, mask)
    for source in ("compiled", "loaded"):
        decoder = FastDecoder(model, artifacts=tmp_path)
        assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW), expected)
        assert list(decoder.step_sources.values()) == [source]


def test_a_truncated_package_is_rebuilt_with_one_line(built, tmp_path, caplog):
    folder = tmp_path / "compiled"
    shutil.copytree(built, folder)
    (package,) = folder.glob("*.pt2")
    package.write_bytes(package.read_bytes()[: package.stat().st_size // 2])
    model = one_layer()
    ids, mask = prompts()
    with caplog.at_level(logging.WARNING, logger="headkit.runtime.packaged"):
        decoder = FastDecoder(model, artifacts=folder)
        got = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(got, eager_greedy(model, ids, mask))
    assert list(decoder.step_sources.values()) == ["compiled"]
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not match its checksum" in warnings[0]
    record = json.loads(package.with_suffix(".json").read_text())
    assert record["bytes"] == package.stat().st_size  # the rebuilt package replaced the truncated one


def test_an_unwritable_folder_compiles_in_memory_with_one_line(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    model = one_layer()
    ids, mask = prompts()
    with caplog.at_level(logging.WARNING, logger="headkit.runtime.packaged"):
        decoder = FastDecoder(model, artifacts=blocker / "compiled")
        got = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(got, eager_greedy(model, ids, mask))
    assert list(decoder.step_sources.values()) == ["compiled in memory"]
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot be written" in warnings[0] and "in memory" in warnings[0]
    assert blocker.read_text() == "not a folder"


def test_the_key_follows_weights_versions_cpu_and_threads(monkeypatch):
    model = one_layer()
    buffers = [torch.zeros(2, 3)]
    base = artifact_key(model, buffers, {"bucket": [1, 256]})
    assert artifact_key(model, buffers, {"bucket": [1, 256]}) == base
    changed = one_layer()
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1e-3  # one weight (tied to the embedding): another model
    assert weights_digest(changed) != weights_digest(model)
    assert artifact_key(changed, buffers, {"bucket": [1, 256]}) != base
    assert artifact_key(model, buffers, {"bucket": [1, 512]}) != base
    assert artifact_key(model, [torch.zeros(2, 4)], {"bucket": [1, 256]}) != base
    eager = one_layer()
    eager.set_attn_implementation("eager")  # the same weights and config, other attention code
    assert artifact_key(eager, buffers, {"bucket": [1, 256]}) != base
    monkeypatch.setattr(packaged, "headkit_source_digest", lambda: "edited")
    assert artifact_key(model, buffers, {"bucket": [1, 256]}) != base
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0-another")
    assert artifact_key(model, buffers, {"bucket": [1, 256]}) != base
    monkeypatch.undo()
    monkeypatch.setattr(packaged, "cpu_identity", lambda: "another CPU")
    assert artifact_key(model, buffers, {"bucket": [1, 256]}) != base
    monkeypatch.undo()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert artifact_key(model, buffers, {"bucket": [1, 256]}) != base
    finally:
        torch.set_num_threads(threads)


def test_a_record_for_another_key_is_not_loaded(built, tmp_path):
    folder = tmp_path / "compiled"
    shutil.copytree(built, folder)
    (record_path,) = folder.glob("*.json")
    record = json.loads(record_path.read_text())
    record["key"]["torch"] = "0.0.0-another"  # a foreign artifact under this name
    record_path.write_text(json.dumps(record))
    package, problem = packaged._stored(folder, record_path.stem, json.loads(record_path.read_text())["key"])
    assert package is not None and problem is None
    package, problem = packaged._stored(
        folder, record_path.stem, {**record["key"], "torch": torch.__version__}
    )
    assert package is None and "written for something else" in problem


def test_buffers_are_installed_and_restored():
    model = linearized(sinks=1, budget=4, retrieval_heads=[(0, 1)])
    decoder = FastDecoder(model, compile=False)
    ids, mask = prompts()
    decoder.generate(ids, attention_mask=mask, max_new_tokens=2)
    (cache,) = decoder._caches.values()
    own = cache_buffers(cache)
    assert own and all(isinstance(buffer, torch.Tensor) for buffer in own)
    stand_ins = [buffer.clone() for buffer in own]
    with buffers_installed(cache, stand_ins):
        assert all(a is b for a, b in zip(cache_buffers(cache), stand_ins, strict=True))
    assert all(a is b for a, b in zip(cache_buffers(cache), own, strict=True))
    with (
        pytest.raises(ValueError, match="more buffers"),
        buffers_installed(cache, [*stand_ins, stand_ins[0]]),
    ):
        pass
    assert all(a is b for a, b in zip(cache_buffers(cache), own, strict=True))


def test_clearing_removes_only_compiled_steps(built, tmp_path):
    folder = tmp_path / "compiled"
    shutil.copytree(built, folder)
    (folder / "notes.txt").write_text("mine")
    files, size = clear_artifacts(folder)
    assert files == 2 and size > 0
    assert [path.name for path in folder.iterdir()] == ["notes.txt"]
    assert clear_artifacts(tmp_path / "absent") == (0, 0)
