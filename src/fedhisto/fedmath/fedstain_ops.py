"""FedStain comparator math (its paper's section III), pure and transport-free.

Clients upload per-channel style statistics of a fraction r of their samples; the server pools
them and hands each client the pool without its own entries. Locally, RandStain (eq. 1) restyles
pixels with pooled channel means and deviations, MixStyle with higher-order statistics
(eq. 2, Algorithm 1) restyles intermediate features with pooled skewness and kurtosis, and the
loss is CE + alpha * L_RA (SupCon, eq. 3-4) + beta * L_JS (eq. 5-6). Aggregation is FedAvg.

[ours, where the paper is terse] noted at each function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def channel_moments(x: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """Per sample and channel over the remaining axes: mean, std, skewness, kurtosis (eq. 2).

    x: (B, C, ...). S_c = E[(x_c - mu_c)^3] / (sigma_c^2)^{3/2}, K_c = E[(x_c - mu_c)^4] / (sigma_c^2)^2,
    population moments (ddof 0, as scipy.stats.skew / kurtosis(fisher=False)); each output (B, C).
    """
    flat = x.float().flatten(2)
    mu = flat.mean(2)
    centred = flat - mu[..., None]
    var = (centred**2).mean(2)
    skew = (centred**3).mean(2) / (var + eps) ** 1.5
    kurt = (centred**4).mean(2) / (var + eps) ** 2
    return mu, var.sqrt(), skew, kurt


def upload_count(n_samples: int, ratio: float) -> int:
    """ceil(r * n_i) samples, at least one for a client that has any (Algorithm 2, line 5)."""
    return 0 if n_samples == 0 else max(1, math.ceil(ratio * n_samples))


def style_traffic(dim: int, optimisation_sizes: dict[str, int], ratio: float, pixel_floats: int = 6,
                  feature_floats_per_channel: int = 2, count: Callable[[int, float], int] = upload_count) -> int:
    """Bytes of one round's statistics exchange (float32): every client's ``count(n_i, r)`` upload rows
    (ceil(r n_i) by default) plus each client's pool of the others' rows. A row holds ``pixel_floats``
    pixel statistics and ``feature_floats_per_channel`` x D feature statistics."""
    row = (pixel_floats + feature_floats_per_channel * dim) * 4
    rows = {client: count(n, ratio) for client, n in optimisation_sizes.items()}
    total = sum(rows.values())
    return total * row + sum(total - r for r in rows.values()) * row


@dataclass(frozen=True)
class StyleStats:
    """One client's upload: rows = sampled images, columns = channels."""

    pixel_mean: torch.Tensor   # (n, 3)  for RandStain
    pixel_std: torch.Tensor    # (n, 3)
    feat_skew: torch.Tensor    # (n, C)  for MixStyle
    feat_kurt: torch.Tensor    # (n, C)

    def n_values(self) -> int:
        return sum(t.numel() for t in (self.pixel_mean, self.pixel_std, self.feat_skew, self.feat_kurt))


def pool_excluding(uploads: dict[str, Any], client: str) -> Any:
    """S_pool^i = S_pool minus S_i (Algorithm 2, lines 8-9): every other client's rows, in client order.

    Uploads are row-wise dataclasses of tensors (``StyleStats``, or the code variant's ``PixelMoments``);
    the pool is one of the same type with every field's rows concatenated."""
    others = [uploads[c] for c in sorted(uploads) if c != client and uploads[c] is not None]
    if not others:
        raise ValueError(f"no other client uploaded style statistics for {client!r}")
    return type(others[0])(*(torch.cat([getattr(o, f.name) for o in others]) for f in fields(others[0])))


def randstain(x: torch.Tensor, pool: StyleStats, rng: np.random.Generator, eps: float = 1e-6) -> torch.Tensor:
    """Eq. 1 per image and channel: x' = (x - mu) / sigma * sigma' + mu', then clipped to [0, 1].

    x: (B, 3, H, W) RGB in [0, 1]. (mu', sigma') is one pooled image's statistics drawn uniformly
    [ours: the paper samples "from the distribution of training statistics" without naming one;
    a drawn row keeps the three channels' statistics consistent]. Eq. 1 as printed omits the
    division by sigma; RandStainNA, which it cites, standardises first, as here.
    """
    mu, sigma, _, _ = channel_moments(x)
    rows = torch.from_numpy(rng.integers(len(pool.pixel_mean), size=x.shape[0]))
    new_mu, new_sigma = pool.pixel_mean[rows].to(x), pool.pixel_std[rows].to(x)
    out = (x - mu[..., None, None]) / (sigma[..., None, None] + eps) * new_sigma[..., None, None] + new_mu[..., None, None]
    return out.clamp(0.0, 1.0)


def mixstyle_higher_order(x: torch.Tensor, pool: StyleStats, rng: np.random.Generator, alpha: float = 0.1,
                          eps: float = 1e-6) -> torch.Tensor:
    """Algorithm 1: x_hat = gamma_mix * (x - mu) / sigma + beta_mix with
    beta_mix = lam S' + (1 - lam) S(x), gamma_mix = lam K' + (1 - lam) K(x), lam ~ Beta(alpha, alpha).

    x: (B, C, N) features (channels first, statistics over the last axis); (S', K') is one pooled
    row per sample. Implemented as printed: skewness takes the place of the mean and kurtosis the
    place of the deviation.
    """
    mu, sigma, skew, kurt = channel_moments(x, eps)
    rows = torch.from_numpy(rng.integers(len(pool.feat_skew), size=x.shape[0]))
    lam = torch.from_numpy(rng.beta(alpha, alpha, size=(x.shape[0], 1))).to(x)
    beta_mix = lam * pool.feat_skew[rows].to(x) + (1 - lam) * skew.to(x)
    gamma_mix = lam * pool.feat_kurt[rows].to(x) + (1 - lam) * kurt.to(x)
    standardised = (x - mu[..., None].to(x)) / (sigma[..., None].to(x) + eps)
    return gamma_mix[..., None] * standardised + beta_mix[..., None]


def supcon(z: torch.Tensor, labels: torch.Tensor, tau: float = 0.1, include_self: bool = False) -> torch.Tensor:
    """Eq. 3 with cosine similarity: for each anchor i, -1/|P(i)| sum_p log softmax_{a != i}(s(z_i, z_a) / tau)_p.

    Averaged over the anchors that have a positive [ours: the printed sum over I scales with the
    batch size; the mean keeps alpha comparable across batch sizes, as in the SupCon reference code].

    ``include_self``: the authors' code's form, where the anchor counts among its own positives:
    per anchor -(s_ii + sum_p s_ip) / (|P(i)| + 1) + log sum_{a != i} exp(s_ia), s = cosine / tau,
    averaged over every anchor.
    """
    z = F.normalize(z.float(), dim=1)
    sim = z @ z.T / tau
    n = len(z)
    self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
    if include_self:
        same = (labels[:, None] == labels[None, :]).float()
        positive = (sim * same).sum(1) / same.sum(1)
        return (sim.masked_fill(self_mask, float("-inf")).logsumexp(1) - positive).mean()
    log_prob = sim.masked_fill(self_mask, float("-inf")).log_softmax(dim=1)
    positives = (labels[:, None] == labels[None, :]) & ~self_mask
    counts = positives.sum(1)
    has = counts > 0
    if not has.any():
        return z.sum() * 0.0
    per_anchor = -(log_prob.masked_fill(~positives, 0.0).sum(1)[has]) / counts[has]
    return per_anchor.mean()


def representation_alignment(z: torch.Tensor, augmented: list[torch.Tensor], labels: torch.Tensor,
                             tau: float = 0.1, include_self: bool = False) -> torch.Tensor:
    """Eq. 4: L_RA = mean over augmented feature sets X of SupCon over {Z, X} (labels repeated)."""
    both = labels.repeat(2)
    return sum(supcon(torch.cat([z, x]), both, tau, include_self) for x in augmented) / len(augmented)


def js_multi(logits: list[torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    """Eq. 5: (1/M) sum_i KL(Y_i || mean_j Y_j) over the M prediction distributions, batch-averaged."""
    probs = [F.softmax(lg.float(), dim=1).clamp_min(eps) for lg in logits]
    mean = (sum(probs) / len(probs)).clamp_min(eps)
    return sum((p * (p.log() - mean.log())).sum(1) for p in probs).mean() / len(probs)


def _zoom(img: torch.Tensor, factor: float) -> torch.Tensor:
    """Centre crop by 1/factor, resized back (the 'scaling' operation)."""
    h, w = img.shape[-2:]
    ch, cw = max(1, round(h / factor)), max(1, round(w / factor))
    top, left = (h - ch) // 2, (w - cw) // 2
    crop = img[..., top:top + ch, left:left + cw]
    return F.interpolate(crop[None], size=(h, w), mode="bilinear", align_corners=False)[0]


def _morphology_op(img: torch.Tensor, op: int, rng: np.random.Generator) -> torch.Tensor:
    if op == 0:
        return img.flip(-1)
    if op == 1:
        return img.flip(-2)
    if op == 2:
        return torch.rot90(img, int(rng.integers(1, 4)), dims=(-2, -1))
    return _zoom(img, float(rng.uniform(1.0, 1.3)))


def augmix(img: torch.Tensor, rng: np.random.Generator, width: int = 3, max_depth: int = 3) -> torch.Tensor:
    """AugMix (Hendrycks et al.) with morphology operations only (section III-D1: flipping, rotation,
    scaling, composed in chains): x_aug = m x + (1 - m) sum_k w_k chain_k(x), w ~ Dir(1), m ~ Beta(1, 1).

    img: (3, H, W) in [0, 1]; each chain composes 1..max_depth operations drawn from flip left-right,
    flip up-down, rotation by a multiple of 90 degrees and a centre zoom of 1.0-1.3 [ours: the
    operation list and ranges; rotations by 90 degrees keep the square field of view whole].
    """
    weights = rng.dirichlet([1.0] * width)
    mixed = torch.zeros_like(img)
    for w in weights:
        chain = img
        for _ in range(int(rng.integers(1, max_depth + 1))):
            chain = _morphology_op(chain, int(rng.integers(0, 4)), rng)
        mixed = mixed + float(w) * chain
    m = float(rng.beta(1.0, 1.0))
    return m * img + (1 - m) * mixed
