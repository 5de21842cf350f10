"""The cost of a round with secure aggregation against without, side by side (interleaved runs, ratios pair by pair).

Two measurements, each printing its figures and the ratio secure / plain of every pair:

``--cohort``: the Flower tests' cohort and tiny config (tests/flower_support.py: five sites) on stock Flower
processes (SuperLink + five SuperNodes, TLS, SuperNode authentication; ``federation.localhost``), one
federation up for the whole measurement and one round per run, runs alternating plain, secure, plain,
secure, ... (``--pairs``) for ``--method``; per run the round's wall time and its phases.

``--hibou``: HIBOU-B's tensor shapes (the real architecture on the meta device, ``model.parameter_card``),
five sites with random trainable states of those shapes. Plain: what the server does with the states in
the clear (every site's state packed as a message, ``records.state_record``, and the study's aggregation,
``fedmath.aggregate``: delta-SVD and the weighted mean). Secure: the whole of Flower's SecAgg+ for the
round's masked sum (``federation.secagg.masked_sum`` over the ClientApp in this process,
``tests/flower_support.LocalGrid``: every site's keys, shares, products expanded, quantised and masked,
and the server's unmasking) and the server step from the sum (``Strategy.aggregate_sums``). The process
runs every site one after the other, so a secure round's figure is the sites' work summed; real sites
work in parallel.

    python benchmarks/secure_round.py --hibou [--pairs 3] [--method fedavg_peft]
    python benchmarks/secure_round.py --cohort [--pairs 2] [--method past_v2] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SITES = ["C1", "C2", "C3", "C4", "C5"]


def hibou(method: str, pairs: int) -> list[dict]:
    import torch
    from flower_support import LocalGrid

    from fedhisto.config.study import load_config
    from fedhisto.federation.records import state_record
    from fedhisto.federation.secagg import masked_sum
    from fedhisto.federation.secure_site import keep
    from fedhisto.fedmath.aggregate import aggregate
    from fedhisto.fedmath.secure_sums import layout
    from fedhisto.methods import build_method
    from fedhisto.methods.secure_capability import SecureSums
    from fedhisto.model.parameter_card import meta_model

    cfg = load_config({"secure_aggregation": {"enabled": True}})
    m = build_method(method, cfg)
    meta = meta_model("hibou-b", method, cfg.model)
    scaling, shapes = meta.lora_scaling, {k: v.shape for k, v in meta.trainable_state().items()}
    g = torch.Generator().manual_seed(0)
    start = {k: 0.02 * torch.randn(s, generator=g) for k, s in shapes.items()}
    states = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in start.items()} for _ in SITES]
    weights = {s: 1 / len(SITES) for s in SITES}

    def plain() -> float:
        t0 = time.perf_counter()
        for st in states:
            state_record(st)  # the upload a site sends in the clear
        aggregate(states, list(weights.values()), scaling, cfg.model.lora_r)
        return time.perf_counter() - t0

    grid = LocalGrid({100 + k: {"site-id": s} for k, s in enumerate(SITES)}, {})
    from flwr.app import RecordDict

    for k, st in enumerate(states):
        grid.states[100 + k] = RecordDict()
        keep(grid.states[100 + k], "terms", 0, m.objective.secure_terms(st, start, scaling))
    order = layout(m.objective.secure_terms(states[0], start, scaling))

    stages: dict = {}

    def secure() -> float:
        t0 = time.perf_counter()
        got = masked_sum(grid, {s: 100 + k for k, s in enumerate(SITES)}, weights, 0, "terms",
                         cfg.secure_aggregation, timeout=600, poll=None)
        t1 = time.perf_counter()
        sums = {name: torch.from_numpy(a).reshape(shape) for (name, shape), a in zip(order, got.sum, strict=True)}
        m.aggregate_sums(SecureSums(0, sums, weights, start), meta_like(meta, scaling))
        stages.update({x["stage"]: x["s"] for x in got.stages if "stage" in x}, server_step=time.perf_counter() - t1,
                      up_bytes_per_site=got.stages[-1]["up_bytes"] / len(SITES))
        return time.perf_counter() - t0

    out = []
    for _ in range(pairs):
        a, b = plain(), secure()
        out.append({"plain_s": round(a, 3), "secure_s": round(b, 3), "ratio": round(b / a, 1),
                    "secure_parts_s": {k: round(v, 3) for k, v in stages.items()}})
        print(out[-1], flush=True)
    return out


def meta_like(meta, scaling: float):
    """What ``aggregate_sums`` reads of the model: its LoRA scaling."""
    from types import SimpleNamespace

    return SimpleNamespace(lora_scaling=scaling)


def cohort(method: str, pairs: int, work: Path) -> list[dict]:
    import torch
    from flower_support import prepare

    from fedhisto.federation.localhost import LocalFederation, SiteSpec, wait_run_end

    prepared = prepare(work / "cohort")
    identity = json.loads(prepared["identity"].read_text())["dataset_identity"]
    import yaml

    raw = yaml.safe_load(Path(prepared["config"]).read_text())
    raw["train"] = {**raw["train"], "max_rounds": 1}
    (work / "config.yaml").write_text(yaml.safe_dump(raw))
    fed = LocalFederation(work / "fed", [SiteSpec(s, prepared["manifest"], prepared["descriptors"]) for s in SITES])
    out = []
    try:
        fed.start()
        for i in range(pairs):
            row = {}
            for kind in ("plain", "secure"):
                run = work / f"{kind}{i}"
                fed.run({"method": method, "seed": 11, "config": str(work / "config.yaml"),
                         "descriptors": str(prepared["descriptors"]), "out-dir": str(run / "train"),
                         "dataset-identity": identity, "log-dir": str(run / "log"), "round-timeout": 600.0,
                         "secure-aggregation": kind == "secure"})
                end = wait_run_end(run / "log", 1200)
                assert end["event"] == "finished", end
                h = torch.load(run / "train/checkpoint.pt", map_location="cpu", weights_only=False)["history"][0]
                row[f"{kind}_s"] = h["wall_s"]
                row[f"{kind}_phases"] = {a: v["s"] for a, v in h["phases"].items()}
            row["ratio"] = round(row["secure_s"] / row["plain_s"], 2)
            out.append(row)
            print(json.dumps(row), flush=True)
    finally:
        left = fed.stop()
    assert left == [], left
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hibou", action="store_true")
    ap.add_argument("--cohort", action="store_true")
    ap.add_argument("--method", default="fedavg_peft")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--work")
    ap.add_argument("--out", default="secure_round.json")
    args = ap.parse_args()
    figures = {}
    if args.hibou:
        figures["hibou"] = hibou(args.method, args.pairs)
    if args.cohort:
        figures["cohort"] = cohort(args.method, args.pairs, Path(args.work or tempfile.mkdtemp(prefix="secround-")))
    Path(args.out).write_text(json.dumps(figures, indent=1))
    for name, rows in figures.items():
        plain = statistics.median(r["plain_s"] for r in rows)
        secure = statistics.median(r["secure_s"] for r in rows)
        ratios = [r["ratio"] for r in rows]
        print(f"{name} ({args.method}): plain median {plain:.2f} s, secure median {secure:.2f} s, ratio per pair "
              f"{ratios} (median {statistics.median(ratios)})")


if __name__ == "__main__":
    main()
