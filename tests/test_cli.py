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
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--lengths" in lines[0]
