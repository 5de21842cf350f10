"""What a dataset folder holds: its images, and every other file with the reason it is not one.

Real folders carry ``.DS_Store``, ``Thumbs.db``, READMEs, licence files and metadata tables
beside the images. None of them stops the cohort stage and none is dropped silently: each is
returned as an exclusion that the stage lists in ``results/cohort/excluded.csv`` and counts in
its log. A file with an image extension is always an image: one that does not decode still
stops the stage by name (``fedhisto.realdata.sources``), since a truncated scan must never vanish.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".tif", ".tiff"}


@dataclass(frozen=True)
class Exclusion:
    path: str
    reason: str


def _reason(rel: Path, suffix: str, named: dict[Path, str]) -> str | None:
    """Why a file below a dataset root is not read as an image (None: it is an image)."""
    if rel in named:
        return named[rel]
    if any(part.startswith(".") for part in rel.parts):
        # AppleDouble '._x.png' files carry an image extension but hold resource forks, not pixels
        return "hidden file or folder (name starts with '.')"
    if suffix not in IMAGE_SUFFIXES:
        return f"not an image file (extension {suffix or 'none'!r}; images: {', '.join(sorted(IMAGE_SUFFIXES))})"
    return None


def list_folder(root: Path, named: dict[Path, str] | None = None) -> tuple[list[Path], list[Exclusion]]:
    """Image files below ``root`` (sorted) and every other file with its reason.

    ``named``: files the source itself reads (e.g. a metadata table), by absolute path, with the
    reason recorded for them.
    """
    rel_named = {p.resolve().relative_to(root.resolve()): why for p, why in (named or {}).items()
                 if p.resolve().is_relative_to(root.resolve())}
    images: list[Path] = []
    excluded: list[Exclusion] = []
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            continue
        why = _reason(p.relative_to(root), p.suffix.lower(), rel_named)
        if why is None:
            images.append(p)
        else:
            excluded.append(Exclusion(str(p.resolve()), why))
    return images, excluded


def _stat_line(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path}\tmissing"
    return f"{path}\t{st.st_size}\t{st.st_mtime_ns}"


def inventory_digest(paths: list[Path]) -> str:
    """SHA-256 over path, size and modification time of every file below each folder (a file: itself).

    Cheap enough to compute whenever Snakemake parses the workflow (a stat per file, no reads), so
    the cohort rule carries it as a parameter: adding, removing, editing or touching an image
    changes it, which reruns the cohort stage and, through its outputs, everything after it.
    """
    lines: list[str] = []
    for root in paths:
        if root.is_dir():
            lines += [_stat_line(p) for p in sorted(root.rglob("*")) if not p.is_dir()]
        else:
            lines.append(_stat_line(root))
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()


def csv_listed_paths(csv_path: Path) -> list[Path]:
    """The image paths a CSV source lists (relative to the CSV), for the inventory; unreadable: none."""
    import csv

    try:
        with csv_path.open(newline="") as handle:
            return [Path(os.path.normpath(csv_path.parent / rec["path"])) for rec in csv.DictReader(handle)
                    if rec.get("path")]
    except (OSError, KeyError, csv.Error, UnicodeDecodeError):
        return []  # the cohort stage names the problem; the digest only has to change with the file


def sources_inventory(specs) -> str:
    """Inventory digest of every configured real source (``SourceSpec`` list): folder sources
    their whole folder, a CSV source its file and every image it lists, a metadata table itself."""
    paths: list[Path] = []
    for spec in specs:
        root = Path(spec.root)
        paths.append(root)
        if spec.kind == "csv":
            paths += csv_listed_paths(root)
        if getattr(spec, "metadata", None):
            paths.append(root / spec.metadata)
    return inventory_digest(paths)
