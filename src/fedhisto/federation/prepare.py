"""``fedhisto site-prepare``: everything before training, at a site, on the site's own images only.

Run by the site on its own folder (``--images``); it reads nothing else, and writes under ``--out``:

- ``sources.csv``: the site's images (path, portable relpath ``<source-site>/<path in folder>``, label);
- ``clearance/``: the clearance engine (``fedhisto.clearance``) within the site: ``edges.csv``,
  ``families.csv``, ``audit.json``, ``report.md``; a label-conflicting family stops here;
- ``manifest/``: the site's manifest, built by the manifest stage's own code (``fedhisto.manifest.stage``)
  with the site's kept images as its client pool, so the holdout split is the study's rule
  (``targets.holdout_count`` per class, the split seed's streams for client index k), and sample ids
  are the central pipeline's (hash of the portable relpath); an evaluation-only site (``--role
  validation|test|external``) lists its kept images under that split;
- ``stain/descriptor.json``: a client's raw 14-d descriptor (``stain.site_descriptor``);
- ``upload.json`` (+ provenance sidecar): the :class:`fedhisto.federation.upload.SiteUpload`, the only
  file that leaves the site.

An image that cannot be decoded stops the preparation naming the file (``imageio.load_rgb``); nothing
is skipped. A coordinator drop list (``--exclude drops/C3.csv``, from ``fedhisto check-uploads``) takes
cross-site duplicates out of the manifest; the upload still lists them (``excluded``), so the
coordinator sees the resolution.
"""

from __future__ import annotations

import csv
import json
import logging
from collections import Counter
from pathlib import Path

from fedhisto import CLASSES
from fedhisto.clearance.engine import audit_images
from fedhisto.clearance.stage import FAMILY_COLUMNS, family_rows, write_outputs
from fedhisto.config.study import Config, PartitionTargets
from fedhisto.federation.upload import ROLE_SPLITS, ROLES, SiteUpload, settings_digest
from fedhisto.infra.atomic import write_csv, write_json, write_with
from fedhisto.infra.code_identity import code_identity
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.manifest.stage import MANIFEST_COLUMNS, dataset_identity, run_manifest, sample_id
from fedhisto.realdata.sources import (
    IMAGE_SUFFIXES,
    READERS,
    SourceError,
    SourceRow,
    _check_openable,
    parse_label,
    write_sources_csv,
)
from fedhisto.stain.stage import site_descriptor

log = logging.getLogger(__name__)
STAGE = "site"
LAYOUTS = ("folders", "lc25000", "wsss4luad", "lunghist700")
#: ``--config`` keys of the site workflow (workflow/site/Snakefile) that are not pipeline settings
SITE_KEYS = ("site", "images", "role", "layout", "source_site", "exclude")


class SitePrepareError(RuntimeError):
    """The site's folder cannot be prepared; the message names the site and the file or value."""


def read_site_images(images: Path, source_site: str, layout: str, cohort: str) -> list[SourceRow]:
    """The site's images as source rows, sorted by portable relpath.

    ``folders``: one folder per class directly below ``images`` (``ACA``/``Normal``/``SCC`` or an alias
    such as ``lung_aca``; a class may be missing), images anywhere below it. The other layouts are the
    pipeline's dataset readers (``fedhisto.realdata.sources``) pointed at ``images``."""
    from fedhisto.config.study import SourceSpec

    if not images.is_dir():
        raise SourceError(f"site images: not a folder: {images}")
    if layout != "folders":
        rows, excluded = READERS[layout](SourceSpec(kind=layout, root=str(images), site=source_site, cohort=cohort))
        if excluded:
            log.warning("%d image(s) of %s map to no study class and are left out: %s", len(excluded), images,
                        [e.path for e in excluded[:5]])
        return sorted(rows, key=lambda r: r.relpath)
    rows = []
    for p in sorted(images.rglob("*")):
        rel = p.relative_to(images)
        if p.is_dir() or any(part.startswith(".") for part in rel.parts):
            continue
        if len(rel.parts) < 2:
            raise SourceError(f"{p}: images must lie in a class folder below {images} (ACA/, Normal/, SCC/)")
        if p.suffix.lower() not in IMAGE_SUFFIXES:
            raise SourceError(f"not an image file: {p} (accepted: {', '.join(sorted(IMAGE_SUFFIXES))})")
        _check_openable(p)
        rows.append(SourceRow(path=str(p.resolve()), relpath=f"{source_site}/{rel.as_posix()}",
                              label=parse_label(rel.parts[0], f"class folder {images / rel.parts[0]}"),
                              source="folder", site=source_site, cohort=cohort))
    if not rows:
        raise SourceError(f"no images below {images}")
    return rows


def folder_inventory(images: str | Path) -> str:
    """SHA-256 of the sorted ``relpath:size:mtime`` lines below ``images``: the site workflow's rerun
    trigger (a folder's own mtime does not change when a file deep inside it does)."""
    import hashlib

    root = Path(images)
    if not root.is_dir():
        return "missing"
    lines = sorted(f"{p.relative_to(root).as_posix()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                   for p in root.rglob("*") if p.is_file())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def read_drop_list(path: Path | None) -> set[str]:
    if path is None:
        return set()
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if "sample_id" not in (reader.fieldnames or ()):
            raise SitePrepareError(f"{path}: a drop list needs a 'sample_id' column")
        return {r["sample_id"] for r in reader}


def site_index(cfg: Config, site: str) -> int:
    clients = sorted(cfg.manifest.holdout_fraction)
    if site not in clients:
        raise SitePrepareError(f"site {site}: not a configured client; manifest.holdout_fraction names {clients} "
                               "(an evaluation-only site prepares with --role validation|test|external)")
    return clients.index(site)


def _site_config(cfg: Config, site: str, source_site: str, counts: Counter) -> Config:
    """The config under which the manifest stage builds exactly this site's pool: its kept images, the
    other clients empty (so k, the site's index, is the one the central manifest gives it), no
    validation or test drawn here."""
    zero = (0, 0, 0)
    clients = {c: tuple(counts[cls] for cls in CLASSES) if c == site else zero for c in cfg.manifest.holdout_fraction}
    manifest = cfg.manifest.model_copy(update={
        "targets": PartitionTargets(clients=clients, validation=zero, test=zero),
        "client_sites": {site: [source_site]}, "allow_scaling": False})
    return cfg.model_copy(update={"manifest": manifest})


def _evaluation_manifest(rows: list[SourceRow], fams: list[dict], role: str, out: Path) -> dict:
    """An evaluation-only site: every kept image is in the role's split (no client, no descriptor)."""
    meta = {r.relpath: r for r in rows}
    listed = []
    for f in sorted((f for f in fams if f["keep"]), key=lambda f: f["relpath"]):
        m = meta[f["relpath"]]
        listed.append({"sample_id": sample_id(m.relpath), "relpath": m.relpath, "path": m.path, "label": m.label,
                       "source": m.source, "site": m.site, "cohort": m.cohort, "differentiation": m.differentiation,
                       "magnification": m.magnification, "sha256": f["sha256"], "family": f["family"],
                       "partition": role, "client": "", "split": role})
    write_csv(out / "manifest.csv", listed, MANIFEST_COLUMNS)
    summary = {"dataset_identity": dataset_identity(listed), "images": len(listed), "role": role}
    write_json(out / "manifest.json", summary)
    return summary


def prepare_site(images: str | Path, site: str, out_dir: str | Path, cfg: Config, *, role: str = "client",
                 source_site: str | None = None, layout: str = "folders", exclude: str | Path | None = None,
                 threads: int = 1, progress: bool = False) -> SiteUpload:
    """Prepare one site from its own folder; returns (and writes as ``upload.json``) what it uploads."""
    if role not in ROLES:
        raise SitePrepareError(f"site {site}: role {role!r}; allowed: {', '.join(ROLES)}")
    if layout not in LAYOUTS:
        raise SitePrepareError(f"site {site}: layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    images, out = Path(images), Path(out_dir)
    k = site_index(cfg, site) if role == "client" else None
    source_site = source_site or images.resolve().name
    rows = read_site_images(images, source_site, layout, "external" if role == "external" else "internal")
    out.mkdir(parents=True, exist_ok=True)
    write_with(out / "sources.csv", lambda tmp: write_sources_csv(tmp, rows))

    # clearance within the site (an undecodable image raises here, naming the file)
    result = audit_images([r.path for r in rows], cfg.clearance, threads=threads, progress=progress)
    write_outputs(out / "clearance", rows, result, cfg.clearance, inputs={"sources": out / "sources.csv"})
    fams = family_rows(rows, result, cfg.clearance.family_policy)
    drops = read_drop_list(Path(exclude) if exclude else None)
    ids = {sample_id(r.relpath) for r in rows}
    stale = sorted(drops - ids)
    if stale:
        raise SitePrepareError(f"site {site}: drop list {exclude} names {len(stale)} sample id(s) this site does not "
                               f"hold, e.g. {stale[:3]}: it was made for another site or another image folder")
    for f in fams:
        f["excluded"] = sample_id(f["relpath"]) in drops
        f["keep"] = bool(f["keep"]) and not f["excluded"]
    families_csv = out / "clearance" / "families_for_manifest.csv"  # clearance's keep, less the drop list
    write_csv(families_csv, [{c: f[c] for c in FAMILY_COLUMNS} for f in fams], FAMILY_COLUMNS)

    if role == "client":
        counts = Counter(f["label"] for f in fams if f["keep"])
        summary = run_manifest(out / "sources.csv", families_csv, out / "clearance" / "edges.csv",
                               _site_config(cfg, site, source_site, counts), out / "manifest")
    else:
        summary = _evaluation_manifest(rows, fams, role, out / "manifest")
    with (out / "manifest" / "manifest.csv").open() as fh:
        manifest = list(csv.DictReader(fh))
    class_counts = {split: {cls: sum(1 for r in manifest if r["split"] == split and r["label"] == cls)
                            for cls in CLASSES} for split in ROLE_SPLITS[role]}
    unused = [r["sample_id"] for r in manifest if r["split"] not in ROLE_SPLITS[role]]
    if unused:  # the site's pool is all it keeps; anything else means the split rule changed under us
        raise SitePrepareError(f"site {site}: {len(unused)} kept image(s) not placed in {ROLE_SPLITS[role]}")

    descriptor = None
    if role == "client":
        descriptor = site_descriptor(manifest, site, k, cfg)
        descriptor = {**descriptor, "raw": [float(v) for v in descriptor["raw"]]}
        write_json(out / "stain" / "descriptor.json", descriptor)

    by_relpath = {r.relpath: i for i, r in enumerate(rows)}
    images_doc = [{"sample_id": sample_id(f["relpath"]), "sha256": f["sha256"],
                   "phash": [f"{int(h):016x}" for h in result.phashes[by_relpath[f["relpath"]]]],
                   "family": f["family"], "kept": f["keep"], "excluded": f["excluded"]}
                  for f in sorted(fams, key=lambda f: sample_id(f["relpath"]))]
    prov = provenance_block(STAGE, {"site": site, "role": role, "settings": settings_digest(cfg)},
                            {"manifest": out / "manifest" / "manifest.csv"})
    upload = SiteUpload(site=site, role=role, site_index=k, code=dict(code_identity()),
                        settings_digest=settings_digest(cfg), class_counts=class_counts, images=images_doc,
                        manifest_identity=summary["dataset_identity"], descriptor=descriptor, provenance=prov)
    write_json(out / "upload.json", upload.to_json())
    write_sidecar(out / "upload.json", prov)
    log.info("site %s prepared: %s; upload.json %.1f KiB", site, json.dumps(class_counts),
             (out / "upload.json").stat().st_size / 1024)
    return upload
