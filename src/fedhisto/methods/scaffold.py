"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", Algorithm 1 with option II) on the study's PEFT model, as its paper runs it.

What the paper assumes, and this method declares (``assumptions``; a run that departs from it gets a
caveat line in the report and every table row, ``Strategy.protocol_departures``):

- **local steps are plain SGD**, y_i <- y_i - eta_l (g_i(y_i) + c - c_i), without clipping or weight
  decay. The method's schedule (``local_schedule``) asks the engines for exactly that, with its own
  learning rate ``train.scaffold.local_lr`` (eta_l), not the study's AdamW; so option II's
  (x - y_i) / (K eta_l) is the mean corrected gradient of the round, in gradient units. The study's
  AdamW protocol is the registered method ``scaffold_adamw`` (a reading, not SCAFFOLD: after AdamW
  steps (x - y_i) / (K eta_l) is Adam's preconditioned step, of order 1 per coordinate, not a
  gradient, and c - c_i outweighs the data gradient; it is marked as a departure);
- **uniform weights**: f = (1/N) sum_i f_i and the server's Delta x = (1/|S|) sum_i Delta y_i
  (``train.scaffold.weighting: uniform``; ``sample_mass`` is the study's weighting, marked);
- **any participation**: N counts every participant of the round, returned or not, as the paper's
  sampled-client formula.

Client, in every local step: the gradient becomes g + c - c_i. The engine owns the optimiser, so the
correction enters as one more loss term, ``<c - c_i, theta - theta_start>`` summed over the trainable
tensors: its gradient with respect to theta is exactly c - c_i (the start state is a constant, so the
term's value is the first-order drift and starts at 0). The engine divides every micro-batch's loss
by the accumulation steps and steps after each group, so the term is scaled by
accumulation / (micro-batches in this group): every optimiser step receives c - c_i exactly once,
the last, shorter group of an epoch included.

Server, option II, after round t with K_i = optimiser steps of participant i (``RoundUpdate.steps``)
and eta_l the local learning rate of the round (``local_schedule(t).lr``):
    c_i+ = c_i - c + (x - y_i) / (K_i eta_l)           for every returned i
    c+   = c + (1 / N) sum over returned i of (c_i+ - c_i)
    x+   = x + eta_g sum_i a_i (y_i - x),  eta_g = 1   (a_i = 1/|S| under uniform weights)
Variates start at 0; a participant never seen has c_i = 0. The model step is Algorithm 1's, in the
parameters the clients train (the LoRA factors A, B, the adapter, the classifier): the mean of the
returned factors, not delta-SVD's refactorised product, so the variates and the model live in the same
coordinates.

**LoRA pairs keep their variates meaningful.** A pair's factors have a gauge: (B M, M^-1 A) is the same
s B A for any invertible r x r M. The factor mean drifts away from the balanced split delta-SVD gives
every other method (B^T B = A A^T = S / s), so each pair is refactorised to that split, which is an exact
change of basis of the same product: with B = Q_B R_B, A^T = Q_A R_A and s R_B R_A^T = U S V^T,
    B' = Q_B U sqrt(S / s) = B M,   A' = sqrt(S / s) V^T Q_A^T = M^-1 A,   M = R_B^-1 U sqrt(S / s)
(``rebalance``). Every variate of the pair is transported with it as a gradient is, c_B' = c_B M^-T and
c_A' = M^T c_A (``transport``): a variate is a mean local gradient (option II in gradient units), and
by the chain rule the gradient of any loss at the same point is, in the new factors, dL/dB' =
dL/dB M^-T and dL/dA' = M^T dL/dA. The data gradient g_i a client computes after the change of basis
is in those coordinates, so only this rule keeps g_i - c_i + c an estimate of the global gradient
(the rule of a parameter displacement, c_B M and M^-1 c_A, does not: with exact variates on an
unbalanced pair the corrected direction is then off by orders of magnitude). A pair whose factor
mean is rank-deficient (a factor still at 0) is left as it is.

``train.scaffold.variates: start_gradient`` [ours] keeps the variates in gradient units by another
route: each participant uploads, before training, the full-data gradient of its class-balanced CE at
the start state x (evaluation views, no dropout; the ``upload_before_training`` hook), the server sets
c_i = g_i(x) and c = (1/N) sum_i g_i(x) over this round's uploads, and sends c - c_i back. This is the
paper's option I (c_i+ = g_i(x)) evaluated at the round's own start instead of carried over to the
next round. It costs one extra forward/backward pass over the participant's data per round and needs
no server state. Traffic: g_i up, c - c_i down: the same two state copies per participant and round.

Where the variates live: our sites are stateless between messages, so the server keeps every c_i in
its server state on the clients' behalf (``{"c": ..., "clients": {name: c_i}}``, checkpointed with
the run) and sends c and c_i down with the start state; the client uploads only its trained state
and its step count, from which the server computes c_i+. A deployment could keep c_i at the site
instead: the server sends c, the site uploads delta c_i = c_i+ - c_i. Either way two trainable-state
copies of variates travel per participant and round (here c and c_i down, there c down and delta c_i
up), which is what Table 8 counts (``extra_traffic_bytes``).

The local learning rate: ``local_lr`` was chosen on the embedded default's global validation set only
(docs/methods.md records the sweep); no test or external prediction was looked at.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedhisto.data.splits import Split, eval_batches
from fedhisto.fedmath.aggregate import lora_pairs
from fedhisto.fedmath.losses import class_balanced_weights
from fedhisto.infra.settings_base import Strict
from fedhisto.methods.base import (
    GLOBAL,
    Batch,
    LocalRun,
    LocalSchedule,
    PaperAssumptions,
    RoundUpdate,
    balanced_cross_entropy,
    training_autocast,
)
from fedhisto.methods.dp_objective import PrivateObjective, image_ce
from fedhisto.methods.objective import Objective
from fedhisto.methods.secure_capability import SecureAggregation
from fedhisto.methods.strategy import Strategy
from fedhisto.model.peft_model import FedHistoModel

State = dict[str, torch.Tensor]

LOCAL_LR = 0.1  # eta_l: see docs/methods.md for the validation sweep that chose it


class ScaffoldConfig(Strict):
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II) on the PEFT model; global step eta_g = 1."""

    correction_scale: float = Field(
        1.0, ge=0, description="[ours] multiplies c - c_i in the local step: 1 is the paper's correction, 0 trains "
                               "without it while the variates are still tracked")
    variates: Literal["option_ii", "start_gradient"] = Field(
        "option_ii", description="option_ii: the paper's c_i+ = c_i - c + (x - y_i) / (K_i eta_l), server-kept; "
                                 "[ours] start_gradient: c_i = full-data gradient at the round's start (option I "
                                 "without the round's delay), uploaded before training")
    local_lr: float = Field(
        LOCAL_LR, gt=0, description="eta_l of the plain SGD local steps (Algorithm 1); chosen on the embedded "
                                    "default's validation set (docs/methods.md)")
    weighting: Literal["uniform", "sample_mass"] = Field(
        "uniform", description="uniform: the paper's (1/|S|) sum Delta y_i; sample_mass: the study's n_i / n "
                               "(a departure from the paper, marked in the report)")


def _zeros_like(state: State) -> State:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def client_variate(c_i: State, c: State, start: State, trained: State, steps: int, lr: float) -> State:
    """Option II: c_i+ = c_i - c + (x - y_i) / (K_i eta_l), in float64, stored in ``c_i``'s dtype."""
    return {k: (c_i[k].double() - c[k].double() + (start[k].double() - trained[k].double()) / (steps * lr))
            .to(c_i[k].dtype) for k in c_i}


def server_variate(c: State, old: dict[str, State], new: dict[str, State], n_participants: int) -> State:
    """c+ = c + (1 / N) sum_i (c_i+ - c_i) over the returned participants."""
    out = {}
    for k in c:
        moved = sum((new[n][k].double() - old[n][k].double() for n in sorted(new)), torch.zeros_like(c[k].double()))
        out[k] = (c[k].double() + moved / n_participants).to(c[k].dtype)
    return out


def mean_state(states: list[State], weights: list[float]) -> State:
    """Algorithm 1's model step with eta_g = 1: sum_i a_i y_i, in float64, stored in the states' dtype."""
    return {k: sum((w * st[k].double() for st, w in zip(states, weights, strict=True)),
                   torch.zeros_like(states[0][k].double())).to(states[0][k].dtype) for k in states[0]}


def rebalance(a: torch.Tensor, b: torch.Tensor, scaling: float, rtol: float = 1e-10
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The balanced split of s B A (delta-SVD's: B'^T B' = A' A'^T = S / s) as an exact change of basis:
    (A', B', M, M^-1) in float64 with B' = B M, A' = M^-1 A. None when B or A is rank-deficient (no
    invertible M exists; the pair stays as it is)."""
    a, b = a.double(), b.double()
    q_b, r_b = torch.linalg.qr(b)            # out x r, r x r
    q_a, r_a = torch.linalg.qr(a.T)          # in x r, r x r
    u, sv, vh = torch.linalg.svd(scaling * (r_b @ r_a.T))
    if sv.numel() < a.shape[0] or float(sv[-1]) <= rtol * max(float(sv[0]), 1e-300):
        return None
    root = torch.sqrt(sv / scaling)
    m = torch.linalg.solve_triangular(r_b, u, upper=True) * root[None, :]   # R_B^-1 U sqrt(S / s)
    m_inv = (u.T @ r_b) / root[:, None]                                      # sqrt(s / S) U^T R_B
    return root[:, None] * (vh @ q_a.T), (q_b @ u) * root[None, :], m, m_inv


def transport(variate: State, a_key: str, b_key: str, m: torch.Tensor, m_inv: torch.Tensor) -> None:
    """A pair's variates into the new basis, in place, as gradients move: c_B' = c_B M^-T, c_A' = M^T c_A."""
    dtype = variate[a_key].dtype
    variate[a_key] = (m.T.to(variate[a_key].device) @ variate[a_key].double()).to(dtype)
    variate[b_key] = (variate[b_key].double() @ m_inv.T.to(variate[b_key].device)).to(dtype)


def start_gradient(model: FedHistoModel, data: Split, cfg, device: torch.device) -> State:
    """g_i(x): the gradient of the class-balanced CE over all of ``data`` (evaluation views, no
    dropout) at the model's loaded state, per trainable tensor, on the host."""
    t = cfg.train
    weights = class_balanced_weights(data.class_counts(), t.cb_beta, t.cb_cap, t.readings.ce_weight_normalisation).to(device)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    model.eval()
    autocast = training_autocast(device, t.precision)
    for x, y in eval_batches(data, cfg.views, cfg.evaluate.eval_batch):
        with autocast:
            logits, _ = model(x.to(device), None)
        balanced_cross_entropy(logits.float(), y.to(device), weights, nominal_batch=len(data)).backward()
    out = {n: (p.grad.detach().cpu().clone() if p.grad is not None else torch.zeros_like(p, device="cpu"))
           for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return out


class ScaffoldObjective(Objective):
    """fedavg_peft's objective plus the correction c - c_i in every local step, under the method's own local
    schedule (plain SGD at ``local_lr``; ``scaffold_adamw``: the study's AdamW)."""

    def __init__(self, name, cfg, config_key=None, *, local_optimizer: str = "sgd") -> None:
        super().__init__(name, cfg, config_key)
        if local_optimizer not in ("sgd", "adamw"):
            raise ValueError(f"method {name!r}: local_optimizer {local_optimizer!r} is sgd or adamw")
        self.local_optimizer = local_optimizer

    def local_schedule(self, round_idx: int) -> LocalSchedule:
        """Plain SGD with ``local_lr``, no clipping, no weight decay (Algorithm 1), in the study's single-view
        batches and epochs; ``scaffold_adamw``: the study's AdamW schedule."""
        if self.local_optimizer == "adamw":
            return super().local_schedule(round_idx)
        t = self.cfg.train
        return LocalSchedule("sgd", self.settings.local_lr, 0.0, t.local_epochs, t.single_view_batch, 1, None)

    @property
    def pre_uploads(self) -> bool:  # start_gradient: every participant uploads g_i(x) before training
        return self.settings.variates == "start_gradient"

    def upload_before_training(self, model: FedHistoModel, start_state: State, data: Split,
                               rng: np.random.Generator, device: torch.device) -> State | None:
        if not self.pre_uploads:
            return None
        model.load_trainable_state(start_state)
        return start_gradient(model, data, self.cfg, device)

    @contextmanager
    def local_session(self, run: LocalRun) -> Iterator[None]:
        c, c_i = run.payload.get("control"), run.payload.get("client_control")
        # in the dtype of the state the client trains (the engines' float32; float64 in a toy)
        if c is not None:
            run.scratch["correction"] = {k: (c[k] - c_i[k]).to(run.device, run.start_state[k].dtype) for k in c}
        elif run.payload.get("correction") is not None:
            run.scratch["correction"] = {k: v.to(run.device, run.start_state[k].dtype)
                                         for k, v in run.payload["correction"].items()}
        yield

    def _group_scale(self, run: LocalRun, batch: Batch) -> float:
        """accumulation / micro-batches in this batch's optimiser step: c - c_i once per step."""
        accum = self.local_schedule(run.round_idx).accumulation
        n_batches = math.ceil(len(run.data) / run.nominal_batch)
        group_start = batch.number - batch.number % accum
        return accum / min(accum, n_batches - group_start)

    def _drift(self, run: LocalRun) -> torch.Tensor | None:
        """<c - c_i, theta - theta_start>: its gradient is the correction (None before any variate)."""
        correction = run.scratch.get("correction")
        if correction is None:
            return None
        return sum((correction[k] * (run.params[k] - run.start_state[k])).sum() for k in correction)

    def extra_terms(self, run, batch, logits, zs):
        drift = self._drift(run)
        if drift is None:
            return {"scaffold": torch.zeros((), device=run.device)}
        return {"scaffold": self.settings.correction_scale * self._group_scale(run, batch) * drift}

    # Under DP-SGD the correction term has no data: its gradient joins every step's noisy gradient
    # after the noise, once per optimiser step, whatever the local optimiser; the variates are computed
    # from the returned (noised) states and the public step count, post-processing.
    def dp_refusal(self) -> str | None:
        if self.pre_uploads:
            return ("train.scaffold.variates: start_gradient uploads each site's full-data gradient before training, "
                    "un-noised; use option_ii under DP")
        return super().dp_refusal()

    def private_objective(self, run: LocalRun) -> PrivateObjective:
        def correction_term() -> torch.Tensor | None:
            drift = self._drift(run)
            return None if drift is None else self.settings.correction_scale * drift

        return PrivateObjective(image_ce(run), correction_term)


class Scaffold(Strategy):
    """fedavg_peft's model plus SCAFFOLD's control variates, kept and updated by the server (see the module
    docstring); its clients are ``ScaffoldObjective``."""

    objective_class = ScaffoldObjective

    assumptions = PaperAssumptions("Karimireddy et al. 2020 (SCAFFOLD, Algorithm 1)", local_optimizer="sgd",
                                   weighting="uniform", participation="any", clipping=False)

    def weighting(self) -> str:
        return self.settings.weighting

    def client_weights(self, counts, updates) -> list[float]:
        if self.settings.weighting == "uniform":
            return [1.0 / len(counts)] * len(counts)
        return super().client_weights(counts, updates)

    def configure_train(self, round_idx, server_state, uploads):
        self._participants = sorted(uploads)  # N of the server update: everyone asked this round
        if self.pre_uploads:  # c = (1/N) sum g_i(x) over this round's uploads; each gets c - c_i
            names = sorted(uploads)
            c = {k: sum((uploads[n][k].double() for n in names), torch.zeros_like(uploads[names[0]][k].double()))
                 / len(names) for k in uploads[names[0]]}
            return {n: {"correction": {k: (c[k] - uploads[n][k].double()).to(uploads[n][k].dtype) for k in c}}
                    for n in names}
        if not server_state:
            return {n: {} for n in uploads}  # round 1: c = c_i = 0, no correction to send
        c, clients = server_state["c"], server_state["clients"]
        return {n: {"control": c, "client_control": clients.get(n, _zeros_like(c))} for n in uploads}

    def aggregate_train(self, update: RoundUpdate, model: FedHistoModel):
        returned = sorted(update.states)
        start = update.starts[returned[0]]
        for n in returned:  # SGD without clipping diverges at too large an eta_l: say so, not an SVD error
            bad = sorted(k for k, v in update.states[n].items() if not bool(torch.isfinite(v).all()))
            if bad:
                raise ValueError(f"scaffold: participant {n}'s state after round {update.round_idx + 1} is not finite "
                                 f"({bad[0]}, {len(bad)} tensor(s)): its SGD local steps diverged; lower "
                                 f"train.scaffold.local_lr ({self.objective.local_schedule(update.round_idx).lr:g})")
        weights = [update.weights[n] for n in returned]
        if abs(sum(weights) - 1.0) > 1e-6:
            raise ValueError(f"scaffold: aggregation weights must sum to 1, got {sum(weights)}")
        merged = mean_state([update.states[n] for n in returned], weights)
        if self.pre_uploads:  # start_gradient: variates are recomputed every round, nothing to keep
            return {GLOBAL: self._rebalanced(merged, [], model.lora_scaling)}, None
        state = update.server_state or {}
        device = next(iter(start.values())).device  # a resumed checkpoint holds the variates on the host
        c = {k: v.to(device) for k, v in state["c"].items()} if state.get("c") else _zeros_like(start)
        clients = {n: {k: v.to(device) for k, v in ci.items()} for n, ci in state.get("clients", {}).items()}
        lr = self.objective.local_schedule(update.round_idx).lr
        old, new = {}, {}
        for n in returned:
            if update.steps[n] < 1:
                raise ValueError(f"scaffold: participant {n} took {update.steps[n]} optimiser steps in round "
                                 f"{update.round_idx + 1}; option II divides by K_i")
            old[n] = clients.get(n, _zeros_like(start))
            new[n] = client_variate(old[n], c, update.starts[n], update.states[n], update.steps[n], lr)
        n_participants = len(set(getattr(self, "_participants", [])) | set(returned))
        clients.update(new)
        c = server_variate(c, old, new, n_participants)
        merged = self._rebalanced(merged, [c, *clients.values()], model.lora_scaling)
        return {GLOBAL: merged}, {"c": c, "clients": clients}

    @staticmethod
    def _rebalanced(state: State, variates: list[State], scaling: float) -> State:
        """Each LoRA pair of ``state`` in delta-SVD's balanced split (an exact change of basis) with every
        variate transported into it (``rebalance``, ``transport``)."""
        out = dict(state)
        for a_key, b_key in lora_pairs(list(state)):
            found = rebalance(state[a_key], state[b_key], scaling)
            if found is None:
                continue
            a, b, m, m_inv = found
            out[a_key], out[b_key] = a.to(state[a_key].dtype), b.to(state[b_key].dtype)
            for v in variates:
                transport(v, a_key, b_key, m, m_inv)
        return out

    def secure_aggregation(self) -> SecureAggregation:
        """The model step and c+ are sums, but the variates of each site are kept per site by the server."""
        if self.pre_uploads:
            return SecureAggregation.refused(
                "train.scaffold.variates: start_gradient: each site uploads its full-data gradient g_i before "
                "training and the server sends it back c - g_i, so every g_i is seen in the clear")
        return SecureAggregation.refused(
            "the server keeps each site's control variate c_i (these sites keep no state between rounds) and "
            "updates it from that site's returned state, c_i+ - c_i = (x - y_i) / (K_i eta_l) - c: the site's "
            "update in the clear; keeping c_i at the site would leave only sums (not implemented)")

    def extra_traffic_bytes(self, dim, availability, optimisation_sizes, payload_bytes):
        return {"control_variates": 2 * len(availability) * payload_bytes}
