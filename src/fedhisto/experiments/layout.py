"""Where the experiments' conditions, runs and outputs live, across every registered experiment.

A *condition* is a folder ``results/experiments/<experiment>/<name>/`` holding its own manifest,
training runs and predictions, made by the shared condition rules (the main pipeline's stage
scripts). Whatever the main pipeline already made is reused: the experiment says which of its
conditions are the main runs (``Experiment.is_main``). Torch-free: the Snakefile calls it at parse time.
"""

from __future__ import annotations

from fedhisto.config.study import Config
from fedhisto.experiments.framework import ROOT, Step, alternatives, summary_files

__all__ = ["ROOT", "all_outputs", "condition_pattern", "run_dir", "steps", "summary_files"]


def _experiment(condition: str):
    from fedhisto.registries.experiment_registry import experiment, experiment_names

    name = condition.split("/", 1)[0]
    if name not in experiment_names():
        raise ValueError(f"unknown experiment condition {condition!r}")
    return experiment(name)


def main_inputs(cfg: Config) -> dict[str, str | list[str]]:
    """The main pipeline's manifest, its identity, stain descriptors and pretrained encoder (if any)."""
    return {"manifest": "results/manifest/manifest.csv", "identity": "results/manifest/manifest.json",
            "descriptors": "results/stain/descriptors.json",
            "encoder": ["results/pretrain/encoder"] if cfg.model.pretrain.enabled else []}


def pretrain_inputs(cfg: Config) -> dict[str, str]:
    """The manifest, only when the tiny encoder is pretrained on the clients' optimisation images."""
    return {"manifest": "results/manifest/manifest.csv"} if cfg.model.pretrain.objective == "self_supervised" else {}


def is_main(cfg: Config, condition: str) -> bool:
    """A condition the main pipeline already is (reused, never retrained)."""
    return _experiment(condition).is_main(cfg, condition)


def run_dir(cfg: Config, condition: str, kind: str, method: str, seed: int) -> str:
    """``kind`` train or predictions: the folder of one run of a condition (main folders when reused)."""
    base = "results" if is_main(cfg, condition) else f"{ROOT}/{condition}"
    return f"{base}/{kind}/{method}/seed{seed}"


def condition_inputs(cfg: Config, condition: str) -> dict[str, str | list[str]]:
    """Manifest, its identity, descriptors and encoder a condition's runs train and predict on."""
    return _experiment(condition).condition_inputs(cfg, condition)


def condition_config(cfg: Config, condition: str) -> Config:
    """The config a condition's runs train and predict with."""
    return _experiment(condition).condition_config(cfg, condition)


def condition_manifest_inputs(cfg: Config, condition: str) -> dict[str, str]:
    """What a retrained condition's own manifest is derived from."""
    inputs = _experiment(condition).manifest_inputs(cfg, condition)
    if inputs is None:
        raise ValueError(f"experiment condition {condition!r} has no manifest of its own")
    return inputs


def retrained_conditions(cfg: Config) -> list[str]:
    from fedhisto.registries.experiment_registry import experiment, experiment_names

    return [c for name in experiment_names() for c in experiment(name).conditions(cfg)]


def condition_pattern(cfg: Config) -> str:
    """Wildcard constraint of ``{condition}``: the retrained conditions of every registered experiment."""
    return alternatives(retrained_conditions(cfg))


def experiment_block(cfg: Config, name: str) -> dict:
    """What an experiment's summary depends on beyond its input files."""
    x = cfg.experiments
    return {"experiment": name, "methods": x.methods, "seeds": x.seeds, "resamples": x.resamples,
            "bootstrap_seed": x.bootstrap_seed, "bins": x.calibration.bins,  # ECE bins of every experiment
            name: getattr(x, name).model_dump(mode="json")}


def all_outputs() -> list[str]:
    from fedhisto.registries.experiment_registry import experiment_names

    return [f for name in experiment_names() for f in summary_files(name).values()]


def steps(cfg: Config) -> list[Step]:
    """Every registered experiment's steps, in registration order (one Snakemake rule each)."""
    from fedhisto.registries.experiment_registry import experiment, experiment_names

    out = [s for name in experiment_names() for s in experiment(name).steps(cfg)]
    seen = [s.rule for s in out]
    twice = sorted({r for r in seen if seen.count(r) > 1})
    if twice:
        raise ValueError(f"experiment rules named twice: {twice}")
    return out
