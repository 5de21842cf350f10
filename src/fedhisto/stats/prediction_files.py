"""The prediction-CSV format, written and read here only.

``results/predictions/{method}/seed{seed}/{test,holdout,external}.csv``: one row per image (and per
model, for a method that keeps one model per client): sample id, true label, the three class
probabilities, predicted label, cohort, client, differentiation, magnification, run status, and,
only for multi-model methods (``local_only``), the ``model`` that predicted it.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

from fedhisto import CLASSES
from fedhisto.infra.atomic import write_csv

PROB_COLUMNS = tuple(f"p_{c}" for c in CLASSES)
COLUMNS = ("sample_id", "label", *PROB_COLUMNS, "pred", "cohort", "client", "differentiation", "magnification",
           "run_status")
MEMBER_COLUMN = "model"
SINGLE = "global"  # the model name of a single-model method (never written)


class AlignmentError(ValueError):
    pass


def write_predictions(path: str | Path, rows: list[dict]) -> None:
    """``rows`` carry ``model``; the column is written only when more than one model predicted."""
    multi = len({r[MEMBER_COLUMN] for r in rows}) > 1
    columns = (*COLUMNS, MEMBER_COLUMN) if multi else COLUMNS
    write_csv(path, [{k: r[k] for k in columns} for r in rows], columns)


def read_rows(path: str | Path) -> dict[str, list[dict]]:
    """Rows per model (``global`` for a single-model method), in file order."""
    out: dict[str, list[dict]] = defaultdict(list)
    with Path(path).open() as fh:
        for r in csv.DictReader(fh):
            out[r.get(MEMBER_COLUMN) or SINGLE].append(r)
    return dict(out)


def arrays(rows: list[dict]) -> tuple[list[str], np.ndarray, np.ndarray]:
    ids = [r["sample_id"] for r in rows]
    labels = np.array([CLASSES.index(r["label"]) for r in rows], dtype=int)
    probs = np.array([[float(r[c]) for c in PROB_COLUMNS] for r in rows]).reshape(-1, len(CLASSES))
    return ids, labels, probs


def read_predictions(path: str | Path) -> dict[str, tuple[list[str], np.ndarray, np.ndarray]]:
    """(ids, labels, probabilities) per model."""
    return {member: arrays(rows) for member, rows in read_rows(path).items()}


def ensemble_members(paths: list[str | Path]) -> dict[str, tuple[list[str], np.ndarray, np.ndarray]]:
    """Per model, the image-wise mean of the checkpoints' probabilities, sorted by sample id; every file
    must list the same models and images with the same labels."""
    if not paths:
        raise AlignmentError("an ensemble needs at least one prediction file")
    first = read_predictions(paths[0])
    totals = {}
    for member, (ids0, y0, _) in first.items():
        order0 = np.argsort(ids0)
        totals[member] = ([ids0[i] for i in order0], y0[order0], np.zeros((len(ids0), len(CLASSES))))
    for p in paths:
        got = read_predictions(p)
        if set(got) != set(first):
            raise AlignmentError(f"{p}: its models {sorted(got)} differ from {paths[0]}'s {sorted(first)}")
        for member, (ids, y, probs) in got.items():
            ids0, y0, total = totals[member]
            if sorted(ids) != ids0:
                raise AlignmentError(f"{p}: its images differ from {paths[0]} ({len(set(ids) ^ set(ids0))} ids differ)")
            order = np.argsort(ids)
            if not np.array_equal(y[order], y0):
                raise AlignmentError(f"{p}: labels disagree with {paths[0]} for the same sample ids")
            total += probs[order]
    return {m: (ids, y, total / len(paths)) for m, (ids, y, total) in totals.items()}


def ensemble(paths: list[str | Path]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The ensemble of a single-model method (an error for a multi-model one: use ``ensemble_members``)."""
    members = ensemble_members(paths)
    if len(members) != 1:
        raise AlignmentError(f"{paths[0]}: {len(members)} models per image; use ensemble_members")
    return next(iter(members.values()))
