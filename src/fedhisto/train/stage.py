"""``results/train/{method}/seed{seed}/``: checkpoint, history, report or failure record.

- ``checkpoint.pt``: trainable tensors and prototypes only (latest and best), progress, history,
  identities and RNG states; rewritten atomically after every round, resumed when identities match;
- ``history.csv``: per round validation macro-F1, client weights, losses, failures, wall time;
- ``report.json`` (finalised) or ``failure.json`` (what failed, where; no score imputed);
- ``status.json``: always written last, the Snakemake target.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from pathlib import Path

import torch

from fedhisto import CLASSES
from fedhisto.atomic import write_json, write_with
from fedhisto.config import Config
from fedhisto.methods import method_spec
from fedhisto.model.encoder import load_encoder
from fedhisto.model.peft_model import DESCRIPTOR_DIM, FedHistoModel
from fedhisto.provenance import config_hash, provenance_block
from fedhisto.train.client import predict
from fedhisto.train.data import load_partitions
from fedhisto.train.loop import ResumeRefused, RunContext, load_checkpoint, macro_f1, run_rounds

log = logging.getLogger(__name__)
STAGE = "train"


def training_block(cfg: Config, method: str, seed: int) -> dict:
    """What a run's identity depends on (the lists of methods and seeds do not, nor FedStain's
    settings for the methods that do not exchange style statistics)."""
    train = cfg.train.model_dump(mode="json")
    for key in ("methods", "ablations", "seeds", "ablation_seeds"):
        train.pop(key)
    if not method_spec(method).style_exchange:
        train.pop("fedstain")
    return {"method": method, "seed": seed, "train": train, "model": cfg.model.model_dump(mode="json"),
            "views": cfg.views.model_dump(mode="json")}


def pick_device() -> torch.device:
    """From the environment (CUDA_VISIBLE_DEVICES as SLURM sets it); never assumes cuda:0 exists."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def descriptors_for(method: str, descriptors_json: str | Path, clients: list[str]) -> dict:
    spec = method_spec(method)
    if not spec.film:
        return dict.fromkeys([*clients, "global"])
    if spec.zero_descriptor:
        return {k: torch.zeros(DESCRIPTOR_DIM) for k in [*clients, "global"]}
    doc = json.loads(Path(descriptors_json).read_text())
    out = {c: torch.tensor(doc["clients"][c]["standardised"], dtype=torch.float32) for c in clients}
    out["global"] = torch.tensor(doc["centroid"]["standardised"], dtype=torch.float32)
    return out


def build_model(cfg: Config, method: str, seed: int, encoder_dir: str | None) -> FedHistoModel:
    torch.manual_seed(0)  # a random (non-pretrained) encoder must be identical across runs
    encoder = load_encoder(cfg.model.encoder, encoder_dir)
    torch.manual_seed(seed)  # LoRA A and head initialisation follow the run seed
    return FedHistoModel(encoder, cfg.model, film=method_spec(method).film)


def validate_outcome(ckpt: dict, metric: float) -> list[str]:
    problems = []
    for name, tensor in ckpt["best"]["state"].items():
        if not torch.isfinite(tensor).all():
            problems.append(f"checkpoint tensor {name} is not finite")
    if not (0.0 <= metric <= 1.0) or math.isnan(metric):
        problems.append(f"validation macro-F1 {metric} outside [0, 1]")
    if not ckpt["history"]:
        problems.append("no completed round in the history")
    return problems


def _write_history(path: Path, history: list[dict]) -> None:
    def writer(tmp: Path) -> None:
        with tmp.open("w", newline="") as fh:
            w = csv.writer(fh, lineterminator="\n")
            w.writerow(["round", "val_macro_f1", "best", "weights", "losses", "failed_clients", "wall_s"])
            for h in history:
                w.writerow([h["round"], f"{h['val_macro_f1']:.6f}", h["best"], json.dumps(h["weights"]),
                            json.dumps(h["losses"]), json.dumps(h["failed_clients"]), h["wall_s"]])

    write_with(path, writer)


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
              threads: int = 1, **test_hooks) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(threads, 1))
    device = pick_device()
    dataset_identity = json.loads(Path(manifest_json).read_text())["dataset_identity"]
    block = training_block(cfg, method, seed)
    identity = {"method": method, "seed": seed, "config_hash": config_hash(block), "dataset_identity": dataset_identity}
    parts = load_partitions(manifest_csv, cfg.views.crop_size)
    clients = sorted(k for k in parts if ":" not in k and k.startswith("C"))
    model = build_model(cfg, method, seed, encoder_dir).to(device)
    _set_aside_foreign_checkpoint(out / "checkpoint.pt", identity)
    ctx = RunContext(model=model, clients={c: parts[c] for c in clients}, validation=parts["validation"],
                     descriptors=descriptors_for(method, descriptors_json, clients), spec=method_spec(method),
                     cfg=cfg, seed=seed, identity=identity, device=device, checkpoint=out / "checkpoint.pt",
                     **test_hooks)
    ckpt = run_rounds(ctx)
    probs = predict(model, parts["validation"], ctx.descriptors["global"], cfg, device)
    metric = macro_f1(probs, parts["validation"].labels)
    _write_history(out / "history.csv", ckpt["history"])
    write_with(out / "validation_predictions.csv", lambda tmp: tmp.write_text(
        "sample_id,label," + ",".join(f"p_{c}" for c in CLASSES) + "\n" + "".join(
            f"{i},{CLASSES[y]}," + ",".join(f"{v:.8f}" for v in p.tolist()) + "\n"
            for i, y, p in zip(parts["validation"].ids, parts["validation"].labels, probs, strict=True))))
    prov = provenance_block(STAGE, block, {"manifest": manifest_csv, "descriptors": descriptors_json})
    problems = validate_outcome(ckpt, metric)
    summary = {"method": method, "seed": seed, "identity": identity, "device": str(device),
               "rounds": ckpt["round"], "best_round": ckpt["best"]["round"], "early_stopped": ckpt["stopped"],
               "resumed_at_rounds": ckpt.get("resumed_at_rounds", []),
               "validation_macro_f1": metric, "provenance": prov, "pid": os.getpid()}
    if problems:
        write_json(out / "failure.json", {**summary, "failed": "validation of checkpoint/report", "problems": problems,
                                          "checkpoint_usable": all("tensor" not in p for p in problems)})
        status = "failed"
    else:
        write_json(out / "report.json", summary)
        status = "finalised"
    write_json(out / "status.json", {"status": status, "method": method, "seed": seed,
                                     "dataset_identity": dataset_identity, "provenance": prov})
    return summary
