"""What leaves a site: the ONE document ``fedhisto site-prepare`` writes as ``upload.json``.

Everything a site sends the coordinator before training is a field of :class:`SiteUpload`; nothing
else leaves (no pixels, no file names or paths: images are named by their stable sample id, the
first 16 hex digits of SHA-256 of the portable relative path, and local families by an id hashed
from their members' paths):

===================  =============================================================================
field                content
===================  =============================================================================
``site``, ``role``   site id (``C3``) and role: ``client`` (trains; optimisation + holdout) or an
                     evaluation set it holds (``validation``, ``test``, ``external``)
``site_index``       the site's index k among the configured clients (seeds its random streams)
``code``             :func:`fedhisto.infra.code_identity.code_identity` (version, commit, source digest)
``settings_digest``  SHA-256 of the settings that shape the upload (:func:`settings_block`), so the
                     coordinator refuses a site that prepared with other thresholds or seeds
``class_counts``     images per split and class in the site's manifest (``optimisation``/``holdout``
                     for a client, the role's split otherwise)
``descriptor``       client only: raw 14-d stain descriptor, tissue pixel count, fallback note,
                     H&E check and the sample ids it was computed from (``stain.site_descriptor``)
``images``           every image listed at the site: ``sample_id``, ``sha256`` of its bytes,
                     ``phash`` (8 dihedral 64-bit PHashes, hex), local ``family``, ``kept`` (in the
                     site's manifest) and ``excluded`` (on a coordinator drop list)
``manifest_identity`` ``manifest.dataset_identity`` of the site's manifest (binds training to it)
===================  =============================================================================

:func:`read_upload` is the coordinator's gate: a document that is not this, down to the descriptor's
length and finiteness, is refused with :class:`UploadError` naming the site and the reason.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fedhisto import CLASSES
from fedhisto.config.study import Config
from fedhisto.infra.provenance import config_hash
from fedhisto.stain.stage import DESCRIPTOR_NAMES

UPLOAD_SCHEMA_VERSION = 1
ROLES = ("client", "validation", "test", "external")
ROLE_SPLITS = {"client": ("optimisation", "holdout"), "validation": ("validation",), "test": ("test",),
               "external": ("external",)}
_HEX16, _HEX64 = re.compile(r"^[0-9a-f]{16}$"), re.compile(r"^[0-9a-f]{64}$")
_FAMILY = re.compile(r"^fam-[0-9a-f]{12}$")


class UploadError(ValueError):
    """A site's upload is refused; the message starts with the site and says why (``site``: its id)."""

    def __init__(self, site: str, message: str) -> None:
        self.site = site
        super().__init__(message)


@dataclass
class SiteUpload:
    site: str
    role: str
    site_index: int | None
    code: dict
    settings_digest: str
    class_counts: dict[str, dict[str, int]]
    images: list[dict]
    manifest_identity: str
    descriptor: dict | None = None
    schema_version: int = UPLOAD_SCHEMA_VERSION
    provenance: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    def kept(self) -> int:
        return sum(1 for im in self.images if im["kept"])


def settings_block(cfg: Config) -> dict:
    """The settings every site must share for uploads to be comparable and the split to be the study's."""
    return {"clearance": cfg.clearance.model_dump(mode="json"), "stain": cfg.stain.model_dump(mode="json"),
            "split_seed": cfg.manifest.split_seed, "holdout_fraction": dict(cfg.manifest.holdout_fraction)}


def settings_digest(cfg: Config) -> str:
    return config_hash(settings_block(cfg))


def _fail(site: str, why: str) -> UploadError:
    return UploadError(site, f"site {site}: upload refused: {why}")


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _check_descriptor(site: str, d: object) -> None:
    if not isinstance(d, dict):
        raise _fail(site, f"descriptor must be an object with 'raw', got {type(d).__name__}")
    raw = d.get("raw")
    if not isinstance(raw, list) or len(raw) != len(DESCRIPTOR_NAMES):
        n = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise _fail(site, f"descriptor.raw must hold {len(DESCRIPTOR_NAMES)} numbers ({', '.join(DESCRIPTOR_NAMES)}), "
                          f"got {n}")
    bad = [DESCRIPTOR_NAMES[i] for i, v in enumerate(raw) if not _number(v)]
    if bad:
        raise _fail(site, f"descriptor.raw has non-finite or non-numeric value(s) for {bad}")
    for key in ("tissue_pixels", "sample_ids"):
        if key not in d:
            raise _fail(site, f"descriptor lacks '{key}'")
    if not isinstance(d["sample_ids"], list) or not all(isinstance(s, str) and _HEX16.match(s) for s in d["sample_ids"]):
        raise _fail(site, "descriptor.sample_ids must be a list of 16-hex-digit sample ids")


def _check_images(site: str, images: object, hashes_per_image: int) -> None:
    if not isinstance(images, list) or not images:
        raise _fail(site, "images must be a non-empty list")
    seen: set[str] = set()
    for n, im in enumerate(images):
        where = f"images[{n}]"
        if not isinstance(im, dict):
            raise _fail(site, f"{where} is not an object")
        sid = im.get("sample_id")
        if not isinstance(sid, str) or not _HEX16.match(sid):
            raise _fail(site, f"{where}.sample_id {sid!r} is not a 16-hex-digit sample id")
        if sid in seen:
            raise _fail(site, f"sample id {sid} listed twice")
        seen.add(sid)
        if not isinstance(im.get("sha256"), str) or not _HEX64.match(im["sha256"]):
            raise _fail(site, f"{where} ({sid}): sha256 is not 64 hex digits")
        ph = im.get("phash")
        if not isinstance(ph, list) or len(ph) != hashes_per_image or \
                not all(isinstance(h, str) and _HEX16.match(h) for h in ph):
            raise _fail(site, f"{where} ({sid}): phash must be {hashes_per_image} 16-hex-digit hashes")
        if not isinstance(im.get("family"), str) or not _FAMILY.match(im["family"]):
            raise _fail(site, f"{where} ({sid}): family {im.get('family')!r} is not a local family id")
        for flag in ("kept", "excluded"):
            if not isinstance(im.get(flag), bool):
                raise _fail(site, f"{where} ({sid}): '{flag}' must be true or false")


def parse_upload(doc: object, where: str, cfg: Config) -> SiteUpload:
    """Validate one upload document against the coordinator's config; ``where`` names it when no site does."""
    if not isinstance(doc, dict):
        raise _fail(where, f"not a JSON object ({type(doc).__name__})")
    site = doc.get("site")
    if not isinstance(site, str) or not site:
        raise _fail(where, "no site id")
    if doc.get("schema_version") != UPLOAD_SCHEMA_VERSION:
        raise _fail(site, f"schema_version {doc.get('schema_version')!r}, expected {UPLOAD_SCHEMA_VERSION}")
    missing = [k for k in ("role", "site_index", "code", "settings_digest", "class_counts", "images",
                           "manifest_identity") if k not in doc]
    if missing:
        raise _fail(site, f"missing field(s) {missing}")
    role = doc["role"]
    if role not in ROLES:
        raise _fail(site, f"role {role!r}; allowed: {', '.join(ROLES)}")
    if doc["settings_digest"] != settings_digest(cfg):
        raise _fail(site, "prepared with other clearance/stain/split settings than the coordinator's config "
                          f"(settings digest {str(doc['settings_digest'])[:12]}... vs {settings_digest(cfg)[:12]}...)")
    counts = doc["class_counts"]
    if not isinstance(counts, dict) or set(counts) != set(ROLE_SPLITS[role]) or not all(
            isinstance(c, dict) and set(c) == set(CLASSES) and all(isinstance(v, int) and v >= 0 for v in c.values())
            for c in counts.values()):
        raise _fail(site, f"class_counts must map {list(ROLE_SPLITS[role])} to non-negative counts of {list(CLASSES)}")
    hashes_per_image = 8 if cfg.clearance.dihedral_invariant else 1
    _check_images(site, doc["images"], hashes_per_image)
    kept = sum(1 for im in doc["images"] if im["kept"])
    if kept != sum(sum(c.values()) for c in counts.values()):
        raise _fail(site, f"{kept} kept image(s) listed but class_counts sum to {sum(sum(c.values()) for c in counts.values())}")
    if role == "client":
        _check_descriptor(site, doc.get("descriptor"))
        k = doc["site_index"]
        clients = sorted(cfg.manifest.holdout_fraction)
        if site not in clients:
            raise _fail(site, f"not a configured client (manifest.holdout_fraction has {clients})")
        if k != clients.index(site):
            raise _fail(site, f"site_index {k!r}, but {site} is client {clients.index(site)} of {clients}")
    elif doc.get("descriptor") is not None:
        raise _fail(site, f"a {role} site uploads no stain descriptor (it is conditioned on the centroid)")
    elif doc["site_index"] is not None:
        raise _fail(site, f"a {role} site has no client index (got site_index {doc['site_index']!r})")
    fields = {k: doc[k] for k in SiteUpload.__dataclass_fields__ if k in doc}
    return SiteUpload(**fields)


def read_upload(path: str | Path, cfg: Config) -> SiteUpload:
    """Read and validate ``upload.json``; any problem is an :class:`UploadError` naming the site."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(p.parent.name or str(p), f"{p}: not readable JSON ({exc})") from None
    return parse_upload(doc, p.parent.name or str(p), cfg)
