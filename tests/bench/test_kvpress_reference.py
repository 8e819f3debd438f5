"""kvpress' reference row of `headkit bench retrieval`: the child script's protocol and decoding (against the
model's own greedy generate, with a stand-in `kvpress` package whose press records what it was asked and
compresses nothing), the row beside the baseline, and the refusals before any work. The real kvpress needs
transformers<5.3 (`make kvpress`), outside the suite's environments."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from headkit.bench.retrieval import KVPRESS_CHILD
from headkit.cli import main

STAND_IN = """
import contextlib, json, os
from dataclasses import dataclass

__version__ = "0.0+stand-in"


@dataclass
class SnapKVPress:
    compression_ratio: float = 0.0
    window_size: int = 64

    @contextlib.contextmanager
    def __call__(self, model):
        with open(os.environ["STAND_IN_LOG"], "a") as log:
            log.write(json.dumps([self.compression_ratio, self.window_size]) + "\\n")
        yield
"""

TINY = [
    "--lengths", "160", "--trials", "3", "--budgets", "4", "--retrieval-head-counts", "0,1", "--observation", "8",
    "--second-turn-gap", "40", "--perplexity-length", "64", "--held-out-windows", "1", "--state-context", "200",
    "--threads", "1", "--window", "16",
]  # fmt: skip


def _bench(folder, python, out):
    """`headkit bench retrieval` on the tiny model with kvpress' row from `python`."""
    return [
        "bench",
        "retrieval",
        "--model",
        str(folder),
        *TINY,
        "--kvpress-python",
        str(python),
        "--out",
        str(out),
    ]


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    package = tmp_path / "site" / "kvpress"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    log = tmp_path / "press.log"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    return log


def test_the_child_decodes_greedily_from_the_pressed_prefill_at_the_true_positions(
    stand_in, tmp_path, save_tiny_causal_lm
):
    folder = save_tiny_causal_lm(tmp_path / "llama")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (40, 64)]
    request, answer = tmp_path / "request.json", tmp_path / "answer.json"
    request.write_text(
        json.dumps(
            {"model": str(folder), "prompts": prompts, "kept": 32, "observation": 8, "max_new_tokens": 6,
             "threads": 1}
        )
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(KVPRESS_CHILD), str(request), str(answer)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(answer.read_text())
    assert result["versions"]["kvpress"] == "0.0+stand-in" and result["seconds"] > 0
    assert not answer.with_suffix(".partial").exists()
    # Each prompt was prefilled under a press keeping `kept` of its T tokens, observing the last 8 queries.
    logged = [json.loads(line) for line in stand_in.read_text().splitlines()]
    assert logged == [[pytest.approx(1 - 32 / 40), 8], [pytest.approx(1 - 32 / 64), 8]]
    # The stand-in compresses nothing: the answers are the model's own greedy continuation.
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    for prompt, got in zip(prompts, result["answers"], strict=True):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        assert got == expected[0, len(prompt) :].tolist()


def test_the_reference_row_keeps_the_baselines_tokens_per_head(stand_in, tmp_path, save_tiny_causal_lm):
    folder = save_tiny_causal_lm(tmp_path / "llama")
    out = tmp_path / "retrieval"
    main(_bench(folder, sys.executable, out))
    results = json.loads((out / "results.json").read_text())
    names = [p["model"] for p in results["points"]]
    # Beside the baseline without retrieval heads only: 4 sinks + the 16-token window + G = 4.
    assert names == [
        "original (full KV cache)",
        "compressed cache G=4 R=0",
        "kvpress 0.0+stand-in SnapKVPress, 24 tokens per head (equal bytes)",
        "compressed cache G=4 R=1",
    ]
    row, original = results["points"][2], results["points"][0]
    assert row["kept_tokens"] == 24 and row["second_turn"] is None and row["perplexity"] is None
    assert row["passkey_160"]["trials"] == 3 and 0 <= row["passkey_160"]["accuracy"] <= 1
    # Its cache: 24 of the original's tokens, whatever the context (the original's grows to 200).
    assert row["state_bytes"] * 200 == pytest.approx(original["state_bytes"] * 24, rel=0.01)
    assert len(stand_in.read_text().splitlines()) == 3
    table = (out / "table.md").read_text()
    assert "kvpress" in table and "| — | — |" in table


@pytest.mark.parametrize(
    ("python", "message"),
    [
        ("/nope/python", "--kvpress-python must be a Python interpreter with kvpress installed"),
        (sys.executable, "cannot import kvpress"),
    ],
)
def test_an_interpreter_without_kvpress_is_refused_before_any_work(
    python, message, tmp_path, save_tiny_causal_lm, capsys, monkeypatch
):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    folder = save_tiny_causal_lm(tmp_path / "llama")
    with pytest.raises(SystemExit) as exc:
        main(_bench(folder, python, tmp_path / "o"))
    assert exc.value.code == 2 and message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "o").exists()
