"""Stage ``bootstrap``: paired image-level bootstrap of a named comparison (study section 3.11).

Both methods' method-level ensembles (image-wise mean of their checkpoints' probabilities,
aligned by stable sample id; misalignment is an error) are resampled with the *same* image
indices: B resamples (10,000; 5,000 for ablations) from a generator seeded with 20260730.
Per metric: each method's point estimate, the difference, its percentile 95 % CI, the
two-sided bootstrap p (twice the smaller tail mass of the differences around 0, capped at 1)
and P(delta > 0). Metrics: macro-F1 (:func:`fedhisto.stats.scores.macro_f1_from_confusion`, the
package's one definition), balanced accuracy, accuracy, per-class recall.
Resampling images cannot capture patient-level dependence; the p-values are descriptive.

Where the manifest names patients (or slides) for the external cohort, the stage also runs a
cluster bootstrap beside the image-level one: B resamples of *patients* with replacement, each
drawn patient bringing all its images (an image without a patient is its own cluster), again the
same resamples for both methods, from its own generator seeded with the same seed, so the
image-level figures are exactly those of a run without patients. The JSON keeps the image-level
results under ``metrics`` (``interval_unit: image``) and adds ``patient_level`` (null when no
patient is known); the report's Tables 6 and 7 print one row per metric and unit.

The same resampling (:func:`resampled_metrics`) serves :func:`bootstrap_interval` (one
prediction set's percentile CI, used by the report's figures) and :func:`independent_difference`
(two different image sets, each resampled on its own).

Resolution of p: with B usable replicates the smallest p this definition can return above 0 is
2/B (one replicate on the far side of zero). When no replicate lies on the far side, p is not 0
but below that resolution, so the JSON records ``p_two_sided = 2/B`` with ``p_is_upper_bound:
true`` and the tables print ``< 0.0002`` for B = 10,000: the study's "p < 0.0002".

Seeds: both ensembles of a comparison use the SAME seeds (:meth:`fedhisto.config.study.Config.comparison_seeds`),
since ensemble size alone moves macro-F1: an ablation comparison (study Table 7) uses
``train.ablation_seeds`` for both, so full v2 is its 11/33/55 subset; any other the seeds both
methods train on, so v2 against an extra comparator on ``train.comparator_seeds`` enters with
those seeds only. Unmatched seed lists are refused. The JSON records the matched seeds
(``ensemble.seeds``, and each role's list) and the ``ablation`` flag, which the report uses to split
Tables 6 and 7.
"""

from __future__ import annotations

import numpy as np

from fedhisto import CLASSES
from fedhisto.stats.scores import class_scores, macro_f1_from_confusion, mean_over_present

N = len(CLASSES)


def confusion_counts(y: np.ndarray, pred: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """B x 3 x 3 confusion matrices for B resamples given as per-image multiplicities (B x n)."""
    onehot = np.zeros((len(y), N * N))
    onehot[np.arange(len(y)), y * N + pred] = 1.0
    return (weights @ onehot).reshape(-1, N, N)


def metrics_from_confusion(cm: np.ndarray) -> dict[str, np.ndarray]:
    """Vectorised over the leading axis; classes absent from a resample drop out of the macro means."""
    s = class_scores(cm)
    out = {"macro_f1": macro_f1_from_confusion(cm), "balanced_accuracy": mean_over_present(s["recall"], s["present"]),
           "accuracy": np.diagonal(cm, axis1=1, axis2=2).sum(1) / cm.sum((1, 2))}
    for c, name in enumerate(CLASSES):
        out[f"recall_{name}"] = s["recall"][:, c]
    return out


def member_mean_metrics(y: np.ndarray, preds: list[np.ndarray], weights: np.ndarray) -> dict[str, np.ndarray]:
    """Metrics of each model's predictions, averaged over the models (one model: its metrics). A
    method that keeps one model per client (``local_only``) is scored as its mean client model."""
    per = [metrics_from_confusion(confusion_counts(y, p, weights)) for p in preds]
    return {k: np.mean([m[k] for m in per], axis=0) for k in per[0]}


Preds = np.ndarray | list[np.ndarray]


def _models(preds: Preds) -> list[np.ndarray]:
    """Predicted labels of one model, or a list of them (one per model), as a list."""
    return [preds] if isinstance(preds, np.ndarray) else list(preds)


def resample_weights(rng: np.random.Generator, n: int, b: int) -> np.ndarray:
    """B x n multiplicities of B image-level resamples with replacement (one ``integers`` draw)."""
    idx = rng.integers(0, n, size=(b, n))
    weights = np.zeros((b, n))
    np.add.at(weights, (np.repeat(np.arange(b), n), idx.ravel()), 1.0)
    return weights


def cluster_weights(rng: np.random.Generator, clusters: np.ndarray, b: int) -> np.ndarray:
    """B x n multiplicities of B cluster resamples: G clusters drawn with replacement, each image
    weighted by how often its cluster was drawn (``clusters``: the cluster index 0..G-1 of each image)."""
    g = int(clusters.max()) + 1
    counts = resample_weights(rng, g, b)  # B x G: how often each cluster was drawn
    return counts[:, clusters]


def cluster_index(keys: list[str]) -> np.ndarray:
    """Cluster index per image from its patient key; an image without one is its own cluster."""
    index: dict[str, int] = {}
    return np.array([index.setdefault(k if k else f"\0image{n}", len(index)) for n, k in enumerate(keys)], dtype=int)


def resampled_metrics(y: np.ndarray, pred_sets: list[list[np.ndarray]], resamples: int, rng: np.random.Generator,
                      chunk: int = 2000, clusters: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
    """Metrics of every prediction set on the *same* ``resamples`` resamples of the images of ``y``
    (one metric array of length ``resamples`` per set and metric). Drawn in chunks to bound memory;
    the draw order is fixed, so a seed gives the same replicates whatever the caller. ``clusters``:
    resample these clusters (patients) instead of images (:func:`cluster_weights`)."""
    n = len(y)
    parts: list[dict[str, list]] = [{} for _ in pred_sets]
    done = 0
    while done < resamples:
        b = min(chunk, resamples - done)
        weights = resample_weights(rng, n, b) if clusters is None else cluster_weights(rng, clusters, b)
        for out, preds in zip(parts, pred_sets, strict=True):
            for k, v in member_mean_metrics(y, preds, weights).items():
                out.setdefault(k, []).append(v)
        done += b
    return [{k: np.concatenate(v) for k, v in out.items()} for out in parts]


def difference_test(d: np.ndarray, confidence: float) -> dict:
    """Percentile CI and two-sided p of bootstrap differences ``d`` (finite replicates only)."""
    alpha = (1 - confidence) / 2
    lo, hi = np.percentile(d, [100 * alpha, 100 * (1 - alpha)])
    tail = min((d <= 0).mean(), (d >= 0).mean())
    bound = tail == 0            # no replicate on the far side of 0: p is below the resolution 2/B
    p = 2 / len(d) if bound else min(1.0, 2 * tail)
    return {"ci_low": float(lo), "ci_high": float(hi), "p_two_sided": float(p), "p_is_upper_bound": bool(bound),
            "p_delta_positive": float((d > 0).mean()), "n_resamples": len(d)}


def paired_bootstrap(y: np.ndarray, pred_a: Preds, pred_b: Preds,
                     resamples: int, seed: int, confidence: float = 0.95, chunk: int = 2000,
                     clusters: np.ndarray | None = None) -> dict:
    """``pred_a`` / ``pred_b``: predicted labels, or a list of them (one per model, averaged metrics).
    ``clusters``: a cluster (patient) bootstrap over these cluster indices instead of images."""
    pred_a, pred_b = _models(pred_a), _models(pred_b)
    full = np.ones((1, len(y)))
    point_a = member_mean_metrics(y, pred_a, full)
    point_b = member_mean_metrics(y, pred_b, full)
    # the same indices serve both methods: that pairing is what the test is about
    ma, mb = resampled_metrics(y, [pred_a, pred_b], resamples, np.random.default_rng(seed), chunk, clusters)
    result = {}
    for k in point_a:
        d = ma[k] - mb[k]
        d = d[np.isfinite(d)]
        if not len(d):  # recall of a class absent from the cohort: never observed, nothing to compare
            result[k] = {**dict.fromkeys(("method", "reference", "difference", "ci_low", "ci_high", "p_two_sided",
                                          "p_delta_positive")), "p_is_upper_bound": False, "n_resamples": 0}
            continue
        result[k] = {"method": float(point_a[k][0]), "reference": float(point_b[k][0]),
                     "difference": float(point_a[k][0] - point_b[k][0]), **difference_test(d, confidence)}
    return result


def bootstrap_interval(y: np.ndarray, preds: Preds, resamples: int, seed: int, confidence: float = 0.95,
                       chunk: int = 2000) -> dict[str, dict]:
    """Point estimate and percentile CI of every metric of one prediction set on one image set.

    ``preds``: predicted labels, or a list of them (one per model, metrics averaged as in
    :func:`paired_bootstrap`). Replicates where a metric is undefined (a class absent from the
    resample) are dropped; ``n_resamples`` counts the ones used. A class absent from ``y`` has no
    estimate and no interval (None, ``n_resamples`` 0).
    """
    models = _models(preds)
    point = member_mean_metrics(y, models, np.ones((1, len(y))))
    (reps,) = resampled_metrics(y, [models], resamples, np.random.default_rng(seed), chunk)
    alpha = (1 - confidence) / 2
    result = {}
    for k, v in reps.items():
        v = v[np.isfinite(v)]
        if not np.isfinite(point[k][0]) or not len(v):
            result[k] = {"estimate": None, "ci_low": None, "ci_high": None, "n_resamples": 0}
            continue
        lo, hi = np.percentile(v, [100 * alpha, 100 * (1 - alpha)])
        result[k] = {"estimate": float(point[k][0]), "ci_low": float(lo), "ci_high": float(hi),
                     "n_resamples": len(v)}
    return result


def independent_difference(y_a: np.ndarray, preds_a: Preds, y_b: np.ndarray, preds_b: Preds, resamples: int,
                           seed: int, confidence: float = 0.95, chunk: int = 2000) -> dict[str, dict]:
    """Difference a - b of every metric between two *different* image sets (e.g. two cohorts).

    Each set is resampled on its own (a's replicates first, then b's, from one generator seeded
    with ``seed``); the i-th replicates are differenced. CI and p follow :func:`paired_bootstrap`
    (percentile CI; p twice the smaller tail mass around 0, ``2/B`` with ``p_is_upper_bound``
    when no replicate crosses 0). Unpaired, so no image-level pairing narrows the interval.
    """
    models_a, models_b = _models(preds_a), _models(preds_b)
    point_a = member_mean_metrics(y_a, models_a, np.ones((1, len(y_a))))
    point_b = member_mean_metrics(y_b, models_b, np.ones((1, len(y_b))))
    rng = np.random.default_rng(seed)
    (ma,) = resampled_metrics(y_a, [models_a], resamples, rng, chunk)
    (mb,) = resampled_metrics(y_b, [models_b], resamples, rng, chunk)
    result = {}
    for k in point_a:
        d = ma[k] - mb[k]
        d = d[np.isfinite(d)]
        estimate = point_a[k][0] - point_b[k][0]
        if not np.isfinite(estimate) or not len(d):  # a class absent from either set: nothing to compare
            result[k] = {**dict.fromkeys(("estimate_a", "estimate_b", "estimate", "ci_low", "ci_high",
                                          "p_two_sided", "p_delta_positive")),
                         "p_is_upper_bound": False, "n_resamples": 0}
            continue
        result[k] = {"estimate_a": float(point_a[k][0]), "estimate_b": float(point_b[k][0]),
                     "estimate": float(estimate), **difference_test(d, confidence)}
    return result
