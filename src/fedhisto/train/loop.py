"""The in-process federated round loop, with early stopping and an atomic checkpoint after every round.

Round t, in the order of the method hooks (``methods.base``): participants upload what the server
needs to configure the round (FedStain's style statistics), the server sends each its start state and
payload, each trains ``local_epochs`` epochs, the server weights what came back and aggregates, then
(prototype methods) participants upload centroids under the new model and the server keeps them as
its method state. The global-validation macro-F1 (the mean over members for ``local_only``) decides
early stopping; the best member states and method state are kept apart from the latest.

Failures are counted, never absorbed: only a declared unavailability (``ClientUnavailable``: a site
that cannot be reached or whose data cannot be read) is tolerated, recorded per round and bounded by
``train.max_unavailable_client_rounds``; any other error stops the run as a ``ClientFailure`` that
names the client and round.

Every random draw of round t derives from (seed, t, participant), so resuming from the checkpoint of
round t replays rounds t+1.. exactly: on one machine and build the resumed run is bitwise the
uninterrupted one.
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
from fedhisto.fedmath.aggregate import flat_update
from fedhisto.methods.base import Method, named_rng
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.data import Split
from fedhisto.train.inference import predict
from fedhisto.train.local import local_train

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 2
IDENTITY_KEYS = ("method", "seed", "config_hash", "dataset_identity", "descriptor_digest", "encoder_digest")


class ResumeRefused(RuntimeError):
    """A checkpoint belongs to another method, seed, configuration, dataset, descriptor set or encoder."""


class ClientUnavailable(RuntimeError):
    """Declared unavailability: a site that cannot be reached or whose data cannot be read this round."""


class ClientFailure(RuntimeError):
    """Anything else that went wrong in a client's round: the run stops and says where."""

    def __init__(self, client: str, round_idx: int, error: BaseException) -> None:
        super().__init__(f"client {client} failed in round {round_idx + 1}: {type(error).__name__}: {error}")
        self.client, self.round, self.error = client, round_idx + 1, f"{type(error).__name__}: {error}"


class TooManyUnavailable(RuntimeError):
    """More tolerated client-rounds than ``train.max_unavailable_client_rounds`` allows."""


@dataclass
class RunContext:
    model: FedHistoModel
    method: Method
    clients: dict[str, Split]                      # participants of a round (method.participants)
    validation: Split
    descriptors: dict[str, torch.Tensor | None]    # per participant, and "global" for validation/test/external
    cfg: Config
    seed: int
    identity: dict
    device: torch.device
    checkpoint: Path
    stop_after_round: int | None = None            # for tests: simulate a kill after this round
    client_fault: dict = field(default_factory=dict)  # for tests: {round index: client} declared unavailable
    client_error: dict = field(default_factory=dict)  # for tests: {round index: client} raises a plain error


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
    differ = [k for k in IDENTITY_KEYS if ckpt["identity"].get(k) != identity[k]]
    if differ:
        detail = "; ".join(f"{k}: checkpoint {ckpt['identity'].get(k)!r} vs run {identity[k]!r}" for k in differ)
        raise ResumeRefused(f"{path}: refusing to resume, {detail}. Delete it to start over.")
    random.setstate(ckpt["rng"]["python"])
    np.random.set_state(ckpt["rng"]["numpy"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    return ckpt


def macro_f1(probs: torch.Tensor, labels: list[int]) -> float:
    return macro_f1_of(labels, probs.argmax(1).cpu().numpy())  # the package's one macro-F1 (fedhisto.evaluation)


def validate_members(ctx: RunContext, members: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    out = {}
    for name, state in members.items():
        ctx.model.load_trainable_state(state)
        out[name] = macro_f1(predict(ctx.model, ctx.validation, ctx.descriptors["global"], ctx.cfg, ctx.device),
                             ctx.validation.labels)
    return out


def fresh_checkpoint(model: FedHistoModel, method: Method, participants: list[str], identity: dict) -> dict:
    state = model.trainable_state()
    members = {m: state for m in method.members(sorted(participants))}
    return {"format": CHECKPOINT_FORMAT, "identity": identity, "round": 0, "members": members,
            "server_state": None, "best": {"members": members, "server_state": None, "round": 0, "metric": -1.0},
            "bad_rounds": 0, "stopped": False, "history": []}


def start_or_resume(path: Path, identity: dict, fresh) -> dict:
    """The checkpoint to continue from (its resume recorded), or ``fresh()``."""
    ckpt = load_checkpoint(path, identity)
    if ckpt is None:
        return fresh()
    log.info("resuming %s seed %d from %s after round %d", identity["method"], identity["seed"], path, ckpt["round"])
    ckpt.setdefault("resumed_at_rounds", []).append(ckpt["round"])
    return ckpt


def close_round(ckpt: dict, cfg: Config, r: int, row: dict, member_metrics: dict[str, float], start: float,
                path: Path) -> float:
    """Early stopping on the mean member validation macro-F1, the history row, the atomic checkpoint, and
    the unavailability budget; shared by the in-process and Flower engines. Returns the metric."""
    t = cfg.train
    val = float(np.mean(list(member_metrics.values())))
    improved = val > ckpt["best"]["metric"] + t.min_delta
    if improved:
        ckpt["best"] = {"members": ckpt["members"], "server_state": ckpt["server_state"], "round": r + 1,
                        "metric": val, "member_metrics": member_metrics}
    ckpt.update(round=r + 1, bad_rounds=0 if improved else ckpt["bad_rounds"] + 1)
    ckpt["stopped"] = ckpt["bad_rounds"] >= t.patience
    ckpt["history"].append({"round": r + 1, "val_macro_f1": val, "best": improved, **row,
                            "member_metrics": member_metrics, "wall_s": round(time.perf_counter() - start, 3)})
    save_checkpoint(path, ckpt)
    # one line per round in the rule log: a cluster user sees progress and where a resume will start
    log.info("round %d/%d: validation macro-F1 %.4f (best %.4f at round %d), %d client(s) unavailable, "
             "checkpoint saved", r + 1, t.max_rounds, val, ckpt["best"]["metric"], ckpt["best"]["round"],
             len(row["unavailable_clients"]))
    if unavailable_so_far(ckpt) > t.max_unavailable_client_rounds:
        raise TooManyUnavailable(f"{unavailable_so_far(ckpt)} unavailable client-rounds exceed "
                                 f"train.max_unavailable_client_rounds={t.max_unavailable_client_rounds}")
    return val


def unavailable_so_far(ckpt: dict) -> int:
    return sum(len(h["unavailable_clients"]) for h in ckpt["history"])


def _client_step(ctx: RunContext, name: str, round_idx: int, fn, inject: bool = True):
    """Run one client's step; a declared unavailability passes through, anything else names the client."""
    try:
        if inject and ctx.client_fault.get(round_idx) == name:
            raise ClientUnavailable(f"injected unavailability of {name} in round {round_idx + 1}")
        if inject and ctx.client_error.get(round_idx) == name:
            raise RuntimeError(f"injected error in {name}, round {round_idx + 1}")
        return fn()
    except ClientUnavailable:
        raise
    except Exception as exc:
        raise ClientFailure(name, round_idx, exc) from exc


def _batched_clients(ctx: RunContext, members: dict, payloads: dict, unavailable: dict[str, str], r: int) -> dict:
    """Every available client's local epochs in one batched pass (``train.batched``); injected faults
    are resolved per client first, an error inside the pass names every client of it."""
    from fedhisto.train.batched import MemberJob, batched_local_train

    method, names = ctx.method, sorted(ctx.clients)
    jobs, order = [], []
    for k, name in enumerate(names):
        if name in unavailable:
            continue
        try:
            _client_step(ctx, name, r, lambda: None)
        except ClientUnavailable as exc:
            log.warning("round %d: client %s unavailable: %s", r + 1, name, exc)
            unavailable[name] = str(exc)
            continue
        jobs.append(MemberJob(method.start_state(members, name), ctx.clients[name], ctx.descriptors[name],
                              payloads[name], ctx.seed, r, k))
        order.append(name)
    if not jobs:
        return {}
    out = _client_step(ctx, ",".join(order), r, lambda: batched_local_train(method, ctx.model, jobs, ctx.cfg,
                                                                            ctx.device), inject=False)
    return dict(zip(order, out, strict=True))


def train_round(ctx: RunContext, ckpt: dict, r: int) -> dict:
    """One round; returns the history row and updates ``ckpt`` (members, server state)."""
    method, names = ctx.method, sorted(ctx.clients)
    members = ckpt["members"]
    unavailable: dict[str, str] = {}
    uploads = {}
    for k, name in enumerate(names):
        try:
            uploads[name] = _client_step(ctx, name, r, lambda name=name, k=k: method.upload_before_training(
                ctx.model, method.start_state(members, name), ctx.clients[name],
                named_rng("style_sample", ctx.seed, r, k), ctx.device), inject=False)
        except ClientUnavailable as exc:
            unavailable[name] = str(exc)
    payloads = method.configure_train(r, ckpt["server_state"], uploads)
    results = {}
    if ctx.cfg.train.engine == "batched":
        results = _batched_clients(ctx, members, payloads, unavailable, r)
    for k, name in enumerate(names):
        if name in unavailable or ctx.cfg.train.engine == "batched":
            continue
        try:
            results[name] = _client_step(ctx, name, r, lambda name=name, k=k: local_train(
                method, ctx.model, method.start_state(members, name), ctx.clients[name], ctx.descriptors[name],
                payloads[name], ctx.cfg, ctx.seed, r, k, ctx.device))
        except ClientUnavailable as exc:
            log.warning("round %d: client %s unavailable: %s", r + 1, name, exc)
            unavailable[name] = str(exc)
    if not results:
        raise TooManyUnavailable(f"round {r + 1}: no participant returned an update ({sorted(unavailable)})")
    returned = sorted(results)
    reference = {n: method.start_state(members, n) for n in returned}
    weights = method.client_weights([results[n].n_samples for n in returned],
                                    [flat_update(results[n].state, reference[n]) for n in returned])
    members = {**members, **method.aggregate_train({n: results[n].state for n in returned}, weights, ctx.model)}
    after = {}
    for n in returned:
        ctx.model.load_trainable_state(method.start_state(members, n))
        after[n] = method.upload_after_aggregation(ctx.model, ctx.clients[n], ctx.descriptors[n], ctx.device)
    server_state = method.aggregate_uploads(after) if any(v is not None for v in after.values()) else None
    ckpt.update(members=members, server_state=server_state)
    return {"weights": dict(zip(returned, weights, strict=True)), "unavailable_clients": unavailable,
            "losses": {n: results[n].losses for n in returned}}


def run_rounds(ctx: RunContext) -> dict:
    t = ctx.cfg.train
    ckpt = start_or_resume(ctx.checkpoint, ctx.identity,
                           lambda: fresh_checkpoint(ctx.model, ctx.method, list(ctx.clients), ctx.identity))
    bar = tqdm(total=t.max_rounds, initial=ckpt["round"], desc=f"{ctx.identity['method']} s{ctx.seed}", unit="round")
    try:
        while not ckpt["stopped"] and ckpt["round"] < t.max_rounds:
            r = ckpt["round"]
            start = time.perf_counter()
            row = train_round(ctx, ckpt, r)
            val = close_round(ckpt, ctx.cfg, r, row, validate_members(ctx, ckpt["members"]), start, ctx.checkpoint)
            bar.update()
            bar.set_postfix(val_f1=f"{val:.3f}", best=f"{ckpt['best']['metric']:.3f}")
            if ctx.stop_after_round is not None and ckpt["round"] >= ctx.stop_after_round and not ckpt["stopped"]:
                raise KeyboardInterrupt(f"stopped after round {ckpt['round']} (simulated kill)")
    finally:
        bar.close()
    return ckpt
