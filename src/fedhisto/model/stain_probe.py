"""Stain-sensitivity probe of a frozen encoder (``fedhisto probe-encoder``; issue 21, item 5).

Before any federated training: does the encoder's embedding move under the paired stain
perturbation that v2's views apply, compared with how far apart different tissues lie? Each image
is resized as the evaluation transform resizes it (eval geometry, so only the stain differs) and
drawn twice through the training views' stain perturbation (:func:`fedhisto.data.views.stain_perturb`:
OD mixing, brightness, contrast), from a generator seeded by (probe seed, sample id), so the two
views are reproducible. Measures, over the images' pooled embeddings:

- ``within``: mean cosine distance between the two stain draws of the same tissue;
- ``between``: mean cosine distance between draws of different tissues (draw A of i, draw B of j);
- ``ratio`` = within / between: 0 for an encoder that ignores colour, about 1 when a stain change
  moves an embedding as far as a change of tissue;
- ``retrieval_top1``: nearest-neighbour retrieval of the same tissue across the two draws (A to B
  and B to A, averaged) among all n tissues: 1.0 when the stain never hides which tissue it is,
  1/n by chance;
- with class labels, ``between_same_class`` and ``ratio_same_class``: the same against the mean
  distance between different tissues of one class (a stain change vs the differences a classifier
  trained on one class's variety sees within a class).

Every measure comes with a 95 % percentile bootstrap interval over images
(:func:`fedhisto.stats.resampling.resample_weights` multiplicities, :func:`fedhisto.stats.ensemble_intervals.interval`).
The same measures compare any two renderings of the same tissues (:func:`pair_sensitivity`), e.g.
the dose-response cohort's tissues at severity 0 and at severity s.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np
import torch

from fedhisto.config.study import Config, ViewsConfig
from fedhisto.data.views import eval_view, normalise, stain_perturb, view_rng
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.imageio import load_rgb
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.infra.settings_base import identity_dump
from fedhisto.model.encoder import FrozenEncoder, load_encoder
from fedhisto.stats.ensemble_intervals import interval
from fedhisto.stats.resampling import resample_weights

STAGE = "probe"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
MEASURES = ("within", "between", "ratio", "retrieval_top1")
PER_IMAGE_COLUMNS = ("sample_id", "within", "nearest_other", "hit_a_to_b", "hit_b_to_a")


class ProbeError(RuntimeError):
    """The probe's input cannot be measured as given (names the file, column or count); a RuntimeError
    like EncoderLoadError, so the command line reports it as one line."""


def frozen_embedding(encoder: FrozenEncoder, pixels: torch.Tensor) -> torch.Tensor:
    """The frozen encoder's pooled embedding of a batch, as its registry entry pools it (CLS, or CLS
    with the mean patch token): what the PEFT head of every method sees."""
    return encoder.embed(pixels)


@torch.no_grad()
def embed(encoder: FrozenEncoder, views: Sequence[torch.Tensor], batch: int = 64,
          device: torch.device | None = None) -> np.ndarray:
    """n x d float64 embeddings of normalised view tensors, in order, computed on ``device`` (default: where
    the encoder is); the encoder is moved there once, each batch on its way."""
    encoder.module.eval()
    if device is None:
        first = next(iter(encoder.module.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    encoder.module.to(device)
    out = [frozen_embedding(encoder, torch.stack(list(views[i:i + batch])).to(device, non_blocking=True)).double().cpu()
           for i in range(0, len(views), batch)]
    return torch.cat(out).numpy()


def _hex_id(sample_id: str) -> str:
    """``view_rng`` reads a hex sample id; any other name is hashed to one (stable across runs)."""
    return hashlib.sha256(sample_id.encode()).hexdigest()[:16]


def stain_pair(rgb: np.ndarray, cfg: ViewsConfig, seed: int, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two stain draws of one image at evaluation geometry (whole image resized to ``crop_size``)."""
    rng = view_rng(seed, 0, _hex_id(sample_id))
    geo = cv2.resize(rgb, (cfg.crop_size, cfg.crop_size), interpolation=cv2.INTER_LINEAR)
    return normalise(stain_perturb(geo, rng, cfg), cfg), normalise(stain_perturb(geo, rng, cfg), cfg)


def clean_view(rgb: np.ndarray, cfg: ViewsConfig) -> torch.Tensor:
    """The evaluation transform itself (no stain perturbation)."""
    return eval_view(rgb, cfg)


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    if (norm == 0).any():
        raise ProbeError("an embedding is all zeros: cosine distance is undefined")
    return x / norm


def _hits(dist: np.ndarray) -> np.ndarray:
    """Per tissue, the mean of its two retrieval hits (A to B, B to A) against the full gallery; a tie
    with the true partner goes to the lower index."""
    n = len(dist)
    return ((dist.argmin(1) == np.arange(n)).astype(float) + (dist.argmin(0) == np.arange(n))) / 2


def _measures(dist: np.ndarray, w: np.ndarray, labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Measures of each resample: ``w`` is B x n image multiplicities (a row of ones: the images as given).

    Distances are averaged over the resampled tissues and pairs of different tissues. Retrieval is
    each resampled query's hit against the FULL gallery of n tissues: a gallery shrunk to a
    resample's distinct images (about 63 %) would hold fewer distractors and bias every replicate
    upwards, so only the queries are resampled. ``labels``: also the ratio to the mean distance
    between different tissues of the same class (stain vs the differences a classifier must keep)."""
    diag = np.diag(dist)
    within = w @ diag / w.sum(1)
    pair_w = w.sum(1) ** 2 - (w ** 2).sum(1)  # ordered pairs of different tissues
    between = (np.einsum("bi,ij,bj->b", w, dist, w) - (w ** 2) @ diag) / pair_w
    out = {"within": within, "between": between, "ratio": within / between,
           "retrieval_top1": w @ _hits(dist) / w.sum(1)}
    if labels is not None:
        same = (labels[:, None] == labels[None, :]).astype(float)
        np.fill_diagonal(same, 0.0)
        same_w = np.einsum("bi,ij,bj->b", w, same, w)
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample without two tissues of one class: NaN
            between_same = np.einsum("bi,ij,bj->b", w, dist * same, w) / same_w
        out.update(between_same_class=between_same, ratio_same_class=within / between_same)
    return out


def pair_sensitivity(emb_a: np.ndarray, emb_b: np.ndarray, resamples: int, seed: int,
                     labels: Sequence | None = None) -> dict:
    """Probe measures of two renderings of the same n tissues (row i of both is tissue i), each with
    its bootstrap interval; ``per_image``: each tissue's own distance and retrieval hits. With
    ``labels`` (one class per tissue) also ``between_same_class`` and ``ratio_same_class``."""
    if emb_a.shape != emb_b.shape or emb_a.ndim != 2:
        raise ProbeError(f"embeddings must be two n x d arrays of one shape (got {emb_a.shape} and {emb_b.shape})")
    n = len(emb_a)
    if n < 3:
        raise ProbeError(f"the probe needs at least 3 images (got {n}): 'between' compares different tissues")
    dist = 1.0 - _unit(emb_a) @ _unit(emb_b).T
    w = np.vstack([np.ones((1, n)), resample_weights(np.random.default_rng(seed), n, resamples)])
    y = None if labels is None else np.asarray(labels)
    if y is not None and (len(y) != n or not any(np.sum(y == c) > 1 for c in set(y.tolist()))):
        raise ProbeError(f"labels: need one per tissue ({len(y)} for {n}) and two tissues of some class")
    reps = _measures(dist, w, y)
    off = dist + np.diag(np.full(n, np.inf))
    per_image = {"within": np.diag(dist), "hit_a_to_b": dist.argmin(1) == np.arange(n),
                 "hit_b_to_a": dist.argmin(0) == np.arange(n), "nearest_other": np.minimum(off.min(1), off.min(0))}
    return {"images": n, "resamples": resamples, "chance_retrieval": 1.0 / n,
            **{k: interval(v) for k, v in reps.items()}, "per_image": per_image}


def stain_sensitivity(encoder: FrozenEncoder, images: Sequence[tuple[str, np.ndarray]], cfg: ViewsConfig,
                      seed: int, resamples: int, bootstrap_seed: int, batch: int = 64,
                      labels: Sequence | None = None, device: torch.device | None = None) -> dict:
    """The probe on ``images`` ((sample id, RGB uint8)): two seeded stain draws per image, embedded on
    ``device``."""
    pairs = [stain_pair(rgb, cfg, seed, sid) for sid, rgb in images]
    emb_a = embed(encoder, [a for a, _ in pairs], batch, device)
    emb_b = embed(encoder, [b for _, b in pairs], batch, device)
    return pair_sensitivity(emb_a, emb_b, resamples, bootstrap_seed, labels)


def per_image_rows(ids: Sequence[str], result: dict, **extra: object) -> list[dict]:
    p = result["per_image"]
    return [{**extra, "sample_id": sid, "within": f"{p['within'][i]:.6f}",
             "nearest_other": f"{p['nearest_other'][i]:.6f}", "hit_a_to_b": int(p["hit_a_to_b"][i]),
             "hit_b_to_a": int(p["hit_b_to_a"][i])} for i, sid in enumerate(ids)]


def summary_of(result: dict) -> dict:
    """The result without its per-image arrays (for JSON)."""
    return {k: v for k, v in result.items() if k != "per_image"}


def image_list(source: str | Path, split: str | None = None,
               limit: int | None = None) -> list[tuple[str, str, str | None]]:
    """(sample id, path, label) of a folder's images (recursive; id = relative path; no label) or of a
    CSV with ``sample_id`` and ``path`` columns (a manifest or the dose-response cohort; its ``label``
    column when it has one), optionally one ``split`` only; sorted by id, then the first ``limit``."""
    src = Path(source)
    if src.is_dir():
        found = [(p.relative_to(src).as_posix(), str(p), None) for p in sorted(src.rglob("*"))
                 if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
        if split:
            raise ProbeError(f"{src}: --split applies to a manifest CSV, not to a folder")
    elif src.is_file():
        with src.open() as fh:
            reader = csv.DictReader(fh)
            missing = {"sample_id", "path"} - set(reader.fieldnames or [])
            if missing:
                raise ProbeError(f"{src}: no column {sorted(missing)} (need sample_id and path)")
            rows = list(reader)
        if split:
            if rows and "split" not in rows[0]:
                raise ProbeError(f"{src}: --split {split!r} given but the CSV has no 'split' column")
            rows = [r for r in rows if r["split"] == split]
        found = sorted((r["sample_id"], r["path"], r.get("label") or None) for r in rows)
    else:
        raise ProbeError(f"image folder or CSV not found: {src}")
    if limit is not None:
        found = found[:limit]
    if len(found) < 3:
        raise ProbeError(f"{src}: {len(found)} image(s){f' in split {split!r}' if split else ''}; the probe needs at least 3")
    return found


def load_probe_image(path: str, crop_size: int) -> np.ndarray:
    """Decoded whole; a large image is first shrunk to twice the crop size with area averaging, as the
    pipeline's data loader does before the evaluation resize, so the probe sees what evaluation sees."""
    rgb = load_rgb(path)
    longest = max(rgb.shape[:2])
    if longest > 2 * crop_size:
        f = 2 * crop_size / longest
        rgb = cv2.resize(rgb, (round(rgb.shape[1] * f), round(rgb.shape[0] * f)), interpolation=cv2.INTER_AREA)
    return rgb


def run_probe(cfg: Config, images: str | Path, out_dir: str | Path, encoder_dir: str | None = None,
              split: str | None = None, limit: int | None = None, seed: int = 0, resamples: int = 1000,
              bootstrap_seed: int = 20261201, threads: int = 1) -> dict:
    """``fedhisto probe-encoder``: the probe of ``cfg.model.encoder`` (or the tiny encoder in
    ``encoder_dir``) on a folder or CSV of images; writes ``probe.json`` and ``per_image.csv``."""
    from fedhisto.model.build import pick_device

    torch.set_num_threads(max(threads, 1))
    listed = image_list(images, split, limit)
    device = pick_device(cfg)  # the GPU a job declaring one holds (train.device)
    encoder = load_encoder(cfg.model.encoder, encoder_dir)
    loaded = [(sid, load_probe_image(path, cfg.views.crop_size)) for sid, path, _ in listed]
    labels = [label for *_, label in listed]
    result = stain_sensitivity(encoder, loaded, cfg.views, seed, resamples, bootstrap_seed, cfg.evaluate.eval_batch,
                               labels=labels if all(labels) and len(set(labels)) < len(labels) else None,
                               device=device)
    out = Path(out_dir)
    block = {"encoder": identity_dump(cfg.model.encoder), "views": identity_dump(cfg.views),
             "seed": seed, "resamples": resamples, "bootstrap_seed": bootstrap_seed, "split": split, "limit": limit}
    prov = provenance_block(STAGE, block, {"images": images, **({"encoder": encoder_dir} if encoder_dir else {})})
    ids = [sid for sid, *_ in listed]
    write_csv(out / "per_image.csv", per_image_rows(ids, result), PER_IMAGE_COLUMNS)
    write_sidecar(out / "per_image.csv", prov)
    summary = {"encoder": cfg.model.encoder.name, "encoder_dir": encoder_dir or cfg.model.encoder.local_dir,
               "images_source": str(images), **summary_of(result), "provenance": prov}
    write_json(out / "probe.json", summary)
    return summary
