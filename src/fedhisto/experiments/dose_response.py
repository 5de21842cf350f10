"""Experiment 1, stain-shift dose-response: ensemble metrics against shift severity, per encoder condition.

Each cell (encoder condition x severity x method) scores the seeds' ensemble on the same tissues
rendered at that severity: macro-F1, balanced accuracy and ECE with 95 % bootstrap intervals,
and the v2-vs-FedAvg-PEFT paired bootstrap difference of macro-F1 (the bootstrap stage's test).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedhisto.atomic import write_csv, write_json
from fedhisto.config import Config
from fedhisto.experiment_stats import metric_replicates, paired_macro_f1, summarise
from fedhisto.figures import plot_lines_with_bands, save_figure
from fedhisto.predictions import AlignmentError, ensemble
from fedhisto.provenance import provenance_block

STAGE = "experiments"
METRICS = ("macro_f1", "balanced_accuracy", "ece")
DIFFERENCE = ("past_v2", "fedavg_peft")


def _severity_of(cohort_csv: str | Path) -> dict[str, float]:
    with Path(cohort_csv).open() as fh:
        return {r["sample_id"]: float(r["severity"]) for r in csv.DictReader(fh)}


def summarise_dose_response(runs: list[tuple[str, str, int, str]], cohort_csv: str | Path, cfg: Config,
                            out_dir: str | Path) -> dict:
    """``runs``: (encoder condition, method, seed, shifted-predictions CSV)."""
    x = cfg.experiments
    severity_of = _severity_of(cohort_csv)
    files: dict[tuple[str, str], list[str]] = defaultdict(list)
    for condition, method, _seed, path in runs:
        files[(condition.split("/")[-1], method)].append(path)
    cells, diffs = [], []
    ensembles: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    first_ids: list[str] | None = None
    for (encoder, method), paths in files.items():
        ids, y, probs = ensemble(paths)
        unknown = [i for i in ids if i not in severity_of]
        if unknown:
            raise AlignmentError(f"{paths[0]}: {len(unknown)} sample id(s) not in {cohort_csv} (e.g. {unknown[0]})")
        if first_ids is not None and ids != first_ids:  # the paired differences need the same images
            raise AlignmentError(f"{paths[0]}: its images differ from the other methods' shifted predictions")
        first_ids = ids
        ensembles[(encoder, method)] = (np.array([severity_of[i] for i in ids]), y, probs)
    for (encoder, method), (sev, y, probs) in sorted(ensembles.items()):
        for s in x.dose_response.severities:
            sel = sev == s
            if not sel.any():
                raise AlignmentError(f"{cohort_csv}: no image at severity {s} (experiments.dose_response.severities)")
            reps = metric_replicates(y[sel], probs[sel], x.resamples, x.bootstrap_seed, x.calibration.bins)
            cells.append({"encoder": encoder, "severity": s, "method": method, "seeds": len(files[(encoder, method)]),
                          "images": int(sel.sum()), **summarise(reps, METRICS)})
    for encoder in sorted({e for e, _ in ensembles}):
        if all((encoder, m) in ensembles for m in DIFFERENCE):
            (sev, y, pa), (_, _, pb) = (ensembles[(encoder, m)] for m in DIFFERENCE)
            for s in x.dose_response.severities:
                sel = sev == s
                diffs.append({"encoder": encoder, "severity": s, "method": DIFFERENCE[0], "reference": DIFFERENCE[1],
                              "images": int(sel.sum()),
                              **paired_macro_f1(y[sel], pa[sel], pb[sel], x.resamples, x.bootstrap_seed)})
    out = Path(out_dir)
    write_csv(out / "dose_response.csv", cells, list(cells[0]))
    write_csv(out / "v2_vs_fedavg_by_severity.csv", diffs, list(diffs[0]) if diffs else ["encoder"])
    _figure(cells, diffs, out / "dose_response.png")
    summary = {"design": x.dose_response.model_dump(mode="json"), "methods": sorted({m for _, m in ensembles}),
               "seeds": list(x.seeds), "resamples": x.resamples, "cells": cells, "v2_vs_fedavg": diffs,
               "provenance": provenance_block(STAGE, {"experiment": "dose_response", **x.model_dump(mode="json")},
                                              {"cohort": cohort_csv, **{f"run{i}": r[3] for i, r in enumerate(runs)}})}
    write_json(out / "dose_response.json", summary)
    return summary


def _figure(cells: list[dict], diffs: list[dict], path: Path) -> None:
    encoders = sorted({c["encoder"] for c in cells})
    fig, axes = plt.subplots(2, len(encoders), figsize=(5.2 * len(encoders) + 2.2, 7.5), squeeze=False,
                             sharey="row")
    for col, encoder in enumerate(encoders):
        series = {}
        for method in sorted({c["method"] for c in cells if c["encoder"] == encoder}):
            rows = sorted((c for c in cells if c["encoder"] == encoder and c["method"] == method),
                          key=lambda c: c["severity"])
            series[method] = tuple(np.array([r[k] for r in rows]) for k in ("macro_f1", "macro_f1_ci_low",
                                                                            "macro_f1_ci_high"))
        xs = sorted({c["severity"] for c in cells})
        plot_lines_with_bands(axes[0, col], xs, series)
        axes[0, col].set_title(f"encoder: {encoder}")
        axes[0, col].set_ylabel("ensemble macro-F1 (95 % CI)")
        rows = sorted((d for d in diffs if d["encoder"] == encoder), key=lambda d: d["severity"])
        if rows:
            plot_lines_with_bands(axes[1, col], [r["severity"] for r in rows],
                                  {"past_v2 - fedavg_peft": tuple(np.array([r[k] for r in rows])
                                                                  for k in ("difference", "ci_low", "ci_high"))})
        axes[1, col].axhline(0.0, color="grey", lw=0.8)
        axes[1, col].set_ylabel("paired macro-F1 difference (95 % CI)")
        axes[1, col].set_xlabel("shift severity (0: client site, 1: external site)")
    save_figure(fig, path)
