"""Exact (SHA-256) and perceptual (dihedral-invariant PHash) fingerprints."""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np
from PIL import Image
from scipy.fftpack import dct


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _bits(block: np.ndarray) -> int:
    flat = block.ravel()
    return int("".join("1" if b else "0" for b in (flat > np.median(flat))), 2)


def dihedral_phashes(rgb: np.ndarray, dihedral: bool = True) -> np.ndarray:
    """PHash (``imagehash.phash``, which imagededup also uses) of the image under each of the 8 dihedral transforms.

    One 32 x 32 greyscale resize and one 2-D DCT serve all eight: a flip negates every odd
    frequency along its axis, a transpose transposes the coefficients, and the median of the
    8 x 8 low-frequency block is unchanged by either. The first hash is bit-equal to
    ``imagehash.phash`` of the image, and each variant to ``imagehash.phash`` of the transformed
    32 x 32 thumbnail (tests/test_clearance.py checks both); ``imagehash.phash`` of the transformed
    full image can differ by a bit or two, since PIL's two-pass resize rounds differently once
    rows and columns swap.
    """
    grey = Image.fromarray(rgb).convert("L").resize((32, 32), Image.Resampling.LANCZOS)
    coeff = dct(dct(np.asarray(grey, dtype=np.float64), axis=0), axis=1)[:8, :8]
    sign = np.where(np.arange(8) % 2 == 0, 1.0, -1.0)
    flip_cols, flip_rows = coeff * sign[None, :], coeff * sign[:, None]
    both = coeff * sign[:, None] * sign[None, :]
    variants = [coeff, flip_cols, flip_rows, coeff.T, both, both.T, flip_cols.T, flip_rows.T]
    return np.array([_bits(v) for v in (variants if dihedral else variants[:1])], dtype=np.uint64)


def exact_groups(digests: list[str]) -> list[list[int]]:
    """Indices sharing a SHA-256, groups of two or more."""
    by: dict[str, list[int]] = defaultdict(list)
    for i, d in enumerate(digests):
        by[d].append(i)
    return [g for g in by.values() if len(g) > 1]


def phash_pairs(hashes: np.ndarray, threshold: int, chunk: int = 512) -> list[tuple[int, int, int]]:
    """All pairs (i < j) whose minimum Hamming distance over the dihedral variants is <= threshold.

    ``hashes`` is N x V (V = 8 dihedral hashes or 1). Comparing B's identity hash with all of
    A's variants covers every relative dihedral transform. This is all-pairs hashing (cheap
    bit counts, chunked), not all-pairs feature matching.
    """
    n = len(hashes)
    base = hashes[:, 0]
    out: list[tuple[int, int, int]] = []
    for start in range(0, n, chunk):
        block = hashes[start:start + chunk]                       # c x V
        xor = block[:, :, None] ^ base[None, None, :]             # c x V x N
        dist = np.bitwise_count(xor).min(axis=1)                  # c x N
        rows, cols = np.nonzero(dist <= threshold)
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            i = start + r
            if i < c:
                out.append((i, c, int(dist[r, c])))
    return out
