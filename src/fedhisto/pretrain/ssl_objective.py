"""Self-supervised pretraining of the tiny encoder on the clients' optimisation images
(``model.pretrain.objective: self_supervised``; issue 21, item 7).

The synthetic-supervised tiny encoder has never seen real tissue. This objective gives it real
features without labels and without touching any image a score is computed on: SimCLR (Chen et
al. 2020; NT-Xent loss over a 2-layer projection head) on two views of each image, each with its
own geometry and, unless ``stain_views`` is off, its own stain perturbation (the training views'
draws, seeded by pool seed, epoch and sample id). Images: the manifest rows whose ``split`` column
is ``optimisation`` (each client's own training images), never validation, test, holdout or
external. A manifest without that column is refused; the report records the manifest's digest,
the images used per client, how many of every other split were left out, a digest of the
sample ids used, and whether the run collapsed (its last loss back at chance; then also a warning).
"""

from __future__ import annotations

import csv
import hashlib
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedhisto.config.study import Config
from fedhisto.data.splits import load_split
from fedhisto.data.views import training_views
from fedhisto.model.encoder import FrozenEncoder

log = logging.getLogger(__name__)
ALLOWED_SPLIT = "optimisation"
COLLAPSE_FRACTION = 0.99  # last-epoch loss at >= 99 % of its chance value log(2 batch - 1): collapsed


class PretrainDataError(ValueError):
    """The manifest cannot give self-supervised pretraining its images (names the file and column)."""


def optimisation_rows(manifest_csv: str | Path) -> tuple[list[dict], dict]:
    """The manifest rows of the clients' optimisation images, and a record of what was used and left out."""
    path = Path(manifest_csv)
    with path.open() as fh:
        reader = csv.DictReader(fh)
        missing = {"sample_id", "path", "label", "split", "client"} - set(reader.fieldnames or [])
        if missing:
            raise PretrainDataError(f"{path}: no column {sorted(missing)}: self-supervised pretraining reads the "
                                    "split column to use the clients' optimisation images only")
        rows = list(reader)
    used = [r for r in rows if r["split"] == ALLOWED_SPLIT]
    if not used:
        raise PretrainDataError(f"{path}: no row with split '{ALLOWED_SPLIT}': nothing to pretrain on")
    unowned = [r["sample_id"] for r in used if not r["client"]]
    if unowned:
        raise PretrainDataError(f"{path}: optimisation row {unowned[0]} has no client ({len(unowned)} such rows)")
    ids = sorted(r["sample_id"] for r in used)
    record = {"manifest": str(path), "splits_used": [ALLOWED_SPLIT], "images": len(used),
              "per_client": dict(sorted(Counter(r["client"] for r in used).items())),
              "left_out": dict(sorted(Counter(r["split"] for r in rows if r["split"] != ALLOWED_SPLIT).items())),
              "sample_ids_sha256": hashlib.sha256("\n".join(ids).encode()).hexdigest()}
    return used, record


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss: each view's positive is the other view of its image, the other 2n - 2 views are negatives."""
    z = nn.functional.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.T / temperature
    n = len(z1)
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return nn.functional.cross_entropy(sim, target)


def ssl_views(rgb: np.ndarray, cfg: Config, epoch: int, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent training views (own geometry, own stain draw unless ``stain_views`` is off)."""
    pc = cfg.model.pretrain
    return tuple(training_views(rgb, cfg.views, pc.seed, 2 * epoch + k, sample_id, paired=False,
                                stain_single=pc.stain_views)[0] for k in (0, 1))  # type: ignore[return-value]


def pretrain_self_supervised(encoder: FrozenEncoder, cfg: Config, manifest_csv: str | Path) -> tuple[list[dict], dict]:
    """Train ``encoder`` in place; returns the per-epoch history and the record of the images used."""
    pc = cfg.model.pretrain
    rows, record = optimisation_rows(manifest_csv)
    split = load_split(rows, cfg.views.crop_size)
    if len(split) < 2:
        raise PretrainDataError(f"{manifest_csv}: {len(split)} optimisation image(s); SimCLR needs at least 2")
    hidden = encoder.dim
    head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, pc.projection_dim))
    params = [*encoder.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=pc.lr, weight_decay=1e-4)
    batch = min(pc.batch, len(split))
    steps_per_epoch = len(split) // batch  # full batches only: a last batch of one image has no negatives
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=pc.lr, total_steps=pc.epochs * steps_per_epoch,
                                                pct_start=0.15)
    history = []
    for epoch in range(pc.epochs):
        order = np.random.default_rng(np.random.SeedSequence([pc.seed, 2, epoch])).permutation(len(split))
        encoder.module.train()
        total = 0.0
        for step in range(steps_per_epoch):
            idx = order[step * batch:(step + 1) * batch]
            views = [ssl_views(split.images[i], cfg, epoch, split.ids[i]) for i in idx]
            z1 = head(encoder.embed(torch.stack([a for a, _ in views])))
            z2 = head(encoder.embed(torch.stack([b for _, b in views])))
            loss = nt_xent(z1, z2, pc.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
        history.append({"epoch": epoch + 1, "loss": total / steps_per_epoch,
                        "chance_loss": float(np.log(2 * batch - 1))})
        log.info("self-supervised pretrain epoch %d: %s", epoch + 1, history[-1])
    # a loss back at its chance value means every view embeds alike (seen at lr 2e-3 on real images)
    record["collapsed"] = bool(history[-1]["loss"] >= COLLAPSE_FRACTION * history[-1]["chance_loss"])
    if record["collapsed"]:
        log.warning("CAVEAT: self-supervised pretraining collapsed (last loss %.3f, chance %.3f): the encoder embeds "
                    "every view alike; lower model.pretrain.lr (3e-4 learnt where 2e-3 collapsed, "
                    "docs/encoders.md)", history[-1]["loss"], history[-1]["chance_loss"])
    return history, record
