"""Metrics cross-checked against scikit-learn, ECE against a direct loop, bootstrap against scipy;
the one macro-F1 definition at its three call sites; the bootstrap p bound."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    balanced_accuracy_score,
    f1_score,
    log_loss,
    precision_recall_fscore_support,
    roc_auc_score,
)

from fedhisto.stats.prediction_files import AlignmentError, ensemble
from fedhisto.stats.resampling import paired_bootstrap
from fedhisto.stats.scores import classification_metrics, ece, macro_f1


def random_case(seed: int, n: int = 300, classes=(0, 1, 2)):
    rng = np.random.default_rng(seed)
    y = rng.choice(classes, n)
    logits = rng.normal(size=(n, 3)) + 1.5 * np.eye(3)[y] * rng.random((n, 1))
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return p, y


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_sklearn(seed: int):
    p, y = random_case(seed)
    m = classification_metrics(p, y)
    pred = p.argmax(1)
    assert m["accuracy"] == pytest.approx(accuracy_score(y, pred))
    assert m["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y, pred))
    assert m["macro_f1"] == pytest.approx(f1_score(y, pred, average="macro"))
    prec, rec, f1, sup = precision_recall_fscore_support(y, pred, labels=[0, 1, 2], zero_division=0)
    for c, name in enumerate(("ACA", "Normal", "SCC")):
        pc = m["per_class"][name]
        assert (pc["precision"], pc["recall"], pc["f1"], pc["support"]) == pytest.approx((prec[c], rec[c], f1[c], sup[c]))
    assert m["macro_auroc"] == pytest.approx(roc_auc_score(y, p, multi_class="ovr", average="macro"))
    assert m["macro_auprc"] == pytest.approx(np.mean([average_precision_score(y == c, p[:, c]) for c in range(3)]))
    assert m["nll"] == pytest.approx(log_loss(y, p, labels=[0, 1, 2]))
    assert m["brier"] == pytest.approx(np.mean(((p - np.eye(3)[y]) ** 2).sum(1)))
    assert macro_f1(y, pred) == pytest.approx(m["macro_f1"])


def test_ece_against_a_direct_loop():
    p, y = random_case(7, n=500)
    conf, correct = p.max(1), (p.argmax(1) == y)
    total = 0.0
    for b in range(15):
        lo, hi = b / 15, (b + 1) / 15
        idx = [i for i in range(len(y)) if (lo < conf[i] <= hi) or (b == 0 and conf[i] == 0)]
        if idx:
            total += len(idx) / len(y) * abs(np.mean(correct[idx]) - np.mean(conf[idx]))
    assert ece(p, y, 15) == pytest.approx(total)


def test_absent_class_is_reported_not_scored():
    p, y = random_case(3, classes=(0, 1))
    m = classification_metrics(p, y)
    assert m["absent_classes"] == ["SCC"]
    assert m["per_class"]["SCC"]["recall"] is None and m["per_class"]["SCC"]["absent"]
    pred = p.argmax(1)
    assert m["balanced_accuracy"] == pytest.approx(np.mean([np.mean(pred[y == c] == c) for c in (0, 1)]))


def test_bootstrap_is_reproducible_and_matches_scipy():
    p_a, y = random_case(11, n=400)
    p_b = np.roll(p_a, 1, axis=1) * 0.3 + p_a * 0.7
    pred_a, pred_b = p_a.argmax(1), p_b.argmax(1)
    ours = paired_bootstrap(y, pred_a, pred_b, 4000, seed=20260730)
    again = paired_bootstrap(y, pred_a, pred_b, 4000, seed=20260730)
    assert ours == again
    for key, fn in [("accuracy", lambda yy, a, b: (a == yy).mean() - (b == yy).mean()),
                    ("macro_f1", lambda yy, a, b: macro_f1(yy, a) - macro_f1(yy, b))]:
        ref = stats.bootstrap((y, pred_a, pred_b), fn, paired=True, vectorized=False, n_resamples=4000,
                              method="percentile", random_state=np.random.default_rng(5))
        lo, hi = ref.confidence_interval
        width = hi - lo
        # two independent Monte Carlo runs of 4,000 resamples: bounds agree to a small fraction of the width
        assert ours[key]["ci_low"] == pytest.approx(lo, abs=0.1 * width)
        assert ours[key]["ci_high"] == pytest.approx(hi, abs=0.1 * width)
        assert ours[key]["difference"] == pytest.approx(fn(y, pred_a, pred_b))
    assert 0 <= ours["macro_f1"]["p_two_sided"] <= 1 and 0 <= ours["macro_f1"]["p_delta_positive"] <= 1


# Hand-computed macro-F1 (per-class F1 averaged over the classes present in the labels).
MACRO_F1_CASES = [
    # name, labels, predictions, expected
    ("all present, perfect", [0, 1, 2], [0, 1, 2], 1.0),
    # ACA P=R=1/2 -> 1/2; Normal P=2/3 R=1 -> 4/5; SCC P=1 R=1/2 -> 2/3
    ("all present, errors", [0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 2, 0], (1 / 2 + 4 / 5 + 2 / 3) / 3),
    # like client C5: no SCC image and none predicted. ACA P=1 R=1/2 -> 2/3; Normal P=2/3 R=1 -> 4/5.
    # Counting SCC as 0 (the old early-stopping rule) would give (2/3 + 4/5) / 3 = 0.4889.
    ("SCC absent from labels and predictions", [0, 0, 1, 1], [0, 1, 1, 1], (2 / 3 + 4 / 5) / 2),
    # SCC absent but predicted once: the miss costs ACA's recall (ACA 2/3, Normal 1), SCC is not scored
    ("SCC absent from labels, predicted", [0, 0, 1, 1], [0, 2, 1, 1], (2 / 3 + 1) / 2),
    # SCC present, never predicted: F1 0 and counted. ACA 1; Normal P=1/3 R=1 -> 1/2
    ("present class never predicted", [0, 1, 2, 2], [0, 1, 1, 1], (1 + 1 / 2 + 0) / 3),
    ("one class present", [1, 1, 1], [1, 1, 0], 4 / 5),   # Normal P=1 R=2/3
]


@pytest.mark.parametrize(("name", "y", "pred", "expected"), MACRO_F1_CASES, ids=[c[0] for c in MACRO_F1_CASES])
def test_macro_f1_call_sites_agree(name, y, pred, expected):
    """Early stopping (train.loop), the metrics stage and the bootstrap score a split identically."""
    torch = pytest.importorskip("torch")
    from fedhisto.train.participants import macro_f1 as early_stopping_macro_f1

    y, pred = np.array(y), np.array(pred)
    probs = np.eye(3)[pred] * 0.7 + 0.1                     # argmax = pred
    exact = 1e-12                                            # the same rational numbers, up to rounding
    assert macro_f1(y, pred) == pytest.approx(expected, abs=exact)
    assert classification_metrics(probs, y)["macro_f1"] == pytest.approx(expected, abs=exact)
    assert paired_bootstrap(y, pred, pred, 100, seed=1)["macro_f1"]["method"] == pytest.approx(expected, abs=exact)
    assert early_stopping_macro_f1(torch.tensor(probs), y.tolist()) == pytest.approx(expected, abs=exact)


def test_bootstrap_of_a_cohort_without_a_class_leaves_that_recall_empty():
    y = np.array([0, 0, 1, 1] * 10)                        # no SCC image at all
    res = paired_bootstrap(y, y, np.where(np.arange(40) % 5 == 0, 2, y), 200, seed=3)
    assert res["recall_SCC"]["n_resamples"] == 0 and res["recall_SCC"]["difference"] is None
    assert res["macro_f1"]["method"] == 1.0 and res["macro_f1"]["n_resamples"] == 200


@pytest.mark.parametrize("seed", range(4))
def test_macro_f1_rule_is_sklearn_over_the_labels_present(seed: int):
    p, y = random_case(seed, n=60, classes=(0, 2))     # Normal absent from the labels, sometimes predicted
    pred = p.argmax(1)
    assert (pred == 1).any()
    ref = f1_score(y, pred, labels=np.unique(y), average="macro", zero_division=0)
    assert macro_f1(y, pred) == pytest.approx(ref, abs=1e-12)
    assert classification_metrics(p, y)["macro_f1"] == pytest.approx(ref, abs=1e-12)


def test_p_is_an_upper_bound_when_no_replicate_crosses_zero():
    rng = np.random.default_rng(4)
    y = rng.integers(0, 3, 400)
    worse = np.where(rng.random(400) < 0.3, (y + 1) % 3, y)  # 30 % wrong: every resample favours y itself
    res = paired_bootstrap(y, y, worse, 10_000, seed=20260730)["macro_f1"]
    assert res["p_delta_positive"] == 1.0 and res["ci_low"] > 0
    # twice the smaller (empty) tail is 0: reported as its resolution 2/B, flagged; the study's "p < 0.0002"
    assert res["p_is_upper_bound"] is True and res["p_two_sided"] == pytest.approx(2 / 10_000)
    assert f"{res['p_two_sided']:g}" == "0.0002"
    other = np.where(rng.random(400) < 0.3, (y + 2) % 3, y)  # as good: replicates fall on both sides
    crossing = paired_bootstrap(y, worse, other, 2000, seed=1)["macro_f1"]
    assert crossing["p_is_upper_bound"] is False and 2 / 2000 <= crossing["p_two_sided"] <= 1


def test_identical_methods_give_zero_difference():
    p, y = random_case(2)
    res = paired_bootstrap(y, p.argmax(1), p.argmax(1), 500, seed=1)
    assert res["macro_f1"]["difference"] == 0 and res["macro_f1"]["ci_low"] == 0 == res["macro_f1"]["ci_high"]
    assert res["macro_f1"]["p_delta_positive"] == 0 and res["macro_f1"]["p_two_sided"] == 1
    assert res["macro_f1"]["p_is_upper_bound"] is False


def _write_pred(path, ids, labels, probs):
    lines = ["sample_id,label,p_ACA,p_Normal,p_SCC"]
    names = ("ACA", "Normal", "SCC")
    lines += [f"{i},{names[y]}," + ",".join(map(str, p)) for i, y, p in zip(ids, labels, probs, strict=True)]
    path.write_text("\n".join(lines) + "\n")


def test_ensemble_aligns_by_id_and_refuses_misalignment(tmp_path):
    _write_pred(tmp_path / "a.csv", ["x", "y"], [0, 1], [[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]])
    _write_pred(tmp_path / "b.csv", ["y", "x"], [1, 0], [[0.4, 0.5, 0.1], [0.2, 0.2, 0.6]])
    ids, y, p = ensemble([tmp_path / "a.csv", tmp_path / "b.csv"])
    assert ids == ["x", "y"] and y.tolist() == [0, 1]
    assert np.allclose(p, [[0.4, 0.25, 0.35], [0.3, 0.6, 0.1]])
    _write_pred(tmp_path / "c.csv", ["x", "z"], [0, 1], [[1, 0, 0], [0, 1, 0]])
    with pytest.raises(AlignmentError, match="differ"):
        ensemble([tmp_path / "a.csv", tmp_path / "c.csv"])
    _write_pred(tmp_path / "d.csv", ["x", "y"], [2, 1], [[1, 0, 0], [0, 1, 0]])
    with pytest.raises(AlignmentError, match="labels disagree"):
        ensemble([tmp_path / "a.csv", tmp_path / "d.csv"])


def test_a_multi_model_method_is_scored_as_its_mean_model(tmp_path):
    """local_only writes one row per image and client model; metrics and the bootstrap average the models."""
    import numpy as np

    from fedhisto.stats.prediction_files import ensemble_members, write_predictions
    from fedhisto.stats.resampling import paired_bootstrap
    from fedhisto.stats.scores import classification_metrics, mean_over_models

    y = np.array([0, 1, 2, 0, 1, 2])
    good = np.eye(3)[y] * 0.8 + 0.2 / 3
    bad = np.eye(3)[(y + 1) % 3] * 0.8 + 0.2 / 3
    rows = [{"sample_id": f"{i:02d}", "label": ["ACA", "Normal", "SCC"][c], **{f"p_{k}": f"{v:.8f}" for k, v in
            zip(["ACA", "Normal", "SCC"], probs[i], strict=True)}, "pred": "", "cohort": "external", "client": "",
            "differentiation": "", "magnification": "", "run_status": "finalised", "model": model}
            for model, probs in (("C1", good), ("C2", bad)) for i, c in enumerate(y)]
    write_predictions(tmp_path / "external.csv", rows)
    members = ensemble_members([tmp_path / "external.csv"])
    assert sorted(members) == ["C1", "C2"]
    m = mean_over_models([classification_metrics(p, yy) for _, yy, p in members.values()])
    assert m["macro_f1"] == pytest.approx(0.5) and m["accuracy"] == pytest.approx(0.5) and m["models"] == 2
    assert m["per_class"]["ACA"]["recall"] == pytest.approx(0.5)
    result = paired_bootstrap(y, good.argmax(1), [good.argmax(1), bad.argmax(1)], 200, 1)
    assert result["macro_f1"]["reference"] == pytest.approx(0.5) and result["macro_f1"]["difference"] == pytest.approx(0.5)
    single = [r for r in rows if r["model"] == "C1"]
    write_predictions(tmp_path / "single.csv", single)
    assert "model" not in (tmp_path / "single.csv").read_text().splitlines()[0]  # one model: the plain format
