"""Class probabilities of a model on a split, with the deterministic evaluation transform."""

from __future__ import annotations

import torch

from fedhisto.config.study import Config
from fedhisto.data.splits import Split, eval_batches
from fedhisto.model.peft_model import N_CLASSES, FedHistoModel


@torch.no_grad()
def predict(model: FedHistoModel, data: Split, descriptor: torch.Tensor | None, cfg: Config,
            device: torch.device) -> torch.Tensor:
    """Class probabilities (N x 3)."""
    model.eval()
    desc = descriptor.to(device)[None] if descriptor is not None else None
    probs = [torch.softmax(model(x.to(device), desc)[0].float(), dim=1).cpu()
             for x, _ in eval_batches(data, cfg.views, cfg.evaluate.eval_batch)]
    return torch.cat(probs) if probs else torch.zeros(0, N_CLASSES)
