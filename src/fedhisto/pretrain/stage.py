"""Stage ``pretrain``: give the tiny encoder meaningful frozen features.

A frozen encoder is only meaningful if its features are. HIBOU-B brings them from pathology
pretraining; the CPU-sized tiny encoder of the embedded default gets them here, supervised on a
synthetic pool rendered from its own seed stream (disjoint from every client, validation, test
and external image) with only the five client sites' stains, each image seen through the
training views' stain perturbation (geometry-only views when ``stain_views`` is off: the dose-response
experiment's plain encoder). The external site's stain is never shown. The encoder is
then saved with ``save_pretrained`` and loaded through the same strict loader as HIBOU-B.

``objective: self_supervised`` replaces the synthetic pool by the clients' own optimisation
images and the class labels by SimCLR (:mod:`fedhisto.pretrain.ssl_objective`), for real cohorts. Either
way the report lists the run's caveats (:mod:`fedhisto.caveats`), also logged as warnings.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedhisto import CLASSES
from fedhisto.caveats import log_caveats
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.data.views import training_views
from fedhisto.infra.atomic import write_json
from fedhisto.infra.provenance import provenance_block, runtime_block
from fedhisto.model.build import set_determinism
from fedhisto.model.encoder import random_encoder
from fedhisto.synth.stain_styles import SITE_STYLES, render_rgb
from fedhisto.synth.tissue import tissue

log = logging.getLogger(__name__)
STAGE = "pretrain"
CLIENT_SITES = [s for s in SITE_STYLES if s != "external"]


def render_pool(cfg: Config) -> tuple[list[np.ndarray], list[int]]:
    pc = cfg.model.pretrain
    size = cfg.cohort.synthetic.image_size
    images, labels = [], []
    for c, cls in enumerate(CLASSES):
        for k in range(pc.images_per_class):
            rng = np.random.default_rng(np.random.SeedSequence([pc.seed, 99, c, k]))  # own stream: no overlap
            site = CLIENT_SITES[int(rng.integers(len(CLIENT_SITES)))]
            diff = str(rng.choice(["", "well", "moderately", "poorly"])) if cls != "Normal" else ""
            h, e = tissue(cls, rng, size, size / 128 * float(rng.choice([1.0, 1.3])), diff)
            images.append(render_rgb(h, e, SITE_STYLES[site].jittered(rng), rng, size / 128))
            labels.append(c)
    return images, labels


def pretrain_view(image: np.ndarray, cfg: Config, epoch: int, index: int) -> torch.Tensor:
    """One pretraining view of pool image ``index``: stain-perturbed unless ``stain_views`` is off (the
    dose-response experiment's plain encoder, which must see the pool's stains as rendered)."""
    pc = cfg.model.pretrain
    return training_views(image, cfg.views, pc.seed, epoch, f"{index:x}", paired=False,
                          stain_single=pc.stain_views)[0]


def run_pretrain(cfg: Config, out_dir: str | Path, threads: int = 1, manifest_csv: str | Path | None = None) -> dict:
    """``manifest_csv``: the manifest whose optimisation images ``objective: self_supervised`` trains on."""
    torch.set_num_threads(max(threads, 1))
    set_determinism()
    caveats = log_caveats(cfg, log)
    pc = cfg.model.pretrain
    torch.manual_seed(pc.seed)
    if pc.objective == "self_supervised":
        return _run_self_supervised(cfg, out_dir, manifest_csv, caveats)
    images, labels = render_pool(cfg)
    encoder = random_encoder(cfg.model.encoder.name)
    head = nn.Linear(encoder.dim, len(CLASSES))
    params = [*encoder.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=pc.lr, weight_decay=1e-4)
    steps = pc.epochs * -(-len(images) // pc.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=pc.lr, total_steps=steps, pct_start=0.15)
    y_all = torch.tensor(labels)
    history = []
    for epoch in range(pc.epochs):
        order = np.random.default_rng(np.random.SeedSequence([pc.seed, 1, epoch])).permutation(len(images))
        correct, total_loss = 0, 0.0
        encoder.module.train()
        for start in range(0, len(order), pc.batch):
            idx = order[start:start + pc.batch]
            x = torch.stack([pretrain_view(images[i], cfg, epoch, i) for i in idx])
            logits = head(encoder.embed(x))
            loss = nn.functional.cross_entropy(logits, y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total_loss += float(loss.detach()) * len(idx)
            correct += int((logits.argmax(1) == y_all[idx]).sum())
        history.append({"epoch": epoch + 1, "loss": total_loss / len(order), "train_accuracy": correct / len(order)})
        log.info("pretrain epoch %d: %s", epoch + 1, history[-1])
    out = Path(out_dir)
    encoder.module.eval()
    encoder.save(out)
    report = {"pool_images": len(images), "sites": CLIENT_SITES, "history": history, "caveats": caveats,
              "provenance": provenance_block(STAGE, stage_block(cfg, STAGE)),
              "runtime": runtime_block(torch.device("cpu"))}
    write_json(out / "pretrain_report.json", report)
    return report


def _run_self_supervised(cfg: Config, out_dir: str | Path, manifest_csv: str | Path | None, caveats: list[str]) -> dict:
    from fedhisto.pretrain.ssl_objective import PretrainDataError, pretrain_self_supervised

    if manifest_csv is None:
        raise PretrainDataError("model.pretrain.objective self_supervised needs the manifest (its optimisation "
                                "images); the pretrain rule passes results/manifest/manifest.csv")
    encoder = random_encoder(cfg.model.encoder.name)
    history, record = pretrain_self_supervised(encoder, cfg, manifest_csv)
    out = Path(out_dir)
    encoder.module.eval()
    encoder.save(out)
    report = {"objective": "self_supervised", "self_supervised": record, "history": history, "caveats": caveats,
              "provenance": provenance_block(STAGE, stage_block(cfg, STAGE), {"manifest": manifest_csv}),
              "runtime": runtime_block(torch.device("cpu"))}
    write_json(out / "pretrain_report.json", report)
    return report
