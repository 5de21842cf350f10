"""The one round driver: hook order, aggregation, early stopping, best state, checkpoints and the
unavailability rules, whoever the participants are and however they are reached.

Round t, in the order of the method's strategy hooks (``methods.base``): participants upload what the server
needs to configure the round (a method's pre-round statistics), the server sends each its start state and
payload, each trains, the server weights what came back and aggregates (``aggregate_train``, which
may also update the method's server state: control variates, a server optimiser's moments), then
(prototype methods) participants upload under the new model and the server folds that into its
state (``aggregate_uploads``). The global-validation macro-F1 (the mean over members for a method
that keeps one model per client) decides early stopping; the best member states and server state are
kept apart from the latest.

*How* participants are reached is a ``Participants`` object (``train.participants``): in-process one
after the other, in-process batched in one encoder pass, or over Flower messages
(``federation.server``). The driver never knows which.

Failures are counted, never absorbed: only a declared unavailability (``ClientUnavailable``: a site
that cannot be reached or whose data cannot be read) is tolerated, recorded per round and bounded by
``train.max_unavailable_client_rounds``; any other error stops the run as a ``ClientFailure`` that
names the client and round.

Every random draw of round t derives from (seed, t, participant), so resuming from the checkpoint of
round t replays rounds t+1.. exactly: on one machine and build the resumed run is bitwise the
uninterrupted one. The checkpoint (``train.checkpoint``) is plain data read without unpickling code, and
a resumed run's states go back on the device the model is on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fedhisto.config.study import Config
from fedhisto.fedmath.aggregate import flat_update
from fedhisto.infra.progress import Progress
from fedhisto.methods.base import RoundUpdate
from fedhisto.methods.strategy import Strategy
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.checkpoint import (
    CHECKPOINT_FORMAT,
    IDENTITY_KEYS,
    ResumeRefused,
    load_checkpoint,
    save_checkpoint,
)
from fedhisto.train.local import LocalResult

State = dict[str, torch.Tensor]

log = logging.getLogger(__name__)
__all__ = ["CHECKPOINT_FORMAT", "IDENTITY_KEYS", "ResumeRefused", "load_checkpoint", "save_checkpoint"]


class ClientUnavailable(RuntimeError):
    """Declared unavailability: a site that cannot be reached or whose data cannot be read this round."""


class ClientFailure(RuntimeError):
    """Anything else that went wrong in a client's round: the run stops and says where."""

    def __init__(self, client: str, round_idx: int, error: BaseException) -> None:
        super().__init__(f"client {client} failed in round {round_idx + 1}: {type(error).__name__}: {error}")
        self.client, self.round, self.error = client, round_idx + 1, f"{type(error).__name__}: {error}"


class TooManyUnavailable(RuntimeError):
    """More tolerated client-rounds than ``train.max_unavailable_client_rounds`` allows."""


class RunStopped(RuntimeError):
    """The participants stop the run before a round (the privacy budget would be exceeded): the rounds so
    far stand, the checkpoint records why (``stop_reason``) and the run is finalised as stopped."""


def model_device(model: FedHistoModel) -> torch.device:
    """Where the run computes: the device of the model's trainable tensors."""
    params = list(model.parameters())
    return next((p for p in params if p.requires_grad), params[0]).device


def fresh_checkpoint(model: FedHistoModel, method: Strategy, participants: list[str], identity: dict) -> dict:
    state = model.trainable_state()
    members = {m: state for m in method.members(sorted(participants))}
    return {"format": CHECKPOINT_FORMAT, "identity": identity, "round": 0, "members": members,
            "server_state": None, "best": {"members": members, "server_state": None, "round": 0, "metric": -1.0},
            "bad_rounds": 0, "stopped": False, "history": []}


def start_or_resume(path: Path, identity: dict, fresh, device: torch.device | None = None) -> dict:
    """The checkpoint to continue from (its resume recorded; its states on ``device``), or ``fresh()``."""
    ckpt = load_checkpoint(path, identity, device)
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


class Participants(Protocol):
    """How the driver reaches the participants of a run. Each call returns what came back by name and
    the participants that were unavailable (name -> why); any other failure raises ``ClientFailure``."""

    names: list[str]

    def pre_upload(self, r: int, starts: dict[str, State]) -> tuple[dict[str, Any], dict[str, str]]:
        """Client ``upload_before_training`` of each named participant from its start state."""

    def train(self, r: int, starts: dict[str, State], payloads: dict[str, dict]
              ) -> tuple[dict[str, LocalResult], dict[str, str]]:
        """Local training of each named participant from its start state with its payload."""

    def post(self, r: int, members: dict[str, State], uploaders: list[str]
             ) -> tuple[dict[str, Any], dict[str, str], dict[str, float]]:
        """With the new member states: ``upload_after_aggregation`` of ``uploaders`` and the validation
        macro-F1 of every member. Returns (uploads, unavailable, member metrics)."""

    def row_extra(self) -> dict:
        """What this transport adds to the round's history row (e.g. message timings)."""


def run_round(method: Strategy, parts: Participants, ckpt: dict, r: int, model: FedHistoModel) -> tuple[dict, dict]:
    """One round; updates ``ckpt`` (members, server state) and returns (history row, member metrics)."""
    names, members = parts.names, ckpt["members"]
    unavailable: dict[str, str] = {}
    starts = {n: method.start_state(members, n) for n in names}  # each participant's start, this round
    if method.pre_uploads:
        uploads, lost = parts.pre_upload(r, starts)
        unavailable.update(lost)
    else:
        uploads = dict.fromkeys(names)
    payloads = method.configure_train(r, ckpt["server_state"], uploads)
    todo = [n for n in names if n not in unavailable]
    results, lost = parts.train(r, {n: starts[n] for n in todo}, {n: payloads[n] for n in todo})
    for n, why in lost.items():
        log.warning("round %d: client %s unavailable: %s", r + 1, n, why)
    unavailable.update(lost)
    if not results:
        raise TooManyUnavailable(f"round {r + 1}: no participant returned an update ({sorted(unavailable)})")
    returned = sorted(results)
    starts = {n: starts[n] for n in returned}
    weights = method.client_weights([results[n].n_samples for n in returned],
                                    [flat_update(results[n].state, starts[n]) for n in returned])
    update = RoundUpdate(r, {n: results[n].state for n in returned}, starts,
                         {n: results[n].n_samples for n in returned}, {n: results[n].steps for n in returned},
                         dict(zip(returned, weights, strict=True)), ckpt["server_state"])
    new_members, server_state = method.aggregate_train(update, model)
    members = {**members, **new_members}
    after, lost_post, member_metrics = parts.post(r, members, returned if method.post_uploads else [])
    for n, why in lost_post.items():  # trained, then lost before its upload: its round counts as unavailable
        unavailable[n] = f"unavailable after aggregation: {why}"
    if method.post_uploads:
        server_state = method.aggregate_uploads(after, server_state) if after else None
    ckpt.update(members=members, server_state=server_state)
    snapshot = getattr(parts, "state", None)  # participants' own state (DP ledgers), if they keep one
    kept = snapshot() if snapshot is not None else None
    if kept is not None:
        ckpt["participants"] = kept
    row = {"weights": update.weights, "unavailable_clients": unavailable,
           "losses": {n: results[n].losses for n in returned}, **parts.row_extra()}
    return row, member_metrics


def run_rounds(method: Strategy, parts: Participants, model: FedHistoModel, cfg: Config, identity: dict,
               checkpoint: Path, after_round: Callable[[dict], None] | None = None,
               stop_after_round: int | None = None) -> dict:
    """Rounds until early stopping or ``max_rounds``, resuming from ``checkpoint`` when its identity
    matches. ``after_round(ckpt)`` runs after each round's checkpoint; ``stop_after_round`` simulates a
    kill (tests)."""
    t = cfg.train
    ckpt = start_or_resume(checkpoint, identity, lambda: fresh_checkpoint(model, method, parts.names, identity),
                           model_device(model))
    restore = getattr(parts, "restore", None)
    if restore is not None:
        restore(ckpt.get("participants"))
    # the rule log gets close_round's one line per round; a terminal also gets a bar
    bar = Progress(t.max_rounds, f"{identity['method']} s{identity['seed']}", "round", initial=ckpt["round"],
                   logger=log, summary=False)
    # participants may bring their own round (secure aggregation: train.secure_round.run_secure_round)
    one_round = getattr(parts, "round_driver", run_round)
    try:
        while not ckpt["stopped"] and ckpt["round"] < t.max_rounds:
            r = ckpt["round"]
            start = time.perf_counter()
            try:
                row, member_metrics = one_round(method, parts, ckpt, r, model)
            except RunStopped as exc:
                log.warning("stopping before round %d: %s", r + 1, exc)
                ckpt.update(stopped=True, stop_reason=str(exc))
                save_checkpoint(checkpoint, ckpt)
                break
            val = close_round(ckpt, cfg, r, row, member_metrics, start, checkpoint)
            bar.update()
            bar.set_postfix(val_f1=f"{val:.3f}", best=f"{ckpt['best']['metric']:.3f}")
            if after_round is not None:
                after_round(ckpt)
            if stop_after_round is not None and ckpt["round"] >= stop_after_round and not ckpt["stopped"]:
                raise KeyboardInterrupt(f"stopped after round {ckpt['round']} (simulated kill)")
    finally:
        bar.close()
    return ckpt
