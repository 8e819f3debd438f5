"""The benchmark registry: every ``headkit bench`` command is generated from a registered settings dataclass."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import typer.main
from typer.testing import CliRunner

from headkit.app import app
from headkit.bench import load_benchmarks
from headkit.bench.registry import BENCHMARKS, option, parse_list, register_benchmark
from headkit.cli import main
from headkit.errors import HeadkitError

load_benchmarks()


@pytest.fixture
def captured(monkeypatch):
    """Every registered benchmark's run replaced by one that records the settings the command built."""
    seen = {}
    for name, benchmark in list(BENCHMARKS.items()):
        monkeypatch.setitem(
            BENCHMARKS,
            name,
            dataclasses.replace(benchmark, run=lambda s, name=name: seen.setdefault(name, s)),
        )
    return seen


def test_headkits_benchmarks_are_registered_each_under_one_convention():
    order = (
        "speed decode digits lora decompose lm extrapolate compress prune linearize retrieval frontier export"
    )
    order = [*order.split(), "memory"]
    assert list(load_benchmarks()) == order  # BUILTIN_BENCHMARKS' order, which `headkit bench --help` keeps
    assert list(typer.main.get_command(app).commands["bench"].commands) == list(load_benchmarks())
    for benchmark in BENCHMARKS.values():
        assert dataclasses.is_dataclass(benchmark.settings) and benchmark.options(), benchmark.name
        assert isinstance(benchmark.settings.quick(), benchmark.settings), benchmark.name
        assert benchmark.help and benchmark.quick_help(), benchmark.name


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_options_left_out_take_the_full_or_the_quick_runs_values(name, captured):
    settings = BENCHMARKS[name].settings
    assert CliRunner().invoke(app, ["bench", name]).exit_code == 0
    assert captured.pop(name) == settings()
    assert CliRunner().invoke(app, ["bench", name, "--quick"]).exit_code == 0
    assert captured.pop(name) == settings.quick()


def test_given_options_override_the_mode_and_lists_are_parsed(captured, tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "digits",
            "--quick",
            "--steps",
            "7",
            "--images",
            "5, 6",
            "--sample",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    from headkit.bench.digits import DigitsConfig

    assert captured["digits"] == DigitsConfig.quick(steps=7, image_counts=(5, 6), sample=True, out=tmp_path)
    # An option given with its default value is still given: --quick does not replace it.
    CliRunner().invoke(app, ["bench", "prune", "--quick", "--gate-steps", "300", "--fractions", "0,0.5"])
    assert captured["prune"].gate_steps == 300 and captured["prune"].encoder_recovery_steps == 10
    assert captured["prune"].fractions == (0.0, 0.5)


def test_positional_argument_and_renamed_flags(captured, tmp_path):
    CliRunner().invoke(app, ["bench", "decompose", str(tmp_path), "--no-tensorly", "--dims", "8"])
    assert captured["decompose"].model == tmp_path and captured["decompose"].include_tensorly is False
    assert captured["decompose"].dims == (8,)


@pytest.mark.parametrize(
    ("arguments", "flag"),
    [
        (["bench", "digits", "--images", "1,x"], "--images"),
        (["bench", "lora", "--ranks", "0"], "--ranks"),
        (["bench", "linearize", "--layers", "-1"], "--layers"),
        (["bench", "prune", "--fractions", "a"], "--fractions"),
    ],
)
def test_bad_list_options_exit_2_naming_the_option(arguments, flag, captured, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    assert not captured


def test_a_benchmark_run_as_the_program_is_its_bench_command(captured, monkeypatch, capsys):
    # `python -m headkit.bench.<module>` (run_as_script): the same options, the same one-line errors and status
    from headkit.bench.registry import run_as_script

    monkeypatch.setattr("sys.argv", ["digits", "--quick", "--steps", "7"])
    run_as_script("digits")
    from headkit.bench.digits import DigitsConfig

    assert captured.pop("digits") == DigitsConfig.quick(steps=7)
    monkeypatch.setattr("sys.argv", ["digits", "--images", "1,x"])
    with pytest.raises(SystemExit) as exit_info:
        run_as_script("digits")
    assert exit_info.value.code == 2 and "--images" in capsys.readouterr().err
    assert not captured


def test_the_help_of_an_option_that_quick_changes_is_written_from_its_values():
    assert option(100, "Steps.", quick=10).metadata["help"] == "Steps (default 100; 10 with --quick)."
    assert option((1, 2), "Sizes", quick=(1,)).metadata["help"] == "Sizes (default 1,2; 1 with --quick)."
    assert option(2e-3, "Rate.", quick=0.5).metadata["help"] == "Rate (default 0.002; 0.5 with --quick)."
    assert (
        option(None, "Bytes (default all; 2 MB with --quick).", quick=2).metadata["help"].endswith("quick).")
    )
    assert option(5, "Repeats.").metadata["help"] == "Repeats."  # the command line adds [default: 5]


def test_parse_list_kinds():
    assert parse_list("--x", " 1, 2 ,") == (1, 2)
    assert parse_list("--x", "0,3", minimum=0) == (0, 3)
    assert parse_list("--x", "0.5,1", float) == (0.5, 1.0)
    assert parse_list("--x", "a, b", str) == ("a", "b")
    for text, kind in (("", int), ("0", int), ("a", float), (" , ", str)):
        with pytest.raises(HeadkitError, match="--x"):
            parse_list("--x", text, kind)


def test_a_benchmark_registered_in_one_place_becomes_a_command(monkeypatch, tmp_path):
    @dataclasses.dataclass
    class WidgetSettings:
        out: object = option(tmp_path, "Output directory.")
        steps: int = option(100, "Training steps.", min=1)
        hidden: int = 5  # a setting without help: not an option

        @classmethod
        def quick(cls, **overrides):
            """Ten steps."""
            return cls(**({"steps": 10} | overrides))

    monkeypatch.setattr("headkit.bench.registry.BENCHMARKS", dict(BENCHMARKS))
    from headkit.bench import registry

    @register_benchmark("widget", WidgetSettings)
    def run_widget(settings, console):
        """Widgets per second.

        Details the command's help leaves out."""
        return {"steps": settings.steps, "threads": torch.get_num_threads()}

    widget = registry.BENCHMARKS["widget"]
    assert [field.name for field in widget.options()] == ["out", "steps"]
    assert widget.help == "Widgets per second." and widget.quick_help() == "Ten steps."
    assert widget.make_settings(True, steps=3).steps == 3
    assert run_widget() == {"steps": 100, "threads": torch.get_num_threads()}  # the full run's settings
    with pytest.raises(ValueError, match="already registered"):
        register_benchmark("widget", WidgetSettings)(lambda settings, console: {})
    with pytest.raises(TypeError, match="dataclass with a quick"):
        register_benchmark("gadget", dict)


def test_the_run_checks_the_settings_first_and_limits_threads_for_the_body(monkeypatch):
    from headkit.bench import registry

    monkeypatch.setattr("headkit.bench.registry.BENCHMARKS", {})

    @dataclasses.dataclass
    class Settings:
        threads: int = option(1, "torch threads.")

        @classmethod
        def quick(cls, **overrides):
            """Quick."""
            return cls(**overrides)

    def check(settings):
        if settings.threads > 8:
            raise HeadkitError("--threads: at most 8")

    @register_benchmark("threads", Settings, check=check)
    def run(settings, console):
        """Threads."""
        return {"threads": torch.get_num_threads()}

    before = torch.get_num_threads()
    assert run(Settings(threads=1)) == {"threads": 1} and torch.get_num_threads() == before
    with pytest.raises(HeadkitError, match="--threads"):
        run(Settings(threads=9))
    assert registry.BENCHMARKS["threads"].run is run


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_an_option_that_quick_changes_says_so_in_its_help(name):
    benchmark = BENCHMARKS[name]
    full, quick = benchmark.settings(), benchmark.settings.quick()
    for field in benchmark.options():
        if getattr(full, field.name) != getattr(quick, field.name):
            assert "quick" in field.metadata["help"], (
                f"bench {name} --{field.name}: help omits the quick value"
            )


def test_check_options_enforces_each_declared_minimum_naming_the_option():
    from headkit.bench.decode import DecodeSettings
    from headkit.bench.registry import check_options

    check_options(DecodeSettings(threads=None, new_tokens=2))  # None: the default "torch's setting"
    for overrides, message in (
        ({"new_tokens": 1}, "--new-tokens must be an integer ≥ 2, got 1"),
        ({"repeats": True}, "--repeats must be a positive integer, got True"),
        ({"threads": 0}, "--threads must be a positive integer, got 0"),
        ({"batch_size": 1.5}, "--batch-size must be a positive integer"),
    ):
        with pytest.raises(HeadkitError, match=message):
            check_options(DecodeSettings(**overrides))


def test_a_new_benchmark_is_one_module_found_without_editing_the_registry(tmp_path, monkeypatch):
    import sys

    import headkit.bench
    from headkit.bench import registry

    (tmp_path / "widget_bench.py").write_text(
        "from dataclasses import dataclass\n"
        "from pathlib import Path\n"
        "from headkit.bench.registry import option, quick_preset, register_benchmark\n"
        "@dataclass\n"
        "class WidgetSettings:\n"
        "    out: Path = option(Path('results/widget'), 'Output directory.')\n"
        "    steps: int = option(100, 'Steps (default 100; 10 with --quick).', min=1, quick=10)\n"
        "    quick = quick_preset('Ten steps.')\n"
        "@register_benchmark('widget', WidgetSettings)\n"
        "def run_widget(settings, console):\n"
        "    '''Counts widgets.'''\n"
        "    return {'steps': settings.steps}\n"
    )
    monkeypatch.setattr(headkit.bench, "__path__", [*headkit.bench.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "BENCHMARKS", dict(registry.BENCHMARKS))
    monkeypatch.delitem(sys.modules, "headkit.bench.widget_bench", raising=False)
    try:
        benchmarks = load_benchmarks()
    finally:
        sys.modules.pop("headkit.bench.widget_bench", None)
    assert list(benchmarks)[-1] == "widget"  # after headkit's own, which keep their order
    assert benchmarks["widget"].help == "Counts widgets."
    assert benchmarks["widget"].settings.quick().steps == 10


def test_check_options_enforces_a_declared_maximum_of_a_number_and_of_a_list():
    from dataclasses import dataclass

    from headkit.bench.registry import check_options, setting

    @dataclass
    class Settings:
        count: int = setting(3, min=1, max=5)
        rate: float = setting(0.5, max=1.0)
        sizes: tuple[int, ...] = setting((1, 2), max=4)

    check_options(Settings())
    for overrides, message in (
        ({"count": 99}, "--count must be at most 5, got 99"),
        ({"rate": 1.5}, "--rate must be at most 1.0, got 1.5"),
        ({"sizes": (1, 9)}, "--sizes"),
    ):
        with pytest.raises(HeadkitError, match=message):
            check_options(Settings(**overrides))
