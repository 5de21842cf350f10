"""Stage ``stain``: 14-d client stain descriptors (study section 3.5).

Per client, at most 128 optimisation images (class-aware round robin over seeded per-class
orders), resized to 128 x 128, are pooled; OD = -ln((I + 1) / Io); a pixel is background
when any OD channel is below 0.15. Macenko: the plane of the two leading eigenvectors of the
tissue OD covariance, extreme angles at the alpha / 100 - alpha percentiles give the two stain
directions, hematoxylin first (larger red OD), unit norm, positive. Concentrations by least
squares; descriptor = 6 direction elements + mean, SD, Q1, Q3 of each stain's concentrations.

Descriptors are standardised across the training clients; client holdouts use their own
client's descriptor, global validation / test and the external cohort the centroid of the
training clients' (which, after standardisation, is the zero vector).

Fallback (fewer than ``min_tissue_pixels`` tissue pixels): the Ruifrok-Johnston reference
directions with zero concentration statistics, reported in ``fallback``. A client whose
directions are far from H&E (an IHC slide, say) is reported in ``he_check``, never silently
accepted.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import cv2
import numpy as np

from fedhisto import CLASSES
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config, StainConfig
from fedhisto.infra.atomic import write_json, write_with
from fedhisto.infra.imageio import load_rgb
from fedhisto.infra.provenance import provenance_block, write_sidecar

STAGE = "stain"
REFERENCE_H = np.array([0.650, 0.704, 0.286]) / np.linalg.norm([0.650, 0.704, 0.286])
REFERENCE_E = np.array([0.072, 0.990, 0.105]) / np.linalg.norm([0.072, 0.990, 0.105])
DESCRIPTOR_NAMES = [f"{s}_dir_{c}" for s in ("H", "E") for c in "RGB"] + \
    [f"{s}_{stat}" for s in ("H", "E") for stat in ("mean", "sd", "q1", "q3")]


class StainError(RuntimeError):
    pass


def optical_density(rgb: np.ndarray, io: float) -> np.ndarray:
    return -np.log((rgb.reshape(-1, 3).astype(np.float64) + 1.0) / io)


def tissue_mask(od: np.ndarray, threshold: float) -> np.ndarray:
    """Tissue where no OD channel is below the threshold (any channel below -> background)."""
    return ~np.any(od < threshold, axis=1)


def _positive(v: np.ndarray) -> np.ndarray:
    return v if v.sum() >= 0 else -v


def macenko_directions(od_tissue: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """3 x 2 unit stain directions, hematoxylin first."""
    _, eigvecs = np.linalg.eigh(np.cov(od_tissue.T))
    plane = np.stack([_positive(eigvecs[:, 2]), _positive(eigvecs[:, 1])], axis=1)  # deterministic signs
    proj = od_tissue @ plane
    phi = np.arctan2(proj[:, 1], proj[:, 0])
    lo, hi = np.percentile(phi, alpha), np.percentile(phi, 100 - alpha)
    v_lo = plane @ np.array([np.cos(lo), np.sin(lo)])
    v_hi = plane @ np.array([np.cos(hi), np.sin(hi)])
    h, e = (v_lo, v_hi) if v_lo[0] > v_hi[0] else (v_hi, v_lo)
    return np.stack([_positive(h) / np.linalg.norm(h), _positive(e) / np.linalg.norm(e)], axis=1)


def concentrations(od: np.ndarray, directions: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(directions, od.T, rcond=None)[0]  # 2 x N


def descriptor_from_pixels(od_tissue: np.ndarray, cfg: StainConfig) -> tuple[np.ndarray, np.ndarray]:
    directions = macenko_directions(od_tissue, cfg.percentile)
    conc = concentrations(od_tissue, directions)
    stats = [f(conc[s]) for s in range(2) for f in (np.mean, np.std, lambda x: np.percentile(x, 25),
                                                  lambda x: np.percentile(x, 75))]
    return np.concatenate([directions[:, 0], directions[:, 1], stats]), directions


def fallback_descriptor() -> np.ndarray:
    return np.concatenate([REFERENCE_H, REFERENCE_E, np.zeros(8)])


def he_check(directions: np.ndarray, min_cos: float) -> dict:
    cos_h = float(directions[:, 0] @ REFERENCE_H)
    cos_e = float(directions[:, 1] @ REFERENCE_E)
    return {"cos_hematoxylin": round(cos_h, 4), "cos_eosin": round(cos_e, 4), "he_like": min(cos_h, cos_e) >= min_cos}


def tissue_pixels(path: str, cfg: StainConfig) -> np.ndarray:
    """One image's tissue pixels in optical density (M x 3), at the estimator's resize."""
    rgb = cv2.resize(load_rgb(path), (cfg.resize, cfg.resize), interpolation=cv2.INTER_AREA)
    od = optical_density(rgb, cfg.od_reference_intensity)
    return od[tissue_mask(od, cfg.od_background)]


def client_descriptor(paths: list[str], cfg: StainConfig) -> dict:
    return pooled_descriptor([tissue_pixels(p, cfg) for p in paths], cfg)


def pooled_descriptor(pixels: list[np.ndarray], cfg: StainConfig) -> dict:
    """The descriptor of the images whose tissue pixels are ``pixels`` (:func:`tissue_pixels` each), pooled."""
    tissue = np.concatenate(pixels) if pixels else np.zeros((0, 3))
    if len(tissue) < cfg.min_tissue_pixels:
        return {"raw": fallback_descriptor(), "tissue_pixels": len(tissue),
                "fallback": f"{len(tissue)} tissue pixels < {cfg.min_tissue_pixels}: reference H&E directions, "
                            "zero concentration statistics",
                "he_check": None}
    raw, directions = descriptor_from_pixels(tissue, cfg)
    return {"raw": raw, "tissue_pixels": len(tissue), "fallback": None,
            "he_check": he_check(directions, cfg.he_min_cosine)}


def sample_client(rows: list[dict], k: int, seed: int, client_index: int) -> list[dict]:
    """Class-aware deterministic sample: round robin over per-class seeded orders."""
    by_class: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["sample_id"]):
        by_class[r["label"]].append(r)
    queues = []
    for c, cls in enumerate(CLASSES):
        items = by_class.get(cls, [])
        rng = np.random.default_rng(np.random.SeedSequence([seed, 4, client_index, c]))
        queues.append([items[i] for i in rng.permutation(len(items))])
    out: list[dict] = []
    while len(out) < k and any(queues):
        for q in queues:
            if q and len(out) < k:
                out.append(q.pop(0))
    return out


def standardise(raw: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    mat = np.stack(list(raw.values()))
    mean = mat.mean(0)
    sd = np.maximum(mat.std(0), 1e-6)  # a dimension constant across clients carries no signal
    return {k: (v - mean) / sd for k, v in raw.items()}, mean, sd


def run_stain(manifest_csv: str | Path, cfg: Config, out_dir: str | Path) -> dict:
    with Path(manifest_csv).open() as fh:
        rows = list(csv.DictReader(fh))
    out = Path(out_dir)
    clients = sorted({r["client"] for r in rows if r["client"]})
    if not clients:
        raise StainError(f"{manifest_csv}: no client images")
    per_client = {client: site_descriptor(rows, client, k, cfg) for k, client in enumerate(clients)}
    doc = descriptors_document(per_client)
    prov = provenance_block(STAGE, stage_block(cfg, STAGE), {"manifest": manifest_csv})
    write_json(out / "descriptors.json", {**doc, "provenance": prov})
    write_descriptors_csv(out / "descriptors.csv", doc)
    write_sidecar(out / "descriptors.csv", prov)
    write_view_pairs(rows, cfg, out / "view_pairs.png")
    write_sidecar(out / "view_pairs.png", prov)
    return doc


def site_descriptor(rows: list[dict], client: str, k: int, cfg: Config) -> dict:
    """One client's raw descriptor from its optimisation rows (``k``: its index among the sorted clients,
    which seeds its sample); computable where the images are, from that client's rows alone."""
    opt = [r for r in rows if r["client"] == client and r["split"] == "optimisation"]
    chosen = sample_client(opt, cfg.stain.max_images_per_client, cfg.manifest.split_seed, k)
    return {**client_descriptor([r["path"] for r in chosen], cfg.stain), "sample_ids": [r["sample_id"] for r in chosen]}


def descriptors_document(per_client: dict[str, dict]) -> dict:
    """``descriptors.json`` (less provenance) from the clients' raw descriptors: standardisation across
    them and the centroid. The stain stage and the federation's coordinator (from uploads) both call it."""
    per_client = {c: {**v, "raw": np.asarray(v["raw"], dtype=np.float64)} for c, v in per_client.items()}
    std, mean, sd = standardise({c: v["raw"] for c, v in per_client.items()})
    centroid_raw = np.mean([v["raw"] for v in per_client.values()], axis=0)
    centroid = (centroid_raw - mean) / sd
    return {
        "names": DESCRIPTOR_NAMES,
        "clients": {c: {"raw": v["raw"].tolist(), "standardised": std[c].tolist(), "tissue_pixels": v["tissue_pixels"],
                        "fallback": v["fallback"], "he_check": v["he_check"], "sample_ids": v["sample_ids"]}
                    for c, v in per_client.items()},
        "standardisation": {"mean": mean.tolist(), "sd": sd.tolist()},
        "centroid": {"raw": centroid_raw.tolist(), "standardised": centroid.tolist()},
        "use": {"client holdout": "own client's standardised descriptor",
                "validation, test, external": "centroid (standardised)"},
        "fallback_clients": [c for c, v in per_client.items() if v["fallback"]],
        "not_he_like": [c for c, v in per_client.items() if v["he_check"] and not v["he_check"]["he_like"]],
    }


def write_descriptors_csv(path: Path, doc: dict) -> None:
    """``descriptors.csv``: raw and standardised rows per client, then the standardised centroid."""

    def table(tmp: Path) -> None:
        with tmp.open("w", newline="") as fh:
            w = csv.writer(fh, lineterminator="\n")
            w.writerow(["who", "kind", *DESCRIPTOR_NAMES])
            for c, v in doc["clients"].items():
                w.writerow([c, "raw", *np.round(np.asarray(v["raw"]), 6)])
                w.writerow([c, "standardised", *np.round(np.asarray(v["standardised"]), 6)])
            w.writerow(["centroid", "standardised", *np.round(np.asarray(doc["centroid"]["standardised"]), 6)])

    write_with(path, table)


def write_view_pairs(rows: list[dict], cfg: Config, path: Path, per_class: int = 2) -> None:
    """PNG grid of paired stain-counterfactual views so a person can check what they share."""
    from PIL import Image

    from fedhisto.data.views import view_grid

    picks = []
    for cls in CLASSES:
        picks += sorted((r for r in rows if r["split"] == "optimisation" and r["label"] == cls),
                        key=lambda r: r["sample_id"])[:per_class]
    grid = view_grid([(r["sample_id"], load_rgb(r["path"])) for r in picks], cfg.views)
    write_with(path, lambda tmp: Image.fromarray(grid).save(tmp, format="PNG"))


def descriptor_for(doc: dict, client: str, split: str) -> np.ndarray:
    """The descriptor an image is conditioned on at evaluation (study 3.5)."""
    if client and split in ("holdout", "optimisation"):
        return np.asarray(doc["clients"][client]["standardised"], dtype=np.float32)
    return np.asarray(doc["centroid"]["standardised"], dtype=np.float32)
