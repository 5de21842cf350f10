"""``fedhisto check-uploads``: the coordinator's cross-site checks, from the sites' ``upload.json`` only.

1. **Gate.** Every upload is validated (:func:`upload.read_upload`: schema, descriptor of 14 finite
   numbers, counts, hashes, the site's index) and its code identity checked against the
   coordinator's (:func:`code_identity.check_code`). Refusals name the site and the reason; all
   are collected (``refused.json``) before the check stops, and nothing of the accepted sites is
   touched, so only the refused site has to redo its preparation.
2. **Stain descriptors.** The clients' raw descriptors go through :func:`stain.descriptors_document`,
   the stain stage's own standardisation and centroid, into ``descriptors.json`` / ``.csv`` (the
   file every site's SuperNode conditions on; no ``view_pairs.png``: that needs pixels).
3. **Cross-site duplicate audit on hashes.** Nodes are the images of every site; edges join (a) the
   members of one site's local clearance family and (b) images of two different sites with the same
   SHA-256 or a dihedral PHash Hamming distance <= ``clearance.phash_threshold`` (the clearance
   engine's first two detectors; its SIFT verification needs pixels, so it cannot run here). A
   connected component holding kept images of more than one local family is a suspected
   cross-site family: the local family first in (site id, smallest sample id) order stays, every
   other's images go on its site's drop list. ``duplicates.csv`` names every suspected pair by site
   and sample id; ``drops/<site>.csv`` is what each site passes back to ``site-prepare --exclude``.
   The rule is deterministic and drops already applied stay on the list, so preparing again with
   it and re-uploading leaves every component with one kept family (``unresolved: 0``).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from fedhisto.clearance.hashing import phash_pairs
from fedhisto.config.study import Config
from fedhisto.federation.upload import SiteUpload, UploadError, read_upload, settings_digest
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.code_identity import CodeMismatch, check_code, code_identity
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.realdata.union_find import UnionFind
from fedhisto.stain.stage import descriptors_document, write_descriptors_csv

STAGE = "coordinator"
PAIR_COLUMNS = ("site_a", "sample_id_a", "site_b", "sample_id_b", "match", "distance", "component")
DROP_COLUMNS = ("sample_id", "component", "kept_site", "kept_sample_id")


class UploadsRefused(RuntimeError):
    """One or more uploads were refused; ``refusals`` maps site to reason."""

    def __init__(self, refusals: dict[str, str]) -> None:
        self.refusals = refusals
        super().__init__("refused: " + "; ".join(f"{s}: {r}" for s, r in refusals.items()))


def gate(paths: list[str | Path], cfg: Config) -> tuple[list[SiteUpload], dict[str, str]]:
    """Accepted uploads (sorted by site) and refusals (site -> reason), every upload examined."""
    ours = code_identity()
    accepted: dict[str, SiteUpload] = {}
    refusals: dict[str, str] = {}
    for path in paths:
        try:
            up = read_upload(path, cfg)
        except UploadError as exc:
            refusals[exc.site] = str(exc)
            continue
        try:
            check_code(f"site {up.site}", up.code, ours)
        except CodeMismatch as exc:
            refusals[up.site] = f"site {up.site}: upload refused: {exc}"
            continue
        if up.site in accepted:
            refusals[up.site] = f"site {up.site}: two uploads ({path} and an earlier one)"
            continue
        accepted[up.site] = up
    clients = sorted(cfg.manifest.holdout_fraction)
    have = {s for s, u in accepted.items() if u.role == "client"} | set(refusals)
    for site in clients:
        if site not in have:
            refusals[site] = f"site {site}: no upload (configured clients: {clients})"
    return [accepted[s] for s in sorted(accepted)], refusals


def standardised_descriptors(uploads: list[SiteUpload]) -> dict:
    """``descriptors.json`` content from the client uploads (sorted by site id, as the stain stage sorts)."""
    per_client = {u.site: u.descriptor for u in sorted(uploads, key=lambda u: u.site) if u.role == "client"}
    return descriptors_document({s: {"raw": d["raw"], "tissue_pixels": d["tissue_pixels"],
                                     "fallback": d.get("fallback"), "he_check": d.get("he_check"),
                                     "sample_ids": d["sample_ids"]} for s, d in per_client.items()})


def duplicate_audit(uploads: list[SiteUpload], phash_threshold: int) -> dict:
    """Suspected cross-site pairs, components and per-site drop lists (see the module docstring)."""
    nodes = [(u.site, im) for u in uploads for im in u.images]
    uf = UnionFind(len(nodes))
    first_of_family: dict[tuple[str, str], int] = {}
    for i, (site, im) in enumerate(nodes):
        key = (site, im["family"])
        if key in first_of_family:
            uf.union(first_of_family[key], i)
        else:
            first_of_family[key] = i
    pairs: list[dict] = []
    by_digest: dict[str, list[int]] = defaultdict(list)
    for i, (_, im) in enumerate(nodes):
        by_digest[im["sha256"]].append(i)
    exact = set()
    for group in by_digest.values():
        for a in group:
            for b in group:
                if a < b and nodes[a][0] != nodes[b][0]:
                    exact.add((a, b))
                    pairs.append({"a": a, "b": b, "match": "exact", "distance": 0})
    hashes = np.array([[int(h, 16) for h in im["phash"]] for _, im in nodes], dtype=np.uint64)
    for a, b, d in phash_pairs(hashes, phash_threshold):
        if nodes[a][0] != nodes[b][0] and (a, b) not in exact:
            pairs.append({"a": a, "b": b, "match": "phash", "distance": d})
    for p in pairs:
        uf.union(p["a"], p["b"])
    site_order = {s: n for n, s in enumerate(sorted({u.site for u in uploads}))}
    components: dict[int, list[int]] = defaultdict(list)
    for i in range(len(nodes)):
        components[uf.find(i)].append(i)
    comp_name: dict[int, str] = {}
    drops: dict[str, list[dict]] = {u.site: [] for u in uploads}
    suspected = unresolved = 0
    for root, members in components.items():
        # a local family is eligible when it would be in its site's manifest but for the drop list
        fams: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i in members:
            if nodes[i][1]["kept"] or nodes[i][1]["excluded"]:
                fams[(nodes[i][0], nodes[i][1]["family"])].append(i)
        sites = {nodes[i][0] for i in members}
        if len(sites) < 2:
            continue
        name = f"x{suspected:05d}"
        suspected += 1
        comp_name[root] = name
        if len(fams) < 2:
            continue
        order = sorted(fams, key=lambda f: (site_order[f[0]], min(nodes[i][1]["sample_id"] for i in fams[f])))
        keep_site = order[0][0]
        keep_id = min(nodes[i][1]["sample_id"] for i in fams[order[0]])
        still_kept = sum(1 for f in order[1:] for i in fams[f] if nodes[i][1]["kept"])
        unresolved += still_kept > 0
        for f in order[1:]:
            for i in fams[f]:
                drops[f[0]].append({"sample_id": nodes[i][1]["sample_id"], "component": name,
                                    "kept_site": keep_site, "kept_sample_id": keep_id})
    kept = {(site, im["sample_id"]) for site, im in nodes if im["kept"]}
    pair_rows = [{"site_a": nodes[p["a"]][0], "sample_id_a": nodes[p["a"]][1]["sample_id"],
                  "site_b": nodes[p["b"]][0], "sample_id_b": nodes[p["b"]][1]["sample_id"], "match": p["match"],
                  "distance": p["distance"], "component": comp_name[uf.find(p["a"])]} for p in pairs]
    pair_rows.sort(key=lambda r: (r["component"], r["site_a"], r["sample_id_a"], r["site_b"], r["sample_id_b"]))
    for rows in drops.values():
        rows.sort(key=lambda r: r["sample_id"])
    members_of = {(nodes[i][0], nodes[i][1]["sample_id"]): comp_name[root]
                  for root, members in components.items() if root in comp_name for i in members}
    return {"pairs": pair_rows, "drops": drops, "components": members_of,
            "summary": {"images": len(nodes), "suspected_pairs": len(pair_rows),
                        "exact_pairs": sum(1 for p in pairs if p["match"] == "exact"),
                        "phash_pairs": sum(1 for p in pairs if p["match"] == "phash"),
                        "suspected_components": suspected, "unresolved_components": unresolved,
                        "drops_per_site": {s: len(r) for s, r in sorted(drops.items())},
                        "pending_drops_per_site": {s: sum(1 for r in rows if (s, r["sample_id"]) in kept)
                                                   for s, rows in sorted(drops.items())}}}


def federation_identity(uploads: list[SiteUpload]) -> str:
    """One digest of every site's manifest identity: what ``fedhisto federate --dataset-identity`` binds a
    run to when no central manifest exists (a site that re-prepares changes it)."""
    lines = sorted(f"{u.site}:{u.role}:{u.manifest_identity}" for u in uploads)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def check_uploads(paths: list[str | Path], cfg: Config, out_dir: str | Path) -> dict:
    """Gate, standardise and audit; writes ``out_dir``; raises :class:`UploadsRefused` after writing
    ``refused.json`` when any site is refused."""
    out = Path(out_dir)
    uploads, refusals = gate(paths, cfg)
    prov = provenance_block(STAGE, {"settings": settings_digest(cfg)}, {str(p): p for p in paths})
    if refusals:
        write_json(out / "refused.json", {"refused": refusals, "accepted": [u.site for u in uploads],
                                          "provenance": prov})
        raise UploadsRefused(refusals)
    (out / "refused.json").unlink(missing_ok=True)
    doc = standardised_descriptors(uploads)
    write_json(out / "descriptors.json", {**doc, "provenance": prov})
    write_descriptors_csv(out / "descriptors.csv", doc)
    write_sidecar(out / "descriptors.csv", prov)
    audit = duplicate_audit(uploads, cfg.clearance.phash_threshold)
    write_csv(out / "duplicates.csv", audit["pairs"], PAIR_COLUMNS)
    write_sidecar(out / "duplicates.csv", prov)
    for site, rows in audit["drops"].items():
        write_csv(out / "drops" / f"{site}.csv", rows, DROP_COLUMNS)
    summary = {"sites": {u.site: {"role": u.role, "class_counts": u.class_counts, "images": len(u.images),
                                  "kept": u.kept(), "manifest_identity": u.manifest_identity,
                                  "code": u.code} for u in uploads},
               "dataset_identity": federation_identity(uploads), "duplicates": audit["summary"], "provenance": prov}
    write_json(out / "check.json", summary)
    return json.loads(json.dumps(summary, default=str))
