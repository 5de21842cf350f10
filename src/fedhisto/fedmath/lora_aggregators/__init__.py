"""Server aggregators of LoRA factors, one file each, and their registry.

Every aggregator combines, per LoRA-adapted module, the clients' factors ``(A_k, B_k)`` (peft shapes:
A is r x in, B is out x r) with weights ``a_k`` (summing to 1) into the next round's factors; tensors
outside LoRA pairs (adapter, FiLM, classifier) take the weighted mean ``sum_k a_k theta_k`` under
every aggregator here. An aggregator also says what travels (``message_bytes``, counted from the real
tensors for Table 8), whether it admits a different LoRA rank per site, and whether the aggregate is
exact (``s B' A'`` equals ``sum_k a_k s B_k A_k``).

Registered: ``delta_svd`` (the study's, ``fedmath.delta_svd``), ``factor_mean``, ``flexlora``,
``fedex_lora``, ``ffa_lora`` and ``fedsa_lora``. The methods of the same names
(``methods.lora_aggregation``) are FedAvg-PEFT's model and objective with that aggregator.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: name -> "module:Class" (imported when used, so listing the names imports no aggregator)
AGGREGATORS = {
    "delta_svd": "fedhisto.fedmath.lora_aggregators.study_delta_svd:DeltaSVD",
    "factor_mean": "fedhisto.fedmath.lora_aggregators.factor_mean:FactorMean",
    "flexlora": "fedhisto.fedmath.lora_aggregators.flexlora:FlexLoRA",
    "fedex_lora": "fedhisto.fedmath.lora_aggregators.fedex_lora:FedExLoRA",
    "ffa_lora": "fedhisto.fedmath.lora_aggregators.ffa_lora:FFALoRA",
    "fedsa_lora": "fedhisto.fedmath.lora_aggregators.fedsa_lora:FedSALoRA",
}

State = dict[str, torch.Tensor]


@dataclass
class Pair:
    """One module's aggregate: the factors every site receives, and (FedEx-LoRA) the dense residual
    ``R`` (out x in) folded into the frozen weight, ``W0 <- W0 + R``; None for the others."""

    a: torch.Tensor
    b: torch.Tensor
    residual: torch.Tensor | None = None


#: Key prefix of a member state's folded base deltas (FedEx-LoRA's residual, ``fold.py``): dense offsets of
#: frozen weights, never LoRA factors.
FOLDED = "folded_base."

class Aggregator:
    """Base of the LoRA aggregators (see the module docstring)."""

    name = ""
    heterogeneous_ranks = False   # admits a LoRA rank per site (zero-padded to the model's rank)
    exact = False                 # s B' A' equals sum_k a_k s B_k A_k
    frozen_factor: str | None = None  # "lora_A": sites never train A (FFA-LoRA)
    local_factor: str | None = None   # "lora_B": each site keeps its own B, never sent (FedSA-LoRA)

    def pair(self, factors: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float], scaling: float,
             rank: int) -> Pair:
        raise NotImplementedError

    def message_bytes(self, state: State, site_rank: int | None = None, model_rank: int | None = None
                      ) -> tuple[int, int]:
        """(down, up) bytes of one site in one round, from the real tensors of a trainable ``state``:
        every tensor but the ones this aggregator keeps off the wire, a factor at the site's rank."""
        down = up = 0
        for key, t in state.items():
            if key.startswith(FOLDED):  # the server's folded base deltas: counted by extra_down_bytes
                continue
            if self.frozen_factor and f".{self.frozen_factor}." in key:
                continue
            if self.local_factor and f".{self.local_factor}." in key:
                continue
            n = t.numel() * t.element_size()
            if site_rank is not None and model_rank and (".lora_A." in key or ".lora_B." in key):
                n = n * site_rank // model_rank
            down, up = down + n, up + n
        return down + self.extra_down_bytes(state), up

    def extra_down_bytes(self, state: State) -> int:
        """Bytes sent down per site beyond the state (FedEx-LoRA's dense residuals)."""
        return 0

    # Under secure aggregation (``methods.secure_capability``) the server sees only weighted sums over
    # the sites: an aggregator says which per-pair terms a site masks and builds the pair from their means.
    #: what a site masks per LoRA pair, in words (None: this aggregator cannot run on sums)
    secure_form: str | None = "s B_k A_k (dense, out x in)"

    def secure_pair_terms(self, a: torch.Tensor, b: torch.Tensor, scaling: float, a_key: str, b_key: str) -> dict:
        """A site's masked terms of one pair (default: its dense product, under the A key)."""
        from fedhisto.fedmath.secure_sums import Product

        return {a_key: Product(b, a, scaling)}

    def pair_from_means(self, mean, a_key: str, b_key: str, scaling: float, rank: int, start: State) -> Pair:
        """The pair from the weighted means of its terms (``mean(name)``); default: the rank-r SVD of the
        mean product, as delta-SVD and FlexLoRA compute it."""
        from fedhisto.fedmath.secure_sums import refactorise

        a, b = refactorise(mean(a_key), scaling, rank)
        return Pair(a, b)


def aggregator(name: str) -> Aggregator:
    try:
        target = AGGREGATORS[name]
    except KeyError:
        raise ValueError(f"unknown LoRA aggregator {name!r}; registered: {', '.join(AGGREGATORS)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)()


def lora_pairs(keys: Sequence[str]) -> list[tuple[str, str]]:
    """(A key, B key) for every LoRA-adapted module in a peft state dict."""
    return [(k, k.replace("lora_A", "lora_B")) for k in sorted(keys) if ".lora_A." in k]


def check_weights(states: Sequence[State], weights: Sequence[float]) -> None:
    if not states:
        raise ValueError("no client state to aggregate")
    if abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"aggregation weights must sum to 1, got {sum(weights)}")
    keys = set(states[0])
    if any(set(s) != keys for s in states[1:]):
        raise ValueError("client states carry different tensors")


def check_frozen(agg: Aggregator, states: Mapping[str, State], starts: Mapping[str, State]) -> None:
    """An aggregator that keeps a factor frozen (FFA-LoRA's A): every site's returned factor must be bitwise
    the one it was sent (the round's start), not merely equal to the other sites' (a change made
    identically everywhere is still a trained factor)."""
    if not agg.frozen_factor:
        return
    for name in sorted(states):
        for key, t in states[name].items():
            if f".{agg.frozen_factor}." in key and not torch.equal(t, starts[name][key].to(t.device)):
                raise ValueError(f"{agg.name}: client {name}'s {key} differs from the broadcast A_0 (the frozen factor "
                                 "must come back as it was sent: a site trained it)")


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_k a_k t_k in float64, returned in the first tensor's dtype."""
    return sum(w * t.double() for t, w in zip(tensors, weights, strict=True)).to(tensors[0].dtype)


def aggregate_states(agg: Aggregator, states: Sequence[State], weights: Sequence[float], scaling: float,
                     rank: int) -> tuple[State, dict[str, torch.Tensor]]:
    """The aggregate state and, per A key, the dense residual an aggregator folds (FedEx-LoRA; else empty)."""
    check_weights(states, weights)
    out: State = {}
    residuals: dict[str, torch.Tensor] = {}
    pairs = lora_pairs(list(states[0]))
    for a_key, b_key in pairs:
        got = agg.pair([(s[a_key], s[b_key]) for s in states], weights, scaling, rank)
        out[a_key], out[b_key] = got.a.to(states[0][a_key].dtype), got.b.to(states[0][b_key].dtype)
        if got.residual is not None:
            residuals[a_key] = got.residual
    paired = {k for p in pairs for k in p}
    for key in sorted(set(states[0]) - paired):
        out[key] = weighted_mean([s[key] for s in states], weights)
    return out, residuals


def secure_state_terms(agg: Aggregator, state: State, scaling: float) -> dict:
    """A site's masked terms under ``agg``: each pair's (``secure_pair_terms``), every other trainable tensor."""
    state = {k: v for k, v in state.items() if not k.startswith(FOLDED)}  # the trainable part (fold.py's)
    out: dict = {}
    pairs = lora_pairs(list(state))
    for a_key, b_key in pairs:
        out.update(agg.secure_pair_terms(state[a_key], state[b_key], scaling, a_key, b_key))
    paired = {k for p in pairs for k in p}
    out.update({k: v for k, v in state.items() if k not in paired})
    return out


def aggregate_means(agg: Aggregator, mean, start: State, scaling: float, rank: int
                    ) -> tuple[State, dict[str, torch.Tensor]]:
    """``aggregate_states`` from the weighted means of the sites' ``secure_state_terms`` (``mean(name)``),
    in the start state's dtypes."""
    start = {k: v for k, v in start.items() if not k.startswith(FOLDED)}
    out: State = {}
    residuals: dict[str, torch.Tensor] = {}
    pairs = lora_pairs(list(start))
    for a_key, b_key in pairs:
        got = agg.pair_from_means(mean, a_key, b_key, scaling, rank, start)
        out[a_key], out[b_key] = got.a.to(start[a_key].dtype), got.b.to(start[b_key].dtype)
        if got.residual is not None:
            residuals[a_key] = got.residual
    paired = {k for p in pairs for k in p}
    for key in sorted(set(start) - paired):
        out[key] = mean(key).to(start[key].dtype)
    return out, residuals
