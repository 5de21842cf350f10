"""``fedhisto export``: one method's finalised seeds (its ensemble) as a self-contained model package.

Reads what the pipeline wrote (``results/train/{method}/seed{seed}/``, ``results/predictions``, the stain
descriptors, the manifest's dataset identity) and writes the package of :mod:`fedhisto.export.package`.
The checkpoints are the pipeline's own (read with ``predict.load_eligible_checkpoint``, which refuses a
checkpoint of another dataset); the package holds no pickle.

Calibration: one temperature for the ensemble, fitted (``calibration.fit_temperature``) on the
ensemble's probabilities on the global validation set, the split that selected every member's
checkpoint, from each run's ``validation_predictions.csv``; never on test or external images.

Domain: the statistics ``classify``'s domain check reads (:mod:`fedhisto.export.domain_export`), computed
site by site from the manifest's training-site images; the model card names the data
(:func:`fedhisto.export.model_card.data_card`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import torch

from fedhisto import CLASSES
from fedhisto.config.study import Config
from fedhisto.export.model_card import card_json, card_markdown, cohort_metrics, data_card
from fedhisto.export.package import (
    FORMAT,
    PEFT_PREFIX,
    PackageError,
    adapter_config,
    split_state,
    write_package,
)
from fedhisto.infra.code_identity import code_identity
from fedhisto.infra.provenance import digest_path
from fedhisto.registries.encoder_registry import encoder_entry
from fedhisto.stats.prediction_files import ensemble
from fedhisto.stats.temperature import fit_temperature

log = logging.getLogger(__name__)
STAGE = "export"
#: where a classification without --descriptor conditions FiLM, and why (documented in docs/getting-started.md)
DEFAULT_DESCRIPTOR = "centroid"


def finalised_seeds(method: str, cfg: Config, train_root: Path) -> list[int]:
    seeds, skipped = [], []
    for s in cfg.trained_seeds(method):
        status = train_root / method / f"seed{s}" / "status.json"
        if not status.exists():
            raise PackageError(f"{status}: missing; run the pipeline (snakemake --cores 2 all) before exporting")
        (seeds if json.loads(status.read_text())["status"] == "finalised" else skipped).append(s)
    if skipped:
        log.info("export %s: seed(s) %s not finalised, left out of the ensemble", method, skipped)
    if not seeds:
        raise PackageError(f"{method}: no finalised seed under {train_root / method}; nothing to export")
    return seeds


def encoder_block(cfg: Config, encoder_dir: str | None) -> tuple[dict, Path | None]:
    """The encoder as the package names it, and the folder to include (an encoder no hub holds)."""
    enc = cfg.model.encoder
    entry = encoder_entry(enc.name)
    block = {"name": enc.name, "architecture": entry.architecture, "hub_id": entry.hub_id,
             "repo_id": enc.repo_id if entry.hub_id else None, "revision": enc.revision if entry.hub_id else None}
    folder = encoder_dir or enc.local_dir
    if entry.hub_id is not None:
        block["folder_digest"] = digest_path(folder) if folder else None
        return block, None
    if folder:
        return block, Path(folder)
    # a randomly initialised encoder (require_pretrained: false): save the exact module the runs built
    from fedhisto.model.encoder import load_encoder

    torch.manual_seed(0)  # as build_model: the random encoder every run of this config used
    tmp = Path(tempfile.mkdtemp(prefix="fedhisto-encoder-"))
    load_encoder(enc, None).save(tmp)
    block["random_initialisation"] = "torch.manual_seed(0), as fedhisto.model.build.build_model"
    return block, tmp


def run_export(method: str, cfg: Config, out: str | Path, train_root: str | Path = "results/train",
               predictions_root: str | Path = "results/predictions",
               descriptors_json: str | Path = "results/stain/descriptors.json",
               manifest_json: str | Path = "results/manifest/manifest.json", encoder_dir: str | None = None,
               overwrite: bool = False, manifest_csv: str | Path | None = None) -> dict:
    """``manifest_csv``: the manifest the runs were built from (default: ``manifest.csv`` beside
    ``manifest_json``), for the domain statistics' images and the model card's data."""
    from fedhisto.export.domain_export import domain_block
    from fedhisto.methods import build_method
    from fedhisto.model.build import build_model, pick_device
    from fedhisto.predict.stage import load_eligible_checkpoint
    from fedhisto.train.stage import descriptors_for

    train_root, predictions_root = Path(train_root), Path(predictions_root)
    manifest_csv = Path(manifest_csv) if manifest_csv else Path(manifest_json).with_name("manifest.csv")
    if not manifest_csv.exists():
        raise PackageError(f"{manifest_csv}: missing; the package's domain statistics and model card read the "
                           "manifest the runs were built from")
    m = build_method(method, cfg)
    identity = json.loads(Path(manifest_json).read_text())["dataset_identity"]
    seeds = finalised_seeds(method, cfg, train_root)
    members, member_meta = {}, []
    for s in seeds:
        ckpt, status = load_eligible_checkpoint(train_root / method / f"seed{s}", identity)
        best = ckpt["best"]["members"]
        if len(best) != 1:
            raise PackageError(f"{method} keeps {len(best)} models per run ({sorted(best)}); only a single-model "
                               "method exports as one ensemble")
        members[f"seed{s}"] = next(iter(best.values()))
        member_meta.append({"name": f"seed{s}", "seed": s, "status": status, "identity": ckpt["identity"],
                            "best_round": ckpt["best"]["round"]})
    log.info("export %s: %d member(s) %s", method, len(seeds), [f"seed{s}" for s in seeds])

    # one temperature for the ensemble, fitted on the global validation set
    _, val_y, val_p = ensemble([train_root / method / f"seed{s}" / "validation_predictions.csv" for s in seeds])
    temperature = fit_temperature(val_p, val_y)
    log.info("export %s: temperature %.4f fitted on %d global validation images", method, temperature, len(val_y))

    desc = descriptors_for(m, descriptors_json, [])["global"]
    doc = json.loads(Path(descriptors_json).read_text()) if m.film else None
    kind = "none" if not m.film else ("zero" if bool(getattr(m, "zero_descriptor", False)) else "stain")
    descriptor = {"kind": kind, "default": DEFAULT_DESCRIPTOR if kind == "stain" else kind,
                  "centroid": None if desc is None else [float(x) for x in desc.tolist()]}
    if doc is not None and kind == "stain":
        descriptor.update(names=doc["names"], standardisation=doc["standardisation"],
                          centroid_raw=doc["centroid"]["raw"], training_clients=sorted(doc["clients"]),
                          estimator=cfg.stain.model_dump(mode="json"))

    # the domain statistics: every member's embeddings of the training sites' images, with the default descriptor
    model = build_model(cfg, m, seeds[0], encoder_dir).to(pick_device(cfg))
    stain_doc = json.loads(Path(descriptors_json).read_text())
    domain, domain_tensors = domain_block(model, members, manifest_csv, cfg,
                                          None if desc is None else torch.as_tensor(desc, dtype=torch.float32),
                                          stain_doc)
    del model

    enc, include = encoder_block(cfg, encoder_dir)
    lora, _ = split_state(members[f"seed{seeds[0]}"])
    targets = sorted({k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in lora})
    model_block = cfg.model.model_dump(mode="json")
    lora_cfg = adapter_config(model_block, targets, enc["repo_id"] or enc["name"])

    meta = {
        "format": FORMAT, "classes": list(CLASSES),
        "method": {"name": method, "film": m.film, "film_bound": cfg.model.film_bound},
        "model": model_block, "encoder": enc,
        "normalisation": {"mean": list(cfg.views.mean), "std": list(cfg.views.std), "crop_size": cfg.views.crop_size,
                          "decode_max_edge": 2 * cfg.views.crop_size,
                          "transform": "decode to RGB; shrink (INTER_AREA) to decode_max_edge; resize (INTER_LINEAR) "
                                       "to crop_size; /255; (x - mean) / std"},
        "views": cfg.views.model_dump(mode="json"), "eval_batch": cfg.evaluate.eval_batch,
        "descriptor": descriptor,
        "temperature": {"value": temperature, "fitted_on": "the global validation set (pooled internal validation "
                        f"images, n={len(val_y)}), ensemble probabilities, by NLL (fedhisto.stats.temperature)",
                        "n": len(val_y)},
        "members": member_meta,
        "domain": domain,
        "dataset_identity": identity,
        "code": code_identity(),
    }
    resamples, bseed, conf = cfg.bootstrap.resamples, cfg.bootstrap.seed, cfg.bootstrap.confidence
    metrics = {}
    for cohort, label in (("test", "internal (global test)"), ("external", "external cohort")):
        files = [predictions_root / method / f"seed{s}" / f"{cohort}.csv" for s in seeds]
        if all(f.exists() for f in files):
            metrics[label] = cohort_metrics(files, resamples, bseed, conf, cfg.evaluate.ece_bins)
        else:
            log.warning("export %s: no %s predictions under %s; the model card omits them", method, cohort,
                        predictions_root)
    data = data_card(manifest_csv, cfg, enc, stain_doc)
    meta["data"] = data
    card = card_json(meta, metrics, data)
    try:
        write_package(Path(out), meta, members, lora_cfg, (card_markdown(card), card), include, overwrite,
                      domain_tensors)
    finally:
        if include is not None and enc.get("random_initialisation"):
            import shutil

            shutil.rmtree(include, ignore_errors=True)
    log.info("export %s: package written to %s", method, out)
    return {"out": str(out), "members": [x["name"] for x in member_meta], "temperature": temperature,
            "metrics": {k: float(np.round(v["macro_f1"], 6)) for k, v in metrics.items()},
            "demonstration": data["demonstration"],
            "domain": {"calibration_images": domain["embedding"]["calibration"]["n"],
                       "threshold": domain["embedding"]["default_threshold"]}}
