"""Experiment 3, leave-one-site-out (FedStain's domain-generalisation protocol).

For each left-out client site the other four train; the left-out site's images are the test
cohort. Per site and method: the seeds' ensemble macro-F1 and balanced accuracy with 95 %
bootstrap intervals. The mean over sites resamples each site's images on its own and averages
the replicates, so its interval reflects every site's sampling error.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedhisto.config.study import Config
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.plotting import legend_outside, plot_bars_with_ci, save_figure
from fedhisto.infra.provenance import provenance_block
from fedhisto.stats.ensemble_intervals import metric_replicates, summarise
from fedhisto.stats.prediction_files import ensemble

STAGE = "experiments"
METRICS = ("macro_f1", "balanced_accuracy")


def summarise_leave_one_site_out(runs: list[tuple[str, str, int, str]], cfg: Config, out_dir: str | Path) -> dict:
    """``runs``: (left-out client, method, seed, external-predictions CSV of that condition)."""
    x = cfg.experiments
    sites = list(x.leave_one_site_out.left_out)
    methods = list(dict.fromkeys(m for _c, m, _s, _p in runs))
    rows, means = [], []
    for method in methods:
        per_site = {}
        for k, site in enumerate(sites):
            paths = [p for c, m, _s, p in runs if c == site and m == method]
            if not paths:
                raise ValueError(f"no predictions of {method} for site {site}")
            ids, y, probs = ensemble(paths)
            per_site[site] = metric_replicates(y, probs, x.resamples, x.bootstrap_seed + 1009 * k)
            rows.append({"left_out": site, "method": method, "seeds": len(paths), "images": len(ids),
                         "classes_present": len(np.unique(y)), **summarise(per_site[site], METRICS)})
        mean = {name: np.mean([per_site[s][name] for s in sites], axis=0) for name in METRICS}
        means.append({"left_out": "mean", "method": method, "sites": len(sites), **summarise(mean, METRICS)})
    out = Path(out_dir)
    table = rows + means
    write_csv(out / "leave_one_site_out.csv", table, list(dict.fromkeys(k for r in table for k in r)))
    _figure(rows, means, sites, methods, out / "leave_one_site_out.png")
    summary = {"design": x.leave_one_site_out.model_dump(mode="json"), "methods": methods, "resamples": x.resamples,
               "per_site": rows, "mean_over_sites": means,
               "provenance": provenance_block(STAGE, {"experiment": "leave_one_site_out", **x.model_dump(mode="json")},
                                              {f"run{i}": r[3] for i, r in enumerate(runs)})}
    write_json(out / "leave_one_site_out.json", summary)
    return summary


def _figure(rows: list[dict], means: list[dict], sites: list[str], methods: list[str], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(2.0 + 1.5 * (len(sites) + 1) + 2.5, 4.6))
    groups = [*sites, "mean"]
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        sel = [next(r for r in rows + means if r["left_out"] == g and r["method"] == method) for g in groups]
        plot_bars_with_ci(ax, [f"{g} left out" if g != "mean" else "mean over sites" for g in groups],
                          [r["macro_f1"] for r in sel], [r["macro_f1_ci_low"] for r in sel],
                          [r["macro_f1_ci_high"] for r in sel], label=method,
                          offset=(j - (len(methods) - 1) / 2) * width, width=width)
    ax.set_ylabel("left-out site macro-F1 (ensemble, 95 % CI)")
    ax.set_title("leave-one-site-out: train on four clients, test on the fifth site")
    legend_outside(ax)
    save_figure(fig, path)

