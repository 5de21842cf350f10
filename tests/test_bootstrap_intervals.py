"""One-sample bootstrap intervals and unpaired differences (fedhisto.bootstrap.stage), which share the
paired bootstrap's resampling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedhisto.stats.resampling import bootstrap_interval, independent_difference, paired_bootstrap
from fedhisto.stats.scores import macro_f1

METRICS = {"macro_f1", "balanced_accuracy", "accuracy", "recall_ACA", "recall_Normal", "recall_SCC"}


def _noisy(n: int, right: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels and predictions right with probability ``right``, else a uniform class."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    return y, np.where(rng.random(n) < right, y, rng.integers(0, 3, n))


def test_interval_contains_the_estimate_for_every_metric():
    y, pred = _noisy(300, 0.7, seed=1)
    res = bootstrap_interval(y, pred, 1000, seed=4)
    assert set(res) == METRICS
    assert res["macro_f1"]["estimate"] == pytest.approx(macro_f1(y, pred), abs=1e-12)
    assert res["accuracy"]["estimate"] == pytest.approx((y == pred).mean(), abs=1e-12)
    for k, v in res.items():
        assert v["ci_low"] <= v["estimate"] <= v["ci_high"], k
        assert v["n_resamples"] == 1000


def test_always_right_gives_the_degenerate_interval_one():
    y = np.array([0, 1, 2] * 10)
    res = bootstrap_interval(y, y.copy(), 500, seed=0)
    for k, v in res.items():
        assert (v["estimate"], v["ci_low"], v["ci_high"]) == (1.0, 1.0, 1.0), k


def test_interval_width_matches_binomial_and_shrinks_with_images():
    widths = {}
    for n in (100, 2500):
        y, pred = _noisy(n, 0.7, seed=n)
        v = bootstrap_interval(y, pred, 2000, seed=9)["accuracy"]
        acc = v["estimate"]
        # the percentile interval of a proportion is close to +-1.96 binomial SE; 2000 resamples put
        # the 2.5 / 97.5 % quantiles within a few per cent of theirs, 20 % is ample and still tight
        assert v["ci_high"] - v["ci_low"] == pytest.approx(2 * 1.96 * math.sqrt(acc * (1 - acc) / n), rel=0.2)
        widths[n] = v["ci_high"] - v["ci_low"]
    assert 0.12 < widths[2500] / widths[100] < 0.3  # 1 / sqrt(25) = 0.2


def test_seed_reproduces_and_a_model_list_averages_the_models():
    y, a = _noisy(200, 0.8, seed=2)
    _, b = _noisy(200, 0.4, seed=3)
    assert bootstrap_interval(y, a, 300, seed=5) == bootstrap_interval(y, a, 300, seed=5)
    both = bootstrap_interval(y, [a, b], 300, seed=5)
    assert both["accuracy"]["estimate"] == pytest.approx(((y == a).mean() + (y == b).mean()) / 2, abs=1e-12)


def test_a_class_absent_from_the_labels_has_no_estimate():
    y = np.array([0, 1] * 20)
    res = bootstrap_interval(y, y.copy(), 200, seed=1)
    assert res["recall_SCC"] == {"estimate": None, "ci_low": None, "ci_high": None, "n_resamples": 0}
    assert res["macro_f1"]["estimate"] == 1.0


def test_independent_difference_of_a_set_with_itself_is_zero_and_insignificant():
    y, pred = _noisy(400, 0.7, seed=6)
    res = independent_difference(y, pred, y, pred, 2000, seed=8)
    for k, v in res.items():
        assert v["estimate"] == 0.0, k
        assert v["ci_low"] < 0 < v["ci_high"], k
        assert v["p_two_sided"] > 0.5 and not v["p_is_upper_bound"], k


def test_independent_difference_of_different_sets_bounds_p_when_no_replicate_crosses_zero():
    y_a = np.array([0, 1, 2] * 30)
    y_b = np.array([0, 1, 2] * 20)
    res = independent_difference(y_a, y_a.copy(), y_b, np.zeros_like(y_b), 1000, seed=3)
    acc = res["accuracy"]
    assert (acc["estimate_a"], acc["estimate_b"]) == (1.0, pytest.approx(1 / 3))
    assert acc["estimate"] == pytest.approx(2 / 3) and acc["ci_low"] <= acc["estimate"] <= acc["ci_high"]
    assert acc["p_is_upper_bound"] and acc["p_two_sided"] == 2 / 1000 and acc["p_delta_positive"] == 1.0


def test_unpaired_interval_is_wider_than_the_paired_one_on_the_same_images():
    # the two prediction sets share most errors: pairing cancels them, independent resampling does not
    y, a = _noisy(500, 0.7, seed=12)
    b = np.where(np.random.default_rng(13).random(500) < 0.9, a, y)
    paired = paired_bootstrap(y, b, a, 2000, seed=1)["accuracy"]
    unpaired = independent_difference(y, b, y, a, 2000, seed=1)["accuracy"]
    assert unpaired["estimate"] == pytest.approx(paired["difference"], abs=1e-12)
    assert unpaired["ci_high"] - unpaired["ci_low"] > 2 * (paired["ci_high"] - paired["ci_low"])
