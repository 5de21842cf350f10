"""Post-hoc calibration of stored probabilities: temperature scaling and its measures.

Pure numpy / scipy (no torch): everything works on the probabilities the prediction CSVs hold,
so a calibration experiment needs no model, only ``results/predictions``.

Temperature scaling (Guo et al. 2017, "On calibration of modern neural networks") rescales the
logits by one scalar T fitted on held-out images by negative log-likelihood; it never changes
the predicted class, only the confidence. The CSVs keep probabilities, not logits, so the logits
are recovered as ``log p`` (softmax is invariant to an additive constant per image, so ``log p``
is as good as the original logits).

Measures: :func:`nll`, :func:`brier` (multi-class, summed over classes) and the ECE of
:func:`fedhisto.stats.scores.ece`; :func:`reliability_bins` gives the reliability diagram on the
same binning as that ECE, optionally with a per-bin bootstrap interval of the accuracy.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax

from fedhisto.stats.resampling import resample_weights
from fedhisto.stats.scores import confidence_bins, ece

# The prediction CSVs round probabilities to 8 decimals: a stored 0 means "below 5e-9", so 1e-8
# is the smallest probability the files can vouch for; clipping there keeps log p finite without
# inventing confidence the files never recorded.
PROB_FLOOR = 1e-8
T_BOUNDS = (0.05, 20.0)


def _log_probs(probs: np.ndarray) -> np.ndarray:
    return np.log(np.clip(np.asarray(probs, dtype=np.float64), PROB_FLOOR, 1.0))


def _labels(labels: np.ndarray) -> np.ndarray:
    return np.asarray(labels, dtype=int)


def apply_temperature(probs: np.ndarray, temperature: float) -> np.ndarray:
    """``softmax(log p / T)``, with p clipped at :data:`PROB_FLOOR` (see :func:`fit_temperature`).

    T > 1 softens (lowers confidence), T < 1 sharpens; T = 1 returns ``probs`` renormalised after
    the clip, i.e. unchanged for probabilities that sum to 1 and are all at least 1e-8."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return np.exp(log_softmax(_log_probs(probs) / temperature, axis=1))


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood of the true class, p clipped at :data:`PROB_FLOOR`.

    The floor is the stored CSVs' resolution (8 decimals); Table 5's NLL (``evaluation``) clips
    at 1e-12 instead, so the two differ only for images whose true class was stored as 0."""
    y = _labels(labels)
    return float(-_log_probs(probs)[np.arange(len(y)), y].mean())


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    """Multi-class Brier score: squared error against the one-hot label summed over the classes,
    averaged over the images (0 is perfect, 2 the worst), as Table 5 reports it."""
    p = np.asarray(probs, dtype=np.float64)
    onehot = np.eye(p.shape[1])[_labels(labels)]
    return float(((p - onehot) ** 2).sum(1).mean())


def fit_temperature(probs: np.ndarray, labels: np.ndarray) -> float:
    """The temperature T in [0.05, 20] minimising the mean NLL of ``softmax(log p / T)``.

    ``probs``: N x 3 stored probabilities; logits are taken as ``log p`` with p clipped at 1e-8,
    because the prediction CSVs round probabilities to 8 decimals (a stored 0 would otherwise give
    an infinite logit). The search is scipy's bounded scalar minimiser on log T, deterministic
    (no random start): the NLL is convex in 1/T (a log-sum-exp of a linear function minus a linear
    one), hence unimodal in log T, so the bounded search finds the global minimum in the range.
    Searching on log T treats sharpening and softening by the same factor symmetrically.
    """
    logits, y = _log_probs(probs), _labels(labels)
    if len(y) == 0:
        raise ValueError("fit_temperature needs at least one image")
    rows = np.arange(len(y))

    def objective(log_t: float) -> float:
        return float(-log_softmax(logits / np.exp(log_t), axis=1)[rows, y].mean())

    fit = minimize_scalar(objective, bounds=tuple(np.log(T_BOUNDS)), method="bounded",
                          options={"xatol": 1e-6})
    return float(np.exp(fit.x))


def reliability_bins(probs: np.ndarray, labels: np.ndarray, bins: int = 15, resamples: int = 0, seed: int = 0,
                     confidence: float = 0.95, chunk: int = 2000) -> list[dict]:
    """One row per equal-width bin of top-1 confidence (the binning of ``evaluation.ece``):
    ``bin_low``, ``bin_high``, ``count``, mean ``confidence`` and ``accuracy`` (None when empty).

    With ``resamples`` > 0 each row also carries ``ci_low`` / ``ci_high``: the percentile interval
    of the bin's accuracy over image-level resamples of the whole set (seeded numpy Generator), so
    a sparsely populated bin gets the wide interval its few images deserve. Resamples in which a
    bin is empty are left out of that bin's interval; ``ci_resamples`` counts the ones used.
    """
    p, y = np.asarray(probs, dtype=np.float64), _labels(labels)
    conf = p.max(1)
    correct = (p.argmax(1) == y).astype(float)
    masks = confidence_bins(conf, bins)
    rows = []
    for lo, hi, sel in masks:
        n = int(sel.sum())
        rows.append({"bin_low": lo, "bin_high": hi, "count": n,
                     "confidence": float(conf[sel].mean()) if n else None,
                     "accuracy": float(correct[sel].mean()) if n else None})
    if resamples <= 0:
        return rows
    rng = np.random.default_rng(seed)
    # per bin, a B x n_bin block of multiplicities: accuracy of a resample = weighted mean of correct
    hits: list[list[np.ndarray]] = [[] for _ in masks]
    done = 0
    while done < resamples:
        b = min(chunk, resamples - done)
        weights = resample_weights(rng, len(y), b)
        for k, (_, _, sel) in enumerate(masks):
            counts = weights[:, sel].sum(1)
            acc = np.divide(weights[:, sel] @ correct[sel], counts, out=np.full(b, np.nan), where=counts > 0)
            hits[k].append(acc)
        done += b
    alpha = (1 - confidence) / 2
    for row, parts in zip(rows, hits, strict=True):
        acc = np.concatenate(parts)
        acc = acc[np.isfinite(acc)]
        if row["count"] and len(acc):
            lo, hi = np.percentile(acc, [100 * alpha, 100 * (1 - alpha)])
            row.update(ci_low=float(lo), ci_high=float(hi), ci_resamples=len(acc))
        else:
            row.update(ci_low=None, ci_high=None, ci_resamples=0)
    return rows


def calibration_measures(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> dict[str, float]:
    """NLL, Brier and ECE of one set of probabilities."""
    p, y = np.asarray(probs, dtype=np.float64), _labels(labels)
    return {"nll": nll(p, y), "brier": brier(p, y), "ece": ece(p, y, bins)}


def calibration_summary(val_probs: np.ndarray, val_y: np.ndarray,
                        cohorts: dict[str, tuple[np.ndarray, np.ndarray]], bins: int = 15) -> dict:
    """Fit T on the validation probabilities, then each cohort's measures before and after it.

    ``{"temperature", "fit": {n, before, after}, "cohorts": {name: {n, before, after}}}``; the
    fitting set is reported apart from the cohorts because its "after" is optimistic by design.
    """
    temperature = fit_temperature(val_probs, val_y)

    def entry(probs: np.ndarray, y: np.ndarray) -> dict:
        return {"n": len(y), "before": calibration_measures(probs, y, bins),
                "after": calibration_measures(apply_temperature(probs, temperature), y, bins)}

    return {"temperature": temperature, "bins": bins, "fit": entry(val_probs, val_y),
            "cohorts": {name: entry(p, y) for name, (p, y) in cohorts.items()}}
