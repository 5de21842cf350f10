"""What a package knows of its training domain: statistics the sites can share (no image leaves a site),
written at export and read by ``fedhisto classify``'s domain check (:mod:`fedhisto.classify.domain_check`).

**Embeddings** (per member; Lee et al. 2018's class-conditional Gaussians with one shared covariance). Each
site sends, for its optimisation images (at most ``MAX_PER_CLASS`` per class, a seeded sample), the count
and the sum of its adapted embeddings per class and the sum of their outer products
(:func:`site_statistics`); the pooled class means and within-class covariance follow exactly from those sums
(:func:`pool_statistics`), shrunk toward a scaled identity with the OAS rule as scikit-learn writes it
(Chen et al. 2010, eq. 23; :func:`oas`), since a 768-wide covariance from a few hundred images is otherwise
ill-conditioned. An image's out-of-domain score is its Mahalanobis distance to the nearest class mean
(:func:`mahalanobis_scores`), averaged over the members. Embeddings are taken with the package's default
descriptor (FiLM methods: the training centroid), the one ``classify`` scores with, so the score never
depends on ``--descriptor``.

**Calibration**: each site scores its own holdout images and sends the scores; the package keeps them, and
``classify`` flags an image whose score exceeds the conformal quantile of these scores at the requested
false-flag rate (:func:`conformal_threshold`); the rate actually seen on a site the threshold was not
calibrated on is measured by leaving each site out in turn (:func:`leave_one_site_out`), and the model card
and ``classify``'s JSON state both.

**Stain descriptor**: the training sites' standardised 14-d descriptors, their Ledoit-Wolf covariance
(scikit-learn; five sites in fourteen dimensions need shrinkage), and, per folder size, the largest
Mahalanobis distance and per-dimension |z| of descriptors estimated from same-size resamples (with
replacement) of each site's own stain-sample images (:func:`descriptor_limits`): a small folder's descriptor
is noisy, and the limit says how far an in-domain folder of that size strays.
"""

from __future__ import annotations

import math

import numpy as np

MAX_PER_CLASS = 256             # [ours] images per site and class in the statistics, as the prototypes' cap
FALSE_FLAG_RATE = 0.05          # [ours] classify's default per-image false-flag rate on in-domain images
DESCRIPTOR_SIZES = (1, 4, 16, 64)  # folder sizes the descriptor limits are tabulated at (larger: the 64 limit)
DESCRIPTOR_DRAWS = 10           # resamples per site and size (50 per size with five sites)
SEED = 20260514
#: float32 forward passes in other batches differ in the last digits: a calibration image scored again at
#: classify must not cross its own threshold by that noise (an image is flagged above threshold x (1 + this))
RELATIVE_TOLERANCE = 1e-5


def site_statistics(z: np.ndarray, labels: np.ndarray, n_classes: int) -> dict[str, np.ndarray]:
    """One site's shareable sums: per-class count and embedding sum, and the sum of outer products."""
    z = np.asarray(z, dtype=np.float64)
    labels = np.asarray(labels, dtype=int)
    count = np.bincount(labels, minlength=n_classes).astype(np.float64)
    total = np.zeros((n_classes, z.shape[1]))
    np.add.at(total, labels, z)
    return {"count": count, "sum": total, "outer": z.T @ z}


def pool_statistics(sites: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(class counts, class means, within-class covariance) of the union of the sites' images, from their sums
    alone. The covariance is the maximum-likelihood one (divided by the image count, as scikit-learn's
    ``empirical_covariance``); a class no site holds gets a NaN mean and is skipped when scoring."""
    count = sum(s["count"] for s in sites)
    total = sum(s["sum"] for s in sites)
    outer = sum(s["outer"] for s in sites)
    n = count.sum()
    if n < 2:
        raise ValueError(f"domain statistics need at least two images; the sites hold {int(n)}")
    with np.errstate(invalid="ignore", divide="ignore"):
        means = total / count[:, None]
    present = count > 0
    scatter = outer - (means[present].T * count[present]) @ means[present]
    return count, means, scatter / n


def oas(emp_cov: np.ndarray, n: int) -> tuple[np.ndarray, float]:
    """Oracle-approximating shrinkage of an empirical covariance from ``n`` samples, as scikit-learn's
    ``OAS`` computes it (its formula depends on the covariance and ``n`` only, so sums suffice)."""
    p = emp_cov.shape[0]
    mu = np.trace(emp_cov) / p
    alpha = np.mean(emp_cov**2)
    num = alpha + mu**2
    den = (n + 1) * (alpha - mu**2 / p)
    shrinkage = 1.0 if den == 0 else min(num / den, 1.0)
    shrunk = (1.0 - shrinkage) * emp_cov
    shrunk.flat[:: p + 1] += shrinkage * mu
    return shrunk, float(shrinkage)


def embedding_statistics(sites: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The tensors a member stores (float32, as the package holds them): class means and counts, the shrunk
    shared covariance, and the shrinkage."""
    count, means, emp = pool_statistics(sites)
    cov, shrinkage = oas(emp, int(count.sum()))
    return {"class_means": means.astype(np.float32), "class_counts": count.astype(np.float32),
            "covariance": cov.astype(np.float32), "shrinkage": np.array([shrinkage], dtype=np.float32)}


def mahalanobis_scores(z: np.ndarray, stats: dict[str, np.ndarray]) -> np.ndarray:
    """Per image, the Mahalanobis distance (shared covariance) to the nearest class mean the sites hold."""
    from scipy.linalg import pinvh

    z = np.asarray(z, dtype=np.float64)
    precision = pinvh(np.asarray(stats["covariance"], dtype=np.float64))
    means = np.asarray(stats["class_means"], dtype=np.float64)[np.asarray(stats["class_counts"]) > 0]
    d2 = np.stack([np.einsum("ij,jk,ik->i", z - mu, precision, z - mu) for mu in means])
    return np.sqrt(np.clip(d2.min(axis=0), 0.0, None))


def conformal_threshold(scores: list[float] | np.ndarray, rate: float) -> dict:
    """The split-conformal threshold at false-flag rate ``rate``: the k-th smallest calibration score with
    k = ceil((n + 1)(1 - rate)); an in-domain image exchangeable with the calibration images exceeds it with
    probability at most 1 - k / (n + 1) (``bound``). Too few calibration images for ``rate`` (k > n): the
    largest score, and the bound is 1 / (n + 1), which the result states."""
    s = np.sort(np.asarray(scores, dtype=np.float64))
    n = len(s)
    if n == 0:
        raise ValueError("no calibration scores: the package's sites scored no holdout image")
    if not 0 < rate < 1:
        raise ValueError(f"false-flag rate {rate}: must lie in (0, 1)")
    k = min(n, math.ceil((n + 1) * (1 - rate)))
    return {"threshold": float(s[k - 1]), "rate": rate, "bound": 1 - k / (n + 1), "k": k, "n": n,
            "reachable": math.ceil((n + 1) * (1 - rate)) <= n,
            "calibration_flagged": int((s > s[k - 1]).sum())}


def leave_one_site_out(scores: dict[str, list[float]], rate: float) -> dict:
    """The false-flag rate on images no threshold saw: each site's holdout images against the conformal
    threshold of the *other* sites' holdout scores at ``rate``, per site and pooled. The conformal bound holds
    for images exchangeable with the calibration set; a site's own images are not (the sites differ), so this
    says how far the stated rate carries to a site the threshold did not see. Flagged as classify flags
    (above the threshold by more than ``RELATIVE_TOLERANCE``)."""
    per_site, flagged, n = {}, 0, 0
    for site in sorted(scores):
        others = [x for other, v in scores.items() if other != site for x in v]
        own = np.asarray(scores[site], dtype=np.float64)
        if not others or not len(own):
            continue
        thr = conformal_threshold(others, rate)["threshold"]
        k = int((own > thr * (1 + RELATIVE_TOLERANCE)).sum())
        per_site[site] = {"images": len(own), "flagged": k, "rate": k / len(own), "threshold": thr}
        flagged, n = flagged + k, n + len(own)
    return {"rate": rate, "sites": per_site, "images": n, "flagged": flagged,
            "pooled_rate": flagged / n if n else None}


def descriptor_reference(standardised: dict[str, list[float]]) -> dict:
    """The training sites' standardised descriptors and their Ledoit-Wolf location and precision."""
    from sklearn.covariance import LedoitWolf

    z = np.array(list(standardised.values()), dtype=np.float64)
    lw = LedoitWolf().fit(z)
    return {"sites": {k: list(map(float, v)) for k, v in standardised.items()}, "location": lw.location_.tolist(),
            "precision": lw.precision_.tolist(), "shrinkage": float(lw.shrinkage_),
            "range": {"min": z.min(0).tolist(), "max": z.max(0).tolist()}}


def descriptor_distance(z: np.ndarray, reference: dict) -> float:
    d = np.asarray(z, dtype=np.float64) - np.asarray(reference["location"])
    return float(np.sqrt(max(d @ np.asarray(reference["precision"]) @ d, 0.0)))


def descriptor_limits(site_pixels: dict[str, list[np.ndarray]], stain_cfg, mean: np.ndarray, sd: np.ndarray,
                      reference: dict) -> dict:
    """Per folder size, the largest Mahalanobis distance and per-dimension |z| among descriptors of
    same-size resamples (with replacement) of each site's images: how far an in-domain folder strays."""
    from fedhisto.stain.stage import pooled_descriptor

    rng = np.random.default_rng(SEED)
    limits = {"sizes": list(DESCRIPTOR_SIZES), "mahalanobis": [], "dimension": [], "draws": 0}
    for size in DESCRIPTOR_SIZES:
        dist, dims = [], []
        for site in sorted(site_pixels):
            pixels = site_pixels[site]
            for _ in range(DESCRIPTOR_DRAWS):
                est = pooled_descriptor([pixels[i] for i in rng.integers(0, len(pixels), size)], stain_cfg)
                if est["fallback"]:
                    continue  # too little tissue: classify reports such a folder, never judges it
                z = (np.asarray(est["raw"]) - mean) / sd
                dist.append(descriptor_distance(z, reference))
                dims.append(np.abs(z))
        limits["mahalanobis"].append(float(max(dist)) if dist else None)
        limits["dimension"].append(np.max(dims, axis=0).tolist() if dims else None)
        limits["draws"] = max(limits["draws"], len(dist))
    return limits


def limit_for(limits: dict, n_images: int) -> tuple[int, float | None, list[float] | None]:
    """The tabulated size a folder of ``n_images`` is judged at (the largest not above it) and its limits."""
    idx = max([i for i, s in enumerate(limits["sizes"]) if s <= max(n_images, 1)] or [0])
    return limits["sizes"][idx], limits["mahalanobis"][idx], limits["dimension"][idx]
