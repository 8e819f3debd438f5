"""What bounds a recipe's memory without changing its result. --micro-batch: a recovery step's batch run in several
forwards, their gradients summed into the same step — the whole batch's model (up to the summation's rounding) —
and a micro-batch that does not divide the batch refused in one line before any work. The measurement's student
holding the untouched weights once with the teacher, never with a model the caller passed in."""

import importlib
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from headkit.cli import main
from headkit.errors import HeadkitError
from headkit.recipes.prune_settings import PruneSettings
from headkit.recipes.settings import TRAINING_FORWARD_TOKENS, training_forwards

transformers.logging.set_verbosity_error()

PRUNE = ["prune", "--heads", "5", "--quick", "--window", "16", "--train-texts", "16", "--held-out", "2"]
PRUNE += ["--batch-size", "8", "--recovery-steps", "4", "--seed", "3"]
LINEARIZE = [
    "linearize", "--quick", "--window", "8", "--train-length", "32", "--train-windows", "8", "--batch-size", "4",
    "--transfer-steps", "2", "--recovery-steps", "2", "--eval-lengths", "32", "--held-out-windows", "2",
    "--decode-contexts", "48", "--decode-steps", "2", "--decode-batch-sizes", "1",
]  # fmt: skip


def _run(args):
    with pytest.raises(SystemExit) as exited:
        main(args)
        raise SystemExit(0)
    return exited.value.code


def _largest_difference(first, second) -> float:
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.mark.parametrize(
    ("batch", "micro", "accumulation", "expected"),
    [(16, 16, 1, (16, 1)), (16, 4, 1, (4, 4)), (16, 4, 2, (4, 8)), (6, 3, 1, (3, 2))],
)
def test_training_forwards_splits_the_batch_into_micro_batches(batch, micro, accumulation, expected):
    settings = PruneSettings(batch_size=batch, micro_batch=micro, gradient_accumulation_steps=accumulation)
    assert training_forwards(settings, 256) == expected


@pytest.mark.parametrize(
    ("batch", "tokens", "accumulation", "expected"),
    # the most examples a divisor of the batch whose tokens fit TRAINING_FORWARD_TOKENS; one at least
    [
        (16, 64, 1, (16, 1)),
        (16, 256, 1, (4, 4)),
        (16, 256, 2, (4, 8)),
        (6, 300, 1, (3, 2)),
        (2, 1024, 1, (1, 2)),
        (3, 4096, 1, (1, 3)),
        (7, 200, 1, (1, 7)),
    ],
)
def test_without_a_micro_batch_a_forward_holds_at_most_1024_tokens(batch, tokens, accumulation, expected):
    assert TRAINING_FORWARD_TOKENS == 1024
    settings = PruneSettings(batch_size=batch, gradient_accumulation_steps=accumulation)
    assert training_forwards(settings, tokens) == expected


@pytest.mark.parametrize("micro", [3, 32])
def test_a_micro_batch_that_does_not_divide_the_batch_is_refused(micro):
    with pytest.raises(HeadkitError, match=r"--micro-batch must divide --batch-size \(16\)"):
        training_forwards(PruneSettings(batch_size=16, micro_batch=micro), 256)


@pytest.mark.parametrize(("name", "command"), [("prune", PRUNE), ("linearize", LINEARIZE)])
def test_micro_batches_give_the_whole_batchs_model(
    name, command, tiny_llama, text_folder, tmp_path, monkeypatch
):
    distill = importlib.import_module(
        "headkit.recipes.distill"
    )  # the module (the package names a function so)
    forwards, train_loop = [], distill.train_loop

    def observed(*args, **kwargs):  # what each training's forwards are: (examples, forwards per step)
        forwards.append((kwargs["batch_size"], kwargs["gradient_accumulation_steps"]))
        return train_loop(*args, **kwargs)

    monkeypatch.setattr(distill, "train_loop", observed)
    outs, batch = {}, int(command[command.index("--batch-size") + 1])
    for micro in (batch, 2):  # the whole batch in one forward (linearize's default is one window a forward)
        outs[micro] = tmp_path / f"out-{micro}"
        args = [
            command[0],
            str(tiny_llama),
            *command[1:],
            "--data",
            str(text_folder),
            "--micro-batch",
            str(micro),
        ]
        assert _run([*args, "--out", str(outs[micro])]) == 0
    trainings = len(forwards) // 2
    assert forwards == [(batch, 1)] * trainings + [(2, batch // 2)] * trainings and trainings >= 1
    assert _largest_difference(outs[batch], outs[2]) <= 1e-5
    first, second = (json.loads((out / "report.json").read_text()) for out in outs.values())
    assert second["settings"]["micro_batch"] == 2


def test_the_command_line_refuses_a_micro_batch_that_does_not_divide_the_batch(
    tiny_llama, text_folder, tmp_path, capsys
):
    args = ["prune", str(tiny_llama), *PRUNE[1:], "--data", str(text_folder), "--micro-batch", "3"]
    assert _run([*args, "--out", str(tmp_path / "o")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --micro-batch must divide --batch-size (8), got 3"]
    assert not (tmp_path / "o").exists()


def test_the_measurement_holds_the_unchanged_weights_once_unless_the_caller_loaded_the_model(
    tiny_llama, text_folder, tmp_path, monkeypatch
):
    """After the recovery nothing trains: the recipe points the student's untouched weights at the teacher's
    (a pruned model's MLPs and embeddings), but never at a model the caller passed in and keeps."""
    from headkit.recipes import steps as recipe_steps
    from headkit.recipes.prune import prune
    from headkit.recipes.prune_settings import PruneSettings
    from headkit.runs.models import load_model

    freed, share = [], recipe_steps.share_unchanged_weights

    def sharing(model, reference):
        held_once = {p.data_ptr() for p in reference.parameters()}
        freed.append(share(model, reference))
        shared = [n for n, p in model.named_parameters() if p.data_ptr() in held_once]
        freed[-1] = (freed[-1], shared)

    monkeypatch.setattr(recipe_steps, "share_unchanged_weights", sharing)
    # without a recovery (which trains every weight here) the MLPs and embeddings are the original's, held once
    # from the pruning on (headkit.runs.models.shared_copy); the measurement frees what the pruning copied but
    # left equal (the key/value projections when only query heads go)
    args = ["prune", str(tiny_llama), *PRUNE[1:], "--data", str(text_folder), "--recovery-steps", "0"]
    assert _run([*args, "--out", str(tmp_path / "cli")]) == 0
    weights = dict(load_model(tiny_llama).model.named_parameters())
    mlp = {n for n in weights if ".mlp." in n}
    key_values = {n for n in weights if ".k_proj." in n or ".v_proj." in n}
    assert len(freed) == 1 and (mlp | key_values) <= set(freed[0][1])
    assert freed[0][0] == sum(weights[n].numel() * 4 for n in key_values)
    loaded = load_model(tiny_llama)
    settings = PruneSettings(
        model=tiny_llama, data=text_folder, heads=5, window=16, train_texts=16, held_out_texts=2, batch_size=8,
        recovery_steps=1, out=tmp_path / "library",
    )  # fmt: skip
    result = prune(settings, echo=lambda text: None, loaded=loaded)
    assert len(freed) == 1  # not called again
    ours = {p.data_ptr() for p in loaded.model.parameters()}
    assert not ours & {p.data_ptr() for p in result.model.parameters()}


@pytest.mark.parametrize(
    "command",
    [
        pytest.param([*PRUNE, "--lora-rank", "0"], id="prune-full-recovery"),
        pytest.param([*PRUNE], id="prune-lora-recovery-by-default"),
        pytest.param([*PRUNE, "--unit", "group", "--uniform", "--heads", "4"], id="prune-groups"),
        pytest.param([*LINEARIZE], id="linearize-lora"),
        pytest.param([*LINEARIZE, "--lora-rank", "0"], id="linearize-full"),
        pytest.param(
            ["compress", "--kv-budget", "1/2", "--kv-budget-context", "64"], id="compress-kv-budget"
        ),
    ],
)
def test_a_conversion_that_holds_the_original_once_leaves_the_original_unchanged(
    command, tiny_llama, text_folder, tmp_path, monkeypatch
):
    """The student holds the original's tensors from the surgery on (headkit.runs.models.shared_copy); the repair,
    a training and a LoRA merge write copies of their own, so the original is what was loaded, value for value."""
    from headkit.recipes import steps as recipe_steps
    from headkit.runs.models import load_model

    loaded = dict(load_model(tiny_llama).model.named_parameters())
    checked, share = [], recipe_steps.share_unchanged_weights

    def compared(model, reference):  # at the measurement: after the surgery, the repair, a training, a merge
        for name, parameter in reference.named_parameters():
            assert torch.equal(parameter, loaded[name]), name
        checked.append(name)
        return share(model, reference)

    monkeypatch.setattr(recipe_steps, "share_unchanged_weights", compared)
    args = [command[0], str(tiny_llama), *command[1:], "--data", str(text_folder)]
    assert _run([*args, "--out", str(tmp_path / "out")]) == 0
    assert len(checked) == 1
    # the preflight's estimate is kept beside the measured peak
    peak = json.loads((tmp_path / "out" / "report.json").read_text())["peak_memory"]
    assert peak["resident_bytes"] > 0 and peak["estimate"]["bytes"] > 0
    assert peak["estimate"]["stage"] in peak["estimate"]["stages"]


def test_a_micro_batch_below_the_process_count_takes_one_example_per_process(monkeypatch):
    """linearize's default of one 1,024-token window a forward, under torchrun with 2 processes: each takes one."""
    from headkit.recipes.linearize_settings import LinearizeSettings

    length = LinearizeSettings().train_length
    assert length == 1024
    assert training_forwards(LinearizeSettings(), length) == (1, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert training_forwards(LinearizeSettings(), length) == (2, 1)
    assert training_forwards(LinearizeSettings(batch_size=4), length) == (2, 2)
