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
    return ServerPrototypes(centroids, _reliability(raw, mask), mask, counts)


def _reliability(raw: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Times the mask, normalised to mean 1 over valid classes, clipped to [0, 3]."""
    if not mask.any():
        return torch.zeros(mask.numel())
    raw = raw * mask
    raw = raw / raw[mask].mean()
    return raw.clamp(0.0, 3.0).float()


# Under secure aggregation the server sees only sums over the sites. Every quantity above is one:
# with w_k = sqrt(n_kc), p_c = normalize(sum_k w_k u_kc), n_c = sum_k n_kc, the contributor count is a sum
# of ones, and the weighted variance expands into sums,
#     var_c = (sum_k w_k ||u_kc||^2 - 2 p_c . sum_k w_k u_kc + ||p_c||^2 sum_k w_k) / (D sum_k w_k).
# Each site masks five terms per class (zeros for an absent class, so every site's vector has one
# layout), scaled by the public cap on images per class so that every value stays within [-1, 1].
PROTO_TERMS = ("wu", "w", "wuu", "n", "sites")


def prototype_terms(upload: ClientPrototypes, n_classes: int, dim: int, cap: int) -> dict[str, torch.Tensor]:
    """A site's masked terms for ``aggregate_prototypes_from_sums`` (``cap``: images per class at most)."""
    out = {}
    for c in range(n_classes):
        u = upload.centroids.get(c)
        n = upload.counts.get(c, 0)
        w = (n ** 0.5) / cap ** 0.5 if u is not None else 0.0
        u = u.double() if u is not None else torch.zeros(dim, dtype=torch.float64)
        values = {"wu": w * u, "w": torch.tensor(w, dtype=torch.float64), "wuu": torch.tensor(w * float(u @ u)),
                  "n": torch.tensor(n / cap, dtype=torch.float64), "sites": torch.tensor(float(n > 0))}
        out.update({f"proto:{c}:{k}": values[k].double() for k in PROTO_TERMS})
    return out


def aggregate_prototypes_from_sums(sums: dict[str, torch.Tensor], n_classes: int, dim: int, cap: int,
                                   variant: Literal["study", "bounded"] = "study") -> ServerPrototypes:
    """``aggregate_prototypes`` from the sites' summed ``prototype_terms`` (counts and contributor numbers
    are integers: rounded)."""
    centroids = torch.zeros(n_classes, dim)
    mask = torch.zeros(n_classes, dtype=torch.bool)
    counts = torch.zeros(n_classes)
    raw = torch.zeros(n_classes, dtype=torch.float64)
    for c in range(n_classes):
        get = {k: sums[f"proto:{c}:{k}"].double() for k in PROTO_TERMS}
        contributors = round(float(get["sites"]))
        if contributors < 1:
            continue
        p = F.normalize(get["wu"], dim=0)
        centroids[c] = p.float()
        mask[c] = True
        n_c = round(float(get["n"]) * cap)
        counts[c] = n_c
        if contributors >= 2:
            w = get["w"]
            var = (get["wuu"] - 2 * (p @ get["wu"]) + (p @ p) * w) / (dim * w)
            raw[c] = 1.0 / var.clamp_min(1e-4) if variant == "study" else 1.0 / (1.0 + var * dim)
        else:
            raw[c] = n_c ** 0.5 / (n_c ** 0.5 + 5.0)
    return ServerPrototypes(centroids, _reliability(raw, mask), mask, counts)


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
