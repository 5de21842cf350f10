"""Renyi differential privacy of the Poisson-sampled Gaussian mechanism (Mironov, Talwar, Zhang 2019).

One DP-SGD step releases ``sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)`` over a batch in which every
privacy unit takes part independently with probability ``q``. With ``mu0 = N(0, sigma^2)`` and
``mu = (1 - q) mu0 + q N(1, sigma^2)`` its RDP of order ``alpha > 1`` is

    eps_RDP(alpha) = log(A_alpha) / (alpha - 1),   A_alpha = E_{z ~ mu0}[(mu(z) / mu0(z))^alpha],

(add/remove adjacency of one unit). For integer alpha (their eq. 11)

    A_alpha = sum_{k=0}^{alpha} C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 sigma^2));

for fractional alpha the two-sided series of their section 3.3 (splitting the integral at
``z0 = sigma^2 log(1/q - 1) + 1/2``), summed until its terms fall below e^-30. RDP composes by
addition: T steps cost ``T eps_RDP(alpha)``, and steps at different (sigma, q) add order by order.

RDP to (eps, delta) uses the conversion of Balle et al. (2020, Theorem 21), as Opacus does:

    eps = min_alpha  rdp(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1).

Pure numpy/scipy; ``tests/test_privacy_accounting.py`` checks it against direct numerical
integration of ``A_alpha`` and against Opacus's independent implementation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from scipy import special

#: The order grid Opacus uses by default: fine near 1, integers up to 63.
DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def _log_add(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    return hi if lo == -math.inf else hi + math.log1p(math.exp(lo - hi))


def _log_sub(a: float, b: float) -> float:
    """log(e^a - e^b) for a >= b (the fractional series alternates in sign)."""
    if b == -math.inf:
        return a
    if a < b:
        raise ArithmeticError("log of a negative number in the RDP series")
    if a == b:
        return -math.inf
    return a + math.log(-math.expm1(b - a))


def _log_erfc(x: float) -> float:
    return math.log(2) + float(special.log_ndtr(-x * math.sqrt(2)))


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    log_a = -math.inf
    for k in range(alpha + 1):
        log_binom = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
        term = log_binom + k * math.log(q) + (alpha - k) * math.log(1 - q) + (k * k - k) / (2 * sigma**2)
        log_a = _log_add(log_a, float(term))
    return log_a


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    k = 0
    while True:
        coef = float(special.binom(alpha, k))
        log_coef = math.log(abs(coef))
        j = alpha - k
        log_t0 = log_coef + k * math.log(q) + j * math.log(1 - q)
        log_t1 = log_coef + j * math.log(q) + k * math.log(1 - q)
        log_e0 = math.log(0.5) + _log_erfc((k - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (k * k - k) / (2 * sigma**2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma**2) + log_e1
        if coef > 0:
            log_a0, log_a1 = _log_add(log_a0, log_s0), _log_add(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        k += 1
        if max(log_s0, log_s1) < -30:
            return _log_add(log_a0, log_a1)


def sampled_gaussian_rdp(noise_multiplier: float, sample_rate: float, order: float) -> float:
    """RDP of order ``order`` of ONE step of the Poisson-sampled Gaussian mechanism."""
    if not 0 <= sample_rate <= 1:
        raise ValueError(f"sample rate must lie in [0, 1], got {sample_rate}")
    if order <= 1:
        raise ValueError(f"RDP order must exceed 1, got {order}")
    if noise_multiplier < 0:
        raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
    if sample_rate == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    if sample_rate == 1:
        return order / (2 * noise_multiplier**2)
    if float(order).is_integer():
        log_a = _log_a_int(sample_rate, noise_multiplier, int(order))
    else:
        log_a = _log_a_frac(sample_rate, noise_multiplier, float(order))
    return log_a / (order - 1)


def rdp_curve(noise_multiplier: float, sample_rate: float, steps: int,
              orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of ``steps`` composed steps at every order (composition adds RDP)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    return steps * np.array(_one_step_curve(float(noise_multiplier), float(sample_rate), tuple(orders)))


@lru_cache(maxsize=256)
def _one_step_curve(noise_multiplier: float, sample_rate: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    # cached: a site's ledger re-evaluates the same (sigma, q) after every round
    return tuple(sampled_gaussian_rdp(noise_multiplier, sample_rate, a) for a in orders)


def epsilon_from_rdp(rdp: Sequence[float], delta: float,
                     orders: Sequence[float] = DEFAULT_ORDERS) -> tuple[float, float]:
    """(epsilon, best order) at ``delta`` by Balle et al. (2020)'s conversion, minimised over the orders."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    a = np.asarray(orders, dtype=float)
    r = np.asarray(rdp, dtype=float)
    if r.shape != a.shape:
        raise ValueError(f"{r.size} RDP values for {a.size} orders")
    with np.errstate(invalid="ignore"):
        eps = r - (math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    if np.isnan(eps).all() or np.isinf(eps).all():
        return math.inf, math.nan
    best = int(np.nanargmin(eps))
    return max(float(eps[best]), 0.0), float(a[best])


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            orders: Sequence[float] = DEFAULT_ORDERS) -> float:
    """Epsilon at ``delta`` after ``steps`` steps at one (noise multiplier, sample rate)."""
    return epsilon_from_rdp(rdp_curve(noise_multiplier, sample_rate, steps, orders), delta, orders)[0]


def noise_multiplier_for(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                         orders: Sequence[float] = DEFAULT_ORDERS, tolerance: float = 1e-3) -> float:
    """The smallest noise multiplier (to ``tolerance``) whose epsilon after ``steps`` is <= the target."""
    if target_epsilon <= 0:
        raise ValueError(f"target epsilon must be > 0, got {target_epsilon}")
    lo, hi = 0.0, 1.0
    while epsilon(hi, sample_rate, steps, delta, orders) > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > 1e4:
            raise ValueError(f"no noise multiplier up to 1e4 reaches epsilon {target_epsilon} at delta {delta} "
                             f"(sample rate {sample_rate}, {steps} steps)")
    while hi - lo > tolerance:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if epsilon(mid, sample_rate, steps, delta, orders) > target_epsilon else (lo, mid)
    return hi
