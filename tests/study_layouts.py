"""The study's three datasets as folders on disk, in their real layouts, at test size (reusable: the
rehearsal of config/paper.yaml, and any test of patient / slide handling).

- LC25000: ``lung_image_sets/{lung_aca,lung_n,lung_scc}/lung{aca,n,scc}<k>.jpeg`` (the release's names).
- WSSS4LUAD training tiles: ``<slide>-<x>-<y>-[tumor, stroma, normal].png`` (the release's pattern, e.g.
  ``436219-7159-48057-[1, 0, 0].png``), several tiles per slide; tiles of one slide share its stain.
- LungHist700: ``images/<class>[_<differentiation>]_<magnification>_<k>.jpg`` (``aca_bd_20x_12.jpg``,
  ``nor_40x_3.jpg``) and beside ``images/`` the metadata table ``data.csv``, one row per image with its
  patient id (columns ``superclass, subclass, resolution, image_id, patient_id``), several images per
  patient; fields keep the 4:3 shape of the 1600 x 1200 originals.

Every image is its own random tissue-like picture (no two are near-duplicates, so clearance keeps them
all); a tile's colours come from its slide / patient, its layout from its own seed.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

LC25000_FOLDERS = {"ACA": ("lung_aca", "lungaca"), "Normal": ("lung_n", "lungn"), "SCC": ("lung_scc", "lungscc")}
WSSS4LUAD_VECTORS = {"ACA": (1, 0, 0), "ACA+stroma": (1, 1, 0), "Normal": (0, 0, 1), "stroma": (0, 1, 0),
                     "mixed": (1, 0, 1)}
LUNGHIST700_PREFIX = {"ACA": "aca", "Normal": "nor", "SCC": "scc"}


def tissue(rng: np.random.Generator, height: int, width: int, tint: np.ndarray) -> np.ndarray:
    """Blobs of purple nuclei on pink stroma, tinted per slide / patient: distinct images that clearance's
    perceptual hash and local features tell apart."""
    cell = 8
    coarse = rng.random((height // cell + 1, width // cell + 1))
    mask = np.kron(coarse, np.ones((cell, cell)))[:height, :width] > 0.55
    pink, purple = np.array([230.0, 170, 200]), np.array([120.0, 60, 150])
    img = np.where(mask[..., None], purple, pink) + tint + rng.normal(0, 12, (height, width, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


@dataclass
class StudyFolders:
    """Where the builders put each dataset (the ``root`` each ``config/paper.yaml`` source takes)."""
    lc25000: Path
    wsss4luad: Path
    lunghist700: Path
    lunghist700_table: Path
    slides: dict[str, list[str]] = field(default_factory=dict)  # WSSS4LUAD slide -> its tile names
    patients: dict[str, list[str]] = field(default_factory=dict)  # LungHist700 patient -> its image names


def build_lc25000(root: Path, per_class: int, size: int = 96, seed: int = 0) -> Path:
    """``root/lung_image_sets`` with ``per_class`` JPEGs per class folder; returns that folder."""
    rng = np.random.default_rng(seed)
    base = root / "lung_image_sets"
    for folder, stem in LC25000_FOLDERS.values():
        (base / folder).mkdir(parents=True, exist_ok=True)
        tint = rng.normal(0, 10, 3)
        for k in range(1, per_class + 1):
            Image.fromarray(tissue(rng, size, size, tint)).save(base / folder / f"{stem}{k}.jpeg", quality=95)
    return base


def build_wsss4luad(root: Path, tiles: dict[str, int], tiles_per_slide: int = 3, size: int = 80,
                    seed: int = 1) -> tuple[Path, dict[str, list[str]]]:
    """``root/1.training`` with ``tiles[kind]`` tiles of each kind of WSSS4LUAD_VECTORS, ``tiles_per_slide``
    consecutive tiles to a slide; returns the folder and slide -> tile names."""
    rng = np.random.default_rng(seed)
    base = root / "1.training"
    base.mkdir(parents=True, exist_ok=True)
    slides: dict[str, list[str]] = {}
    slide, tint, made = "", np.zeros(3), 0
    for kind, count in tiles.items():
        for _ in range(count):
            if made % tiles_per_slide == 0:
                slide, tint = str(int(rng.integers(100000, 1000000))), rng.normal(0, 10, 3)
            x, y = (int(v) for v in rng.integers(0, 60000, 2))
            vector = ", ".join(map(str, WSSS4LUAD_VECTORS[kind]))
            name = f"{slide}-{x}-{y}-[{vector}].png"
            Image.fromarray(tissue(rng, size, size, tint)).save(base / name)
            slides.setdefault(slide, []).append(name)
            made += 1
    return base, slides


def build_lunghist700(root: Path, per_class: int, images_per_patient: int = 2, size: tuple[int, int] = (120, 160),
                      seed: int = 2) -> tuple[Path, Path, dict[str, list[str]]]:
    """``root/LungHist700/images`` with ``per_class`` fields per class (20x and 40x, differentiations in
    turn) and ``root/LungHist700/data.csv``; returns the images folder, the table and patient -> names."""
    rng = np.random.default_rng(seed)
    base = root / "LungHist700"
    images = base / "images"
    images.mkdir(parents=True, exist_ok=True)
    patients: dict[str, list[str]] = {}
    rows = []
    serial = 0
    for label, prefix in LUNGHIST700_PREFIX.items():
        for k in range(per_class):
            if k % images_per_patient == 0:
                patient, tint = f"p{len(patients) + 1:03d}", rng.normal(0, 10, 3)
                patients[patient] = []
            diff = "" if label == "Normal" else ("bd", "md", "pd")[k % 3]
            mag = ("20x", "40x")[k % 2]
            serial += 1
            name = f"{prefix}_{diff + '_' if diff else ''}{mag}_{serial}.jpg"
            Image.fromarray(tissue(rng, *size, tint)).save(images / name, quality=95)
            patients[patient].append(name)
            rows.append({"superclass": {"ACA": "aca", "Normal": "nor", "SCC": "scc"}[label], "subclass": diff,
                         "resolution": mag, "image_id": name.rsplit(".", 1)[0], "patient_id": patient})
    table = base / "data.csv"
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return images, table, patients


def build_study_folders(root: Path, lc25000_per_class: int, wsss4luad_tiles: dict[str, int],
                        lunghist700_per_class: int) -> StudyFolders:
    """All three datasets under ``root``."""
    lc = build_lc25000(root / "LC25000", lc25000_per_class)
    ws, slides = build_wsss4luad(root / "WSSS4LUAD", wsss4luad_tiles)
    lh, table, patients = build_lunghist700(root, lunghist700_per_class)
    return StudyFolders(lc, ws, lh, table, slides, patients)


def sources_overlay(folders: StudyFolders) -> list[dict]:
    """``cohort.real.sources`` of config/paper.yaml with only the roots changed."""
    import yaml

    repo = Path(__file__).resolve().parents[1]
    sources = yaml.safe_load((repo / "config/paper.yaml").read_text())["cohort"]["real"]["sources"]
    roots = {"lc25000": folders.lc25000, "wsss4luad": folders.wsss4luad, "lunghist700": folders.lunghist700}
    return [{**s, "root": str(roots[s["kind"]])} for s in sources]


def save_random_hibou_b(folder: Path, seed: int = 0, depth: int | None = None) -> Path:
    """HIBOU-B's architecture (the registry entry's Dinov2WithRegisters config, as the hub's config.json
    gives it), random weights, written as the hub snapshot is (config.json + model.safetensors). ``depth``:
    fewer blocks, only where a test needs no more than a folder of the right kind."""
    import torch

    from fedhisto.model.encoder import random_encoder

    torch.manual_seed(seed)
    random_encoder("hibou-b", depth).save(folder)
    return folder
