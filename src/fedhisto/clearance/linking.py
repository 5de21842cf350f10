"""Second pass: link two detected families whose closest members nearly verify.

Families are connected components of pairs confirmed at ``min_inliers``, so a true family splits
when no member of one part verifies against any member of the other, e.g. two heavily rotated
and flipped copies that verify with each other but reach only 6-9 inliers against their
relatives. Lowering ``min_inliers`` everywhere would let chance matches between unrelated
singletons chain families together. This pass relaxes the threshold *between families only*
and asks for corroboration:

1. A *near miss* is a verified pair below ``min_inliers`` with at least ``link_min_inliers``
   RANSAC inliers and a plausible similarity scale (the same range as a confirmation), proposed
   by PHash or the descriptor neighbours (a zoom-view candidate must verify outright). Chance
   matches between unrelated tiles mostly fit a degenerate transform (scale near 0), which
   this excludes.
2. Every pair of first-pass families joined by a near miss is *suspect*. Its closest cross
   pairs (visual-word cosine), up to ``LINK_CHECKS`` not yet verified, are verified now, so
   support does not hinge on which pairs the k-NN candidates happened to propose.
3. Two suspect families are linked when a cross pair now verifies outright, or when near misses
   join at least ``link_min_pairs`` distinct *pictures* pairs. A picture is a set of members
   that are copies of one image up to re-encoding, resizing, re-staining or a flip / 90-degree
   turn, i.e. joined by exact or PHash-stage edges: one chance match against two such copies
   repeats itself and is one piece of evidence, not two (measured on the embedded default's
   planted families, where it was the cause of every false link). Two singletons can therefore
   only link by a full verification: the pass never lowers the bar for them.

Links are decided on the first-pass families and applied together, so the outcome does not
depend on the order suspects are examined in.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import numpy as np

from fedhisto.clearance.verify import SCALE_RANGE, Verdict
from fedhisto.realdata.union_find import UnionFind

#: closest not-yet-verified cross pairs verified per suspect family pair
LINK_CHECKS = 12

Pair = tuple[int, int]


def is_near_miss(inliers: int, scale: float, link_min_inliers: int) -> bool:
    return inliers >= link_min_inliers and SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]


def _verified(edges: list[dict]) -> dict[Pair, dict]:
    """Pass-1 verdicts by pair (exact and implied edges carry none)."""
    return {(min(e["a"], e["b"]), max(e["a"], e["b"])): e for e in edges
            if e["decision"] in ("confirmed", "rejected") and e["stage"] != "exact"}


def suspects(uf: UnionFind, edges: list[dict], link_min_inliers: int) -> dict[Pair, set[Pair]]:
    """First-pass family pairs (by root) joined by a near miss, with those near-miss pairs."""
    out: dict[Pair, set[Pair]] = defaultdict(set)
    for pair, e in _verified(edges).items():
        # zoom-view candidates must verify outright: their near misses are no evidence here (on real LC25000
        # among synthetic LC25000-shaped families they made 31 false links, pairwise precision 0.81)
        if e["decision"] != "rejected" or e["inliers"] == "" or e["stage"] == "zoom":
            continue
        ra, rb = uf.find(pair[0]), uf.find(pair[1])
        if ra != rb and is_near_miss(int(e["inliers"]), float(e["scale"]), link_min_inliers):
            out[(min(ra, rb), max(ra, rb))].add(pair)
    return dict(out)


def closest_unverified(a: list[int], b: list[int], words: np.ndarray, done: set[Pair], limit: int) -> list[Pair]:
    """Up to ``limit`` cross pairs of families ``a`` x ``b`` not yet verified, most similar first."""
    sim = words[a] @ words[b].T
    order = np.lexsort((np.arange(sim.size), -sim.ravel()))  # ties: row-major order, deterministic
    out: list[Pair] = []
    for flat in order.tolist():
        i, j = a[flat // len(b)], b[flat % len(b)]
        pair = (min(i, j), max(i, j))
        if pair not in done:
            out.append(pair)
            if len(out) == limit:
                break
    return out


def link_families(uf: UnionFind, edges: list[dict], words: np.ndarray, link_min_inliers: int, link_min_pairs: int,
                  min_inliers: int, verify_map: Callable[[list[Pair]], Iterable[tuple[Pair, Verdict | str]]],
                  edge: Callable[..., None], failures: list[dict]) -> int:
    """Run the second pass in place on ``uf``; append its edges with stage ``link``; return links made."""
    suspect = suspects(uf, edges, link_min_inliers)
    if not suspect:
        return 0
    members: dict[int, list[int]] = defaultdict(list)
    for i in range(len(uf.parent)):
        members[uf.find(i)].append(i)
    done = set(_verified(edges))
    checks: dict[Pair, list[Pair]] = {}
    for roots in sorted(suspect):
        checks[roots] = closest_unverified(members[roots[0]], members[roots[1]], words, done, LINK_CHECKS)
        done.update(checks[roots])
    todo = [p for roots in sorted(checks) for p in checks[roots]]
    verdicts: dict[Pair, Verdict] = {}
    for pair, verdict in verify_map(todo):
        if isinstance(verdict, str):
            failures.append({"a": pair[0], "b": pair[1], "error": verdict})
            edge(*pair, "link", float(words[pair[0]] @ words[pair[1]]), 0, "failed")
        else:
            verdicts[pair] = verdict
    pass1 = _verified(edges)
    pictures = UnionFind(len(uf.parent))
    for e in edges:
        if e["decision"] == "confirmed" and e["stage"] in ("exact", "phash"):
            pictures.union(e["a"], e["b"])

    def independent(pairs: list[Pair]) -> int:
        return len({tuple(sorted((pictures.find(a), pictures.find(b)))) for a, b in pairs})

    links: list[tuple[Pair, list[Pair]]] = []
    for roots in sorted(suspect):
        full = [p for p in checks[roots] if p in verdicts and verdicts[p].confirmed(min_inliers)]
        near = sorted(suspect[roots] | {p for p in checks[roots] if p in verdicts and not verdicts[p].confirmed(
            min_inliers) and is_near_miss(verdicts[p].inliers, verdicts[p].scale, link_min_inliers)})
        for p in checks[roots]:  # every pass-2 verification is recorded, at the threshold that judged it
            if p in verdicts and p not in full and p not in near:
                edge(*p, "link", float(words[p[0]] @ words[p[1]]), 0, "rejected", verdicts[p], link_min_inliers)
        if full or independent(near) >= link_min_pairs:
            links.append((roots, full + near))
        else:
            for p in near:
                if p in verdicts:
                    edge(*p, "link", float(words[p[0]] @ words[p[1]]), 0, "rejected", verdicts[p], link_min_inliers)
    for roots, support in links:
        uf.union(*roots)
        for p in support:
            v = verdicts.get(p)
            if v is None:  # a pass-1 near miss: its verdict is in its pass-1 row
                e = pass1[p]
                v = Verdict(int(e["inliers"]), 0, float(e["scale"]), float(e["angle_deg"]), bool(e["mirrored"]))
            edge(*p, "link", float(words[p[0]] @ words[p[1]]), 0, "confirmed", v,
                 min_inliers if v.confirmed(min_inliers) else link_min_inliers)
    return len(links)
