"""Stage ``metrics``: per-run, client-level, cross-seed, ensemble and subgroup tables.

- internal (global test, client holdouts): finalised seeds only; a failed seed is listed, never
  imputed; cross-seed mean and sample SD;
- client level: per-client holdout metrics where classes allow, worst-client macro-F1 and the
  across-client SD per run;
- external: every eligible checkpoint (a failed report with a usable checkpoint included) and
  the method-level ensemble (image-wise mean probability, aligned by sample id);
- subgroups of the external cohort (differentiation, magnification): descriptive only.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from fedhisto import CLASSES
from fedhisto.atomic import write_csv, write_json
from fedhisto.bootstrap import ensemble
from fedhisto.config import Config
from fedhisto.evaluation import classification_metrics
from fedhisto.provenance import provenance_block, write_sidecar

STAGE = "metrics"
SCALARS = ("accuracy", "balanced_accuracy", "macro_f1", "macro_auroc", "macro_auprc", "nll", "brier", "ece")


def _rows(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def _metrics_of(rows: list[dict], bins: int) -> dict:
    y = np.array([CLASSES.index(r["label"]) for r in rows])
    p = np.array([[float(r[f"p_{c}"]) for c in CLASSES] for r in rows])
    return classification_metrics(p, y, bins)


def _flat(m: dict) -> dict:
    out = {k: (round(m[k], 6) if m[k] is not None else "") for k in SCALARS}
    for c in CLASSES:
        pc = m["per_class"][c]
        out[f"recall_{c}"] = "absent" if pc["absent"] else round(pc["recall"], 6)
    return out


def run_metrics(runs: list[tuple[str, int, str]], cfg: Config, out_dir: str | Path) -> dict:
    """``runs``: (method, seed, predictions folder) for every trained run."""
    out = Path(out_dir)
    bins = cfg.evaluate.ece_bins
    per_run, clients_tbl, doc = [], [], defaultdict(dict)
    finalised: dict[str, list[int]] = defaultdict(list)
    failed: dict[str, list[int]] = defaultdict(list)
    for method, seed, folder in runs:
        folder = Path(folder)
        test = _rows(folder / "test.csv")
        status = test[0]["run_status"] if test else "failed"
        (finalised if status == "finalised" else failed)[method].append(seed)
        entry = {"status": status}
        for cohort in ("test", "external"):
            if cohort == "test" and status != "finalised":
                continue  # internal scores of a failed run are not reported, never imputed
            m = _metrics_of(_rows(folder / f"{cohort}.csv"), bins)
            entry[cohort] = m
            per_run.append({"method": method, "seed": seed, "cohort": cohort, "status": status, **_flat(m)})
        if status == "finalised":
            by_client = defaultdict(list)
            for r in _rows(folder / "holdout.csv"):
                by_client[r["client"]].append(r)
            f1s = {}
            for client, rows in sorted(by_client.items()):
                m = _metrics_of(rows, bins)
                f1s[client] = m["macro_f1"]
                clients_tbl.append({"method": method, "seed": seed, "client": client, "n": m["n"],
                                    "absent_classes": " ".join(m["absent_classes"]), **_flat(m)})
            entry["clients"] = {"macro_f1": f1s, "worst": min(f1s.values()),
                                "sd": float(np.std(list(f1s.values()), ddof=1)) if len(f1s) > 1 else 0.0}
        doc[method][seed] = entry
    summary = []
    for method in doc:
        ok = [doc[method][s] for s in finalised[method]]
        row = {"method": method, "finalised_seeds": " ".join(map(str, finalised[method])),
               "failed_seeds": " ".join(map(str, failed[method]))}
        for k in ("macro_f1", "balanced_accuracy", "accuracy", "macro_auroc", "ece"):
            vals = [e["test"][k] for e in ok if e["test"][k] is not None]
            row[f"test_{k}_mean"] = round(float(np.mean(vals)), 6) if vals else ""
            row[f"test_{k}_sd"] = round(float(np.std(vals, ddof=1)), 6) if len(vals) > 1 else ""
        worst = [e["clients"]["worst"] for e in ok]
        row["worst_client_macro_f1_mean"] = round(float(np.mean(worst)), 6) if worst else ""
        row["worst_client_macro_f1_sd"] = round(float(np.std(worst, ddof=1)), 6) if len(worst) > 1 else ""
        summary.append(row)
    ens_rows, subgroup_rows = [], []
    ensembles = {}
    for method in doc:
        files = [Path(f) / "external.csv" for m, _, f in runs if m == method]
        ids, y, p = ensemble(files)
        m = classification_metrics(p, y, bins)
        ensembles[method] = m
        ens_rows.append({"method": method, "checkpoints": len(files), **_flat(m)})
        meta = {r["sample_id"]: r for r in _rows(files[0])}
        for key in ("differentiation", "magnification"):
            groups = defaultdict(list)
            for i, sid in enumerate(ids):
                groups[(meta[sid][key] or "n/a", CLASSES[y[i]])].append(i)
            for (value, cls), idx in sorted(groups.items()):
                subgroup_rows.append({"method": method, "variable": key, "value": value, "class": cls, "n": len(idx),
                                      "accuracy": round(float((p[idx].argmax(1) == y[idx]).mean()), 6)})
    write_csv(out / "per_run.csv", per_run)
    write_csv(out / "summary.csv", summary)
    write_csv(out / "client_level.csv", clients_tbl)
    write_csv(out / "ensembles.csv", ens_rows)
    write_csv(out / "subgroups.csv", subgroup_rows)
    prov = provenance_block(STAGE, cfg.evaluate.model_dump(mode="json"),
                            {f"{m}/seed{s}/{c}": Path(f) / f"{c}.csv" for m, s, f in runs
                             for c in ("test", "holdout", "external")})
    payload = {"runs": doc, "ensembles": ensembles, "summary": summary, "provenance": prov}
    write_json(out / "metrics.json", json.loads(json.dumps(payload, default=float)))
    for name in ("per_run.csv", "summary.csv", "client_level.csv", "ensembles.csv", "subgroups.csv"):
        write_sidecar(out / name, prov)
    return payload
