"""Experiment 4, calibration: temperature scaling fitted per checkpoint on its validation predictions.

Each run's temperature is fitted on that run's validation predictions only (the split that
selected its checkpoint; never test or external), then applied to its test and external
probabilities. Per method, the seeds' ensemble before and after (each after-ensemble averages the
runs' calibrated probabilities) gives NLL, Brier and ECE with 95 % bootstrap intervals; before and
after are resampled with the same images, so their difference is a paired one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from fedhisto.config.study import Config
from fedhisto.experiments.framework import Experiment, Step, summary_dir, summary_files, warm
from fedhisto.experiments.layout import experiment_block
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block, sidecar_path
from fedhisto.infra.settings_base import Strict

STAGE = "experiments"
COHORTS = ("test", "external")
SCORES = ("nll", "brier", "ece")


if TYPE_CHECKING:
    import numpy as np

NAME = "calibration"


class CalibrationConfig(Strict):
    """Temperature scaling fitted per checkpoint on its validation predictions."""

    bins: int = Field(15, ge=2, description="reliability-diagram and ECE bins")


def calibration_runs(cfg: Config) -> list[tuple[str, int]]:
    x = cfg.experiments
    return [(m, s) for m in x.methods for s in x.seeds]


def calibration_inputs(cfg: Config) -> list[tuple[str, int, str, str, str]]:
    """(method, seed, validation, test, external predictions); the training stage writes the
    validation predictions beside status.json."""
    return [(m, s, f"results/train/{m}/seed{s}/validation_predictions.csv", f"results/predictions/{m}/seed{s}/test.csv",
             f"results/predictions/{m}/seed{s}/external.csv") for m, s in calibration_runs(cfg)]


def calibration_files(cfg: Config) -> list[str]:
    """The rule's inputs: each run's status (its validation predictions are not a declared output) and predictions."""
    return [p for m, s, _val, test, ext in calibration_inputs(cfg) for p in (f"results/train/{m}/seed{s}/status.json",
                                                                          test, ext)]


def _summarise(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.calibration:summarise_calibration", [tuple(r) for r in smk.params.runs], cfg,
         summary_dir(smk))


class Calibration(Experiment):
    name = NAME
    settings = CalibrationConfig

    def steps(self, cfg: Config) -> list[Step]:
        return [Step("calibrate_checkpoints", summary_files(NAME), _summarise, inputs={"runs": calibration_files(cfg)},
                     params={"runs": [list(r) for r in calibration_inputs(cfg)], "block": experiment_block(cfg, NAME)})]


# ------------------------------------------------------------------ analysis
def _single(path: str | Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    import numpy as np

    from fedhisto.stats.prediction_files import read_predictions

    sidecar = sidecar_path(path)
    if sidecar.exists() and "temperatures" in json.loads(sidecar.read_text()):
        raise ValueError(f"{path}: already temperature-scaled (evaluate.temperature_scaling: true); the calibration "
                         "experiment needs the raw probabilities, set evaluate.temperature_scaling: false")
    got = read_predictions(path)
    if len(got) != 1:
        raise ValueError(f"{path}: {len(got)} models per image; calibration scores single-model methods")
    ids, y, probs = next(iter(got.values()))
    order = np.argsort(ids)
    return [ids[i] for i in order], y[order], probs[order]


def summarise_calibration(runs: list[tuple[str, int, str, str, str]], cfg: Config, out_dir: str | Path) -> dict:
    """``runs``: (method, seed, validation CSV, test CSV, external CSV) of the main pipeline's runs."""
    import numpy as np

    from fedhisto.stats.ensemble_intervals import interval
    from fedhisto.stats.temperature import (
        apply_temperature,
        calibration_measures,
        fit_temperature,
        reliability_bins,
    )

    x = cfg.experiments
    bins = x.calibration.bins
    per_run, per_method, diagrams = [], [], {}
    ensembles: dict[tuple[str, str], dict] = {}
    for method, seed, val_csv, test_csv, ext_csv in runs:
        _, vy, vp = _single(val_csv)
        t = fit_temperature(vp, vy)
        for cohort, path in zip(COHORTS, (test_csv, ext_csv), strict=True):
            ids, y, p = _single(path)
            after = apply_temperature(p, t)
            before_s, after_s = calibration_measures(p, y, bins), calibration_measures(after, y, bins)
            per_run.append({"method": method, "seed": seed, "temperature": t, "cohort": cohort, "images": len(ids),
                            **{f"{k}_before": v for k, v in before_s.items()},
                            **{f"{k}_after": v for k, v in after_s.items()}})
            acc = ensembles.setdefault((method, cohort), {"ids": ids, "y": y, "before": [], "after": []})
            if acc["ids"] != ids:
                raise ValueError(f"{path}: its images differ from the other seeds' {cohort} predictions")
            acc["before"].append(p)
            acc["after"].append(after)
    rng_seed = x.bootstrap_seed
    for (method, cohort), acc in sorted(ensembles.items()):
        y = acc["y"]
        before, after = np.mean(acc["before"], axis=0), np.mean(acc["after"], axis=0)
        rng = np.random.default_rng(rng_seed)
        picks = [np.arange(len(y))] + [rng.integers(0, len(y), len(y)) for _ in range(x.resamples)]
        # each resample scored once (the three measures together), not once per measure
        mb = [calibration_measures(before[i], y[i], bins) for i in picks]
        ma = [calibration_measures(after[i], y[i], bins) for i in picks]
        rb = {k: np.array([m[k] for m in mb]) for k in SCORES}
        ra = {k: np.array([m[k] for m in ma]) for k in SCORES}
        for k in SCORES:
            b, a, d = interval(rb[k]), interval(ra[k]), interval(ra[k] - rb[k])
            per_method.append({"method": method, "cohort": cohort, "score": k, "seeds": len(acc["before"]),
                               "images": len(y), "before": b["estimate"], "before_ci_low": b["ci_low"],
                               "before_ci_high": b["ci_high"], "after": a["estimate"], "after_ci_low": a["ci_low"],
                               "after_ci_high": a["ci_high"], "change": d["estimate"], "change_ci_low": d["ci_low"],
                               "change_ci_high": d["ci_high"]})
        diagrams[(method, cohort)] = {
            "before": reliability_bins(before, y, bins, resamples=x.resamples, seed=rng_seed),
            "after": reliability_bins(after, y, bins, resamples=x.resamples, seed=rng_seed)}
    out = Path(out_dir)
    write_csv(out / "calibration.csv", per_method, list(per_method[0]))
    write_csv(out / "per_run.csv", per_run, list(per_run[0]))
    _figure(diagrams, bins, out / "calibration.png")
    summary = {"design": {**x.calibration.model_dump(mode="json"), "methods": list(x.methods), "seeds": list(x.seeds),
                          "fitted_on": "validation predictions of each run", "applied_to": list(COHORTS)},
               "resamples": x.resamples, "per_method": per_method, "per_run": per_run,
               "reliability": {f"{m}/{c}": d for (m, c), d in diagrams.items()},
               "provenance": provenance_block(STAGE, {"experiment": "calibration", **x.model_dump(mode="json")},
                                              {f"{r[0]}_seed{r[1]}_{k}": p for r in runs
                                               for k, p in zip(("validation", *COHORTS), r[2:], strict=True)})}
    write_json(out / "calibration.json", summary)
    return summary


def _figure(diagrams: dict, bins: int, path: Path) -> None:
    from fedhisto.infra.plotting import (  # plotting: only when drawing
        legend_outside,
        plot_reliability,
        plt,
        save_figure,
    )

    methods = sorted({m for m, _ in diagrams})
    fig, axes = plt.subplots(len(COHORTS), len(methods), figsize=(3.3 * len(methods) + 3.2, 3.4 * len(COHORTS)),
                             squeeze=False, sharex=True, sharey=True)
    for i, cohort in enumerate(COHORTS):
        for j, method in enumerate(methods):
            ax = axes[i, j]
            d = diagrams[(method, cohort)]
            plot_reliability(ax, d["before"], "before")
            plot_reliability(ax, d["after"], "after temperature scaling")
            ax.set_title(f"{method} / {cohort}", fontsize=9)
    legend_outside(axes[0, -1])  # one legend, right of the last panel: never over a diagram
    fig.suptitle(f"reliability ({bins} bins, per-bin 95 % CI) before and after temperature scaling")
    save_figure(fig, path)
