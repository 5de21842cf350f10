"""Source audit of the manifest: partition x source x class counts, single-source classes, and the
source-stratified allocation of global validation and test (``manifest.stratify_by_source``).

A *source* is the ``site`` tag of sources.csv: one per configured dataset (it defaults to the
dataset kind, e.g. ``lc25000``, ``wsss4luad``) or one per synthetic site. When a class of a
partition comes from one source only while other classes of that partition come from others
(under the study's setup SCC can only come from LC25000, since WSSS4LUAD has no SCC), the source
predicts the class there, and early stopping on that partition can reward a source cue rather
than morphology. The audit flags such classes; stratification cannot remove them (it only
mirrors, per class, the sources the leftovers come from), so the flag stays the reader's warning.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict

from fedhisto import CLASSES

log = logging.getLogger(__name__)

SOURCE_COLUMNS = ("partition", "subset", "source", *CLASSES, "total")
AUDITED = ("validation", "test")


def source_composition(rows: list[dict]) -> list[dict]:
    """Partition x source x class counts: client pools, global validation and test, external."""
    count: dict[tuple[str, str, str], Counter] = defaultdict(Counter)
    for r in rows:
        if r["client"]:
            count[(r["client"], "pool", r["site"])][r["label"]] += 1
        elif r["partition"] != "unused":
            count[(r["partition"], "all", r["site"])][r["label"]] += 1
    rank = {p: k for k, p in enumerate([f"C{k}" for k in range(1, 6)] + ["validation", "test", "external"])}
    keys = sorted(count, key=lambda k: (rank.get(k[0], len(rank)), k[0], k[2]))
    return [{"partition": p, "subset": s, "source": src, **{c: count[(p, s, src)][c] for c in CLASSES},
             "total": sum(count[(p, s, src)].values())} for p, s, src in keys]


def single_source_classes(rows: list[dict]) -> list[dict]:
    """Classes of global validation / test drawn from one source while the partition draws from several."""
    sources: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for r in rows:
        if r["partition"] in AUDITED:
            sources[(r["partition"], r["label"])][r["site"]] += 1
    flags = []
    for partition in AUDITED:
        present = sorted({s for (p, _), c in sources.items() if p == partition for s in c})
        if len(present) < 2:
            continue  # a one-source partition: source cannot tell its classes apart
        for cls in CLASSES:
            by = sources.get((partition, cls), Counter())
            if len(by) == 1:
                (only, n), = by.items()
                flags.append({"partition": partition, "class": cls, "source": only, "images": n,
                              "partition_sources": present})
    for f in flags:
        log.warning("source audit: %s %s comes from %s only (%d images) while %s draws from %s: the source predicts "
                    "the class there", f["partition"], f["class"], f["source"], f["images"], f["partition"],
                    f["partition_sources"])
    return flags


def flag_lines(flags: list[dict]) -> list[str]:
    if not flags:
        return ["No class of global validation or test is drawn from a single source while others are not."]
    return [f"FLAG: {f['partition']} {f['class']} comes from {f['source']} only ({f['images']} images) while "
            f"{f['partition']} draws from {', '.join(f['partition_sources'])}: the source predicts the class there."
            for f in flags]


def allocate(count: int, available: dict[str, int]) -> dict[str, int]:
    """``count`` split over sources in proportion to ``available`` (largest remainder, ties by source name)."""
    total = sum(available.values())
    if total == 0 or count == 0:
        return {s: 0 for s in available}
    exact = {s: count * n / total for s, n in available.items()}
    out = {s: int(v) for s, v in exact.items()}
    for s in sorted(available, key=lambda s: (-(exact[s] - out[s]), s))[:count - sum(out.values())]:
        out[s] += 1
    return out
