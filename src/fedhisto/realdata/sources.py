"""Readers for the dataset layouts users have on disk, all producing one table schema.

``sources.csv`` schema (also written by the synthetic cohort):

==================  ===========================================================
path                file to open (absolute for real data, workdir-relative for synthetic)
relpath             portable relative path ``<site>/<path inside the dataset>``: the
                    stable sample id is derived from it, so moving the data keeps ids
label               ACA, Normal or SCC
source              dataset kind: synthetic, lc25000, wsss4luad, lunghist700, csv
site                acquisition site (the client sources draw from sites)
cohort              internal (clients, validation, test) or external
differentiation     well / moderately / poorly, empty when unknown or not applicable
magnification       20x / 40x, empty when unknown
patient             ``slide:<id>`` or ``patient:<id>`` (``fedhisto.realdata.patients``); the
                    column is written only when some source knows patients or slides
==================  ===========================================================

Every problem is an error naming the file, folder, or label; an image is never skipped
silently. Files that are not images (``.DS_Store``, ``Thumbs.db``, a README, a metadata table)
are returned as exclusions with their reason (``fedhisto.realdata.listing``); WSSS4LUAD tiles
whose label vector maps to no study class are excluded only when the config says so.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from fedhisto import CLASSES
from fedhisto.config.study import SourceSpec
from fedhisto.realdata.listing import IMAGE_SUFFIXES, Exclusion, list_folder
from fedhisto.realdata.patients import MetadataError, patient_value, read_patient_table, slide_value

__all__ = ["IMAGE_SUFFIXES", "Exclusion", "SourceError", "SourceRow", "collect_sources"]

SOURCES_COLUMNS = ("path", "relpath", "label", "source", "site", "cohort", "differentiation", "magnification")
PATIENT_COLUMN = "patient"
LC25000_FOLDERS = {"lung_aca": "ACA", "lung_n": "Normal", "lung_scc": "SCC"}
LUNGHIST700_CLASS = {"aca": "ACA", "nor": "Normal", "scc": "SCC"}
LUNGHIST700_DIFF = {"bd": "well", "md": "moderately", "pd": "poorly"}
LUNGHIST700_NAME = re.compile(r"^(aca|scc|nor)_(?:(bd|md|pd)_)?(20x|40x)_[^/]+\.(?:jpe?g|png|tiff?)$", re.I)
WSSS4LUAD_NAME = re.compile(r"^.+-\[\s*([01])\s*,\s*([01])\s*,\s*([01])\s*\]\.png$", re.I)
WSSS4LUAD_SLIDE = re.compile(r"^([^-\s]+)-\d+-\d+-\[")  # <slide>-<x>-<y>-[...]
LABEL_ALIASES = {
    "aca": "ACA", "adenocarcinoma": "ACA", "lung_aca": "ACA", "luad": "ACA",
    "normal": "Normal", "n": "Normal", "nor": "Normal", "lung_n": "Normal",
    "scc": "SCC", "squamous": "SCC", "lung_scc": "SCC", "lusc": "SCC",
}


class SourceError(ValueError):
    """Bad input data: the message names the offending file, folder, or value."""


@dataclass(frozen=True)
class SourceRow:
    path: str
    relpath: str
    label: str
    source: str
    site: str
    cohort: str
    differentiation: str = ""
    magnification: str = ""
    patient: str = ""


def _require_dir(root: Path, what: str) -> None:
    if not root.exists():
        raise SourceError(f"{what}: folder not found: {root}")
    if not root.is_dir():
        raise SourceError(f"{what}: not a folder: {root}")


def _check_openable(path: Path) -> None:
    """Cheap header check so a zero-byte or non-image file is named here; clearance decodes fully."""
    try:
        with Image.open(path) as img:
            img.size  # noqa: B018 - touching the header is the check
    except (UnidentifiedImageError, OSError) as exc:
        raise SourceError(f"unreadable image: {path} ({exc})") from None


def _image_files(root: Path, what: str, named: dict[Path, str] | None = None) -> tuple[list[Path], list[Exclusion]]:
    """All image files below ``root``, and every other file with the reason it is not read."""
    files, excluded = list_folder(root, named)
    if not files:
        raise SourceError(f"{what}: no images found under {root}")
    return files, excluded


def _row(spec: SourceSpec, root: Path, path: Path, label: str, **meta: str) -> SourceRow:
    _check_openable(path)
    site = spec.site or spec.kind
    return SourceRow(path=str(path.resolve()), relpath=f"{site}/{path.relative_to(root).as_posix()}", label=label,
                     source=spec.kind, site=site, cohort=spec.cohort, **meta)


def read_lc25000(spec: SourceSpec) -> tuple[list[SourceRow], list[Exclusion]]:
    """LC25000 lung set: ``lung_aca/``, ``lung_n/``, ``lung_scc/`` (point ``root`` at ``lung_image_sets``)."""
    root = Path(spec.root)
    _require_dir(root, "LC25000")
    present = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    unknown = present - set(LC25000_FOLDERS)
    if unknown:
        raise SourceError(f"LC25000 {root}: unknown class folder(s) {sorted(unknown)}; "
                          f"expected only {sorted(LC25000_FOLDERS)}")
    rows, excluded = [], []
    for folder, label in LC25000_FOLDERS.items():
        _require_dir(root / folder, f"LC25000 class {label}")
        files, skipped = _image_files(root / folder, f"LC25000 {folder}")
        rows += [_row(spec, root, p, label) for p in files]
        excluded += skipped
    # files beside the class folders (a README, a licence) and in hidden folders are listed too, never
    # silently passed over
    excluded += [Exclusion(str(p.resolve()), "not in a class folder") for p in sorted(root.iterdir())
                 if p.is_file()]
    excluded += [Exclusion(str(f.resolve()), "hidden file or folder (name starts with '.')")
                 for d in sorted(root.iterdir()) if d.is_dir() and d.name.startswith(".")
                 for f in sorted(d.rglob("*")) if not f.is_dir()]
    return rows, excluded


def wsss4luad_label(tumor: int, stroma: int, normal: int) -> str | None:
    """Map a WSSS4LUAD ``[tumor, stroma, normal]`` vector to a study class.

    Tumour without normal tissue is lung adenocarcinoma (ACA), whatever stroma it holds;
    normal tissue without tumour is Normal. Tiles holding both tumour and normal tissue,
    stroma alone, or nothing have no single study class and return None.
    """
    del stroma  # stroma accompanies both classes and decides nothing
    if tumor and not normal:
        return "ACA"
    if normal and not tumor:
        return "Normal"
    return None


def read_wsss4luad(spec: SourceSpec) -> tuple[list[SourceRow], list[Exclusion]]:
    """WSSS4LUAD training tiles named ``<slide>-<x>-<y>-[tumor, stroma, normal].png``."""
    root = Path(spec.root)
    _require_dir(root, "WSSS4LUAD")
    rows = []
    files, excluded = _image_files(root, "WSSS4LUAD")
    for p in files:
        m = WSSS4LUAD_NAME.match(p.name)
        if not m:
            raise SourceError(f"WSSS4LUAD: file name carries no [tumor, stroma, normal] label: {p} "
                              "(point root at the labelled training folder)")
        slide = WSSS4LUAD_SLIDE.match(p.name)
        if not slide:
            raise SourceError(f"WSSS4LUAD: file name carries no slide id: {p} (expected "
                              "<slide>-<x>-<y>-[tumor, stroma, normal].png, e.g. 436219-7159-48057-[1, 0, 0].png); "
                              "without it tiles of one slide could land in two partitions")
        vec = tuple(int(g) for g in m.groups())
        label = wsss4luad_label(*vec)
        if label is None:
            reason = f"label vector {list(vec)} maps to no study class"
            if spec.unmapped == "error":
                raise SourceError(f"WSSS4LUAD: {p}: {reason} (set unmapped: exclude to record and exclude it)")
            excluded.append(Exclusion(str(p.resolve()), reason))
            continue
        rows.append(_row(spec, root, p, label, patient=slide_value(slide.group(1))))
    return rows, excluded


def read_lunghist700(spec: SourceSpec) -> tuple[list[SourceRow], list[Exclusion]]:
    """LungHist700: class, differentiation and magnification in names like ``aca_bd_20x_12.jpg``."""
    root = Path(spec.root)
    _require_dir(root, "LungHist700")
    table = (root / spec.metadata) if spec.metadata else None
    files, excluded = _image_files(root, "LungHist700", {table: "the source's patient metadata table"} if table else None)
    try:
        patients = read_patient_table(table, files) if table else {}
    except MetadataError as exc:
        raise SourceError(f"LungHist700: {exc}") from None
    rows = []
    for p in files:
        m = LUNGHIST700_NAME.match(p.name)
        if not m:
            raise SourceError(f"LungHist700: cannot parse class/differentiation/magnification from {p} "
                              "(expected e.g. aca_bd_20x_1.jpg or nor_40x_3.jpg)")
        cls, diff, mag = (g.lower() if g else "" for g in m.groups())
        if cls in ("aca", "scc") and not diff:
            raise SourceError(f"LungHist700: {p}: {cls} image without differentiation (bd/md/pd)")
        rows.append(_row(spec, root, p, LUNGHIST700_CLASS[cls], differentiation=LUNGHIST700_DIFF.get(diff, ""),
                         magnification=mag, patient=patients.get(p, "")))
    return rows, excluded


def parse_label(value: str, where: str) -> str:
    if value in CLASSES:
        return value
    label = LABEL_ALIASES.get(value.strip().lower())
    if label is None:
        raise SourceError(f"{where}: unknown label {value!r}; allowed: {', '.join(CLASSES)} "
                          f"(or aliases {', '.join(sorted(LABEL_ALIASES))})")
    return label


def _lexical(path: Path) -> Path:
    """Absolute, ``..`` collapsed, symlinks NOT followed (a linked image keeps the path it is listed under)."""
    return Path(os.path.normpath(os.path.abspath(path)))


def read_csv_source(spec: SourceSpec) -> tuple[list[SourceRow], list[Exclusion]]:
    """Generic CSV with columns ``path,label`` (optional ``differentiation,magnification``).

    Relative paths are relative to the CSV; absolute paths are taken as they are. The portable
    ``relpath`` of a row is its path relative to ``relpath_root`` (default: the CSV's folder); a
    row outside that folder is an error naming the row and a ``relpath_root`` that would hold all.
    """
    csv_path = Path(spec.root)
    if not csv_path.is_file():
        raise SourceError(f"CSV source: file not found: {csv_path}")
    base = _lexical(Path(spec.relpath_root) if spec.relpath_root else csv_path.parent)
    if spec.relpath_root and not base.is_dir():
        raise SourceError(f"CSV source {csv_path}: relpath_root is not a folder: {spec.relpath_root}")
    with csv_path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"path", "label"} - set(reader.fieldnames or ())
        if missing:
            raise SourceError(f"CSV source {csv_path}: missing column(s) {sorted(missing)}")
        listed = [(line, rec, _lexical(csv_path.parent / rec["path"])) for line, rec in enumerate(reader, start=2)]
    if not listed:
        raise SourceError(f"CSV source {csv_path}: no rows")
    outside = [(line, p) for line, _, p in listed if not p.is_relative_to(base)]
    if outside:
        line, p = outside[0]
        common = os.path.commonpath([str(q.parent) for _, _, q in listed])
        how = "relpath_root" if spec.relpath_root else "the CSV's folder (set relpath_root on this source)"
        raise SourceError(f"{csv_path}:{line}: image {p} lies outside {base}, the folder portable relpaths are taken "
                          f"from ({how}); {len(outside)} row(s) do. A relpath_root holding every row: {common}")
    rows = []
    has_patients = PATIENT_COLUMN in (reader.fieldnames or ())
    for line, rec, p in listed:
        where = f"{csv_path}:{line}"
        if not p.is_file():
            raise SourceError(f"{where}: image not found: {p}")
        patient = (rec.get(PATIENT_COLUMN) or "").strip()
        if has_patients and not patient:
            raise SourceError(f"{where}: image {p} has an empty {PATIENT_COLUMN!r} (the column, once present, "
                              "needs a value on every row)")
        rows.append(_row(spec, base, p, parse_label(rec["label"], where),
                         differentiation=(rec.get("differentiation") or "").strip(),
                         magnification=(rec.get("magnification") or "").strip(),
                         patient=patient_value(patient) if patient else ""))
    return rows, []


READERS = {"lc25000": read_lc25000, "wsss4luad": read_wsss4luad, "lunghist700": read_lunghist700,
           "csv": read_csv_source}


def collect_sources(specs: Iterable[SourceSpec]) -> tuple[list[SourceRow], list[Exclusion]]:
    """Read every configured source; relative paths must be unique across sources."""
    rows: list[SourceRow] = []
    excluded: list[Exclusion] = []
    for spec in specs:
        got, dropped = READERS[spec.kind](spec)
        rows += got
        excluded += dropped
    seen: dict[str, str] = {}
    for r in rows:
        if r.relpath in seen:
            raise SourceError(f"two images share the portable path {r.relpath!r}: {seen[r.relpath]} and {r.path} "
                              "(give the sources distinct site names)")
        seen[r.relpath] = r.path
    return rows, excluded


def write_sources_csv(path: Path, rows: Iterable[SourceRow]) -> None:
    """The ``patient`` column only when some row has one: a cohort without patients keeps its bytes."""
    rows = list(rows)
    columns = (*SOURCES_COLUMNS, PATIENT_COLUMN) if any(r.patient for r in rows) else SOURCES_COLUMNS
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: v for k, v in asdict(r).items() if k in columns})


def read_sources_csv(path: str | Path) -> list[SourceRow]:
    with Path(path).open(newline="") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) not in (SOURCES_COLUMNS, (*SOURCES_COLUMNS, PATIENT_COLUMN)):
            raise SourceError(f"{path}: columns {reader.fieldnames} differ from the sources schema {list(SOURCES_COLUMNS)} "
                              f"(+ optional {PATIENT_COLUMN!r})")
        return [SourceRow(**rec) for rec in reader]
