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
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np

from fedhisto.clearance.verify import extract, make_detector
from fedhisto.imageio import load_rgb


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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
