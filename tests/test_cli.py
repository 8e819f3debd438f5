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
