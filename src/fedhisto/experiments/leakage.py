"""Experiment 2, family-leakage inflation: internal test macro-F1 per split policy, leaky minus clean.

The policies' test sets are different images (each policy draws its own split), so the inflation
is a difference between independent samples: each test set is resampled on its own and the
replicates are subtracted. Inside the leaky split, the test images that have a family relative in
some client's data are scored apart from the rest: where the inflation comes from.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from fedhisto.config.study import Config
from fedhisto.experiments.framework import ROOT, Experiment, Step, summary_dir, summary_files, warm
from fedhisto.experiments.layout import experiment_block, main_inputs, run_dir
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block
from fedhisto.infra.settings_base import Strict
from fedhisto.registries.method_registry import Method

STAGE = "experiments"
LEAKY = "ignore_families"
METRICS = ("macro_f1", "balanced_accuracy")


NAME = "leakage"
FamilyPolicy = Literal["ignore_families", "representatives", "whole_families"]


class LeakageConfig(Strict):
    """The same methods and seeds on splits that ignore, thin or keep augmentation families."""

    policies: list[FamilyPolicy] = Field(
        default_factory=lambda: ["ignore_families", "representatives", "whole_families"], min_length=2)
    methods: list[Method] = Field(default_factory=lambda: ["fedavg_peft", "past_v2"], min_length=1)

    @model_validator(mode="after")
    def _has_leaky_and_clean(self) -> LeakageConfig:
        if "ignore_families" not in self.policies or len(self.policies) < 2:
            raise ValueError("experiments.leakage.policies needs 'ignore_families' and at least one clean policy")
        return self


def leakage_runs(cfg: Config) -> list[tuple[str, str, int]]:
    x = cfg.experiments
    return [(f"leakage/{p}", m, s) for p in x.leakage.policies for m in x.leakage.methods for s in x.seeds]


def leakage_manifest(cfg: Config, policy: str) -> str:
    return "results/manifest/manifest.csv" if policy == cfg.clearance.family_policy \
        else f"{ROOT}/leakage/{policy}/manifest/manifest.csv"


def leakage_predictions(cfg: Config) -> list[tuple[str, str, int, str]]:
    """(policy, method, seed, internal test predictions)."""
    return [(c.split("/")[1], m, s, f"{run_dir(cfg, c, 'predictions', m, s)}/test.csv")
            for c, m, s in leakage_runs(cfg)]


def _summarise(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.leakage:summarise_leakage", [tuple(r) for r in smk.params.runs],
         dict(smk.params.manifests), cfg, summary_dir(smk))


class Leakage(Experiment):
    name = NAME
    settings = LeakageConfig

    def is_main(self, cfg: Config, condition: str) -> bool:
        return condition == f"leakage/{cfg.clearance.family_policy}"

    def conditions(self, cfg: Config) -> list[str]:
        return [f"leakage/{p}" for p in cfg.experiments.leakage.policies if not self.is_main(cfg, f"leakage/{p}")]

    def condition_inputs(self, cfg: Config, condition: str) -> dict[str, str | list[str]]:
        # its own stain descriptors: the pools differ
        folder = f"{ROOT}/{condition}"
        return {**main_inputs(cfg), "manifest": f"{folder}/manifest/manifest.csv",
                "identity": f"{folder}/manifest/manifest.json", "descriptors": f"{folder}/stain/descriptors.json"}

    def manifest_inputs(self, cfg: Config, condition: str) -> dict[str, str]:
        return {"sources": "results/cohort/sources.csv", "families": "results/clearance/families.csv",
                "edges": "results/clearance/edges.csv"}

    def build_manifest(self, cfg: Config, condition: str, smk) -> None:
        from fedhisto.experiments.conditions import policy_manifest

        policy_manifest(smk.input.sources, smk.input.families, smk.input.edges, cfg, condition.split("/")[1],
                        Path(smk.output.manifest).parent)

    def steps(self, cfg: Config) -> list[Step]:
        runs, policies = leakage_predictions(cfg), cfg.experiments.leakage.policies
        return [Step("summarize_leakage", summary_files(NAME), _summarise,
                     inputs={"manifests": [leakage_manifest(cfg, p) for p in policies], "predictions": [r[3] for r in runs]},
                     params={"runs": [list(r) for r in runs], "manifests": {p: leakage_manifest(cfg, p) for p in policies},
                             "block": experiment_block(cfg, NAME)})]


# ------------------------------------------------------------------ analysis
def relatives_in_training(manifest_csv: str | Path) -> set[str]:
    """Test images whose augmentation family also has a member in a client's optimisation or holdout set."""
    with Path(manifest_csv).open() as fh:
        rows = list(csv.DictReader(fh))
    client_families = {r["family"] for r in rows if r["split"] in ("optimisation", "holdout")}
    return {r["sample_id"] for r in rows if r["split"] == "test" and r["family"] in client_families}


def summarise_leakage(runs: list[tuple[str, str, int, str]], manifests: dict[str, str], cfg: Config,
                      out_dir: str | Path) -> dict:
    """``runs``: (policy, method, seed, test-predictions CSV); ``manifests``: policy -> manifest.csv."""
    import numpy as np

    from fedhisto.stats.ensemble_intervals import difference, metric_replicates, summarise
    from fedhisto.stats.prediction_files import ensemble

    x = cfg.experiments
    policies, methods = list(x.leakage.policies), list(x.leakage.methods)
    rows, inflation, subsets = [], [], []
    reps: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for k, policy in enumerate(policies):
        leaked = relatives_in_training(manifests[policy])
        for method in methods:
            paths = [p for pol, m, _s, p in runs if pol == policy and m == method]
            if not paths:
                raise ValueError(f"no predictions of {method} for policy {policy}")
            ids, y, probs = ensemble(paths)
            reps[(policy, method)] = metric_replicates(y, probs, x.resamples, x.bootstrap_seed + 1009 * k)
            rows.append({"policy": policy, "method": method, "seeds": len(paths), "test_images": len(ids),
                         "test_images_with_relative_in_training": sum(i in leaked for i in ids),
                         **summarise(reps[(policy, method)], METRICS)})
            if policy == LEAKY:
                mask = np.array([i in leaked for i in ids])
                for name, sel in (("relative_in_training", mask), ("no_relative", ~mask)):
                    if sel.any():
                        r = metric_replicates(y[sel], probs[sel], x.resamples, x.bootstrap_seed)
                        subsets.append({"policy": policy, "method": method, "subset": name, "images": int(sel.sum()),
                                        **summarise(r, METRICS)})
    for method in methods:
        for clean in (p for p in policies if p != LEAKY):
            d = difference(reps[(LEAKY, method)]["macro_f1"], reps[(clean, method)]["macro_f1"])
            inflation.append({"method": method, "leaky": LEAKY, "clean": clean, "metric": "macro_f1", **d})
    out = Path(out_dir)
    write_csv(out / "leakage.csv", rows, list(rows[0]))
    write_csv(out / "inflation.csv", inflation, list(inflation[0]))
    write_csv(out / "leaky_subsets.csv", subsets, list(subsets[0]) if subsets else ["policy"])
    _figure(rows, inflation, policies, methods, out / "leakage.png")
    summary = {"design": x.leakage.model_dump(mode="json"), "seeds": list(x.seeds), "resamples": x.resamples,
               "per_policy": rows, "inflation": inflation, "leaky_subsets": subsets,
               "provenance": provenance_block(STAGE, {"experiment": "leakage", **x.model_dump(mode="json")},
                                              {**{f"manifest_{p}": m for p, m in manifests.items()},
                                               **{f"run{i}": r[3] for i, r in enumerate(runs)}})}
    write_json(out / "leakage.json", summary)
    return summary


def _figure(rows: list[dict], inflation: list[dict], policies: list[str], methods: list[str], path: Path) -> None:
    from fedhisto.infra.plotting import (  # plotting: only when drawing
        legend_outside,
        plot_bars_with_ci,
        plt,
        save_figure,
    )

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12.5, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        sel = [next(r for r in rows if r["policy"] == p and r["method"] == method) for p in policies]
        plot_bars_with_ci(ax, policies, [r["macro_f1"] for r in sel], [r["macro_f1_ci_low"] for r in sel],
                          [r["macro_f1_ci_high"] for r in sel], label=method, offset=(j - (len(methods) - 1) / 2) * width,
                          width=width)
    ax.set_ylabel("internal test macro-F1 (ensemble, 95 % CI)")
    ax.set_title("test macro-F1 per split policy")
    legend_outside(ax)
    labels = [f"{r['method']}\nleaky - {r['clean']}" for r in inflation]
    plot_bars_with_ci(bx, labels, [r["estimate"] for r in inflation], [r["ci_low"] for r in inflation],
                      [r["ci_high"] for r in inflation], color="tab:red")
    bx.axhline(0.0, color="grey", lw=0.8)
    bx.set_ylabel("inflation of macro-F1 (95 % CI)")
    bx.set_title("leaky minus clean")
    bx.tick_params(axis="x", labelsize=7)
    save_figure(fig, path)

