"""One participant's local epochs in a round: the engine half that every method shares.

The engine owns the optimiser, the micro-batch order, gradient accumulation and clipping; the
method supplies the loss terms of each micro-batch (``Method.batch_terms``). Every random draw
derives from (seed, round, participant), so a round replays exactly on resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedhisto.config import Config
from fedhisto.fedmath.losses import class_balanced_weights
from fedhisto.methods.base import Batch, LocalRun, Method, named_rng
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.data import Split


@dataclass
class LocalResult:
    state: dict[str, torch.Tensor]
    n_samples: int
    losses: dict[str, float]
    steps: int = 0          # optimiser steps taken (SCAFFOLD's K)


def local_train(method: Method, model: FedHistoModel, start_state: dict[str, torch.Tensor], data: Split,
                descriptor: torch.Tensor | None, payload: dict[str, Any], cfg: Config, seed: int, round_idx: int,
                client_idx: int, device: torch.device) -> LocalResult:
    """The method's local schedule (the study's: ``local_epochs`` epochs of AdamW) from ``start_state``,
    with gradient accumulation and clipping."""
    t = cfg.train
    plan = method.local_schedule(round_idx)
    torch.manual_seed(int(named_rng("torch", seed, round_idx, client_idx).integers(2**62)))
    model.load_trainable_state(start_state)
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimiser = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[plan.optimizer]
    opt = optimiser(params.values(), lr=plan.lr, weight_decay=plan.weight_decay)
    micro, accum = plan.micro_batch, plan.accumulation
    run = LocalRun(model=model, data=data, descriptor=descriptor.to(device)[None] if descriptor is not None else None,
                   payload=payload, start_state={k: v.to(device) for k, v in start_state.items()}, params=params,
                   ce_weights=class_balanced_weights(data.class_counts(), t.cb_beta, t.cb_cap).to(device),
                   nominal_batch=micro,
                   cfg=cfg, seed=seed, round_idx=round_idx, client_idx=client_idx, device=device)
    sums: dict[str, float] = {}
    steps = updates = 0
    with method.local_session(run):
        for epoch in range(plan.epochs):
            order = named_rng("order", seed, round_idx, client_idx, epoch).permutation(len(data))
            opt.zero_grad(set_to_none=True)
            batches = [order[i:i + micro] for i in range(0, len(order), micro)]
            for b, idx in enumerate(batches):
                y = torch.tensor([data.labels[i] for i in idx], device=device)
                terms = method.batch_terms(run, Batch(idx, y, epoch, round_idx * plan.epochs + epoch, b))
                (sum(terms.values()) / accum).backward()
                if (b + 1) % accum == 0 or b + 1 == len(batches):
                    torch.nn.utils.clip_grad_norm_(params.values(), t.grad_clip)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    updates += 1
                for k, v in terms.items():
                    sums[k] = sums.get(k, 0.0) + float(v.detach())
                steps += 1
    return LocalResult(model.trainable_state(), len(data), {k: v / max(steps, 1) for k, v in sums.items()}, updates)
