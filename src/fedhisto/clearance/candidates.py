"""Global descriptors that rank an image's transformed relatives first, and k-NN candidates.

The descriptor is built to survive LC25000's augmentation (rotation up to 25 degrees with
zoom, flips), re-encoding and resizing: a colour histogram of the central disk (rotation
and flip invariant), an angular-FFT magnitude of the polar-warped grey image (invariant to
rotation about the centre and to mirroring), and a radial colour profile. Candidates are
each image's k nearest neighbours, so recall per image does not depend on a distance radius
tuned on one corpus.

Zoom views (``clearance.zoom_views``) add a third source: each image's visual words are also
taken of its central crop zoomed back up, and an image's words are compared with every other
image's zoom views. LC25000's crop-and-zoom leaves relatives 1.4-1.9x apart in scale; their
whole-image words then share little (the wider view's keypoints mostly fall outside the other's
field), so on real LC25000 families every pair the words and the global descriptor missed was
such a pair; a centre crop at the family's zoom brings the two fields back into register.
"""

from __future__ import annotations

import cv2
import numpy as np

EDGE = 128


def _disk(size: int, radius: float) -> np.ndarray:
    yy, xx = np.mgrid[:size, :size]
    c = size / 2 - 0.5
    return ((yy - c) ** 2 + (xx - c) ** 2 < (radius * size) ** 2).astype(np.uint8)


_DISK = _disk(EDGE, 0.45)


def global_descriptor(rgb: np.ndarray) -> np.ndarray:
    img = cv2.resize(rgb, (EDGE, EDGE), interpolation=cv2.INTER_AREA)
    hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV)
    hist = cv2.calcHist([hsv], [0, 1, 2], _DISK, [8, 6, 6], [0, 180, 0, 256, 0, 256]).ravel()
    hist = np.sqrt(hist / max(hist.sum(), 1.0))
    grey = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).astype(np.float32)
    polar = cv2.warpPolar(grey, (32, 128), (EDGE / 2, EDGE / 2), EDGE * 0.45, cv2.WARP_POLAR_LINEAR)
    spectrum = np.log1p(np.abs(np.fft.fft(polar - polar.mean(), axis=0))[:16]).ravel()
    radial_img = cv2.warpPolar(img.astype(np.float32), (24, 90), (EDGE / 2, EDGE / 2), EDGE * 0.48,
                               cv2.WARP_POLAR_LINEAR)
    radial = np.concatenate([radial_img.mean(0).ravel(), radial_img.std(0).ravel()]) / 255.0
    parts = []
    for v in (hist, spectrum, radial):
        v = v.astype(np.float64)
        parts.append((v - v.mean()) / (np.linalg.norm(v - v.mean()) + 1e-12))
    return np.concatenate(parts).astype(np.float32)


def knn_pairs(desc: np.ndarray, k: int, chunk: int = 1024) -> dict[tuple[int, int], float]:
    """Symmetrised k-nearest-neighbour pairs (cosine similarity after per-dimension standardisation)."""
    if len(desc) < 2:
        return {}
    z = (desc - desc.mean(0)) / (desc.std(0) + 1e-9)
    z /= np.linalg.norm(z, axis=1, keepdims=True) + 1e-12
    return knn_cosine(z, k, chunk)


class Vocabulary:
    """Visual words and their IDF weights, learnt once, so other views can be embedded alike."""

    def __init__(self, kmeans, idf: np.ndarray) -> None:
        self.kmeans, self.idf = kmeans, idf

    def histograms(self, sets: list[np.ndarray]) -> np.ndarray:
        hist = np.zeros((len(sets), len(self.idf)), np.float32)
        for i, s in enumerate(sets):
            if len(s):
                hist[i] = np.bincount(self.kmeans.predict(np.asarray(s, np.float32)), minlength=len(self.idf))
        return hist

    def tfidf(self, hist: np.ndarray) -> np.ndarray:
        tfidf = np.sqrt(hist) * self.idf
        return tfidf / (np.linalg.norm(tfidf, axis=1, keepdims=True) + 1e-12)

    def embed(self, descriptor_sets: list[np.ndarray], mirrored_sets: list[np.ndarray]) -> np.ndarray:
        """TF-IDF rows of further views (direct + mirrored) under this vocabulary and IDF."""
        if self.kmeans is None:
            return np.zeros((len(descriptor_sets), 1), np.float32)
        return self.tfidf(self.histograms(_stacked(descriptor_sets, mirrored_sets)))


def _stacked(descriptor_sets: list[np.ndarray], mirrored_sets: list[np.ndarray]) -> list[np.ndarray]:
    return [np.vstack([d, m]).astype(np.float32) if len(d) else np.zeros((0, 128), np.float32)
            for d, m in zip(descriptor_sets, mirrored_sets, strict=True)]


def vocabulary(descriptor_sets: list[np.ndarray], mirrored_sets: list[np.ndarray], n_words: int = 1024,
               seed: int = 0, sample: int = 20_000) -> tuple[Vocabulary, np.ndarray]:
    """TF-IDF visual-word histograms of local descriptors (direct + mirrored, so flips match).

    Near-duplicates share many local patches even when crops, zoom, stain or re-encoding move
    their global statistics; retrieving neighbours by shared visual words is the classic
    remedy and costs one small k-means per run. Returns the vocabulary (to embed other views
    of the same images, e.g. zoom views) and the images' rows.
    """
    from sklearn.cluster import MiniBatchKMeans

    sets = _stacked(descriptor_sets, mirrored_sets)
    pool = np.vstack([s for s in sets if len(s)]) if any(len(s) for s in sets) else np.zeros((0, 128), np.float32)
    if len(pool) < 2:
        return Vocabulary(None, np.zeros(1)), np.zeros((len(sets), 1), np.float32)
    rng = np.random.default_rng(seed)
    train = pool[rng.choice(len(pool), size=min(sample, len(pool)), replace=False)]
    k = int(min(n_words, max(2, len(train) // 20)))
    km = MiniBatchKMeans(n_clusters=k, random_state=seed, batch_size=4096, n_init=1).fit(train)
    vocab = Vocabulary(km, np.zeros(k))
    hist = vocab.histograms(sets)
    vocab.idf = np.log((1 + len(sets)) / (1 + (hist > 0).sum(0)))
    return vocab, vocab.tfidf(hist)


def bag_of_words(descriptor_sets: list[np.ndarray], mirrored_sets: list[np.ndarray], n_words: int = 1024,
                 seed: int = 0, sample: int = 20_000) -> np.ndarray:
    """The images' TF-IDF visual-word rows (see ``vocabulary``)."""
    return vocabulary(descriptor_sets, mirrored_sets, n_words, seed, sample)[1]


def centre_zoom(rgb: np.ndarray, zoom: float) -> np.ndarray:
    """The central square of side ``min(h, w) / zoom``: what a relative zoomed by ``zoom`` about the
    centre shows (LC25000's crop-and-zoom keeps the centre; RANSAC on its real families puts the
    centre of one relative within a few pixels of the other's for most pairs)."""
    h, w = rgb.shape[:2]
    side = max(round(min(h, w) / zoom), 8)
    top, left = (h - side) // 2, (w - side) // 2
    return np.ascontiguousarray(rgb[top:top + side, left:left + side])


def _add_top_k(pairs: dict[tuple[int, int], float], rows: np.ndarray, cols: np.ndarray, k: int, chunk: int) -> None:
    """Into ``pairs``: (i, j) for each of row i's k most similar columns j != i (both index the same
    images), keeping the largest similarity an unordered pair is found at."""
    for start in range(0, len(rows), chunk):
        sim = rows[start:start + chunk] @ cols.T
        for r in range(sim.shape[0]):
            sim[r, start + r] = -np.inf
        top = np.argpartition(-sim, k - 1, axis=1)[:, :k]
        for r in range(sim.shape[0]):
            i = start + r
            for j in top[r].tolist():
                key = (min(i, j), max(i, j))
                pairs[key] = max(pairs.get(key, -np.inf), float(sim[r, j]))


def knn_cross(queries: np.ndarray, targets: np.ndarray, k: int, chunk: int = 1024) -> dict[tuple[int, int], float]:
    """Pairs (i, j), i != j, where target row j is among query row i's k most cosine-similar
    targets, or query i among target j's k most similar queries; both sets index the same images."""
    n = len(queries)
    if n < 2:
        return {}
    pairs: dict[tuple[int, int], float] = {}
    for rows, cols in ((queries, targets), (targets, queries)):
        _add_top_k(pairs, rows, cols, min(k, n - 1), chunk)
    return pairs


def knn_cosine(vectors: np.ndarray, k: int, chunk: int = 1024) -> dict[tuple[int, int], float]:
    """Symmetrised k-nearest-neighbour pairs by plain cosine similarity of L2-normalised rows."""
    n = len(vectors)
    if n < 2:
        return {}
    pairs: dict[tuple[int, int], float] = {}
    _add_top_k(pairs, vectors, vectors, min(k, n - 1), chunk)
    return pairs
