"""Membership-inference audit statistics from attack scores (higher score: "was a member").

Given scores of members (canaries that were in a site's training) and non-members (canaries held
out), with the decision "member" iff score >= t:

- ROC AUC, the Mann-Whitney probability P(s_member > s_nonmember) + 0.5 P(tie);
- TPR at a fixed FPR: the largest TPR over thresholds whose FPR is at most the target (1 %, 0.1 %:
  with fewer than 1000 non-members a 0.1 % FPR means no false positive at all);
- bootstrap percentile intervals, members and non-members resampled separately (the design fixes
  both counts);
- the empirical epsilon lower bound (Jagielski et al. 2020; Nasr et al. 2021): an (eps, delta)-DP
  mechanism forces every test to satisfy FPR + e^eps FNR >= 1 - delta and FNR + e^eps FPR >= 1 - delta,
  so with Clopper-Pearson upper bounds FPR^, FNR^ holding at confidence 1 - a,

      eps_lb(t) = max( log((1 - delta - FNR^) / FPR^),  log((1 - delta - FPR^) / FNR^) ),

  and eps_lb = max_t eps_lb(t), floored at 0. Taking the best of K thresholds on the same scores
  would overstate it, so each bound is computed at a / (2K) (Bonferroni over the K thresholds and the
  two rates): the reported eps_lb holds with probability >= 1 - a.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

Scores = np.ndarray


def _as_scores(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=float).ravel()
    if a.size == 0:
        raise ValueError(f"{name}: no scores")
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: scores must be finite")
    return a


def roc_auc(member, nonmember) -> float:
    m, n = _as_scores(member, "member"), _as_scores(nonmember, "non-member")
    ranks = stats.rankdata(np.concatenate([m, n]))  # average ranks handle ties as 1/2
    return float((ranks[: m.size].sum() - m.size * (m.size + 1) / 2) / (m.size * n.size))


def _rates(m: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thresholds (every distinct score, and +inf), and the FP and FN counts at each."""
    thresholds = np.append(np.unique(np.concatenate([m, n])), np.inf)
    fp = n.size - np.searchsorted(np.sort(n), thresholds, side="left")      # non-members with score >= t
    fn = np.searchsorted(np.sort(m), thresholds, side="left")               # members with score < t
    return thresholds, fp, fn


def tpr_at_fpr(member, nonmember, fpr: float) -> float:
    """The largest TPR over thresholds with FPR <= ``fpr``."""
    if not 0 <= fpr <= 1:
        raise ValueError(f"FPR must lie in [0, 1], got {fpr}")
    m, n = _as_scores(member, "member"), _as_scores(nonmember, "non-member")
    _, fp, fn = _rates(m, n)
    ok = fp / n.size <= fpr
    return float(((m.size - fn[ok]) / m.size).max())


def bootstrap_interval(statistic: Callable[[np.ndarray, np.ndarray], float], member, nonmember, resamples: int = 1000,
                       seed: int = 0, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``statistic(member, nonmember)``, each group resampled with replacement."""
    m, n = _as_scores(member, "member"), _as_scores(nonmember, "non-member")
    rng = np.random.default_rng(seed)
    values = np.array([statistic(m[rng.integers(0, m.size, m.size)], n[rng.integers(0, n.size, n.size)])
                       for _ in range(resamples)])
    tail = (1 - confidence) / 2
    return float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))


def clopper_pearson_upper(k: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided upper bound on a binomial rate from k of n, holding with probability >= 1 - alpha."""
    k = np.asarray(k)
    with np.errstate(invalid="ignore"):
        upper = stats.beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, upper)


@dataclass(frozen=True)
class EpsilonLowerBound:
    epsilon: float           # the bound (0 when no threshold gives one)
    threshold: float         # where it is attained
    fpr_upper: float
    fnr_upper: float
    thresholds_tested: int
    confidence: float


def empirical_epsilon(member, nonmember, delta: float = 0.0, confidence: float = 0.95) -> EpsilonLowerBound:
    """The epsilon any (eps, delta)-DP training must at least have, given these audit scores (see module)."""
    if not 0 <= delta < 1 or not 0 < confidence < 1:
        raise ValueError(f"need 0 <= delta < 1 and 0 < confidence < 1 (got {delta}, {confidence})")
    m, n = _as_scores(member, "member"), _as_scores(nonmember, "non-member")
    thresholds, fp, fn = _rates(m, n)
    alpha = (1 - confidence) / (2 * thresholds.size)
    fpr_u, fnr_u = clopper_pearson_upper(fp, n.size, alpha), clopper_pearson_upper(fn, m.size, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.log((1 - delta - fnr_u) / fpr_u)
        b = np.log((1 - delta - fpr_u) / fnr_u)
    eps = np.nan_to_num(np.fmax(a, b), nan=-np.inf)
    best = int(np.argmax(eps))
    return EpsilonLowerBound(max(0.0, float(eps[best])), float(thresholds[best]), float(fpr_u[best]),
                             float(fnr_u[best]), int(thresholds.size), confidence)


def lira_scores(observed, out_scores, in_scores=None, fixed_variance: bool = True) -> np.ndarray:
    """Likelihood-ratio membership scores (LiRA, Carlini et al. 2022) from reference updates.

    ``observed`` (n,): each candidate's attack score under the audited update; ``out_scores`` (r, n):
    its scores under r reference updates trained WITHOUT it; ``in_scores`` (r, n), optional: WITH it.
    Offline (no ``in_scores``): z = (s - mu_out) / sd_out, large when the candidate looks trained on.
    Online: log N(s; mu_in, sd_in) - log N(s; mu_out, sd_out). ``fixed_variance`` pools one sd over the
    candidates (what the paper recommends with few references); otherwise one sd per candidate.
    """
    s = _as_scores(observed, "observed")
    out = np.asarray(out_scores, dtype=float)
    if out.ndim != 2 or out.shape[1] != s.size or out.shape[0] < 2:
        raise ValueError(f"out_scores must be (references >= 2, {s.size}), got {out.shape}")

    def fit(ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mu = ref.mean(0)
        sd = np.full_like(mu, ref.std(0, ddof=1).mean()) if fixed_variance else ref.std(0, ddof=1)
        return mu, np.maximum(sd, 1e-12)

    mu_out, sd_out = fit(out)
    if in_scores is None:
        return (s - mu_out) / sd_out
    ins = np.asarray(in_scores, dtype=float)
    if ins.shape[1:] != (s.size,) or ins.shape[0] < 2:
        raise ValueError(f"in_scores must be (references >= 2, {s.size}), got {ins.shape}")
    mu_in, sd_in = fit(ins)
    return stats.norm.logpdf(s, mu_in, sd_in) - stats.norm.logpdf(s, mu_out, sd_out)


def audit_summary(member, nonmember, delta: float = 0.0, resamples: int = 1000, seed: int = 0,
                  confidence: float = 0.95) -> dict:
    """Every statistic of one audit condition, with intervals, as one JSON-ready mapping."""
    out: dict = {"members": int(np.size(member)), "nonmembers": int(np.size(nonmember))}
    measures = {"auc": roc_auc, "tpr_at_fpr_1pct": lambda a, b: tpr_at_fpr(a, b, 0.01),
                "tpr_at_fpr_0.1pct": lambda a, b: tpr_at_fpr(a, b, 0.001)}
    for k, (name, fn) in enumerate(measures.items()):
        lo, hi = bootstrap_interval(fn, member, nonmember, resamples, seed + k, confidence)
        out[name] = {"value": fn(np.asarray(member, float), np.asarray(nonmember, float)), "low": lo, "high": hi}
    bound = empirical_epsilon(member, nonmember, delta, confidence)
    out["epsilon_lower_bound"] = {"value": bound.epsilon, "threshold": bound.threshold, "fpr_upper": bound.fpr_upper,
                                  "fnr_upper": bound.fnr_upper, "thresholds_tested": bound.thresholds_tested,
                                  "confidence": confidence, "delta": delta}
    if not math.isfinite(out["auc"]["value"]):
        raise ArithmeticError("non-finite AUC")
    return out
