"""The participants of an in-process run, reached one after the other or in one batched pass.

Both implement ``train.loop.Participants``; the Flower implementation is ``federation.server``. A
participant's step that raises ``ClientUnavailable`` (or is injected to, in tests) is reported as
unavailable; anything else becomes a ``ClientFailure`` naming the participant and round.

Under ``train.readings.optimizer_state: kept`` the participants also hold each client's AdamW state
between rounds (``train.optimizer_state``): it goes into the run's checkpoint with the DP ledgers
(``state`` / ``restore``), never to the server; a client that is unavailable keeps its state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fedhisto.config.study import Config
from fedhisto.data.splits import Split
from fedhisto.methods.base import GLOBAL, named_rng
from fedhisto.methods.strategy import Strategy
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.stats.scores import macro_f1 as macro_f1_of
from fedhisto.train.inference import predict
from fedhisto.train.local import LocalResult, local_train
from fedhisto.train.loop import ClientFailure, ClientUnavailable, State
from fedhisto.train.optimizer_state import OptimizerState, keeps_state

log = logging.getLogger(__name__)


def macro_f1(probs: torch.Tensor, labels: list[int]) -> float:
    return macro_f1_of(labels, probs.argmax(1).cpu().numpy())  # the package's one macro-F1 (fedhisto.stats.scores)


def validate_members(model: FedHistoModel, validation: Split, descriptor: torch.Tensor | None, cfg: Config,
                     device: torch.device, members: dict[str, State]) -> dict[str, float]:
    """Global-validation macro-F1 of every member state (the centroid descriptor for FiLM)."""
    out = {}
    for name, state in members.items():
        model.load_trainable_state(state)
        out[name] = macro_f1(predict(model, validation, descriptor, cfg, device), validation.labels)
    return out


@dataclass
class InProcess:
    """Every participant's data and the one model in this process. ``batched``: every available
    participant's local epochs in one encoder pass (``train.batched``)."""

    model: FedHistoModel
    method: Strategy                               # the server half; its client half is method.objective
    clients: dict[str, Split]                      # participants of a round (method.participants)
    validation: Split
    descriptors: dict[str, torch.Tensor | None]    # per participant, and "global" for validation/test/external
    cfg: Config
    seed: int
    device: torch.device
    batched: bool = False
    client_fault: dict = field(default_factory=dict)  # for tests: {round index: client} declared unavailable
    client_error: dict = field(default_factory=dict)  # for tests: {round index: client} raises a plain error
    private: Any = None  # train.private.PrivateSites under privacy.enabled: DP-SGD instead of local_train
    optimizer_states: dict[str, OptimizerState] = field(default_factory=dict)  # kept reading: per client

    def state(self) -> dict | None:
        """For the checkpoint: the sites' privacy ledgers and secret seeds (DP), and each client's kept
        optimiser state (``optimizer_state: kept``); None when neither is kept (the default)."""
        out = dict(self.private.state()) if self.private is not None else {}
        if keeps_state(self.cfg):
            out["optimizer"] = {n: self.optimizer_states[n] for n in sorted(self.optimizer_states)}
        return out or None

    def restore(self, saved: dict | None) -> None:
        if self.private is not None:
            self.private.restore(saved)
        if keeps_state(self.cfg) and saved is not None:
            if "optimizer" not in saved:
                raise ValueError("train.readings.optimizer_state is kept but the checkpoint holds no client "
                                 "optimiser state; delete it to start over")
            unknown = sorted(set(saved["optimizer"]) - set(self.clients))
            if unknown:
                raise ValueError(f"checkpoint optimiser state of {unknown} names no participant of this run "
                                 f"({self.names})")
            self.optimizer_states = dict(saved["optimizer"])

    def _kept(self, name: str) -> OptimizerState | None:
        return self.optimizer_states.get(name) if keeps_state(self.cfg) else None

    def _keep(self, results: dict[str, LocalResult]) -> dict[str, LocalResult]:
        """Each trained client keeps the state its optimiser ended in (clients that did not train keep theirs)."""
        if keeps_state(self.cfg):
            for n, res in results.items():
                self.optimizer_states[n] = res.optimizer_state
        return results

    @property
    def names(self) -> list[str]:
        return sorted(self.clients)

    def _step(self, name: str, r: int, fn, inject: bool = True):
        """One participant's step; a declared unavailability passes through, anything else names it."""
        try:
            if inject and self.client_fault.get(r) == name:
                raise ClientUnavailable(f"injected unavailability of {name} in round {r + 1}")
            if inject and self.client_error.get(r) == name:
                raise RuntimeError(f"injected error in {name}, round {r + 1}")
            return fn()
        except ClientUnavailable:
            raise
        except Exception as exc:
            raise ClientFailure(name, r, exc) from exc

    def _each(self, r: int, names, fn, inject: bool = True) -> tuple[dict[str, Any], dict[str, str]]:
        got, lost = {}, {}
        for name in names:
            try:
                got[name] = self._step(name, r, lambda name=name: fn(name), inject)
            except ClientUnavailable as exc:
                lost[name] = str(exc)
        return got, lost

    def pre_upload(self, r, starts):
        k = {n: self.names.index(n) for n in starts}
        return self._each(r, starts, lambda n: self.method.objective.upload_before_training(
            self.model, starts[n], self.clients[n], named_rng("style_sample", self.seed, r, k[n]), self.device),
            inject=False)

    def train(self, r, starts, payloads):
        k = {n: self.names.index(n) for n in starts}
        if self.private is not None:  # sequential only (privacy.support refuses the batched engine)
            self.private.before_round(r, list(starts))
            got, lost = self._each(r, starts, lambda n: self.private.local_train(
                n, self.model, starts[n], self.descriptors[n], payloads[n], r, k[n], self.device, self._kept(n)))
            return self._keep(got), lost
        if not self.batched:
            got, lost = self._each(r, starts, lambda n: local_train(
                self.method.objective, self.model, starts[n], self.clients[n], self.descriptors[n], payloads[n], self.cfg,
                self.seed, r, k[n], self.device, self._kept(n)))
            return self._keep(got), lost
        from fedhisto.train.batched import batched_local_train
        from fedhisto.train.plan import MemberJob

        ready, lost = self._each(r, starts, lambda n: None)  # injected faults resolve per participant first
        order = [n for n in starts if n in ready]
        if not order:
            return {}, lost
        jobs = [MemberJob(starts[n], self.clients[n], self.descriptors[n], payloads[n], self.seed, r, k[n],
                          self._kept(n)) for n in order]
        out = self._step(",".join(order), r, lambda: batched_local_train(self.method.objective, self.model, jobs, self.cfg,
                                                                         self.device), inject=False)
        return self._keep(dict(zip(order, out, strict=True))), lost

    def post(self, r, members, uploaders):
        def upload(n: str):
            self.model.load_trainable_state(self.method.start_state(members, n))
            if self.private is not None:  # the prototype upload through the Gaussian mechanism
                return self.private.upload_prototypes(n, self.model, self.descriptors[n], r, self.device)
            return self.method.objective.upload_after_aggregation(self.model, self.clients[n], self.descriptors[n],
                                                                  self.device)

        after, lost = self._each(r, uploaders, upload, inject=False)
        metrics = validate_members(self.model, self.validation, self.descriptors[GLOBAL], self.cfg, self.device,
                                   members)
        return after, lost, metrics

    def row_extra(self) -> dict:
        return self.private.row() if self.private is not None else {}


__all__ = ["InProcess", "LocalResult", "macro_f1", "validate_members"]
