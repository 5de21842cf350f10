"""Experiment 3, leave-one-site-out (FedStain's domain-generalisation protocol).

For each left-out client site the other four train; the left-out site's images are the test
cohort. Per site and method: the seeds' ensemble macro-F1 and balanced accuracy with 95 %
bootstrap intervals. The mean over sites resamples each site's images on its own and averages
the replicates, so its interval reflects every site's sampling error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from fedhisto.config.study import Config
from fedhisto.experiments.framework import ROOT, Experiment, Step, summary_dir, summary_files, warm
from fedhisto.experiments.layout import experiment_block, main_inputs, run_dir
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block
from fedhisto.infra.settings_base import Strict
from fedhisto.registries.method_registry import Method

STAGE = "experiments"
METRICS = ("macro_f1", "balanced_accuracy")


NAME = "leave_one_site_out"
ClientName = Literal["C1", "C2", "C3", "C4", "C5"]


class LeaveOneSiteOutConfig(Strict):
    """FedStain's domain-generalisation protocol: train on four clients, test on the fifth's images."""

    left_out: list[ClientName] = Field(default_factory=lambda: ["C1", "C2", "C3", "C4", "C5"], min_length=1)
    extra_methods: list[Method] = Field(default_factory=lambda: ["fedstain_code"],
                                     description="trained beside experiments.methods (FedStain's own protocol)")
    seeds: list[int] = Field(default_factory=lambda: [11], min_length=1)


def leave_one_site_out_methods(cfg: Config) -> list[str]:
    x = cfg.experiments
    return list(dict.fromkeys([*x.methods, *x.leave_one_site_out.extra_methods]))


def leave_one_site_out_runs(cfg: Config) -> list[tuple[str, str, int]]:
    x = cfg.experiments.leave_one_site_out
    return [(f"leave_one_site_out/{c}", m, s) for c in x.left_out for m in leave_one_site_out_methods(cfg)
            for s in x.seeds]


def leave_one_site_out_predictions(cfg: Config) -> list[tuple[str, str, int, str]]:
    """(left-out client, method, seed, predictions on the left-out site)."""
    return [(c.split("/")[1], m, s, f"{run_dir(cfg, c, 'predictions', m, s)}/external.csv")
            for c, m, s in leave_one_site_out_runs(cfg)]


def _summarise(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.leave_one_site_out:summarise_leave_one_site_out",
         [tuple(r) for r in smk.params.runs], cfg, summary_dir(smk))


class LeaveOneSiteOut(Experiment):
    name = NAME
    settings = LeaveOneSiteOutConfig

    def conditions(self, cfg: Config) -> list[str]:
        return [f"leave_one_site_out/{c}" for c in cfg.experiments.leave_one_site_out.left_out]

    def condition_inputs(self, cfg: Config, condition: str) -> dict[str, str | list[str]]:
        # own stain descriptors: four clients whose standardisation and centroid must not see the left-out site
        folder = f"{ROOT}/{condition}"
        return {**main_inputs(cfg), "manifest": f"{folder}/manifest/manifest.csv",
                "identity": f"{folder}/manifest/manifest.json", "descriptors": f"{folder}/stain/descriptors.json"}

    def manifest_inputs(self, cfg: Config, condition: str) -> dict[str, str]:
        return {"manifest": "results/manifest/manifest.csv", "identity": "results/manifest/manifest.json"}

    def build_manifest(self, cfg: Config, condition: str, smk) -> None:
        from fedhisto.experiments.conditions import leave_one_site_out_manifest

        leave_one_site_out_manifest(smk.input.manifest, smk.input.identity, condition.split("/")[1], cfg,
                                    Path(smk.output.manifest).parent)

    def steps(self, cfg: Config) -> list[Step]:
        runs = leave_one_site_out_predictions(cfg)
        return [Step("summarize_leave_one_site_out", summary_files(NAME), _summarise,
                     inputs={"predictions": [r[3] for r in runs]},
                     params={"runs": [list(r) for r in runs], "block": experiment_block(cfg, NAME)})]


# ------------------------------------------------------------------ analysis
def summarise_leave_one_site_out(runs: list[tuple[str, str, int, str]], cfg: Config, out_dir: str | Path) -> dict:
    """``runs``: (left-out client, method, seed, external-predictions CSV of that condition)."""
    import numpy as np

    from fedhisto.stats.ensemble_intervals import metric_replicates, summarise
    from fedhisto.stats.prediction_files import ensemble

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
    from fedhisto.infra.plotting import (  # plotting: only when drawing
        legend_outside,
        plot_bars_with_ci,
        plt,
        save_figure,
    )

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

