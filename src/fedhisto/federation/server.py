"""The server half of a federated run over messages: the engine's round, hook by hook, and its outputs.

``FederatedRun.round`` is ``train.loop.train_round`` with each client step replaced by a message
exchange (``Exchange.send``: one RecordDict per site out, the replies back): pre-round uploads
(``train.pre``, only for a method that has them), ``configure_train``, local training (``train``),
``client_weights`` + ``aggregate_train``, post-aggregation uploads and validation (``evaluate.post``).
``FederatedRun.run`` is ``train.loop.run_rounds``: early stopping on the validation macro-F1, the
best state kept apart, ``loop.save_checkpoint`` (atomic) after every round, resume from it, and the
``ClientUnavailable`` rules. ``finalise`` writes what ``train.stage.run_train`` writes, so
results/train/{method}/seed{seed}/ is the same whichever engine made it.

The server never opens an image: validation is computed by the *evaluation site* (run config
``eval-site``, default the first site), which holds the validation split and returns its macro-F1
(the same ``validate_members`` as the in-process engine) and, at the end, the validation
probabilities of the best state.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Protocol

import torch
from flwr.app import ConfigRecord, RecordDict

from fedhisto.atomic import write_json
from fedhisto.config import Config
from fedhisto.federation.records import get_value, payload_bytes, put_members, put_payload, state_record
from fedhisto.fedmath.aggregate import flat_update
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL, Method
from fedhisto.model.build import build_model, descriptor_digest
from fedhisto.provenance import provenance_block, runtime_block
from fedhisto.stage_config import stage_block
from fedhisto.train.loop import (
    ClientFailure,
    ClientUnavailable,
    TooManyUnavailable,
    close_round,
    fresh_checkpoint,
    start_or_resume,
)
from fedhisto.train.stage import STAGE, finalise_run, run_identity

log = logging.getLogger(__name__)


class Exchange(Protocol):
    def send(self, action: str, contents: dict[str, RecordDict], round_idx: int
             ) -> tuple[dict[str, RecordDict], dict[str, str]]:
        """Send one RecordDict per site; return (replies by site, unavailable sites with why)."""


def overrides(method: Method, hook: str) -> bool:
    return getattr(type(method), hook) is not getattr(Method, hook)


def has_pre_upload(method: Method) -> bool:
    return overrides(method, "upload_before_training")


def has_post_upload(method: Method) -> bool:
    # the PAST family overrides the hook for every row but uploads only with prototypes
    return overrides(method, "upload_after_aggregation") and getattr(method, "prototypes", "") != "none"


def check_federable(method: Method, sites: list[str]) -> None:
    if overrides(method, "participants") or method.members(sites) != [GLOBAL]:
        raise ValueError(f"method {method.name!r} is not a federated method with one global model "
                         "(local_only and pooled run only on the in-process engine)")


class FederatedRun:
    def __init__(self, cfg: Config, method_name: str, seed: int, sites: list[str], out_dir: str | Path,
                 dataset_identity: str, descriptors_json: str, encoder_dir: str | None = None,
                 eval_site: str | None = None, events: Path | None = None, pause_between_rounds: float = 0.0):
        self.cfg, self.seed, self.sites = cfg, seed, sorted(sites)
        self.method = build_method(method_name, cfg)
        check_federable(self.method, self.sites)
        self.eval_site = eval_site or self.sites[0]
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.descriptors_json = descriptors_json
        self.model = build_model(cfg, self.method, seed, encoder_dir)  # frozen encoder stays here; never sent
        doc = json.loads(Path(descriptors_json).read_text()) if self.method.film else None
        descriptors = self.method.descriptors(doc, self.sites)
        self.identity = run_identity(cfg, self.method, seed, dataset_identity, descriptors, encoder_dir)
        self.site_descriptors = {s: descriptors[s] for s in self.sites}
        self.cfg_json = cfg.model_dump_json()
        self.events, self.pause = events, pause_between_rounds
        self.checkpoint = self.out / "checkpoint.pt"
        self.after_round = None  # called after each round's checkpoint (the ServerApp dumps its open audit)

    # ------------------------------------------------------------------ messages
    def _run_record(self, site: str, round_idx: int, **extra) -> ConfigRecord:
        return ConfigRecord({"method": self.method.name, "seed": self.seed, "config": self.cfg_json,
                             "round": round_idx, "site": site, "k": self.sites.index(site), **extra})

    def _event(self, **row) -> None:
        if self.events is not None:
            with self.events.open("a") as fh:
                fh.write(json.dumps({"t": time.time(), **row}) + "\n")

    def _exchange(self, ex: Exchange, action: str, contents: dict[str, RecordDict], r: int,
                  traffic: dict) -> tuple[dict[str, RecordDict], dict[str, str]]:
        self._event(event="send", action=action, round=r + 1, sites=sorted(contents))
        t0 = time.perf_counter()
        replies, unavailable = ex.send(action, contents, r)
        traffic[action] = {"s": round(time.perf_counter() - t0, 3),
                           "down_bytes": sum(payload_bytes(rd) for rd in contents.values()),
                           "up_bytes": sum(payload_bytes(rd) for rd in replies.values())}
        ok = {}
        for site, rd in replies.items():
            if "error" in rd:
                err = rd["error"]
                if err["type"] == "ClientUnavailable":
                    unavailable[site] = str(err["message"])
                    continue
                raise ClientFailure(site, r, RuntimeError(f"{err['type']}: {err['message']}\n{err['traceback']}"))
            ok[site] = rd
        self._event(event="received", action=action, round=r + 1, ok=sorted(ok), unavailable=unavailable)
        return ok, unavailable

    def _check_identity(self, site: str, rd: RecordDict, r: int) -> None:
        got = get_value(rd, "descriptor")
        want = self.site_descriptors[site]
        if descriptor_digest({site: got}) != descriptor_digest({site: want}):
            raise ClientFailure(site, r, RuntimeError("its stain descriptor differs from the run's descriptors"))
        digest = str(rd["identity"]["encoder-digest"])
        if digest != self.identity["encoder_digest"]:
            raise ClientFailure(site, r, RuntimeError(f"its encoder digest {digest[:12]} differs from the run's "
                                                      f"{self.identity['encoder_digest'][:12]}"))

    # ------------------------------------------------------------------ one round
    def round(self, ex: Exchange, ckpt: dict, r: int) -> dict:
        method, names, members = self.method, self.sites, ckpt["members"]
        unavailable: dict[str, str] = {}
        traffic: dict = {}
        if has_pre_upload(method):
            out = {}
            for n in names:
                rd = RecordDict({"run": self._run_record(n, r), "start": state_record(method.start_state(members, n))})
                out[n] = rd
            ok, unavailable = self._exchange(ex, "train.pre", out, r, traffic)
            uploads = {n: get_value(ok[n], "upload") for n in names if n in ok}
        else:
            uploads = dict.fromkeys(names)
        payloads = method.configure_train(r, ckpt["server_state"], uploads)
        out = {}
        for n in names:
            if n in unavailable:
                continue
            rd = RecordDict({"run": self._run_record(n, r), "start": state_record(method.start_state(members, n))})
            put_payload(rd, payloads[n])
            out[n] = rd
        ok, lost = self._exchange(ex, "train", out, r, traffic)
        for n, why in lost.items():
            log.warning("round %d: client %s unavailable: %s", r + 1, n, why)
        unavailable.update(lost)
        if not ok:
            raise TooManyUnavailable(f"round {r + 1}: no participant returned an update ({sorted(unavailable)})")
        for n in ok:
            self._check_identity(n, ok[n], r)
        returned = sorted(ok)
        states = {n: dict(ok[n]["state"].to_torch_state_dict()) for n in returned}
        counts = [int(ok[n]["metrics"]["num-examples"]) for n in returned]
        reference = {n: method.start_state(members, n) for n in returned}
        weights = method.client_weights(counts, [flat_update(states[n], reference[n]) for n in returned])
        members = {**members, **method.aggregate_train(states, weights, self.model)}
        # post-aggregation: uploads under the new model (prototypes) and, at the evaluation site, validation
        upload = has_post_upload(method)
        targets = sorted(set(returned if upload else []) | {self.eval_site})
        out = {}
        for n in targets:
            rd = RecordDict({"run": self._run_record(n, r, upload=upload and n in returned,
                                                     validate=n == self.eval_site, member=GLOBAL)})
            put_members(rd, {GLOBAL: method.start_state(members, n)} if n != self.eval_site else members)
            out[n] = rd
        ok_post, lost_post = self._exchange(ex, "evaluate.post", out, r, traffic)
        if self.eval_site not in ok_post:
            raise ClientUnavailable(f"round {r + 1}: the evaluation site {self.eval_site} did not validate "
                                    f"({lost_post.get(self.eval_site, 'no reply')}); resume when it is back")
        after = {n: get_value(ok_post[n], "upload") for n in returned if n in ok_post and upload}
        for n in returned:
            if upload and n not in ok_post:  # trained, then lost before its upload: its round counts as unavailable
                unavailable[n] = f"unavailable after aggregation: {lost_post.get(n, 'no reply')}"
        server_state = method.aggregate_uploads(after) if any(v is not None for v in after.values()) else None
        ckpt.update(members=members, server_state=server_state)
        member_metrics = {k: float(v) for k, v in ok_post[self.eval_site]["validation"].items()}
        return {"weights": dict(zip(returned, weights, strict=True)), "unavailable_clients": unavailable,
                "losses": {n: dict(ok[n]["losses"]) for n in returned}, "member_metrics": member_metrics,
                "engine": "flower", "phases": traffic}

    # ------------------------------------------------------------------ the run
    def run(self, ex: Exchange) -> dict:
        t = self.cfg.train
        ckpt = start_or_resume(self.checkpoint, self.identity,
                               lambda: fresh_checkpoint(self.model, self.method, self.sites, self.identity))
        self._event(event="start", round=ckpt["round"])
        while not ckpt["stopped"] and ckpt["round"] < t.max_rounds:
            r = ckpt["round"]
            start = time.perf_counter()
            row = self.round(ex, ckpt, r)
            member_metrics = row.pop("member_metrics")
            val = close_round(ckpt, self.cfg, r, row, member_metrics, start, self.checkpoint)
            if self.after_round is not None:
                self.after_round()
            self._event(event="checkpoint", round=r + 1, val=val, unavailable=sorted(row["unavailable_clients"]))
            if self.pause and ckpt["round"] < t.max_rounds and not ckpt["stopped"]:
                time.sleep(self.pause)  # a window between rounds (tests restart the SuperLink in it)
        return ckpt

    # ------------------------------------------------------------------ outputs
    def summary(self) -> dict:
        prov = provenance_block(STAGE, stage_block(self.cfg, STAGE, method=self.method.name, seed=self.seed),
                                {"descriptors": self.descriptors_json})
        return {"method": self.method.name, "seed": self.seed, "identity": self.identity,
                "runtime": runtime_block(torch.device("cpu")), "provenance": prov, "engine": "flower",
                "sites": self.sites, "evaluation_site": self.eval_site}

    def _status(self, status: str) -> None:
        s = self.summary()
        write_json(self.out / "status.json", {"status": status, "method": self.method.name, "seed": self.seed,
                                              "dataset_identity": self.identity["dataset_identity"],
                                              "provenance": s["provenance"], "engine": "flower"})

    def fail(self, exc: BaseException) -> None:
        write_json(self.out / "failure.json", {**self.summary(), "failed": type(exc).__name__, "error": str(exc),
                                               "client": getattr(exc, "client", None),
                                               "round": getattr(exc, "round", None)})
        if isinstance(exc, TooManyUnavailable):
            self._status("failed")

    def finalise(self, ex: Exchange, ckpt: dict) -> dict:
        """Validation predictions of the best state (from the evaluation site), history, report, status."""
        best = ckpt["best"]["members"]
        rd = RecordDict({"run": self._run_record(self.eval_site, ckpt["round"])})
        put_members(rd, best)
        ok, lost = self._exchange(ex, "evaluate.predict", {self.eval_site: rd}, ckpt["round"], {})
        if self.eval_site not in ok:
            raise ClientUnavailable(f"the evaluation site {self.eval_site} did not predict: {lost}")
        reply = ok[self.eval_site]
        ids, labels = list(reply["samples"]["ids"]), [int(y) for y in reply["samples"]["labels"]]
        probs = {member: get_value(reply, f"probs:{member}") for member in best}
        return finalise_run(self.out, ckpt, self.summary(), ids, labels, probs,
                            {"dataset_identity": self.identity["dataset_identity"], "engine": "flower"})


