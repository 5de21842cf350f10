"""Stage ``metrics``: per-run, client-level, cross-seed, ensemble and subgroup tables.

- internal (global test, client holdouts): finalised seeds only; a failed seed is listed, never
  imputed; cross-seed mean and sample SD;
- client level: per-client holdout metrics where classes allow, worst-client macro-F1 and the
  across-client SD per run;
- external: every eligible checkpoint (a failed report with a usable checkpoint included) and
  the method-level ensemble (image-wise mean probability, aligned by sample id);
- subgroups of the external cohort (differentiation, magnification): descriptive only.

A method that keeps one model per client (``local_only``) is scored per model and reported as the
mean over its models (``evaluation.mean_over_models``), per run and per seed-ensemble.

Site robustness (rule ``summarize_robustness``): :func:`run_robustness`, croma's RI and APD of every run's
representation (:mod:`fedhisto.metrics.robustness`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from fedhisto import CLASSES
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.metrics.robustness import run_robustness  # noqa: F401  (rule summarize_robustness calls it here)
from fedhisto.stats.prediction_files import MEMBER_COLUMN, SINGLE, arrays, ensemble_members, read_rows
from fedhisto.stats.scores import classification_metrics, mean_over_models

STAGE = "metrics"
SCALARS = ("accuracy", "balanced_accuracy", "macro_f1", "macro_auroc", "macro_auprc", "nll", "brier", "ece")


def _rows(path: Path) -> list[dict]:
    """Rows of the first model (the metadata columns are the same for every model)."""
    return next(iter(read_rows(path).values()), [])


def _metrics_of(rows: list[dict], bins: int) -> dict:
    """Metrics of prediction rows; rows of several models (``local_only``) are scored per model and averaged."""
    by_model = defaultdict(list)
    for r in rows:
        by_model[r.get(MEMBER_COLUMN) or SINGLE].append(r)
    return mean_over_models([classification_metrics(p, y, bins) for _, y, p in map(arrays, by_model.values())])


def _file_metrics(path: Path, bins: int) -> dict:
    return _metrics_of([r for rows in read_rows(path).values() for r in rows], bins)


def _flat(m: dict) -> dict:
    out = {k: (round(m[k], 6) if m[k] is not None else "") for k in SCALARS}
    for c in CLASSES:
        pc = m["per_class"][c]
        out[f"recall_{c}"] = "absent" if pc["absent"] else round(pc["recall"], 6)
    return out


def unavailable_client_rounds(train_dir: str | Path | None) -> int:
    """Tolerated (declared) client unavailabilities of a run, from its status.json."""
    if train_dir is None or not (Path(train_dir) / "status.json").exists():
        return 0
    return int(json.loads((Path(train_dir) / "status.json").read_text()).get("unavailable_client_rounds", 0))


def privacy_epsilon(train_dir: str | Path | None) -> tuple[float, float] | None:
    """A DP run's (largest per-site epsilon, delta) from its status.json; None for a non-private run."""
    if train_dir is None or not (Path(train_dir) / "status.json").exists():
        return None
    dp = json.loads((Path(train_dir) / "status.json").read_text()).get("privacy")
    return (float(dp["epsilon_max"]), float(dp["delta"])) if dp else None


def run_metrics(runs: list[tuple], cfg: Config, out_dir: str | Path) -> dict:
    """``runs``: (method, seed, predictions folder[, training folder]) for every trained run; the training
    folder's status.json gives the run's tolerated unavailable client-rounds."""
    out = Path(out_dir)
    bins = cfg.evaluate.ece_bins
    per_run, clients_tbl, doc = [], [], defaultdict(dict)
    finalised: dict[str, list[int]] = defaultdict(list)
    failed: dict[str, list[int]] = defaultdict(list)
    unavailable: dict[str, int] = defaultdict(int)
    epsilons: dict[str, list[tuple[float, float]]] = defaultdict(list)  # DP runs only (train.private)
    for method, seed, folder, *train_dir in runs:
        folder = Path(folder)
        test = _rows(folder / "test.csv")
        status = test[0]["run_status"] if test else "failed"
        (finalised if status == "finalised" else failed)[method].append(seed)
        missed = unavailable_client_rounds(train_dir[0] if train_dir else None)
        unavailable[method] += missed
        entry = {"status": status, "unavailable_client_rounds": missed}
        dp = privacy_epsilon(train_dir[0] if train_dir else None)
        if dp is not None:
            epsilons[method].append(dp)
            entry["epsilon"], entry["delta"] = dp
        for cohort in ("test", "external"):
            if cohort == "test" and status != "finalised":
                continue  # internal scores of a failed run are not reported, never imputed
            m = _file_metrics(folder / f"{cohort}.csv", bins)
            entry[cohort] = m
            per_run.append({"method": method, "seed": seed, "cohort": cohort, "status": status,
                            "unavailable_client_rounds": missed, **_flat(m)})
        if status == "finalised":
            by_client = defaultdict(list)
            for rows in read_rows(folder / "holdout.csv").values():
                for r in rows:
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
               "failed_seeds": " ".join(map(str, failed[method])),
               "unavailable_client_rounds": unavailable[method]}
        for k in ("macro_f1", "balanced_accuracy", "accuracy", "macro_auroc", "ece"):
            vals = [e["test"][k] for e in ok if e["test"][k] is not None]
            row[f"test_{k}_mean"] = round(float(np.mean(vals)), 6) if vals else ""
            row[f"test_{k}_sd"] = round(float(np.std(vals, ddof=1)), 6) if len(vals) > 1 else ""
        worst = [e["clients"]["worst"] for e in ok]
        row["worst_client_macro_f1_mean"] = round(float(np.mean(worst)), 6) if worst else ""
        row["worst_client_macro_f1_sd"] = round(float(np.std(worst, ddof=1)), 6) if len(worst) > 1 else ""
        if epsilons[method]:  # the worst seed's largest per-site epsilon: what the method's runs guarantee
            row["epsilon_max"] = max(e for e, _ in epsilons[method])
            row["delta"] = max(d for _, d in epsilons[method])
        summary.append(row)
    ens_rows, subgroup_rows = [], []
    ensembles = {}
    for method in doc:
        files = [Path(f) / "external.csv" for m, _, f, *_ in runs if m == method]
        members = ensemble_members(files)
        ids, y, _ = next(iter(members.values()))
        m = mean_over_models([classification_metrics(p, y, bins) for _, _, p in members.values()])
        ensembles[method] = m
        ens_rows.append({"method": method, "checkpoints": len(files), **_flat(m)})
        meta = {r["sample_id"]: r for r in _rows(files[0])}
        for key in ("differentiation", "magnification"):
            groups = defaultdict(list)
            for i, sid in enumerate(ids):
                groups[(meta[sid][key] or "n/a", CLASSES[y[i]])].append(i)
            for (value, cls), idx in sorted(groups.items()):
                acc = np.mean([(p[idx].argmax(1) == y[idx]).mean() for _, _, p in members.values()])
                subgroup_rows.append({"method": method, "variable": key, "value": value, "class": cls, "n": len(idx),
                                      "accuracy": round(float(acc), 6)})
    write_csv(out / "per_run.csv", per_run)
    write_csv(out / "summary.csv", summary)
    write_csv(out / "client_level.csv", clients_tbl)
    write_csv(out / "ensembles.csv", ens_rows)
    write_csv(out / "subgroups.csv", subgroup_rows)
    prov = provenance_block(STAGE, stage_block(cfg, STAGE),
                            {f"{m}/seed{s}/{c}": Path(f) / f"{c}.csv" for m, s, f, *_ in runs
                             for c in ("test", "holdout", "external")})
    payload = {"runs": doc, "ensembles": ensembles, "summary": summary, "provenance": prov}
    write_json(out / "metrics.json", json.loads(json.dumps(payload, default=float)))
    for name in ("per_run.csv", "summary.csv", "client_level.csv", "ensembles.csv", "subgroups.csv"):
        write_sidecar(out / name, prov)
    return payload
