"""``results/train/{method}/seed{seed}/``: checkpoint, history, report or failure record.

- ``checkpoint.pt``: member states (adapters, FiLM, head) and the method's server state only (latest
  and best), progress, history, identity and RNG states; rewritten atomically after every round and
  resumed only when its identity equals the run's (method, seed, training settings, dataset,
  descriptors, encoder). It is deliberately not a Snakemake output, so a killed job keeps it;
- ``history.csv``: per round validation macro-F1, client weights, losses, unavailable clients, wall time;
- ``report.json`` (finalised) or ``failure.json`` (what failed, where; no score imputed); the report
  names the local optimiser, learning rate and schedule the participants trained with (``local_schedule``);
- ``status.json``: always written last, the Snakemake target.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
from pathlib import Path

import torch

from fedhisto import CLASSES
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.data.splits import load_partitions
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import config_hash, provenance_block, runtime_block
from fedhisto.methods import build_method
from fedhisto.methods.objective import Objective
from fedhisto.methods.strategy import Strategy
from fedhisto.model.build import build_model, descriptor_digest, encoder_digest, pick_device
from fedhisto.stats.prediction_files import PROB_COLUMNS
from fedhisto.train.inference import predict
from fedhisto.train.loop import (
    ClientFailure,
    ResumeRefused,
    TooManyUnavailable,
    load_checkpoint,
    run_rounds,
    unavailable_so_far,
)
from fedhisto.train.participants import InProcess, macro_f1

log = logging.getLogger(__name__)
STAGE = "train"


def run_identity(cfg: Config, method: Strategy, seed: int, dataset_identity: str, descriptors: dict,
                 encoder_dir: str | None) -> dict:
    return {"method": method.name, "seed": seed, "config_hash": config_hash(stage_block(cfg, STAGE, method=method.name,
                                                                                        seed=seed)),
            "dataset_identity": dataset_identity, "descriptor_digest": descriptor_digest(descriptors),
            "encoder_digest": encoder_digest(cfg, encoder_dir)}


def descriptors_for(method: Strategy, descriptors_json: str | Path, participants: list[str]) -> dict:
    doc = json.loads(Path(descriptors_json).read_text()) if method.film else None
    return method.descriptors(doc, participants)


def schedule_record(objective: Objective, rounds: int) -> dict:
    """What the participants' local steps were (``report.json``'s ``local_schedule``): the client objective's
    own ``LocalSchedule`` of round 1 (optimiser, learning rate, weight decay, epochs, batches, clipping), and
    the learning rate of every round run (a schedule may decay it from round to round)."""
    return {**dataclasses.asdict(objective.local_schedule(0)),
            "lr_by_round": [objective.local_schedule(r).lr for r in range(rounds)]}


def validate_outcome(ckpt: dict, metric: float) -> list[str]:
    problems = []
    for member, state in ckpt["best"]["members"].items():
        for name, tensor in state.items():
            if not torch.isfinite(tensor).all():
                problems.append(f"checkpoint tensor {member}/{name} is not finite")
    if not (0.0 <= metric <= 1.0) or math.isnan(metric):
        problems.append(f"validation macro-F1 {metric} outside [0, 1]")
    if not ckpt["history"]:
        problems.append("no completed round in the history")
    return problems


def _write_history(path: Path, history: list[dict]) -> None:
    rows = [{"round": h["round"], "val_macro_f1": f"{h['val_macro_f1']:.6f}", "best": h["best"],
             "weights": json.dumps(h["weights"]), "losses": json.dumps(h["losses"]),
             "unavailable_clients": json.dumps(h["unavailable_clients"]),
             "member_macro_f1": json.dumps(h["member_metrics"]), "wall_s": h["wall_s"]} for h in history]
    columns = ["round", "val_macro_f1", "best", "weights", "losses", "unavailable_clients", "member_macro_f1", "wall_s"]
    sites = sorted({s for h in history for s in h.get("privacy", {}).get("epsilon", {})})
    if sites:  # DP runs only: each site's epsilon at privacy.delta after the round, and their maximum
        for row, h in zip(rows, history, strict=True):
            eps = h["privacy"]["epsilon"]
            row.update(epsilon_max=f"{h['privacy']['epsilon_max']:.6f}", delta=h["privacy"]["delta"],
                       **{f"epsilon_{s}": f"{eps[s]:.6f}" for s in sites})
        columns += ["epsilon_max", "delta", *(f"epsilon_{s}" for s in sites)]
    write_csv(path, rows, columns)


def manifest_families(manifest_csv: str | Path) -> dict[str, str]:
    """Every image's clearance family (manifest column ``family``), for ``privacy.unit: family``."""
    with Path(manifest_csv).open() as fh:
        return {r["sample_id"]: r["family"] for r in csv.DictReader(fh) if r.get("family")}


def finalise_run(out: Path, ckpt: dict, summary: dict, ids: list[str], labels: list[int],
                 member_probs: dict[str, torch.Tensor], status_extra: dict) -> dict:
    """Validation predictions of the best member states, history, report or failure, then status.json
    (last: the Snakemake target). Shared by the in-process and the Flower engines."""
    rows, member_f1 = [], []
    for member, probs in member_probs.items():
        member_f1.append(macro_f1(probs, labels))
        tag = {"model": member} if len(member_probs) > 1 else {}
        rows += [{"sample_id": i, "label": CLASSES[y], **dict(zip(PROB_COLUMNS, (f"{v:.8f}" for v in p.tolist()),
                                                               strict=True)), **tag}
                 for i, y, p in zip(ids, labels, probs, strict=True)]
    metric = sum(member_f1) / len(member_f1)
    _write_history(out / "history.csv", ckpt["history"])
    write_csv(out / "validation_predictions.csv", rows)
    problems = validate_outcome(ckpt, metric)
    summary = {**summary, "rounds": ckpt["round"], "best_round": ckpt["best"]["round"],
               "early_stopped": ckpt["stopped"], "resumed_at_rounds": ckpt.get("resumed_at_rounds", []),
               "validation_macro_f1": metric, "unavailable_client_rounds": unavailable_so_far(ckpt),
               "unavailable": {h["round"]: h["unavailable_clients"] for h in ckpt["history"] if h["unavailable_clients"]}}
    if problems:
        write_json(out / "failure.json", {**summary, "failed": "validation of checkpoint/report", "problems": problems,
                                          "checkpoint_usable": all("tensor" not in p for p in problems)})
        status = "failed"
    else:
        write_json(out / "report.json", summary)
        status = "finalised"
    write_json(out / "status.json", {"status": status, "method": summary["method"], "seed": summary["seed"],
                                     **status_extra, "unavailable_client_rounds": summary["unavailable_client_rounds"],
                                     "provenance": summary["provenance"]})
    return summary


def _set_aside_foreign_checkpoint(path: Path, identity: dict) -> None:
    """A checkpoint of another configuration is never resumed; the pipeline keeps it aside and starts over."""
    try:
        load_checkpoint(path, identity)
    except ResumeRefused as exc:
        stale = path.with_name(f"checkpoint.refused-{os.getpid()}.pt")
        path.rename(stale)
        log.warning("%s; kept as %s, starting a fresh run", exc, stale.name)


def run_train(method: str, seed: int, manifest_csv: str | Path, manifest_json: str | Path,
              descriptors_json: str | Path, cfg: Config, out_dir: str | Path, encoder_dir: str | None = None,
              threads: int = 1, stop_after_round: int | None = None, after_round=None, **test_hooks) -> dict:
    """One run into ``out_dir``; ``after_round(ckpt)``: called after each round's checkpoint (an
    experiment recording what the checkpoint keeps only for the latest round, e.g. the aggregate's spectrum)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(threads, 1))
    device = pick_device(cfg)
    m = build_method(method, cfg)
    dataset_identity = json.loads(Path(manifest_json).read_text())["dataset_identity"]
    # training reads the clients' optimisation sets and the global validation set only: decoding the
    # holdouts, test and external images too cost every run ~1.5 s of CPU (1,300 of its 1,550 images)
    parts = load_partitions(manifest_csv, cfg.views.crop_size, splits=("optimisation", "validation"))
    clients = m.participants({k: parts[k] for k in sorted(parts) if ":" not in k and k.startswith("C")})
    descriptors = descriptors_for(m, descriptors_json, sorted(clients))
    identity = run_identity(cfg, m, seed, dataset_identity, descriptors, encoder_dir)
    model = build_model(cfg, m, seed, encoder_dir).to(device)
    _set_aside_foreign_checkpoint(out / "checkpoint.pt", identity)
    private = None
    if cfg.privacy.enabled:  # every site's plan is checked here, before any training (train.private)
        from fedhisto.train.private import PrivateSites

        families = manifest_families(manifest_csv) if cfg.privacy.unit == "family" else None
        private = PrivateSites.start(cfg, m.objective, clients, families, seed)
    participants = InProcess(model=model, method=m, clients=clients, validation=parts["validation"],
                             descriptors=descriptors, cfg=cfg, seed=seed, device=device,
                             batched=cfg.train.engine == "batched", private=private, **test_hooks)
    if cfg.secure_aggregation.enabled:  # the server step sees only quantised sums (train.secure_round)
        from fedhisto.train.secure_round import SecureInProcess

        participants = SecureInProcess(participants, seed)
    prov = provenance_block(STAGE, stage_block(cfg, STAGE, method=method, seed=seed),
                            {"manifest": manifest_csv, "descriptors": descriptors_json})
    summary = {"method": method, "seed": seed, "identity": identity, "runtime": runtime_block(device),
               "provenance": prov, "pid": os.getpid()}
    try:
        ckpt = run_rounds(m, participants, model, cfg, identity, out / "checkpoint.pt", after_round=after_round,
                          stop_after_round=stop_after_round)
    except (ClientFailure, TooManyUnavailable) as exc:
        failure = {"failed": type(exc).__name__, "error": str(exc), "client": getattr(exc, "client", None),
                   "round": getattr(exc, "round", None)}
        write_json(out / "failure.json", {**summary, **failure})
        if isinstance(exc, ClientFailure):
            raise  # a bug or a crash is never absorbed: the job fails and says where
        write_json(out / "status.json", {"status": "failed", "method": method, "seed": seed,
                                         "dataset_identity": dataset_identity, "provenance": prov})
        return {**summary, **failure}
    status_extra = {"dataset_identity": dataset_identity}
    summary["local_schedule"] = schedule_record(m.objective, ckpt["round"])
    if private is not None:
        private.stop_reason = private.stop_reason or ckpt.get("stop_reason")
        summary["privacy"] = private.summary()
        status_extra["privacy"] = {k: summary["privacy"][k] for k in ("epsilon_max", "delta", "stopped_by_budget")}
    best = ckpt["best"]["members"]  # evaluation uses the validation-selected states
    member_probs = {}
    for member, state in best.items():
        model.load_trainable_state(state)
        member_probs[member] = predict(model, parts["validation"], descriptors["global"], cfg, device)
    return finalise_run(out, ckpt, summary, parts["validation"].ids, parts["validation"].labels, member_probs,
                        status_extra)

