"""The report's site-robustness table and figure, from ``results/metrics/robustness.csv``
(:mod:`fedhisto.metrics.robustness`: croma's RI and APD of every run's adapted representation and of the
frozen encoder).

- ``results/tables/robustness.csv`` / ``.md``: per method, RI and APD as mean and sample SD over seeds (a
  method with one model per site: the mean over its models first), the frozen encoder first;
- ``results/figures/robustness.png``: three panels sharing the methods: RI per seed (dots) and its mean
  (diamond); the median per-image RI per seed with croma's cluster-bootstrap interval; APD per seed and its
  mean. The frozen encoder's value is the dashed line in each panel.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from fedhisto.infra.plotting import legend_outside, save_figure
from fedhisto.metrics.robustness import FROZEN_METHOD, summarize


def _num(v) -> float:
    return np.nan if v in ("", None) else float(v)


def robustness_table(rows: list[dict]) -> list[dict]:
    return [{"method": s["method"], "encoder_state": s["encoder_state"], "seeds": s["seeds"],
             "ri_mean": s["ri_mean"], "ri_sd": s["ri_sd"], "apd_mean": s["apd_mean"], "apd_sd": s["apd_sd"]}
            for s in summarize(rows)]


def robustness_figure(rows: list[dict], path: Path, confidence: float) -> None:
    adapted = [r for r in rows if r["encoder_state"] == "adapted"]
    frozen = next((r for r in rows if r["method"] == FROZEN_METHOD), {})
    means = {s["method"]: s["ri_mean"] for s in summarize(rows) if s["encoder_state"] == "adapted"}
    methods = sorted(means, key=lambda m: (np.nan_to_num(means[m] if means[m] is not None else np.nan, nan=-1), m))
    pos = {m: i for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, 3, figsize=(13, 1.2 + 0.32 * max(len(methods), 3)), sharey=True)
    panels = (("ri", "RI (pooled), per seed"), ("ri_median", f"median per-image RI, {round(100 * confidence)} % "
                                                             "cluster-bootstrap CI"), ("apd", "APD, per seed"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ys = np.array([pos[r["method"]] for r in adapted], dtype=float)
        xs = np.array([_num(r.get(key)) for r in adapted])
        jitter = (np.arange(len(adapted)) % 5 - 2) * 0.06  # seeds of one method side by side, not stacked
        if key == "ri_median":
            lo = np.array([_num(r.get("ri_median_ci_low")) for r in adapted])
            hi = np.array([_num(r.get("ri_median_ci_high")) for r in adapted])
            err = np.clip(np.nan_to_num(np.vstack([xs - lo, hi - xs])), 0, None)
            ax.errorbar(xs, ys + jitter, xerr=err, fmt="o", ms=3, capsize=2, color="tab:blue", label="run")
        else:
            ax.plot(xs, ys + jitter, "o", ms=3, color="tab:blue", alpha=0.7, label="run (seed, model)")
            per = {m: np.nanmean([x for r, x in zip(adapted, xs, strict=True) if r["method"] == m] or [np.nan])
                   for m in methods}
            ax.plot([per[m] for m in methods], range(len(methods)), "D", color="black", ms=5, label="method mean")
        base = _num(frozen.get(key))
        if not np.isnan(base):
            ax.axvline(base, color="grey", ls="--", lw=1, label="frozen encoder")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(methods)), methods)
    axes[0].axvline(0.5, color="tab:red", lw=0.8, alpha=0.5)  # RI's neutral point
    axes[2].axvline(0.0, color="tab:red", lw=0.8, alpha=0.5)  # APD: no drop
    handles, labels = axes[0].get_legend_handles_labels()  # the first panel draws every kind of mark
    legend_outside(axes[2], handles=handles, labels=labels, fontsize=8)
    fig.suptitle("Site robustness of the representations (croma; internal test images, site as confounder)",
                 fontsize=10)
    save_figure(fig, path)

