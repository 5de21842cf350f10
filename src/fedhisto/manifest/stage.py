"""Stage ``manifest``: canonical manifest, five non-IID clients, fixed validation and test (study 3.2).

1. Keep the images clearance keeps (family representatives, or whole families; ``ignore_families``,
   for the leakage experiment only, keeps every image and ignores families: a leaky split by design).
2. Check the targets fit (per class and site group). When they do not, stop with the demand
   against what is available and the two ways out (``clearance.family_policy: whole_families``
   or ``manifest.allow_scaling: true``); only when scaling is allowed is every target scaled by
   one common factor, with a warning, ``scale_factor`` in manifest.json and Table 2 as built
   beside the study's in the report (``fedhisto.manifest.targets``).
3. Client pools: client k draws, per class, its target count from its configured sites, in a
   seeded deterministic order.
4. Global validation, then global test, per class from the internal images left over; with
   ``manifest.stratify_by_source`` each class's counts are first shared out over the sources of its
   leftovers in proportion (``fedhisto.manifest.source_audit``), and each source fills its share.
5. Holdouts per client and available class: ``round(frac * n)`` (Python's half-to-even),
   keeping at least one optimisation image when n >= 2, seeded shuffle with the split seed.
6. Source audit: ``source_composition.csv`` (partition x source x class) and, in manifest.json,
   the classes of validation / test that come from one source while the partition draws from several.
7. Boundary audit: no SHA-256 match, no confirmed family edge and no patient / slide edge may
   join two different protected partitions (client optimisation sets and holdouts, validation,
   test, external); ``metadata_edges.csv`` lists the patient / slide edges (``fedhisto.realdata.units``).

Where a source names patients or slides, a unit is a family joined with every other image of its
patient or slide; a unit holding several classes is drawn class by class, and the first partition
that takes part of it claims the rest (only it may take them; otherwise they stay unused).

Families (``whole_families``) are drawn whole while they fit. To hit a count exactly a
partition may take part of one family; the rest of that family is then left unused, never
placed in another partition, so a family never spans two partitions. With
``representatives`` every unit is one image and none of this arises.
"""

from __future__ import annotations

import csv
import hashlib
import logging
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from fedhisto import CLASSES
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.manifest.source_audit import SOURCE_COLUMNS, allocate, single_source_classes, source_composition
from fedhisto.manifest.targets import (
    client_holdouts,
    demand_rows,
    fit_factor,
    scale,
    scaling_warning,
    shortfall_lines,
    shortfall_message,
    ways_out,
)
from fedhisto.realdata.sources import read_sources_csv
from fedhisto.realdata.units import (
    METADATA_EDGE_COLUMNS,
    group_key,
    metadata_edges,
    patient_audit,
    unit_groups,
)

log = logging.getLogger(__name__)

STAGE = "manifest"
MANIFEST_COLUMNS = ("sample_id", "relpath", "path", "label", "source", "site", "cohort", "differentiation",
                    "magnification", "sha256", "family", "partition", "client", "split")


class ManifestError(RuntimeError):
    """The corpus cannot be partitioned as configured, or a boundary leaks."""


def sample_id(relpath: str) -> str:
    """Stable id from the portable relative path (moving the data keeps ids)."""
    return hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:16]


def _order(ids: list[str], seed: int, *stream: int) -> list[str]:
    """Seeded deterministic shuffle of a sorted id list."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, *stream]))
    ids = sorted(ids)
    return [ids[i] for i in rng.permutation(len(ids))]


def build_manifest(sources_csv: str | Path, families_csv: str | Path, cfg: Config) -> tuple[list[dict], dict]:
    meta = {r.relpath: r for r in read_sources_csv(sources_csv)}
    with Path(families_csv).open() as fh:
        fams = list(csv.DictReader(fh))
    unknown = [r["relpath"] for r in fams if r["relpath"] not in meta]
    if unknown or len(fams) != len(meta):
        raise ManifestError(f"clearance families and sources differ ({len(fams)} vs {len(meta)} images; "
                            f"unknown: {unknown[:3]}): rerun clearance")
    policy = cfg.clearance.family_policy
    # ignore_families (the leakage experiment's leaky split): every image, copies included, is its own unit
    leaky = policy == "ignore_families"
    kept = fams if leaky else [r for r in fams if r["keep"] == "True"]
    by_id = {sample_id(r["relpath"]): r for r in kept}
    if len(by_id) != len(kept):
        raise ManifestError("two kept images share a sample id (portable paths collide)")
    internal_ids = [i for i, r in by_id.items() if r["cohort"] == "internal"]
    available: dict[str, Counter] = defaultdict(Counter)
    for i in internal_ids:
        available[by_id[i]["site"]][by_id[i]["label"]] += 1
    internal = Counter(by_id[i]["label"] for i in internal_ids)
    requested = cfg.partition_targets()
    demand = demand_rows(requested, available, cfg.manifest.client_sites, internal)
    factor = fit_factor(demand)
    targets = requested
    if factor < 1.0:
        if not cfg.manifest.allow_scaling:
            raise ManifestError(shortfall_message(demand, policy))
        log.warning(scaling_warning(factor, demand))
        targets = scale(requested, factor)
    seed = cfg.manifest.split_seed
    # Units are what must stay together: a whole family (family_policy whole_families) or one image,
    # joined with every other image of its patient or slide where a source names them (realdata.units).
    patient_of = {i: group_key(by_id[i]["site"], meta[by_id[i]["relpath"]].patient) for i in internal_ids
                  if meta[by_id[i]["relpath"]].patient}
    members: dict[str, list[str]] = defaultdict(list)
    if patient_of:
        group_of = unit_groups(sorted(internal_ids), {i: by_id[i]["family"] for i in internal_ids}, patient_of,
                               use_families=not leaky)
        for i in internal_ids:
            members[(group_of[i], by_id[i]["label"])].append(i)
        unit_of = {i: sorted(members[(group_of[i], by_id[i]["label"])]) for i in internal_ids}
        # a group holding several classes (a slide's tumour and normal tiles) is drawn class by class: the
        # first partition to take any of it claims the rest, which only that partition may take (or nobody)
        labels_of: dict[str, set[str]] = defaultdict(set)
        for i in internal_ids:
            labels_of[group_of[i]].add(by_id[i]["label"])
        cross_class = any(len(v) > 1 for v in labels_of.values())
    else:
        for i in internal_ids:
            members[by_id[i]["family"]].append(i)
        unit_of = {i: [i] if leaky else sorted(members[by_id[i]["family"]]) for i in internal_ids}
        group_of, cross_class = {}, False
    claims: dict[str, tuple[str, str | None]] = {}  # group -> (partition, split; None while only the client is fixed)
    assignment: dict[str, tuple[str, str, str]] = {}  # id -> (partition, client, split)
    unused = ("unused", "", "unused")

    def allowed(unit: list[str], owner: tuple[str, str | None] | None) -> bool:
        c = claims.get(group_of[unit[0]]) if cross_class and owner else None
        return c is None or (c[0] == owner[0] and (c[1] is None or owner[1] is None or c[1] == owner[1]))

    def claim(ids: list[str], owner: tuple[str, str | None] | None) -> None:
        if cross_class and owner:
            for i in ids:
                if claims.get(group_of[i], (None, None))[1] is None:
                    claims[group_of[i]] = owner

    def take(candidates: list[str], count: int, units: dict[str, list[str]],
             blocked: set[str] = frozenset(), owner: tuple[str, str | None] | None = None) -> list[str]:  # type: ignore[assignment]
        """Exactly ``count`` images in the given order, families kept out of every other partition.

        First whole units that fit and of which nothing is placed, in order (the only pass that
        matters when units are single images); then, while short, part of the untouched unit that
        wastes least, whose rest is marked unused here so that no other partition can take it.
        ``owner`` (partition, split): with groups that span classes, units another partition has
        claimed are blocked, and units this partition claimed come first, so that less is wasted.
        """
        chosen: list[str] = []
        placed: set[str] = set()
        if cross_class and owner:
            mine = [i for i in candidates if claims.get(group_of[i], ("",))[0] == owner[0]]
            candidates = mine + [i for i in candidates if claims.get(group_of[i], ("",))[0] != owner[0]]

        def untouched(unit: list[str]) -> bool:
            return not any(u in assignment or u in placed or u in blocked for u in unit) and allowed(unit, owner)

        for i in candidates:
            if len(chosen) == count:
                break
            unit = units.get(i, [i])
            if untouched(unit) and len(chosen) + len(unit) <= count:
                chosen += unit
                placed.update(unit)
        in_order = {i: n for n, i in enumerate(candidates)}
        while len(chosen) < count:
            need = count - len(chosen)
            parts = {tuple(units.get(i, [i])): i for i in reversed(candidates) if untouched(units.get(i, [i]))}
            if not parts:
                break
            # best fit: the smallest unit that covers what is missing (else the largest), then the given order
            unit = list(min(parts, key=lambda u: (len(u) < need, len(u) if len(u) >= need else -len(u),
                                                  in_order[parts[u]])))
            part = sorted((u for u in unit if u in in_order), key=in_order.__getitem__)[:need]
            chosen += part
            placed.update(unit)
            for u in unit:
                if u not in part:
                    assignment[u] = unused
        claim(chosen, owner)
        return chosen

    def short(what: str, need: int, got: int, sites: str) -> ManifestError:
        return ManifestError(
            f"{what} needs {need} images from sites {sites}, only {got} left (a family never spans two partitions: "
            "the rest of a family a partition takes part of stays unused). Demand against what clearance kept:\n"
            + "\n".join(shortfall_lines(demand)) + "\n" + ways_out(policy, scaling=False))

    holdouts = client_holdouts(targets, cfg.manifest.holdout_fraction)
    for k, (client, pool) in enumerate(sorted(targets.clients.items())):
        sites = set(cfg.manifest.client_sites.get(client, []))
        for c, cls in enumerate(CLASSES):
            free = _order([i for i in internal_ids if i not in assignment and by_id[i]["label"] == cls
                           and (not sites or by_id[i]["site"] in sites)], seed, 1, k, c)
            chosen = take(free, pool[c], unit_of, owner=(client, None))
            if len(chosen) < pool[c]:
                raise short(f"client {client} {cls}", pool[c], len(chosen), str(sorted(sites)))
            n_hold = holdouts[client][c]  # len(chosen) == pool[c] here
            in_pool = set(chosen)  # holdouts are drawn in units of this pool too
            holdout = set(take(_order(chosen, seed, 2, k, c), n_hold,
                               {i: [u for u in unit_of[i] if u in in_pool] for i in chosen}, owner=(client, "holdout")))
            for i in chosen:  # a group another class already put in the holdout cannot train here: unused
                if i not in holdout and i not in assignment and not allowed([i], (client, "optimisation")):
                    assignment[i] = unused
            optimisation = [i for i in chosen if i not in holdout and i not in assignment]
            claim(optimisation, (client, "optimisation"))
            missing = len(chosen) - len(holdout) - len(optimisation)  # rest of a family split by the holdout
            if missing:  # refill the optimisation set from untouched families, in the pool's order
                extra = take(free, missing, unit_of, blocked=in_pool, owner=(client, "optimisation"))
                if len(extra) < missing:
                    raise short(f"client {client} {cls} (optimisation refill)", missing, len(extra),
                                str(sorted(sites)))
                optimisation += extra
            for i in holdout:
                assignment[i] = (client, client, "holdout")
            for i in optimisation:
                assignment[i] = (client, client, "optimisation")
    stratify = cfg.manifest.stratify_by_source
    for c, cls in enumerate(CLASSES):
        free = _order([i for i in internal_ids if i not in assignment and by_id[i]["label"] == cls], seed, 3, c)
        splits = (("validation", targets.validation[c]), ("test", targets.test[c]))
        # stratified: both splits mirror the sources of this class's leftovers, allocated before either is drawn
        shares = {split: allocate(count, Counter(by_id[i]["site"] for i in free)) for split, count in splits} \
            if stratify else {}
        for split, count in splits:
            chosen: list[str] = []
            for source, n in sorted(shares.get(split, {}).items()):
                part = take([i for i in free if i not in assignment and by_id[i]["site"] == source], n, unit_of,
                            owner=(split, split))
                for i in part:
                    assignment[i] = (split, "", split)
                chosen += part
            # unstratified, or what a source could not fill (family units): any leftover of the class, in order
            rest = take([i for i in free if i not in assignment], count - len(chosen), unit_of, owner=(split, split))
            if stratify and rest:
                log.warning("manifest.stratify_by_source: %s %s took %d image(s) beyond its sources' shares %s "
                            "(families could not fill them exactly)", split, cls, len(rest), shares[split])
            chosen += rest
            if len(chosen) < count:
                raise short(f"{split} {cls}", count, len(chosen), "(any internal)")
            for i in chosen:
                assignment[i] = (split, "", split)
        for i in free:
            if i not in assignment:
                assignment[i] = unused
    for i, r in by_id.items():
        if r["cohort"] == "external":
            assignment[i] = ("external", "", "external")
    rows = []
    for i in sorted(by_id, key=lambda i: by_id[i]["relpath"]):
        r = by_id[i]
        partition, client, split = assignment[i]
        m = meta[r["relpath"]]
        rows.append({"sample_id": i, "relpath": r["relpath"], "path": r["path"], "label": r["label"],
                     "source": m.source, "site": r["site"], "cohort": r["cohort"],
                     "differentiation": m.differentiation, "magnification": m.magnification, "sha256": r["sha256"],
                     "family": r["family"], "partition": partition, "client": client, "split": split,
                     **({"patient": m.patient} if m.patient else {})})
    info = {"scale_factor": factor, "allow_scaling": cfg.manifest.allow_scaling, "scaled": factor < 1.0,
            "family_policy": policy, "requested_targets": requested.model_dump(mode="json"),
            "targets": targets.model_dump(mode="json")}
    if factor < 1.0:
        info["shortfalls"] = demand
    return rows, info


def manifest_columns(rows: list[dict]) -> tuple[str, ...]:
    """The patient column only where a source names patients or slides: a cohort without them keeps its bytes."""
    return (*MANIFEST_COLUMNS, "patient") if any("patient" in r for r in rows) else MANIFEST_COLUMNS


def boundary(row: dict) -> str:
    """The protected boundary an image sits in (client optimisation and holdout are distinct)."""
    return f"{row['client']}:{row['split']}" if row["client"] else row["split"]


def boundary_audit(rows: list[dict], edges_csv: str | Path) -> dict:
    digests = {r["relpath"]: r["sha256"] for r in rows}
    where = {r["relpath"]: boundary(r) for r in rows if r["split"] != "unused"}
    leaks = []
    pixel_edges = 0
    with Path(edges_csv).open() as fh:
        for e in csv.DictReader(fh):
            pixel_edges += e["decision"] == "confirmed"
            if e["decision"] == "confirmed" and e["a"] in where and e["b"] in where and where[e["a"]] != where[e["b"]]:
                leaks.append({"a": e["a"], "b": e["b"], "stage": e["stage"], "boundaries": [where[e["a"]], where[e["b"]]]})
    by_digest: dict[str, set] = defaultdict(set)
    for rel, b in where.items():
        if rel in digests:
            by_digest[digests[rel]].add(b)
    exact = [d for d, bs in by_digest.items() if len(bs) > 1]
    # which edges came from pixels (clearance's edges.csv) and which from metadata (metadata_edges.csv)
    return {"cross_boundary_family_edges": leaks, "cross_boundary_exact_matches": exact,
            "confirmed_pixel_edges": pixel_edges, **patient_audit(rows, where, metadata_edges(rows)),
            "boundaries": sorted(set(where.values()))}


def composition(rows: list[dict]) -> list[dict]:
    """Partition x class counts: client pools before holdout, optimisation, holdout; val; test; external."""
    count: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for r in rows:
        if r["client"]:
            count[(r["client"], "pool")][r["label"]] += 1
            count[(r["client"], r["split"])][r["label"]] += 1
            count[("all_clients", r["split"])][r["label"]] += 1
        else:
            count[(r["partition"], "all")][r["label"]] += 1
    order = [(f"C{k}", s) for k in range(1, 6) for s in ("pool", "optimisation", "holdout")] + \
        [("all_clients", "optimisation"), ("all_clients", "holdout"), ("validation", "all"), ("test", "all"),
         ("external", "all"), ("unused", "all")]
    return [{"partition": p, "subset": s, **{c: count[(p, s)][c] for c in CLASSES},
             "total": sum(count[(p, s)].values())} for p, s in order if (p, s) in count or p.startswith("C")]


def dataset_identity(rows: list[dict]) -> str:
    """Digest binding training and inference to this exact inventory and assignment."""
    lines = sorted(f"{r['sample_id']},{r['label']},{r['partition']},{r['client']},{r['split']},{r['sha256']}"
                   for r in rows)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def run_manifest(sources_csv: str | Path, families_csv: str | Path, edges_csv: str | Path, cfg: Config,
                 out_dir: str | Path) -> dict:
    rows, info = build_manifest(sources_csv, families_csv, cfg)
    audit = boundary_audit(rows, edges_csv)
    leaks = len(audit["cross_boundary_family_edges"]) + len(audit["cross_boundary_exact_matches"]) + \
        len(audit["cross_boundary_metadata_edges"])
    if cfg.clearance.family_policy == "ignore_families":
        # wanted only by the leakage experiment: recorded loudly, never silently
        log.warning("clearance.family_policy ignore_families: augmentation families are IGNORED; %d family edge(s) "
                    "and exact match(es) cross protected boundaries. Never report these scores as clean.", leaks)
        result = f"LEAKY by design (family_policy ignore_families): {leaks} cross-boundary edge(s)"
    elif leaks:
        raise ManifestError(f"protected boundaries leak: {len(audit['cross_boundary_family_edges'])} family edge(s) "
                            f"{audit['cross_boundary_family_edges'][:5]}, {len(audit['cross_boundary_exact_matches'])} "
                            f"exact match(es), {len(audit['cross_boundary_metadata_edges'])} patient/slide edge(s) "
                            f"{audit['cross_boundary_metadata_edges'][:5]}")
    else:
        result = "zero cross-boundary exact and family edges"
    if audit["patients_or_slides"]:
        result += (f"; {len(audit['patients_spanning_partitions'])} of {audit['patients_or_slides']} patients/slides "
                   "span two partitions")
    out = Path(out_dir)
    prov = provenance_block(STAGE, stage_block(cfg, STAGE), {"sources": sources_csv, "families": families_csv, "edges": edges_csv})
    comp = composition(rows)
    write_csv(out / "manifest.csv", rows, manifest_columns(rows))
    write_csv(out / "metadata_edges.csv", metadata_edges(rows), METADATA_EDGE_COLUMNS)
    write_csv(out / "composition.csv", comp, ["partition", "subset", *CLASSES, "total"])
    write_csv(out / "source_composition.csv", source_composition(rows), SOURCE_COLUMNS)
    summary = {"dataset_identity": dataset_identity(rows), "images": len(rows), **info,
               "boundary_audit": {**audit, "result": result},
               "source_audit": {"stratify_by_source": cfg.manifest.stratify_by_source,
                                "single_source_classes": single_source_classes(rows)},
               "provenance": prov}
    write_json(out / "manifest.json", summary)
    for name in ("manifest.csv", "composition.csv", "source_composition.csv", "metadata_edges.csv"):
        write_sidecar(out / name, prov)
    return summary
