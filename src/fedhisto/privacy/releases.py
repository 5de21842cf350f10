"""A differentially private prototype upload (per-round class centroids, for a method that uploads them).

Non-private, a client uploads per present class c the normalised mean of its images' normalised
embeddings, u_c = normalize(sum_{i: y_i = c} z_i / ||z_i||), and the count n_c. Both are released
through one Gaussian mechanism here. Each privacy unit u contributes the vector

    v_u = [ sum_{i in u, y_i = c} z_i / ||z_i||  for every class c ;  #{i in u : y_i = c} for every c ],

clipped to L2 norm Delta = sqrt(2) (one image: a unit embedding and a count of 1, so exactly sqrt(2)
and never changed; a family of k images is scaled down to the same bound). The release is
``sum_u v_u + N(0, sigma^2 Delta^2 I)``; the centroid is the direction of the noisy sum (the count
does not change a direction) and the count the rounded noisy count, a class with a noisy count
below 1 is not uploaded. Add/remove of one unit moves the sum by at most Delta, so one upload is the
Gaussian mechanism with noise multiplier sigma (``privacy.prototype_noise_multiplier``, by default
DP-SGD's ``privacy.noise_multiplier``): ``Release(sigma, 1.0, 1, kind="prototypes")`` in the site's
ledger each round. Under DP every unit's images enter (the non-private cap of
``proto_max_images`` images per class picks images by id order, so adding one image can displace
another and double the sensitivity).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from fedhisto.fedmath.prototypes import ClientPrototypes
from fedhisto.privacy.accountant import Release

SENSITIVITY = math.sqrt(2.0)


def unit_contributions(embeddings: torch.Tensor, labels: torch.Tensor, unit_of: torch.Tensor, n_units: int,
                       n_classes: int) -> torch.Tensor:
    """v_u for every unit, (n_units, n_classes * (D + 1)), clipped to norm sqrt(2)."""
    z = F.normalize(embeddings.double(), dim=1)
    dim = z.shape[1]
    sums = torch.zeros(n_units, n_classes, dim, dtype=torch.float64)
    counts = torch.zeros(n_units, n_classes, dtype=torch.float64)
    flat = unit_of.long() * n_classes + labels.long()
    sums.view(-1, dim).index_add_(0, flat, z)
    counts.view(-1).index_add_(0, flat, torch.ones(len(flat), dtype=torch.float64))
    v = torch.cat([sums.reshape(n_units, -1), counts], dim=1)
    scale = (SENSITIVITY / v.norm(dim=1).clamp_min(1e-12)).clamp(max=1.0)
    return v * scale[:, None]


def noised_prototypes(embeddings: torch.Tensor, labels: torch.Tensor, unit_of: torch.Tensor, n_units: int,
                      n_classes: int, noise_multiplier: float, generator: torch.Generator) -> ClientPrototypes:
    """The prototype upload through the Gaussian mechanism (see the module docstring)."""
    if noise_multiplier <= 0:
        raise ValueError(f"noised prototypes need a noise multiplier > 0, got {noise_multiplier}")
    v = unit_contributions(embeddings, labels, unit_of, n_units, n_classes).sum(0)
    v = v + torch.randn(v.shape, generator=generator, dtype=torch.float64) * noise_multiplier * SENSITIVITY
    dim = embeddings.shape[1]
    sums, counts = v[: n_classes * dim].reshape(n_classes, dim), v[n_classes * dim:]
    cents, kept = {}, {}
    for c in range(n_classes):
        n = int(torch.round(counts[c]))
        if n >= 1:
            cents[c] = F.normalize(sums[c], dim=0).float()
            kept[c] = n
    return ClientPrototypes(cents, kept)


def prototype_release(noise_multiplier: float) -> Release:
    """The ledger entry of one noised prototype upload."""
    return Release(noise_multiplier, 1.0, 1, kind="prototypes")


def round_releases(noise_multiplier: float, sample_rate: float, local_epochs: int,
                   uploads_prototypes: bool, prototype_noise_multiplier: float | None = None) -> list[Release]:
    """What one site releases in one round under DP, for its ledger and ``accountant.check_plan``:
    ``local_epochs`` expected passes of round(1 / q) Poisson steps each at ``noise_multiplier``, and the
    noised prototype upload at ``prototype_noise_multiplier`` (None: the same) when the method makes one
    (``privacy.prototypes: noised``)."""
    steps = local_epochs * max(1, round(1 / sample_rate))  # dpsgd.steps_per_epoch
    out = [Release(noise_multiplier, sample_rate, steps)]
    if uploads_prototypes:
        out.append(prototype_release(prototype_sigma(noise_multiplier, prototype_noise_multiplier)))
    return out


def prototype_sigma(noise_multiplier: float, prototype_noise_multiplier: float | None) -> float:
    """The prototype release's noise multiplier: its own setting, or DP-SGD's when unset."""
    return noise_multiplier if prototype_noise_multiplier is None else prototype_noise_multiplier


def releases_of(privacy: Any, local_epochs: int, uploads_prototypes: bool) -> list[Release]:
    """``round_releases`` of a ``privacy:`` block (``config_privacy.PrivacyConfig`` or anything with its fields)."""
    return round_releases(privacy.noise_multiplier, privacy.sample_rate, local_epochs, uploads_prototypes,
                          getattr(privacy, "prototype_noise_multiplier", None))
