"""Training views and evaluation transform (study section 3.4).

Paired stain-counterfactual views share one geometry (RandomResizedCrop 224 with scale
0.85-1.00 and ratio 0.90-1.10, horizontal flip p 0.5, vertical flip p 0.2, rotation
U(-10, 10) degrees, bilinear, white fill) and each gets its own optical-density stain
perturbation (3 x 3 matrix I + N(0, 0.025^2), diagonal scaled U(0.78, 1.22), OD clipped to
[0, 5]) followed by brightness and contrast factors U(0.92, 1.08). Every draw comes from a
generator seeded by (run seed, epoch, sample id), so a view is reproducible on its own.
Evaluation: deterministic whole-image resize to 224 (``views.eval_resize``: squash, the default, or
keep_aspect: see :func:`eval_resize`). Both end with ImageNet normalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np
import torch

from fedhisto.config.study import ViewsConfig


@dataclass(frozen=True)
class Geometry:
    top: int
    left: int
    height: int
    width: int
    hflip: bool
    vflip: bool
    angle: float


def view_rng(seed: int, epoch: int, sample_id: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, int(sample_id[:15], 16)]))


def sample_geometry(rng: np.random.Generator, height: int, width: int, cfg: ViewsConfig) -> Geometry:
    """RandomResizedCrop parameters as torchvision draws them (10 tries, then central fallback)."""
    area = height * width
    log_ratio = (math.log(cfg.crop_ratio[0]), math.log(cfg.crop_ratio[1]))
    box = None
    for _ in range(10):
        target = area * rng.uniform(*cfg.crop_scale)
        ratio = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            box = (int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w)
            break
    if box is None:
        side = min(height, width)
        box = ((height - side) // 2, (width - side) // 2, side, side)
    return Geometry(*box, hflip=bool(rng.random() < cfg.hflip_p), vflip=bool(rng.random() < cfg.vflip_p),
                    angle=float(rng.uniform(-cfg.rotation_deg, cfg.rotation_deg)))


def apply_geometry(rgb: np.ndarray, g: Geometry, size: int) -> np.ndarray:
    crop = rgb[g.top:g.top + g.height, g.left:g.left + g.width]
    out = cv2.resize(crop, (size, size), interpolation=cv2.INTER_LINEAR)
    if g.hflip:
        out = out[:, ::-1]
    if g.vflip:
        out = out[::-1]
    if g.angle:
        m = cv2.getRotationMatrix2D(((size - 1) / 2, (size - 1) / 2), g.angle, 1.0)
        out = cv2.warpAffine(np.ascontiguousarray(out), m, (size, size), flags=cv2.INTER_LINEAR,
                             borderMode=cv2.BORDER_CONSTANT, borderValue=(255, 255, 255))
    return np.ascontiguousarray(out)


def stain_perturb(rgb: np.ndarray, rng: np.random.Generator, cfg: ViewsConfig) -> np.ndarray:
    """Independent OD-space stain change plus brightness and contrast; float RGB in [0, 1]."""
    od = -np.log((rgb.astype(np.float64) + 1.0) / 256.0)
    mix = np.eye(3) + rng.normal(0.0, cfg.od_noise_sd, (3, 3))
    mix[np.diag_indices(3)] *= rng.uniform(*cfg.od_diag_scale, 3)
    od = np.clip(od @ mix.T, 0.0, cfg.od_clip)
    img = np.clip(np.exp(-od) * 256.0 - 1.0, 0, 255) / 255.0
    img = np.clip(img * rng.uniform(*cfg.brightness), 0, 1)
    grey = (img @ np.array([0.299, 0.587, 0.114])).mean()  # torchvision's contrast pivots on mean grey
    return np.clip((img - grey) * rng.uniform(*cfg.contrast) + grey, 0, 1)


def normalise(img01: np.ndarray, cfg: ViewsConfig) -> torch.Tensor:
    arr = (img01 - np.asarray(cfg.mean)) / np.asarray(cfg.std)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))).float()


def training_views(rgb: np.ndarray, cfg: ViewsConfig, seed: int, epoch: int, sample_id: str,
                   paired: bool, stain_single: bool | None = None) -> list[torch.Tensor]:
    """Two stain-counterfactual views of one geometry (paired) or one view (single-view methods)."""
    rng = view_rng(seed, epoch, sample_id)
    geo = apply_geometry(rgb, sample_geometry(rng, rgb.shape[0], rgb.shape[1], cfg), cfg.crop_size)
    if paired:
        return [normalise(stain_perturb(geo, rng, cfg), cfg) for _ in range(2)]
    perturb = cfg.single_view_stain if stain_single is None else stain_single
    return [normalise(stain_perturb(geo, rng, cfg) if perturb else geo / 255.0, cfg)]


def eval_resize(rgb: np.ndarray, size: int, mode: str = "squash") -> np.ndarray:
    """The evaluation image at ``size`` x ``size`` (``views.eval_resize``).

    ``squash``: both sides to ``size`` (the study's "whole-image resize", read literally); a 1600 x 1200
    LungHist700 field is compressed 1.33x more across than down, so nuclei and glands change shape
    between the square training tiles and such a field. ``keep_aspect``: the shorter side to ``size``,
    then the centre square. Cropping, not padding: a padded border is white (or black) background
    the encoder never saw as a large band in training, and it shrinks the tissue further; the crop
    keeps the scale of the shorter side and drops only the longer side's edges (1/8 on each side of a
    4:3 field). Square images give the same pixels either way."""
    h, w = rgb.shape[:2]
    if mode == "squash" or h == w:
        return cv2.resize(rgb, (size, size), interpolation=cv2.INTER_LINEAR)
    if mode != "keep_aspect":
        raise ValueError(f"views.eval_resize: unknown mode {mode!r} (squash | keep_aspect)")
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    out = cv2.resize(rgb, (nw, nh), interpolation=cv2.INTER_LINEAR)  # as squash: only the geometry differs
    top, left = (nh - size) // 2, (nw - size) // 2
    return np.ascontiguousarray(out[top:top + size, left:left + size])


def eval_view(rgb: np.ndarray, cfg: ViewsConfig) -> torch.Tensor:
    return normalise(eval_resize(rgb, cfg.crop_size, cfg.eval_resize) / 255.0, cfg)


def denormalise(t: torch.Tensor, cfg: ViewsConfig) -> np.ndarray:
    arr = t.numpy().transpose(1, 2, 0) * np.asarray(cfg.std) + np.asarray(cfg.mean)
    return np.clip(np.rint(arr * 255), 0, 255).astype(np.uint8)


def view_grid(images: list[tuple[str, np.ndarray]], cfg: ViewsConfig, seed: int = 0, tile: int = 160) -> np.ndarray:
    """Rows of (whole image, view A, view B): morphology shared, only stain differs."""
    from PIL import Image, ImageDraw

    rows = []
    for sample_id, rgb in images:
        a, b = training_views(rgb, cfg, seed, 0, sample_id, paired=True)
        cells = [cv2.resize(rgb, (tile, tile)), cv2.resize(denormalise(a, cfg), (tile, tile)),
                 cv2.resize(denormalise(b, cfg), (tile, tile))]
        rows.append(np.concatenate([np.pad(c, ((2, 2), (2, 2), (0, 0)), constant_values=255) for c in cells], 1))
    grid = np.concatenate(rows, 0)
    header = Image.new("RGB", (grid.shape[1], 18), "white")
    draw = ImageDraw.Draw(header)
    for k, text in enumerate(("image", "view A", "view B")):
        draw.text((k * (tile + 4) + 4, 3), text, fill="black")
    return np.concatenate([np.asarray(header), grid], 0)
