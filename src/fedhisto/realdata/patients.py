"""Which patient or slide an image comes from, where a source says so.

- WSSS4LUAD training tiles are named ``<slide>-<x>-<y>-[tumor, stroma, normal].png``: the slide
  is the name's first field (``436219-7159-48057-[1, 0, 0].png`` is slide 436219). A name without
  that field stops the stage: without it, tiles of one slide could land on both sides of a split.
- LungHist700 ships a metadata table with a patient id per image. Its ``patient_id`` column and
  an image column (``image_id``, ``image`` or ``filename``; a name with or without its extension)
  are read; every image on disk needs exactly one patient and every row must name an image on disk.
- A CSV source may carry a ``patient`` column; when it does, every row needs one.

Values are prefixed with what they are (``slide:436219``, ``patient:12``), so the manifest can
say which kind of metadata holds a group together; groups never join across sources, since the
manifest keys them by site as well.
"""

from __future__ import annotations

import csv
from pathlib import Path

IMAGE_COLUMNS = ("image_id", "image", "filename")
PATIENT_COLUMN = "patient_id"


class MetadataError(ValueError):
    """A patient / slide table or name that cannot be trusted; the message names the file and key."""


def slide_value(slide: str) -> str:
    return f"slide:{slide}"


def patient_value(patient: str) -> str:
    return f"patient:{patient}"


def _stem(name: str) -> str:
    """A table's image name compared without folder or extension (tables list either form)."""
    p = Path(name.strip())
    return p.stem if p.suffix else p.name


def read_patient_table(table: Path, images: list[Path]) -> dict[Path, str]:
    """``{image: patient value}`` for every image, from a metadata table; every mismatch is an error."""
    if not table.is_file():
        raise MetadataError(f"patient metadata table not found: {table}")
    with table.open(newline="") as handle:
        reader = csv.DictReader(handle)
        fields = [f.strip() for f in reader.fieldnames or ()]
        image_col = next((c for c in IMAGE_COLUMNS if c in fields), None)
        if image_col is None or PATIENT_COLUMN not in fields:
            raise MetadataError(f"{table}: needs a {PATIENT_COLUMN!r} column and an image column (one of "
                                f"{', '.join(IMAGE_COLUMNS)}); it has {fields}")
        reader.fieldnames = fields
        listed = [(line, rec[image_col] or "", (rec[PATIENT_COLUMN] or "").strip())
                  for line, rec in enumerate(reader, start=2)]
    by_stem: dict[str, list[Path]] = {}
    for p in images:
        by_stem.setdefault(p.stem, []).append(p)
    ambiguous = {s: ps for s, ps in by_stem.items() if len(ps) > 1}
    claims: dict[Path, tuple[str, int]] = {}
    for line, name, patient in listed:
        where = f"{table}:{line}"
        if not patient:
            raise MetadataError(f"{where}: image {name!r} has an empty {PATIENT_COLUMN}")
        stem = _stem(name)
        if stem in ambiguous:
            raise MetadataError(f"{where}: image {name!r} matches {len(ambiguous[stem])} files "
                                f"{[str(p) for p in ambiguous[stem]]}; names must be unique")
        if stem not in by_stem:
            raise MetadataError(f"{where}: names image {name!r}, which is not on disk below the source's root")
        image = by_stem[stem][0]
        if image in claims and claims[image][0] != patient:
            other, other_line = claims[image]
            raise MetadataError(f"{image}: two patients claim this image: {other!r} ({table}:{other_line}) and "
                                f"{patient!r} ({where})")
        claims[image] = (patient, line)
    missing = [p for p in images if p not in claims]
    if missing:
        raise MetadataError(f"{missing[0]}: no patient row in {table} ({len(missing)} image(s) have none, e.g. "
                            f"{[p.name for p in missing[:3]]})")
    return {p: patient_value(patient) for p, (patient, _) in claims.items()}
