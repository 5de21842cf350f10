"""Local objective terms (study equations 2 and 3)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def class_balanced_weights(counts: Sequence[int], beta: float = 0.999, cap: float = 4.0,
                           normalisation: str = "sample_mean") -> torch.Tensor:
    """Effective-number weights (Cui et al.): w_c = (1 - beta) / (1 - beta^n_c) for present classes.

    [ours, where the study is terse] "normalised over the client's available classes" is read as:
    the client's mean per-sample weight is 1 (sum_c n_c w_c / sum_c n_c = 1), so a rare class can
    exceed the majority's weight several-fold and the 4.0 cap can bind; with mean-over-classes
    normalisation three classes could never reach it. Absent classes get 0 (no oversampling).
    ``normalisation="class_mean"`` (``train.readings.ce_weight_normalisation``) is that other reading:
    the mean weight over the present classes is 1.
    """
    if normalisation not in ("sample_mean", "class_mean"):
        raise ValueError(f"class-balanced weight normalisation {normalisation!r}: sample_mean or class_mean")
    n = torch.tensor(list(counts), dtype=torch.float64)
    present = n > 0
    w = torch.zeros_like(n)
    w[present] = (1 - beta) / (1 - beta ** n[present])
    if present.any() and normalisation == "class_mean":
        w = w * present.sum() / w.sum()
    elif present.any():
        w = w * n.sum() / (w * n).sum()
    return w.clamp(max=cap).float()


def js_divergence(logits_a: torch.Tensor, logits_b: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Jensen-Shannon divergence between two views' class distributions; mixture in float32,
    probabilities bounded away from zero; symmetric, no teacher view."""
    p = F.softmax(logits_a.float(), dim=1).clamp_min(eps)
    q = F.softmax(logits_b.float(), dim=1).clamp_min(eps)
    m = (0.5 * (p + q)).clamp_min(eps)
    kl_pm = (p * (p.log() - m.log())).sum(1)
    kl_qm = (q * (q.log() - m.log())).sum(1)
    return (0.5 * (kl_pm + kl_qm)).mean()


def feature_consistency(z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
    """Mean cosine distance of the two L2-normalised adapted embeddings."""
    return (1 - F.cosine_similarity(F.normalize(z_a, dim=1), F.normalize(z_b, dim=1), dim=1)).mean()


def prototype_v2(z: torch.Tensor, y: torch.Tensor, centroids: torch.Tensor, mask: torch.Tensor,
                 reliability: torch.Tensor, margin: float = 0.20) -> torch.Tensor:
    """mean_i r(y_i)[1 - s(z_i, p_y)] + mean_i max(0, m + max_{c != y, c valid} s(z_i, p_c) - s(z_i, p_y)),
    over samples whose label has a valid global prototype (others are skipped)."""
    keep = mask[y]
    if not keep.any():
        return z.sum() * 0.0
    z, y = F.normalize(z[keep], dim=1), y[keep]
    sim = z @ F.normalize(centroids.to(z.dtype), dim=1).T           # N x C
    pos = sim.gather(1, y[:, None]).squeeze(1)
    attraction = (reliability.to(z.dtype)[y] * (1 - pos)).mean()
    neg = sim.masked_fill(~mask[None, :], float("-inf")).scatter(1, y[:, None], float("-inf"))
    hardest = neg.max(1).values
    has_neg = torch.isfinite(hardest)
    margin_term = torch.where(has_neg, F.relu(margin + hardest - pos), torch.zeros_like(pos)).mean()
    return attraction + margin_term


def prototype_v1(z: torch.Tensor, y: torch.Tensor, centroids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[ours] v1: availability-aware, unweighted cosine attraction to the class prototype, no margin."""
    keep = mask[y]
    if not keep.any():
        return z.sum() * 0.0
    z, y = F.normalize(z[keep], dim=1), y[keep]
    pos = (z * F.normalize(centroids.to(z.dtype), dim=1)[y]).sum(1)
    return (1 - pos).mean()


def proximal(params: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx: (mu / 2) ||theta - theta_global||^2 over the trainable tensors."""
    total = sum(((p - global_state[k].to(p.dtype)) ** 2).sum() for k, p in params.items())
    return 0.5 * mu * total


# Per-image forms (DP-SGD differentiates one image at a time under ``vmap``: no data-dependent Python
# branches, labels may be batched tensors). The batch forms above average over the images whose class
# has a prototype; per image, an image without one contributes 0.

def pick(table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``table[y]`` for a 0-d label that vmap may be batching (plain indexing would read it as a Python int)."""
    return table.index_select(0, y.reshape(1))[0]


def prototype_v2_image(z: torch.Tensor, y: torch.Tensor, centroids: torch.Tensor, mask: torch.Tensor,
                       reliability: torch.Tensor, margin: float) -> torch.Tensor:
    """``prototype_v2`` of the views of ONE image (z: (V, D), y: 0-d), 0 when its class has no prototype."""
    zn = F.normalize(z, dim=1)
    sim = zn @ F.normalize(centroids.to(z.dtype), dim=1).T                 # V x C
    idx = y.reshape(1, 1).expand(z.shape[0], 1)
    pos = sim.gather(1, idx).squeeze(1)
    attraction = pick(reliability.to(z.dtype), y) * (1 - pos)
    neg = sim.masked_fill(~mask[None, :], float("-inf")).scatter(1, idx, float("-inf"))
    hardest = neg.max(1).values
    margin_term = torch.where(torch.isfinite(hardest), F.relu(margin + hardest - pos), torch.zeros_like(pos))
    return torch.where(pick(mask, y), (attraction + margin_term).mean(), torch.zeros((), dtype=z.dtype, device=z.device))


def prototype_v1_image(z: torch.Tensor, y: torch.Tensor, centroids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``prototype_v1`` of the views of ONE image, 0 when its class has no prototype."""
    pos = (F.normalize(z, dim=1) * pick(F.normalize(centroids.to(z.dtype), dim=1), y)[None]).sum(1)
    return torch.where(pick(mask, y), (1 - pos).mean(), torch.zeros((), dtype=z.dtype, device=z.device))
