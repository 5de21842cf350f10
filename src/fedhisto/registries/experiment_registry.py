"""The experiment registry: one line per experiment, below, naming its class as ``"module:Class"``.

The config's ``experiments:`` block is built from it (:func:`experiments_model`: the shared settings
plus one ``experiments.<name>`` block per registration, typed by the experiment's ``settings`` class),
and ``workflow/rules/experiments.smk`` generates the experiments' rules from it. An experiment's
module is imported when a config is first validated, never when this module is: experiment modules
import the config, and they import no torch (:mod:`fedhisto.experiments.framework`).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from pydantic import Field, create_model, model_validator

from fedhisto.infra.settings_base import Strict
from fedhisto.registries.method_registry import Method

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_REGISTRY: dict[str, str] = {}
_LOADED: dict[str, Any] = {}
_MODELS: dict[tuple, type] = {}


class ExperimentsBase(Strict):
    """The ``experiments:`` block's shared settings; each registered experiment adds its own block."""

    methods: list[Method] = Field(
        default_factory=lambda: ["fedavg_peft", "fedprox_peft", "past_v1", "past_v2", "fedstain"], min_length=1,
        description="principal methods compared in every experiment (v2 and FedAvg-PEFT are required)")
    seeds: list[int] = Field(default_factory=lambda: [11, 22, 33], min_length=1,
                             description="seeds of the retrained conditions (dose-response plain encoder, leakage)")
    resamples: int = Field(1000, ge=100, description="bootstrap resamples of every experiment interval")
    bootstrap_seed: int = 20261201

    @model_validator(mode="after")
    def _principal(self) -> ExperimentsBase:
        missing = {"fedavg_peft", "past_v2"} - set(self.methods)
        if missing:
            raise ValueError(f"experiments.methods must include {sorted(missing)}: every experiment reports "
                             "the v2-vs-FedAvg-PEFT difference")
        for name in experiment_names():
            type(experiment(name)).check(self)
        return self


def register(name: str, target: str, *, replace: bool = False) -> None:
    """Add an experiment: ``target`` is ``"package.module:Class"``, an :class:`~fedhisto.experiments.framework.Experiment`
    subclass whose ``name`` is ``name``; its settings become ``experiments.<name>`` and its results
    ``results/experiments/<name>/``."""
    if not _NAME.match(name):
        raise ValueError(f"experiment name {name!r} must be lower-case letters, digits and underscores")
    if name in _REGISTRY and not replace:
        raise ValueError(f"experiment {name!r} is registered already ({_REGISTRY[name]}); pass replace=True")
    _REGISTRY[name] = target
    _LOADED.pop(name, None)


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    _LOADED.pop(name, None)


def experiment_names() -> list[str]:
    return list(_REGISTRY)


def experiment(name: str) -> Any:
    """The registered experiment's instance (its module imported on first use)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown experiment {name!r}; registered: {', '.join(_REGISTRY)}")
    if name not in _LOADED:
        module, _, attr = _REGISTRY[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if getattr(cls, "name", None) != name:
            raise ValueError(f"experiment {name!r}: {_REGISTRY[name]} declares name {getattr(cls, 'name', None)!r}")
        _LOADED[name] = cls()
    return _LOADED[name]


def experiments_model() -> type:
    """``ExperimentsConfig``: the shared settings and one block per registered experiment, in registration order."""
    key = tuple(_REGISTRY.items())
    if key not in _MODELS:
        blocks = {name: (experiment(name).settings, experiment(name).settings()) for name in _REGISTRY}
        _MODELS[key] = create_model("ExperimentsConfig", __base__=ExperimentsBase, **blocks)
    return _MODELS[key]


def experiments_settings(value: Any) -> Any:
    """The ``experiments:`` block validated (an instance already validated is kept as it is)."""
    model = experiments_model()
    return value if isinstance(value, model) else model.model_validate({} if value is None else value)


def owner(condition: str) -> Any:
    """The experiment a ``<name>/<condition>`` folder belongs to."""
    return experiment(condition.split("/", 1)[0])


# ------------------------------------------------------------------ built-in experiments
register("dose_response", "fedhisto.experiments.dose_response:DoseResponse")
register("leakage", "fedhisto.experiments.leakage:Leakage")
register("leave_one_site_out", "fedhisto.experiments.leave_one_site_out:LeaveOneSiteOut")
register("calibration", "fedhisto.experiments.calibration:Calibration")
register("probe", "fedhisto.experiments.probe:Probe")
register("sensitivity", "fedhisto.experiments.sensitivity:Sensitivity")
register("privacy_audit", "fedhisto.experiments.privacy_audit:PrivacyAudit")
register("lora_aggregation", "fedhisto.experiments.lora_aggregation:LoraAggregation")
