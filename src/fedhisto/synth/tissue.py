"""Class morphology as hematoxylin / eosin concentration maps.

- ACA (adenocarcinoma): glands with open lumens lined by a ring of columnar cells whose
  nuclei sit radially, in fibrous stroma; poorer differentiation crowds the nuclei,
  shrinks the lumens and breaks the rings into solid nests.
- SCC (squamous cell carcinoma): sheets of polygonal cells (Voronoi cells with glassy
  pink cytoplasm, a central hyperchromatic nucleus, darker borders) separated by stroma,
  with concentric keratin-like whorls (pearls) that thin out as differentiation drops.
- Normal: alveolar parenchyma, large empty air spaces bounded by thin eosinophilic walls
  with sparse flattened nuclei and capillary red cells.

``scale`` is pixels per base unit: 40x magnification doubles it, so the same tissue shows
fewer, larger structures.
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import gaussian_filter
from scipy.spatial import cKDTree

DIFFERENTIATION_GRADE = {"well": 0.0, "moderately": 0.5, "poorly": 1.0, "": 0.35}


def smooth_noise(rng: np.random.Generator, size: int, sigma: float) -> np.ndarray:
    """Gaussian-filtered white noise rescaled to [0, 1]."""
    field = gaussian_filter(rng.standard_normal((size, size)), sigma=max(sigma, 0.5), mode="wrap")
    lo, hi = field.min(), field.max()
    return (field - lo) / (hi - lo + 1e-12)


def voronoi(rng: np.random.Generator, size: int, n_seeds: int, jitter: float = 1.0):
    """Seeds plus, per pixel, the nearest seed index and the gap d2 - d1 (small on cell borders)."""
    n_side = max(int(np.sqrt(n_seeds)), 1)
    grid = (np.stack(np.meshgrid(np.arange(n_side), np.arange(n_side)), -1).reshape(-1, 2) + 0.5) * (size / n_side)
    seeds = grid + rng.uniform(-0.5, 0.5, grid.shape) * (size / n_side) * jitter
    yy, xx = np.mgrid[0:size, 0:size]
    pix = np.stack([yy.ravel(), xx.ravel()], 1).astype(float)
    dist, idx = cKDTree(seeds).query(pix, k=2)
    gap = (dist[:, 1] - dist[:, 0]).reshape(size, size)
    return seeds, idx[:, 0].reshape(size, size), gap


def stamp_nuclei(h_map: np.ndarray, rng: np.random.Generator, centers: np.ndarray, major: np.ndarray,
                 minor: np.ndarray, angles: np.ndarray, density: np.ndarray) -> None:
    """Add elliptical nuclei with chromatin texture to ``h_map`` in place."""
    size = h_map.shape[0]
    for (cy, cx), a, b, th, d in zip(centers, major, minor, angles, density, strict=True):
        r = int(np.ceil(max(a, b))) + 1
        y0, y1 = max(int(cy) - r, 0), min(int(cy) + r + 1, size)
        x0, x1 = max(int(cx) - r, 0), min(int(cx) + r + 1, size)
        if y0 >= y1 or x0 >= x1:
            continue
        yy, xx = np.mgrid[y0:y1, x0:x1]
        dy, dx = yy - cy, xx - cx
        u = dx * np.cos(th) + dy * np.sin(th)
        v = -dx * np.sin(th) + dy * np.cos(th)
        rr = (u / a) ** 2 + (v / b) ** 2
        body = np.clip(1.3 - rr, 0, 1) ** 0.5  # soft edge
        texture = 0.75 + 0.5 * rng.random(body.shape)
        h_map[y0:y1, x0:x1] = np.maximum(h_map[y0:y1, x0:x1], d * body * texture)


def _stroma(rng: np.random.Generator, size: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Fibrous eosinophilic stroma with sparse spindle fibroblast nuclei."""
    fibres = smooth_noise(rng, size, 1.5 * scale)
    streak = gaussian_filter(rng.standard_normal((size, size)), sigma=(0.6 * scale, 4.0 * scale), mode="wrap")
    e = 0.35 + 0.35 * fibres + 0.12 * np.tanh(streak * 3)
    h = np.zeros((size, size))
    n = rng.poisson(size * size / (700 * scale * scale))
    centers = rng.uniform(0, size, (n, 2))
    stamp_nuclei(h, rng, centers, rng.uniform(3.0, 5.0, n) * scale, rng.uniform(0.8, 1.3, n) * scale,
                 rng.uniform(-0.3, 0.3, n), rng.uniform(0.7, 1.0, n))
    return h, e


def aca(rng: np.random.Generator, size: int, scale: float, grade: float) -> tuple[np.ndarray, np.ndarray]:
    h, e = _stroma(rng, size, scale)
    yy, xx = np.mgrid[0:size, 0:size].astype(float)
    n_glands = max(2, int(rng.poisson((size / (42 * scale)) ** 2)))
    wobble = smooth_noise(rng, size, 3 * scale) - 0.5
    for _ in range(n_glands):
        cy, cx = rng.uniform(0, size, 2)
        radius = rng.uniform(13, 22) * scale
        ecc = rng.uniform(0.7, 1.0)
        ang = rng.uniform(0, np.pi)
        dy, dx = yy - cy, xx - cx
        u = dx * np.cos(ang) + dy * np.sin(ang)
        v = (-dx * np.sin(ang) + dy * np.cos(ang)) / ecc
        rad = np.hypot(u, v) * (1 + (0.25 + 0.5 * grade) * wobble)
        lumen_r = radius * (0.62 - 0.5 * grade) * rng.uniform(0.8, 1.1)
        epithelium = (rad < radius) & (rad >= lumen_r)
        e[rad < radius] = 0.0
        e[epithelium] = 0.45 + 0.1 * rng.random()
        h[rad < radius] *= 0.2
        # columnar nuclei along the ring, long axis radial; crowding and pleomorphism rise with grade
        n_nuc = int(2 * np.pi * radius / ((3.2 - 1.2 * grade) * scale))
        t = np.sort(rng.uniform(0, 2 * np.pi, n_nuc)) if grade > 0.6 else np.linspace(0, 2 * np.pi, n_nuc, endpoint=False)
        ring = lumen_r + (radius - lumen_r) * rng.uniform(0.45, 0.75, n_nuc) + rng.normal(0, grade * 2 * scale, n_nuc)
        cyx = np.stack([cy + ring * np.sin(t + ang), cx + ring * np.cos(t + ang)], 1)
        stamp_nuclei(h, rng, cyx, rng.uniform(2.6, 3.4 + 2.0 * grade, n_nuc) * scale,
                     rng.uniform(1.1, 1.6 + 1.0 * grade, n_nuc) * scale, t + ang + rng.normal(0, 0.1 + 0.8 * grade, n_nuc),
                     rng.uniform(0.9, 1.25, n_nuc))
        if rng.random() < 0.3:  # secretions in the lumen
            e[rad < lumen_r * 0.6] = 0.12
    return h, e


def scc(rng: np.random.Generator, size: int, scale: float, grade: float) -> tuple[np.ndarray, np.ndarray]:
    h, e = _stroma(rng, size, scale)
    nest = smooth_noise(rng, size, 10 * scale) > 0.32
    seeds, _owner, gap = voronoi(rng, size, int((size / (11 * scale)) ** 2), jitter=0.6 + 0.4 * grade)
    cytoplasm = 0.62 + 0.18 * smooth_noise(rng, size, 0.8 * scale)
    border = gap < 1.2 * scale
    e_nest = np.where(border, 0.95, cytoplasm)
    h_nest = np.where(border, 0.18, 0.04)
    e = np.where(nest, e_nest, e)
    h = np.where(nest, h_nest, h * 0.6)
    inside = nest[np.clip(seeds[:, 0].astype(int), 0, size - 1), np.clip(seeds[:, 1].astype(int), 0, size - 1)]
    centers = seeds[inside]
    n = len(centers)
    stamp_nuclei(h, rng, centers, rng.uniform(2.6, 3.6 + 2.5 * grade, n) * scale,
                 rng.uniform(2.2, 3.0 + 2.0 * grade, n) * scale, rng.uniform(0, np.pi, n), rng.uniform(0.95, 1.35, n))
    yy, xx = np.mgrid[0:size, 0:size].astype(float)
    n_pearls = rng.poisson((1.0 - 0.8 * grade) * (size / (60 * scale)) ** 2 + 0.3)
    for _ in range(n_pearls):
        cy, cx = rng.uniform(0.15 * size, 0.85 * size, 2)
        radius = rng.uniform(9, 15) * scale
        r = np.hypot(yy - cy, xx - cx)
        whorl = r < radius
        rings = 0.5 + 0.5 * np.cos(r / (1.3 * scale) + 2 * np.arctan2(yy - cy, xx - cx) * 0.15)
        e[whorl] = 0.85 + 0.45 * rings[whorl]
        h[whorl] *= 0.15
        # flattened keratinocyte nuclei hugging the whorl's rim
        k = int(2 * np.pi * radius / (5 * scale))
        t = rng.uniform(0, 2 * np.pi, k)
        rim = np.stack([cy + radius * 0.9 * np.sin(t), cx + radius * 0.9 * np.cos(t)], 1)
        stamp_nuclei(h, rng, rim, np.full(k, 2.8 * scale), np.full(k, 0.9 * scale), t + np.pi / 2, np.full(k, 1.0))
    return h, e


def normal(rng: np.random.Generator, size: int, scale: float, grade: float) -> tuple[np.ndarray, np.ndarray]:
    del grade  # normal tissue has no differentiation grade
    _seeds, _owner, gap = voronoi(rng, size, int((size / (30 * scale)) ** 2) + 2, jitter=0.9)
    wall_w = (1.3 + 1.8 * smooth_noise(rng, size, 4 * scale)) * scale
    wall = gap < wall_w
    e = np.where(wall, 0.45 + 0.25 * smooth_noise(rng, size, 1.0 * scale), 0.015)
    h = np.zeros((size, size))
    ys, xs = np.nonzero(wall)
    n = min(len(ys), rng.poisson(size * size / (260 * scale * scale)))
    pick = rng.choice(len(ys), size=n, replace=False) if n else np.array([], int)
    centers = np.stack([ys[pick], xs[pick]], 1).astype(float) if n else np.zeros((0, 2))
    stamp_nuclei(h, rng, centers, rng.uniform(2.2, 3.2, n) * scale, rng.uniform(0.8, 1.2, n) * scale,
                 rng.uniform(0, np.pi, n), rng.uniform(0.8, 1.1, n))
    # capillary red cells: small strongly eosinophilic discs within walls
    m = min(len(ys), rng.poisson(size * size / (500 * scale * scale)))
    if m:
        pick = rng.choice(len(ys), size=m, replace=False)
        rbc = np.zeros((size, size))
        stamp_nuclei(rbc, rng, np.stack([ys[pick], xs[pick]], 1).astype(float), np.full(m, 1.6 * scale),
                     np.full(m, 1.4 * scale), np.zeros(m), np.full(m, 1.0))
        e = np.maximum(e, 1.3 * rbc)
    return h, e


MORPHOLOGY = {"ACA": aca, "Normal": normal, "SCC": scc}


def tissue(label: str, rng: np.random.Generator, size: int, scale: float,
           differentiation: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Hematoxylin and eosin concentration maps for one tile of class ``label``."""
    h, e = MORPHOLOGY[label](rng, size, scale, DIFFERENTIATION_GRADE[differentiation])
    # section thickness varies smoothly across a tile; fine speckle keeps it from looking vector-drawn
    thickness = 0.85 + 0.3 * smooth_noise(rng, size, 12 * scale)
    speckle = 1.0 + 0.08 * rng.standard_normal((size, size))
    return np.clip(h * thickness * speckle, 0, None), np.clip(e * thickness * speckle, 0, None)
