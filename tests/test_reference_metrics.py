"""The metrics and the paired bootstrap against scikit-learn, as ``tests/test_evaluation.py`` checks
them, here with their largest differences recorded: every metric of ``classification_metrics`` on
random predictions, and the paired bootstrap's percentile intervals recomputed with scikit-learn's
scores on each of the same resamples (numpy's generator seeded as the protocol says: 20260730, one
``integers(0, n, (B, n))`` draw of image indices shared by both methods)."""

from __future__ import annotations

import numpy as np
import pytest
from reference_support import Reference, check
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    balanced_accuracy_score,
    f1_score,
    log_loss,
    precision_recall_fscore_support,
    recall_score,
    roc_auc_score,
)
from test_evaluation import random_case

pytestmark = pytest.mark.reference

REFERENCES = [
    Reference("mechanism", "metrics", "scikit-learn's scores; ECE by a direct loop", "test_metrics_are_sklearns"),
    Reference("mechanism", "bootstrap", "scikit-learn's scores on the same resamples, numpy percentiles",
              "test_paired_bootstrap_is_sklearn_on_the_same_resamples"),
]


def test_metrics_are_sklearns(request):
    from fedhisto.stats.scores import classification_metrics

    worst = 0.0
    for seed in range(3):
        p, y = random_case(seed)
        m = classification_metrics(p, y)
        pred = p.argmax(1)
        pairs = [(m["accuracy"], accuracy_score(y, pred)), (m["balanced_accuracy"], balanced_accuracy_score(y, pred)),
                 (m["macro_f1"], f1_score(y, pred, average="macro")),
                 (m["macro_auroc"], roc_auc_score(y, p, multi_class="ovr", average="macro")),
                 (m["macro_auprc"], np.mean([average_precision_score(y == c, p[:, c]) for c in range(3)])),
                 (m["nll"], log_loss(y, p, labels=[0, 1, 2])), (m["brier"], np.mean(((p - np.eye(3)[y]) ** 2).sum(1)))]
        prec, rec, f1, _ = precision_recall_fscore_support(y, pred, labels=[0, 1, 2], zero_division=0)
        for c, name in enumerate(("ACA", "Normal", "SCC")):
            got = m["per_class"][name]
            pairs += [(got["precision"], prec[c]), (got["recall"], rec[c]), (got["f1"], f1[c])]
        conf, correct, ece = p.max(1), p.argmax(1) == y, 0.0
        for b in range(15):  # 15 equal-width bins of the top-1 confidence
            inside = (conf > b / 15) & (conf <= (b + 1) / 15)
            if inside.any():
                ece += inside.mean() * abs(correct[inside].mean() - conf[inside].mean())
        pairs.append((m["ece"], ece))
        worst = max(worst, *(abs(a - b) for a, b in pairs))
    check(request, "mechanism", "metrics", worst, 1e-12)


def _recall(c: int):
    return lambda y, pred: recall_score(y, pred, labels=[c], average="macro", zero_division=0)


def test_paired_bootstrap_is_sklearn_on_the_same_resamples(request):
    from fedhisto.stats.resampling import paired_bootstrap

    p_a, y = random_case(11, n=120)
    p_b = np.roll(p_a, 1, axis=1) * 0.3 + p_a * 0.7
    a, b = p_a.argmax(1), p_b.argmax(1)
    resamples, seed = 150, 20260730
    ours = paired_bootstrap(y, a, b, resamples, seed=seed)
    idx = np.random.default_rng(seed).integers(0, len(y), size=(resamples, len(y)))
    scores = {
        "macro_f1": lambda yy, pp: f1_score(yy, pp, average="macro", labels=np.unique(yy)),
        "balanced_accuracy": balanced_accuracy_score,
        "accuracy": accuracy_score,
        **{f"recall_{n}": _recall(c) for c, n in enumerate(("ACA", "Normal", "SCC"))},
    }
    worst = 0.0
    for key, score in scores.items():
        d = np.array([score(y[i], a[i]) - score(y[i], b[i]) for i in idx])
        lo, hi = np.percentile(d, [2.5, 97.5])
        got = ours[key]
        worst = max(worst, abs(got["ci_low"] - lo), abs(got["ci_high"] - hi), abs(got["difference"] - (score(y, a) - score(y, b))),
                    abs(got["p_delta_positive"] - (d > 0).mean()))
    check(request, "mechanism", "bootstrap", worst, 1e-12)
