"""Stage ``predict``: each validation-selected checkpoint once on global test, client holdouts
(with that client's stain descriptor) and the external cohort (centroid descriptor).

``results/predictions/{method}/seed{seed}/{test,holdout,external}.csv``: one row per image with
stable sample id, true label, the three class probabilities, predicted label and metadata.
A checkpoint whose dataset identity differs from the manifest's is refused; a run that failed
validation of its report still predicts when its checkpoint tensors are usable (the study's
FedProx seed 44 case), and says so in ``status``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from fedhisto import CLASSES
from fedhisto.atomic import write_csv
from fedhisto.config import Config
from fedhisto.provenance import provenance_block, write_sidecar
from fedhisto.train.client import predict
from fedhisto.train.data import load_partitions
from fedhisto.train.stage import build_model, descriptors_for, pick_device

STAGE = "predict"
COHORTS = ("test", "holdout", "external")
COLUMNS = ("sample_id", "label", *(f"p_{c}" for c in CLASSES), "pred", "cohort", "client", "differentiation",
           "magnification", "run_status")


class PredictionRefused(RuntimeError):
    pass


def load_eligible_checkpoint(train_dir: Path, dataset_identity: str) -> tuple[dict, str]:
    path = train_dir / "checkpoint.pt"
    if not path.exists():
        raise PredictionRefused(f"{path}: no checkpoint")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt["identity"]["dataset_identity"] != dataset_identity:
        raise PredictionRefused(f"{path}: dataset identity {ckpt['identity']['dataset_identity'][:12]} differs from "
                                f"the manifest's {dataset_identity[:12]}; retrain on this manifest")
    if not all(torch.isfinite(t).all() for t in ckpt["best"]["state"].values()):
        raise PredictionRefused(f"{path}: best state has non-finite tensors; not usable for inference")
    status = json.loads((train_dir / "status.json").read_text())["status"]
    return ckpt, status


def run_predict(method: str, seed: int, train_dir: str | Path, manifest_csv: str | Path, manifest_json: str | Path,
                descriptors_json: str | Path, cfg: Config, out_dir: str | Path, encoder_dir: str | None = None,
                threads: int = 1) -> dict:
    torch.set_num_threads(max(threads, 1))
    train_dir, out = Path(train_dir), Path(out_dir)
    identity = json.loads(Path(manifest_json).read_text())["dataset_identity"]
    ckpt, status = load_eligible_checkpoint(train_dir, identity)
    device = pick_device()
    model = build_model(cfg, method, seed, encoder_dir).to(device)
    model.load_trainable_state(ckpt["best"]["state"])
    with Path(manifest_csv).open() as fh:
        meta = {r["sample_id"]: r for r in csv.DictReader(fh)}
    # inference never touches the optimisation images: do not decode them
    parts = load_partitions(manifest_csv, cfg.views.crop_size, splits=("holdout", "test", "external"))
    clients = sorted({k.split(":")[0] for k in parts if k.endswith(":holdout")})
    desc = descriptors_for(method, descriptors_json, clients)
    groups = {"test": [("test", "global")], "external": [("external", "global")],
              "holdout": [(f"{c}:holdout", c) for c in clients]}
    prov = provenance_block(STAGE, {"method": method, "seed": seed, "views": cfg.views.model_dump(mode="json")},
                            {"checkpoint": train_dir / "checkpoint.pt", "manifest": manifest_csv,
                             "descriptors": descriptors_json})
    counts = {}
    for cohort, keys in groups.items():
        rows = []
        for key, who in keys:
            split = parts[key]
            probs = predict(model, split, desc[who], cfg, device).numpy()
            for sid, y, p in zip(split.ids, split.labels, probs, strict=True):
                m = meta[sid]
                rows.append({"sample_id": sid, "label": CLASSES[y], **{f"p_{c}": f"{v:.8f}" for c, v in zip(CLASSES, p, strict=True)},
                             "pred": CLASSES[int(p.argmax())], "cohort": cohort, "client": m["client"],
                             "differentiation": m["differentiation"], "magnification": m["magnification"],
                             "run_status": status})
        write_csv(out / f"{cohort}.csv", rows, COLUMNS)
        write_sidecar(out / f"{cohort}.csv", prov)
        counts[cohort] = len(rows)
    return {"status": status, "images": counts}
