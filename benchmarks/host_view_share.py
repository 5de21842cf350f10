"""The host-view share of a round: how much of one federated round the engine spends making (or waiting for)
the training views on the host, with and without the view workers (``train.view_workers``).

Usage (CPU or GPU)::

    python benchmarks/host_view_share.py [--encoder tiny] [--depth N] [--images-per-client 16]
        [--workers 0 2] [--engines batched] [--method past_v2] [--json rows.json]

Runs the real round (``benchmarks/gpu_round.py``'s five synthetic clients, the engine's client update,
aggregation, prototypes and validation) once per (engine, workers) and prints, per row, the round's seconds,
the seconds the engine's thread spent on host views (made by itself, ``Method.batch_inputs``, or waited
for from the workers, ``StepsAhead.get``) and their share of the round. On a CPU the views and the step
share the same cores, so workers mostly move the work rather than hide it; on a GPU the share with workers
is what still holds the device up (``benchmarks/gpu_check.sh`` runs it there). One run per row: a share,
not a speed claim (compare speeds side by side with farm-bench).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_round import synthetic_split

from fedhisto.config.study import load_config
from fedhisto.methods import build_method
from fedhisto.model.build import pick_device
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.registries.encoder_registry import ENCODER_NAMES, encoder_entry
from fedhisto.train import view_workers
from fedhisto.train.loop import run_rounds
from fedhisto.train.participants import InProcess


@contextmanager
def view_clock(method):
    """Within (``method``: a method's objective): ``clock["s"]`` accumulates the engine thread's seconds in host views (made or waited for)."""
    clock = {"s": 0.0, "calls": 0}
    cls = type(method)
    own, get = cls.batch_inputs, view_workers.StepsAhead.get

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock["s"] += time.perf_counter() - start
                clock["calls"] += 1
        return wrapper

    cls.batch_inputs, view_workers.StepsAhead.get = timed(own), timed(get)
    try:
        yield clock
    finally:
        cls.batch_inputs, view_workers.StepsAhead.get = own, get


def round_share(method_name: str, engine: str, workers: int, encoder: str, depth: int | None, images: int,
                out: Path) -> dict:
    device = pick_device()
    clients = {f"C{k}": synthetic_split(images, f"site{k}", k) for k in range(1, 6)}
    validation = synthetic_split(max(images // 2, 3), "site1", 99)
    cfg = load_config({"train": {"max_rounds": 1, "engine": engine, "view_workers": workers},
                       "model": {"encoder": {"name": encoder, "require_pretrained": False}},
                       "views": {"crop_size": encoder_entry(encoder).input_size}})
    torch.manual_seed(0)
    method = build_method(method_name, cfg)
    model = FedHistoModel(random_encoder(encoder, depth), cfg.model, film=method.film).to(device)
    desc = torch.zeros(14) if method.film else None
    parts = InProcess(model=model, method=method, clients=clients, validation=validation,
                      descriptors={**dict.fromkeys(clients, desc), "global": desc}, cfg=cfg, seed=11, device=device,
                      batched=engine == "batched")
    identity = {"method": method_name, "seed": 11, "config_hash": "bench", "dataset_identity": "bench",
                "descriptor_digest": "none", "encoder_digest": "bench"}
    checkpoint = out / f"{method_name}-{engine}-{workers}.pt"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.unlink(missing_ok=True)
    with view_clock(method.objective) as clock:  # the client half makes the views
        start = time.perf_counter()
        run_rounds(method, parts, model, cfg, identity, checkpoint)
        if device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - start
    return {"method": method_name, "engine": engine, "view_workers": workers, "encoder": encoder,
            "depth": depth or encoder_entry(encoder).depth, "images_per_client": images, "device": str(device),
            "round_s": round(secs, 3), "host_view_s": round(clock["s"], 3),
            "host_view_share": round(clock["s"] / secs, 4)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder", default="tiny", choices=ENCODER_NAMES)
    parser.add_argument("--depth", type=int, default=None, help="build only this many encoder blocks")
    parser.add_argument("--images-per-client", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--engines", nargs="+", default=["batched"], choices=["sequential", "batched"])
    parser.add_argument("--method", default="past_v2")
    parser.add_argument("--json", default=None)
    parser.add_argument("--out", default="/tmp/fedhisto_host_view_share")
    args = parser.parse_args(argv)
    print("| engine | view workers | round (s) | host views on the engine's path (s) | share of the round |")
    print("|---|---|---|---|---|")
    rows = []
    for engine in args.engines:
        for workers in args.workers if engine == "batched" else [0]:  # the sequential engine has no workers
            r = round_share(args.method, engine, workers, args.encoder, args.depth, args.images_per_client,
                            Path(args.out))
            rows.append(r)
            print(f"| {engine} | {workers} | {r['round_s']:.2f} | {r['host_view_s']:.2f} | "
                  f"{100 * r['host_view_share']:.0f} % |", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
