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

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedhisto.config.study import Config
from fedhisto.experiments.sensitivity_layout import BASELINE, reading_names, retrained
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.plotting import save_figure
from fedhisto.infra.provenance import provenance_block
from fedhisto.stats.ensemble_intervals import paired_macro_f1
from fedhisto.stats.prediction_files import AlignmentError, ensemble
from fedhisto.stats.scores import macro_f1

STAGE = "experiments"


def _sign(d: dict) -> int:
    return 0 if abs(d["difference"]) < 1e-12 else int(np.sign(d["difference"]))


def _excludes_zero(d: dict) -> bool:
    return d["ci_low"] > 0 or d["ci_high"] < 0


def _severity_of(cohort_csv: str | Path) -> dict[str, float]:
    with Path(cohort_csv).open() as fh:
        return {r["sample_id"]: float(r["severity"]) for r in csv.DictReader(fh)}


def summarise_sensitivity(runs: list[tuple[str, str, str, int, str]], cohort_csv: str | Path | None, cfg: Config,
                          out_dir: str | Path) -> dict:
    """``runs``: (encoder, reading, method, seed, predictions CSV): external predictions for
    ``stain_invariant``, shifted-cohort predictions for ``plain`` (scored at ``severity``)."""
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
