"""RDP accounting of the sampled Gaussian (fedhisto.privacy.rdp), the per-site ledger and the budget."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import integrate

from fedhisto.privacy import rdp
from fedhisto.privacy.accountant import PrivacyBudgetExceeded, Release, SiteAccountant, check_plan


def _rdp_by_quadrature(sigma: float, q: float, alpha: float) -> float:
    """log E_{z~N(0, s^2)}[((1-q) + q exp((2z - 1) / (2 s^2)))^alpha] / (alpha - 1), integrated numerically
    (Mironov et al. 2019, the definition their series evaluates)."""
    def integrand(z: float) -> float:
        log_ratio = math.log((1 - q) + q * math.exp((2 * z - 1) / (2 * sigma**2)))
        return math.exp(alpha * log_ratio - z * z / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi))
    peak = alpha  # the integrand's mass moves right with alpha
    value, _ = integrate.quad(integrand, -40 * sigma, 40 * sigma + peak, epsabs=0, epsrel=1e-11, limit=1000,
                              points=[0.0, 0.5, peak])
    return math.log(value) / (alpha - 1)


@pytest.mark.parametrize(("sigma", "q"), [(1.1, 0.01), (0.8, 0.1), (2.0, 0.5), (1.0, 0.9)])
@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.7, 8.0, 16.5, 32.0])
def test_sampled_gaussian_rdp_matches_numerical_integration(sigma, q, alpha):
    got = rdp.sampled_gaussian_rdp(sigma, q, alpha)
    assert got == pytest.approx(_rdp_by_quadrature(sigma, q, alpha), rel=1e-7)


def test_full_batch_gaussian_rdp_and_conversion_by_hand():
    """q = 1: RDP is alpha / (2 sigma^2) per step (Mironov 2017); epsilon is the conversion's minimum."""
    sigma, steps, delta = 1.3, 40, 1e-5
    a = np.array(rdp.DEFAULT_ORDERS)
    assert np.allclose(rdp.rdp_curve(sigma, 1.0, steps), steps * a / (2 * sigma**2), rtol=1e-14, atol=0)
    by_hand = min(steps * x / (2 * sigma**2) + math.log((x - 1) / x) - (math.log(delta) + math.log(x)) / (x - 1)
                  for x in rdp.DEFAULT_ORDERS)
    assert rdp.epsilon(sigma, 1.0, steps, delta) == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"),
                         [(1.1, 0.01, 1000, 1e-5), (0.8, 0.05, 300, 1e-5), (2.0, 0.3, 50, 1e-6), (0.6, 0.02, 5000, 1e-4)])
def test_epsilon_matches_opacus_accountant(sigma, q, steps, delta):
    """An independent implementation (Opacus 1.6's RDP analysis, optional extra 'privacy')."""
    opacus_rdp = pytest.importorskip("opacus.accountants.analysis.rdp")
    orders = list(rdp.DEFAULT_ORDERS)
    ref, _ = opacus_rdp.get_privacy_spent(orders=orders, delta=delta,
                                          rdp=opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders))
    assert rdp.epsilon(sigma, q, steps, delta) == pytest.approx(float(ref), rel=1e-9)


@pytest.mark.parametrize(("sigma", "epochs", "orders", "published"), [
    (1.12, 60, (10, 20, 100), 2.95),          # opacus.ai, compute_dp_sgd_privacy: "(2.95, 1e-5)"
    (1.3, 20, rdp.DEFAULT_ORDERS, 1.34),      # Bu et al. 2020 (PMC7695347, Fig. 4): moments accountant "(1.34, 1e-5)"
])
def test_published_mnist_values(sigma, epochs, orders, published):
    """MNIST, N = 60000, batch 256 (q = 256/60000), delta 1e-5, with the classic conversion those sources
    use, eps = min_alpha rdp(alpha) + log(1/delta) / (alpha - 1) (Mironov 2017, Prop. 3). The figures are
    printed to two decimals, so agreement to 0.015 is what they can confirm."""
    q = 256 / 60000
    steps = math.ceil(epochs / q)
    curve = rdp.rdp_curve(sigma, q, steps, orders)
    classic = min(r - math.log(1e-5) / (a - 1) for r, a in zip(curve, orders, strict=True))
    assert classic == pytest.approx(published, abs=0.015)
    assert rdp.epsilon(sigma, q, steps, 1e-5, orders) < classic  # Balle et al.'s conversion is tighter


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    e = [rdp.epsilon(1.0, 0.05, t, 1e-5) for t in (10, 100, 1000)]
    assert e[0] < e[1] < e[2]
    assert rdp.epsilon(2.0, 0.05, 100, 1e-5) < rdp.epsilon(1.0, 0.05, 100, 1e-5)
    assert rdp.epsilon(1.0, 0.0, 100, 1e-5) < 0.2  # nothing sampled: only the conversion's slack
    assert rdp.epsilon(0.0, 0.05, 1, 1e-5) == math.inf


def test_noise_multiplier_for_a_target_epsilon():
    sigma = rdp.noise_multiplier_for(3.0, 1e-5, 0.02, 500, tolerance=1e-4)
    assert rdp.epsilon(sigma, 0.02, 500, 1e-5) <= 3.0 < rdp.epsilon(sigma - 2e-4, 0.02, 500, 1e-5)


def test_ledger_composes_rounds_and_resumes_exactly_from_json():
    rel = [Release(1.2, 0.05, 40)]
    full = SiteAccountant("C3", 1e-5)
    eps_full = [full.record_round(r, rel) for r in range(6)]
    assert eps_full[-1] == pytest.approx(rdp.epsilon(1.2, 0.05, 240, 1e-5), rel=1e-12)
    assert [row["epsilon"] for row in full.history()] == eps_full
    assert all(row["steps"] == 40 and row["site"] == "C3" for row in full.history())
    # a run killed after round 2: its checkpoint holds the ledger as JSON
    part = SiteAccountant("C3", 1e-5)
    for r in range(3):
        part.record_round(r, rel)
    resumed = SiteAccountant.from_state(json.loads(json.dumps(part.state())))
    eps_resumed = [resumed.record_round(r, rel) for r in range(3, 6)]
    assert eps_resumed == eps_full[3:]  # bit-identical
    assert resumed.history() == full.history()
    with pytest.raises(ValueError, match="round 2 recorded after round 5"):
        resumed.record_round(2, rel)
    bad = part.state() | {"version": 99}
    with pytest.raises(ValueError, match="version 99"):
        SiteAccountant.from_state(bad)


def test_mixed_releases_add_order_by_order():
    ledger = SiteAccountant("C1", 1e-5)
    ledger.record_round(0, [Release(1.0, 0.1, 20), Release(5.0, 1.0, 1, kind="prototypes")])
    a = np.array(rdp.DEFAULT_ORDERS)
    total = rdp.rdp_curve(1.0, 0.1, 20) + a / (2 * 25.0)
    assert ledger.epsilon() == pytest.approx(rdp.epsilon_from_rdp(total, 1e-5)[0], rel=1e-12)
    assert ledger.history()[0]["steps"] == 20  # only DP-SGD steps are counted as steps


def test_budget_check_names_site_round_and_epsilon():
    rel = [Release(1.0, 0.05, 40)]
    curve = check_plan("C2", 500, rel, 10, 1e-5, target_epsilon=None, on_budget="refuse")
    assert len(curve) == 10 and curve == sorted(curve)
    target = (curve[3] + curve[4]) / 2  # rounds 0-3 fit, round 4 does not
    with pytest.raises(PrivacyBudgetExceeded, match=r"site C2: the plan reaches epsilon .* after round 4") as err:
        check_plan("C2", 500, rel, 10, 1e-5, target_epsilon=target, on_budget="refuse")
    assert err.value.site == "C2" and err.value.round_idx == 4 and err.value.epsilon == curve[4]
    assert check_plan("C2", 500, rel, 10, 1e-5, target_epsilon=target, on_budget="stop") == curve
    with pytest.raises(PrivacyBudgetExceeded, match="unsatisfiable: a single round exceeds it"):
        check_plan("C2", 500, rel, 10, 1e-5, target_epsilon=curve[0] / 2, on_budget="stop")
    with pytest.raises(PrivacyBudgetExceeded, match=r"privacy.delta=0.01 is not below 1/n"):
        check_plan("C2", 500, rel, 10, 1e-2, target_epsilon=None, on_budget="stop")
    ledger = SiteAccountant("C2", 1e-5, target_epsilon=target)
    for r in range(4):
        assert ledger.check_round(r, rel) == pytest.approx(curve[r], rel=1e-12)
        ledger.record_round(r, rel)
    with pytest.raises(PrivacyBudgetExceeded, match=r"site C2: round 4 would raise epsilon from .* to "):
        ledger.check_round(4, rel)
    assert len(ledger.rounds) == 4  # the refused round was not recorded
