"""Classification, discrimination and calibration metrics (study section 3.10).

Absent classes are never scored as observed: per-class precision / recall / F1 and the
one-vs-rest AUROC / AUPRC of a class with no true image are reported as absent (None) and
left out of the macro averages, which average over the classes present in the labels.

:func:`macro_f1_from_confusion` is the one macro-F1 of the package: the metrics tables, the
paired bootstrap (vectorised over resamples) and early stopping (``train.participants.macro_f1``) all
call it, so a split with an absent class scores the same everywhere.
"""

from __future__ import annotations

import itertools

import numpy as np

from fedhisto import CLASSES

N = len(CLASSES)


def confusion(y: np.ndarray, pred: np.ndarray) -> np.ndarray:
    m = np.zeros((N, N), dtype=int)
    np.add.at(m, (y, pred), 1)
    return m


def class_scores(cm: np.ndarray) -> dict[str, np.ndarray]:
    """Per-class precision, recall and F1 from confusion matrices (``... x 3 x 3``, rows true).

    Vectorised over leading axes; entries may be counts or bootstrap multiplicities. ``present``
    marks classes with at least one true image. A class never predicted has precision 0
    (sklearn's ``zero_division=0``); a class absent from the labels has recall and F1 NaN
    (not observed, whatever was predicted).
    """
    cm = np.asarray(cm, dtype=np.float64)
    support, predicted = cm.sum(-1), cm.sum(-2)
    tp = np.diagonal(cm, axis1=-2, axis2=-1)
    present = support > 0
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support, out=np.full_like(tp, np.nan), where=present)
    denom = precision + np.nan_to_num(recall)
    f1 = np.divide(2 * precision * np.nan_to_num(recall), denom, out=np.zeros_like(tp), where=denom > 0)
    return {"support": support, "present": present, "precision": precision, "recall": recall,
            "f1": np.where(present, f1, np.nan)}


def mean_over_present(values: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Mean over the last axis of the entries where ``present``; NaN where none is."""
    n = present.sum(-1)
    total = np.where(present, values, 0.0).sum(-1)
    return np.divide(total, n, out=np.full(total.shape, np.nan), where=n > 0)


def macro_f1_from_confusion(cm: np.ndarray) -> np.ndarray:
    """Macro-F1: the unweighted mean of the per-class F1 over the classes present in the labels.

    With all three classes present (the global validation and test sets, the external cohort)
    this is the study's unweighted average over the three target classes, i.e. sklearn's
    ``f1_score(y, pred, labels=[0, 1, 2], average="macro", zero_division=0)``.

    Absent-class rule: a class with no true image has no F1 and is left out of the mean, whether
    or not it is predicted; equivalently ``f1_score(y, pred, labels=np.unique(y), average="macro",
    zero_division=0)``. Predicting an absent class is not free: each such image is a miss in the
    recall (hence the F1) of its true class. Rejected alternatives:

    - counting an absent class as F1 0 (``labels=[0, 1, 2], zero_division=0``, what early stopping
      used to do) caps a split lacking a class at 2/3 whatever the model does, yet the study reports
      worst-client macro-F1 between 0.946 and 1.000 although client C5's holdout has no SCC;
    - sklearn's default (classes present in labels *or* predictions) adds a zero-F1 class to the
      mean when the model spuriously predicts an absent class, so the denominator would depend on
      the model being scored.

    Vectorised over leading axes (the bootstrap's B x 3 x 3 resamples); NaN when no class is present.
    """
    s = class_scores(cm)
    return mean_over_present(s["f1"], s["present"])


def macro_f1(y: np.ndarray, pred: np.ndarray) -> float:
    """Macro-F1 of integer labels against integer predictions (:func:`macro_f1_from_confusion`)."""
    return float(macro_f1_from_confusion(confusion(np.asarray(y, dtype=int), np.asarray(pred, dtype=int))))


def confidence_bins(conf: np.ndarray, bins: int) -> list[tuple[float, float, np.ndarray]]:
    """``(low, high, mask)`` of each equal-width bin of top-1 confidence: the first bin is
    ``[0, 1/bins]``, the others right-closed ``(low, high]``. The one binning of the package: ECE
    and the reliability diagrams (``fedhisto.stats.temperature.reliability_bins``) share it."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    return [(float(lo), float(hi), (conf > lo) & (conf <= hi) if lo > 0 else (conf >= lo) & (conf <= hi))
            for lo, hi in itertools.pairwise(edges)]


def ece(probs: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error over equal-width bins of top-1 confidence (:func:`confidence_bins`)."""
    conf = probs.max(1)
    correct = (probs.argmax(1) == y).astype(float)
    total = 0.0
    for _, _, sel in confidence_bins(conf, bins):
        if sel.any():
            total += sel.mean() * abs(correct[sel].mean() - conf[sel].mean())
    return float(total)


def classification_metrics(probs: np.ndarray, y: np.ndarray, ece_bins: int = 15) -> dict:
    # imported here: training, prediction and the bootstrap use this module's F1 only, and scikit-learn costs
    # each of those jobs about 1-2 s of start-up (docs/changelog.md, levers)
    from sklearn.metrics import average_precision_score, roc_auc_score

    probs = np.asarray(probs, dtype=np.float64)
    y = np.asarray(y, dtype=int)
    pred = probs.argmax(1)
    cm = confusion(y, pred)
    scores = class_scores(cm)
    present = scores["present"]
    per_class = {}
    for c, name in enumerate(CLASSES):
        if not present[c]:
            per_class[name] = {"support": 0, "precision": None, "recall": None, "f1": None, "absent": True}
            continue
        per_class[name] = {"support": int(cm[c].sum()), "precision": float(scores["precision"][c]),
                           "recall": float(scores["recall"][c]), "f1": float(scores["f1"][c]), "absent": False}
    onehot = np.eye(N)[y]
    auroc, auprc = [], []
    for c in range(N):
        if present[c] and (~(y == c)).any():
            auroc.append(roc_auc_score(y == c, probs[:, c]))
            auprc.append(average_precision_score(y == c, probs[:, c]))
    p_true = np.clip(probs[np.arange(len(y)), y], 1e-12, 1.0)
    return {
        "n": len(y),
        "accuracy": float((pred == y).mean()),
        "balanced_accuracy": float(mean_over_present(scores["recall"], present)),
        "macro_f1": float(macro_f1_from_confusion(cm)),
        "macro_auroc": float(np.mean(auroc)) if auroc else None,
        "macro_auprc": float(np.mean(auprc)) if auprc else None,
        "nll": float(-np.log(p_true).mean()),
        "brier": float(((probs - onehot) ** 2).sum(1).mean()),
        "ece": ece(probs, y, ece_bins),
        "per_class": per_class,
        "confusion": cm.tolist(),
        "absent_classes": [n for n, p in zip(CLASSES, present, strict=True) if not p],
    }


def mean_over_models(per_model: list[dict]) -> dict:
    """The metrics of a method that keeps one model per client (``local_only``): every scalar and
    per-class score is the mean over the models (each scored on the same images), the confusion
    matrix their sum; one model returns its own metrics unchanged."""
    if len(per_model) == 1:
        return per_model[0]
    first = per_model[0]

    def mean(values):
        values = [v for v in values if v is not None]
        return float(np.mean(values)) if values else None

    out = {k: mean([m[k] for m in per_model]) for k in first if isinstance(first[k], float) or first[k] is None}
    out["per_class"] = {c: {**first["per_class"][c], **{k: mean([m["per_class"][c][k] for m in per_model])
                                                         for k in ("precision", "recall", "f1")}} for c in CLASSES}
    out.update(n=first["n"], absent_classes=first["absent_classes"], models=len(per_model),
               confusion=np.sum([m["confusion"] for m in per_model], axis=0).tolist())
    return out
