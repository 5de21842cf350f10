"""One federated round with a registry encoder's shape (HIBOU-B by default): seconds per round and peak memory.

Usage (on a machine with a GPU; also runs, slowly, on a CPU with small numbers)::

    python benchmarks/gpu_round.py [--images-per-client 64] [--methods fedavg_peft past_v2]
        [--engines sequential batched] [--view-pipelines host device] [--encoder hibou-b]
        [--depth N] [--json rows.json]

Builds the real PEFT model on a randomly initialised encoder of the entry's exact shape (timing
does not depend on the weights, and no download is possible here), five clients with synthetic
tiles at the entry's input size, and runs the real client update, delta-SVD aggregation, prototype exchange and
validation pass of the training engine. Prints a Markdown table for docs/changelog.md. Every
(method, engine, view pipeline) combination runs, except fedstain / fedstain_code with device views
(they refuse them). ``--depth`` builds fewer encoder blocks (CPU dry runs of benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from fedhisto.config.study import load_config
from fedhisto.data.splits import Split
from fedhisto.methods import build_method
from fedhisto.model.build import pick_device
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.registries.encoder_registry import ENCODER_NAMES, encoder_entry
from fedhisto.synth.stain_styles import SITE_STYLES, render_rgb
from fedhisto.synth.tissue import tissue
from fedhisto.train.loop import run_rounds
from fedhisto.train.participants import InProcess


def synthetic_split(n: int, site: str, seed: int) -> Split:
    rng = np.random.default_rng(seed)
    labels = [k % 3 for k in range(n)]
    images = []
    for y in labels:
        h, e = tissue(("ACA", "Normal", "SCC")[y], rng, 256, 2.0)
        images.append(render_rgb(h, e, SITE_STYLES[site], rng, 2.0))
    return Split([f"{seed:04x}{k:08x}" for k in range(n)], labels, images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images-per-client", type=int, default=64)
    parser.add_argument("--methods", nargs="*", default=["fedavg_peft", "past_v2"])
    parser.add_argument("--engines", nargs="*", default=["sequential"], choices=["sequential", "batched"])
    parser.add_argument("--view-pipelines", nargs="*", default=["host"], choices=["host", "device"])
    parser.add_argument("--encoder", default="hibou-b", choices=ENCODER_NAMES, help="a registry entry (timm ones need fedhisto[zoo])")
    parser.add_argument("--depth", type=int, default=None, help="build only this many encoder blocks")
    parser.add_argument("--json", default=None, help="also write the rows here as JSON")
    parser.add_argument("--out", default="/tmp/fedhisto_gpu_round")
    args = parser.parse_args()
    device = pick_device()
    base = {"train": {"max_rounds": 1, "patience": 10}}
    clients = {f"C{k}": synthetic_split(args.images_per_client, f"site{k}", k) for k in range(1, 6)}
    validation = synthetic_split(max(args.images_per_client // 2, 3), "site1", 99)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name}; images per client: {args.images_per_client}; {args.encoder} shape, random weights")
    print("| method | engine | views | seconds per round | paired-view pairs/s | peak GPU memory (GiB) |")
    print("|---|---|---|---|---|---|")
    rows = []
    combos = [(m, e, v) for m in args.methods for e in args.engines for v in args.view_pipelines
              if not (v == "device" and m in ("fedstain", "fedstain_code"))]
    for method, engine, pipeline in combos:
        cfg = load_config({"train": {**base["train"], "engine": engine, "view_pipeline": pipeline},
                           "model": {"encoder": {"name": args.encoder}},
                           "views": {"crop_size": encoder_entry(args.encoder).input_size}})
        torch.manual_seed(0)
        m = build_method(method, cfg)
        model = FedHistoModel(random_encoder(args.encoder, args.depth), cfg.model, film=m.film).to(device)
        desc = torch.zeros(14) if m.film else None
        parts = InProcess(model=model, method=m, clients=clients, validation=validation,
                          descriptors={**dict.fromkeys(clients, desc), "global": desc}, cfg=cfg, seed=11,
                          device=device, batched=engine == "batched")
        identity = {"method": method, "seed": 11, "config_hash": "bench", "dataset_identity": "bench",
                    "descriptor_digest": "none", "encoder_digest": "bench"}
        checkpoint = Path(args.out) / f"{method}-{engine}-{pipeline}.pt"
        checkpoint.unlink(missing_ok=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        run_rounds(m, parts, model, cfg, identity, checkpoint)
        if device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        views = 2 if m.objective.paired_views else 1
        pairs = cfg.train.local_epochs * sum(len(c) for c in clients.values()) * views / 2
        rows.append({"method": method, "engine": engine, "view_pipeline": pipeline, "encoder": args.encoder,
                     "depth": args.depth or encoder_entry(args.encoder).depth, "seconds_per_round": round(secs, 3),
                     "pairs_per_s": round(pairs / secs, 2), "peak_gib": round(peak, 3) if device.type == "cuda" else None, "device": name,
                     "images_per_client": args.images_per_client})
        print(f"| {method} | {engine} | {pipeline} | {secs:.1f} | {pairs / secs:.1f} | {peak:.2f} |", flush=True)
        if args.json:  # after every row: a run stopped part-way keeps what it measured
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
