"""Per-site privacy accounting across rounds, serialisable into a checkpoint, and the budget check.

Each site runs its own DP-SGD, so each site has its own epsilon: the composition of every step it
took, ``sum_steps eps_RDP(alpha; sigma, q)`` order by order (``privacy.rdp``), converted to
(epsilon, delta) after every round. The state is the list of rounds (round index, noise multiplier,
sample rate, steps): plain JSON numbers, so a checkpoint written after round r and read back gives
bit-identical epsilons to a run that never stopped. Other releases that compose with the SGD
steps (e.g. a noised prototype mean, a Gaussian release with q = 1) are rounds' extra entries.

Budget: with ``target_epsilon`` set, :func:`check_plan` refuses to start a site whose first round
alone would exceed it (or, with ``on_budget: refuse``, whose planned rounds would), and
:meth:`SiteAccountant.check_round` refuses a round that would take the site beyond it; both raise
:class:`PrivacyBudgetExceeded` naming the site, the round and the epsilon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from fedhisto.privacy.rdp import DEFAULT_ORDERS, epsilon_from_rdp, rdp_curve

STATE_VERSION = 1


class PrivacyBudgetExceeded(RuntimeError):
    """Running (or continuing) would take a site beyond its configured epsilon."""

    def __init__(self, message: str, site: str, round_idx: int, epsilon: float) -> None:
        super().__init__(message)
        self.site, self.round_idx, self.epsilon = site, round_idx, epsilon


@dataclass(frozen=True)
class Release:
    """``steps`` compositions of the sampled Gaussian mechanism at one (noise multiplier, sample rate)."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    kind: str = "dpsgd"      # what was released: "dpsgd" steps, or e.g. "prototypes"

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0 or not 0 <= self.sample_rate <= 1 or self.steps < 0:
            raise ValueError(f"invalid release {self}: need noise_multiplier >= 0, 0 <= sample_rate <= 1, steps >= 0")


@dataclass
class SiteAccountant:
    """The privacy ledger of one site: every round's releases and the epsilon after each round."""

    site: str
    delta: float
    target_epsilon: float | None = None
    orders: tuple[float, ...] = DEFAULT_ORDERS
    rounds: list[tuple[int, list[Release]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise ValueError(f"site {self.site}: delta must lie in (0, 1), got {self.delta}")
        if self.target_epsilon is not None and self.target_epsilon <= 0:
            raise ValueError(f"site {self.site}: target epsilon must be > 0, got {self.target_epsilon}")

    # -------------------------------------------------------------- ledger
    def _rdp(self, releases: Sequence[Release]) -> np.ndarray:
        total = np.zeros(len(self.orders))
        for r in releases:
            total = total + rdp_curve(r.noise_multiplier, r.sample_rate, r.steps, self.orders)
        return total

    def all_releases(self) -> list[Release]:
        return [r for _, releases in self.rounds for r in releases]

    def epsilon(self, extra: Sequence[Release] = ()) -> float:
        """Epsilon at ``delta`` after every recorded round (plus ``extra`` releases, if given)."""
        return epsilon_from_rdp(self._rdp([*self.all_releases(), *extra]), self.delta, self.orders)[0]

    def record_round(self, round_idx: int, releases: Sequence[Release]) -> float:
        """Add one finished round's releases; returns the site's epsilon after it."""
        if self.rounds and round_idx <= self.rounds[-1][0]:
            raise ValueError(f"site {self.site}: round {round_idx} recorded after round {self.rounds[-1][0]}")
        self.rounds.append((round_idx, list(releases)))
        return self.epsilon()

    def history(self) -> list[dict[str, Any]]:
        """One row per recorded round: round, its DP-SGD steps, epsilon after it and the round's releases, each
        with its own noise multiplier (for report.json)."""
        rows, done = [], []
        for round_idx, releases in self.rounds:
            done += releases
            eps = epsilon_from_rdp(self._rdp(done), self.delta, self.orders)[0]
            rows.append({"site": self.site, "round": round_idx, "steps": sum(r.steps for r in releases if r.kind == "dpsgd"),
                         "epsilon": eps, "delta": self.delta,
                         "releases": [{"kind": r.kind, "noise_multiplier": r.noise_multiplier,
                                       "sample_rate": r.sample_rate, "steps": r.steps} for r in releases]})
        return rows

    # -------------------------------------------------------------- budget
    def check_round(self, round_idx: int, releases: Sequence[Release]) -> float:
        """Epsilon after ``round_idx`` if it runs; raises when that exceeds the target."""
        eps = self.epsilon(releases)
        if self.target_epsilon is not None and eps > self.target_epsilon:
            now = self.epsilon()
            raise PrivacyBudgetExceeded(
                f"site {self.site}: round {round_idx} would raise epsilon from {now:.4g} to {eps:.4g} at delta "
                f"{self.delta:g}, above the budget privacy.target_epsilon={self.target_epsilon:g}; stopping before it",
                self.site, round_idx, eps)
        return eps

    # --------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """Plain JSON (floats survive a JSON round trip exactly), for the run's checkpoint."""
        return {"version": STATE_VERSION, "site": self.site, "delta": self.delta, "target_epsilon": self.target_epsilon,
                "orders": list(self.orders),
                "rounds": [{"round": i, "releases": [{"noise_multiplier": r.noise_multiplier, "sample_rate": r.sample_rate,
                                                      "steps": r.steps, "kind": r.kind} for r in rel]}
                           for i, rel in self.rounds]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SiteAccountant:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"privacy accountant state version {state.get('version')!r}; this release reads "
                             f"version {STATE_VERSION}")
        rounds = [(int(r["round"]), [Release(float(x["noise_multiplier"]), float(x["sample_rate"]), int(x["steps"]),
                                             str(x["kind"])) for x in r["releases"]]) for r in state["rounds"]]
        return cls(state["site"], float(state["delta"]), state["target_epsilon"], tuple(state["orders"]), rounds)


def check_plan(site: str, n_units: int, releases_per_round: Sequence[Release], rounds: int, delta: float,
               target_epsilon: float | None, on_budget: Literal["refuse", "stop"]) -> list[float]:
    """Before training: epsilon after each planned round; refuses an unsatisfiable plan.

    Refused (by :class:`PrivacyBudgetExceeded`): delta >= 1 / n_units (a mechanism may then publish a
    whole unit with probability delta and still qualify), a first round alone above the budget,
    and with ``on_budget: refuse`` any planned round above it. With ``stop`` the run starts and
    :meth:`SiteAccountant.check_round` stops it before the first round that would exceed it.
    """
    if n_units < 1:
        raise ValueError(f"site {site}: no privacy units to train on")
    if delta >= 1 / n_units:
        raise PrivacyBudgetExceeded(f"site {site}: privacy.delta={delta:g} is not below 1/n = {1 / n_units:.3g} "
                                    f"for its {n_units} privacy units; choose a smaller delta", site, 0, float("inf"))
    ledger = SiteAccountant(site, delta, target_epsilon)
    curve = []
    for r in range(rounds):
        curve.append(ledger.record_round(r, releases_per_round))
    if target_epsilon is not None:
        over = [r for r, eps in enumerate(curve) if eps > target_epsilon]
        if over and (over[0] == 0 or on_budget == "refuse"):
            r = over[0]
            raise PrivacyBudgetExceeded(
                f"site {site}: the plan reaches epsilon {curve[r]:.4g} at delta {delta:g} after round {r}, above the "
                f"budget privacy.target_epsilon={target_epsilon:g}"
                + (" (unsatisfiable: a single round exceeds it; raise privacy.noise_multiplier or lower "
                   "privacy.sample_rate or train.local_epochs)" if r == 0 else
                   f"; {rounds} rounds are planned (privacy.on_budget: refuse)"),
                site, r, curve[r])
    return curve
