"""Does self-supervised pretraining give the tiny encoder real-tissue features? A check on real images.

Usage: ``python benchmarks/tiny_encoder_real_check.py --synthetic-encoder results/pretrain/encoder
[--shared ../shared] [--epochs 100] [--batch 16] [--lr 3e-4] [--threads 2]``. Skips cleanly without the shared folder; nothing
from it is copied (the manifest written to a scratch folder points at the images where they are).

The LC25000 sample (9 augmentation families, 3 per class) is split by family: two families per
class are the clients' optimisation images (the only images self-supervised pretraining sees), the
third family of each class is held out. Three frozen tiny encoders are compared on the held-out
families: random, the pipeline's synthetic-supervised one (``--synthetic-encoder``), and one
pretrained with ``model.pretrain.objective: self_supervised`` on the optimisation families.
Printed per encoder: nearest-centroid class accuracy of the held-out images (centroids from the
optimisation images' embeddings: a label-free encoder's features, scored with labels only here)
and the stain-sensitivity probe (ratio, retrieval) on the held-out images. Figures, not tests.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedhisto import CLASSES
from fedhisto.config.study import load_config
from fedhisto.model.encoder import load_encoder_folder, random_encoder
from fedhisto.model.stain_probe import clean_view, embed, load_probe_image, stain_sensitivity, summary_of
from fedhisto.pretrain.stage import run_pretrain

LABELS = {"lung_aca": "ACA", "lung_n": "Normal", "lung_scc": "SCC"}


def _rows(shared: Path) -> list[dict]:
    with (shared / "realdata/MANIFEST.tsv").open() as fh:
        rows = [r for r in csv.DictReader(fh, delimiter="\t") if r["path"].startswith("lc25000-sample/")]
    families = {lab: sorted({r["family"] for r in rows if r["label"] == lab}) for lab in LABELS}
    held = {fams[-1] for fams in families.values()}
    out = []
    for k, r in enumerate(sorted(rows, key=lambda r: r["path"])):
        out.append({"sample_id": r["sha256"][:16], "path": str(shared / "realdata" / r["path"]),
                    "label": LABELS[r["label"]], "family": r["family"],
                    "split": "test" if r["family"] in held else "optimisation",
                    "client": "" if r["family"] in held else f"C{1 + k % 2}"})
    return out


def _centroid_accuracy(encoder, rows: list[dict], cfg) -> float:
    emb = {}
    for split in ("optimisation", "test"):
        sel = [r for r in rows if r["split"] == split]
        x = embed(encoder, [clean_view(load_probe_image(r["path"], cfg.views.crop_size), cfg.views) for r in sel])
        emb[split] = (x / np.linalg.norm(x, axis=1, keepdims=True), np.array([CLASSES.index(r["label"]) for r in sel]))
    (xo, yo), (xt, yt) = emb["optimisation"], emb["test"]
    centroids = np.stack([xo[yo == c].mean(0) for c in range(len(CLASSES))])
    return float(((xt @ centroids.T).argmax(1) == yt).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--synthetic-encoder", required=True, help="the pipeline's results/pretrain/encoder")
    ap.add_argument("--epochs", type=int, default=100, help="about 60 images: 3 steps an epoch at --batch 16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4, help="peak of the one-cycle schedule")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    shared = Path(args.shared)
    if not (shared / "realdata/MANIFEST.tsv").exists():
        print(f"skipped: {shared}/realdata not found")
        return 0
    torch.set_num_threads(args.threads)
    rows = _rows(shared)
    cfg = load_config({"views": {"crop_size": 48}, "model": {"encoder": {"name": "tiny"}, "pretrain": {
        "enabled": True, "objective": "self_supervised", "epochs": args.epochs, "batch": args.batch, "lr": args.lr}}})
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "manifest.csv"
        with manifest.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        start = time.perf_counter()
        report = run_pretrain(cfg, Path(tmp) / "ssl", threads=args.threads, manifest_csv=manifest)
        seconds = time.perf_counter() - start
        torch.manual_seed(0)
        encoders = {"random": random_encoder("tiny"),
                    "synthetic_supervised": load_encoder_folder(args.synthetic_encoder, "tiny"),
                    "self_supervised": load_encoder_folder(Path(tmp) / "ssl", "tiny")}
        held = [(r["sample_id"], load_probe_image(r["path"], 48)) for r in rows if r["split"] == "test"]
        print(json.dumps({"self_supervised_pretraining": {**report["self_supervised"], "seconds": round(seconds, 1),
                                                          "first_loss": report["history"][0]["loss"],
                                                          "last_loss": report["history"][-1]["loss"],
                                                          "chance_loss": report["history"][0]["chance_loss"]}},
                         indent=1))
        for name, enc in encoders.items():
            probe = summary_of(stain_sensitivity(enc, held, cfg.views, 5151, 1000, 20261201))
            print(json.dumps({"encoder": name, "held_out_images": len(held),
                              "centroid_accuracy": _centroid_accuracy(enc, rows, cfg),
                              "probe_ratio": probe["ratio"], "probe_retrieval": probe["retrieval_top1"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
