"""Experiment 1, stain-shift dose-response: ensemble metrics against shift severity, per encoder condition.

Each cell (encoder condition x severity x method) scores the seeds' ensemble on the same tissues
rendered at that severity: macro-F1, balanced accuracy and ECE with 95 % bootstrap intervals,
and the v2-vs-FedAvg-PEFT paired bootstrap difference of macro-F1 (the bootstrap stage's test).
With an extra arm (``experiments.dose_response.extra_methods``, e.g. the stain-augmented
``fedavg_peft_stain``) also v2 - arm and arm - FedAvg-PEFT: paired consistency, or just augmentation?
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedhisto.config.study import Config
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.plotting import plot_lines_with_bands, save_figure
from fedhisto.infra.provenance import provenance_block
from fedhisto.stats.ensemble_intervals import metric_replicates, paired_macro_f1, summarise
from fedhisto.stats.prediction_files import AlignmentError, ensemble

STAGE = "experiments"
METRICS = ("macro_f1", "balanced_accuracy", "ece")
DIFFERENCE = ("past_v2", "fedavg_peft")


def difference_pairs(methods: list[str], extra: list[str]) -> list[tuple[str, str]]:
    """(method, reference) of every paired difference: v2 - FedAvg-PEFT, then per extra arm v2 - arm
    and arm - FedAvg-PEFT (what the arm's augmentation alone buys)."""
    pairs = [DIFFERENCE]
    for arm in extra:
        if arm not in DIFFERENCE:
            pairs += [(DIFFERENCE[0], arm), (arm, DIFFERENCE[1])]
    return [p for p in dict.fromkeys(pairs) if set(p) <= set(methods)]


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
    pairs = difference_pairs(sorted({m for _, m in ensembles}), list(x.dose_response.extra_methods))
    for encoder in sorted({e for e, _ in ensembles}):
        for pair in pairs:
            if not all((encoder, m) in ensembles for m in pair):
                continue
            (sev, y, pa), (_, _, pb) = (ensembles[(encoder, m)] for m in pair)
            for s in x.dose_response.severities:
                sel = sev == s
                diffs.append({"encoder": encoder, "severity": s, "method": pair[0], "reference": pair[1],
                              "images": int(sel.sum()),
                              **paired_macro_f1(y[sel], pa[sel], pb[sel], x.resamples, x.bootstrap_seed)})
    principal = [d for d in diffs if (d["method"], d["reference"]) == DIFFERENCE]
    out = Path(out_dir)
    write_csv(out / "dose_response.csv", cells, list(cells[0]))
    write_csv(out / "v2_vs_fedavg_by_severity.csv", principal, list(principal[0]) if principal else ["encoder"])
    write_csv(out / "paired_differences.csv", diffs, list(diffs[0]) if diffs else ["encoder"])
    _figure(cells, diffs, out / "dose_response.png")
    summary = {"design": x.dose_response.model_dump(mode="json"), "methods": sorted({m for _, m in ensembles}),
               "seeds": list(x.seeds), "resamples": x.resamples, "cells": cells, "v2_vs_fedavg": principal,
               "paired_differences": diffs,
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
        pairs = list(dict.fromkeys((d["method"], d["reference"]) for d in diffs if d["encoder"] == encoder))
        curves = {}
        for method, reference in pairs:
            rows = sorted((d for d in diffs if d["encoder"] == encoder and (d["method"], d["reference"]) ==
                           (method, reference)), key=lambda d: d["severity"])
            curves[f"{method} - {reference}"] = tuple(np.array([r[k] for r in rows])
                                                      for k in ("difference", "ci_low", "ci_high"))
        if curves:
            plot_lines_with_bands(axes[1, col], xs, curves)
        axes[1, col].axhline(0.0, color="grey", lw=0.8)
        axes[1, col].set_ylabel("paired macro-F1 difference (95 % CI)")
        axes[1, col].set_xlabel("shift severity (0: client site, 1: external site)")
    save_figure(fig, path)
