"""Where the sensitivity ("multiverse") experiment's runs live and what each needs (torch-free: the
Snakefile calls it at parse time).

A *reading* is a named set of config values (``experiments.sensitivity.readings``); ``baseline`` is
the pipeline's own readings. Every reading is retrained one at a time against that one baseline, for
each encoder condition: ``stain_invariant`` (the embedded default; its baseline is the main runs,
scored on the external cohort) and ``plain`` (the dose-response plain-encoder condition; its
baseline is that experiment's runs, scored on the shifted cohort at ``severity``). A method a
reading cannot change is not retrained: its baseline predictions stand for it (``affects``).
"""

from __future__ import annotations

from typing import Any

from fedhisto.config.study import Config
from fedhisto.experiments.dose_response import PLAIN_ENCODER, dose_methods
from fedhisto.experiments.framework import ROOT
from fedhisto.registries.method_registry import registration

BASELINE = "baseline"
HERE = f"{ROOT}/sensitivity"
SHIFTED_COHORT = f"{ROOT}/dose_response/cohort/cohort.csv"

#: Reading keys that act only on methods with a given registered option (the PAST family's
#: switches), read from the registry without importing a method. Any other key acts on every method.
_ONLY_WHERE = {
    "train.readings.ce_views": ("paired_views", True),      # CE over two views: single-view and FedStain's own CE unaffected
    "train.readings.adaptive_on": ("aggregation", "adaptive"),  # sample-mass weights do not look at updates
    "model.film_bound": ("film", True),                      # no FiLM, nothing to bound
}


def reading_names(cfg: Config) -> list[str]:
    return [BASELINE, *cfg.experiments.sensitivity.readings]


def reading_pattern(cfg: Config) -> str:
    """Wildcard constraint of ``{reading}``."""
    return "|".join(sorted(reading_names(cfg), key=len, reverse=True))


def _set(model: Any, path: list[str], value: Any, where: str) -> Any:
    head = path[0]
    if head not in type(model).model_fields:
        raise ValueError(f"experiments.sensitivity.readings: {where!r} names no config key ({head!r} is not one "
                         f"of {sorted(type(model).model_fields)})")
    if len(path) == 1:
        return type(model).model_validate({**model.model_dump(), head: value})
    return model.model_copy(update={head: _set(getattr(model, head), path[1:], value, where)})


def reading_config(cfg: Config, reading: str) -> Config:
    """``cfg`` with the reading's values (each validated by its block's model); ``baseline``: ``cfg``."""
    if reading == BASELINE:
        return cfg
    values = cfg.experiments.sensitivity.readings.get(reading)
    if values is None:
        raise ValueError(f"unknown sensitivity reading {reading!r}; configured: {', '.join(reading_names(cfg))}")
    out = cfg
    for key, value in values.items():
        if key == "views.normalisation" and value == "encoder":  # as Config does: the entry's statistics
            from fedhisto.registries.encoder_registry import encoder_entry

            entry = encoder_entry(out.model.encoder.name)
            out = _set(out, ["views"], {**out.views.model_dump(), "normalisation": "encoder", "mean": entry.mean,
                                        "std": entry.std}, key)
            continue
        out = _set(out, key.split("."), value, key)
    return out


def affects(cfg: Config, reading: str, method: str) -> bool:
    """Whether a reading can change a method's training (else its baseline run stands for it)."""
    if reading == BASELINE:
        return True
    reg = registration(method)
    options = reg.options
    for key in cfg.experiments.sensitivity.readings[reading]:
        family = key.split(".")[1] if key.startswith("train.") and key.count(".") == 2 else None
        if family is not None and family != "readings":  # a method family's own block: that family only
            if reg.config_key == family:
                return True
            continue
        only = _ONLY_WHERE.get(key)
        if only is None or options.get(only[0]) == only[1]:
            return True
    return False


def _own(encoder: str, reading: str, kind: str, method: str, seed: int) -> str:
    return f"{HERE}/{encoder}/{reading}/{kind}/{method}/seed{seed}"


def prediction_file(cfg: Config, encoder: str, reading: str, method: str, seed: int) -> str:
    """The predictions one (encoder, reading, method, seed) is scored on: its own run's, or the baseline's
    when the reading cannot change the method; the baseline reuses the main / dose-response runs."""
    if reading != BASELINE and not affects(cfg, reading, method):
        reading = BASELINE
    if encoder == "stain_invariant":
        if reading == BASELINE and (method, seed) in cfg.train_runs():
            return f"results/predictions/{method}/seed{seed}/external.csv"
        return f"{_own(encoder, reading, 'predictions', method, seed)}/external.csv"
    x = cfg.experiments
    if reading == BASELINE and method in dose_methods(cfg) and seed in x.seeds and "plain" in x.dose_response.labels():
        return f"{ROOT}/dose_response/plain/predictions/{method}/seed{seed}.csv"
    return f"{_own(encoder, reading, 'predictions', method, seed)}/shifted.csv"


def sensitivity_runs(cfg: Config) -> list[tuple[str, str, str, int, str]]:
    """(encoder, reading, method, seed, predictions) of every cell the summary scores."""
    s = cfg.experiments.sensitivity
    return [(e, r, m, seed, prediction_file(cfg, e, r, m, seed)) for e in s.encoders for r in reading_names(cfg)
            for m in s.methods() for seed in s.seeds]


def retrained(cfg: Config, encoder: str, reading: str, method: str) -> bool:
    """Whether the cell has its own run in ``results/experiments/sensitivity/`` (not a reused one)."""
    return prediction_file(cfg, encoder, reading, method, cfg.experiments.sensitivity.seeds[0]).startswith(HERE)


def train_inputs(cfg: Config, encoder: str) -> dict[str, str | list[str]]:
    """Manifest, identity, descriptors and frozen encoder of a reading's runs (the main manifest)."""
    main_encoder = ["results/pretrain/encoder"] if cfg.model.pretrain.enabled else []
    return {"manifest": "results/manifest/manifest.csv", "identity": "results/manifest/manifest.json",
            "descriptors": "results/stain/descriptors.json",
            "encoder": [PLAIN_ENCODER] if encoder == "plain" else main_encoder}


def summary_inputs(cfg: Config) -> dict[str, Any]:
    files = sorted({r[4] for r in sensitivity_runs(cfg)})
    cohort = [SHIFTED_COHORT] if "plain" in cfg.experiments.sensitivity.encoders else []
    return {"predictions": files, "cohort": cohort}


def shifted_block(cfg: Config, reading: str, method: str, seed: int) -> dict:
    """The predict block of a plain-encoder reading run on the shifted cohort (never temperature-scaled)."""
    from fedhisto.config.stage_blocks import stage_block

    block = stage_block(reading_config(cfg, reading), "predict", method=method, seed=seed)
    block.pop("temperature_scaling", None)
    return {**block, "severity_cohort": "dose_response"}


