"""Partition units: what the manifest must keep inside one protected partition.

Clearance's augmentation families are joined by edges found in pixels; a patient's or a slide's
images are joined by edges read from metadata (``fedhisto.realdata.patients``). Both are merged
here with one union-find: a unit is a connected component of pixel and metadata edges, and the
manifest never lets a unit span two partitions, exactly as it already did for families.

Metadata edges are kept apart from clearance's families on purpose: a family is a set of copies
of one image (``family_policy: representatives`` keeps one of them), while a patient's images are
distinct images that all count; and a slide holds several classes (WSSS4LUAD tumour and normal
tiles), which clearance would rightly report as a label conflict within a family.

The boundary audit checks metadata edges as it checks clearance's confirmed edges, and names
every patient or slide found in two partitions; ``metadata_edges.csv`` records each edge with its
origin (``slide`` or ``patient``), beside clearance's ``edges.csv`` (``pixels``).
"""

from __future__ import annotations

from collections import defaultdict

from fedhisto.realdata.union_find import UnionFind

METADATA_EDGE_COLUMNS = ("a", "b", "origin", "key")


def group_key(site: str, patient: str) -> str:
    """A patient / slide is scoped by its source's site: ids of two datasets never join."""
    return f"{site}/{patient}"


def unit_groups(ids: list[str], family_of: dict[str, str], patient_of: dict[str, str],
                use_families: bool = True) -> dict[str, str]:
    """``{id: group}``: the connected component of family (pixel) and patient (metadata) edges."""
    index = {i: n for n, i in enumerate(ids)}
    uf = UnionFind(len(ids))
    for key_of in ((family_of if use_families else {}), patient_of):
        first: dict[str, int] = {}
        for i in ids:
            key = key_of.get(i)
            if key:
                uf.union(first.setdefault(key, index[i]), index[i])
    return {i: ids[uf.find(index[i])] for i in ids}


def metadata_edges(rows: list[dict]) -> list[dict]:
    """One edge from the first-listed image of each patient / slide to each of its other images."""
    members: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("patient"):
            members[group_key(r["site"], r["patient"])].append(r)
    edges = []
    for key, group in sorted(members.items()):
        head, *rest = sorted(group, key=lambda r: r["relpath"])
        origin = head["patient"].split(":", 1)[0]
        edges += [{"a": head["relpath"], "b": r["relpath"], "origin": origin, "key": key} for r in rest]
    return edges


def patient_audit(rows: list[dict], where: dict[str, str], edges: list[dict]) -> dict:
    """Metadata edges across protected boundaries, and patients / slides found in two partitions."""
    # checked over the placed images only: a star through an unused image would hide a split
    leaks = [{**e, "boundaries": [where[e["a"]], where[e["b"]]]}
             for e in metadata_edges([r for r in rows if r["relpath"] in where])
             if where[e["a"]] != where[e["b"]]]
    seen: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        if r.get("patient") and r["relpath"] in where:
            seen[group_key(r["site"], r["patient"])].add(where[r["relpath"]])
    spanning = sorted(k for k, bs in seen.items() if len(bs) > 1)
    origins = defaultdict(int)
    for e in edges:
        origins[e["origin"]] += 1
    return {"cross_boundary_metadata_edges": leaks, "patients_spanning_partitions": spanning,
            "patients_or_slides": len({group_key(r["site"], r["patient"]) for r in rows if r.get("patient")}),
            "metadata_edges_by_origin": dict(sorted(origins.items()))}
