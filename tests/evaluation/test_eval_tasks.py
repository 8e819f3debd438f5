"""`headkit eval --tasks` and the recipes' --eval-tasks through lm-evaluation-harness, offline, on tiny models:
the scores lm-eval reports are the model's own log-likelihoods (computed here from its logits), on a stock
checkpoint and on converted ones reloaded from disk; batching and padding change no score; every refusal is one
line and exit status 2, before any model loads."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch
import transformers

from headkit.errors import HeadkitError

pytest.importorskip("lm_eval", reason="the eval extra: pip install 'headkit[eval]'")

import headkit  # noqa: E402
from headkit.cli import main  # noqa: E402
from headkit.evaluation import tasks as tk  # noqa: E402
from headkit.surgery.latent import compress_kv_to_latent  # noqa: E402

transformers.logging.set_verbosity_error()

WORDS = "heads keys values queries groups layers tokens attention".split()


def _run(args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    return exit_info.value.code


def multiple_choice_rows():
    """Twelve questions of different lengths, four choices of one to four words (continuations of one or more
    tokens), labels cycling through the choices."""
    rows = []
    for i in range(12):
        a, b = WORDS[i % 8], WORDS[(3 * i + 1) % 8]
        question = f"which word comes after {a} and {b}" + " in the model" * (i % 3)
        choices = [
            WORDS[(i + 1) % 8],
            f"{WORDS[(i + 2) % 8]} of the {WORDS[(i + 5) % 8]}",
            "none",
            f"all {a}",
        ]
        rows.append({"question": question, "choices": choices, "label": i % 4})
    return rows


def loglikelihood_rows():
    return [
        {
            "context": f"the {WORDS[i % 8]} share the" + " same" * (i % 2),
            "continuation": f" {WORDS[(i + 3) % 8]}",
        }
        for i in range(10)
    ]


def write_task(folder, name, rows, body, cache):
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # cache_dir keeps 🤗 datasets' Arrow cache of the test's files in the test's own folder.
    header = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    (folder / f"{name}.yaml").write_text(header + f"  cache_dir: {cache}\ntest_split: test\n" + body)


MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
LOGLIKELIHOOD = """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{continuation}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""
# A task whose data lives only on the hub: offline, it cannot load.
HUB_ONLY = """task: hub_only
dataset_path: headkit-tests/not-on-this-machine
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
"""


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    cache = tmp_path_factory.mktemp("datasets-cache")
    write_task(folder, "tiny_mc", multiple_choice_rows(), MULTIPLE_CHOICE, cache)
    write_task(folder, "tiny_ll", loglikelihood_rows(), LOGLIKELIHOOD, cache)
    return folder


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub-tasks")
    (folder / "hub_only.yaml").write_text(HUB_ONLY)
    return folder


# -- the scores, computed here -------------------------------------------------------------------------------------


@torch.no_grad()
def own_loglikelihood(model, tokenizer, context, continuation):
    """(Σ log softmax of the continuation's tokens given the context, whether each is the argmax). MiniLM's
    tokenizer appends [SEP] to a text, so text is encoded without special tokens (headkit tells lm-eval so);
    the continuation's tokens are those the whole text has beyond the context's."""
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    assert whole[: len(context_ids)] == context_ids
    targets = torch.tensor(whole[len(context_ids) :])
    logits = model(input_ids=torch.tensor([whole])).logits[0, len(context_ids) - 1 : len(whole) - 1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return float(logprobs.gather(-1, targets[:, None]).sum()), bool((logprobs.argmax(-1) == targets).all())


def own_scores(model, tokenizer):
    """The tasks' metrics by their definitions: multiple-choice accuracy (the choice of highest log-likelihood is
    the label), greedy accuracy and perplexity exp(−mean log-likelihood) of the continuations; and every
    log-likelihood, per example."""
    choices = [
        [
            own_loglikelihood(model, tokenizer, f"Question: {row['question']}\nAnswer:", " " + c)[0]
            for c in row["choices"]
        ]
        for row in multiple_choice_rows()
    ]
    hits = [
        max(range(4), key=lambda j: scores[j]) == row["label"]
        for scores, row in zip(choices, multiple_choice_rows(), strict=True)
    ]
    continuations = [
        own_loglikelihood(model, tokenizer, r["context"], r["continuation"]) for r in loglikelihood_rows()
    ]
    return {
        "tiny_mc": {"acc": sum(hits) / len(hits)},
        "tiny_ll": {
            "acc": sum(greedy for _, greedy in continuations) / len(continuations),
            "perplexity": math.exp(-sum(ll for ll, _ in continuations) / len(continuations)),
        },
        "loglikelihoods": {"tiny_mc": choices, "tiny_ll": [ll for ll, _ in continuations]},
    }


# -- the models ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, save_tiny_causal_lm):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model", "llama")


def _converted(folder, tiny_folder, surgery):
    """The tiny LLaMA after `surgery`, saved with its tokenizer: a folder only headkit.from_pretrained reloads."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    surgery(model)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(folder)
    return folder


SURGERIES = {
    # Window 4: every context is longer, so the linear term carries part of each score.
    "linearized": lambda model: headkit.linearize(model, window=4),
    "latent": lambda model: compress_kv_to_latent(model, kv_rank=12, rope_dims=4),
    # Uneven: layer 0 keeps 3 query heads, layer 1 keeps 2.
    "pruned": lambda model: headkit.prune_heads(model, {0: [1], 1: [0, 3]}),
}


def reloaded(folder, kind):
    if kind == "stock":
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return headkit.from_pretrained(folder).eval()


@pytest.fixture(scope="module", params=["stock", *SURGERIES])
def model_folder(request, tmp_path_factory, tiny_folder):
    if request.param == "stock":
        return "stock", tiny_folder
    folder = tmp_path_factory.mktemp(request.param) / "model"
    return request.param, _converted(folder, tiny_folder, SURGERIES[request.param])


# -- headkit eval --tasks ------------------------------------------------------------------------------------------


def test_headkit_eval_reports_the_models_own_scores(model_folder, task_folder, tmp_path, capsys):
    kind, folder = model_folder
    out = tmp_path / "eval"
    args = ["eval", str(folder), "--tasks", "tiny_mc,tiny_ll", "--include-path", str(task_folder)]
    assert _run([*args, "--batch-size", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith("| task | metric |") and "| tiny_mc | acc | 12 | 0 |" in printed

    report = json.loads((out / "report.json").read_text())
    # --tasks alone: the default perplexity, passkey and decoding measurements are not run.
    assert report["perplexity"] == [] and report["passkey"] == {} and report["decode"] == []
    tasks = report["tasks"]
    assert tasks["lm_eval_version"] == tk.require_lm_eval() and tasks["reference"] is None
    assert tasks["n-samples"]["tiny_mc"]["effective"] == 12 and tasks["n-shot"] == {
        "tiny_mc": 0,
        "tiny_ll": 0,
    }
    results = tasks["results"]["model"]
    expected = own_scores(reloaded(folder, kind), transformers.AutoTokenizer.from_pretrained(folder))
    assert results["tiny_mc"]["acc,none"] == pytest.approx(expected["tiny_mc"]["acc"], abs=1e-12)
    assert results["tiny_ll"]["acc,none"] == pytest.approx(expected["tiny_ll"]["acc"], abs=1e-12)
    assert results["tiny_ll"]["perplexity,none"] == pytest.approx(expected["tiny_ll"]["perplexity"], rel=1e-4)
    acc = next(row for row in tasks["rows"] if row["task"] == "tiny_mc")
    assert acc["model"] == results["tiny_mc"]["acc,none"] and acc["model_stderr"] > 0
    # The figures behind the scores, per example: the model's own log-likelihood of every choice / continuation.
    loglikelihoods = tasks["loglikelihoods"]["model"]
    assert loglikelihoods["tiny_mc"] == [
        pytest.approx(row, abs=1e-4) for row in expected["loglikelihoods"]["tiny_mc"]
    ]
    assert loglikelihoods["tiny_ll"] == [
        [pytest.approx(ll, abs=1e-4)] for ll in expected["loglikelihoods"]["tiny_ll"]
    ]


def test_a_reference_is_scored_on_the_same_examples_and_subtracted(
    tiny_folder, task_folder, tmp_path, capsys
):
    other = _converted(tmp_path / "pruned", tiny_folder, SURGERIES["pruned"])
    out = tmp_path / "eval"
    args = ["eval", str(other), "--reference", str(tiny_folder), "--tasks", "tiny_mc"]
    assert _run([*args, "--include-path", str(task_folder), "--limit", "8", "--out", str(out)]) == 0
    assert "model − reference" in capsys.readouterr().out
    tasks = json.loads((out / "report.json").read_text())["tasks"]
    assert tasks["reference"] == "reference" and tasks["n-samples"]["tiny_mc"]["effective"] == 8
    row = tasks["rows"][0]
    assert row["model_minus_reference"] == pytest.approx(row["model"] - row["reference"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_folder)
    for name, model in (
        ("model", headkit.from_pretrained(other)),
        ("reference", reloaded(tiny_folder, "stock")),
    ):
        chosen = own_scores(model, tokenizer)["loglikelihoods"]["tiny_mc"][:8]
        hits = [
            max(range(4), key=s.__getitem__) == r["label"]
            for s, r in zip(chosen, multiple_choice_rows()[:8], strict=True)
        ]
        assert row[name] == pytest.approx(sum(hits) / 8)


@pytest.mark.parametrize("kind", ["stock", "linearized"])
def test_batching_and_padding_change_no_score(kind, tiny_folder, task_folder, tmp_path):
    folder = tiny_folder if kind == "stock" else _converted(tmp_path / kind, tiny_folder, SURGERIES[kind])
    model, tokenizer = reloaded(folder, kind), transformers.AutoTokenizer.from_pretrained(folder)
    settings = tk.TaskSettings(tasks=("tiny_mc", "tiny_ll"), include_path=task_folder)
    loaded = tk.load_tasks(settings)
    samples = {}
    for batch_size in (1, 3):  # 3 pads the shorter of each batch of contexts on the right
        batched = dataclasses.replace(loaded, settings=dataclasses.replace(settings, batch_size=batch_size))
        samples[batch_size] = tk.run_tasks(model, tokenizer, batched, log_samples=True)["samples"]
    own = own_scores(model, tokenizer)["loglikelihoods"]
    for task, metric in (("tiny_mc", "acc"), ("tiny_ll", "perplexity")):
        alone, padded = samples[1][task], samples[3][task]
        assert [s["doc_id"] for s in alone] == [s["doc_id"] for s in padded] == list(range(len(alone)))
        for one, three in zip(alone, padded, strict=True):
            # The same verdict per example; log-likelihoods equal up to float32 rounding of other matmul shapes.
            assert one[metric] == pytest.approx(three[metric], rel=1e-5)
            first = [resp[0][0] for resp in one["resps"]]
            assert first == pytest.approx([resp[0][0] for resp in three["resps"]], abs=1e-4)
            expected = own[task][one["doc_id"]]
            assert first == pytest.approx(expected if task == "tiny_mc" else [expected], abs=1e-4)


def test_the_tokenizer_is_copied_and_the_model_and_generators_left_as_they_were(tiny_folder, task_folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder).train()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_folder)
    vocabulary = dict(tokenizer.get_vocab())
    loaded = tk.load_tasks(tk.TaskSettings(tasks=("tiny_ll",), include_path=task_folder))
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    tk.run_tasks(model, tokenizer, loaded)
    assert torch.equal(torch.rand(3), expected)  # lm-eval seeded torch inside, and the state came back
    assert model.training and tokenizer.get_vocab() == vocabulary


# -- refusals: one line, exit status 2, before any model loads --------------------------------------------------------


def _refused(args, capsys) -> str:
    capsys.readouterr()
    assert _run(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    import headkit.runs.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(headkit.runs.models, "load_model", refuse)


def test_an_unknown_task_is_named_with_close_matches(
    tiny_folder, task_folder, tmp_path, capsys, no_model_loads
):
    args = ["eval", str(tiny_folder), "--tasks", "tiny_mcq", "--include-path", str(task_folder)]
    line = _refused([*args, "--out", str(tmp_path / "o")], capsys)
    assert "--tasks: unknown task 'tiny_mcq'" in line and "did you mean tiny_mc" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (
            ["--tasks", "tiny_mc", "--num-fewshot", "-1"],
            "Invalid value for '--num-fewshot'",
        ),
        (["--tasks", "tiny_mc", "--limit", "0"], "Invalid value for '--limit'"),
        (
            ["--tasks", "tiny_mc", "--batch-size", "0"],
            "Invalid value for '--batch-size'",
        ),
        (["--tasks", "tiny_mc,tiny_mc"], "--tasks names tiny_mc more than once"),
        (["--tasks", " , "], "--tasks must name at least one task"),
        (["--limit", "5"], "add --tasks"),
    ],
)
def test_bad_task_options_are_named(args, named, tiny_folder, task_folder, tmp_path, capsys, no_model_loads):
    base = ["eval", str(tiny_folder), "--include-path", str(task_folder), "--out", str(tmp_path / "o")]
    assert named in _refused([*base, *args], capsys)


def test_a_missing_include_path_is_named(tiny_folder, tmp_path, capsys, no_model_loads):
    args = ["eval", str(tiny_folder), "--tasks", "tiny_mc", "--include-path", str(tmp_path / "nowhere")]
    assert "--include-path" in _refused([*args, "--out", str(tmp_path / "o")], capsys)


def test_without_lm_eval_the_error_says_how_to_install_it(
    tiny_folder, task_folder, tmp_path, capsys, monkeypatch
):
    for name in [name for name in sys.modules if name == "lm_eval" or name.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    args = ["eval", str(tiny_folder), "--tasks", "tiny_mc", "--include-path", str(task_folder)]
    line = _refused([*args, "--out", str(tmp_path / "o")], capsys)
    assert "lm-eval" in line and "pip install 'headkit[eval]'" in line


def test_data_not_on_this_machine_with_the_hub_offline_names_the_task(
    tiny_folder, hub_folder, tmp_path, capsys, monkeypatch, no_model_loads
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = ["eval", str(tiny_folder), "--tasks", "hub_only", "--include-path", str(hub_folder)]
    line = _refused([*args, "--out", str(tmp_path / "o")], capsys)
    assert "--tasks hub_only: its data is not on this machine and the hub is offline" in line
    assert "--include-path" in line and "hub online" in line


# -- the recipes: the original and the result, before and after -----------------------------------------------------


def _own_accuracy(model, folder):
    return own_scores(model, transformers.AutoTokenizer.from_pretrained(folder))["tiny_mc"]["acc"]


def assert_each_models_own_loglikelihoods_and_a_changed_model(tasks, name, original, result, folder):
    """The report's per-example log-likelihoods of tiny_mc: the original's are the stock model's own, the
    result's (`name`) those of the model saved in `folder`, and the two differ. Equal accuracies cannot show that
    the result was measured at all (12 questions: a changed model often picks the same choices); the figures
    behind them can. Each agrees with the model's own to 1e-4 (measured: ~2e-6, float32 rounding of other
    matmul shapes), so a result that is the original (measured twice, or left unconverted) would differ from it
    by 2e-4 at most; these recipes' results differ by 0.04 or more (measured), and the bound 1e-3 lies between.
    """
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    figures = tasks["loglikelihoods"]
    for model_name, model in (("original", original), (name, result)):
        own = own_scores(model, tokenizer)["loglikelihoods"]["tiny_mc"]
        assert figures[model_name]["tiny_mc"] == [pytest.approx(row, abs=1e-4) for row in own], model_name
    first, second = (torch.tensor(figures[key]["tiny_mc"]) for key in ("original", name))
    assert first.shape == second.shape == (12, 4)
    difference = float((first - second).abs().max())
    assert difference > 1e-3, f"{name}: the original's log-likelihoods, to {difference:.2g}"


def test_prune_reports_task_accuracy_before_and_after(
    tiny_folder, task_folder, text_folder, tmp_path, capsys
):
    out = tmp_path / "pruned"
    args = ["prune", str(tiny_folder), "--heads", "5", "--data", str(text_folder), "--out", str(out)]
    args += ["--quick", "--window", "16", "--train-texts", "16", "--batch-size", "4", "--recovery-steps", "2"]
    assert _run([*args, "--eval-tasks", "tiny_mc", "--eval-include-path", str(task_folder)]) == 0
    assert "pruned − original" in capsys.readouterr().out
    tasks = json.loads((out / "report.json").read_text())["tasks"]
    assert set(tasks["results"]) == {"original", "pruned"} and tasks["reference"] == "original"
    row = tasks["rows"][0]
    original, pruned = reloaded(tiny_folder, "stock"), headkit.from_pretrained(out).eval()
    assert row["original"] == pytest.approx(_own_accuracy(original, tiny_folder))
    assert row["pruned"] == pytest.approx(_own_accuracy(pruned, out))
    assert row["pruned_minus_original"] == pytest.approx(row["pruned"] - row["original"])
    assert_each_models_own_loglikelihoods_and_a_changed_model(tasks, "pruned", original, pruned, out)


def test_linearize_and_compress_report_task_accuracy(tiny_folder, task_folder, text_folder, tmp_path):
    from headkit.recipes.compress import compress
    from headkit.recipes.linearize import LinearizeSettings, linearize

    options = {"eval_tasks": ("tiny_mc",), "eval_include_path": task_folder, "data": text_folder}
    linearized = linearize(
        LinearizeSettings(
            model=tiny_folder,
            out=tmp_path / "linearized",
            window=8,
            train_length=32,
            train_windows=4,
            batch_size=4,
            transfer_steps=1,
            recovery_steps=1,
            eval_lengths=(32,),
            held_out_windows=1,
            decode_contexts=(16,),
            decode_steps=1,
            decode_batch_sizes=(1,),
            **options,
        ),
        echo=lambda line: None,
    )
    compressed = compress(
        model=tiny_folder,
        out=tmp_path / "compressed",
        kv_rank=12,
        rope_dims=4,
        window=16,
        batch_size=4,
        train_texts=8,
        held_out_texts=2,
        calibration_windows=2,
        timing_repeats=1,
        echo=lambda line: None,
        **options,
    )
    stock = reloaded(tiny_folder, "stock")
    original = _own_accuracy(stock, tiny_folder)
    for result, name in ((linearized, "linearized"), (compressed, "compressed")):
        out = tmp_path / name
        tasks = json.loads((out / "report.json").read_text())["tasks"]
        row = tasks["rows"][0]
        converted = headkit.from_pretrained(out).eval()
        assert row["original"] == pytest.approx(original)
        assert row[name] == pytest.approx(_own_accuracy(converted, out))
        assert f"{name} − original" in str(result)
        assert_each_models_own_loglikelihoods_and_a_changed_model(tasks, name, stock, converted, out)


def test_recipes_refuse_unknown_tasks_and_encoders_before_any_work(
    save_tiny_encoder, tiny_folder, task_folder, tmp_path, capsys
):
    args = ["prune", str(tiny_folder), "--eval-tasks", "nope", "--eval-include-path", str(task_folder)]
    assert "--eval-tasks: unknown task 'nope'" in _refused([*args, "--out", str(tmp_path / "o")], capsys)
    encoder = save_tiny_encoder(tmp_path / "encoder")
    args = ["compress", str(encoder), "--eval-tasks", "tiny_mc", "--eval-include-path", str(task_folder)]
    assert "--eval-tasks scores causal LMs" in _refused([*args, "--out", str(tmp_path / "o")], capsys)
    args = ["linearize", str(tiny_folder), "--eval-include-path", str(task_folder)]
    assert "add --eval-tasks" in _refused([*args, "--out", str(tmp_path / "o")], capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_fewshot", -1, "--num-fewshot must be a non-negative integer, got -1"),
        ("limit", 0, "--limit must be a positive integer, got 0"),
        ("trials", 0, "--trials must be a positive integer, got 0"),
        ("depths", (0.5, 2.0), "--depths must be numbers in \\[0, 1\\]"),
        ("dtype", "float64", "--dtype"),
    ],
)
def test_the_library_checks_eval_settings_as_their_fields_declare(field, value, named, tiny_folder, tmp_path):
    from headkit.evaluation.settings import EvalSettings, check_eval_settings

    settings = EvalSettings(model=tiny_folder, out=tmp_path / "o", tasks=("tiny_mc",), **{field: value})
    with pytest.raises(HeadkitError, match=named):
        check_eval_settings(settings)
