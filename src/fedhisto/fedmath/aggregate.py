"""Server aggregation of returned trainable states: delta-SVD for LoRA pairs, weighted mean otherwise."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from fedhisto.fedmath.delta_svd import delta_svd


def lora_pairs(keys: Sequence[str]) -> list[tuple[str, str]]:
    """(A key, B key) for every LoRA-adapted module in a peft state dict."""
    return [(k, k.replace("lora_A", "lora_B")) for k in sorted(keys) if ".lora_A." in k]


def flat_update(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """A client's update D_k: its state minus the global one, flattened in key order (the trainable
    tensors: a folded base delta in the reference is the server's, never trained or sent back)."""
    from fedhisto.fedmath.lora_aggregators.fold import is_folded

    return torch.cat([(state[k].double() - reference[k].double()).flatten() for k in sorted(reference)
                      if not is_folded(k)])


def aggregate(states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float], scaling: float,
              rank: int) -> dict[str, torch.Tensor]:
    """Combine client states with weights ``a_k`` (they must sum to 1)."""
    if not states:
        raise ValueError("no client state to aggregate")
    if abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"aggregation weights must sum to 1, got {sum(weights)}")
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError("client states carry different tensors")
    out: dict[str, torch.Tensor] = {}
    pairs = lora_pairs(list(keys))
    for a_key, b_key in pairs:
        a, b = delta_svd([(s[a_key], s[b_key]) for s in states], weights, scaling, rank)
        out[a_key], out[b_key] = a, b
    paired = {k for p in pairs for k in p}
    for key in sorted(keys - paired):
        out[key] = sum(w * s[key].double() for s, w in zip(states, weights, strict=True)).to(states[0][key].dtype)
    return out


def delta_svd_from_means(mean: Callable[[str], torch.Tensor], start: Mapping[str, torch.Tensor], scaling: float,
                         rank: int) -> dict[str, torch.Tensor]:
    """``aggregate`` (delta-SVD and the weighted mean) from masked sums (secure aggregation):
    each LoRA pair refactorised from the mean ``s B A`` (``mean(a_key)``), every other trainable tensor its
    mean (``mean(key)``), in the start state's dtypes."""
    from fedhisto.fedmath.lora_aggregators.fold import is_folded
    from fedhisto.fedmath.secure_sums import refactorise

    out = {}
    pairs = lora_pairs(list(start))
    for a_key, b_key in pairs:
        a, b = refactorise(mean(a_key), scaling, rank)
        out[a_key], out[b_key] = a.to(start[a_key].dtype), b.to(start[b_key].dtype)
    paired = {k for p in pairs for k in p}
    for key in sorted(k for k in set(start) - paired if not is_folded(k)):
        out[key] = mean(key).to(start[key].dtype)
    return out
