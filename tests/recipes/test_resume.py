"""A recipe run killed at any moment resumes with --resume to the uninterrupted run's result: each recipe killed
(SIGKILL, a real process, through the HEADKIT_FAULT_AT test hook) during its surgery, its repair, between training
checkpoints, during its measurement and its save; Ctrl-C and SIGTERM; a resume refused for other settings or
input; damaged checkpoints, snapshots and inputs; a failing writer."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from safetensors.torch import load_file

from headkit.cli import main
from headkit.recipes.loop import CHECKPOINT_RECORD
from headkit.recipes.work import work_folder

transformers.logging.set_verbosity_error()

PRUNE = [
    "prune",
    "--quick",
    "--window",
    "16",
    "--train-texts",
    "16",
    "--batch-size",
    "4",
    "--recovery-steps",
    "6",
]
LATENT = [
    "compress",
    "--kv-rank",
    "6",
    "--rope-dims",
    "2",
    "--recovery-steps",
    "5",
    "--calibration-windows",
    "4",
]
LATENT += [
    "--eval-window",
    "24",
    "--window",
    "16",
    "--batch-size",
    "4",
    "--held-out",
    "2",
    "--timing-repeats",
    "1",
]
LATENT += ["--max-iter", "5"]
LINEARIZE = [
    "linearize",
    "--window",
    "8",
    "--train-length",
    "64",
    "--train-windows",
    "8",
    "--batch-size",
    "4",
]
LINEARIZE += ["--transfer-steps", "5", "--recovery-steps", "5", "--lora-rank", "2", "--eval-lengths", "64"]
LINEARIZE += [
    "--held-out-windows",
    "2",
    "--decode-contexts",
    "32",
    "--decode-steps",
    "2",
    "--decode-batch-sizes",
    "1",
]
COLLABORATIVE = ["compress", "--dim", "16", "--recovery-steps", "5", "--window", "16", "--batch-size", "4"]
COLLABORATIVE += ["--held-out", "2", "--timing-repeats", "1", "--max-iter", "5"]
# An encoder's pruning trains Hard Concrete gates in its convert stage (with an L0 controller outside the model).
ENCODER = ["prune", "--quick", "--train-texts", "16", "--held-out", "4", "--batch-size", "4", "--steps", "6"]
ENCODER += ["--recovery-steps", "4"]
COMMANDS = {
    "prune": PRUNE,
    "latent": LATENT,
    "linearize": LINEARIZE,
    "collaborative": COLLABORATIVE,
    "encoder": ENCODER,
}
# Collaborative heads need a model without rotary embeddings; an encoder, texts one a line.
MODELS = {"collaborative": "tiny_gpt2", "encoder": "tiny_encoder"}
DATA = {"encoder": "sentences"}
# One thread, as the tests' own process (tests/conftest.py): the killed run computes what the in-process runs do.
LAUNCH = "import sys, torch; torch.set_num_threads(1); from headkit.cli import main; main(sys.argv[1:])"


def _run(args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    return exit_info.value.code


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory, save_tiny_encoder):
    return save_tiny_encoder(tmp_path_factory.mktemp("bert") / "model")


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    words = "heads share keys values queries groups prune recover distil attention layers tokens".split()
    lines = (" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(800))
    path = tmp_path_factory.mktemp("sentences") / "sentences.txt"
    path.write_text("\n".join(lines))
    return path


def _inputs(name, request):
    """The model and the text a recipe's case runs on."""
    model = request.getfixturevalue(MODELS.get(name, "tiny_llama"))
    return model, request.getfixturevalue(DATA.get(name, "text_folder"))


def _command(name, model, text_folder, out, *extra):
    command = COMMANDS[name]
    return [command[0], str(model), *command[1:], "--data", str(text_folder), "--out", str(out), *extra]


def _launch(args, fault, signal_name=None):
    """The command in its own process, sent `signal_name` (SIGKILL by default) at the fault point `fault`."""
    environment = os.environ | {"HEADKIT_FAULT_AT": fault, "OMP_NUM_THREADS": "1"}
    if signal_name is not None:
        environment["HEADKIT_FAULT_SIGNAL"] = signal_name
    return subprocess.run(
        [sys.executable, "-c", LAUNCH, *args], env=environment, capture_output=True, text=True, timeout=600
    )


def _largest_difference(first: Path, second: Path) -> float:
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def _error_line(capsys) -> str:
    """The one error line the command printed (stderr also holds transformers' progress bars)."""
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def references(request, text_folder, tmp_path_factory):
    """Each recipe's uninterrupted run (checkpointing every 2 steps, as the interrupted runs do)."""
    folder, outs = tmp_path_factory.mktemp("references"), {}

    def reference(name):
        if name not in outs:
            outs[name] = folder / name
            model, data = _inputs(name, request)
            args = [*_command(name, model, data, outs[name]), "--checkpoint-steps", "2"]
            assert _run(args) == 0
            assert _report(outs[name])["resumed"] == []
        return outs[name]

    return reference


CASES = [
    # (recipe, where it is killed, the stages the resumed run takes from the work folder, a checkpoint resumed from)
    ("prune", "convert", ["data"], None),
    ("prune", "repair", ["data", "convert"], None),
    ("prune", "recover:3", ["data", "convert", "repair"], "recover/train-0/checkpoint-2"),
    ("prune", "measure", ["data", "convert", "repair", "recover"], None),
    ("prune", "save", ["data", "convert", "repair", "recover", "measure"], None),
    ("latent", "repair", ["data", "convert"], None),
    ("latent", "recover:3", ["data", "convert", "repair"], "recover/train-0/checkpoint-2"),
    ("latent", "measure", ["data", "convert", "repair", "recover"], None),
    ("linearize", "convert", ["data"], None),
    # the LoRA training, after the attention transfer finished: the transfer is taken from its last checkpoint
    ("linearize", "recover.1:3", ["data", "convert", "repair"], "recover/train-1/checkpoint-2"),
    ("linearize", "measure", ["data", "convert", "repair", "recover"], None),
    ("collaborative", "recover:3", ["data", "convert", "repair"], "recover/train-0/checkpoint-2"),
    # the gate training, between its checkpoints: the heads kept depend on the multipliers it carries
    ("encoder", "convert:3", ["data"], "convert/train-0/checkpoint-2"),
]


@pytest.mark.parametrize("name, fault, resumed, checkpoint", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_run_killed_resumes_to_the_uninterrupted_result(
    name, fault, resumed, checkpoint, references, request, text_folder, tmp_path
):
    reference = references(name)
    out = tmp_path / "out"
    model, data = _inputs(name, request)
    args = [*_command(name, model, data, out), "--checkpoint-steps", "2"]
    killed = _launch(args, fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()  # never a half-written result
    assert (work_folder(out) / "run.json").is_file()

    assert _run([*args, "--resume"]) == 0
    assert _largest_difference(reference, out) <= 1e-6
    report = _report(out)
    assert report["resumed"] == resumed
    if checkpoint is not None:
        assert checkpoint in report["resumed_checkpoints"]
    assert not work_folder(out).exists()  # the result is in place: the work folder is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # and no staging folder of the killed save


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_and_sigterm_leave_a_resumable_run_and_say_so_in_one_line(
    signal_name, status, references, tiny_llama, text_folder, tmp_path
):
    out = tmp_path / "out"
    args = [*_command("prune", tiny_llama, text_folder, out), "--checkpoint-steps", "2"]
    interrupted = _launch(args, "recover:3", signal_name)
    assert interrupted.returncode == status, interrupted.stderr[-2000:]
    lines = [line for line in interrupted.stderr.splitlines() if "interrupted" in line]
    assert lines == [
        f"interrupted; the run so far is in {work_folder(out)}: add --resume to the same command to continue"
    ]
    assert not out.exists()
    assert any(work_folder(out).glob("recover/train-0/checkpoint-2"))
    assert _run([*args, "--resume"]) == 0
    assert _largest_difference(references("prune"), out) <= 1e-6


def test_a_resume_of_another_run_is_refused_in_one_line_and_a_leftover_is_announced(
    tiny_llama, text_folder, tmp_path, capsys
):
    model = tmp_path / "model"  # a copy of its own, to change
    model.mkdir()
    for file in Path(tiny_llama).iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    out = tmp_path / "out"
    args = _command("prune", model, text_folder, out)
    assert _launch(args, "convert").returncode == -signal.SIGKILL
    work = work_folder(out)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in work.iterdir())

    other = [
        *args[: args.index("--recovery-steps")],
        "--recovery-steps",
        "4",
        *args[args.index("--recovery-steps") + 2 :],
    ]
    assert _run([*other, "--resume"]) == 2
    err = _error_line(capsys)
    assert "--recovery-steps 4 (was 6)" in err and str(work) in err

    assert _run([*_command("prune", tiny_llama, text_folder, out), "--resume"]) == 2  # another MODEL
    err = _error_line(capsys)
    assert f"MODEL {Path(tiny_llama).resolve()} (was {model.resolve()})" in err

    config = model / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the same MODEL, changed since
    assert _run([*args, "--resume"]) == 2
    err = _error_line(capsys)
    assert f"another input: MODEL {str(model.resolve())!r} changed since" in err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in work.iterdir()) == before  # left as it was
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    fresh = tmp_path / "fresh"
    assert (
        _run([*_command("prune", tiny_llama, text_folder, fresh), "--resume", "--recovery-steps", "0"]) == 0
    )
    assert f"--resume: no interrupted run in {work_folder(fresh)}; starting afresh" in capsys.readouterr().out

    assert _run([*args, "--recovery-steps", "0"]) == 0  # without --resume: announced, then replaced
    printed = capsys.readouterr().out
    assert f"an interrupted run of this command is in {work}; add --resume to continue it" in printed
    assert _report(out)["resumed"] == [] and not work.exists()


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(
    references, tiny_llama, text_folder, tmp_path, capsys
):
    out = tmp_path / "out"
    args = [*_command("prune", tiny_llama, text_folder, out), "--checkpoint-steps", "2"]
    assert _launch(args, "recover:5").returncode == -signal.SIGKILL
    newest = work_folder(out) / "recover" / "train-0" / "checkpoint-4"
    assert (newest / CHECKPOINT_RECORD).is_file()
    optimizer = newest / "optimizer.pt"
    damaged = bytearray(optimizer.read_bytes())
    damaged[-100:] = bytes(100)
    optimizer.write_bytes(bytes(damaged))

    assert _run([*args, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"skipping checkpoint {newest}: optimizer.pt does not match its record (damaged)" in printed
    assert _report(out)["resumed_checkpoints"] == ["recover/train-0/checkpoint-2"]
    assert _largest_difference(references("prune"), out) <= 1e-6


def test_a_damaged_snapshot_is_announced_and_its_stages_run_again(
    references, tiny_llama, text_folder, tmp_path, capsys
):
    out = tmp_path / "out"
    args = [*_command("prune", tiny_llama, text_folder, out), "--checkpoint-steps", "2"]
    assert _launch(args, "measure").returncode == -signal.SIGKILL
    snapshot = work_folder(out) / "stage-recover.pt"
    snapshot.write_bytes(snapshot.read_bytes()[:1000])
    assert _run([*args, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"--resume: {snapshot} is damaged" in printed
    assert _report(out)["resumed"] == []
    assert _largest_difference(references("prune"), out) <= 1e-6


def _damaged_safetensors(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    return weights


def _damaged_config(folder):
    config = folder / "config.json"
    config.write_text('{"model_type": "llama", "hidden_')
    return config


@pytest.mark.parametrize("damage", [_damaged_safetensors, _damaged_config])
def test_a_damaged_model_file_is_refused_in_one_line_naming_it(
    damage, tiny_llama, text_folder, tmp_path, capsys
):
    model = tmp_path / "model"
    model.mkdir()
    for file in Path(tiny_llama).iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    damaged = damage(model)
    out = tmp_path / "out"
    assert _run(_command("prune", model, text_folder, out)) == 2
    err = _error_line(capsys)
    assert str(damaged) in err or (str(model) in err and damaged.name in err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no --out, no work folder


def test_a_gguf_file_cut_short_is_refused_in_one_line(text_folder, tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((100, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-5000])
    assert _run(["prune", str(cut), "--data", str(text_folder), "--out", str(tmp_path / "out")]) == 2
    err = _error_line(capsys)
    assert str(cut) in err and "GGUF" in err
    assert not (tmp_path / "out").exists() and not work_folder(tmp_path / "out").exists()


def test_a_failing_writer_at_the_save_is_one_line_and_the_run_resumes_to_the_save(
    references, tiny_llama, text_folder, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    args = [*_command("prune", tiny_llama, text_folder, out), "--checkpoint-steps", "2"]

    def full_disk(self, folder, *args, **kwargs):  # the tokenizer: written by the save alone, not by Trainer
        raise OSError(28, "No space left on device", str(Path(folder) / "tokenizer.json"))

    with monkeypatch.context() as patch:
        patch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", full_disk)
        assert _run(args) == 2
    err = _error_line(capsys)
    assert "No space left on device" in err and "tokenizer.json" in err
    assert "--resume" in err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # no staging folder left either
    assert _run([*args, "--resume"]) == 0
    assert _report(out)["resumed"] == ["data", "convert", "repair", "recover", "measure"]
    assert _largest_difference(references("prune"), out) <= 1e-6


def test_resume_is_an_option_of_the_commands_that_save_not_of_the_benchmarks():
    from headkit.bench.linearize import LinearizeBenchSettings
    from headkit.recipes.compress_settings import CompressSettings
    from headkit.recipes.linearize_settings import LinearizeSettings
    from headkit.recipes.prune_settings import PruneSettings
    from headkit.runs.options import option_fields

    for settings in (PruneSettings, CompressSettings, LinearizeSettings):
        assert {"resume", "checkpoint_steps"} <= {field.name for field in option_fields(settings)}
    assert not {"resume", "checkpoint_steps"} & {
        field.name for field in option_fields(LinearizeBenchSettings)
    }


def test_the_newest_whole_checkpoint_is_chosen_and_an_unfinished_one_removed(tmp_path):
    from headkit.recipes.loop import newest_checkpoint, seal_checkpoint

    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "optimizer.pt").write_bytes(bytes([step]) * 64)
    seal_checkpoint(tmp_path / "checkpoint-2")
    seal_checkpoint(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4" / "optimizer.pt").write_bytes(bytes(64))  # changed after its seal
    said = []
    assert newest_checkpoint(tmp_path, said.append) == tmp_path / "checkpoint-2"
    assert said == [
        f"skipping checkpoint {tmp_path / 'checkpoint-6'}: it was not finished; trying the one before",
        f"skipping checkpoint {tmp_path / 'checkpoint-4'}: optimizer.pt does not match its record (damaged); "
        "trying the one before",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_a_run_is_the_same_run_whichever_way_its_paths_are_written(tiny_llama, tmp_path, monkeypatch):
    from headkit.recipes.prune_settings import PruneSettings
    from headkit.recipes.work import run_record

    monkeypatch.chdir(Path(tiny_llama).parent)
    relative = PruneSettings(model=Path(Path(tiny_llama).name), out=Path("result"))
    absolute = PruneSettings(model=Path(tiny_llama), out=tmp_path / "elsewhere", resume=True, overwrite=True)
    assert (
        run_record(relative, relative.model)["fingerprint"]
        == run_record(absolute, absolute.model)["fingerprint"]
    )
    other = PruneSettings(model=Path(tiny_llama), heads=3)
    assert (
        run_record(other, other.model)["fingerprint"] != run_record(absolute, absolute.model)["fingerprint"]
    )


@pytest.mark.parametrize("rank", ["0", "1"])
def test_opening_the_work_folder_creates_no_process_group_before_the_model_loads(
    rank, tiny_llama, tmp_path, monkeypatch
):
    """Under a launcher the work folder opens before the model loads; a process group created then changes how
    transformers loads the weights (with accelerate's FSDP on the CPU, rank 1 got empty ones)."""
    from headkit.recipes.prune_settings import PruneSettings
    from headkit.recipes.work import RunWork
    from headkit.runs import processes

    def no_group_yet():
        raise AssertionError("a process group was asked for before the model loaded")

    monkeypatch.setattr(processes, "_process_state", no_group_yet)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    out = tmp_path / "result"
    stale = tmp_path / ".result.abc123.tmp"
    stale.mkdir()
    settings = PruneSettings(model=Path(tiny_llama), out=out)
    RunWork.open(settings, Path(tiny_llama), out, lambda text: None)
    assert stale.exists() == (rank == "1")  # the main process removed a SIGKILLed save's staging folder


def test_a_snapshot_writes_the_students_tensors_without_a_copy_and_refers_to_the_original(
    tiny_llama, tmp_path
):
    """The snapshot holds no second copy of the student while it is written (a plain pickle held every storage's
    bytes until the dump ended: a whole model more), and the original's objects come back as themselves."""
    import tracemalloc
    from types import SimpleNamespace

    import torch

    from headkit.recipes.prune_settings import PruneSettings
    from headkit.recipes.work import RunWork

    settings = PruneSettings(model=Path(tiny_llama), out=tmp_path / "result")
    work = RunWork.open(settings, Path(tiny_llama), tmp_path / "result", lambda text: None)
    teacher = torch.nn.Linear(4, 4)
    student = torch.nn.ModuleDict(
        {"own": torch.nn.Linear(2048, 2048), "shared": teacher}
    )  # 16 MiB of its own
    steps = SimpleNamespace(teacher=teacher, student=student, report={"ppl": 1.5})
    tracemalloc.start()
    try:
        work.persist("convert", steps, {"seconds": {"convert": 1.0}})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"writing the snapshot held {peak / 2**20:.1f} MiB of Python objects"

    fresh = SimpleNamespace(teacher=teacher, student=None, report=None)
    stage, kept = work.restore(fresh, ("data", "convert"))
    assert (stage, kept) == ("convert", {"seconds": {"convert": 1.0}})
    assert fresh.report == {"ppl": 1.5}
    assert fresh.student["shared"] is teacher  # referred to, not copied
    assert torch.equal(fresh.student["own"].weight, student["own"].weight)
    assert fresh.student["own"].weight.data_ptr() != student["own"].weight.data_ptr()
