"""The embedded synthetic cohort: plan (sites, classes, differentiation, magnification, planted
duplicate families), render originals and planted copies in parallel, and list them.

Synthetic layout: internal sites are LC25000-shaped (``images/site3/lung_scc/lungscc17.jpeg``),
the external site is LungHist700-shaped (``images/external/aca_bd_20x_12.jpg``). Originals
are listed before planted copies, so a clearance stage that keeps the first-listed member of
each family lands exactly on the profile's counts.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from PIL import Image

from fedhisto import CLASSES
from fedhisto.config.profiles import PROFILES
from fedhisto.config.study import SyntheticCohort
from fedhisto.infra.atomic import write_bytes, write_csv
from fedhisto.infra.progress import progress_iter
from fedhisto.realdata.sources import SourceRow
from fedhisto.synth.relatives import encode_jpeg, make_copy
from fedhisto.synth.stain_styles import SITE_STYLES, SiteStyle, render_rgb, style_at
from fedhisto.synth.tissue import tissue

log = logging.getLogger(__name__)
LC_FOLDER = {"ACA": "lung_aca", "Normal": "lung_n", "SCC": "lung_scc"}
LH_PREFIX = {"ACA": "aca", "Normal": "nor", "SCC": "scc"}
LH_DIFF = {"well": "bd", "moderately": "md", "poorly": "pd"}
MAGNIFICATION_SCALE = {"": 1.0, "20x": 1.0, "40x": 1.6}  # 40x shows the same tissue larger
BASE_EDGE = 128  # structure sizes in tissue.py are tuned at this tile edge
SITE_ORDER = [*SITE_STYLES]


@dataclass
class Member:
    """One synthetic image: an original or a planted copy."""

    site: str
    label: str
    key: int                  # unique per image; seeds its rendering
    differentiation: str = ""
    magnification: str = ""
    family: int = -1          # planted family id, -1 when not planted
    transform: str = ""       # empty for originals
    detail: str = ""
    source_key: int = -1      # for copies: the original's key
    relpath: str = ""

    @property
    def cohort(self) -> str:
        return "external" if self.site == "external" else "internal"


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def external_grades(cls: str, n: int, rng: np.random.Generator,
                    grades: Sequence[str] = ("well", "moderately", "poorly"),
                    magnifications: Sequence[str] = ("20x", "40x")) -> list[tuple[str, str]]:
    """(differentiation, magnification) of ``n`` external images of class ``cls``: ``grades`` and
    ``magnifications`` cycled, then shuffled (LungHist700's mix by default; Normal tissue has no grade)."""
    diffs = [""] * n if cls == "Normal" else [grades[i % len(grades)] for i in range(n)]
    mags = [magnifications[i % len(magnifications)] for i in range(n)]
    rng.shuffle(diffs)
    rng.shuffle(mags)
    return list(zip(diffs, mags, strict=True))


def plan_cohort(cfg: SyntheticCohort) -> list[Member]:
    """Every image of the cohort, originals first, with its planted copies after; pure and deterministic."""
    profile = PROFILES[cfg.profile]
    originals: list[Member] = []
    for site, counts in profile.site_counts().items():
        originals += [Member(site, cls, 0) for cls in CLASSES for _ in range(counts[cls])]
    rng = _rng(cfg.seed, 0)
    external = cfg.external_per_class or profile.external
    for c, cls in enumerate(CLASSES):
        originals += [Member("external", cls, 0, d, m)
                      for d, m in external_grades(cls, external[c], rng, cfg.external_grades,
                                                    cfg.external_magnifications)]
    for key, m in enumerate(originals):
        m.key = key

    planted = cfg.planted
    carriers = {cls: [s for s in SITE_ORDER if any(o.site == s and o.label == cls for o in originals)]
                for cls in CLASSES}
    copies: list[Member] = []
    family = 0
    for site in SITE_ORDER:
        pool = [o for o in originals if o.site == site]
        chosen = rng.choice(len(pool), size=min(planted.families_per_site, len(pool)), replace=False)
        for idx in sorted(int(i) for i in chosen):
            orig = pool[idx]
            orig.family = family
            lo, hi = planted.copies_per_family
            for _ in range(int(rng.integers(lo, hi + 1))):
                transform = planted.transforms[len(copies) % len(planted.transforms)]
                others = [s for s in carriers[orig.label] if s != site]
                target = str(rng.choice(others)) if others and rng.random() < planted.cross_site_probability else site
                diff, mag = orig.differentiation, orig.magnification
                if target != "external":  # internal sources carry no such metadata
                    diff, mag = "", ""
                elif site != "external":
                    diff = "" if orig.label == "Normal" else str(rng.choice(["well", "moderately", "poorly"]))
                    mag = str(rng.choice(["20x", "40x"]))
                copies.append(Member(target, orig.label, len(originals) + len(copies), diff, mag, family,
                                     transform, source_key=orig.key))
            family += 1
    members = originals + copies
    _assign_names(members, rng)
    names = Counter(m.relpath for m in members)
    clash = [n for n, k in names.items() if k > 1]
    if clash:  # a clash would silently overwrite an image; fail loudly instead
        raise RuntimeError(f"synthetic cohort plan gives several images the same path: {clash[:5]}")
    return members


def _assign_names(members: list[Member], rng: np.random.Generator) -> None:
    """Dataset-shaped file names, numbered in shuffled order so a name never reveals a copy."""
    groups: dict[tuple[str, str, str, str], list[Member]] = {}
    for m in members:  # internal names carry only the class; external names also grade and magnification
        key = (m.site, m.label, m.differentiation, m.magnification) if m.site == "external" else (m.site, m.label, "", "")
        groups.setdefault(key, []).append(m)
    for (site, cls, diff, mag), group in groups.items():
        numbers = rng.permutation(len(group)) + 1
        for m, n in zip(group, numbers, strict=True):
            if site == "external":
                parts = [LH_PREFIX[cls], *([LH_DIFF[diff]] if diff else []), mag, str(int(n))]
                m.relpath = f"external/{'_'.join(parts)}.jpg"
            else:
                m.relpath = f"{site}/{LC_FOLDER[cls]}/{LC_FOLDER[cls].replace('_', '')}{int(n)}.jpeg"


def render_original(m: Member, cfg: SyntheticCohort) -> bytes:
    rng = _rng(cfg.seed, 1, m.key)
    edge = cfg.external_image_size if m.site == "external" else cfg.image_size
    scale = edge / BASE_EDGE * MAGNIFICATION_SCALE[m.magnification]
    h, e = tissue(m.label, rng, edge, scale, m.differentiation)
    style = site_style(m.site, cfg).jittered(rng)
    rgb = render_rgb(h, e, style, rng, scale)
    return encode_jpeg(Image.fromarray(rgb), style.jpeg_quality)


def site_style(site: str, cfg: SyntheticCohort) -> SiteStyle:
    """A site's stain and scanner; the external site's at ``cfg.external_severity`` (1: as defined)."""
    if site != "external" or cfg.external_severity == 1.0:
        return SITE_STYLES[site]
    return style_at(cfg.external_severity)


def _render_job(args: tuple[Member, SyntheticCohort, str]) -> None:
    m, cfg, images_dir = args
    write_bytes(Path(images_dir) / m.relpath, render_original(m, cfg))


def _copy_job(args: tuple[Member, Member, SyntheticCohort, str]) -> str:
    m, orig, cfg, images_dir = args
    data = (Path(images_dir) / orig.relpath).read_bytes()
    out, detail = make_copy(data, m.transform, _rng(cfg.seed, 2, m.key), cfg.planted.max_rotation_deg,
                            SITE_STYLES[orig.site].jpeg_quality)
    write_bytes(Path(images_dir) / m.relpath, out)
    return detail


def _parallel_map(fn, jobs: Sequence, threads: int, desc: str) -> list:
    if threads <= 1:
        return [fn(j) for j in progress_iter(jobs, desc=desc, unit="img", logger=log)]
    # fork: workers inherit the imported modules (cheap) and need no importable __main__
    with get_context("fork").Pool(threads) as pool:
        return list(progress_iter(pool.imap(fn, jobs, chunksize=8), total=len(jobs), desc=desc, unit="img", logger=log))


def synthesize(cfg: SyntheticCohort, out_dir: Path, threads: int = 1) -> tuple[list[SourceRow], list[Member]]:
    """Render the cohort's images under ``out_dir/images`` and return its source rows and plan."""
    images_dir = out_dir / "images"
    members = plan_cohort(cfg)
    by_key = {m.key: m for m in members}
    originals = [m for m in members if not m.transform]
    copies = [m for m in members if m.transform]
    _parallel_map(_render_job, [(m, cfg, str(images_dir)) for m in originals], threads, "render")
    details = _parallel_map(_copy_job, [(m, by_key[m.source_key], cfg, str(images_dir)) for m in copies],
                            threads, "plant")
    for m, d in zip(copies, details, strict=True):
        m.detail = d
    rows = [SourceRow(path=(images_dir / m.relpath).as_posix(), relpath=m.relpath, label=m.label, source="synthetic",
                      site=m.site, cohort=m.cohort, differentiation=m.differentiation, magnification=m.magnification)
            for m in members]
    return rows, members


PLANTED_COLUMNS = ("family", "role", "relpath", "label", "site", "cohort", "transform", "detail", "original_relpath")


def write_planted(path: Path, members: list[Member]) -> None:
    by_key = {m.key: m for m in members}

    rows = [{"family": m.family, "role": "copy" if m.transform else "original", "relpath": m.relpath,
             "label": m.label, "site": m.site, "cohort": m.cohort, "transform": m.transform, "detail": m.detail,
             "original_relpath": by_key.get(m.source_key, m).relpath}
            for m in sorted((m for m in members if m.family >= 0), key=lambda m: (m.family, bool(m.transform), m.key))]
    write_csv(path, rows, PLANTED_COLUMNS)
