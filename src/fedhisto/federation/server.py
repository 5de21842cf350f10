"""The server half of a federated run over messages: the one round driver with Flower participants.

``FlowerParticipants`` implements ``train.loop.Participants`` by message exchange (``Exchange.send``:
one RecordDict per site out, the replies back): pre-round uploads (``train.pre``, only for a method
that has them), local training (``train``), and post-aggregation uploads with validation
(``evaluate.post``). The rounds themselves (hook order, aggregation, early stopping, the best state
kept apart, the atomic checkpoint, resume, the ``ClientUnavailable`` rules) are ``train.loop``'s, the
same code the in-process engines run. ``finalise`` writes what ``train.stage.run_train`` writes, so
results/train/{method}/seed{seed}/ is the same whichever engine made it.

The server never opens an image: validation is computed by the *evaluation sites* (run config
``eval-site``, a comma list, default the first site), which hold the validation split (or parts of
it) and return per member the confusion matrix of their validation rows; the server's macro-F1 of
their sum is the in-process engine's number (``evaluation.macro_f1_from_confusion``). At the end they
return the validation probabilities of the best state. ``evaluate`` then scores the best state on the
test set, holdouts and the external cohort at the sites that hold them (``federation.evaluate``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Protocol

import torch
from flwr.app import ConfigRecord, RecordDict

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.federation.records import (
    get_value,
    payload_bytes,
    put_members,
    put_payload,
    record_state,
    state_record,
)
from fedhisto.federation.site import federated_config
from fedhisto.infra.atomic import write_json
from fedhisto.infra.code_identity import CodeMismatch, check_code
from fedhisto.infra.provenance import provenance_block, runtime_block
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL
from fedhisto.methods.strategy import Strategy
from fedhisto.model.build import build_model, descriptor_digest
from fedhisto.train.local import LocalResult
from fedhisto.train.loop import ClientFailure, ClientUnavailable, TooManyUnavailable, run_rounds
from fedhisto.train.optimizer_state import federation_refusal
from fedhisto.train.stage import STAGE, finalise_run, run_identity, schedule_record

log = logging.getLogger(__name__)


class Exchange(Protocol):
    def send(self, action: str, contents: dict[str, RecordDict], round_idx: int
             ) -> tuple[dict[str, RecordDict], dict[str, str]]:
        """Send one RecordDict per site; return (replies by site, unavailable sites with why)."""


def check_federable(method: Strategy, sites: list[str]) -> None:
    if method.cfg.privacy.enabled:  # the ledger and secret noise seed live in the in-process run's checkpoint
        raise ValueError("privacy.enabled: DP-SGD runs on the in-process sequential engine only; a Flower site "
                         "keeps no privacy ledger or secret noise seed between messages yet (docs/privacy.md)")
    if (why := federation_refusal(method.cfg)) is not None:  # kept AdamW state would have to live at the site
        raise ValueError(why)
    if type(method).participants is not Strategy.participants or method.members(sites) != [GLOBAL]:
        raise ValueError(f"method {method.name!r} is not a federated method with one global model "
                         "(a method with one model per site, such as local_only or fedsa_lora, and pooled run only on the "
                         "in-process engine)")
    if method.cfg.secure_aggregation.enabled:  # the method's own declaration (methods.secure_capability)
        decl = method.secure_aggregation()
        if not decl.runs:
            raise ValueError(f"method {method.name!r} cannot run under secure aggregation: {decl.refusal}")
        if len(sites) < max(2, decl.min_sites):
            raise ValueError(f"method {method.name!r} under secure aggregation needs at least {decl.min_sites} sites "
                             f"in a masked sum; the run has {len(sites)}")


class FederatedRun:
    def __init__(self, cfg: Config, method_name: str, seed: int, sites: list[str], out_dir: str | Path,
                 dataset_identity: str, descriptors_json: str, encoder_dir: str | None = None,
                 eval_site: str | list[str] | None = None, events: Path | None = None,
                 pause_between_rounds: float = 0.0):
        if cfg.train.engine != "sequential":  # each site trains alone: the sequential engine's math, and identity
            log.info("train.engine %s: the Flower engine trains each site on its own (sequential)", cfg.train.engine)
        cfg = federated_config(cfg)
        self.cfg, self.seed, self.sites = cfg, seed, sorted(sites)
        self.method = build_method(method_name, cfg)
        check_federable(self.method, self.sites)
        names = eval_site.split(",") if isinstance(eval_site, str) else (eval_site or [])
        self.eval_sites = sorted({n.strip() for n in names if n.strip()}) or [self.sites[0]]
        self.eval_site = self.eval_sites[0]  # the first; kept for callers that name one
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
        self.secure_timeout = 120.0  # seconds a SecAgg+ stage waits for the sites (run config secure-timeout)
        self.after_round = None  # called after each round's checkpoint (the ServerApp dumps its open audit)

    # ------------------------------------------------------------------ messages
    def _run_record(self, site: str, round_idx: int, **extra) -> ConfigRecord:
        k = self.sites.index(site) if site in self.sites else -1  # an evaluation-only site has no RNG stream
        return ConfigRecord({"method": self.method.name, "seed": self.seed, "config": self.cfg_json,
                             "round": round_idx, "site": site, "k": k, **extra})

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
                           "up_bytes": sum(payload_bytes(rd) for rd in replies.values()),
                           # per site: seconds in the handler, and (with a worker) the forwarding round trip
                           "sites": {s: dict(rd["info"]) for s, rd in sorted(replies.items()) if "info" in rd}}
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
        if self.cfg.secure_aggregation.enabled:  # the audit of what the coordinator received in the clear
            self._event(event="clear", action=action, round=r + 1,
                        records={s: sorted(rd.keys()) for s, rd in sorted(ok.items())})
        return ok, unavailable

    def identity_mismatch(self, site: str, rd: RecordDict) -> str | None:
        """Why a site's reply does not belong to this run (its descriptor or encoder), or None."""
        got = get_value(rd, "descriptor")
        want = self.site_descriptors[site]
        if descriptor_digest({site: got}) != descriptor_digest({site: want}):
            return f"site {site}: its stain descriptor differs from the run's descriptors"
        digest = str(rd["identity"]["encoder-digest"])
        if digest != self.identity["encoder_digest"]:
            return f"site {site}: its encoder digest {digest[:12]} differs from the run's {self.identity['encoder_digest'][:12]}"
        return None

    # ------------------------------------------------------------------ the run
    def run(self, ex: Exchange) -> dict:
        """The rounds (``train.loop.run_rounds``) with this run's sites reached over ``ex`` (under
        ``secure_aggregation.enabled``: ``secure_server.SecureFlowerParticipants``, masked sums only)."""
        t = self.cfg.train
        parts = FlowerParticipants(self, ex)
        if self.cfg.secure_aggregation.enabled:
            from fedhisto.federation.secure_server import SecureFlowerParticipants

            parts = SecureFlowerParticipants(parts)
        self._event(event="start")

        def after_round(ckpt: dict) -> None:
            if self.after_round is not None:
                self.after_round()
            last = ckpt["history"][-1]
            self._event(event="checkpoint", round=ckpt["round"], val=last["val_macro_f1"],
                        unavailable=sorted(last["unavailable_clients"]))
            if self.pause and ckpt["round"] < t.max_rounds and not ckpt["stopped"]:
                time.sleep(self.pause)  # a window between rounds (tests restart the SuperLink in it)

        return run_rounds(self.method, parts, self.model, self.cfg, self.identity, self.checkpoint, after_round)

    # ------------------------------------------------------------------ outputs
    def summary(self) -> dict:
        prov = provenance_block(STAGE, stage_block(self.cfg, STAGE, method=self.method.name, seed=self.seed),
                                {"descriptors": self.descriptors_json})
        return {"method": self.method.name, "seed": self.seed, "identity": self.identity,
                "runtime": runtime_block(torch.device("cpu")), "provenance": prov, "engine": "flower",
                "sites": self.sites, "evaluation_site": self.eval_site, "evaluation_sites": self.eval_sites}

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
        """Validation predictions of the best state (from the evaluation sites), history, report, status."""
        best = ckpt["best"]["members"]
        contents = {}
        for site in self.eval_sites:
            rd = RecordDict({"run": self._run_record(site, ckpt["round"])})
            put_members(rd, best)
            contents[site] = rd
        ok, lost = self._exchange(ex, "evaluate.predict", contents, ckpt["round"], {})
        missing = {s: lost.get(s, "no reply") for s in self.eval_sites if s not in ok}
        if missing:
            raise ClientUnavailable(f"the evaluation site(s) did not predict: {missing}")
        ids, labels, probs = [], [], {member: [] for member in best}
        for site in self.eval_sites:
            reply = ok[site]
            ids += list(reply["samples"]["ids"])
            labels += [int(y) for y in reply["samples"]["labels"]]
            for member in best:
                probs[member].append(get_value(reply, f"probs:{member}"))
        order = sorted(range(len(ids)), key=ids.__getitem__)  # one validation split, in sample-id order
        if len(set(ids)) != len(ids):
            raise ClientFailure(",".join(self.eval_sites), ckpt["round"],
                                RuntimeError("the evaluation sites' validation rows overlap (same sample id twice)"))
        stacked = {m: torch.cat(ps)[order] for m, ps in probs.items()}
        summary = {**self.summary(), "local_schedule": schedule_record(self.method.objective, ckpt["round"])}
        return finalise_run(self.out, ckpt, summary, [ids[i] for i in order], [labels[i] for i in order],
                            stacked, {"dataset_identity": self.identity["dataset_identity"], "engine": "flower"})

    def evaluate(self, ex: Exchange, ckpt: dict, targets: list, out_dir: str | Path) -> dict:
        """Federated evaluation of the best state at the sites holding ``targets`` (``federation.evaluate``)
        into ``out_dir`` (results/predictions/{method}/seed{seed})."""
        from fedhisto.federation import evaluate as fe

        status = json.loads((self.out / "status.json").read_text())["status"]
        temperatures = {}
        if self.cfg.evaluate.temperature_scaling:
            from fedhisto.predict.stage import member_temperatures

            temperatures = member_temperatures(self.out, list(ckpt["best"]["members"]))
        self._event(event="send", action="evaluate.split", round=ckpt["round"], sites=sorted({t.site for t in targets}))
        replies = fe.evaluate_sites(self, ex, ckpt, targets, temperatures)
        prov = provenance_block("predict", stage_block(self.cfg, "predict", method=self.method.name, seed=self.seed),
                                {"checkpoint": self.checkpoint})
        prov.update(engine="flower", evaluated_at=sorted({t.site for t in targets}))
        if temperatures:
            prov["temperatures"] = temperatures
        summary = fe.write_predictions(out_dir, replies, targets, status, prov, self.cfg.evaluate.ece_bins)
        self._event(event="evaluated", cohorts={c: v["basis"] for c, v in summary.items()})
        return summary


class FlowerParticipants:
    """``train.loop.Participants`` over Flower messages to the run's sites."""

    def __init__(self, run: FederatedRun, ex: Exchange) -> None:
        self.run, self.ex = run, ex
        self.names = run.sites
        self.traffic: dict = {}

    def _start(self, n: str, r: int, state: dict[str, torch.Tensor], **extra) -> RecordDict:
        return RecordDict({"run": self.run._run_record(n, r, **extra), "start": state_record(state)})

    def pre_upload(self, r, starts):
        ok, lost = self.run._exchange(self.ex, "train.pre", {n: self._start(n, r, s) for n, s in starts.items()}, r,
                                      self.traffic)
        return {n: get_value(rd, "upload") for n, rd in ok.items()}, lost

    def train(self, r, starts, payloads):
        ok, lost = self._train(r, starts, payloads)
        return {n: LocalResult(record_state(rd["state"]), int(rd["metrics"]["num-examples"]),
                               dict(rd["losses"]), int(rd["metrics"]["steps"])) for n, rd in ok.items()}, lost

    def _train(self, r, starts, payloads) -> tuple[dict[str, RecordDict], dict[str, str]]:
        """Send ``train``; the replies of the sites on this run's code, descriptor and encoder."""
        out = {}
        for n, state in starts.items():
            out[n] = self._start(n, r, state)
            put_payload(out[n], payloads[n])
        ok, lost = self.run._exchange(self.ex, "train", out, r, self.traffic)
        for n in list(ok):
            try:  # a site on other code is refused by name; its update is not used, the others' are
                check_code(f"site {n}", dict(ok[n]["code"]) if "code" in ok[n] else None)
            except CodeMismatch as exc:
                log.warning("round %d: %s", r + 1, exc)
                lost[n] = f"refused: {exc}"
                del ok[n]
        for n in list(ok):  # a site on another descriptor or encoder: refused by name, the others go on
            why = self.run.identity_mismatch(n, ok[n])
            if why:
                log.warning("round %d: %s", r + 1, why)
                lost[n] = f"refused: {why}"
                del ok[n]
        return ok, lost

    def post(self, r, members, uploaders, upload_of=None):
        """One ``evaluate.post`` per uploader (its start state under the new members) and to each evaluation
        site (every member, and the validation flag); every evaluation site must answer. Uploaders that
        are also evaluation sites do both in one message. ``upload_of``: what an uploader's reply gives
        (default: its upload; under secure aggregation the layout of the terms it kept)."""
        from fedhisto.federation.evaluate import validation_from_counts

        eval_sites = self.run.eval_sites
        out = {}
        for n in sorted({*uploaders, *eval_sites}):
            rd = RecordDict({"run": self.run._run_record(n, r, upload=n in uploaders, validate=n in eval_sites,
                                                         member=GLOBAL)})
            put_members(rd, members if n in eval_sites else {GLOBAL: self.run.method.start_state(members, n)})
            out[n] = rd
        ok, lost = self.run._exchange(self.ex, "evaluate.post", out, r, self.traffic)
        missing = {n: lost.get(n, "no reply") for n in eval_sites if n not in ok}
        if missing:
            raise ClientUnavailable(f"round {r + 1}: evaluation site(s) did not validate ({missing}); "
                                    "resume when they are back")
        upload_of = upload_of or (lambda reply: get_value(reply, "upload"))
        after = {n: upload_of(ok[n]) for n in uploaders if n in ok}
        metrics = validation_from_counts({n: ok[n] for n in eval_sites})
        return after, {n: why for n, why in lost.items() if n in uploaders}, metrics

    def row_extra(self) -> dict:
        traffic, self.traffic = self.traffic, {}
        return {"engine": "flower", "phases": traffic}
