"""headkit.runs.options: a recipe's or a surgery's option is declared once, on its settings field, and the
commands (`headkit linearize`, `prune`, `compress`, `headkit bench …`) are generated from the fields."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from headkit.app import app
from headkit.bench import load_benchmarks
from headkit.bench.registry import BENCHMARKS
from headkit.cli import main
from headkit.errors import HeadkitError
from headkit.recipes.compress import CompressSettings
from headkit.recipes.linearize import LinearizeSettings
from headkit.recipes.prune import PruneSettings
from headkit.recipes.settings import QuickSettings
from headkit.runs.options import (
    option,
    option_fields,
    option_name,
    settings_command,
    settings_from,
    with_fields_of,
)
from headkit.surgery.linearize import LinearizeConfig

load_benchmarks()


def _command(*path: str):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _flags(command) -> set[str]:
    return {name for parameter in command.params for name in (*parameter.opts, *parameter.secondary_opts)}


def _help(command, flag: str) -> str:
    return next(parameter.help for parameter in command.params if flag in parameter.opts)


# -- a throwaway surgery and recipe: the claim itself -----------------------------------------------------------


@dataclass(frozen=True)
class WidgetConfig:
    """A surgery's config beneath the recipes: plain field metadata (no import of headkit.recipes)."""

    width: int = field(default=4, metadata={"help": "Widget width."})
    rows: tuple[int, ...] | None = field(
        default=None, metadata={"help": "Comma-separated rows (default: all)."}
    )

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be a positive integer, got {self.width}")


def _widget_app(config: type) -> tuple[typer.Typer, list]:
    """`widget` over settings made of ``config``'s fields, as headkit linearize is over LinearizeConfig's."""

    @dataclass
    @with_fields_of(config)
    class WidgetSettings(QuickSettings):
        steps: int = option(10, "Steps.", flag="--recovery-steps", removed=("--widget-steps",), quick=2)
        rank: int | None = option(8, "Rank, 0 none.", convert=lambda rank: rank or None)

    seen = []
    widget_app = typer.Typer()

    @widget_app.command()
    @settings_command(WidgetSettings)
    def widget(quick: bool = typer.Option(False), **options) -> None:
        seen.append(settings_from(WidgetSettings, quick, options))

    @widget_app.command()
    def other() -> None:  # a second command: typer then takes the first by its name
        pass

    return widget_app, seen


def test_a_field_added_to_a_config_is_an_option_with_no_other_edit(capsys):
    # The same config with one more field, declared with its help and nothing else.
    grown = dataclasses.make_dataclass(
        "GrownConfig",
        [("depth", int, field(default=3, metadata={"help": "Widget depth."}))],
        bases=(WidgetConfig,),
        frozen=True,
    )
    before, _ = _widget_app(WidgetConfig)
    after, seen = _widget_app(grown)
    assert "--depth" not in _flags(typer.main.get_command(before).commands["widget"])
    command = typer.main.get_command(after).commands["widget"]
    assert {"--depth", "--width", "--rows", "--recovery-steps", "--rank", "--quick"} <= _flags(command)
    assert _help(command, "--depth") == "Widget depth."
    # Passed through: given values, lists parsed, converted (0 → None); left out, the mode's defaults.
    result = CliRunner().invoke(after, ["widget", "--depth", "7", "--rows", "1, 2", "--rank", "0", "--quick"])
    assert result.exit_code == 0, result.output
    settings = seen.pop()
    assert (settings.depth, settings.rows, settings.rank, settings.width, settings.steps) == (
        7,
        (1, 2),
        None,
        4,
        2,
    )
    assert CliRunner().invoke(after, ["widget"]).exit_code == 0
    assert (seen[-1].depth, seen[-1].steps, seen[-1].rank) == (3, 10, 8)


def test_an_old_name_is_hidden_and_refused_in_one_line_naming_the_new_one():
    widget_app, seen = _widget_app(WidgetConfig)
    command = typer.main.get_command(widget_app).commands["widget"]
    hidden = [parameter for parameter in command.params if "--widget-steps" in parameter.opts]
    assert len(hidden) == 1 and hidden[0].hidden
    with pytest.raises(HeadkitError, match="^--widget-steps was removed: use --recovery-steps$"):
        widget_app(["widget", "--widget-steps", "5"], standalone_mode=False)
    assert not seen


def test_the_quick_default_is_stated_in_the_help():
    widget_app, _ = _widget_app(WidgetConfig)
    command = typer.main.get_command(widget_app).commands["widget"]
    assert _help(command, "--recovery-steps") == "Steps (default 10; 2 with --quick)."


def test_an_options_name_clashing_with_the_commands_own_is_refused():
    @dataclass
    class Settings:
        out: Path = option(Path("x"), "Output.")

    with pytest.raises(TypeError, match="out"):

        @settings_command(Settings)
        def command(out: Path = typer.Option(Path("y")), **options) -> None:
            pass


# -- headkit's commands --------------------------------------------------------------------------------------------


def test_every_linearize_config_field_is_an_option_of_linearize_and_bench_linearize():
    # A field of the surgery's config without help would be a setting no command can reach: this fails then.
    for path in (("linearize",), ("bench", "linearize")):
        command = _command(*path)
        for config_field in dataclasses.fields(LinearizeConfig):
            assert "help" in config_field.metadata, f"LinearizeConfig.{config_field.name} declares no help"
            flag = option_name(config_field)
            assert flag in _flags(command), f"headkit {' '.join(path)} lacks {flag}"
            assert _help(command, flag).startswith(config_field.metadata["help"].removesuffix("."))
        assert {f.name for f in dataclasses.fields(LinearizeConfig)} <= {
            f.name for f in option_fields(LinearizeSettings)
        }


@pytest.mark.parametrize(
    ("path", "settings"),
    [(("linearize",), LinearizeSettings), (("prune",), PruneSettings), (("compress",), CompressSettings)],
)
def test_every_option_field_of_a_recipe_is_an_option_of_its_command(path, settings):
    command = _command(*path)
    for settings_field in option_fields(settings):
        assert option_name(settings_field) in _flags(command), settings_field.name
        for old in settings_field.metadata.get("removed") or ():
            assert old in _flags(command)


@pytest.fixture
def recipes(monkeypatch):
    """The recipes behind headkit linearize, prune and compress, replaced by ones that record their settings."""
    seen = {}
    for name in ("linearize", "prune", "compress"):
        # headkit.recipes' functions of the same names shadow the modules as its attributes
        module = importlib.import_module(f"headkit.recipes.{name}")
        monkeypatch.setattr(
            module, name, lambda settings, echo, name=name: _Recorded(seen.setdefault(name, settings))
        )
    return seen


class _Recorded:
    """What a recording recipe returns: a result with an empty report (the command prints it and its last line)."""

    def __init__(self, settings) -> None:
        self.settings, self.report = settings, {}

    def __str__(self) -> str:
        return f"recorded {type(self.settings).__name__}"


def test_left_out_options_are_the_recipes_defaults(recipes):
    for name in ("linearize", "prune", "compress"):
        main([name])
    assert recipes["linearize"] == LinearizeSettings()
    assert recipes["prune"] == PruneSettings()
    assert recipes["compress"] == CompressSettings()
    recipes.clear()
    for name in ("linearize", "prune"):
        main([name, "--quick"])
    assert recipes["linearize"] == LinearizeSettings.quick()
    assert recipes["prune"] == PruneSettings.quick()


def test_linearize_passes_config_and_recipe_options_through(recipes, capsys):
    main(["linearize", "--quick", "--window", "9", "--layers", "0,3", "--convert-sliding", "--lora-rank", "0",
          "--feature-dim", "8", "--decode-contexts", "64,128", "--recovery-steps", "4"])  # fmt: skip
    settings = recipes["linearize"]
    # feature_wavelength: the recipe's default is its training length (256 under --quick)
    assert settings.conversion == LinearizeConfig(
        window=9, layers=(0, 3), convert_sliding=True, feature_dim=8, feature_wavelength=256
    )
    assert (settings.lora_rank, settings.recovery_steps, settings.decode_contexts) == (None, 4, (64, 128))
    assert settings.transfer_steps == LinearizeSettings.quick().transfer_steps


def test_prune_and_compress_keep_their_flag_names(recipes, capsys):
    main(
        ["prune", "--steps", "7", "--held-out", "3", "--gradient-accumulation", "2", "--recovery-steps", "5"]
    )
    settings = recipes["prune"]
    assert (settings.gate_steps, settings.held_out_texts, settings.gradient_accumulation_steps) == (7, 3, 2)
    assert settings.recovery_steps == 5
    main(["compress", "--recovery-steps", "4", "--held-out", "9", "--kv-rank", "6"])
    settings = recipes["compress"]
    assert (settings.recovery_steps, settings.held_out_texts, settings.kv_rank) == (4, 9, 6)
    for command, old in [
        ("prune", "--finetune-steps"),
        ("compress", "--distill-steps"),
        ("linearize", "--lora-steps"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main([command, old, "5"])
        assert exit.value.code == 2
        assert capsys.readouterr().err.strip() == f"error: {old} was removed: use --recovery-steps"


def test_bench_linearize_passes_every_recipe_option_through(monkeypatch):
    seen = {}
    benchmark = BENCHMARKS["linearize"]
    monkeypatch.setitem(
        BENCHMARKS, "linearize", dataclasses.replace(benchmark, run=lambda s: seen.setdefault("settings", s))
    )
    main(["bench", "linearize", "--quick", "--chunk-size", "16", "--lora-rank", "0", "--sinks", "2"])
    recipe = seen["settings"].recipe_settings()
    assert (recipe.chunk_size, recipe.lora_rank, recipe.sinks) == (16, None, 2)
    assert recipe == LinearizeSettings.quick(chunk_size=16, lora_rank=None, sinks=2, seed=0)
