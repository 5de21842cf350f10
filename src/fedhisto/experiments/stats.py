"""Interval estimates shared by the experiments: image-level percentile bootstrap of an ensemble.

Every estimate an experiment reports comes with its 95 % percentile interval over resampled
images. Ensembles are the image-wise mean of the seeds' probabilities (as Table 5 and the
bootstrap stage do). Replicates are returned as arrays so that a mean over independent cohorts
(leave-one-site-out's mean over sites) resamples each cohort on its own and averages replicate-wise.
"""

from __future__ import annotations

import numpy as np

from fedhisto.bootstrap import confusion_counts, metrics_from_confusion, paired_bootstrap
from fedhisto.evaluation import ece

CONFIDENCE = 0.95


def resample_weights(n: int, resamples: int, seed: int) -> np.ndarray:
    """Multiplicity of each image in each resample (resamples x n)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    weights = np.zeros((resamples, n))
    np.add.at(weights, (np.repeat(np.arange(resamples), n), idx.ravel()), 1.0)
    return weights


def metric_replicates(y: np.ndarray, probs: np.ndarray, resamples: int, seed: int, bins: int = 15) -> dict[str, np.ndarray]:
    """Per metric: the point estimate (index 0) followed by ``resamples`` bootstrap replicates."""
    pred = probs.argmax(1)
    weights = np.vstack([np.ones((1, len(y))), resample_weights(len(y), resamples, seed)])
    out = metrics_from_confusion(confusion_counts(y, pred, weights))
    rng = np.random.default_rng([seed, 1])  # ECE needs the images themselves, not only the confusion
    picks = [np.arange(len(y))] + [rng.integers(0, len(y), len(y)) for _ in range(resamples)]
    out["ece"] = np.array([ece(probs[i], y[i], bins) for i in picks])
    return out


def interval(replicates: np.ndarray) -> dict[str, float]:
    """Point estimate (index 0) and the percentile interval of the finite replicates."""
    rest = replicates[1:][np.isfinite(replicates[1:])]
    alpha = (1 - CONFIDENCE) / 2
    lo, hi = np.percentile(rest, [100 * alpha, 100 * (1 - alpha)]) if len(rest) else (np.nan, np.nan)
    return {"estimate": float(replicates[0]), "ci_low": float(lo), "ci_high": float(hi)}


def summarise(replicates: dict[str, np.ndarray], metrics: tuple[str, ...]) -> dict[str, float]:
    """Flat ``metric``, ``metric_ci_low``, ``metric_ci_high`` columns."""
    row = {}
    for name in metrics:
        iv = interval(replicates[name])
        row.update({name: iv["estimate"], f"{name}_ci_low": iv["ci_low"], f"{name}_ci_high": iv["ci_high"]})
    return row


def difference(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """a - b for replicates of two INDEPENDENT image sets, with a two-sided p as paired_bootstrap states it."""
    d = a - b
    row = interval(d)
    rest = d[1:][np.isfinite(d[1:])]
    tail = min((rest <= 0).mean(), (rest >= 0).mean()) if len(rest) else np.nan
    row["p_two_sided"] = float(2 / len(rest) if tail == 0 else min(1.0, 2 * tail))
    row["p_is_upper_bound"] = bool(tail == 0)
    return row


def paired_macro_f1(y: np.ndarray, probs_a: np.ndarray, probs_b: np.ndarray, resamples: int, seed: int) -> dict:
    """The bootstrap stage's paired comparison (same images, same resamples) of two ensembles."""
    res = paired_bootstrap(y, probs_a.argmax(1), probs_b.argmax(1), resamples, seed)["macro_f1"]
    return {"difference": res["difference"], "ci_low": res["ci_low"], "ci_high": res["ci_high"],
            "p_two_sided": res["p_two_sided"], "p_is_upper_bound": res["p_is_upper_bound"]}
