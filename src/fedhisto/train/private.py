"""DP-SGD as a wrapper around a method's client objective, as Flower wraps a strategy (docs/privacy.md).

The objective declares what DP-SGD needs and nothing else decides it: the tensors it trains
(``Objective.trained``: names, and masks where a block is structurally zero), which are exactly the
tensors differentiated per unit, clipped, noised and stepped (``fedhisto.privacy`` takes them as an
argument); its loss of one image and the gradient of any term without data
(``Objective.private_objective``); and whether it can be wrapped at all (``Objective.dp_refusal``,
derived from its declarations). :func:`dp_refusals` lists every reason a configuration cannot run
under DP, by name (the engine, each method's objective, the budget); the configuration door
(``entry.study_config``) and :meth:`PrivateSites.start` refuse with it.

``PrivateSites`` holds one ``privacy.site.DPSite`` per participant (its units, ledger and secret
noise seed) for the whole run. Before any training it checks every site's plan (an unsatisfiable
budget is refused there, by site); each round it refuses to start a round that would take a site beyond
``privacy.target_epsilon`` (``RunStopped``: the run stops there and says so), runs the round as
round(1/q) x ``local_epochs`` Poisson steps of clipped per-unit gradients plus Gaussian noise, and
(an objective that uploads after aggregation, with ``privacy.prototypes: noised``) releases the
prototype upload through the Gaussian mechanism at its own noise multiplier. Its ``state()`` goes into
the run's checkpoint and ``restore`` resumes it exactly.

The plan is ``train.plan``'s (the round's torch seed for dropout, the ``LocalRun`` the objective's view
hook sees, the optimiser), with two differences that privacy forces: the batches are Poisson draws
of whole units instead of a permutation, and the site reports no training losses (they are
functions of its data that nothing noises; the history's ``losses`` are empty under DP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedhisto.config.study import Config
from fedhisto.data.splits import Split, eval_batches
from fedhisto.fedmath.prototypes import ClientPrototypes
from fedhisto.methods import build_method
from fedhisto.methods.base import Batch
from fedhisto.methods.objective import Objective
from fedhisto.model.peft_model import N_CLASSES, FedHistoModel
from fedhisto.privacy.accountant import PrivacyBudgetExceeded, check_plan
from fedhisto.privacy.dpsgd import noise_generator, privacy_units, steps_per_epoch
from fedhisto.privacy.releases import noised_prototypes, prototype_sigma, releases_of
from fedhisto.privacy.site_dpsgd import DPSite
from fedhisto.train.local import OPTIMIZERS, kept_state, make_optimizer
from fedhisto.train.loop import RunStopped
from fedhisto.train.plan import (
    LocalResult,
    MemberJob,
    check_optimizer,
    declared_trained,
    local_run,
    seed_round,
    train_only,
)


def _seed_for(run_seed: int, client_idx: int) -> int:
    """``privacy.noise_seed: run``: reproducible from the run seed (research only, see docs/privacy.md)."""
    return int(np.random.SeedSequence([run_seed, 25, client_idx]).generate_state(1, np.uint64)[0] >> 1)


#: The batched engine forwards every client's views in one pass with masks drawn once for the stack;
#: DP-SGD is built for the sequential engine only.
DP_ENGINES = ("sequential",)


def dp_refusals(cfg: Any) -> list[str]:
    """Every reason ``privacy.enabled: true`` cannot run with ``cfg``'s methods and engine, one line each:
    the engine, each method's objective in its own words (``Objective.dp_refusal``), and the budget."""
    out = []
    if cfg.train.engine not in DP_ENGINES:
        out.append(f"train.engine: {cfg.train.engine!r} cannot run DP-SGD; set train.engine: sequential (the batched "
                   "engine stacks every client's views in one pass and computes no per-unit gradients)")
    p = cfg.privacy
    for name in dict.fromkeys([*cfg.train.methods, *cfg.train.ablations]):
        try:
            objective = build_method(name, cfg).objective
        except ImportError as exc:
            out.append(f"method {name!r} cannot train under DP-SGD: its class cannot be imported ({exc})")
            continue
        if why := objective.dp_refusal():
            out.append(f"method {name!r} cannot train under DP-SGD: {why}")
        elif p.target_epsilon is not None and not any("privacy.target_epsilon" in line for line in out):
            # epsilon per round depends on sigma, q, steps, delta and whether the objective uploads after
            # aggregation, not on a site's size; n only enters the delta < 1/n check, made per site when the
            # run starts (accountant.check_plan): any n below 1/delta here
            releases = releases_of(p, cfg.train.local_epochs, bool(objective.post_uploads))
            try:
                check_plan(name, max(1, int(0.5 / p.delta)), releases, cfg.train.max_rounds, p.delta,
                           p.target_epsilon, p.on_budget)
            except PrivacyBudgetExceeded as exc:
                out.append(f"privacy.target_epsilon: method {name!r} (every site): "
                           f"{str(exc).removeprefix(f'site {name}: ')}")
    return out


def check_privacy(cfg: Any) -> None:
    """Raise ValueError listing every refusal when ``cfg.privacy.enabled`` (``entry.study_config`` calls it)."""
    if cfg.privacy.enabled and (problems := dp_refusals(cfg)):
        raise ValueError("privacy.enabled is true but:\n    " + "\n    ".join(problems))


@dataclass
class PrivateSites:
    """The DP-SGD wrapper of one run's client objective: every participant's site, ledger and secret seed."""

    cfg: Config
    objective: Objective
    clients: dict[str, Split]                 # the participants' optimisation sets
    family_of: dict[str, str] | None
    seed: int                                 # the run seed
    sites: dict[str, DPSite] = field(default_factory=dict)
    stop_reason: str | None = None

    @classmethod
    def start(cls, cfg: Config, objective: Objective, clients: dict[str, Split], family_of: dict[str, str] | None,
              seed: int) -> PrivateSites:
        """Every participant's units and plan check (refusals raise before any training); an objective that
        cannot be wrapped is refused by name, whichever door the configuration came through."""
        if why := objective.dp_refusal():
            raise ValueError(f"privacy.enabled is true but method {objective.name!r} cannot train under DP-SGD: {why}")
        out = cls(cfg, objective, clients, family_of, seed)
        p, epochs = cfg.privacy, objective.local_schedule(0).epochs
        for k, name in enumerate(sorted(clients)):
            secret = None if p.noise_seed == "secret" else _seed_for(seed, k)
            out.sites[name] = DPSite.start(name, out.units_of(name), p, cfg.train.max_rounds, epochs,
                                           out.uploads_prototypes, seed=secret)
        return out

    @property
    def uploads_prototypes(self) -> bool:
        return bool(self.objective.post_uploads)

    def units_of(self, name: str):
        return privacy_units(self.clients[name].ids, self.cfg.privacy.unit, self.family_of)

    # -------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        return {"privacy": {n: s.state() for n, s in sorted(self.sites.items())}}

    def restore(self, saved: dict | None) -> None:
        """Resume every site's ledger and secret seed from the checkpoint (None: a fresh run)."""
        if not saved:
            return
        epochs = self.objective.local_schedule(0).epochs
        got = saved["privacy"]
        if set(got) != set(self.sites):
            raise ValueError(f"checkpoint privacy state has sites {sorted(got)}, the run has {sorted(self.sites)}")
        self.sites = {n: DPSite.resume(got[n], self.units_of(n), self.cfg.privacy, epochs, self.uploads_prototypes)
                      for n in sorted(got)}

    # ------------------------------------------------------------ rounds
    def before_round(self, r: int, names: list[str]) -> None:
        """Stop the run (``RunStopped``) when round ``r`` would take any of ``names`` beyond the budget."""
        releases = releases_of(self.cfg.privacy, self.objective.local_schedule(r).epochs, self.uploads_prototypes)
        for n in names:
            try:
                self.sites[n].ledger.check_round(r, releases)
            except PrivacyBudgetExceeded as exc:
                self.stop_reason = f"privacy budget: {exc}"
                raise RunStopped(self.stop_reason) from exc

    def local_train(self, name: str, model: FedHistoModel, start_state: dict[str, torch.Tensor],
                    descriptor: torch.Tensor | None, payload: dict, round_idx: int, client_idx: int,
                    device: torch.device, optimizer_state: dict | None = None) -> LocalResult:
        """One participant's round of DP-SGD from ``start_state`` (the sequential engine's plan otherwise).
        ``optimizer_state`` (``train.readings.optimizer_state: kept``): the site's AdamW state from its
        previous round; AdamW's moments are functions of the noised gradients only, so keeping them at
        the site is post-processing and changes no epsilon."""
        objective, cfg, data, site = self.objective, self.cfg, self.clients[name], self.sites[name]
        job = MemberJob(start_state, data, descriptor, payload, self.seed, round_idx, client_idx, optimizer_state)
        plan = objective.local_schedule(round_idx)
        check_optimizer(objective, plan, tuple(OPTIMIZERS), "sequential")
        seed_round(job)  # the per-sample dropout masks draw from the round's torch stream
        model.load_trainable_state(start_state)
        model.train()
        params, trained = declared_trained(objective, model, job)  # the only tensors clipped, noised and stepped
        opt = make_optimizer(plan, params, job, cfg)
        run = local_run(model, job, cfg, plan, device, params)
        per_image = objective.private_objective(run)
        per_epoch, step = steps_per_epoch(cfg.privacy.sample_rate), [0]

        def fetch(images: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            # views as the non-private engine draws them: seeded by (run seed, round x epochs + epoch, image id)
            epoch = step[0] // per_epoch
            y = torch.tensor([data.labels[i] for i in images], device=device)
            inputs = objective.batch_inputs(run, Batch(images, y, epoch, round_idx * plan.epochs + epoch, step[0]))
            return torch.stack([v.to(device) for v in inputs.views], dim=1), y

        with train_only(model, params), objective.local_session(run):  # a data-free term's gradient joins after the noise
            site.train_round(round_idx, model, opt, per_image.unit_loss, fetch, trained, descriptor=run.descriptor,
                             data_free_gradient=lambda: per_image.data_free_gradient(params), device=device,
                             on_step=lambda s: step.__setitem__(0, s))
        return LocalResult(model.trainable_state(), len(data), {}, site.steps_per_round(), kept_state(opt, params, cfg))

    @torch.no_grad()
    def upload_prototypes(self, name: str, model: FedHistoModel, descriptor: torch.Tensor | None, round_idx: int,
                          device: torch.device) -> ClientPrototypes:
        """The post-aggregation upload through the Gaussian mechanism (``privacy.releases``; in the ledger
        since ``releases_of`` counts it), over every unit's images (the non-private cap is dropped)."""
        data, site = self.clients[name], self.sites[name]
        model.eval()
        desc = descriptor.to(device)[None] if descriptor is not None else None
        zs, ys = [], []
        for x, y in eval_batches(data, self.cfg.views, self.cfg.evaluate.eval_batch):
            zs.append(model.embed(x.to(device), desc).float().cpu())
            ys.append(y)
        seed = int(np.random.SeedSequence([site.seed, round_idx, 2]).generate_state(1, np.uint64)[0] >> 1)
        generator, _ = noise_generator("cpu", seed)
        return noised_prototypes(torch.cat(zs), torch.cat(ys), torch.as_tensor(site.units.unit_of), site.units.n_units,
                                 N_CLASSES, prototype_sigma(self.cfg.privacy.noise_multiplier,
                                                            self.cfg.privacy.prototype_noise_multiplier), generator)

    # ---------------------------------------------------------- reporting
    def epsilons(self) -> dict[str, float]:
        """Each site's epsilon at ``privacy.delta`` after every round it has run (0 before its first)."""
        return {n: (s.ledger.epsilon() if s.ledger.rounds else 0.0) for n, s in sorted(self.sites.items())}

    def row(self) -> dict:
        """The history row's privacy entry after a round."""
        eps = self.epsilons()
        return {"privacy": {"epsilon": eps, "epsilon_max": max(eps.values()), "delta": self.cfg.privacy.delta}}

    def summary(self) -> dict:
        """``report.json``'s privacy block (no seed: that stays in the site's checkpoint)."""
        p = self.cfg.privacy
        eps = self.epsilons()
        return {"unit": p.unit, "noise_multiplier": p.noise_multiplier, "clip_norm": p.clip_norm,
                "prototype_noise_multiplier": (prototype_sigma(p.noise_multiplier, p.prototype_noise_multiplier)
                                               if self.uploads_prototypes else None),
                "class_counts": p.class_counts,
                "sample_rate": p.sample_rate, "delta": p.delta, "target_epsilon": p.target_epsilon,
                "steps_per_round": {n: s.steps_per_round() for n, s in sorted(self.sites.items())},
                "units": {n: s.units.n_units for n, s in sorted(self.sites.items())},
                "epsilon": eps, "epsilon_max": max(eps.values()), "stopped_by_budget": self.stop_reason,
                "history": [row for s in self.sites.values() for row in s.ledger.history()]}
