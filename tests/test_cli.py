import ast
import subprocess
import sys

import pytest

from headkit.cli import main


def test_version_prints_versions(capsys):
    main(["version"])
    out = capsys.readouterr().out
    assert out.startswith("headkit ") and "torch" in out and "transformers" in out


def test_unknown_option_is_a_usage_error_with_status_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["version", "--no-such-option"])
    assert exc.value.code == 2
    assert "no-such-option" in capsys.readouterr().err


def test_user_error_is_one_line_and_status_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "headkit", "bench", "speed", "--lengths", "a,b"],
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hang, not a timing: shared cores can make the import slow
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--lengths" in lines[0]


def test_bench_decompose_quick_on_a_tiny_bert_writes_its_table(tmp_path, capsys):
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    BertModel(config).save_pretrained(tmp_path / "bert")
    main(
        [
            "bench",
            "decompose",
            str(tmp_path / "bert"),
            "--dims",
            "8,32",
            "--max-iter",
            "3",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    out = capsys.readouterr().out
    assert "| 8 |" in out and "| 32 |" in out
    assert (tmp_path / "out" / "results.json").is_file() and (
        tmp_path / "out" / "decompose.png"
    ).stat().st_size > 0


def test_bench_decompose_bad_dims_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "decompose", "--dims", "x"])
    assert exc.value.code == 2
    assert "--dims" in capsys.readouterr().err


def test_the_list_of_commands_is_the_apps_and_needs_no_torch():
    # `headkit --help` answers from headkit_entry.COMMANDS without importing headkit (torch, transformers, the
    # recipes: seconds); the table must say what the app says.
    import subprocess
    import sys

    import typer

    from headkit.app import app
    from headkit_entry import COMMANDS, top_level_help

    commands = typer.main.get_command(app).commands
    assert [name for name, _ in COMMANDS] == list(commands)
    for name, text in COMMANDS:
        assert text == " ".join((commands[name].help or "").split("\n\n")[0].split()), name
    probe = "import sys; from headkit_entry import main; main(['--help']); print(sorted(m for m in ('torch', 'transformers', 'headkit') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("[]") and done.stdout.startswith(top_level_help())


# What a refusal of a bad option must not import: transformers' model code, torch's compiler, the training and
# data stacks, the recipes' own modules, headkit's models and layers, the benchmarks.
HEAVY = (
    "transformers.modeling_utils",
    "transformers.trainer",
    "torch._dynamo",
    "datasets",
    "pandas",
    "peft",
    "headkit.models",
    "headkit.layers",
    "headkit.recipes.prune",
    "headkit.recipes.compress",
    "headkit.recipes.linearize",
    "headkit.recipes.distill",
    "headkit.surgery.pruning",
    "headkit.surgery.latent",
    "headkit.surgery.linearize",
    "headkit.bench.lm",
)
# The console script's path in a fresh interpreter: the refusal's exit status, its stderr, and which of HEAVY were
# imported by the time it exited.
REFUSAL_PROBE = """
import sys
from headkit_entry import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
else:
    code = 0
print(code, sorted(name for name in {heavy!r} if name in sys.modules))
"""


# What a bare transformers config costs on the installed release: its own imports are not headkit's to avoid
# (transformers 5.22's configuration imports torch._dynamo through its activations; 5.24's does not).
FLOOR_PROBE = """
import sys
import gguf, torch, transformers
transformers.LlamaConfig
print(sorted(name for name in {heavy!r} if name in sys.modules))
"""


def _floor() -> set[str]:
    """The HEAVY modules that torch, gguf and a transformers config class import by themselves."""
    done = subprocess.run(
        [sys.executable, "-c", FLOOR_PROBE.format(heavy=HEAVY)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return set(ast.literal_eval(done.stdout.strip()))


def _refusal(args: list[str]) -> tuple[str, list[str]]:
    """Run the ``headkit`` console script's entry point with `args` in a fresh interpreter: (stdout, the error
    lines of stderr)."""
    probe = REFUSAL_PROBE.format(heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    return done.stdout.strip(), errors


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["prune", "--heads", "100000"],
            "error: --heads must be in [1, 270] (the model has 270 query heads), got 100000",
        ),
        (
            ["compress", "--kv-rank", "100000"],
            "error: kv_rank must be an integer in [1, 336] (the full width min(hidden 576, kv_heads 3 × (2·head_dim "
            "128 − rope_dims 16))), got 100000",
        ),
        (
            ["linearize", "--window", "1000000"],
            "error: window must be at most the model's context of 8192 tokens, got 1000000",
        ),
    ],
)
def test_a_bad_option_on_the_smollm2_gguf_is_refused_without_model_code(args, message, tmp_path):
    # The refusal reads the GGUF header and the settings only: none of HEAVY imported (seconds of imports that
    # would make a one-line refusal take ten).
    from headkit.errors import HeadkitError
    from headkit.runs.models import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except HeadkitError as exc:
        pytest.skip(str(exc))
    command, *options = args
    stdout, errors = _refusal([command, str(path), *options, "--out", str(tmp_path / "o")])
    assert errors == [message]
    code, imported = stdout.split(" ", 1)
    assert code == "2"
    assert set(ast.literal_eval(imported)) <= _floor()
    assert not (tmp_path / "o").exists()


def test_import_headkit_still_registers_its_models_and_the_console_script_reads_their_configs(tmp_path):
    # `import headkit` registers model_type "headkit" with the Auto classes at once; under the console script,
    # which defers it, reading a checkpoint's config registers them first (headkit.runs.models).
    import headkit

    config = headkit.HeadkitConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    config.save_pretrained(tmp_path)
    eager = "import headkit, transformers; print(transformers.AutoConfig.for_model('headkit').model_type)"
    done = subprocess.run([sys.executable, "-c", eager], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "headkit", done.stderr
    deferred = (
        "import sys, headkit_entry; headkit_entry.defer_models = True; import headkit;"
        "before = 'headkit.models' in sys.modules;"
        "from headkit.runs.models import read_model_config;"
        f"print(before, type(read_model_config({str(tmp_path)!r})).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", deferred], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False HeadkitConfig", done.stderr
