"""The one recipe skeleton: the config checks before anything loads, the stages in order, each timed, the global
RNG seeded once before loading, and the repair stage a no-op reported as such where a surgery has none."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.recipes.steps import STAGES, Recipe, Steps, run_recipe
from headkit.runs.models import LoadedModel


@dataclass
class Settings:
    seed: int = 3
    dtype: str = "float32"
    overwrite: bool = False
    eval_tasks: tuple[str, ...] = ()
    refuse: bool = False
    calls: list[str] = field(default_factory=list)


class RecordingSteps(Steps):
    def check(self) -> None:
        self.settings.calls.append("check")

    def data(self) -> None:
        self.settings.calls.append("data")
        self.report["draw"] = torch.rand(1).item()  # what the seed set before loading gives

    def convert(self) -> None:
        self.settings.calls.append("convert")
        self.student = nn.Linear(2, 2)

    def recover(self) -> None:
        self.settings.calls.append("recover")

    def measure(self) -> None:
        self.settings.calls.append("measure")
        self.report["figure"] = 1.0


def _preflight(settings, model_path, config, out) -> None:
    settings.calls.append("preflight")
    if settings.refuse:
        raise HeadkitError("--refuse must be false")


RECIPE = Recipe(preflight=_preflight, steps=RecordingSteps)
LOADED = LoadedModel(nn.Linear(2, 2), tokenizer=None, kind="causal_lm", source=Path("nowhere"))


def test_the_stages_run_in_order_each_timed_and_repair_is_reported_as_a_no_op():
    settings = Settings()
    steps, report = run_recipe(RECIPE, settings, Path("nowhere"), lambda line: None, loaded=LOADED)
    assert settings.calls == ["preflight", "check", "data", "convert", "recover", "measure"]
    assert list(report["stage_seconds"]) == list(STAGES)
    assert all(seconds >= 0 for seconds in report["stage_seconds"].values())
    assert report["repair"] is None and report["figure"] == 1.0 and report["seconds"] >= 0
    assert report["settings"]["seed"] == 3 and report["model"] == "nowhere"
    torch.manual_seed(3)
    assert report["draw"] == torch.rand(1).item()
    assert isinstance(steps.student, nn.Linear)


def test_a_refused_setting_stops_before_loading(monkeypatch):
    import headkit.recipes.steps as skeleton

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded before the refusal")

    monkeypatch.setattr(skeleton, "load_model", no_loading)
    settings = Settings(refuse=True)
    with pytest.raises(HeadkitError, match="--refuse must be false"):
        run_recipe(RECIPE, settings, Path("nowhere"), lambda line: None)
    assert settings.calls == ["preflight"]


def test_a_repair_step_reports_what_it_did():
    class Repairing(RecordingSteps):
        def repair(self):
            return {"layers": 2}

    _, report = run_recipe(
        Recipe(preflight=_preflight, steps=Repairing),
        Settings(),
        Path("nowhere"),
        lambda line: None,
        loaded=LOADED,
    )
    assert report["repair"] == {"layers": 2}


def test_each_stage_states_its_peak_resident_memory():
    class Allocating(RecordingSteps):
        def convert(self):
            super().convert()
            block = torch.ones(64 * 1024**2)  # 256 MiB, touched
            del block

    _, report = run_recipe(
        Recipe(preflight=_preflight, steps=Allocating),
        Settings(),
        Path("nowhere"),
        lambda line: None,
        loaded=LOADED,
    )
    peak = report["peak_memory"]
    assert list(peak["stages"]) == list(STAGES)
    assert peak["stage"] == "convert" and peak["resident_bytes"] == max(peak["stages"].values())
    assert peak["stages"]["convert"] > peak["stages"]["measure"] + 200 * 1024**2
