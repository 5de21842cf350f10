"""Interval estimates shared by the experiments: image-level percentile bootstrap of an ensemble.

Every estimate an experiment reports comes with its 95 % percentile interval over resampled
images. Ensembles are the image-wise mean of the seeds' probabilities (as Table 5 and the
bootstrap stage do). Replicates are returned as arrays so that a mean over independent cohorts
(leave-one-site-out's mean over sites) resamples each cohort on its own and averages replicate-wise.
"""

from __future__ import annotations

import numpy as np

from fedhisto.stats.resampling import (
    difference_test,
    member_mean_metrics,
    paired_bootstrap,
    resampled_metrics,
)
from fedhisto.stats.scores import ece

CONFIDENCE = 0.95


def metric_replicates(y: np.ndarray, probs: np.ndarray, resamples: int, seed: int, bins: int = 15) -> dict[str, np.ndarray]:
    """Per metric: the point estimate (index 0) followed by ``resamples`` bootstrap replicates
    (the bootstrap stage's resampling; ECE, which needs the images themselves, from its own stream)."""
    pred = [probs.argmax(1)]
    point = member_mean_metrics(y, pred, np.ones((1, len(y))))
    (reps,) = resampled_metrics(y, [pred], resamples, np.random.default_rng(seed))
    out = {k: np.concatenate([point[k], reps[k]]) for k in reps}
    rng = np.random.default_rng([seed, 1])
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
    """a - b for replicates of two INDEPENDENT image sets (index 0: point estimates), tested as
    :func:`fedhisto.stats.resampling.independent_difference` tests it."""
    d = a[1:] - b[1:]
    return {"estimate": float(a[0] - b[0]), **difference_test(d[np.isfinite(d)], CONFIDENCE)}


def paired_macro_f1(y: np.ndarray, probs_a: np.ndarray, probs_b: np.ndarray, resamples: int, seed: int) -> dict:
    """The bootstrap stage's paired comparison (same images, same resamples) of two ensembles."""
    res = paired_bootstrap(y, probs_a.argmax(1), probs_b.argmax(1), resamples, seed)["macro_f1"]
    return {"difference": res["difference"], "ci_low": res["ci_low"], "ci_high": res["ci_high"],
            "p_two_sided": res["p_two_sided"], "p_is_upper_bound": res["p_is_upper_bound"]}
