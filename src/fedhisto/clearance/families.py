"""Families as connected components of confirmed edges, and scoring against ground truth."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import combinations

from fedhisto.realdata.union_find import UnionFind


def components(n: int, edges: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Connected components, each sorted, ordered by their first (smallest) index."""
    uf = UnionFind(n)
    for a, b in edges:
        uf.union(a, b)
    groups: dict[int, list[int]] = defaultdict(list)
    for i in range(n):
        groups[uf.find(i)].append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def family_id(members: Sequence[str]) -> str:
    """Stable id from the sorted portable paths of the members."""
    return "fam-" + hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:12]


def same_family_pairs(labels: Sequence[str]) -> set[tuple[int, int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, lab in enumerate(labels):
        groups[lab].append(i)
    return {p for g in groups.values() for p in combinations(sorted(g), 2)}


def pairwise_scores(truth: Sequence[str], found: Sequence[str]) -> dict[str, float]:
    """Pairwise precision / recall / F1 of a clustering against ground-truth families, plus ARI."""
    from sklearn.metrics import adjusted_rand_score

    t, f = same_family_pairs(truth), same_family_pairs(found)
    tp = len(t & f)
    precision = tp / len(f) if f else 1.0
    recall = tp / len(t) if t else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "ari": float(adjusted_rand_score(truth, found)),
            "true_pairs": len(t), "found_pairs": len(f)}
