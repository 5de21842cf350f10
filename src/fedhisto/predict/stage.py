"""Stage ``predict``: each validation-selected checkpoint once on global test, client holdouts
(with that client's stain descriptor) and the external cohort (centroid descriptor).

``results/predictions/{method}/seed{seed}/{test,holdout,external}.csv`` in the format of
:mod:`fedhisto.stats.prediction_files` (one row per image and model), and ``embeddings.safetensors``
(:mod:`fedhisto.stats.embedding_files`): the global test images' adapted embeddings from the same forward
pass, and the frozen encoder's (one extra encoder pass per job, before any member state is loaded), which
the metrics stage's site-robustness measures read.
A checkpoint whose dataset identity differs from the manifest's is refused; a run that failed
validation of its report still predicts when its checkpoint tensors are usable (the study's
FedProx seed 44 case), and says so in ``status``.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import torch

from fedhisto import CLASSES
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.data.splits import load_partitions
from fedhisto.infra.provenance import provenance_block, runtime_block, write_sidecar
from fedhisto.methods import build_method
from fedhisto.methods.strategy import Strategy
from fedhisto.model.build import build_model, pick_device
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.stats.embedding_files import EMBEDDINGS_FILE, write_embeddings
from fedhisto.stats.prediction_files import MEMBER_COLUMN, read_predictions, write_predictions
from fedhisto.stats.temperature import apply_temperature, fit_temperature
from fedhisto.train.checkpoint import ResumeRefused, read_checkpoint
from fedhisto.train.inference import frozen_embeddings, predict_with_embeddings
from fedhisto.train.stage import descriptors_for

STAGE = "predict"
log = logging.getLogger(__name__)
COHORTS = ("test", "holdout", "external")


class PredictionRefused(RuntimeError):
    pass


def load_eligible_checkpoint(train_dir: Path, dataset_identity: str) -> tuple[dict, str]:
    path = train_dir / "checkpoint.pt"
    if not path.exists():
        raise PredictionRefused(f"{path}: no checkpoint")
    try:  # plain data only: a swapped file with code in it is refused, never unpickled
        ckpt = read_checkpoint(path)
    except ResumeRefused as exc:
        raise PredictionRefused(str(exc)) from None
    if ckpt["identity"]["dataset_identity"] != dataset_identity:
        raise PredictionRefused(f"{path}: dataset identity {ckpt['identity']['dataset_identity'][:12]} differs from "
                                f"the manifest's {dataset_identity[:12]}; retrain on this manifest")
    if not all(torch.isfinite(t).all() for state in ckpt["best"]["members"].values() for t in state.values()):
        raise PredictionRefused(f"{path}: best state has non-finite tensors; not usable for inference")
    status = json.loads((train_dir / "status.json").read_text())["status"]
    return ckpt, status


def load_run(method: str, seed: int, train_dir: Path, manifest_json: str | Path, cfg: Config,
             encoder_dir: str | None) -> tuple[Strategy, FedHistoModel, dict, str, torch.device]:
    """The run's method, its model on the device, the best state of each member, and the run status."""
    identity = json.loads(Path(manifest_json).read_text())["dataset_identity"]
    ckpt, status = load_eligible_checkpoint(train_dir, identity)
    device = pick_device(cfg)
    m = build_method(method, cfg)
    model = build_model(cfg, m, seed, encoder_dir).to(device)
    return m, model, ckpt["best"]["members"], status, device


def member_temperatures(train_dir: Path, members: list[str]) -> dict[str, float]:
    """``evaluate.temperature_scaling``: one temperature per model, fitted on its own validation
    predictions (the split that selected its checkpoint), never on what it is then applied to."""
    path = train_dir / "validation_predictions.csv"
    if not path.exists():
        raise PredictionRefused(f"{path}: missing; temperature scaling is fitted on the run's validation predictions")
    val = read_predictions(path)
    missing = [m for m in members if m not in val and not (len(val) == 1 and len(members) == 1)]
    if missing:
        raise PredictionRefused(f"{path}: no validation predictions of model(s) {missing}")
    out = {}
    for m in members:
        _, y, probs = val[m] if m in val else next(iter(val.values()))
        out[m] = fit_temperature(probs, y)
    return out


def run_predict(method: str, seed: int, train_dir: str | Path, manifest_csv: str | Path, manifest_json: str | Path,
                descriptors_json: str | Path, cfg: Config, out_dir: str | Path, encoder_dir: str | None = None,
                threads: int = 1) -> dict:
    """Predict one run (``method``, ``seed``) into ``out_dir``."""
    return run_predict_seeds(method, [(seed, train_dir, out_dir)], manifest_csv, manifest_json, descriptors_json,
                             cfg, encoder_dir, threads)[seed]


def run_predict_seeds(method: str, runs: list[tuple[int, str | Path, str | Path]], manifest_csv: str | Path,
                      manifest_json: str | Path, descriptors_json: str | Path, cfg: Config,
                      encoder_dir: str | None = None, threads: int = 1) -> dict[int, dict]:
    """Predict every ``(seed, train_dir, out_dir)`` of one method in this process.

    The evaluation images are decoded once for all seeds (one process start and one decode instead of one per
    seed); each seed's model is built and its files written exactly as a run of its own would."""
    torch.set_num_threads(max(threads, 1))
    with Path(manifest_csv).open() as fh:
        meta = {r["sample_id"]: r for r in csv.DictReader(fh)}
    # inference never touches the optimisation images: do not decode them
    parts = load_partitions(manifest_csv, cfg.views.crop_size, splits=("holdout", "test", "external"))
    results, frozen = {}, {}  # the frozen encoder's test embeddings: the same for every seed, computed once
    for seed, train_dir, out_dir in runs:
        results[seed] = _predict_run(method, seed, Path(train_dir), Path(out_dir), meta, parts, manifest_csv,
                                     manifest_json, descriptors_json, cfg, encoder_dir, frozen)
        log.info("predict %s seed %d: %s", method, seed,
                 ", ".join(f"{c} {n} rows" for c, n in results[seed]["images"].items()))
    return results


def _predict_run(method: str, seed: int, train_dir: Path, out: Path, meta: dict, parts: dict,
                 manifest_csv: str | Path, manifest_json: str | Path, descriptors_json: str | Path, cfg: Config,
                 encoder_dir: str | None, frozen: dict) -> dict:
    m, model, members, status, device = load_run(method, seed, train_dir, manifest_json, cfg, encoder_dir)
    if "test" not in frozen:  # the freshly built model, no member state loaded yet: LoRA off is the frozen encoder
        frozen["test"] = frozen_embeddings(model, parts["test"], cfg, device).numpy()
    clients = sorted({k.split(":")[0] for k in parts if k.endswith(":holdout")})
    desc = descriptors_for(m, descriptors_json, clients)
    groups = {"test": [("test", "global")], "external": [("external", "global")],
              "holdout": [(f"{c}:holdout", c) for c in clients]}
    prov = provenance_block(STAGE, stage_block(cfg, STAGE, method=method, seed=seed),
                            {"checkpoint": train_dir / "checkpoint.pt", "manifest": manifest_csv,
                             "descriptors": descriptors_json})
    prov["runtime"] = runtime_block(device)
    temperatures = member_temperatures(train_dir, list(members)) if cfg.evaluate.temperature_scaling else {}
    if temperatures:
        prov["temperatures"] = temperatures
    counts, adapted = {}, {}
    for cohort, keys in groups.items():
        rows = []
        for member, state in members.items():
            model.load_trainable_state(state)
            for key, who in keys:
                if cohort == "holdout" and m.own_holdout and member != who:
                    continue  # a personalised model is scored on its own site's holdout only
                split = parts[key]
                probs, z = predict_with_embeddings(model, split, desc.get(who, desc["global"]), cfg, device)
                probs = probs.numpy()
                if cohort == "test":
                    adapted[member] = z.numpy()
                if temperatures:
                    probs = apply_temperature(probs, temperatures[member])
                for sid, y, p in zip(split.ids, split.labels, probs, strict=True):
                    info = meta[sid]
                    rows.append({"sample_id": sid, "label": CLASSES[y],
                                 **{f"p_{c}": f"{v:.8f}" for c, v in zip(CLASSES, p, strict=True)},
                                 "pred": CLASSES[int(p.argmax())], "cohort": cohort, "client": info["client"],
                                 "differentiation": info["differentiation"], "magnification": info["magnification"],
                                 "run_status": status, MEMBER_COLUMN: member})
        write_predictions(out / f"{cohort}.csv", rows)
        write_sidecar(out / f"{cohort}.csv", prov)
        counts[cohort] = len(rows)
    write_embeddings(out / EMBEDDINGS_FILE, parts["test"].ids, "test", adapted, frozen["test"])
    write_sidecar(out / EMBEDDINGS_FILE, prov)
    return {"status": status, "images": counts}
