"""Experiment 6, sensitivity ("multiverse"): which headline conclusions survive the study's unstated choices.

Per encoder condition and reading (``experiments.sensitivity``), each conclusion's paired bootstrap
difference of ensemble macro-F1 (method - reference, the bootstrap stage's test on the same images),
beside the baseline's. A conclusion *survives* a reading when its sign is the baseline's and its
interval excludes 0 exactly when the baseline's does; the verdict table says, per conclusion and
encoder, whether it survives every reading and which readings break it.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.experiments import sensitivity_layout as SX
from fedhisto.experiments.framework import Experiment, Step, encoder_dir, summary_dir, summary_files, warm
from fedhisto.experiments.layout import experiment_block
from fedhisto.experiments.sensitivity_layout import BASELINE, reading_names, retrained
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block
from fedhisto.infra.settings_base import Strict
from fedhisto.registries.method_registry import Method

NAME = "sensitivity"

#: The readings the sensitivity experiment retrains under by default, one open choice each;
#: each maps dotted config keys to the reading's values (the pipeline's own reading is the baseline).
DEFAULT_READINGS: dict[str, dict[str, Any]] = {
    "ce_class_mean": {"train.readings.ce_weight_normalisation": "class_mean"},
    "ce_weighted_mean": {"train.readings.ce_reduction": "weighted_mean"},
    "ce_views_sum": {"train.readings.ce_views": "sum"},
    "adaptive_delta_w": {"train.readings.adaptive_on": "delta_w"},
    "film_tanh": {"model.film_bound": "tanh"},
    # HIBOU-B's own input statistics in place of ImageNet's (the tiny encoder was pretrained under ImageNet's)
    "hibou_statistics": {"views.mean": [0.7068, 0.5755, 0.722], "views.std": [0.195, 0.2316, 0.1816]},
    # FedStain's MixStyle on the tokens after the tiny encoder's last block (2 of 0-2) instead of block 0
    "mixstyle_last_block": {"train.fedstain.mixstyle_after_layer": 2},
    # each client's AdamW moments and step count kept from one round's local training to the next
    "adamw_kept": {"train.readings.optimizer_state": "kept"},
}
READING_ROOTS = ("train.readings.", "model.film_bound", "views.normalisation", "views.mean", "views.std",
                 "train.fedstain.", "train.fedstain_code.")


class SensitivityConfig(Strict):
    """Which headline conclusions survive every reading of the study's unstated choices: each reading
    retrained one at a time against one shared baseline (the pipeline's own readings), on the
    embedded default (external cohort) and on the dose-response plain-encoder cohort at ``severity``."""

    conclusions: list[tuple[Method, Method]] = Field(
        default_factory=lambda: [("past_v2", "fedavg_peft"), ("past_v2", "v2_no_js"), ("past_v2", "fedstain")],
        min_length=1, description="(method, reference) paired macro-F1 differences whose sign and CI are checked")
    readings: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {k: dict(v) for k, v in DEFAULT_READINGS.items()}, min_length=1,
        description="name -> {dotted config key: value}, each key under " + ", ".join(READING_ROOTS))
    encoders: list[Literal["stain_invariant", "plain"]] = Field(
        default_factory=lambda: ["stain_invariant", "plain"], min_length=1,
        description="stain_invariant: the embedded default (main runs, external cohort); plain: the dose-response "
                    "plain-encoder runs on the shifted cohort at `severity`")
    severity: float | None = Field(None, ge=0, description="shifted-cohort severity of the plain-encoder condition, "
                                   "one of experiments.dose_response.severities; unset: the largest")
    seeds: list[int] = Field(default_factory=lambda: [11], min_length=1,
                             description="seeds of every reading's runs (few: the readings are many)")

    @model_validator(mode="after")
    def _named(self) -> SensitivityConfig:
        for name, keys in self.readings.items():
            if not name.replace("_", "").isalnum() or not name.islower() or name == "baseline":
                raise ValueError(f"experiments.sensitivity.readings: name {name!r} must be lower-case letters, "
                                 "digits and underscores, and not 'baseline' (the shared reference)")
            bad = [k for k in keys if not k.startswith(READING_ROOTS)] or ([] if keys else ["(none)"])
            if bad:
                raise ValueError(f"experiments.sensitivity.readings.{name}: key {bad[0]!r} is not a reading; "
                                 f"readings set keys under {', '.join(READING_ROOTS)}")
        return self

    def methods(self) -> list[str]:
        return list(dict.fromkeys(m for pair in self.conclusions for m in pair))


def _train(smk, cfg: Config) -> None:
    w = smk.wildcards
    warm(smk, "fedhisto.train.stage:run_train", w.method, int(w.seed), smk.input.manifest, smk.input.identity,
         smk.input.descriptors, SX.reading_config(cfg, w.reading), Path(smk.output.status).parent,
         encoder_dir=encoder_dir(smk), threads=smk.threads)


def _predict(smk, cfg: Config) -> None:
    w = smk.wildcards
    warm(smk, "fedhisto.predict.stage:run_predict", w.method, int(w.seed), Path(smk.input.status).parent, smk.input.manifest,
         smk.input.identity, smk.input.descriptors, SX.reading_config(cfg, w.reading), Path(smk.output.external).parent,
         encoder_dir=encoder_dir(smk), threads=smk.threads)


def _predict_shifted(smk, cfg: Config) -> None:
    w = smk.wildcards
    warm(smk, "fedhisto.experiments.shifted:predict_shifted", w.method, int(w.seed), Path(smk.input.status).parent,
         smk.input.manifest, smk.input.identity, smk.input.descriptors, smk.input.cohort,
         SX.reading_config(cfg, w.reading), smk.output.predictions, encoder_dir=encoder_dir(smk), threads=smk.threads)


def _summarise(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.sensitivity:summarise_sensitivity", [tuple(r) for r in smk.params.runs],
         smk.input.cohort[0] if smk.input.cohort else None, cfg, summary_dir(smk))


class Sensitivity(Experiment):
    """Each reading of an unstated choice retrained one at a time against the shared baseline (main /
    dose-response plain runs), for the two tiny encoder conditions."""

    name = NAME
    settings = SensitivityConfig

    @classmethod
    def check(cls, experiments) -> None:
        sens, severities = experiments.sensitivity, experiments.dose_response.severities
        if sens.severity is None:  # resolved here so every reader (summary, figure, provenance) sees one number
            sens = sens.model_copy(update={"severity": float(max(severities))})  # a copy: defaults are shared
            object.__setattr__(experiments, "sensitivity", sens)
        if "plain" in sens.encoders and sens.severity not in severities:  # caught here, not after the training
            raise ValueError(f"experiments.sensitivity.severity {sens.severity} is not one of "
                             f"experiments.dose_response.severities {severities}: its plain-encoder condition "
                             "is scored on the dose-response cohort at that severity")

    def steps(self, cfg: Config) -> list[Step]:
        here, run = SX.HERE, "{reading}/train/{method}/seed{seed}"
        reading = {"reading": SX.reading_pattern(cfg)}

        def block(stage: str):
            return lambda w: stage_block(SX.reading_config(cfg, w.reading), stage, method=w.method, seed=w.seed)

        def predictions(encoder: str, name: str) -> str:
            return f"{here}/{encoder}/{{reading}}/predictions/{{method}}/seed{{seed}}/{name}"

        return [
            Step("train_sensitivity", {"status": f"{here}/{{sencoder}}/{run}/status.json",
                                       "history": f"{here}/{{sencoder}}/{run}/history.csv"},
                 _train, inputs=lambda w: SX.train_inputs(cfg, w.sencoder), params={"block": block("train")},
                 log="logs/experiments/sensitivity/{sencoder}/{reading}/train/{method}/seed{seed}.log",
                 resources="train", wildcard_constraints={"sencoder": "stain_invariant|plain", **reading}),
            Step("predict_sensitivity", {k: predictions("stain_invariant", f"{k}.csv")
                                         for k in ("test", "holdout", "external")},
                 _predict, inputs=lambda w: {**SX.train_inputs(cfg, "stain_invariant"),
                                             "status": f"{here}/stain_invariant/{w.reading}/train/{w.method}/seed{w.seed}/status.json"},
                 params={"block": block("predict")}, resources="predict", wildcard_constraints=reading,
                 log="logs/experiments/sensitivity/stain_invariant/{reading}/predict/{method}/seed{seed}.log"),
            Step("predict_sensitivity_shifted", {"predictions": predictions("plain", "shifted.csv")},
                 _predict_shifted, inputs=lambda w: {**SX.train_inputs(cfg, "plain"), "cohort": SX.SHIFTED_COHORT,
                                                     "status": f"{here}/plain/{w.reading}/train/{w.method}/seed{w.seed}/status.json"},
                 params={"block": lambda w: SX.shifted_block(cfg, w.reading, w.method, w.seed)}, resources="predict",
                 log="logs/experiments/sensitivity/plain/{reading}/predict/{method}/seed{seed}.log",
                 wildcard_constraints=reading),
            Step("summarize_sensitivity", summary_files(NAME), _summarise, inputs=SX.summary_inputs(cfg),
                 params={"runs": [list(r) for r in SX.sensitivity_runs(cfg)], "block": experiment_block(cfg, NAME)}),
        ]


# ------------------------------------------------------------------ analysis
STAGE = "experiments"


def _sign(d: dict) -> int:
    return 0 if abs(d["difference"]) < 1e-12 else (1 if d["difference"] > 0 else -1)


def _excludes_zero(d: dict) -> bool:
    return d["ci_low"] > 0 or d["ci_high"] < 0


def _severity_of(cohort_csv: str | Path) -> dict[str, float]:
    with Path(cohort_csv).open() as fh:
        return {r["sample_id"]: float(r["severity"]) for r in csv.DictReader(fh)}


def summarise_sensitivity(runs: list[tuple[str, str, str, int, str]], cohort_csv: str | Path | None, cfg: Config,
                          out_dir: str | Path) -> dict:
    """``runs``: (encoder, reading, method, seed, predictions CSV): external predictions for
    ``stain_invariant``, shifted-cohort predictions for ``plain`` (scored at ``severity``)."""
    import numpy as np

    from fedhisto.stats.ensemble_intervals import paired_macro_f1
    from fedhisto.stats.prediction_files import AlignmentError, ensemble
    from fedhisto.stats.scores import macro_f1

    x, s = cfg.experiments, cfg.experiments.sensitivity
    files: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for encoder, reading, method, _seed, path in runs:
        files[(encoder, reading, method)].append(path)
    severity_of = _severity_of(cohort_csv) if cohort_csv else {}
    rows = []
    for encoder in s.encoders:
        ens, first = {}, None
        for reading in reading_names(cfg):
            for method in s.methods():
                paths = files.get((encoder, reading, method))
                if not paths:
                    raise AlignmentError(f"sensitivity: no predictions for {encoder}/{reading}/{method}")
                ids, y, probs = ensemble(paths)
                if encoder == "plain":
                    missing = [i for i in ids if i not in severity_of]
                    if missing:
                        raise AlignmentError(f"{paths[0]}: sample {missing[0]} is not in {cohort_csv}")
                    keep = np.array([severity_of[i] == s.severity for i in ids])
                    if not keep.any():
                        raise AlignmentError(f"{paths[0]}: no image at severity {s.severity} "
                                             "(experiments.sensitivity.severity must be a dose-response severity)")
                    ids, y, probs = [i for i, k in zip(ids, keep, strict=True) if k], y[keep], probs[keep]
                if first is not None and ids != first:
                    raise AlignmentError(f"{paths[0]}: its images differ from the other cells' ({encoder})")
                first = ids
                ens[(reading, method)] = (y, probs)
        for method, reference in s.conclusions:
            base = None
            for reading in reading_names(cfg):
                (y, pa), (_, pb) = ens[(reading, method)], ens[(reading, reference)]
                d = paired_macro_f1(y, pa, pb, x.resamples, x.bootstrap_seed)
                base = d if reading == BASELINE else base
                keeps_sign = _sign(d) == _sign(base)
                keeps_ci = _excludes_zero(d) == _excludes_zero(base)
                rows.append({"encoder": encoder, "reading": reading, "method": method, "reference": reference,
                             "images": len(y), "seeds": len(files[(encoder, reading, method)]),
                             "method_macro_f1": macro_f1(y, pa.argmax(1)),
                             "reference_macro_f1": macro_f1(y, pb.argmax(1)),
                             "retrained": ",".join(m for m in (method, reference) if reading != BASELINE
                                                   and retrained(cfg, encoder, reading, m)),
                             **d, "excludes_zero": _excludes_zero(d), "keeps_sign": keeps_sign,
                             "keeps_ci": keeps_ci, "survives": keeps_sign and keeps_ci})
    verdicts = []
    for encoder in s.encoders:
        for method, reference in s.conclusions:
            mine = [r for r in rows if (r["encoder"], r["method"], r["reference"]) == (encoder, method, reference)]
            base = next(r for r in mine if r["reading"] == BASELINE)
            broken = [r["reading"] for r in mine if not r["survives"]]
            verdicts.append({"encoder": encoder, "conclusion": f"{method} - {reference}",
                             "baseline": base["difference"], "ci_low": base["ci_low"], "ci_high": base["ci_high"],
                             "baseline_excludes_zero": base["excludes_zero"],
                             "survives_every_reading": not broken, "broken_by": ",".join(broken)})
    out = Path(out_dir)
    write_csv(out / "sensitivity.csv", rows, list(rows[0]))
    write_csv(out / "verdicts.csv", verdicts, list(verdicts[0]))
    _figure(rows, cfg, out / "sensitivity.png")
    summary = {"design": s.model_dump(mode="json"), "resamples": x.resamples, "cells": rows, "verdicts": verdicts,
               "provenance": provenance_block(STAGE, {"experiment": "sensitivity", **x.model_dump(mode="json")},
                                              {**({"cohort": cohort_csv} if cohort_csv else {}),
                                               **{f"run{i}": r[4] for i, r in enumerate(runs)}})}
    write_json(out / "sensitivity.json", summary)
    return summary


def _figure(rows: list[dict], cfg: Config, path: Path) -> None:
    from fedhisto.infra.plotting import plt, save_figure  # plotting: only when drawing

    s = cfg.experiments.sensitivity
    readings = reading_names(cfg)
    fig, axes = plt.subplots(1, len(s.encoders), figsize=(6.0 * len(s.encoders) + 1.5, 0.45 * len(readings)
                                                           * len(s.conclusions) + 1.8), squeeze=False, sharey=True)
    for col, encoder in enumerate(s.encoders):
        ax = axes[0, col]
        labels, ticks = [], []
        for k, (method, reference) in enumerate(s.conclusions):
            mine = [r for r in rows if (r["encoder"], r["method"], r["reference"]) == (encoder, method, reference)]
            y0 = k * (len(readings) + 1)
            for j, r in enumerate(mine):
                yy = y0 + j
                colour = "black" if r["reading"] == BASELINE else ("tab:blue" if r["survives"] else "tab:red")
                ax.errorbar(r["difference"], yy, xerr=[[r["difference"] - r["ci_low"]], [r["ci_high"] - r["difference"]]],
                            fmt="o", color=colour, capsize=2)
                ticks.append(yy)
                labels.append(f"{method} - {reference}: {r['reading']}")
        ax.axvline(0.0, color="grey", lw=0.8)
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"encoder: {encoder}" + (f" (shifted cohort, s = {s.severity})" if encoder == "plain"
                                              else " (external cohort)"))
        ax.set_xlabel("paired macro-F1 difference (95 % CI); red: the reading breaks the baseline's conclusion")
    save_figure(fig, path)
