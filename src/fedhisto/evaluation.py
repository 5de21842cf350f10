"""Classification, discrimination and calibration metrics (study section 3.10, SPEC section 8).

Absent classes are never scored as observed: per-class precision / recall / F1 and the
one-vs-rest AUROC / AUPRC of a class with no true image are reported as absent (None) and
left out of the macro averages, which average over the classes present in the labels.
"""

from __future__ import annotations

import itertools

import numpy as np
from sklearn.metrics import average_precision_score, roc_auc_score

from fedhisto import CLASSES

N = len(CLASSES)


def confusion(y: np.ndarray, pred: np.ndarray) -> np.ndarray:
    m = np.zeros((N, N), dtype=int)
    np.add.at(m, (y, pred), 1)
    return m


def ece(probs: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error over equal-width bins of top-1 confidence (right-closed bins)."""
    conf = probs.max(1)
    correct = (probs.argmax(1) == y).astype(float)
    edges = np.linspace(0.0, 1.0, bins + 1)
    total = 0.0
    for lo, hi in itertools.pairwise(edges):
        sel = (conf > lo) & (conf <= hi) if lo > 0 else (conf >= lo) & (conf <= hi)
        if sel.any():
            total += sel.mean() * abs(correct[sel].mean() - conf[sel].mean())
    return float(total)


def classification_metrics(probs: np.ndarray, y: np.ndarray, ece_bins: int = 15) -> dict:
    probs = np.asarray(probs, dtype=np.float64)
    y = np.asarray(y, dtype=int)
    pred = probs.argmax(1)
    cm = confusion(y, pred)
    present = cm.sum(1) > 0
    per_class = {}
    for c, name in enumerate(CLASSES):
        tp, support, predicted = cm[c, c], cm[c].sum(), cm[:, c].sum()
        if not present[c]:
            per_class[name] = {"support": 0, "precision": None, "recall": None, "f1": None, "absent": True}
            continue
        precision = tp / predicted if predicted else 0.0
        recall = tp / support
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_class[name] = {"support": int(support), "precision": float(precision), "recall": float(recall),
                           "f1": float(f1), "absent": False}
    observed = [per_class[n] for n, p in zip(CLASSES, present, strict=True) if p]
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
        "balanced_accuracy": float(np.mean([o["recall"] for o in observed])),
        "macro_f1": float(np.mean([o["f1"] for o in observed])),
        "macro_auroc": float(np.mean(auroc)) if auroc else None,
        "macro_auprc": float(np.mean(auprc)) if auprc else None,
        "nll": float(-np.log(p_true).mean()),
        "brier": float(((probs - onehot) ** 2).sum(1).mean()),
        "ece": ece(probs, y, ece_bins),
        "per_class": per_class,
        "confusion": cm.tolist(),
        "absent_classes": [n for n, p in zip(CLASSES, present, strict=True) if not p],
    }


def macro_f1_from(y: np.ndarray, pred: np.ndarray) -> float:
    """Macro-F1 over the classes present in ``y``, by the bootstrap's vectorised confusion code."""
    from fedhisto.bootstrap import metrics_from_confusion

    return float(metrics_from_confusion(confusion(y, pred)[None])["macro_f1"][0])
