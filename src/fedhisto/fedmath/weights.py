"""Client aggregation weights: the one hook each strategy overrides.

``SampleMass`` (FedAvg-PEFT, FedProx-PEFT, FiLM-Zero): a_k = n_k / sum_j n_j.

``Adaptive`` (FedHisto-PAST v1 and v2, study equation 4)::

    a~_k = n_k^0.5 * exp(-(1 - cos(D_k, mean_{j != k} D_j))) * exp(-0.5 |ln(||D_k|| / median_j ||D_j||)|)
    a_k  = Normalize(max(Normalize(a~_k), 0.03))

where D_k is client k's update (its returned trainable state minus the global state, flattened).
An empirical heuristic, not a trust score or a robustness guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ClientWeights:
    name = "base"

    def __call__(self, counts: Sequence[int], updates: Sequence[torch.Tensor]) -> list[float]:
        raise NotImplementedError


class SampleMass(ClientWeights):
    name = "sample_mass"

    def __call__(self, counts: Sequence[int], updates: Sequence[torch.Tensor]) -> list[float]:
        total = float(sum(counts))
        if total <= 0:
            raise ValueError("sample-mass weights need at least one sample")
        return [n / total for n in counts]


class Adaptive(ClientWeights):
    name = "adaptive"

    def __init__(self, floor: float = 0.03, exponent: float = 0.5) -> None:
        self.floor = floor
        self.exponent = exponent

    def __call__(self, counts: Sequence[int], updates: Sequence[torch.Tensor]) -> list[float]:
        k = len(counts)
        if k == 1:
            return [1.0]
        d = torch.stack([u.double().flatten() for u in updates])
        norms = d.norm(dim=1)
        median = norms.median() if k % 2 else norms.sort().values[k // 2 - 1:k // 2 + 1].mean()
        raw = []
        for i in range(k):
            others = torch.cat([d[:i], d[i + 1:]]).mean(0)
            cos = torch.nn.functional.cosine_similarity(d[i], others, dim=0, eps=1e-12)
            ratio = (norms[i] / median.clamp_min(1e-12)).clamp_min(1e-12)
            raw.append(counts[i] ** self.exponent * torch.exp(-(1 - cos)) * torch.exp(-0.5 * torch.log(ratio).abs()))
        w = torch.stack(raw)
        w = w / w.sum()
        w = torch.clamp(w, min=self.floor)
        return (w / w.sum()).tolist()

