"""Temperature scaling and calibration measures on stored probabilities (fedhisto.stats.temperature)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import softmax

from fedhisto.stats.scores import ece
from fedhisto.stats.temperature import (
    apply_temperature,
    brier,
    calibration_summary,
    fit_temperature,
    nll,
    reliability_bins,
)

# three images, hand-scored: confidences 0.7 / 0.55 / 0.45, the third image wrong (argmax 1, label 2)
HAND_P = np.array([[0.7, 0.2, 0.1], [0.1, 0.55, 0.35], [0.2, 0.45, 0.35]])
HAND_Y = np.array([0, 1, 2])


def _miscalibrated(t0: float, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stored probabilities softmax(z) whose labels truly follow softmax(z / t0), rounded to 8
    decimals as the prediction CSVs store them: the temperature that calibrates them is t0."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 3.0, size=(n, 3))
    true = softmax(z / t0, axis=1)
    y = (rng.random(n)[:, None] > np.cumsum(true, axis=1)).sum(1)
    return np.round(softmax(z, axis=1), 8), y


@pytest.mark.parametrize("t0", [0.6, 2.5])
def test_fit_temperature_recovers_the_planted_temperature(t0):
    probs, y = _miscalibrated(t0, 20_000, seed=7)
    t = fit_temperature(probs, y)
    # tolerance from the MLE's own standard error: 1 / sqrt(N * I), I the per-image curvature of the
    # mean NLL in T (finite differences). 4 SE: a correct fit fails with probability ~6e-5.
    h = 1e-3 * t
    curvature = (nll(apply_temperature(probs, t + h), y) - 2 * nll(apply_temperature(probs, t), y)
                 + nll(apply_temperature(probs, t - h), y)) / h**2
    se = 1 / math.sqrt(len(y) * curvature)
    assert se < 0.05 * t0  # N is large enough for the check to mean something
    assert abs(t - t0) < 4 * se


def test_fitting_never_raises_nll_on_the_fitting_set_and_keeps_the_argmax():
    probs, y = _miscalibrated(2.0, 3_000, seed=1)
    t = fit_temperature(probs, y)
    after = apply_temperature(probs, t)
    assert t > 1.2  # the stored probabilities are overconfident: the fit softens them
    assert nll(after, y) < nll(probs, y) - 0.01
    np.testing.assert_array_equal(after.argmax(1), probs.argmax(1))


def test_calibrated_probabilities_fit_temperature_one():
    probs, y = _miscalibrated(1.0, 20_000, seed=3)
    assert fit_temperature(probs, y) == pytest.approx(1.0, abs=0.05)


def test_temperature_one_leaves_probabilities_unchanged():
    # all entries >= 1e-8 and rows summing to 1: the clip and the renormalisation are no-ops
    np.testing.assert_allclose(apply_temperature(HAND_P, 1.0), HAND_P, rtol=0, atol=1e-12)


def test_temperature_sharpens_and_softens():
    assert apply_temperature(HAND_P, 0.5)[0, 0] == pytest.approx(0.49 / (0.49 + 0.04 + 0.01))  # p^2 renormalised
    np.testing.assert_allclose(apply_temperature(HAND_P, 20.0).max(1), 1 / 3, atol=0.02)
    with pytest.raises(ValueError, match="positive"):
        apply_temperature(HAND_P, 0.0)


def test_a_stored_zero_is_clipped_at_the_csv_resolution():
    probs = np.array([[1.0, 0.0, 0.0]])
    assert nll(probs, np.array([1])) == pytest.approx(-math.log(1e-8))
    assert np.isfinite(fit_temperature(np.vstack([probs, HAND_P]), np.array([1, 0, 1, 2])))


def test_hand_computed_measures():
    assert nll(HAND_P, HAND_Y) == pytest.approx(-(math.log(0.7) + math.log(0.55) + math.log(0.35)) / 3, abs=1e-12)
    # squared errors per image: 0.09+0.04+0.01, 0.01+0.2025+0.1225, 0.04+0.2025+0.4225
    assert brier(HAND_P, HAND_Y) == pytest.approx((0.14 + 0.335 + 0.665) / 3, abs=1e-12)
    # 5 bins: (0.4, 0.6] holds 0.55 (right) and 0.45 (wrong): gap |0.5 - 0.5| = 0; (0.6, 0.8] holds
    # 0.7 (right): gap 0.3, weight 1/3
    assert ece(HAND_P, HAND_Y, 5) == pytest.approx(0.1, abs=1e-12)


def test_reliability_bins_share_ece_binning():
    rows = reliability_bins(HAND_P, HAND_Y, 5)
    assert [r["count"] for r in rows] == [0, 0, 2, 1, 0]
    assert rows[2]["accuracy"] == 0.5 and rows[2]["confidence"] == pytest.approx(0.5)
    assert rows[3]["accuracy"] == 1.0 and rows[0]["accuracy"] is None
    assert (rows[0]["bin_low"], rows[0]["bin_high"], rows[-1]["bin_high"]) == (0.0, 0.2, 1.0)
    probs, y = _miscalibrated(2.0, 2_000, seed=5)
    rows = reliability_bins(probs, y, 15)
    assert sum(r["count"] for r in rows) == len(y)
    from_bins = sum(r["count"] / len(y) * abs(r["accuracy"] - r["confidence"]) for r in rows if r["count"])
    assert from_bins == pytest.approx(ece(probs, y, 15), abs=1e-12)


def test_reliability_intervals_cover_the_bin_accuracy_and_shrink_with_images():
    probs, y = _miscalibrated(2.0, 4_000, seed=11)
    rows = reliability_bins(probs, y, 10, resamples=500, seed=2)
    assert rows == reliability_bins(probs, y, 10, resamples=500, seed=2)  # seeded: reproducible
    for r in (r for r in rows if r["count"] >= 20):
        assert r["ci_low"] <= r["accuracy"] <= r["ci_high"]
        # binomial standard error of the bin's accuracy: the 95 % interval spans about 2 x 1.96 of it
        se = math.sqrt(r["accuracy"] * (1 - r["accuracy"]) / r["count"])
        assert r["ci_high"] - r["ci_low"] == pytest.approx(2 * 1.96 * se, rel=0.35, abs=0.01)
    assert all(r["ci_low"] is None for r in rows if r["count"] == 0)


def test_calibration_summary_reports_before_and_after_per_cohort():
    val_p, val_y = _miscalibrated(2.0, 4_000, seed=21)
    ext_p, ext_y = _miscalibrated(2.0, 2_000, seed=22)
    s = calibration_summary(val_p, val_y, {"external": (ext_p, ext_y)}, bins=15)
    assert s["temperature"] == pytest.approx(fit_temperature(val_p, val_y))
    ext = s["cohorts"]["external"]
    assert ext["n"] == 2_000 and set(ext["before"]) == {"nll", "brier", "ece"}
    assert ext["before"]["nll"] == pytest.approx(nll(ext_p, ext_y))
    # same miscalibration in both sets: the validation temperature helps the held-out cohort too
    assert ext["after"]["nll"] < ext["before"]["nll"] and ext["after"]["ece"] < ext["before"]["ece"]
    assert s["fit"]["after"]["nll"] <= s["fit"]["before"]["nll"]
