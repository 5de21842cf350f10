"""What a method declares to train under DP-SGD (``privacy.enabled``, docs/privacy.md).

DP-SGD clips each privacy unit's gradient, so it needs the local objective as a sum of per-image
terms whose value depends on that image alone, given the round's public inputs (the start state,
the server's payload, the site's class-balanced weights, which the guarantee holds at their
published values: neighbouring datasets never have equal counts).
A method's client objective declares what that objective is (``Objective.private_objective``): the
loss of ONE image from its views' outputs, written so ``vmap`` can map it, and the gradient of any
term without data (it joins the noisy gradient after the noise, as post-processing); the default
objective's form is :func:`image_ce`. Whether it can (``Objective.dp_refusal``) follows from its
declarations, or from the reason its own file gives. The engine (``train.private``) and
``fedhisto.privacy`` only call these hooks; they name no method.

Under DP-SGD the division of the batch form by the micro-batch size becomes the division by the
expected logical batch size (``privacy.dpsgd``), so the per-image objective is the batch objective
on a batch of that one image with nominal batch size 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedhisto.fedmath.losses import pick
from fedhisto.privacy.per_sample import UnitLoss


@dataclass(frozen=True)
class PrivateObjective:
    """A method's objective under DP-SGD in one participant's round: the loss of one image, and the terms
    without data (a function of the trainable tensors and the round's public inputs alone; None: none
    this step). The latter is the same term the method adds to its batch loss, so the two paths agree."""

    unit_loss: UnitLoss
    data_free_loss: Callable[[], torch.Tensor | None] | None = None

    def data_free_gradient(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradient of the terms without data at ``params`` (autograd; empty when there are none)."""
        value = self.data_free_loss() if self.data_free_loss is not None else None
        if value is None or not value.requires_grad:
            return {}
        grads = torch.autograd.grad(value, list(params.values()), allow_unused=True)
        return {n: g.detach() for n, g in zip(params, grads, strict=True) if g is not None}


@dataclass(frozen=True)
class ImageCE:
    """Class-balanced CE of one image over its V views: w_y CE(l_v, y) averaged over the views, or summed
    (``train.readings.ce_views``): ``Objective.terms_from_outputs``'s CE on a batch of that image alone."""

    ce_weights: torch.Tensor                       # (C,) class-balanced weights of the site
    ce_views: str = "mean"

    def ce(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_view = F.cross_entropy(logits, y.reshape(1).expand(logits.shape[0]), reduction="none")
        weighted = per_view * pick(self.ce_weights.to(logits.dtype), y)
        return weighted.sum() if self.ce_views == "sum" else weighted.mean()

    def __call__(self, logits: torch.Tensor, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.ce(logits, y)


def image_ce(run: Any) -> ImageCE:
    """The default objective (``Objective.terms_from_outputs`` without extra terms) of one image of ``run``."""
    return ImageCE(run.ce_weights, run.cfg.train.readings.ce_views)


def objective_refusal(cfg: Any) -> str | None:
    """A reading of the class-balanced CE that has no per-image form (None: every reading in force has one)."""
    if cfg.train.readings.ce_reduction == "weighted_mean":
        return ("train.readings.ce_reduction: weighted_mean divides each image's CE by the batch's summed class "
                "weights, so one image changes every other image's term and per-unit clipping bounds nothing; "
                "use nominal_batch under DP")
    return None
