"""One site's DP-SGD across rounds: the plan check, every round's Poisson steps, the ledger, resume.

The engine calls :meth:`DPSite.start` once per site (it refuses an unsatisfiable plan before any
training), then :meth:`DPSite.train_round` each round (it refuses, by
``accountant.PrivacyBudgetExceeded``, a round that would exceed the budget: the engine stops that
site there), and keeps :meth:`DPSite.state` in the site's checkpoint.

Randomness: the Poisson sampling and the Gaussian noise of round r are drawn from generators seeded
by (secret seed, r), so a site resumed from its checkpoint replays round r exactly, and nothing
about them follows from the run seed the coordinator knows (unless ``privacy.noise_seed: run``).
Privacy amplification by sampling needs the sampled batch to stay hidden as much as the noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedhisto.privacy.accountant import SiteAccountant, check_plan
from fedhisto.privacy.dpsgd import (
    NoisyGradientSum,
    PrivacyUnits,
    noise_generator,
    poisson_sample,
    steps_per_epoch,
)
from fedhisto.privacy.per_sample import Trained, UnitLoss
from fedhisto.privacy.releases import releases_of
from fedhisto.privacy.step import Fetch, logical_step, set_gradients

DataFreeGradient = Callable[[], dict[str, torch.Tensor]]


def _round_seeds(seed: int, round_idx: int) -> tuple[np.random.Generator, int]:
    ss = np.random.SeedSequence([seed, round_idx])
    sampling, noise = ss.spawn(2)
    return np.random.default_rng(sampling), int(noise.generate_state(1, np.uint64)[0] >> 1)


@dataclass
class DPSite:
    site: str
    units: PrivacyUnits
    privacy: Any                  # a config_privacy.PrivacyConfig (or anything with its fields)
    local_epochs: int
    uploads_prototypes: bool
    ledger: SiteAccountant
    seed: int

    @classmethod
    def start(cls, site: str, units: PrivacyUnits, privacy: Any, rounds: int, local_epochs: int,
              uploads_prototypes: bool, seed: int | None = None) -> DPSite:
        """Check the plan (``accountant.check_plan``) and open the site's ledger. ``seed=None`` draws a secret one."""
        releases = releases_of(privacy, local_epochs, uploads_prototypes)
        check_plan(site, units.n_units, releases, rounds, privacy.delta, privacy.target_epsilon, privacy.on_budget)
        _, secret = noise_generator("cpu", seed)
        return cls(site, units, privacy, local_epochs, uploads_prototypes,
                   SiteAccountant(site, privacy.delta, privacy.target_epsilon), secret)

    def steps_per_round(self) -> int:
        return self.local_epochs * steps_per_epoch(self.privacy.sample_rate)

    def train_round(self, round_idx: int, model: nn.Module, optimizer: torch.optim.Optimizer, unit_loss: UnitLoss,
                    fetch: Fetch, trained: Trained, descriptor: torch.Tensor | None = None,
                    data_free_gradient: DataFreeGradient | None = None, device: torch.device | str = "cpu",
                    chunk_size: int | None = None, on_step: Callable[[int], None] | None = None) -> float:
        """The round's DP-SGD steps over the ``trained`` tensors (the method's declaration: only they are
        differentiated, clipped, noised and stepped); returns the site's epsilon after it. ``data_free_gradient`` adds the
        gradient of a term without data (a proximal or control-variate term, the method's
        ``private_objective``) after the noise; ``on_step(s)`` is told
        the step index before step s's batch is fetched (the engine seeds that step's views with it)."""
        p = self.privacy
        releases = releases_of(p, self.local_epochs, self.uploads_prototypes)
        self.ledger.check_round(round_idx, releases)
        sampling, noise_seed = _round_seeds(self.seed, round_idx)
        generator, _ = noise_generator(device, noise_seed)
        acc = NoisyGradientSum(p.clip_norm, p.noise_multiplier, p.sample_rate * self.units.n_units)
        for step in range(self.steps_per_round()):
            if on_step is not None:
                on_step(step)
            selected = poisson_sample(self.units.n_units, p.sample_rate, sampling)
            grads = logical_step(model, unit_loss, self.units, selected, fetch, acc, generator, trained=trained,
                                 micro_batch=p.micro_batch, descriptor=descriptor, dropout=p.dropout,
                                 chunk_size=chunk_size)
            if data_free_gradient is not None:
                extra = data_free_gradient()
                grads = {n: g + extra[n].to(g.dtype) if n in extra else g for n, g in grads.items()}
            set_gradients(model, grads, trained)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return self.ledger.record_round(round_idx, releases)

    def state(self) -> dict[str, Any]:
        """For the site's checkpoint (plain JSON): the ledger and the secret seed."""
        return {"ledger": self.ledger.state(), "seed": self.seed}

    @classmethod
    def resume(cls, state: dict[str, Any], units: PrivacyUnits, privacy: Any, local_epochs: int,
               uploads_prototypes: bool) -> DPSite:
        ledger = SiteAccountant.from_state(state["ledger"])
        if ledger.delta != privacy.delta or ledger.target_epsilon != privacy.target_epsilon:
            raise ValueError(f"site {ledger.site}: checkpoint ledger has delta {ledger.delta}, target "
                             f"{ledger.target_epsilon}; the configuration says {privacy.delta}, {privacy.target_epsilon}")
        return cls(ledger.site, units, privacy, local_epochs, uploads_prototypes, ledger, int(state["seed"]))
