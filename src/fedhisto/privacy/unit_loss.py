"""The PAST family's local objective for ONE image, written so ``vmap`` can map it (no data-dependent
Python branches), for per-sample gradients (``per_sample.UnitLoss``).

For image i with label y and views v = 1..V (logits l_v, adapted embeddings z_v):

    l_i = (1/V) sum_v w_y CE(l_v, y)                                    class-balanced CE, per view
        + lambda_JS JS(p_1, p_2) + lambda_feat (1 - cos(z_1, z_2))      pair terms (paired views)
        + lambda_proto (1/V) sum_v L_proto(z_v, y; P, mask, r)           against the GLOBAL prototypes

It is the method's batch objective (``methods.past``, ``fedmath.losses``) evaluated on a batch of
that one image with nominal batch size 1: the batch losses are sums of these over the images divided
by the batch size, except the prototype terms, which the batch form averages over the images whose
class has a global prototype; per image, an image without one contributes 0. Under DP-SGD the
division is by the expected logical batch size instead (``dpsgd``). The global prototypes are
fixed during the round (server state), so the prototype terms couple nothing between images.

FedProx's proximal term (mu/2)||theta - theta_global||^2 involves no data: its gradient is added to
the noisy gradient outside clipping (post-processing), never into a unit's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedhisto.fedmath.losses import feature_consistency, js_divergence


def _pick(table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``table[y]`` for a 0-d label that vmap may be batching (plain indexing would read it as a Python int)."""
    return table.index_select(0, y.reshape(1))[0]


def _prototype_v2_one(z: torch.Tensor, y: torch.Tensor, centroids: torch.Tensor, mask: torch.Tensor,
                      reliability: torch.Tensor, margin: float) -> torch.Tensor:
    """``losses.prototype_v2`` of the views of one image (z: (V, D)), 0 when its class has no prototype."""
    zn = F.normalize(z, dim=1)
    sim = zn @ F.normalize(centroids.to(z.dtype), dim=1).T                 # V x C
    idx = y.reshape(1, 1).expand(z.shape[0], 1)
    pos = sim.gather(1, idx).squeeze(1)
    attraction = _pick(reliability.to(z.dtype), y) * (1 - pos)
    neg = sim.masked_fill(~mask[None, :], float("-inf")).scatter(1, idx, float("-inf"))
    hardest = neg.max(1).values
    margin_term = torch.where(torch.isfinite(hardest), F.relu(margin + hardest - pos), torch.zeros_like(pos))
    return torch.where(_pick(mask, y), (attraction + margin_term).mean(), torch.zeros((), dtype=z.dtype, device=z.device))


def _prototype_v1_one(z: torch.Tensor, y: torch.Tensor, centroids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    pos = (F.normalize(z, dim=1) * _pick(F.normalize(centroids.to(z.dtype), dim=1), y)[None]).sum(1)
    return torch.where(_pick(mask, y), (1 - pos).mean(), torch.zeros((), dtype=z.dtype, device=z.device))


@dataclass(frozen=True)
class PastUnitLoss:
    """The per-image objective of one PAST-family method in one round (a ``per_sample.UnitLoss``)."""

    ce_weights: torch.Tensor                       # (C,) class-balanced weights of the site
    weight_js: float = 0.0                         # 0 switches the term off
    weight_feat: float = 0.0
    weight_proto: float = 0.0
    prototypes: Literal["none", "v1", "v2"] = "none"
    centroids: torch.Tensor | None = None          # (C, D) global prototypes of the round
    mask: torch.Tensor | None = None               # (C,) bool: class has a valid prototype
    reliability: torch.Tensor | None = None        # (C,) v2's per-class reliability
    margin: float = 0.20

    def __call__(self, logits: torch.Tensor, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        views = logits.shape[0]
        ce = F.cross_entropy(logits, y.reshape(1).expand(views), reduction="none")
        loss = (ce * _pick(self.ce_weights.to(logits.dtype), y)).mean()
        if views >= 2 and self.weight_js:
            loss = loss + self.weight_js * js_divergence(logits[0:1], logits[1:2])
        if views >= 2 and self.weight_feat:
            loss = loss + self.weight_feat * feature_consistency(z[0:1], z[1:2])
        if self.prototypes != "none" and self.weight_proto and self.centroids is not None:
            if self.prototypes == "v2":
                proto = _prototype_v2_one(z, y, self.centroids, self.mask, self.reliability, self.margin)
            else:
                proto = _prototype_v1_one(z, y, self.centroids, self.mask)
            loss = loss + self.weight_proto * proto
        return loss


def past_unit_loss(method, payload: dict, ce_weights: torch.Tensor, device: torch.device | str = "cpu") -> PastUnitLoss:
    """The per-image objective of a ``methods.past.PastFamily`` method for one round's payload
    (``configure_train``'s, with the round's global prototypes when the method uses them)."""
    s = method.settings
    protos = payload.get("prototypes")
    use_protos = method.prototypes != "none" and protos is not None and bool(protos.mask.any())
    return PastUnitLoss(
        ce_weights=ce_weights.to(device),
        weight_js=s.weight_js if (method.paired_views and method.js) else 0.0,
        weight_feat=s.weight_feat if (method.paired_views and method.feat) else 0.0,
        weight_proto=s.weight_proto if use_protos else 0.0,
        prototypes=method.prototypes if use_protos else "none",
        centroids=protos.centroids.to(device) if use_protos else None,
        mask=protos.mask.to(device) if use_protos else None,
        reliability=protos.reliability.to(device) if use_protos else None,
        margin=s.proto_margin)
