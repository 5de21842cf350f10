"""The report's figures (stage ``report``): every estimate with its 95 % bootstrap CI.

Intervals are percentile intervals over image-level resamples of the external cohort
(:func:`fedhisto.stats.resampling.bootstrap_interval` on each method's ensemble predictions, seeded with
the ``bootstrap`` config block's seed and resample count), so the bars and points show how much
the external estimate would move on another draw of the same number of images. Legends sit
outside the axes (:func:`fedhisto.infra.plotting.legend_outside`) and never cover a bar or point.
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from fedhisto import CLASSES
from fedhisto.infra.plotting import legend_outside, plot_bars_with_ci, plot_reliability, save_figure
from fedhisto.stats.prediction_files import ensemble, ensemble_members
from fedhisto.stats.resampling import bootstrap_interval
from fedhisto.stats.temperature import reliability_bins

log = logging.getLogger(__name__)
RELIABILITY_BINS = 15
RELIABILITY_METHODS = ("fedavg_peft",)  # drawn beside the focus method (v2) when configured


def ensemble_intervals(methods: list[str], external_predictions: dict[str, list[str]], resamples: int, seed: int,
                       confidence: float) -> dict[str, dict[str, dict]]:
    """Per method, :func:`bootstrap_interval` of every metric of its external ensemble (a method
    with one model per client: the mean over its models, as Table 5 scores it)."""
    missing = [k for k in methods if k not in external_predictions]
    if missing:
        raise ValueError(f"no external predictions for {', '.join(missing)}: the figures' intervals need them")
    out = {}
    for method in methods:
        members = ensemble_members(external_predictions[method])
        _, y, _ = next(iter(members.values()))
        out[method] = bootstrap_interval(y, [p.argmax(1) for _, _, p in members.values()], resamples, seed,
                                         confidence)
    return out


def _warn_if_table_differs(m: dict, intervals: dict[str, dict[str, dict]]) -> None:
    """The figures re-score the predictions; a disagreement with Table 5 means the report was given
    other files than the metrics stage read."""
    for method, iv in intervals.items():
        table = m["ensembles"][method]["macro_f1"]
        if table is not None and abs(iv["macro_f1"]["estimate"] - table) > 1e-9:
            log.warning("%s: figure macro-F1 %.6f differs from Table 5's %.6f", method, iv["macro_f1"]["estimate"],
                        table)


def _columns(intervals: dict[str, dict[str, dict]], metric: str) -> tuple[list, list, list]:
    rows = [intervals[k][metric] for k in intervals]
    return [r["estimate"] for r in rows], [r["ci_low"] for r in rows], [r["ci_high"] for r in rows]


def _grouped_bars(intervals: dict[str, dict[str, dict]], metrics: dict[str, str], title: str, pct: int, path: Path):
    methods = list(intervals)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(methods) + 3), 3.8))
    width = 0.8 / len(metrics)
    for k, (metric, label) in enumerate(metrics.items()):
        plot_bars_with_ci(ax, methods, *_columns(intervals, metric), label=label, width=width,
                          offset=(k - (len(metrics) - 1) / 2) * width)
    ax.set_ylim(0, 1.05)  # room above a bar whose CI reaches 1
    ax.set_title(f"{title} ({pct} % bootstrap CI)")
    legend_outside(ax)
    save_figure(fig, path)


def write_figures(m: dict, boots: list[dict], external_predictions: dict[str, list[str]], figures: Path,
                  resamples: int, seed: int, confidence: float) -> None:
    methods = list(m["ensembles"])
    pct = round(100 * confidence)
    intervals = ensemble_intervals(methods, external_predictions, resamples, seed, confidence)
    _warn_if_table_differs(m, intervals)
    _grouped_bars(intervals, {"macro_f1": "macro-F1", "balanced_accuracy": "balanced accuracy"},
                  "External cohort: method-level ensembles", pct, figures / "ensemble_macro_f1.png")
    _grouped_bars(intervals, {f"recall_{c}": c for c in CLASSES}, "External cohort: class-wise recall", pct,
                  figures / "class_recall.png")

    focus = "past_v2" if "past_v2" in methods else methods[-1]
    cm = np.array(m["ensembles"][focus]["confusion"])  # counts, not estimates: no interval to draw
    fig, ax = plt.subplots(figsize=(4, 3.6))
    ax.imshow(cm, cmap="Blues")
    for i in range(3):
        for j in range(3):
            ax.text(j, i, str(cm[i, j]), ha="center", va="center")
    ax.set_xticks(range(3), CLASSES)
    ax.set_yticks(range(3), CLASSES)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"{focus} ensemble, external cohort")
    save_figure(fig, figures / "confusion_v2.png")

    abl = [b for b in boots if b["ablation"]]
    fig, ax = plt.subplots(figsize=(6, 2.5 + 0.4 * len(abl)))
    for i, b in enumerate(abl):
        v = b["metrics"]["macro_f1"]
        ax.errorbar(v["difference"], i, xerr=[[v["difference"] - v["ci_low"]], [v["ci_high"] - v["difference"]]],
                    fmt="o", capsize=4)
    ax.axvline(0, color="grey", lw=1)
    ax.set_yticks(range(len(abl)), [b["comparison"] for b in abl])
    ax.set_xlabel("macro-F1 difference (full v2 minus ablation), 95 % CI")
    ax.set_title("Ablation forest plot (external cohort)")
    save_figure(fig, figures / "ablation_forest.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in (k for k in (*RELIABILITY_METHODS, focus) if k in external_predictions):
        _, y, p = ensemble(external_predictions[method])
        plot_reliability(ax, reliability_bins(p, y, RELIABILITY_BINS, resamples, seed, confidence), method)
    ax.set_title(f"Reliability, external ensembles ({RELIABILITY_BINS} bins, {pct} % bootstrap CI)")
    legend_outside(ax)
    save_figure(fig, figures / "reliability.png")
