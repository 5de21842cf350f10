"""One arm of the LoRA-aggregation experiment: a PAST-family method under one server aggregator
(``train.past.lora_aggregator``), one seed, one encoder condition, trained and predicted by the main
stages' functions, with what the checkpoint keeps only for the latest round recorded per round:

- the **spectrum of the aggregate**: per LoRA-adapted module, the singular values of the global
  model's learned update ``dW = s B' A'`` (plus, under FedEx-LoRA, the folded offset of the frozen
  weight, so dW is the whole change the federation made), summarised as the energy share
  ``sum_{i<=k} sigma_i^2 / sum_i sigma_i^2`` of the leading k = 1..r directions (mean over modules)
  and the effective rank ``exp(H)`` of the normalised energies: does the energy concentrate in a few
  leading directions as rounds go (rank collapse)?
- the **traffic of the round**: ``Strategy.model_bytes`` of the round's real start state (FedEx-LoRA's
  dense offsets included) over the clients, plus the method's extra messages (v2's prototypes), as
  Table 8 counts them.

``rounds.json`` in the arm's folder holds one row per round; it is rewritten after every round, so a
resumed run keeps the rows of the rounds before its resume. Torch is imported inside the functions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fedhisto.config.study import Config


def arm_config(cfg: Config, aggregator: str, method: str, seed: int) -> Config:
    """The main config with one method and seed trained under ``aggregator`` (no other run, no bootstrap)."""
    from fedhisto.entry import study_config  # a run's config: the DP capability checks included

    raw = json.loads(cfg.model_dump_json())
    raw["train"].update(methods=[method], ablations=[], ablation_seeds=[], comparator_seeds=None, seeds=[seed])
    raw["train"].setdefault("past", {})["lora_aggregator"] = aggregator
    raw["bootstrap"]["comparisons"] = {}
    return study_config(raw, source=f"lora_aggregation arm {aggregator}/{method}/seed{seed}")


def update_spectrum(state: dict, scaling: float, rank: int) -> dict[str, Any]:
    """Energy shares of the leading 1..``rank`` directions and the effective rank of the global update,
    each the mean over LoRA-adapted modules (float64 SVD of the dense out x in update)."""
    import torch

    from fedhisto.fedmath.lora_aggregators import lora_pairs
    from fedhisto.fedmath.lora_aggregators.fold import base_weight, split_folded

    trainable, folded = split_folded(state)
    shares, effective = [], []
    for a_key, b_key in lora_pairs(list(trainable)):
        dense = scaling * trainable[b_key].double() @ trainable[a_key].double()
        offset = folded.get(base_weight(a_key))
        if offset is not None:
            dense = dense + offset.double()
        energy = torch.linalg.svdvals(dense) ** 2
        total = float(energy.sum())
        if total == 0.0:
            continue
        p = energy / total
        cumulative = torch.cumsum(p, 0)
        shares.append([float(cumulative[min(k, len(p)) - 1]) for k in range(1, rank + 1)])
        nonzero = p[p > 0]
        effective.append(math.exp(float(-(nonzero * nonzero.log()).sum())))
    if not shares:
        return {"energy_share": [], "effective_rank": None, "modules": 0}
    return {"energy_share": [sum(col) / len(col) for col in zip(*shares, strict=True)],
            "effective_rank": sum(effective) / len(effective), "modules": len(shares)}


def round_traffic_bytes(method: Any, cfg: Config, state: dict, first_round: bool) -> int:
    """Bytes of one round's messages over the clients (Table 8's count) from the round's real start
    state: round 1 starts before any fold, so its start carries no offsets."""
    from fedhisto.accounting.stage import optimisation_sizes
    from fedhisto.fedmath.lora_aggregators.fold import trainable_part

    targets = cfg.partition_targets()
    availability = {c: [n > 0 for n in pool] for c, pool in targets.clients.items()}
    start = trainable_part(state) if first_round else state
    payload = sum(t.numel() * t.element_size() for t in trainable_part(state).values())
    dim = state["classifier.weight"].shape[1]
    model = method.model_bytes(start, sorted(availability)) if method.exchanges_model else 0
    folding = getattr(method, "lora_aggregator", None) or getattr(method, "aggregator", None)
    if first_round and folding is not None:  # Table 8 counts a fold's offsets on a state without them: not yet sent
        model -= len(availability) * folding.extra_down_bytes(start)
    return model + sum(method.extra_traffic_bytes(dim, availability, optimisation_sizes(cfg), payload).values())


def train_arm(cfg: Config, aggregator: str, method: str, seed: int, manifest: str | Path, identity: str | Path,
              descriptors: str | Path, out_dir: str | Path, encoder_dir: str | None = None, threads: int = 1) -> dict:
    """Train and predict one arm into ``out_dir`` (``train/``, ``predictions/``, ``rounds.json``)."""
    from fedhisto.infra.atomic import write_json
    from fedhisto.methods import build_method
    from fedhisto.methods.base import GLOBAL
    from fedhisto.predict.stage import run_predict
    from fedhisto.train.stage import run_train

    out = Path(out_dir)
    c = arm_config(cfg, aggregator, method, seed)
    m = build_method(method, c)
    scaling = c.model.lora_alpha / c.model.lora_r
    path = out / "rounds.json"
    kept = json.loads(path.read_text())["rounds"] if path.exists() else []

    def after_round(ckpt: dict) -> None:
        state = ckpt["members"][GLOBAL]
        rows = [r for r in kept if r["round"] < ckpt["round"]]
        rows.append({"round": ckpt["round"], "val_macro_f1": ckpt["history"][-1]["val_macro_f1"],
                     "traffic_bytes": round_traffic_bytes(m, c, state, ckpt["round"] == 1),
                     **update_spectrum(state, scaling, c.model.lora_r)})
        kept[:] = rows
        write_json(path, {"aggregator": aggregator, "method": method, "seed": seed, "rounds": rows})

    summary = run_train(method, seed, manifest, identity, descriptors, c, out / "train", encoder_dir=encoder_dir,
                        threads=threads, after_round=after_round)
    run_predict(method, seed, out / "train", manifest, identity, descriptors, c, out / "predictions", encoder_dir,
                threads)
    return {"rounds": summary.get("rounds"), "best_round": summary.get("best_round"),
            "rounds_json": str(path), "external": str(out / "predictions/external.csv")}
