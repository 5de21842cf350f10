"""Planted duplicate families: the transformed copies a clearance stage must catch.

Each transform mirrors a real leak: byte copies and re-encodes from dataset mirrors,
resizes, LC25000's flip / 90-degree and small-angle rotation-with-zoom augmentation,
crops, and re-stained copies.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from fedhisto.synth.stain_styles import od_to_rgb, rgb_to_od

DIHEDRAL = (
    Image.Transpose.FLIP_LEFT_RIGHT, Image.Transpose.FLIP_TOP_BOTTOM, Image.Transpose.ROTATE_90,
    Image.Transpose.ROTATE_180, Image.Transpose.ROTATE_270, Image.Transpose.TRANSPOSE,
    Image.Transpose.TRANSVERSE,
)


def encode_jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=int(quality), subsampling=2, optimize=False)
    return buf.getvalue()


def rotate_zoom(img: Image.Image, angle: float) -> Image.Image:
    """Rotate, then crop the largest axis-aligned square free of fill and zoom it back (as Augmentor does)."""
    w, h = img.size
    rot = img.rotate(angle, resample=Image.Resampling.BICUBIC, expand=False)
    a = np.deg2rad(abs(angle))
    side = min(w, h) / (np.cos(a) + np.sin(a))  # inscribed square of a rotated square
    left, top = (w - side) / 2, (h - side) / 2
    return rot.crop((round(left), round(top), round(left + side), round(top + side))).resize(
        (w, h), Image.Resampling.BICUBIC)


def stain_shift(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Re-stain: mix the optical-density channels through a random near-identity matrix."""
    od = rgb_to_od(np.asarray(img))
    mix = np.eye(3) + rng.normal(0, 0.08, (3, 3))
    mix[np.diag_indices(3)] *= rng.uniform(0.7, 1.3, 3)
    return Image.fromarray(od_to_rgb(np.clip(od @ mix.T, 0, 5)))


def make_copy(original_bytes: bytes, transform: str, rng: np.random.Generator, max_rotation: float,
              base_quality: int) -> tuple[bytes, str]:
    """Return the copy's bytes and a description of the exact parameters used."""
    if transform == "exact":
        return original_bytes, "exact byte copy"
    img = Image.open(io.BytesIO(original_bytes)).convert("RGB")
    w, h = img.size
    if transform == "jpeg":
        q = int(rng.choice([q for q in (55, 65, 75, 85, 95) if q != base_quality]))
        return encode_jpeg(img, q), f"re-encoded at JPEG quality {q}"
    if transform == "resize":
        f = float(rng.choice([0.5, 0.75, 1.25, 1.5]))
        out = img.resize((max(round(w * f), 16), max(round(h * f), 16)), Image.Resampling.LANCZOS)
        return encode_jpeg(out, base_quality), f"resized by {f}"
    if transform == "dihedral":
        op = DIHEDRAL[int(rng.integers(len(DIHEDRAL)))]
        return encode_jpeg(img.transpose(op), base_quality), f"dihedral {op.name}"
    if transform == "rotate_zoom":
        angle = float(rng.uniform(3.0, max_rotation)) * float(rng.choice([-1, 1]))
        out = rotate_zoom(img, angle)
        flip = bool(rng.random() < 0.5)
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return encode_jpeg(out, base_quality), f"rotated {angle:.1f} deg with crop-and-zoom{', flipped' if flip else ''}"
    if transform == "crop":
        frac = float(rng.uniform(0.7, 0.9))
        cw, ch = round(w * frac), round(h * frac)
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        out = img.crop((x0, y0, x0 + cw, y0 + ch))
        zoom = bool(rng.random() < 0.5)
        if zoom:
            out = out.resize((w, h), Image.Resampling.BICUBIC)
        return encode_jpeg(out, base_quality), f"crop {frac:.2f} at ({x0},{y0}){' zoomed back' if zoom else ''}"
    if transform == "stain_shift":
        return encode_jpeg(stain_shift(img, rng), base_quality), "optical-density stain shift"
    raise ValueError(f"unknown planted transform {transform!r}")
