"""The audited federations of the privacy-audit experiment (:mod:`fedhisto.experiments.privacy_audit`):
one condition's federations trained with canaries, the coordinator's view of each audited site
recorded every round, and the canaries scored on it (imports torch: run by the condition's job only)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fedhisto.config.study import Config
from fedhisto.data.splits import Split, load_partitions
from fedhisto.data.views import eval_view
from fedhisto.experiments.privacy_audit import STAGE, privacy_audit_block, privacy_audit_config
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block
from fedhisto.methods import build_method
from fedhisto.model.build import build_model, pick_device
from fedhisto.privacy.attack import CanarySplit, loss_difference_scores, select_canaries
from fedhisto.privacy.audit import audit_summary
from fedhisto.stats.scores import macro_f1
from fedhisto.train.inference import predict
from fedhisto.train.loop import run_rounds
from fedhisto.train.participants import InProcess
from fedhisto.train.stage import descriptors_for, manifest_families, run_identity

log = logging.getLogger(__name__)


@dataclass
class Recording(InProcess):
    """The in-process participants, recording what the coordinator sees of each audited site every round."""

    audited: tuple[str, ...] = ()
    seen: dict[str, list[tuple[dict, dict]]] = field(default_factory=dict)   # site -> [(global start, returned)]

    def train(self, r, starts, payloads):
        results, lost = super().train(r, starts, payloads)
        for site in self.audited:
            if site in results:
                self.seen.setdefault(site, []).append(({k: v.clone() for k, v in starts[site].items()},
                                                       {k: v.clone() for k, v in results[site].state.items()}))
        return results, lost


def _eval_pixels(split: Split, ids: list[str], cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    where = {i: k for k, i in enumerate(split.ids)}
    return (torch.stack([eval_view(split.images[where[i]], cfg.views) for i in ids]),
            torch.tensor([split.labels[where[i]] for i in ids]))


def canary_splits(cfg: Config, parts: dict[str, Split], families: dict[str, str]) -> dict[str, CanarySplit]:
    """Each audited site's canaries, from a stream of (audit seed, 25, site index): the same in every condition."""
    a = cfg.experiments.privacy_audit
    return {site: select_canaries(parts[site].ids, families, a.canaries_per_side,
                                  np.random.default_rng([a.seed, 25, int(site[1:])])) for site in a.sites}


def audit_method(cfg: Config, condition: str, method_name: str, manifest_csv: str | Path, identity_json: str | Path,
                 descriptors_json: str | Path, out_dir: Path, encoder_dir: str | None = None) -> dict:
    """One (condition, method): train with every audited site's canary split, score the canaries of each site
    under that site's returned states, pool the sites' scores, measure utility."""
    a = cfg.experiments.privacy_audit
    c = privacy_audit_config(cfg, condition, method_name)
    device = pick_device(c)
    method = build_method(method_name, c)
    parts = load_partitions(manifest_csv, c.views.crop_size)
    families = manifest_families(manifest_csv)
    splits = canary_splits(cfg, parts, families)
    clients = {k: parts[k] for k in sorted(parts) if ":" not in k and k.startswith("C")}
    for site, split in splits.items():
        withheld = set(split.withheld)
        keep = [k for k, i in enumerate(parts[site].ids) if i not in withheld]
        clients[site] = Split([parts[site].ids[k] for k in keep], [parts[site].labels[k] for k in keep],
                              [parts[site].images[k] for k in keep])
    clients = method.participants(clients)
    descriptors = descriptors_for(method, descriptors_json, sorted(clients))
    dataset_identity = json.loads(Path(identity_json).read_text())["dataset_identity"]
    identity = run_identity(c, method, a.seed, f"{dataset_identity}+canaries", descriptors, encoder_dir)
    model = build_model(c, method, a.seed, encoder_dir).to(device)
    private = None
    if c.privacy.enabled:
        from fedhisto.train.private import PrivateSites

        private = PrivateSites.start(c, method.objective, clients, families, a.seed)
    recorder = Recording(model=model, method=method, clients=clients, validation=parts["validation"],
                         descriptors=descriptors, cfg=c, seed=a.seed, device=device, private=private,
                         audited=tuple(a.sites))
    work = out_dir / condition / method_name
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint.pt"
    checkpoint.unlink(missing_ok=True)  # the recorded updates live in memory: always a whole run
    ckpt = run_rounds(method, recorder, model, c, identity, checkpoint)
    checkpoint.unlink(missing_ok=True)

    rows, member, nonmember = [], [], []
    for site, split in splits.items():
        ids = [*split.members, *split.nonmembers]
        pixels, labels = _eval_pixels(parts[site], ids, c)
        desc = descriptors[site].to(device)[None] if descriptors[site] is not None else None
        scores = np.zeros(len(ids))
        for start, returned in recorder.seen.get(site, []):
            scores += loss_difference_scores(model, start, returned, pixels.to(device), labels.to(device), desc)
        member += list(scores[: len(split.members)])
        nonmember += list(scores[len(split.members):])
        rows += [{"site": site, "canary": i, "member": k < len(split.members), "score": float(v)}
                 for k, (i, v) in enumerate(zip(ids, scores, strict=True))]
    write_csv(work / "scores.csv", rows)
    stats = audit_summary(np.array(member), np.array(nonmember), delta=a.delta, resamples=cfg.experiments.resamples,
                          seed=cfg.experiments.bootstrap_seed)
    utility = {}
    model.load_trainable_state(ckpt["best"]["members"]["global"])
    for cohort in ("test", "external"):
        probs = predict(model, parts[cohort], descriptors["global"], c, device)
        utility[cohort] = macro_f1(parts[cohort].labels, probs.argmax(1).numpy())
    eps = private.epsilons() if private is not None else None
    return {"condition": condition, "method": method_name, "rounds": ckpt["round"], "audited_sites": list(a.sites),
            "noise_multiplier": c.privacy.noise_multiplier if c.privacy.enabled else 0.0,
            "epsilon": max(eps[s] for s in a.sites) if eps else None, "epsilon_per_site": eps,
            "delta": a.delta, "stopped_by_budget": private.stop_reason if private is not None else None,
            "internal_macro_f1": utility["test"], "external_macro_f1": utility["external"],
            "canaries": {s: {"members": sp.members, "nonmembers": sp.nonmembers, "withheld": len(sp.withheld)}
                         for s, sp in splits.items()},
            "attack": stats}


def run_condition(cfg: Config, condition: str, manifest_csv, identity_json, descriptors_json, out_json: str | Path,
                  encoder_dir: str | None = None, threads: int = 1) -> dict:
    """Every audited method under one condition; ``<condition>/audit.json``."""
    torch.set_num_threads(max(threads, 1))
    out = Path(out_json)
    results = [audit_method(cfg, condition, m, manifest_csv, identity_json, descriptors_json, out.parent.parent,
                            encoder_dir) for m in cfg.experiments.privacy_audit.methods]
    prov = provenance_block(STAGE, privacy_audit_block(cfg, condition), {"manifest": manifest_csv, "descriptors": descriptors_json})
    doc = {"condition": condition, "results": results, "provenance": prov}
    write_json(out, doc)
    return doc
