"""What an experiment is: its settings block, its Snakemake steps, and the conditions it retrains.

An experiment is one module under ``fedhisto/experiments/`` holding an :class:`Experiment` subclass
(registered once, :mod:`fedhisto.registries.experiment_registry`). Its module is imported whenever a config is
validated (every job of every stage) and when the Snakefile is parsed, so its top level imports no torch,
no plotting library and not numpy: its analysis imports those inside the functions that use them.

- ``settings``: the strict pydantic class of ``experiments.<name>`` (validated with the config);
- ``steps(cfg)``: the experiment's rules (:class:`Step`), from which ``workflow/rules/experiments.smk``
  generates one Snakemake rule each; the last one writes ``results/experiments/<name>/<name>.{csv,json,png}``;
- ``conditions(cfg)``: retrained conditions ``<name>/<condition>`` that the shared condition rules
  (manifest, stain descriptors, training and prediction through the main stages' scripts) make in
  ``results/experiments/<name>/<condition>/``, with ``condition_inputs`` and, when a condition has its
  own manifest, ``manifest_inputs`` and ``build_manifest``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from fedhisto.infra.settings_base import Strict

if TYPE_CHECKING:
    from fedhisto.config.study import Config

ROOT = "results/experiments"
#: Resources of a summary step: a few seconds of CPU on prediction tables.
LIGHT = {"mem_mb": 2000, "runtime": 10, "gpu": 0}


@dataclass(frozen=True)
class Step:
    """One rule of an experiment. ``output``: name -> path pattern (``{wildcard}`` as Snakemake writes it);
    ``run(smk, cfg)``: what the job does (the generic entry, :mod:`fedhisto.experiments.stage`, calls it);
    ``inputs(wildcards)`` and ``params``: as Snakemake takes them (a param may be a function of the
    wildcards); ``resources``: a dict, a function of the wildcards returning one, or the name of a
    main-stage profile the workflow resolves (``"train"``, ``"predict"``, ``"predict_encoder"``: predict
    on the device of the ``{encoder}`` condition)."""

    rule: str
    output: dict[str, str]
    run: Callable[[Any, Config], Any]
    inputs: Callable[[Any], dict] | dict = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    log: str | None = None
    threads: int = 1
    resources: dict[str, int] | str | Callable[[Any], dict] = field(default_factory=lambda: dict(LIGHT))
    wildcard_constraints: dict[str, str] = field(default_factory=dict)
    directories: tuple[str, ...] = ()  # outputs that are folders

    def log_path(self) -> str:
        return self.log or f"logs/experiments/{self.rule}.log"


def summary_files(name: str) -> dict[str, str]:
    """The CSV, JSON and figure of one experiment."""
    return {kind: f"{ROOT}/{name}/{name}.{kind}" for kind in ("csv", "json", "png")}


def alternatives(values: list[str]) -> str:
    """A wildcard constraint matching exactly ``values`` (never matching when there are none)."""
    import re

    return "|".join(sorted(map(re.escape, dict.fromkeys(values)), key=len, reverse=True)) or "(?!)"


def warm(smk: Any, target: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``target`` (``"module:function"``) in the warm server as a cold job would (``fedhisto.infra.warm_server``)."""
    from fedhisto.entry import log_of
    from fedhisto.infra.warm_server import call

    return call(target, *args, log_path=log_of(smk), **kwargs)


def encoder_dir(smk: Any) -> str | None:
    """The rule's pretrained encoder folder, when it has one as input."""
    return smk.input.encoder[0] if smk.input.get("encoder") else None


def summary_dir(smk: Any) -> Path:
    """The folder of the rule's ``json`` output (a summary's ``results/experiments/<name>/``)."""
    return Path(smk.output.json).parent


class Experiment:
    """Base class of an experiment (see the module's docstring); one instance per registered name."""

    name: ClassVar[str]
    settings: ClassVar[type[Strict]]

    def steps(self, cfg: Config) -> list[Step]:
        raise NotImplementedError

    def conditions(self, cfg: Config) -> list[str]:
        """``<name>/<condition>`` folders the shared condition rules train, each with its own runs."""
        return []

    def condition_inputs(self, cfg: Config, condition: str) -> dict[str, str | list[str]]:
        """Manifest, its identity, descriptors and encoder a retrained condition's runs train and predict on."""
        raise ValueError(f"unknown experiment condition {condition!r}")

    def is_main(self, cfg: Config, condition: str) -> bool:
        """A condition the main pipeline already is (its runs are reused from ``results/``, never retrained)."""
        return False

    def condition_config(self, cfg: Config, condition: str) -> Config:
        """The config a condition's runs train and predict with (``cfg`` unless the experiment changes it)."""
        return cfg

    def manifest_inputs(self, cfg: Config, condition: str) -> dict[str, str] | None:
        """What a condition's own manifest is derived from (None: its runs use another manifest)."""
        return None

    def build_manifest(self, cfg: Config, condition: str, smk: Any) -> None:
        raise ValueError(f"experiment {self.name!r} builds no manifest (condition {condition!r})")

    @classmethod
    def check(cls, experiments: Any) -> None:
        """Checks across blocks, after every block is validated (e.g. a severity that must exist in another
        experiment's design); may resolve defaults in its own block with ``object.__setattr__``."""


