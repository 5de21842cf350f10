"""Client aggregation weights: the one hook each strategy overrides.

``SampleMass`` (FedAvg-PEFT, FedProx-PEFT, FiLM-Zero): a_k = n_k / sum_j n_j.

``Adaptive`` (FedHisto-PAST v1 and v2, study equation 4)::

    a~_k = n_k^0.5 * exp(-(1 - cos(D_k, mean_{j != k} D_j))) * exp(-0.5 |ln(||D_k|| / median_j ||D_j||)|)
    a_k  = Normalize(max(Normalize(a~_k), 0.03))

where D_k is client k's update (its returned trainable state minus the global state, flattened).
An empirical heuristic, not a trust score or a robustness guarantee.

The study leaves open what D_k holds for a LoRA pair. By default it is the raw factor deltas
(A_k - A, B_k - B), which depend on how delta-SVD split the last global product into factors;
``induced_update`` is the other reading (``train.readings.adaptive_on: delta_w``): the induced
weight change s (B_k A_k - B A), invariant to that split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedhisto.fedmath.aggregate import lora_pairs


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
        return self.normalised(raw)

    def normalised(self, raw: list[torch.Tensor]) -> list[float]:
        w = torch.stack(raw)
        w = w / w.sum()
        w = torch.clamp(w, min=self.floor)
        return (w / w.sum()).tolist()

    def from_statistics(self, counts: Sequence[int], squared_norms: Sequence[float], dots: Sequence[float],
                        sum_squared_norm: float, summed: int) -> list[float]:
        """The same weights from what secure aggregation leaves the server: a masked sum S of ``summed``
        sites' updates (||S||^2 = ``sum_squared_norm``) and, per weighted site, ||D_k||^2 and D_k . S.
        The mean of the others' updates is (S - D_k) / (summed - 1), so

            cos_k = (D_k . S - ||D_k||^2) / (||D_k|| ||S - D_k||),  ||S - D_k||^2 = ||S||^2 - 2 D_k . S + ||D_k||^2

        equal to ``__call__``'s when S sums exactly the weighted sites (``summed == len(counts)``)."""
        k = len(counts)
        if k == 1:
            return [1.0]
        if summed < 2:
            raise ValueError(f"adaptive weights need the sum of at least two sites' updates (got {summed})")
        sq = torch.tensor(squared_norms, dtype=torch.float64)
        dot = torch.tensor(dots, dtype=torch.float64)
        norms = sq.clamp_min(0).sqrt()
        median = norms.median() if k % 2 else norms.sort().values[k // 2 - 1:k // 2 + 1].mean()
        m = summed - 1   # the mean of the others' updates is (S - D_k) / m; cosine_similarity's eps as torch applies it
        others = (sum_squared_norm - 2 * dot + sq).clamp_min(0).sqrt() / m
        raw = []
        for i in range(k):
            cos = ((dot[i] - sq[i]) / m) / (norms[i].clamp_min(1e-12) * others[i].clamp_min(1e-12))
            ratio = (norms[i] / median.clamp_min(1e-12)).clamp_min(1e-12)
            raw.append(counts[i] ** self.exponent * torch.exp(-(1 - cos)) * torch.exp(-0.5 * torch.log(ratio).abs()))
        return self.normalised(raw)



def induced_update(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
    """D_k with every LoRA pair as its induced dW = s (B_k A_k - B A) (float64, flattened) and every
    other tensor as its plain delta, in key order."""
    pairs = lora_pairs(list(reference))
    paired = {k for p in pairs for k in p}
    parts = []
    for a_key, b_key in pairs:
        new = state[b_key].double() @ state[a_key].double()
        old = reference[b_key].double() @ reference[a_key].double()
        parts.append((scaling * (new - old)).flatten())
    parts += [(state[k].double() - reference[k].double()).flatten() for k in sorted(set(reference) - paired)]
    return torch.cat(parts)
