"""Per-round wall time of a Flower deployment on stock Flower processes and on the fast path, side by side.

On the Flower tests' cohort and tiny config (tests/flower_support.py: five sites, past_v2, two
rounds), on this host:

1. in-process engine (``train.stage.run_train``), the reference;
2. deployment as ``fedhisto site`` starts it by default, on Flower's own processes (TLS + SuperNode
   auth, five SuperNodes, one ``flwr-clientapp`` process per message that imports torch/peft, builds
   the model and reads the site's decoded images from the node cache; the SuperNode's fixed 3 s idle
   poll, SuperExecs polling every 0.1 s, the ServerApp pulling every 0.2 s);
3. deployment as ``fedhisto site --fastpath`` starts it (``federation.fastpath``: a long-lived worker
   per site, 0.2 / 0.1 / 0.2 s polls), each worker warmed up before it says ready (``--warm-config``:
   frozen encoder, the site's images, the run's model; the evaluation site also its validation images).

Prints a markdown table (per round: wall, train and post phases) and, per message of the Flower
default, where its seconds went (the ClientApp process's age when the handler started = interpreter
start + imports; the handler's setup = model build; the handler). Writes the raw figures as JSON.

    python benchmarks/federation_round.py [--work DIR] [--out figures.json] [--skip-default] [--method M]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def deployment(prepared: dict, root: Path, fast: bool, method: str) -> dict:
    import torch

    from fedhisto.federation.localhost import LocalFederation, SiteSpec, wait_run_end

    sites = ("C1", "C2", "C3", "C4", "C5")  # the evaluation site is the first (run config eval-site unset)
    warm = {"warm_config": prepared["config"], "warm_runs": (f"{method}:11",)}
    specs = [SiteSpec(s, prepared["manifest"], prepared["descriptors"], **warm,
                      warm_splits=("optimisation", "validation") if s == sites[0] else ("optimisation",))
             for s in sites]
    fed = LocalFederation(root, specs, fastpath=fast)
    out, logs = root / f"results/train/{method}/seed11", root / "serverapp"
    t0 = time.time()
    try:
        fed.start()
        ready_s = time.time() - t0
        warmed = {s: json.loads((root / "sites" / s / "worker.ready").read_text()).get("warmed", {})
                  for s in sites} if fast else {}
        fed.run({"method": method, "seed": 11, "config": str(prepared["config"]),
                 "descriptors": str(prepared["descriptors"]), "out-dir": str(out),
                 "dataset-identity": prepared["dataset_identity"], "log-dir": str(logs), "round-timeout": 600.0})
        end = wait_run_end(logs, 900)
        total_s = time.time() - t0
        cpu = fed.cpu_seconds()
    finally:
        left = fed.stop()
    assert left == [], left
    assert end["event"] == "finished", end
    hist = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["history"]
    groups = {"superlink (+ ServerApp)": [k for k in cpu if k == "superlink"],
              "supernodes (+ SuperExec, ClientApp processes)": [k for k in cpu if k.startswith("supernode_")],
              "site workers": [k for k in cpu if k.startswith("worker_")]}
    return {"ready_s": round(ready_s, 1), "total_s": round(total_s, 1), "warmed": warmed,
            "cpu_s": {g: round(sum(cpu[k] for k in ks), 1) for g, ks in groups.items()},
            "rounds": [{"round": h["round"], "wall_s": h["wall_s"],
                        "phases": {a: {"s": v["s"], "sites": v.get("sites", {})} for a, v in h["phases"].items()}}
                       for h in hist]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work")
    ap.add_argument("--out", default="federation_round.json")
    ap.add_argument("--skip-default", action="store_true", help="only the in-process and the fast-path deployment")
    ap.add_argument("--method", default="past_v2", help="a federable method (past_v2, fedavg_peft, fedstain, ...)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="fedround-"))
    import torch
    from flower_support import prepare

    from fedhisto.config.study import load_config_file
    from fedhisto.train.stage import run_train

    prepared = prepare(work / "cohort")
    prepared["dataset_identity"] = json.loads(prepared["identity"].read_text())["dataset_identity"]
    run_train(args.method, 11, prepared["manifest"], prepared["identity"], prepared["descriptors"],
              load_config_file(prepared["config"]), work / "inproc")
    inproc = [h["wall_s"] for h in torch.load(work / "inproc/checkpoint.pt", weights_only=False)["history"]]
    figures = {"in_process": inproc}
    if not args.skip_default:
        figures["flower_default"] = deployment(prepared, work / "default", False, args.method)
    figures["fedhisto_fast"] = deployment(prepared, work / "fast", True, args.method)
    Path(args.out).write_text(json.dumps(figures, indent=1))

    print("| engine | " + " | ".join(f"round {i + 1}" for i in range(len(inproc))) + " |")
    print("|---|" + "---|" * len(inproc))
    print("| in-process | " + " | ".join(f"{s:.1f} s" for s in inproc) + " |")
    for name in ("flower_default", "fedhisto_fast"):
        if name not in figures:
            continue
        cells = []
        for h in figures[name]["rounds"]:
            ph = ", ".join(f"{a} {v['s']:.1f}" for a, v in h["phases"].items())
            ratio = h["wall_s"] / inproc[h["round"] - 1]
            cells.append(f"{h['wall_s']:.1f} s ({ratio:.1f}x; {ph})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name in ("flower_default", "fedhisto_fast"):
        if name in figures:
            print(f"\n{name}: start-up {figures[name]['ready_s']} s, start to finish {figures[name]['total_s']} s, "
                  f"CPU seconds {figures[name]['cpu_s']}")
            for site, w in figures[name].get("warmed", {}).items():
                print(f"  worker {site} warm-up: {w}")
    for name in ("flower_default", "fedhisto_fast"):
        if name not in figures:
            continue
        print(f"\n{name}: per message (mean over sites) process age at handler start / handler setup / handler")
        for h in figures[name]["rounds"]:
            for action, v in h["phases"].items():
                infos = list(v["sites"].values())
                if infos:
                    mean = {k: sum(float(i.get(k, 0)) for i in infos) / len(infos)
                            for k in ("process_age_s", "setup_s", "handler_s")}
                    print(f"  round {h['round']} {action}: {mean['process_age_s']:.1f} / {mean['setup_s']:.2f} / "
                          f"{mean['handler_s']:.2f} s (phase {v['s']:.1f} s)")


if __name__ == "__main__":
    main()
