"""An experiment is one module and one registration: the config's ``experiments.<name>`` blocks, the
workflow's rules and the entry script's steps all come from the experiment registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import Field

from fedhisto.config.study import ConfigError, load_config
from fedhisto.experiments import layout
from fedhisto.experiments.framework import Experiment, Step, summary_files
from fedhisto.experiments.stage import run_step
from fedhisto.infra.settings_base import Strict
from fedhisto.registries import experiment_registry as registry

REPO = Path(__file__).resolve().parents[1]


class ToyConfig(Strict):
    draws: int = Field(3, ge=1)


def _toy_run(smk, cfg):
    return ("ran", cfg.experiments.toy.draws, smk.rule)


class Toy(Experiment):
    name = "toy"
    settings = ToyConfig

    def steps(self, cfg):
        return [Step("summarize_toy", summary_files("toy"), _toy_run, inputs={"manifest": "results/manifest/manifest.csv"})]


@pytest.fixture
def toy():
    sys.modules[__name__].Toy = Toy  # importable by its "module:Class" path
    registry.register("toy", f"{__name__}:Toy")
    yield
    registry.unregister("toy")


def test_a_registered_experiment_brings_its_settings_block_rules_and_outputs(toy):
    cfg = load_config({"experiments": {"toy": {"draws": 5}}})
    assert cfg.experiments.toy.draws == 5 and load_config({}).experiments.toy.draws == 3
    with pytest.raises(ConfigError, match=r"experiments\.toy\.draws"):
        load_config({"experiments": {"toy": {"draws": 0}}})
    assert "results/experiments/toy/toy.json" in layout.all_outputs()
    assert layout.steps(cfg)[-1].rule == "summarize_toy"
    smk = SimpleNamespace(rule="summarize_toy")
    assert run_step(smk, cfg) == ("ran", 5, "summarize_toy")


def test_an_unregistered_block_is_refused_and_the_registry_names_each_experiment_once():
    names = registry.experiment_names()
    assert names[:4] == ["dose_response", "leakage", "leave_one_site_out", "calibration"]  # the config's block order
    assert all(registry._REGISTRY[n].startswith(f"fedhisto.experiments.{n}:") for n in names)  # one module each
    with pytest.raises(ConfigError, match=r"experiments\.toy"):
        load_config({"experiments": {"toy": {"draws": 5}}})
    with pytest.raises(ValueError, match="registered already"):
        registry.register("leakage", "fedhisto.experiments.leakage:Leakage")
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        registry.experiment("nope")
    rules = [s.rule for s in layout.steps(load_config({}))]
    assert len(rules) == len(set(rules))
    assert all(f"summarize_{n}" in rules or n == "calibration" for n in registry.experiment_names())
    with pytest.raises(SystemExit, match="no registered experiment's step"):
        run_step(SimpleNamespace(rule="summarize_nothing"), load_config({}))


def test_the_retrained_conditions_wildcard_comes_from_the_registry():
    cfg = load_config({"experiments": {"leave_one_site_out": {"left_out": ["C2"]}}})
    assert layout.condition_pattern(cfg) == "leakage/ignore_families|leakage/whole_families|" \
        "leave_one_site_out/C2|dose_response/plain"
    with pytest.raises(ValueError, match="unknown experiment condition 'nothing/here'"):
        layout.condition_inputs(cfg, "nothing/here")


def test_experiment_modules_import_neither_torch_nor_numpy_and_the_config_names_no_experiment():
    # every job validates its config, and so imports every experiment module: they must stay light
    code = ("import sys; from fedhisto.config.study import load_config; from fedhisto.experiments import layout; "
            "cfg = load_config({}); layout.steps(cfg); "
            "print(sorted(m for m in ('torch', 'matplotlib', 'scipy', 'peft', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    config_source = (REPO / "src/fedhisto/config/study.py").read_text()
    named = [n for n in registry.experiment_names() if f"experiments.{n}" in config_source
             or f"{n}:" in config_source or f"{n} =" in config_source]  # no block, field or import of one
    assert named == []
    script = (REPO / "scripts/experiments.py").read_text()
    assert "rule ==" not in script and "elif" not in script
