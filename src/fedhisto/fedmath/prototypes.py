"""Class prototypes with availability masks and reliability (study section 3.7).

Client: L2-normalised centroid of the (normalised) embeddings of at most 256 optimisation
images per *locally present* class, with its count. An absent class sends nothing, never a
placeholder.

Server, per class c with at least one contribution (availability mask true):
    p_c = normalize(sum_k w_k u_kc) with w_k = n_kc^0.5,
    reliability: variance of the contributed centroids around p_c (weighted, mean over
    dimensions, floored at 1e-4, inverted) when two or more clients contribute, else the
    count fallback sqrt(n_c) / (sqrt(n_c) + 5); times the mask, normalised to mean 1 over
    valid classes, clipped to [0, 3].
The server keeps centroids, counts and masks apart from the model state.

What the study's formula does (``variant="study"``, the default): the inverse variance of
unit centroids in 768 dimensions is large (around 10^3 once two or more clients contribute a
class), while the one-contributor fallback lies below 1. After normalising to mean 1, a class
that only one client contributes (a class held by one site, or after a client failure) gets a
reliability of about 10^-3 and so drops out of the v2 attraction term. ``variant="bounded"``
[ours] puts both cases on one scale: r = 1 / (1 + var / var_ref) with var_ref the variance of
unit vectors spread uniformly on the sphere (1 / D per dimension), which lies in (0, 1] like the
count fallback, before the same normalisation and clipping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


@dataclass
class ClientPrototypes:
    """Upload: one centroid and count per locally present class."""

    centroids: dict[int, torch.Tensor]
    counts: dict[int, int]


@dataclass
class ServerPrototypes:
    """Download: global centroids (C x D; rows of invalid classes are zero and masked), reliability, mask."""

    centroids: torch.Tensor
    reliability: torch.Tensor
    mask: torch.Tensor
    counts: torch.Tensor

    def state(self) -> dict[str, torch.Tensor]:
        return {"centroids": self.centroids, "reliability": self.reliability, "mask": self.mask, "counts": self.counts}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> ServerPrototypes:
        return cls(state["centroids"], state["reliability"], state["mask"], state["counts"])


def client_prototypes(embeddings: torch.Tensor, labels: torch.Tensor, n_classes: int) -> ClientPrototypes:
    z = F.normalize(embeddings.double(), dim=1)
    cents, counts = {}, {}
    for c in range(n_classes):
        sel = labels == c
        if sel.any():
            cents[c] = F.normalize(z[sel].mean(0), dim=0).float()
            counts[c] = int(sel.sum())
    return ClientPrototypes(cents, counts)


def aggregate_prototypes(uploads: list[ClientPrototypes], n_classes: int, dim: int,
                         variant: Literal["study", "bounded"] = "study") -> ServerPrototypes:
    centroids = torch.zeros(n_classes, dim)
    reliability = torch.zeros(n_classes)
    mask = torch.zeros(n_classes, dtype=torch.bool)
    counts = torch.zeros(n_classes)
    raw = torch.zeros(n_classes, dtype=torch.float64)
    for c in range(n_classes):
        contrib = [(u.centroids[c].double(), u.counts[c]) for u in uploads if c in u.centroids]
        if not contrib:
            continue
        w = torch.tensor([n ** 0.5 for _, n in contrib], dtype=torch.float64)
        u = torch.stack([v for v, _ in contrib])
        p = F.normalize((w[:, None] * u).sum(0), dim=0)
        centroids[c] = p.float()
        mask[c] = True
        n_c = sum(n for _, n in contrib)
        counts[c] = n_c
        if len(contrib) >= 2:
            var = ((w / w.sum())[:, None] * (u - p) ** 2).sum(0).mean()
            raw[c] = 1.0 / var.clamp_min(1e-4) if variant == "study" else 1.0 / (1.0 + var * dim)
        else:
            raw[c] = n_c ** 0.5 / (n_c ** 0.5 + 5.0)
    if mask.any():
        raw = raw * mask
        raw = raw / raw[mask].mean()
        reliability = raw.clamp(0.0, 3.0).float()
    return ServerPrototypes(centroids, reliability, mask, counts)


FLOAT32 = 4
MASK_BYTE = 1


@dataclass(frozen=True)
class PrototypeTraffic:
    upload_bytes: int
    download_bytes: int
    study_bytes: int  # what the study's figure counts: centroids+counts up, centroids down

    @property
    def total_bytes(self) -> int:
        return self.upload_bytes + self.download_bytes


def prototype_traffic(dim: int, client_classes: dict[str, list[bool]]) -> PrototypeTraffic:
    """Bytes of one round's prototype messages for clients with the given class availability: up, one
    centroid (D floats) and its count per locally available class; down, the global centroids of valid
    classes, the per-class reliability (C floats) and availability mask (C bytes)."""
    n_classes = len(next(iter(client_classes.values())))
    valid = [any(avail[c] for avail in client_classes.values()) for c in range(n_classes)]
    up = sum(sum(avail) * (dim + 1) * FLOAT32 for avail in client_classes.values())
    down_centroids = len(client_classes) * sum(valid) * dim * FLOAT32
    down = down_centroids + len(client_classes) * n_classes * (FLOAT32 + MASK_BYTE)
    return PrototypeTraffic(up, down, up + down_centroids)
