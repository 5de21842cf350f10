"""The federated round loop with early stopping and an atomic checkpoint after every round.

Round t: every client starts from the global trainable state, trains 2 local epochs and
returns its state; the server weights what came back (a client that fails is recorded, never
fabricated), aggregates by delta-SVD, then (prototype methods) each client sends centroids
computed with the new global model and the server aggregates them. The global-validation
macro-F1 decides early stopping; the best state and prototypes are kept apart from the latest.
FedStain first collects every client's style statistics under the global state and hands each
client the others' pool (recomputed from the checkpointed state on resume, so nothing extra is saved).

Every random draw of round t derives from (seed, t, client), so resuming from the checkpoint
of round t replays rounds t+1.. exactly: on CPU the resumed run is bitwise the uninterrupted one.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fedhisto.atomic import atomic_path
from fedhisto.config import Config
from fedhisto.evaluation import macro_f1 as macro_f1_of
from fedhisto.federated.aggregate import aggregate, flat_update
from fedhisto.federated.fedstain import StyleStats, pool_excluding
from fedhisto.federated.prototypes import ServerPrototypes, aggregate_prototypes
from fedhisto.federated.weights import weights_for
from fedhisto.methods import MethodSpec
from fedhisto.model.peft_model import N_CLASSES, FedHistoModel
from fedhisto.train.client import embed_for_prototypes, local_train, predict, stream_rng
from fedhisto.train.data import Split
from fedhisto.train.fedstain_client import client_style_statistics

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 1


class ResumeRefused(RuntimeError):
    """A checkpoint belongs to another method, seed, configuration or dataset."""


@dataclass
class RunContext:
    model: FedHistoModel
    clients: dict[str, Split]
    validation: Split
    descriptors: dict[str, torch.Tensor | None]   # per client, and "global" for validation/test/external
    spec: MethodSpec
    cfg: Config
    seed: int
    identity: dict
    device: torch.device
    checkpoint: Path
    stop_after_round: int | None = None            # for tests: simulate a kill after this round
    client_fault: dict = field(default_factory=dict)  # for tests: {round: client} raises in that round


def save_checkpoint(path: Path, ckpt: dict) -> None:
    ckpt = {**ckpt, "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                            "torch": torch.get_rng_state()}}
    with atomic_path(path) as tmp:
        torch.save(ckpt, tmp)


def load_checkpoint(path: Path, identity: dict) -> dict | None:
    if not path.exists():
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ResumeRefused(f"{path}: checkpoint format {ckpt.get('format')} is not {CHECKPOINT_FORMAT}")
    differ = [k for k in ("method", "seed", "config_hash", "dataset_identity") if ckpt["identity"].get(k) != identity[k]]
    if differ:
        detail = "; ".join(f"{k}: checkpoint {ckpt['identity'].get(k)!r} vs run {identity[k]!r}" for k in differ)
        raise ResumeRefused(f"{path}: refusing to resume, {detail}. Delete it to start over.")
    random.setstate(ckpt["rng"]["python"])
    np.random.set_state(ckpt["rng"]["numpy"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    return ckpt


def macro_f1(probs: torch.Tensor, labels: list[int]) -> float:
    return macro_f1_of(labels, probs.argmax(1).cpu().numpy())  # the package's one macro-F1 (fedhisto.evaluation)


def style_pools(ctx: RunContext, global_state: dict, names: list[str], round_idx: int) -> dict[str, StyleStats]:
    """FedStain stage (a): every client uploads its style statistics; each gets the others' pool."""
    uploads = {name: client_style_statistics(ctx.model, global_state, ctx.clients[name], ctx.cfg,
                                             stream_rng(ctx.seed, 12, round_idx, k), ctx.device)
               for k, name in enumerate(names)}
    return {name: pool_excluding(uploads, name) for name in names}


def run_rounds(ctx: RunContext) -> dict:
    t = ctx.cfg.train
    ckpt = load_checkpoint(ctx.checkpoint, ctx.identity)
    if ckpt is not None:
        log.info("resuming %s seed %d from %s after round %d", ctx.identity["method"], ctx.seed, ctx.checkpoint,
                 ckpt["round"])
        ckpt.setdefault("resumed_at_rounds", []).append(ckpt["round"])
    if ckpt is None:
        state = ctx.model.trainable_state()
        ckpt = {"format": CHECKPOINT_FORMAT, "identity": ctx.identity, "round": 0, "global_state": state,
                "server_prototypes": None, "best": {"state": state, "prototypes": None, "round": 0, "metric": -1.0},
                "bad_rounds": 0, "stopped": False, "history": []}
    weigh = weights_for(ctx.spec.aggregation, t.adaptive_floor)
    names = sorted(ctx.clients)
    bar = tqdm(total=t.max_rounds, initial=ckpt["round"], desc=f"{ctx.identity['method']} s{ctx.seed}", unit="round")
    while not ckpt["stopped"] and ckpt["round"] < t.max_rounds:
        r = ckpt["round"]
        start = time.perf_counter()
        protos = ServerPrototypes.from_state(ckpt["server_prototypes"]) if ckpt["server_prototypes"] else None
        results, failed = {}, {}
        pools = style_pools(ctx, ckpt["global_state"], names, r) if ctx.spec.style_exchange else {}
        for k, name in enumerate(names):
            try:
                if ctx.client_fault.get(r) == name:
                    raise RuntimeError(f"injected fault for {name} in round {r}")
                results[name] = local_train(ctx.model, ckpt["global_state"], ctx.clients[name],
                                            ctx.descriptors[name], protos, ctx.spec, ctx.cfg, ctx.seed, r, k,
                                            ctx.device, style_pool=pools.get(name))
            except Exception as exc:  # recorded, never fabricated: the server aggregates what came back
                log.warning("round %d: client %s failed: %s", r, name, exc)
                failed[name] = f"{type(exc).__name__}: {exc}"
        if not results:
            raise RuntimeError(f"round {r}: every client failed: {failed}")
        returned = sorted(results)
        weights = weigh([results[n].n_samples for n in returned],
                        [flat_update(results[n].state, ckpt["global_state"]) for n in returned])
        new_state = aggregate([results[n].state for n in returned], weights, ctx.model.lora_scaling, ctx.cfg.model.lora_r)
        ctx.model.load_trainable_state(new_state)
        server = None
        if ctx.spec.prototypes != "none":
            uploads = [embed_for_prototypes(ctx.model, ctx.clients[n], ctx.descriptors[n], ctx.cfg, ctx.device)
                       for n in returned]
            server = aggregate_prototypes(uploads, N_CLASSES, ctx.model.classifier.in_features).state()
        val = macro_f1(predict(ctx.model, ctx.validation, ctx.descriptors["global"], ctx.cfg, ctx.device),
                       ctx.validation.labels)
        improved = val > ckpt["best"]["metric"] + t.min_delta
        if improved:
            ckpt["best"] = {"state": new_state, "prototypes": server, "round": r + 1, "metric": val}
        ckpt.update(global_state=new_state, server_prototypes=server, round=r + 1,
                    bad_rounds=0 if improved else ckpt["bad_rounds"] + 1)
        ckpt["stopped"] = ckpt["bad_rounds"] >= t.patience
        ckpt["history"].append({
            "round": r + 1, "val_macro_f1": val, "best": improved,
            "weights": dict(zip(returned, weights, strict=True)), "failed_clients": failed,
            "losses": {n: results[n].losses for n in returned}, "wall_s": round(time.perf_counter() - start, 3)})
        save_checkpoint(ctx.checkpoint, ckpt)
        # one line per round in the rule log: a cluster user sees progress and where a resume will start
        log.info("round %d/%d: validation macro-F1 %.4f (best %.4f at round %d), %d client(s) failed, checkpoint saved",
                 r + 1, t.max_rounds, val, ckpt["best"]["metric"], ckpt["best"]["round"], len(failed))
        bar.update()
        bar.set_postfix(val_f1=f"{val:.3f}", best=f"{ckpt['best']['metric']:.3f}")
        if ctx.stop_after_round is not None and ckpt["round"] >= ctx.stop_after_round and not ckpt["stopped"]:
            bar.close()
            raise KeyboardInterrupt(f"stopped after round {ckpt['round']} (simulated kill)")
    bar.close()
    ctx.model.load_trainable_state(ckpt["best"]["state"])  # evaluation uses the validation-selected state
    return ckpt
