"""Stage ``report``: tables mirroring the study's Tables 4 to 8 and the figures.

Tables (CSV and Markdown) under ``results/tables/``; figures (PNG) under ``results/figures/``.
``snakemake --report report.html`` bundles them with captions (workflow/report/).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import itertools

import matplotlib.pyplot as plt
import numpy as np

from fedhisto import CLASSES
from fedhisto.atomic import write_csv, write_text, write_with
from fedhisto.bootstrap import ensemble
from fedhisto.provenance import provenance_block, write_sidecar
from fedhisto.targets import write_table2

STAGE = "report"


def _fmt(v) -> str:
    return f"{v:.6f}" if isinstance(v, float) else ("" if v is None else str(v))


def write_table(base: Path, rows: list[dict], title: str, notes: list[str] = ()) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    write_csv(base.with_suffix(".csv"), [{k: _fmt(r.get(k)) for k in cols} for r in rows], cols)
    md = [f"# {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_fmt(r.get(k)) for k in cols) + " |" for r in rows]
    md += ["", *(f"Note: {n}" for n in notes)] if notes else []
    write_text(base.with_suffix(".md"), "\n".join(md) + "\n")


def unavailability_notes(summary: list[dict], methods: set[str]) -> list[str]:
    """A footnote per method whose runs tolerated declared client unavailabilities (train loop)."""
    return [f"{r['method']}: {r['unavailable_client_rounds']} client-round(s) unavailable across its runs "
            "(aggregated without them; train.max_unavailable_client_rounds bounds this per run)"
            for r in summary if r["method"] in methods and int(r.get("unavailable_client_rounds") or 0) > 0]


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)


def run_report(metrics_json: str | Path, bootstrap_jsons: list[str | Path], communication_csv: str | Path,
               external_predictions: dict[str, list[str]], tables_dir: str | Path, figures_dir: str | Path,
               manifest_dir: str | Path | None = None) -> None:
    m = json.loads(Path(metrics_json).read_text())
    tables, figures = Path(tables_dir), Path(figures_dir)
    if manifest_dir is not None:  # Table 2 as built beside the study's, with the scaling line (fedhisto.targets)
        write_table2(Path(manifest_dir) / "composition.csv", Path(manifest_dir) / "manifest.json", tables)
    methods = list(m["ensembles"])
    t4 = []
    for row in m["summary"]:
        t4.append({"method": row["method"], "finalised_seeds": row["finalised_seeds"],
                   "failed_seeds": row["failed_seeds"], "macro_f1_mean": row["test_macro_f1_mean"],
                   "macro_f1_sd": row["test_macro_f1_sd"], "balanced_accuracy_mean": row["test_balanced_accuracy_mean"],
                   "accuracy_mean": row["test_accuracy_mean"], "macro_auroc_mean": row["test_macro_auroc_mean"],
                   "ece_mean": row["test_ece_mean"], "worst_client_macro_f1_mean": row["worst_client_macro_f1_mean"],
                   "worst_client_macro_f1_sd": row["worst_client_macro_f1_sd"],
                   "unavailable_client_rounds": row.get("unavailable_client_rounds", 0)})
    write_table(tables / "table4_internal", t4, "Table 4: internal global test (finalised seeds, mean and sample SD)")
    missed = {r["method"]: r.get("unavailable_client_rounds", 0) for r in m["summary"]}
    t5 = []
    for method, e in m["ensembles"].items():
        t5.append({"method": method, "macro_f1": e["macro_f1"], "balanced_accuracy": e["balanced_accuracy"],
                   "accuracy": e["accuracy"], **{f"recall_{c}": e["per_class"][c]["recall"] for c in CLASSES},
                   "nll": e["nll"], "brier": e["brier"], "ece": e["ece"],
                   "unavailable_client_rounds": missed.get(method, 0)})
    write_table(tables / "table5_external", t5, "Table 5: external cohort, method-level ensembles")
    boots = [json.loads(Path(p).read_text()) for p in bootstrap_jsons]
    for path, b in zip(bootstrap_jsons, boots, strict=True):
        if "ablation" not in b:
            raise ValueError(f"{path}: no 'ablation' flag (written before matched-seed ablations); rerun its bootstrap")
    # the comparison's own flag (bootstrap.comparisons.<name>.ablation) splits Tables 6 and 7, not its name
    for ablation, name, title in ((False, "table6_bootstrap", "Table 6: paired bootstrap, principal comparisons"),
                                  (True, "table7_ablation", "Table 7: paired bootstrap, component ablations "
                                                            "(both ensembles on the matched ablation seeds)")):
        rows = []
        for b in (b for b in boots if b["ablation"] == ablation):
            seeds = {f"{role}_seeds": " ".join(map(str, b["ensemble"][f"{role}_seeds"])) for role in ("method", "reference")}
            for metric, v in b["metrics"].items():
                # no replicate crossed 0: p is an upper bound, printed as the study does ("< 0.0002")
                p_text = f"< {v['p_two_sided']:g}" if v["p_is_upper_bound"] else v["p_two_sided"]
                rows.append({"comparison": b["comparison"], **seeds, "metric": metric, "method": v["method"],
                             "reference": v["reference"], "difference": v["difference"], "ci_low": v["ci_low"],
                             "ci_high": v["ci_high"], "p_two_sided": p_text,
                             "p_delta_positive": v["p_delta_positive"], "n_resamples": v["n_resamples"]})
        involved = {x for b in boots if b["ablation"] == ablation for x in (b["method"], b["reference"])}
        write_table(tables / name, rows, title, unavailability_notes(m["summary"], involved))
    with Path(communication_csv).open() as fh:
        write_table(tables / "table8_communication", list(csv.DictReader(fh)), "Table 8: parameters and communication")

    x = np.arange(len(methods))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(x - 0.2, [m["ensembles"][k]["macro_f1"] for k in methods], 0.4, label="macro-F1")
    ax.bar(x + 0.2, [m["ensembles"][k]["balanced_accuracy"] for k in methods], 0.4, label="balanced accuracy")
    ax.set_xticks(x, methods, rotation=30, ha="right")
    ax.set_ylim(0, 1)
    ax.set_title("External cohort: method-level ensembles")
    ax.legend()
    _save(fig, figures / "ensemble_macro_f1.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for k, c in enumerate(CLASSES):
        ax.bar(x + (k - 1) * 0.27, [m["ensembles"][n]["per_class"][c]["recall"] or 0 for n in methods], 0.27, label=c)
    ax.set_xticks(x, methods, rotation=30, ha="right")
    ax.set_ylim(0, 1)
    ax.set_title("External cohort: class-wise recall")
    ax.legend()
    _save(fig, figures / "class_recall.png")

    focus = "past_v2" if "past_v2" in methods else methods[-1]
    cm = np.array(m["ensembles"][focus]["confusion"])
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
    _save(fig, figures / "confusion_v2.png")

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
    _save(fig, figures / "ablation_forest.png")

    fig, ax = plt.subplots(figsize=(4.5, 4))
    edges = np.linspace(0, 1, 16)
    for method in (k for k in ("fedavg_peft", focus) if k in external_predictions):
        _, y, p = ensemble(external_predictions[method])
        conf, correct = p.max(1), p.argmax(1) == y
        centres, accs = [], []
        for lo, hi in itertools.pairwise(edges):
            sel = (conf > lo) & (conf <= hi)
            if sel.any():
                centres.append(conf[sel].mean())
                accs.append(correct[sel].mean())
        ax.plot(centres, accs, "o-", label=method)
    ax.plot([0, 1], [0, 1], "--", color="grey")
    ax.set_xlabel("confidence (top-1)")
    ax.set_ylabel("accuracy")
    ax.set_title("Reliability, external ensembles (15 bins)")
    ax.legend()
    _save(fig, figures / "reliability.png")
    prov = provenance_block(STAGE, {"tables": "4-8", "figures": 5},
                            {"metrics": metrics_json, "communication": communication_csv,
                             **{Path(p).name: p for p in bootstrap_jsons}})
    for path in [*sorted(tables.glob("table*")), *sorted(figures.glob("*.png"))]:
        if not path.name.endswith(".prov.json"):
            write_sidecar(path, prov)
