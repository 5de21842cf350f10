"""Clearance outputs for the pipeline (``results/clearance``) and for any folder (``fedhisto audit``).

- ``edges.csv``: every examined pair with stage, score, threshold, decision and the fitted transform;
- ``families.csv``: every image with its family id, size, representative flag and whether it is kept;
- ``audit.json``: counts per stage, thresholds, timings, failures, planted-family recall (synthetic);
- ``report.md``: the same for a human reader.

Families never mix classes silently: a family whose members carry different labels stops
the stage with the list, since it means the same tissue was labelled twice.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from fedhisto.clearance.engine import EDGE_COLUMNS, AuditResult, audit_images
from fedhisto.clearance.families import family_id, pairwise_scores
from fedhisto.config.study import ClearanceConfig
from fedhisto.infra.atomic import write_csv, write_json, write_text
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.realdata.sources import IMAGE_SUFFIXES, SourceRow, read_sources_csv

STAGE = "clearance"
FAMILY_COLUMNS = ("relpath", "path", "label", "site", "cohort", "sha256", "family", "family_size", "representative",
                  "keep")


class ClearanceError(RuntimeError):
    """Clearance could not certify the corpus; the message lists what remains."""


def family_rows(rows: list[SourceRow], result: AuditResult, policy: str) -> list[dict]:
    out: list[dict] = [{}] * len(rows)
    for members in result.families:
        fid = family_id([rows[i].relpath for i in members])
        # whole families stay together, but never across the internal / external boundary: a copy
        # filed in the other cohort than the family's first-listed member is dropped
        home = rows[members[0]].cohort
        for i in members:
            representative = i == members[0]  # first-listed member: originals precede copies
            out[i] = {"relpath": rows[i].relpath, "path": rows[i].path, "label": rows[i].label,
                      "site": rows[i].site, "cohort": rows[i].cohort, "sha256": result.digests[i], "family": fid,
                      "family_size": len(members),
                      "representative": representative, "keep": kept_by(policy, representative, rows[i].cohort, home)}
    return out


def kept_by(policy: str, representative: bool, cohort: str, home_cohort: str) -> bool:
    """Whether a family member enters the manifest under ``clearance.family_policy``."""
    if policy == "ignore_families":  # the leakage experiment's leaky split: as if clearance never ran
        return True
    return representative or (policy == "whole_families" and cohort == home_cohort)


def refile(families: list[dict], policy: str) -> list[dict]:
    """families.csv rows with ``keep`` recomputed for another policy (the leakage experiment reuses
    one clearance audit for every policy; the families themselves do not depend on it)."""
    home = {r["family"]: r["cohort"] for r in families if r["representative"] in (True, "True")}
    orphans = sorted({r["family"] for r in families} - set(home))
    if orphans:
        raise ClearanceError(f"families.csv: family {orphans[0]} (and {len(orphans) - 1} more) has no representative "
                             "row; rerun clearance")
    return [{**r, "keep": kept_by(policy, r["representative"] in (True, "True"), r["cohort"], home[r["family"]])}
            for r in families]


def label_conflicts(rows: list[SourceRow], result: AuditResult) -> list[dict]:
    return [{"members": [rows[i].relpath for i in f], "labels": sorted({rows[i].label for i in f})}
            for f in result.families if len({rows[i].label for i in f}) > 1]


def planted_scores(rows: list[SourceRow], fams: list[dict], planted_csv: Path) -> dict:
    """Recall of planted families: a family is found when all its members share one found family."""
    with planted_csv.open() as fh:
        planted = list(csv.DictReader(fh))
    found = {r["relpath"]: r["family"] for r in fams}
    truth: dict[str, list[str]] = defaultdict(list)
    for rec in planted:
        truth[rec["family"]].append(rec["relpath"])
    hit = [fid for fid, members in truth.items() if len({found[m] for m in members}) == 1]
    planted_of = {m: f"planted-{fid}" for fid, members in truth.items() for m in members}
    truth_labels = [planted_of.get(r.relpath, f"single-{r.relpath}") for r in rows]
    scores = pairwise_scores(truth_labels, [found[r.relpath] for r in rows])
    missed = sorted(set(truth) - set(hit), key=int)
    return {"planted_families": len(truth), "recovered": len(hit), "recall": len(hit) / max(len(truth), 1),
            "missed": [truth[f] for f in missed], "pairwise": scores}


def _audit_json(result: AuditResult, cfg: ClearanceConfig, rows: list[SourceRow], conflicts, planted) -> dict:
    per_boundary: dict[str, int] = defaultdict(int)
    for e in result.edges:
        if e["decision"] == "confirmed":
            a, b = rows[e["a"]], rows[e["b"]]
            key = " | ".join(sorted({f"{a.cohort}:{a.site}", f"{b.cohort}:{b.site}"}))
            per_boundary[key] += 1
    return {"stats": result.stats, "thresholds": cfg.model_dump(mode="json"),
            "confirmed_edges_by_site_pair": dict(sorted(per_boundary.items())),
            "failures": result.failures, "label_conflicts": conflicts, "planted": planted}


def _report(audit: dict) -> str:
    s = audit["stats"]
    lines = ["# Clearance report", "",
             f"- images: {s['images']}; exact-duplicate groups: {s['exact_groups']}",
             f"- candidates: {s['candidates']} ({s['phash_pairs']} PHash <= {audit['thresholds']['phash_threshold']}, "
             f"{s['descriptor_pairs']} descriptor neighbours"
             + (f", {s['zoom_pairs']} zoom-view neighbours" if "zoom_pairs" in s else "")
             + f"); verified {s['verified']}, implied {s['implied']}",
             f"- confirmed edges by stage: {s['confirmed_by_stage']}; rejected: {s['rejected']}",
             f"- families (2+ images): {s['families']} covering {s['images_in_families']} images; "
             f"largest {s['largest_family']}",
             f"- scoring failures: {len(audit['failures'])}; label conflicts: {len(audit['label_conflicts'])}",
             f"- seconds: {s['seconds']}"]
    if audit.get("planted"):
        p = audit["planted"]
        lines.append(f"- planted families recovered: {p['recovered']} / {p['planted_families']} "
                     f"(pairwise F1 {p['pairwise']['f1']:.4f})")
    lines += ["", "Confirmed edges by site pair:", ""]
    lines += [f"- {k}: {v}" for k, v in audit["confirmed_edges_by_site_pair"].items()] or ["- none"]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, rows: list[SourceRow], result: AuditResult, cfg: ClearanceConfig,
                  planted_csv: Path | None = None, inputs: dict | None = None, strict_labels: bool = True) -> dict:
    fams = family_rows(rows, result, cfg.family_policy)
    conflicts = label_conflicts(rows, result)
    planted = planted_scores(rows, fams, planted_csv) if planted_csv else None
    audit = _audit_json(result, cfg, rows, conflicts, planted)
    if result.failures or (conflicts and strict_labels):
        raise ClearanceError(f"clearance left {len(result.failures)} unresolved scoring failure(s) "
                             f"{result.failures[:5]} and {len(conflicts)} label-conflicting famil(ies) {conflicts[:5]}")
    edges = [{**e, "a": rows[e["a"]].relpath, "b": rows[e["b"]].relpath} for e in result.edges]
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance_block(STAGE, cfg.model_dump(mode="json"), inputs or {})
    write_csv(out / "edges.csv", edges, EDGE_COLUMNS)
    write_csv(out / "families.csv", fams, FAMILY_COLUMNS)
    write_json(out / "audit.json", {**audit, "provenance": prov})
    write_text(out / "report.md", _report(audit))
    for name in ("edges.csv", "families.csv", "report.md"):
        write_sidecar(out / name, prov)
    return audit


def run_clearance(sources_csv: str | Path, cfg: ClearanceConfig, out_dir: str | Path, threads: int = 1,
                  planted_csv: str | Path | None = None, progress: bool = True) -> dict:
    rows = read_sources_csv(sources_csv)
    result = audit_images([r.path for r in rows], cfg, threads=threads, progress=progress)
    inputs = {"sources": sources_csv, **({"planted": planted_csv} if planted_csv else {})}
    return write_outputs(Path(out_dir), rows, result, cfg, Path(planted_csv) if planted_csv else None, inputs)


def run_audit_folder(folder: str | Path, out_dir: str | Path, cfg: ClearanceConfig, threads: int = 1) -> dict:
    """``fedhisto audit DIR``: every image below a folder, labelled by its parent folder."""
    root = Path(folder)
    if not root.is_dir():
        raise ClearanceError(f"not a folder: {root}")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise ClearanceError(f"no images below {root}")
    rows = [SourceRow(path=str(p), relpath=p.relative_to(root).as_posix(), label=p.parent.name, source="folder",
                      site=root.name, cohort="internal") for p in files]
    result = audit_images([r.path for r in rows], cfg, threads=threads, progress=True)
    # folder names are only a hint of class here: conflicts are reported, not fatal
    return write_outputs(Path(out_dir), rows, result, cfg, inputs={"folder": root}, strict_labels=False)
