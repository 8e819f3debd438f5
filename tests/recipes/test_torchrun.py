"""Every recipe under ``torchrun`` (two CPU processes, gloo): one writer, one report, the same model as one process.

The run is the user's command unchanged (``torchrun --nproc_per_node 2 -m headkit prune …``); --batch-size is the
global batch, so two processes take half of each batch and the same optimizer steps as one process taking it
whole: the saved weights agree up to the order of the gradient all-reduce."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from headkit.files import WRITE_LOG_ENVIRONMENT

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

PRUNE = ["prune", "--heads", "5", "--quick", "--window", "16", "--train-texts", "16", "--held-out", "2"]
PRUNE += ["--batch-size", "4", "--recovery-steps", "3"]
LINEARIZE = [
    "linearize", "--quick", "--window", "8", "--train-length", "32", "--train-windows", "8", "--batch-size", "4",
    "--transfer-steps", "2", "--recovery-steps", "2", "--eval-lengths", "32", "--held-out-windows", "2",
    "--decode-contexts", "48", "--decode-steps", "2", "--decode-batch-sizes", "1",
]  # fmt: skip
COMPRESS = ["compress", "--kv-rank", "8", "--rope-dims", "4", "--recovery-steps", "3", "--window", "16"]
COMPRESS += ["--batch-size", "4", "--held-out", "2", "--timing-repeats", "1", "--calibration-windows", "2"]
COMPRESS += ["--eval-window", "16"]


def _environment() -> dict[str, str]:
    launched = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launched)}
    return env | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _headkit(
    args: list[str], processes: int, launcher: tuple[str, ...] = (), writes=None, fault: str | None = None
) -> subprocess.CompletedProcess:
    if launcher:
        command = [*launcher, "--num_processes", str(processes), "-m", "headkit"]
    elif processes == 1:
        command = [sys.executable, "-m", "headkit"]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(processes),
        ]
        command += ["-m", "headkit"]
    # Each process lists in `writes` every path it creates or moves into place (headkit.files.record_write).
    env = _environment() | ({WRITE_LOG_ENVIRONMENT: str(writes)} if writes is not None else {})
    env |= {"HEADKIT_FAULT_AT": fault} if fault is not None else {}
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=600, env=env, check=False
    )


def _weights(folder) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights |= load_file(shard)
    return weights


def _one_and_two_processes(recipe: list[str], model, data, tmp_path, launcher: tuple[str, ...] = ()):
    outputs = {}
    for processes in (1, 2):
        out = tmp_path / f"out{processes}"
        args = [recipe[0], str(model), *recipe[1:], "--data", str(data), "--seed", "3", "--out", str(out)]
        writes = tmp_path / f"writes{processes}"
        result = _headkit(args, processes, launcher if processes == 2 else (), writes)
        assert result.returncode == 0, result.stderr[-4000:]
        outputs[processes] = (out, result, writes)
    return outputs


def _assert_same_model_one_writer(outputs, tmp_path, saved_line: str):
    import headkit

    (one, _, _), (two, result, writes) = outputs[1], outputs[2]
    # One writer, observed: each process listed every path it created or moved into place (the staging folder,
    # the report, the output folder), and only rank 0 has a list — a second rank writing its own folder and
    # moving it into place, even one that leaves no trace beside `out`, would have one too.
    lists = {log.name: log.read_text().splitlines() for log in writes.iterdir()}
    assert list(lists) == ["rank-0.paths"], lists
    assert str(two) in lists["rank-0.paths"], lists
    # One output folder, no staging folder left behind, each report line printed once.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))) == [
        "out1",
        "out2",
    ]
    assert result.stdout.count(saved_line) == 1, result.stdout
    assert json.loads((two / "report.json").read_text())["reload_max_abs_diff"] <= 1e-5
    first, second = _weights(one), _weights(two)
    assert first.keys() == second.keys() and first
    difference = max(float((first[name] - second[name]).abs().max()) for name in first)
    assert difference <= 1e-5, difference
    reloaded = headkit.from_pretrained(two)  # the two-process output reloads and generates
    assert reloaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


@pytest.mark.slow
def test_prune_under_torchrun_saves_once_the_model_one_process_saves(tiny_llama, text_folder, tmp_path):
    outputs = _one_and_two_processes(PRUNE, tiny_llama, text_folder, tmp_path)
    _assert_same_model_one_writer(outputs, tmp_path, "saved to")


@pytest.mark.slow
def test_linearize_under_torchrun_saves_once_the_model_one_process_saves(tiny_llama, text_folder, tmp_path):
    outputs = _one_and_two_processes(LINEARIZE, tiny_llama, text_folder, tmp_path)
    _assert_same_model_one_writer(outputs, tmp_path, "saved to")


@pytest.mark.slow
def test_compress_under_torchrun_saves_once_the_model_one_process_saves(tiny_llama, text_folder, tmp_path):
    outputs = _one_and_two_processes(COMPRESS, tiny_llama, text_folder, tmp_path)
    _assert_same_model_one_writer(outputs, tmp_path, "saved to")


@pytest.mark.slow
def test_a_run_under_torchrun_killed_mid_training_resumes_to_the_uninterrupted_result(
    tiny_llama, text_folder, tmp_path
):
    recipe = [*PRUNE[:-1], "6"]  # --recovery-steps 6: checkpoints at steps 2, 4 and 6
    args = [recipe[0], str(tiny_llama), *recipe[1:], "--data", str(text_folder), "--checkpoint-steps", "2"]
    whole, out = tmp_path / "whole", tmp_path / "out"
    assert _headkit([*args, "--out", str(whole)], 2).returncode == 0
    # Every rank kills itself once step 3 is done (as a machine going down would take them all).
    killed = _headkit([*args, "--out", str(out)], 2, fault="recover:3")
    assert killed.returncode != 0 and not out.exists()
    writes = tmp_path / "writes"
    resumed = _headkit([*args, "--out", str(out), "--resume"], 2, writes=writes)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed.stdout.count("resuming the training from") == 1, resumed.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["resumed"] == ["data", "convert", "repair"]
    assert report["resumed_checkpoints"] == ["recover/train-0/checkpoint-2"]
    assert [log.name for log in writes.iterdir()] == ["rank-0.paths"]  # one writer of the work folder too
    first, second = _weights(whole), _weights(out)
    assert max(float((first[name] - second[name]).abs().max()) for name in first) <= 1e-6


ACCELERATE = (sys.executable, "-m", "accelerate.commands.launch")


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        # accelerate's route to several processes on one machine (torchrun underneath; on the CPU, DDP over gloo)
        ("--multi_gpu",),
        # FSDP asked for: accelerate runs a CPU launch as DDP (MULTI_CPU) and ignores the FSDP plugin, so the
        # recipe gives the same model; on GPUs the same command shards it (docs/distributed.md)
        ("--use_fsdp", "--fsdp_version", "2", "--fsdp_state_dict_type", "FULL_STATE_DICT"),
    ],
    ids=["ddp", "fsdp-on-cpu"],
)
def test_prune_under_accelerate_launch_saves_once_the_model_one_process_saves(
    options, tiny_llama, text_folder, tmp_path
):
    outputs = _one_and_two_processes(PRUNE, tiny_llama, text_folder, tmp_path, (*ACCELERATE, *options))
    _assert_same_model_one_writer(outputs, tmp_path, "saved to")


def test_a_bad_argument_under_torchrun_exits_2_on_every_rank_with_one_line(tiny_llama, tmp_path):
    out = tmp_path / "out"
    result = _headkit(["prune", str(tiny_llama), "--heads", "999", "--quick", "--out", str(out)], 2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--heads must be in [1, 8]" in errors[0], result.stderr[-3000:]
    # Every rank refuses the argument before any collective (no rank can wait for another); torchrun ends the
    # group at the first exit and names its status.
    assert "exitcode: 2" in result.stderr and "exitcode: 1" not in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split("exitcode: 2")[0]
    assert not out.exists()


def test_the_write_log_lists_each_path_per_rank_and_nothing_when_unset(tmp_path, monkeypatch):
    from headkit.files import staged_folder, write_json_atomic

    def save(out):
        with staged_folder(out) as staging:
            write_json_atomic(staging / "report.json", {"a": 1})
            return staging

    monkeypatch.delenv(WRITE_LOG_ENVIRONMENT, raising=False)
    save(tmp_path / "plain")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # unset: nothing beside the output
    monkeypatch.setenv(WRITE_LOG_ENVIRONMENT, str(tmp_path / "writes"))
    monkeypatch.setenv("RANK", "1")
    staging = save(tmp_path / "out")
    lines = (tmp_path / "writes" / "rank-1.paths").read_text().splitlines()
    assert lines == [str(staging), str(staging / "report.json"), str(tmp_path / "out")]
    assert [p.name for p in (tmp_path / "writes").iterdir()] == ["rank-1.paths"]
