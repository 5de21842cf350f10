"""The package's domain block, computed at export from the pipeline's own runs and images, site by site, as
the sites would compute and send it (:mod:`fedhisto.export.domain_stats` says what travels and why).

Per member, every site embeds its optimisation images (at most ``MAX_PER_CLASS`` per class, a seeded sample)
and its holdout images with the package's default descriptor; its sums make the member's statistics
(``members/<name>/domain.safetensors``), its holdout images are scored against them, and the member-mean
scores are the calibration set. The descriptor block holds the training sites' descriptors and the
size-calibrated limits, from the images each site's stain descriptor was estimated on.
"""

from __future__ import annotations

import csv
import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from fedhisto import CLASSES
from fedhisto.data.splits import load_split
from fedhisto.export.domain_stats import (
    DESCRIPTOR_DRAWS,
    FALSE_FLAG_RATE,
    MAX_PER_CLASS,
    SEED,
    conformal_threshold,
    descriptor_limits,
    descriptor_reference,
    embedding_statistics,
    leave_one_site_out,
    mahalanobis_scores,
    site_statistics,
)
from fedhisto.infra.progress import Progress

log = logging.getLogger(__name__)
DOMAIN_FILE = "domain.safetensors"


def site_rows(manifest_csv: str | Path) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """Per client: its optimisation rows (at most ``MAX_PER_CLASS`` per class, seeded) and its holdout rows."""
    opt, hold = defaultdict(list), defaultdict(list)
    with Path(manifest_csv).open() as fh:
        for r in csv.DictReader(fh):
            if r["client"] and r["split"] == "optimisation":
                opt[r["client"]].append(r)
            elif r["client"] and r["split"] == "holdout":
                hold[r["client"]].append(r)
    if not opt:
        raise ValueError(f"{manifest_csv}: no client optimisation images; not the manifest of a trained run")
    capped = {}
    for k, client in enumerate(sorted(opt)):
        chosen = []
        for c, cls in enumerate(CLASSES):
            rows = sorted((r for r in opt[client] if r["label"] == cls), key=lambda r: r["sample_id"])
            rng = np.random.default_rng(np.random.SeedSequence([SEED, k, c]))
            chosen += [rows[i] for i in sorted(rng.permutation(len(rows))[:MAX_PER_CLASS])]
        capped[client] = chosen
    return capped, dict(hold)


def embedding_block(model, members: dict[str, dict[str, torch.Tensor]], manifest_csv: str | Path, cfg,
                    descriptor: torch.Tensor | None) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """``model`` on the device it computes on (``train.device``, as the predict stage places it)."""
    from fedhisto.train.inference import predict_with_embeddings

    device = next(model.parameters()).device
    opt_rows, hold_rows = site_rows(manifest_csv)
    opt = {c: load_split(rows, cfg.views.crop_size) for c, rows in opt_rows.items()}
    hold = {c: load_split(rows, cfg.views.crop_size) for c, rows in hold_rows.items() if rows}
    tensors, member_scores = {}, defaultdict(list)
    with Progress(len(members), "export: domain statistics", "model") as bar:
        for name, state in members.items():
            model.load_trainable_state(state)
            sites = [site_statistics(predict_with_embeddings(model, split, descriptor, cfg, device)[1].numpy(),
                                     np.array(split.labels), len(CLASSES)) for split in opt.values()]
            tensors[name] = embedding_statistics(sites)
            for client, split in hold.items():
                z = predict_with_embeddings(model, split, descriptor, cfg, device)[1].numpy()
                member_scores[client].append(mahalanobis_scores(z, tensors[name]))
            bar.update()
    scores = {c: np.mean(v, axis=0).tolist() for c, v in sorted(member_scores.items())}
    pooled = [s for v in scores.values() for s in v]
    block = {"representation": "the adapted embedding z (the classifier's input) with the package's default "
                               "descriptor; score: Mahalanobis distance to the nearest class mean, shared "
                               "OAS-shrunk covariance, mean over members",
             "file": DOMAIN_FILE, "max_per_class": MAX_PER_CLASS,
             "sites": {c: {"images": len(s), "per_class": s.class_counts()} for c, s in sorted(opt.items())},
             "calibration": {"scores": scores, "n": len(pooled),
                             "sites": {c: len(v) for c, v in scores.items()}},
             "default_rate": FALSE_FLAG_RATE,
             "default_threshold": conformal_threshold(pooled, FALSE_FLAG_RATE) if pooled else None,
             "leave_one_site_out": leave_one_site_out(scores, FALSE_FLAG_RATE)}
    return block, tensors


def descriptor_block(descriptors_doc: dict, manifest_csv: str | Path, stain_cfg) -> dict:
    from fedhisto.stain.stage import tissue_pixels

    with Path(manifest_csv).open() as fh:
        path_of = {r["sample_id"]: r["path"] for r in csv.DictReader(fh)}
    clients = descriptors_doc["clients"]
    reference = descriptor_reference({c: v["standardised"] for c, v in clients.items()})
    pixels = {c: [tissue_pixels(path_of[i], stain_cfg) for i in v.get("sample_ids", []) if i in path_of]
              for c, v in clients.items()}
    pixels = {c: p for c, p in pixels.items() if p}
    std = descriptors_doc["standardisation"]
    limits = (descriptor_limits(pixels, stain_cfg, np.asarray(std["mean"]), np.asarray(std["sd"]), reference)
              if pixels else None)
    return {"names": descriptors_doc["names"], "estimator": stain_cfg.model_dump(mode="json"),
            "standardisation": std, "reference": reference, "limits": limits,
            "limits_from": f"{DESCRIPTOR_DRAWS} resamples per site and folder size of each site's stain-sample "
                           "images, with replacement"}


def domain_block(model, members: dict[str, dict[str, torch.Tensor]], manifest_csv: str | Path, cfg,
                 descriptor: torch.Tensor | None, descriptors_doc: dict) -> tuple[dict, dict[str, dict]]:
    """(package.json's ``domain`` block, per member the tensors of ``domain.safetensors``)."""
    emb, tensors = embedding_block(model, members, manifest_csv, cfg, descriptor)
    block = {"embedding": emb, "descriptor": descriptor_block(descriptors_doc, manifest_csv, cfg.stain)}
    log.info("export: domain statistics from %d site(s); %d holdout image(s) calibrate the out-of-domain score",
             len(emb["sites"]), emb["calibration"]["n"])
    return block, tensors
