"""One participant's local plan, written once for both engines.

The sequential engine (``train.local``) walks one participant's plan; the batched engine
(``train.batched``) walks every member's plan in lock step. What a plan fixes is the same for both:
the round's torch seed, the ``LocalRun`` the objective's batch hooks see, the micro-batch order of each
epoch (a named random stream of (seed, round, participant, epoch)), the accumulation boundary at
which the optimiser steps, and the per-micro-batch means of the loss terms that go into the history.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedhisto.config.study import Config
from fedhisto.data.splits import Split
from fedhisto.fedmath.losses import class_balanced_weights
from fedhisto.methods.base import Batch, LocalRun, LocalSchedule, named_rng
from fedhisto.methods.objective import Objective
from fedhisto.model.peft_model import FedHistoModel


@dataclass
class LocalResult:
    state: dict[str, torch.Tensor]
    n_samples: int
    losses: dict[str, float]
    steps: int = 0          # optimiser steps taken (K of a server update that divides by it)
    optimizer_state: dict | None = None  # train.readings.optimizer_state kept: the client's AdamW state after
    #                                      training (train.optimizer_state.OptimizerState); stays at the client


@dataclass
class MemberJob:
    """One participant's local training of one round."""

    start_state: dict[str, torch.Tensor]
    data: Split
    descriptor: torch.Tensor | None
    payload: dict[str, Any]
    seed: int
    round_idx: int
    client_idx: int
    optimizer_state: dict | None = None  # kept reading: the client's AdamW state from its previous training


def seed_round(job: MemberJob) -> None:
    """The global torch generator (dropout) of the job's round, from its named stream."""
    torch.manual_seed(int(named_rng("torch", job.seed, job.round_idx, job.client_idx).integers(2**62)))


def local_run(model: FedHistoModel, job: MemberJob, cfg: Config, plan: LocalSchedule, device: torch.device,
              params: dict[str, torch.Tensor]) -> LocalRun:
    """What the objective's batch hooks see of one participant's round."""
    t = cfg.train
    return LocalRun(model=model, data=job.data,
                    descriptor=job.descriptor.to(device)[None] if job.descriptor is not None else None,
                    payload=job.payload, start_state={k: v.to(device) for k, v in job.start_state.items()},
                    params=params, ce_weights=class_balanced_weights(job.data.class_counts(), t.cb_beta, t.cb_cap,
                                                                        t.readings.ce_weight_normalisation).to(device),
                    nominal_batch=plan.micro_batch, cfg=cfg, seed=job.seed, round_idx=job.round_idx,
                    client_idx=job.client_idx, device=device)


def declared_trained(objective: Objective, model: FedHistoModel, job: MemberJob
                     ) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.Tensor | None]]:
    """The job's declaration (``Objective.trained``) checked against the model: the declared parameters in
    the model's order, and the declaration in that order (name -> mask or None)."""
    decl = objective.trained(job.start_state, job.payload)
    own = {n: p for n, p in model.named_parameters() if p.requires_grad}
    unknown = sorted(set(decl) - set(own))
    if unknown:
        raise ValueError(f"{objective.name}: declares trained tensors that are not trainable tensors of the model: "
                         f"{unknown[:3]}")
    params = {n: p for n, p in own.items() if n in decl}
    return params, {n: decl[n] for n in params}


@contextmanager
def train_only(model: FedHistoModel, params: dict[str, torch.nn.Parameter]) -> Iterator[None]:
    """Within: the model's trainable tensors outside ``params`` take no gradient (FFA-LoRA's frozen A is
    never differentiated); restored after, so the trainable state keeps its names."""
    others = [p for n, p in model.named_parameters() if p.requires_grad and n not in params]
    for p in others:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in others:
            p.requires_grad_(True)


def epoch_batches(job: MemberJob, epoch: int, micro: int) -> list[np.ndarray]:
    """The micro-batches (indices into the job's data) of one epoch, in order."""
    order = named_rng("order", job.seed, job.round_idx, job.client_idx, epoch).permutation(len(job.data))
    return [order[i:i + micro] for i in range(0, len(order), micro)]


def batch_of(job: MemberJob, plan: LocalSchedule, epoch: int, number: int, idx: np.ndarray,
             device: torch.device) -> Batch:
    """Micro-batch ``number`` of ``epoch``: its indices, labels, and the view epoch that seeds its views."""
    y = torch.tensor([job.data.labels[i] for i in idx], device=device)
    return Batch(idx, y, epoch, view_epoch(job, plan, epoch), number)


def view_epoch(job: MemberJob, plan: LocalSchedule, epoch: int) -> int:
    """The epoch that seeds a batch's views: distinct for every local epoch of every round."""
    return job.round_idx * plan.epochs + epoch


def steps_now(number: int, n_batches: int, accumulation: int) -> bool:
    """Whether the optimiser steps after micro-batch ``number`` (accumulation boundary or epoch end)."""
    return (number + 1) % accumulation == 0 or number + 1 == n_batches


class LossMeans:
    """Sums of each loss term over micro-batches (float64, in order), and their means."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, terms: dict[str, torch.Tensor]) -> None:
        for k, v in terms.items():
            v = v.detach().to(torch.float64)
            self.sums[k] = v if k not in self.sums else self.sums[k] + v
        self.count += 1

    def means(self) -> dict[str, float]:
        return {k: float(v) / max(self.count, 1) for k, v in self.sums.items()}


def check_optimizer(objective: Objective, plan: LocalSchedule, supported: tuple[str, ...], engine: str) -> None:
    # Adam without weight decay is AdamW without weight decay: torch's two updates are the same formula
    if plan.optimizer == "adam" and plan.weight_decay == 0 and "adamw" in supported:
        return
    if plan.optimizer not in supported:
        raise NotImplementedError(f"{objective.name}: the {engine} engine implements {', '.join(supported)}, this "
                                  f"schedule asks for {plan.optimizer!r}")
