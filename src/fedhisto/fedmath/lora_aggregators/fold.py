"""Folded base deltas: the part of a member state that FedEx-LoRA adds to the frozen encoder.

An aggregator that folds (``Pair.residual``, FedEx-LoRA) changes the frozen weight of every
LoRA-adapted module, ``W0 <- W0 + R``, every round. The change is part of the model, so it lives in
the member state beside the trainable tensors, one dense tensor per module under the name of the
base weight it offsets, prefixed ``folded_base.``:

    folded_base.<module>.base_layer.weight = D_t = R_1 + ... + R_t   (out x in, the base weight's dtype)

so that the module computes ``(W0 + D_t) x + s B A x``. Keeping the cumulative offset (not the
round's residual) makes a member state the whole model: the engines send it as the start state
(the dense traffic FedEx-LoRA pays, both in-process and on the Flower message path), the
checkpoint keeps it, ``FedHistoModel.load_trainable_state`` applies it (and a state without it
means the pristine encoder), and the export package stores it as a safetensors file beside the
adapters. Sites never send it back: they do not change it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedhisto.fedmath.lora_aggregators import FOLDED, Aggregator, State, aggregate_means, aggregate_states


def is_folded(key: str) -> bool:
    return key.startswith(FOLDED)


def base_weight(a_key: str) -> str:
    """The frozen weight a LoRA pair adapts: ``X.lora_A.<adapter>.weight`` -> ``X.base_layer.weight``."""
    module, mark, _ = a_key.partition(".lora_A.")
    if not mark:
        raise ValueError(f"{a_key!r} is not a LoRA A tensor")
    return f"{module}.base_layer.weight"


def folded_key(a_key: str) -> str:
    return FOLDED + base_weight(a_key)


def split_folded(state: Mapping[str, torch.Tensor]) -> tuple[State, State]:
    """(the trainable tensors, the folded base deltas keyed by the base weight's name)."""
    trainable, folded = {}, {}
    for key, t in state.items():
        if is_folded(key):
            folded[key.removeprefix(FOLDED)] = t
        else:
            trainable[key] = t
    return trainable, folded


def trainable_part(state: Mapping[str, torch.Tensor]) -> State:
    return {k: v for k, v in state.items() if not is_folded(k)}


def aggregate_with_fold(agg: Aggregator, states: Sequence[State], weights: Sequence[float], scaling: float,
                        rank: int, start: Mapping[str, torch.Tensor], dtype: torch.dtype) -> State:
    """``aggregate_states`` of the sites' trainable ``states``, plus, for an aggregator that folds,
    the new cumulative offsets ``D_t = D_{t-1} + R_t`` (``D_{t-1}`` from the round's ``start``; summed in
    float64 and stored in ``dtype``, the base weights'). Every site starts a round from the same
    ``start`` (one global model), so its offsets are the ones the sites trained on."""
    merged, residuals = aggregate_states(agg, [trainable_part(s) for s in states], weights, scaling, rank)
    return fold_residuals(agg, merged, residuals, start, dtype)


def aggregate_means_with_fold(agg: Aggregator, mean, scaling: float, rank: int, start: Mapping[str, torch.Tensor],
                              dtype: torch.dtype) -> State:
    """``aggregate_with_fold`` from the weighted means of the sites' masked terms (secure aggregation:
    ``lora_aggregators.aggregate_means``)."""
    merged, residuals = aggregate_means(agg, mean, dict(start), scaling, rank)
    return fold_residuals(agg, merged, residuals, start, dtype)


def fold_residuals(agg: Aggregator, merged: State, residuals: dict[str, torch.Tensor],
                   start: Mapping[str, torch.Tensor], dtype: torch.dtype) -> State:
    """``merged`` with the new cumulative offsets D_t = D_{t-1} + R_t of a folding aggregator."""
    previous = {k: v for k, v in start.items() if is_folded(k)}
    if not residuals:
        if previous:
            raise ValueError(f"{agg.name}: the start state carries folded base deltas but the aggregator folds "
                             "none (a fedex_lora state resumed under another aggregator?)")
        return merged
    for a_key, residual in residuals.items():
        key = folded_key(a_key)
        before = previous.get(key)
        total = residual if before is None else before.double() + residual
        merged[key] = total.to(dtype)
    return merged
