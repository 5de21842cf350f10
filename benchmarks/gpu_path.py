"""The GPU path of benchmarks/gpu_check.sh, part by part, into one JSON file (``--json``, merged per part).

    python benchmarks/gpu_path.py device --json path.json   # the device a run picks, and the refusals
    python benchmarks/gpu_path.py resume --json path.json   # a run killed (SIGKILL) after round 1, resumed
    python benchmarks/gpu_path.py views --json path.json    # the host-view share of a round, view workers or not

``device``: ``train.device`` auto and cuda pick the GPU; a job declaring a GPU with every GPU hidden
(``CUDA_VISIBLE_DEVICES=""``) stops naming the cause. ``resume``: the same run three times in fresh
processes (HIBOU-B's shape, random weights, five synthetic clients, the batched engine, three rounds):
uninterrupted; killed with SIGKILL right after round 1's checkpoint; resumed from that checkpoint. The
resumed run must finish (its tensors back on the GPU) and end where the uninterrupted one does (the
largest difference is reported: bitwise where the kernels are deterministic). ``views``:
``benchmarks/host_view_share.py`` on the device. ``--depth``/``--images`` shrink everything for a CPU
dry run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _merge(path: str | None, key: str, value) -> None:
    print(json.dumps({key: value}, indent=2), flush=True)
    if path:
        doc = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        doc[key] = value
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def device_part() -> dict:
    import torch

    from fedhisto.config.study import load_config
    from fedhisto.model.build import cuda_unavailable_cause, pick_device

    out = {"cuda_available": torch.cuda.is_available(), "cause": cuda_unavailable_cause(),
           "auto": str(pick_device(load_config({})))}
    if torch.cuda.is_available():
        out["cuda"] = str(pick_device(load_config({"train": {"device": "cuda"}})))
    code = ("from fedhisto.model.build import pick_device\ntry:\n    pick_device(None)\n"
            "except Exception as exc:\n    print(f'{type(exc).__name__}: {exc}')\nelse:\n    print('no refusal')")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "FEDHISTO_JOB_GPUS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    out["hidden_gpu_job"] = (proc.stdout + proc.stderr).strip().splitlines()[-1] if proc.stdout or proc.stderr else ""
    out["ok"] = out["hidden_gpu_job"].startswith("DeviceUnavailable") and (
        not torch.cuda.is_available() or out["auto"] == out["cuda"] == "cuda")
    return out


def _one_run(work: Path, tag: str, rounds: int, depth: int | None, images: int, kill_after: int | None) -> None:
    """One run in this process (``resume`` runs it in fresh processes); kills itself after ``kill_after``."""
    import torch

    from fedhisto.config.study import load_config
    from fedhisto.methods import build_method
    from fedhisto.model.build import pick_device
    from fedhisto.model.encoder import random_encoder
    from fedhisto.model.peft_model import FedHistoModel
    from fedhisto.train.loop import run_rounds
    from fedhisto.train.participants import InProcess

    sys.path.insert(0, str(HERE))
    from gpu_round import synthetic_split

    cfg = load_config({"train": {"max_rounds": rounds, "patience": rounds + 1}, "model": {"encoder": {"name": "hibou-b"}},
                       "views": {"crop_size": 224 if depth is None else 56}})
    device = pick_device(cfg)
    clients = {f"C{k}": synthetic_split(images, f"site{k}", k) for k in range(1, 6)}
    validation = synthetic_split(max(images // 2, 3), "site1", 99)
    method = build_method("past_v2", cfg)
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("hibou-b", depth), cfg.model, film=method.film).to(device)
    desc = torch.zeros(14)
    parts = InProcess(model=model, method=method, clients=clients, validation=validation,
                      descriptors={**dict.fromkeys(clients, desc), "global": desc}, cfg=cfg, seed=11, device=device,
                      batched=True)
    identity = {"method": "past_v2", "seed": 11, "config_hash": "gpu-path", "dataset_identity": "gpu-path",
                "descriptor_digest": "none", "encoder_digest": "gpu-path"}

    def after(ckpt: dict) -> None:
        if kill_after is not None and ckpt["round"] >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # right after the atomic checkpoint: a preempted job

    run_rounds(method, parts, model, cfg, identity, work / f"{tag}.pt", after_round=after)


def resume_part(work: Path, rounds: int, depth: int | None, images: int) -> dict:
    import torch

    work.mkdir(parents=True, exist_ok=True)
    for tag in ("uninterrupted", "killed"):
        (work / f"{tag}.pt").unlink(missing_ok=True)
    args = [sys.executable, __file__, "_run", "--work", str(work), "--rounds", str(rounds), "--images", str(images),
            *(["--depth", str(depth)] if depth else [])]
    out, start = {}, time.perf_counter()
    for name, extra in (("uninterrupted", ["--tag", "uninterrupted"]), ("killed", ["--tag", "killed", "--kill-after", "1"]),
                        ("resumed", ["--tag", "killed"])):
        proc = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=600)
        out[f"{name}_rc"] = proc.returncode
        if proc.returncode not in (0, -signal.SIGKILL):
            out[f"{name}_error"] = proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else []
    a = torch.load(work / "uninterrupted.pt", map_location="cpu", weights_only=True)
    b = torch.load(work / "killed.pt", map_location="cpu", weights_only=True)
    sa, sb = a["best"]["members"]["global"], b["best"]["members"]["global"]
    out.update(rounds=[a["round"], b["round"]], resumed_at_rounds=b.get("resumed_at_rounds"),
               max_abs_difference=max(float((sa[k] - sb[k]).abs().max()) for k in sa),
               bitwise=all(torch.equal(sa[k], sb[k]) for k in sa), seconds=round(time.perf_counter() - start, 1))
    out["ok"] = (out["uninterrupted_rc"] == 0 and out["killed_rc"] == -signal.SIGKILL and out["resumed_rc"] == 0
                 and out["resumed_at_rounds"] == [1] and out["rounds"] == [rounds, rounds])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["device", "resume", "views", "_run"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--depth", type=int, default=None, help="encoder blocks (default: all)")
    parser.add_argument("--images", type=int, default=8, help="images per client")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default="/tmp/fedhisto_gpu_path")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--encoder", default="hibou-b", help="views: the encoder whose input size the views take")
    args = parser.parse_args()
    if args.part == "_run":
        _one_run(Path(args.work), args.tag, args.rounds, args.depth, args.images, args.kill_after)
        return 0
    if args.part == "device":
        result = device_part()
    elif args.part == "resume":
        result = resume_part(Path(args.work), args.rounds, args.depth, args.images)
    else:
        sys.path.insert(0, str(HERE))
        import torch
        from host_view_share import main as share

        workers = [0, max(1, len(os.sched_getaffinity(0)) - 1)] if torch.cuda.is_available() else [0, 1]
        encoder = ["--encoder", args.encoder, *(["--depth", str(args.depth)] if args.depth else [])]
        rows = share([*encoder, "--images-per-client", str(args.images), "--workers", *map(str, workers)])
        result = {"rows": rows, "ok": all(0 <= r["host_view_share"] <= 1 for r in rows)}
    _merge(args.json, args.part, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
