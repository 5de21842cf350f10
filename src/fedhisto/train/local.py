"""One participant's local epochs in a round, one after the other: the sequential engine.

The engine owns the optimiser, gradient accumulation and clipping; the method's client objective
(``methods.objective.Objective``) supplies the tensors it trains and the loss terms of each
micro-batch (``Objective.batch_terms``). The plan (seeding, batch order, accumulation
boundaries, loss means) is ``train.plan``'s, shared with the batched engine; every random draw
derives from (seed, round, participant), so a round replays exactly on resume. The optimiser is
built afresh each round, and under ``train.readings.optimizer_state: kept`` it is given the client's
state from its previous local training and hands its own back (``train.optimizer_state``).
"""

from __future__ import annotations

from typing import Any

import torch

from fedhisto.config.study import Config
from fedhisto.data.splits import Split
from fedhisto.methods.base import LocalSchedule
from fedhisto.methods.objective import Objective
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.optimizer_state import OptimizerState, keeps_state, load_into, read_from
from fedhisto.train.plan import (
    LocalResult,
    LossMeans,
    MemberJob,
    batch_of,
    check_optimizer,
    declared_trained,
    epoch_batches,
    local_run,
    seed_round,
    steps_now,
    train_only,
)

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}  # sgd: no momentum


def local_train(objective: Objective, model: FedHistoModel, start_state: dict[str, torch.Tensor], data: Split,
                descriptor: torch.Tensor | None, payload: dict[str, Any], cfg: Config, seed: int, round_idx: int,
                client_idx: int, device: torch.device, optimizer_state: OptimizerState | None = None) -> LocalResult:
    """The objective's local schedule (the study's: ``local_epochs`` epochs of AdamW) from ``start_state``,
    with gradient accumulation and clipping. ``optimizer_state``: the client's kept AdamW state (only
    under ``train.readings.optimizer_state: kept``; None: a fresh optimiser); the result then carries
    the state the optimiser ends in."""
    job = MemberJob(start_state, data, descriptor, payload, seed, round_idx, client_idx, optimizer_state)
    plan = objective.local_schedule(round_idx)
    check_optimizer(objective, plan, tuple(OPTIMIZERS), "sequential")
    seed_round(job)
    model.load_trainable_state(start_state)
    model.train()
    # exactly what the objective declares it trains: a tensor it does not (a frozen LoRA factor) gets no gradient,
    # stays out of the optimiser and the clipping norm; a masked block's gradient is projected to 0
    params, trained = declared_trained(objective, model, job)
    masks = {n: m.to(device) for n, m in trained.items() if m is not None}
    opt = make_optimizer(plan, params, job, cfg)
    run = local_run(model, job, cfg, plan, device, params)
    losses, updates = LossMeans(), 0
    with train_only(model, params), objective.local_session(run):
        for epoch in range(plan.epochs):
            opt.zero_grad(set_to_none=True)
            batches = epoch_batches(job, epoch, plan.micro_batch)
            for b, idx in enumerate(batches):
                terms = objective.batch_terms(run, batch_of(job, plan, epoch, b, idx, device))
                (sum(terms.values()) / plan.accumulation).backward()
                if steps_now(b, len(batches), plan.accumulation):
                    for n, m in masks.items():
                        if params[n].grad is not None:
                            params[n].grad.mul_(m)
                    if plan.grad_clip is not None:  # the method's schedule says (a paper's unclipped SGD: none)
                        torch.nn.utils.clip_grad_norm_(params.values(), plan.grad_clip)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    updates += 1
                losses.add(terms)
    return LocalResult(model.trainable_state(), len(data), losses.means(), updates, kept_state(opt, params, cfg))


def make_optimizer(plan: LocalSchedule, params: dict[str, torch.Tensor], job: MemberJob, cfg: Config) -> torch.optim.Optimizer:
    """The round's optimiser over ``params``: fresh, or (kept) continuing from the job's kept state."""
    opt = OPTIMIZERS[plan.optimizer](params.values(), lr=plan.lr, weight_decay=plan.weight_decay)
    if job.optimizer_state is not None:
        if not keeps_state(cfg):  # never silently dropped
            raise ValueError(f"client {job.client_idx}, round {job.round_idx + 1}: a kept optimiser state was "
                             "passed but train.readings.optimizer_state is per_round")
        load_into(opt, params, job.optimizer_state, f"client {job.client_idx}, round {job.round_idx + 1}")
    return opt


def kept_state(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], cfg: Config) -> OptimizerState | None:
    """What the client keeps for its next round (kept reading), else None."""
    return read_from(opt, params) if keeps_state(cfg) else None


__all__ = ["LocalResult", "kept_state", "local_train", "make_optimizer"]
