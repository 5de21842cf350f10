"""Could sites upload visual-word signatures a coordinator compares without pixels? A measurement.

Usage (after ``benchmarks/site_duplicate_audit.py`` rendered the cohort)::

    python benchmarks/site_word_signatures.py [--work /tmp/fedhisto-siteaudit] [--bits 12]

The central clearance fits its visual-word vocabulary (k-means) on the whole corpus, which no site
has. This tries the data-free alternative every site can compute identically: each RootSIFT
descriptor (direct and mirrored, as clearance extracts them) is hashed to a word by ``--bits`` seeded
random hyperplanes; an image's signature is its word-count vector; the coordinator weights by IDF over
every site's counts, takes sqrt-TF-IDF cosines, and compares cross-site pairs of one planted family
with every other cross-site pair. Prints the true-pair similarity quantiles and, per threshold,
recall against the number of false cross-site pairs proposed (docs/federation.md records a run).

Second, the clearance engine's own data-free global descriptor (``candidates.global_descriptor``:
rotation- and flip-invariant colour, angular-spectrum and radial statistics), standardised at the
coordinator over all images: cross-site pairs above a cosine threshold are joined to the hash audit's
components (the six ``upload.json`` of ``site_duplicate_audit.py``), and the cross-site pair recall
and precision of the union are printed per threshold.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np

from fedhisto.clearance.verify import extract, make_detector
from fedhisto.infra.imageio import load_rgb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/fedhisto-siteaudit")
    ap.add_argument("--bits", type=int, default=12)
    args = ap.parse_args()
    work = Path(args.work)
    with (work / "cohort" / "sources.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    with (work / "cohort" / "planted_families.csv").open() as fh:
        family = {r["relpath"]: r["family"] for r in csv.DictReader(fh)}
    detector = make_detector("sift", 400)[0]
    planes = np.random.default_rng(20261201).standard_normal((args.bits, 128)).astype(np.float32)
    t = time.perf_counter()
    counts = []
    for r in rows:
        f = extract(load_rgb(r["path"]), detector)
        d = np.vstack([f.descriptors, f.descriptors_mirror]).astype(np.float32)
        d = np.sqrt(d / (d.sum(1, keepdims=True) + 1e-9))  # RootSIFT
        words = ((d @ planes.T) > 0).astype(np.int64) @ (1 << np.arange(args.bits))
        counts.append(np.bincount(words, minlength=1 << args.bits).astype(np.float64))
    h = np.stack(counts)
    idf = np.log((1 + len(h)) / (1 + (h > 0).sum(0)))
    sig = np.sqrt(h) * idf
    sig /= np.linalg.norm(sig, axis=1, keepdims=True) + 1e-12
    sim = sig @ sig.T
    true, other = [], []
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if rows[i]["site"] != rows[j]["site"]:
                same = rows[i]["relpath"] in family and family[rows[i]["relpath"]] == family.get(rows[j]["relpath"])
                (true if same else other).append(sim[i, j])
    true_s, other_s = np.array(true), np.array(other)
    print(f"images {len(rows)}, signatures in {time.perf_counter() - t:.1f} s; cross-site pairs: {len(true_s)} "
          f"planted, {len(other_s)} other; max other cosine {other_s.max():.3f}")
    print("true-pair cosine quantiles 10/50/90 %:", np.round(np.quantile(true_s, [0.1, 0.5, 0.9]), 3).tolist())
    for thr in (0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6):
        print(f"cosine >= {thr:.2f}: recall {np.mean(true_s >= thr):.3f}, false cross-site pairs "
              f"{int(np.sum(other_s >= thr))}")
    union_with_hash_audit(work)
    return 0


def union_with_hash_audit(work: Path) -> None:
    from collections import defaultdict
    from itertools import combinations

    from fedhisto.clearance.candidates import global_descriptor
    from fedhisto.config.study import load_config_file
    from fedhisto.federation.coordinator import duplicate_audit
    from fedhisto.federation.upload import read_upload
    from fedhisto.manifest.stage import sample_id
    from fedhisto.realdata.union_find import UnionFind

    cfg = load_config_file("config/config.yaml")
    sites = {"C1": "site1", "C2": "site2", "C3": "site3", "C4": "site4", "C5": "site5", "EXT": "external"}
    site_of = {v: k for k, v in sites.items()}
    with (work / "cohort" / "sources.csv").open() as fh:
        rows = {(site_of[r["site"]], sample_id(r["relpath"])): r for r in csv.DictReader(fh)}
    with (work / "cohort" / "planted_families.csv").open() as fh:
        family = {r["relpath"]: r["family"] for r in csv.DictReader(fh)}
    ups = [read_upload(work / "sites" / s / "upload.json", cfg) for s in sites]
    nodes = [(u.site, im) for u in ups for im in u.images]
    index = {(s, im["sample_id"]): i for i, (s, im) in enumerate(nodes)}
    desc = np.stack([global_descriptor(load_rgb(rows[(s, im["sample_id"])]["path"])) for s, im in nodes])
    z = (desc - desc.mean(0)) / (desc.std(0) + 1e-9)
    z /= np.linalg.norm(z, axis=1, keepdims=True) + 1e-12
    sim = np.triu(z @ z.T, 1)
    audit = duplicate_audit(ups, cfg.clearance.phash_threshold)
    groups = defaultdict(list)
    for i, (s, im) in enumerate(nodes):
        rel = rows[(s, im["sample_id"])]["relpath"]
        if rel in family:
            groups[family[rel]].append(i)
    truth = {(a, b) for g in groups.values() for a, b in combinations(sorted(g), 2) if nodes[a][0] != nodes[b][0]}
    for thr in (None, 0.9, 0.8, 0.75, 0.7):
        uf = UnionFind(len(nodes))
        first: dict = {}
        for i, (s, im) in enumerate(nodes):
            uf.union(first.setdefault((s, im["family"]), i), i)
        for p in audit["pairs"]:
            uf.union(index[(p["site_a"], p["sample_id_a"])], index[(p["site_b"], p["sample_id_b"])])
        if thr is not None:
            for i, j in zip(*np.nonzero(sim >= thr), strict=True):
                if nodes[i][0] != nodes[j][0]:
                    uf.union(int(i), int(j))
        comp = defaultdict(list)
        for i in range(len(nodes)):
            comp[uf.find(i)].append(i)
        found = {(a, b) for g in comp.values() for a, b in combinations(g, 2) if nodes[a][0] != nodes[b][0]}
        hits = len(found & truth)
        print(f"hashes{'' if thr is None else f' + global descriptor cosine >= {thr}'}: {len(found)} cross-site "
              f"pairs, recall {hits / len(truth):.3f}, precision {hits / max(len(found), 1):.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
