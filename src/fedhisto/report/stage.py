"""Stage ``report``: tables mirroring the study's Tables 4 to 8 and the figures.

Tables (CSV and Markdown) under ``results/tables/``; figures (PNG) under ``results/figures/``.
``snakemake --report report.html`` bundles them with captions (workflow/report/). The figures
(``fedhisto.report.figures``) carry image-level bootstrap 95 % CIs on every estimate.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from fedhisto import CLASSES
from fedhisto.config.study import BootstrapConfig, Config
from fedhisto.infra.atomic import write_csv, write_text
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.manifest.targets import write_table2
from fedhisto.metrics.robustness_reading import read_robustness_csv
from fedhisto.report.figures import write_figures
from fedhisto.report.robustness_view import robustness_figure, robustness_table
from fedhisto.stats.prediction_files import MEMBER_COLUMN, read_predictions

STAGE = "report"
FIGURE_BOOTSTRAP_DEFAULTS = BootstrapConfig().model_dump(include={"seed", "resamples", "confidence"})


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


def model_notes(external_predictions: dict[str, list[str]]) -> list[str]:
    """A footnote per method that keeps one model per site (local_only, fedsa_lora): how its rows are
    scored, read from its own prediction files (the ``model`` column), so the tables say which rule."""
    notes = []
    for method, files in external_predictions.items():
        if not files:
            continue
        models = sorted(read_predictions(files[0]))
        if len(models) < 2:
            continue
        holdout = Path(files[0]).with_name("holdout.csv")
        own = holdout.exists() and all(r[MEMBER_COLUMN] == r["client"] for r in read_rows_flat(holdout))
        notes.append(f"{method}: {len(models)} models per run, one per site ({', '.join(models)}); its test and "
                     "external scores are the mean over the site models (Table 5: each site model's cross-seed "
                     "ensemble, then the mean); its worst-client column scores each site's holdout with "
                     + ("that site's own model only" if own else "every site's model"))
    return notes


def read_rows_flat(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def privacy_columns(summary_row: dict) -> dict:
    """Epsilon (the largest per-site value over the method's seeds) and delta, for DP runs only: the
    tables of non-private runs keep their columns."""
    return {k: summary_row[k] for k in ("epsilon_max", "delta") if k in summary_row}


def marked(row: dict, caveats: dict[str, list[str]], *methods: str) -> dict:
    """``row`` with a ``caveat`` column when one of ``methods`` departs from its paper's assumptions
    (:func:`fedhisto.caveats.method_caveats`); unmarked rows keep their columns."""
    lines = [line for m in dict.fromkeys(methods) for line in caveats.get(m, [])]
    return {**row, "caveat": "; ".join(lines)} if lines else row


def method_notes(caveats: dict[str, list[str]], methods) -> list[str]:
    """A CAVEAT note per departure of a method in the table."""
    return [f"CAVEAT: {line} (not a finding about the method as its paper runs it)"
            for m in sorted(set(methods)) for line in caveats.get(m, [])]


def run_report_of_config(cfg: Config, *args, **kwargs) -> None:
    """:func:`run_report` with the run's caveats read off its config (:mod:`fedhisto.caveats`)."""
    from fedhisto.caveats import method_caveats, run_caveats

    run_report(*args, caveats=run_caveats(cfg), method_caveats=method_caveats(cfg), **kwargs)


def run_report(metrics_json: str | Path, bootstrap_jsons: list[str | Path], communication_csv: str | Path,
               external_predictions: dict[str, list[str]], tables_dir: str | Path, figures_dir: str | Path,
               manifest_dir: str | Path | None = None, bootstrap: dict | None = None,
               caveats: list[str] = (), method_caveats: dict[str, list[str]] | None = None,
               robustness_csv: str | Path | None = None) -> None:
    """``bootstrap``: ``seed``, ``resamples``, ``confidence`` of the figures' intervals (the
    ``bootstrap`` config block; missing keys take its defaults). Tables do not depend on it.
    ``caveats``: :func:`fedhisto.caveats.run_caveats` of the run's config, printed as
    ``CAVEAT`` notes under Tables 4 and 5 (none on the synthetic cohort: those tables as before).
    ``method_caveats``: :func:`fedhisto.caveats.method_caveats`, each method's departures from its own
    paper's assumptions: a ``caveat`` column on every row of a marked method (and of every comparison
    with a marked arm) and a note under each table.
    ``robustness_csv``: the metrics stage's site-robustness rows: ``tables/robustness`` and
    ``figures/robustness.png`` (:mod:`fedhisto.report.robustness_view`)."""
    marks = method_caveats or {}
    warned = [f"CAVEAT: {c}" for c in caveats]
    per_site = model_notes(external_predictions)
    m = json.loads(Path(metrics_json).read_text())
    tables, figures = Path(tables_dir), Path(figures_dir)
    if manifest_dir is not None:  # Table 2 as built beside the study's, with the scaling line (fedhisto.manifest.targets)
        write_table2(Path(manifest_dir) / "composition.csv", Path(manifest_dir) / "manifest.json", tables)
    t4 = []
    for row in m["summary"]:
        t4.append({"method": row["method"], "finalised_seeds": row["finalised_seeds"],
                   "failed_seeds": row["failed_seeds"], "macro_f1_mean": row["test_macro_f1_mean"],
                   "macro_f1_sd": row["test_macro_f1_sd"], "balanced_accuracy_mean": row["test_balanced_accuracy_mean"],
                   "accuracy_mean": row["test_accuracy_mean"], "macro_auroc_mean": row["test_macro_auroc_mean"],
                   "ece_mean": row["test_ece_mean"], "worst_client_macro_f1_mean": row["worst_client_macro_f1_mean"],
                   "worst_client_macro_f1_sd": row["worst_client_macro_f1_sd"],
                   "unavailable_client_rounds": row.get("unavailable_client_rounds", 0),
                   **privacy_columns(row)})
    t4 = [marked(r, marks, r["method"]) for r in t4]
    write_table(tables / "table4_internal", t4, "Table 4: internal global test (finalised seeds, mean and sample SD)",
                [*warned, *per_site, *method_notes(marks, [r["method"] for r in t4])])
    missed = {r["method"]: r.get("unavailable_client_rounds", 0) for r in m["summary"]}
    dp = {r["method"]: privacy_columns(r) for r in m["summary"]}
    t5 = []
    for method, e in m["ensembles"].items():
        t5.append({"method": method, "macro_f1": e["macro_f1"], "balanced_accuracy": e["balanced_accuracy"],
                   "accuracy": e["accuracy"], **{f"recall_{c}": e["per_class"][c]["recall"] for c in CLASSES},
                   "nll": e["nll"], "brier": e["brier"], "ece": e["ece"],
                   "unavailable_client_rounds": missed.get(method, 0), **dp.get(method, {})})
    t5 = [marked(r, marks, r["method"]) for r in t5]
    write_table(tables / "table5_external", t5, "Table 5: external cohort, method-level ensembles",
                [*warned, *per_site, *method_notes(marks, [r["method"] for r in t5])])
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
            # one row per metric and resampling unit: images always; patients where the manifest names them
            units = [("image", b["metrics"])] + ([("patient", b["patient_level"]["metrics"])]
                                                 if b.get("patient_level") else [])
            for metric in b["metrics"]:
                for unit, metrics in units:
                    v = metrics[metric]
                    # no replicate crossed 0: p is an upper bound, printed as the study does ("< 0.0002")
                    p_text = f"< {v['p_two_sided']:g}" if v["p_is_upper_bound"] else v["p_two_sided"]
                    rows.append(marked({"comparison": b["comparison"], **seeds, "metric": metric, "unit": unit,
                                        "method": v["method"], "reference": v["reference"],
                                        "difference": v["difference"], "ci_low": v["ci_low"], "ci_high": v["ci_high"],
                                        "p_two_sided": p_text, "p_delta_positive": v["p_delta_positive"],
                                        "n_resamples": v["n_resamples"]},
                                       marks, b["method"], b["reference"]))
        involved = {x for b in boots if b["ablation"] == ablation for x in (b["method"], b["reference"])}
        write_table(tables / name, rows, title,
                    unavailability_notes(m["summary"], involved) + method_notes(marks, involved))
    with Path(communication_csv).open() as fh:
        t8 = [marked(r, marks, r["method"]) for r in csv.DictReader(fh)]
    write_table(tables / "table8_communication", t8, "Table 8: parameters and communication",
                method_notes(marks, [r["method"] for r in t8]))

    interval = {**FIGURE_BOOTSTRAP_DEFAULTS, **(bootstrap or {})}
    write_figures(m, boots, external_predictions, figures, **interval)
    prov = provenance_block(STAGE, {"tables": "4-8", "figures": 5},
                            {"metrics": metrics_json, "communication": communication_csv,
                             **{Path(p).name: p for p in bootstrap_jsons}})
    for path in sorted(tables.glob("table*")):
        if not path.name.endswith(".prov.json"):
            write_sidecar(path, prov)
    # the figures also depend on the external predictions and the interval settings: their own sidecar says so
    figure_prov = provenance_block(STAGE, {"figures": 5, "intervals": interval},
                                   {"metrics": metrics_json, **{Path(p).name: p for p in bootstrap_jsons},
                                    **{f"{k}/{i}": f for k, files in external_predictions.items()
                                       for i, f in enumerate(files)}})
    for path in sorted(figures.glob("*.png")):
        write_sidecar(path, figure_prov)
    if robustness_csv is not None:
        write_robustness(robustness_csv, tables, figures, interval["confidence"])


def write_robustness(robustness_csv: str | Path, tables: Path, figures: Path, confidence: float) -> None:
    """Site robustness: the table (per method over seeds) and the figure, each with its own sidecar."""
    rows = read_robustness_csv(robustness_csv)
    write_table(tables / "robustness", robustness_table(rows),
                "Site robustness (croma): RI and APD over seeds, adapted representations and the frozen encoder",
                ["RI: PathoROB's robustness index (1 biology only, 0 site only, 0.5 neutral); APD: average "
                 "performance drop of a class probe as class and site are coupled (0 none, -1 collapse); "
                 "per run and model in results/metrics/robustness.csv"])
    robustness_figure(rows, figures / "robustness.png", confidence)
    prov = provenance_block(STAGE, {"robustness": "table and figure", "confidence": confidence},
                            {"robustness": robustness_csv})
    for path in (tables / "robustness.csv", tables / "robustness.md", figures / "robustness.png"):
        write_sidecar(path, prov)
