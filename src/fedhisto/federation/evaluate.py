"""Federated evaluation: the test set, holdouts and the external cohort are scored at the sites that hold
them, and the coordinator's metrics, ensembles and bootstrap run on what comes back.

A site answers ``evaluate.split`` (one message per site, listing the splits it holds) with, per split
and member, either **per-image rows** (sample id, label, the three probabilities, and the manifest's
client / differentiation / magnification: what ``results/predictions`` holds centrally) or, where the
site has opted out of rows (its node config ``report = counts``; the site decides, not the
coordinator), **counts** only: the 3x3 confusion matrix, per bin of top-1 confidence (the package's
one binning, ``evaluation.confidence_bins``, ``evaluate.ece_bins`` bins) the count, the summed
confidence and the number correct, and the sums of the NLL and Brier terms.

At the coordinator (:func:`write_predictions`) a cohort whose every site returned rows becomes
``results/predictions/{method}/seed{seed}/{cohort}.csv`` in the central format, so the central
``metrics`` and ``bootstrap`` stages consume it unchanged. A cohort with a counts-only site gets
``counts.json`` instead, from which :func:`metrics_from_counts` computes accuracy, balanced accuracy,
macro-F1, per-class precision / recall / F1, NLL, Brier and ECE (equal to the per-image values up to
floating-point summation order) and refuses by name what counts cannot give: AUROC and AUPRC need
the ranking of the images, the seed ensemble the image-wise probabilities and the paired bootstrap
the images themselves (:func:`require_rows`). ``evaluation.json`` says which cohort rests on what.

The validation split for early stopping may also be spread over several sites
(``FederatedRun(eval_sites=[...])``): each returns its confusion matrix per member and the
coordinator takes the macro-F1 of their sum (``evaluation.macro_f1_from_confusion``, the one the
in-process engine applies to the whole validation split, so the number is the same).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from fedhisto import CLASSES
from fedhisto.federation.records import get_members, get_value, put_members, put_value
from fedhisto.infra.atomic import write_json
from fedhisto.infra.provenance import write_sidecar
from fedhisto.methods.base import GLOBAL
from fedhisto.stats.prediction_files import MEMBER_COLUMN
from fedhisto.stats.prediction_files import write_predictions as write_prediction_rows
from fedhisto.stats.scores import (
    N,
    class_scores,
    confidence_bins,
    confusion,
    macro_f1_from_confusion,
    mean_over_present,
)

SPLITS = ("validation", "test", "holdout", "external")
COHORT_OF = {"test": "test", "holdout": "holdout", "external": "external"}
REPORTS = ("rows", "counts")
NOT_FROM_COUNTS = ("macro_auroc", "macro_auprc")


class CountsOnly(RuntimeError):
    """Something needs per-image rows and a site returned counts only."""


@dataclass(frozen=True)
class EvalTarget:
    """One split a site holds (``holdout``: its own holdout; the others: every row of that split in
    its manifest)."""

    site: str
    split: str

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"site {self.site}: unknown evaluation split {self.split!r} (one of {', '.join(SPLITS)})")


# ------------------------------------------------------------------ the site's side
def counts_of(probs: np.ndarray, y: np.ndarray, bins: int) -> dict:
    """What a counts-only site returns for one member on one split (nothing per image)."""
    probs, y = np.asarray(probs, dtype=np.float64), np.asarray(y, dtype=int)
    conf, pred = probs.max(1), probs.argmax(1)
    correct = (pred == y).astype(float)
    p_true = np.clip(probs[np.arange(len(y)), y], 1e-12, 1.0)
    return {"n": len(y), "confusion": confusion(y, pred).tolist(),
            "bins": [[int(sel.sum()), float(conf[sel].sum()), float(correct[sel].sum())]
                     for _, _, sel in confidence_bins(conf, bins)],
            "nll_sum": float(-np.log(p_true).sum()), "brier_sum": float(((probs - np.eye(N)[y]) ** 2).sum())}


def site_evaluation(site, run: dict, content: RecordDict) -> RecordDict:
    """``evaluate.split`` at a site: every split of ``run['splits']`` under every member state."""
    from fedhisto.stats.temperature import apply_temperature
    from fedhisto.train.inference import predict

    members = get_members(content)
    temperatures = json.loads(str(run.get("temperatures", "{}")))
    report = site.report
    rd = RecordDict({"report": ConfigRecord({"report": report})})
    for split in json.loads(str(run["splits"])):
        data, meta = site.evaluation_split(split)
        descriptor = site.descriptors[site.sc.site] if split == "holdout" else site.descriptors[GLOBAL]
        probs = {}
        for name, state in members.items():
            site.model.load_trainable_state(state)
            p = predict(site.model, data, descriptor, site.cfg, site.device).numpy()
            probs[name] = apply_temperature(p, temperatures[name]) if name in temperatures else p
        if report == "rows":
            rd[f"rows:{split}"] = ConfigRecord({"ids": list(data.ids), "labels": [int(y) for y in data.labels],
                                                "meta": json.dumps(meta)})
            for name, p in probs.items():
                put_value(rd, f"probs:{split}:{name}", torch.from_numpy(np.ascontiguousarray(p)))
        else:
            y = np.asarray(data.labels, dtype=int)
            rd[f"counts:{split}"] = ConfigRecord({"json": json.dumps(
                {name: counts_of(p, y, site.cfg.evaluate.ece_bins) for name, p in probs.items()})})
    return rd


# ------------------------------------------------------------------ the coordinator's side
def request(fed, round_idx: int, members: dict, splits: list[str], site: str, temperatures: dict) -> RecordDict:
    rd = RecordDict({"run": fed._run_record(site, round_idx, splits=json.dumps(splits),
                                            temperatures=json.dumps(temperatures))})
    put_members(rd, members)
    return rd


def evaluate_sites(fed, ex, ckpt: dict, targets: list[EvalTarget], temperatures: dict | None = None) -> dict:
    """Send ``evaluate.split`` to every site of ``targets`` with the best member states; returns
    ``{site: reply}``. A site that does not answer or fails stops the evaluation naming it (the other
    sites' replies are kept in the returned error's ``replies``)."""
    by_site: dict[str, list[str]] = {}
    for t in targets:
        by_site.setdefault(t.site, []).append(t.split)
    members = ckpt["best"]["members"]
    contents = {s: request(fed, ckpt["round"], members, splits, s, temperatures or {}) for s, splits in by_site.items()}
    ok, lost = ex.send("evaluate.split", contents, ckpt["round"])
    failed = {s: str(rd["error"]["type"]) + ": " + str(rd["error"]["message"]) for s, rd in ok.items() if "error" in rd}
    failed.update(lost)
    if failed:
        raise EvaluationIncomplete(failed, {s: rd for s, rd in ok.items() if "error" not in rd})
    return ok


class EvaluationIncomplete(RuntimeError):
    def __init__(self, failed: dict[str, str], replies: dict) -> None:
        super().__init__("federated evaluation incomplete: " + "; ".join(f"site {s}: {why}" for s, why in
                                                                         sorted(failed.items())))
        self.failed, self.replies = failed, replies


def write_predictions(out_dir: str | Path, replies: dict[str, RecordDict], targets: list[EvalTarget],
                      run_status: str, provenance: dict, bins: int) -> dict:
    """The sites' replies as the central prediction files (rows) or ``counts.json``, and ``evaluation.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    basis: dict[str, dict[str, str]] = {}
    rows: dict[str, list[dict]] = {}
    counts: dict[str, dict[str, dict]] = {}
    for t in sorted(targets, key=lambda t: (t.split, t.site)):
        if t.split == "validation":
            continue
        cohort, rd = COHORT_OF[t.split], replies[t.site]
        basis.setdefault(cohort, {})[t.site] = str(rd["report"]["report"])
        if f"counts:{t.split}" in rd:
            counts.setdefault(cohort, {})[t.site] = json.loads(str(rd[f"counts:{t.split}"]["json"]))
            continue
        rec = rd[f"rows:{t.split}"]
        ids, labels, meta = list(rec["ids"]), [int(y) for y in rec["labels"]], json.loads(str(rec["meta"]))
        members = sorted({k.split(":", 2)[2] for k in rd if k.startswith(f"probs:{t.split}:") and "#" not in k})
        for member in members:
            probs = get_value(rd, f"probs:{t.split}:{member}").numpy()
            for sid, y, p, m in zip(ids, labels, probs, meta, strict=True):
                rows.setdefault(cohort, []).append(
                    {"sample_id": sid, "label": CLASSES[y], **{f"p_{c}": f"{v:.8f}" for c, v in zip(CLASSES, p,
                                                                                                   strict=True)},
                     "pred": CLASSES[int(p.argmax())], "cohort": cohort, "client": m["client"],
                     "differentiation": m["differentiation"], "magnification": m["magnification"],
                     "run_status": run_status, MEMBER_COLUMN: member})
    summary = {}
    for cohort, sites in sorted(basis.items()):
        if cohort in counts:
            summary[cohort] = {"basis": "counts", "sites": sites,
                               "rows_from": sorted(s for s, b in sites.items() if b == "rows"),
                               "counts_from": sorted(counts[cohort])}
            if any(b == "rows" for b in sites.values()):  # mixed: the rows sites' counts join the sums
                counts[cohort].update(_counts_of_rows(rows.pop(cohort, []), bins))
        else:
            # central order: members outermost, then the split order (holdout: client by client), sample ids
            ordered = sorted(rows[cohort], key=lambda r: (r[MEMBER_COLUMN], r["client"] if cohort == "holdout" else "",
                                                          r["sample_id"]))
            write_prediction_rows(out / f"{cohort}.csv", ordered)
            write_sidecar(out / f"{cohort}.csv", provenance)
            summary[cohort] = {"basis": "rows", "sites": sites}
    if counts:
        write_json(out / "counts.json", {"run_status": run_status, "cohorts": counts, "provenance": provenance})
    write_json(out / "evaluation.json", {"cohorts": summary, "provenance": provenance})
    return summary


def _counts_of_rows(rows: list[dict], bins: int) -> dict[str, dict]:
    """A rows site's contribution to a cohort that another site sent as counts: its rows, counted."""
    from fedhisto.stats.prediction_files import arrays

    out: dict[str, dict] = {}
    for site in sorted({r["client"] for r in rows}):
        mine = [r for r in rows if r["client"] == site]
        out[site] = {m: counts_of(arrays(rs)[2], arrays(rs)[1], bins)
                     for m in sorted({r[MEMBER_COLUMN] for r in mine})
                     for rs in [[r for r in mine if r[MEMBER_COLUMN] == m]]}
    return out


def metrics_from_counts(parts: list[dict]) -> dict:
    """A cohort's metrics from its sites' counts of one member (summed): the count-computable ones of
    ``evaluation.classification_metrics``, the rest named in ``not_computable``."""
    cm = np.sum([np.asarray(p["confusion"]) for p in parts], axis=0)
    n = int(sum(p["n"] for p in parts))
    nb = len(parts[0]["bins"])
    bins = np.sum([np.asarray(p["bins"], dtype=np.float64).reshape(nb, 3) for p in parts], axis=0)
    ece = float(sum(b[0] / n * abs(b[2] / b[0] - b[1] / b[0]) for b in bins if b[0] > 0))
    s = class_scores(cm)
    per_class = {}
    for c, name in enumerate(CLASSES):
        per_class[name] = ({"support": 0, "precision": None, "recall": None, "f1": None, "absent": True}
                           if not s["present"][c] else
                           {"support": int(cm[c].sum()), "precision": float(s["precision"][c]),
                            "recall": float(s["recall"][c]), "f1": float(s["f1"][c]), "absent": False})
    return {"n": n, "accuracy": float(np.trace(cm) / n),
            "balanced_accuracy": float(mean_over_present(s["recall"], s["present"])),
            "macro_f1": float(macro_f1_from_confusion(cm)), "macro_auroc": None, "macro_auprc": None,
            "nll": float(sum(p["nll_sum"] for p in parts) / n), "brier": float(sum(p["brier_sum"] for p in parts) / n),
            "ece": ece, "per_class": per_class, "confusion": cm.tolist(),
            "absent_classes": [nm for nm, pr in zip(CLASSES, s["present"], strict=True) if not pr],
            "basis": "counts", "not_computable": {k: "needs the ranking of per-image probabilities; a site returned "
                                                     "counts only" for k in NOT_FROM_COUNTS}}


def cohort_metrics(pred_dir: str | Path, cohort: str, bins: int) -> dict:
    """Metrics of one cohort of a federated evaluation, on rows where every site sent rows, else on counts."""
    d = Path(pred_dir)
    doc = json.loads((d / "evaluation.json").read_text())["cohorts"][cohort]
    if doc["basis"] == "rows":
        from fedhisto.metrics.stage import _file_metrics

        return {**_file_metrics(d / f"{cohort}.csv", bins), "basis": "rows"}
    counts = json.loads((d / "counts.json").read_text())["cohorts"][cohort]
    members = sorted({m for site in counts.values() for m in site})
    if len(members) != 1:
        raise CountsOnly(f"{cohort}: counts of several models ({members}); score them with rows")
    return {**metrics_from_counts([site[members[0]] for site in counts.values()]), "counts_from": sorted(counts)}


def require_rows(pred_dir: str | Path, cohort: str, what: str) -> Path:
    """The cohort's prediction file, or ``CountsOnly`` naming the sites that sent counts and ``what`` needed rows."""
    d = Path(pred_dir)
    doc = json.loads((d / "evaluation.json").read_text())["cohorts"].get(cohort)
    if doc is None:
        raise CountsOnly(f"{cohort}: no site evaluated it")
    if doc["basis"] != "rows":
        raise CountsOnly(f"{what} of {cohort} needs per-image rows; site(s) {', '.join(doc['counts_from'])} "
                         "returned counts only (their opt-out), so it cannot be computed")
    return d / f"{cohort}.csv"


def validation_from_counts(replies: dict[str, RecordDict]) -> dict[str, float]:
    """Early stopping's macro-F1 per member over validation held by several sites (summed confusions)."""
    total: dict[str, np.ndarray] = {}
    for rd in replies.values():
        for member, cm in json.loads(str(rd["validation-counts"]["json"])).items():
            total[member] = total.get(member, 0) + np.asarray(cm)
    return {m: float(macro_f1_from_confusion(cm)) for m, cm in sorted(total.items())}


def read_manifest_meta(manifest_csv: str, site: str | None, split: str) -> dict[str, dict]:
    with Path(manifest_csv).open() as fh:
        return {r["sample_id"]: {"client": r["client"], "differentiation": r.get("differentiation", ""),
                                 "magnification": r.get("magnification", "")}
                for r in csv.DictReader(fh) if r["split"] == split and (site is None or r["client"] == site)}
