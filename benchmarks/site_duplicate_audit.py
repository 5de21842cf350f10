"""What the coordinator's hash-only cross-site audit finds on the embedded default, against the central audit.

Usage::

    python benchmarks/site_duplicate_audit.py [--config config/config.yaml] [--work /tmp/fedhisto-siteaudit]
        [--threads 2] [--json PATH]

1. Renders the embedded default's synthetic cohort (``fedhisto cohort``; reused when ``--work`` holds it)
   with its planted duplicate families (``planted_families.csv``: the truth).
2. Central audit: the clearance stage over every image (SHA-256, dihedral PHash, visual-word and
   global-descriptor candidates, SIFT + RANSAC verification).
3. Federated: each site folder (``images/site1`` .. ``site5`` as clients C1..C5, ``images/external``
   as evaluation site EXT) prepared alone (``federation.prepare``), then ``check-uploads`` on the six
   ``upload.json`` files: hashes only.
4. Scores, on **cross-site** pairs only (pairs of one planted family filed at two different sites):
   pairwise recall and precision of "same central family" and of "same coordinator component", and
   the planted cross-site families that still leave two kept members at two sites after each design
   resolves them (central: the clearance keep flags; federated: local clearance plus the drop lists).

Prints one JSON document (and writes it with ``--json``); docs/federation.md records a run.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections import defaultdict
from itertools import combinations
from pathlib import Path

from fedhisto.config.study import load_config_file
from fedhisto.manifest.stage import sample_id

SITES = {"C1": "site1", "C2": "site2", "C3": "site3", "C4": "site4", "C5": "site5", "EXT": "external"}


def _read(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def cross_site_pairs(groups: dict[str, list[tuple[str, str]]]) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    """Pairs of (site, relpath) in one group and at two different sites, ordered."""
    out = set()
    for members in groups.values():
        for a, b in combinations(sorted(set(members)), 2):
            if a[0] != b[0]:
                out.add((a, b))
    return out


def score(found: set, truth: set) -> dict:
    tp = len(found & truth)
    return {"found_pairs": len(found), "true_pairs": len(truth), "hits": tp,
            "recall": round(tp / len(truth), 4) if truth else 1.0,
            "precision": round(tp / len(found), 4) if found else 1.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--work", default="/tmp/fedhisto-siteaudit")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    from fedhisto.clearance.stage import run_clearance
    from fedhisto.cohort.stage import run_cohort
    from fedhisto.federation.coordinator import check_uploads, duplicate_audit
    from fedhisto.federation.prepare import prepare_site
    from fedhisto.federation.upload import read_upload

    cfg = load_config_file(args.config)
    work = Path(args.work)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    if not (work / "cohort" / "planted_families.csv").exists():
        run_cohort(cfg.cohort, work / "cohort", threads=args.threads)
    seconds["cohort"] = round(time.perf_counter() - t, 1)
    with threadpool_limits(1):  # the visual-word k-means: small BLAS calls, threads only contend
        t = time.perf_counter()
        if not (work / "central" / "families.csv").exists():
            run_clearance(work / "cohort" / "sources.csv", cfg.clearance, work / "central", threads=args.threads,
                          planted_csv=work / "cohort" / "planted_families.csv", progress=False)
        seconds["central_clearance"] = round(time.perf_counter() - t, 1)
        uploads = []
        t = time.perf_counter()
        for site, folder in SITES.items():
            out = work / "sites" / site
            if not (out / "upload.json").exists():
                prepare_site(work / "cohort" / "images" / folder, site, out, cfg,
                             role="external" if site == "EXT" else "client",
                             layout="lunghist700" if site == "EXT" else "folders", threads=args.threads)
            uploads.append(out / "upload.json")
        seconds["site_prepare_all_six"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    summary = check_uploads(uploads, cfg, work / "coordinator")
    seconds["check_uploads"] = round(time.perf_counter() - t, 2)
    ups = [read_upload(p, cfg) for p in uploads]
    audit = duplicate_audit(ups, cfg.clearance.phash_threshold)

    site_of = {v: k for k, v in SITES.items()}
    sources = _read(work / "cohort" / "sources.csv")
    where = {r["relpath"]: (site_of[r["site"]], r["relpath"]) for r in sources}
    planted = _read(work / "cohort" / "planted_families.csv")
    truth_groups: dict[str, list] = defaultdict(list)
    for r in planted:
        truth_groups[r["family"]].append(where[r["relpath"]])
    truth = cross_site_pairs(truth_groups)
    central_fams = _read(work / "central" / "families.csv")
    central_groups: dict[str, list] = defaultdict(list)
    for r in central_fams:
        central_groups[r["family"]].append(where[r["relpath"]])
    by_id = {(site_of[r["site"]], sample_id(r["relpath"])): where[r["relpath"]] for r in sources}
    fed_groups: dict[str, list] = defaultdict(list)
    for node, comp in audit["components"].items():
        fed_groups[comp].append(by_id[node])
    central_pairs, fed_pairs = cross_site_pairs(central_groups), cross_site_pairs(fed_groups)

    # after resolution: which planted cross-site families still keep members at two sites
    central_kept = {r["relpath"] for r in central_fams if r["keep"] == "True"}
    dropped = {(s, r["sample_id"]) for s, rows in audit["drops"].items() for r in rows}
    fed_kept = {by_id[(u.site, im["sample_id"])][1] for u in ups for im in u.images
                if im["kept"] and (u.site, im["sample_id"]) not in dropped}

    def leaking(kept: set[str]) -> list[str]:
        out = []
        for fam, members in truth_groups.items():
            sites = {s for s, rel in members if rel in kept}
            if len({s for s, _ in members}) > 1 and len(sites) > 1:
                out.append(fam)
        return sorted(out, key=int)

    transforms = {}
    for r in planted:
        if r["role"] == "copy":
            transforms[r["relpath"]] = r["transform"]
    missed_by_transform: dict[str, int] = defaultdict(int)
    for a, b in truth - fed_pairs:
        for node in (a, b):
            if node[1] in transforms:
                missed_by_transform[transforms[node[1]]] += 1
    cross_families = sum(1 for m in truth_groups.values() if len({s for s, _ in m}) > 1)
    report = {
        "images": len(sources), "planted_families": len(truth_groups), "planted_cross_site_families": cross_families,
        "central": score(central_pairs, truth), "hash_only": score(fed_pairs, truth),
        "families_leaking_after_resolution": {"central": leaking(central_kept), "hash_only": leaking(fed_kept)},
        "hash_only_missed_pair_ends_by_copy_transform": dict(sorted(missed_by_transform.items())),
        "coordinator": summary["duplicates"], "upload_kib": {
            p.parent.name: round(p.stat().st_size / 1024, 1) for p in uploads},
        "seconds": seconds,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
