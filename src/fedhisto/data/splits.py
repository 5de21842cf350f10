"""Client and evaluation data as plain lists of (sample id, label index, RGB array) per partition."""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

from fedhisto import CLASSES
from fedhisto.config.study import ViewsConfig
from fedhisto.data.views import eval_view
from fedhisto.infra.imageio import load_rgb


@dataclass
class Split:
    ids: list[str]
    labels: list[int]
    images: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.ids)

    def class_counts(self) -> list[int]:
        return [self.labels.count(c) for c in range(len(CLASSES))]


def _load(path: str, max_edge: int) -> np.ndarray:
    """Decoded once; large images are shrunk to ``max_edge`` (views crop >= 85 % of the area then
    resize to the crop size, so nothing finer than that survives anyway)."""
    rgb = load_rgb(path)
    longest = max(rgb.shape[:2])
    if longest > max_edge:
        f = max_edge / longest
        rgb = cv2.resize(rgb, (round(rgb.shape[1] * f), round(rgb.shape[0] * f)), interpolation=cv2.INTER_AREA)
    return rgb


def load_for_eval(path: str | Path, max_edge: int) -> np.ndarray:
    """One image decoded exactly as the evaluation splits decode it (``fedhisto classify`` uses it so a new
    folder's pixels match the pipeline's for the same file)."""
    return _load(str(path), max_edge)


def load_partitions(manifest_csv: str | Path, crop_size: int,
                    splits: tuple[str, ...] = ("optimisation", "holdout", "validation", "test", "external"),
                    ) -> dict[str, Split]:
    """Keys: ``C1``..``C5`` (optimisation), ``C1:holdout``.., ``validation``, ``test``, ``external``;
    only the ``splits`` asked for are decoded."""
    groups: dict[str, list[dict]] = defaultdict(list)
    with Path(manifest_csv).open() as fh:
        for r in csv.DictReader(fh):
            if r["split"] not in splits:
                continue
            if r["split"] == "optimisation":
                groups[r["client"]].append(r)
            elif r["split"] == "holdout":
                groups[f"{r['client']}:holdout"].append(r)
            elif r["split"] in ("validation", "test", "external"):
                groups[r["split"]].append(r)
    return {key: load_split(rows, crop_size) for key, rows in groups.items()}


def load_split(rows: list[dict], crop_size: int) -> Split:
    """Rows with ``sample_id``, ``label`` and ``path``, decoded in sample-id order."""
    rows = sorted(rows, key=lambda r: r["sample_id"])
    return Split([r["sample_id"] for r in rows], [CLASSES.index(r["label"]) for r in rows],
                 [_load(r["path"], 2 * crop_size) for r in rows])


def eval_batches(split: Split, cfg: ViewsConfig, batch: int):
    for start in range(0, len(split), batch):
        imgs = torch.stack([eval_view(im, cfg) for im in split.images[start:start + batch]])
        yield imgs, torch.tensor(split.labels[start:start + batch])
