"""``fedhisto bench``: training and inference throughput of the PEFT model, sequential vs batched.

Figures, all measured in the same process on the same device:

- ``matmul_tflops``: a square matrix product (bf16 on a GPU, float32 on a CPU), the device's peak
  as this run sees it;
- ``sequential_pairs_s``: paired-view pairs per second of the sequential engine's step pattern
  (one participant after the other: two views forwarded, loss, backward; AdamW with clipping every
  ``accumulation_steps`` micro-batches), the study's objective (past_v2: CE, JS, feature consistency);
- ``batched_pairs_s``: the same work for every member at once (``train.batched``: one encoder pass
  over all members' views, member-stacked LoRA/adapter/FiLM/head, per-member AdamW and clipping);
- ``inference_images_s``: evaluation forward passes at a large batch (no gradients), under the
  training autocast (bf16 on a GPU);
- ``pipeline_inference_images_s``: the same forward as the pipeline's validation, prototypes and
  predictions run it (``train.inference.predict``: float32, ``evaluate.eval_batch`` images per call);
- ``*_tflops`` and ``*_ratio``: model FLOP/s (counted with torch's FlopCounterMode on one step)
  and their ratio to ``matmul_tflops``;
- ``peak_memory_gib``: peak device memory (GPU), or the process's peak resident memory (CPU);
- ``host_view_pairs_s``: paired stain views made on the host per second by one thread (the
  engines' data path; the timings above use views already on the device, kept as uint8);
  ``host_pool_pairs_s``: the same made by the pipeline's view workers (``train.view_workers``:
  ``host_view_workers`` threads on this device, none on a CPU), which overlap the step;
- ``device_view_pairs_s``: the same paired views made by ``fedhisto.data.device_views`` on the bench
  device, a batch of ``members x micro`` pairs per call (parameters drawn on the host, pixels from
  uint8 images kept on the device), images and output sized as for ``host_view_pairs_s``.

What is measured is the pipeline's own configuration (``bench_settings``): the config's encoder, head
sizes, crop, micro-batch and accumulation, one training job's members (its participants: the pipeline
runs one job per method and seed), precision and compile, and its view path; ``--members`` measures a
larger stack (seeds together, which the pipeline does not run).

Views are synthetic uint8 tiles on the device (timing does not depend on content); the encoder has
the chosen shape with random weights (no download; ``depth`` builds fewer blocks, for CPU dry runs).
Members are clients of one round (or seeds). Mixed precision is the engines' own
(``methods.base.training_autocast``: bf16 autocast on CUDA); ``compile`` times the batched step
with the engine's ``train.compile`` pass (``train.batched.compiled_embedding``); the first compiled
step, compilation included, is timed apart as ``compile_warmup_s``. Deterministic kernels are on,
as in the pipeline's runs (``model.build.set_determinism``).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhisto.config.study import load_config
from fedhisto.data.device_views import DeviceImages, draw_views, render_views
from fedhisto.data.splits import Split
from fedhisto.data.views import training_views
from fedhisto.infra.atomic import write_json
from fedhisto.methods import build_method
from fedhisto.methods.base import Batch, training_autocast
from fedhisto.model.build import set_determinism
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.registries.encoder_registry import encoder_entry
from fedhisto.train.batched import (
    Layout,
    StackedAdamW,
    clip_per_member,
    compiled_embedding,
    member_pathway,
    stack_states,
    stacked_forward,
)
from fedhisto.train.plan import MemberJob, local_run
from fedhisto.train.view_workers import view_workers

#: the method the bench trains: the study's proposed one (paired views, FiLM, prototypes)
METHOD = "past_v2"


def bench_settings(cfg: Any, encoder: str | None = None, members: int | None = None) -> dict:
    """What the bench runs, from the pipeline's configuration ``cfg``: its encoder, head sizes, crop, the
    method's micro-batch and accumulation, the members of one training job's batched step (the method's
    participants of a round: the pipeline runs one job per method and seed), the engine, view pipeline,
    view workers, precision and compile, and the evaluation batch. ``encoder`` and ``members`` override
    (to measure a larger stack or another encoder); the result records both."""
    strategy = build_method(METHOD, cfg)
    plan = strategy.objective.local_schedule(0)
    participants = len(strategy.participants(dict.fromkeys(cfg.partition_targets().clients)))
    return {"method": METHOD, "encoder": encoder or cfg.model.encoder.name,
            "adapter_hidden": cfg.model.adapter_hidden, "film_hidden": cfg.model.film_hidden,
            "crop": cfg.views.crop_size, "micro_batch": plan.micro_batch, "accumulation_steps": plan.accumulation,
            "members": members or participants, "pipeline_members": participants, "engine": cfg.train.engine,
            "view_pipeline": cfg.train.view_pipeline, "view_workers": cfg.train.view_workers,
            "precision": cfg.train.precision, "compile": cfg.train.compile, "eval_batch": cfg.evaluate.eval_batch}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], None], device: torch.device, iters: int, warmup: int) -> float:
    """Seconds per call after ``warmup`` untimed calls; one synchronisation at each end."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _flops(fn: Callable[[], None]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_peak(device: torch.device, n: int | None = None) -> tuple[float, str]:
    """TFLOP/s of an n x n x n product: bf16 on a GPU (n 8192), float32 on a CPU (n 1024)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    secs = _timed(lambda: torch.mm(a, b), device, iters=10 if device.type == "cuda" else 3, warmup=2)
    return 2 * n**3 / secs / 1e12, str(dtype).removeprefix("torch.")


def _pixels(u8: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (u8.float() / 255 - mean) / std


def host_view_rate(crop: int, n: int = 16, workers: int = 0) -> float:
    """Paired stain views per second made on the host (images 2 x crop, as loaded): by the engine's thread
    (``workers`` 0), or spread over ``workers`` threads as the view workers make them."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = load_config({"views": {"crop_size": crop}}).views
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (2 * crop, 2 * crop, 3), dtype=np.uint8) for _ in range(max(n, workers))]

    def one(k: int) -> None:
        training_views(images[k], cfg, 11, 0, f"{k:016x}", paired=True)

    start = time.perf_counter()
    if workers:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(len(images))))
    else:
        for k in range(len(images)):
            one(k)
    return len(images) / (time.perf_counter() - start)


def device_view_rate(crop: int, device: torch.device, batch: int, iters: int = 3) -> float:
    """Paired stain views per second made by ``render_views`` on ``device``, ``batch`` pairs per call
    (the per-step host work, drawing the parameters, included)."""
    cfg = load_config({"views": {"crop_size": crop}}).views
    rng = np.random.default_rng(0)
    store = DeviceImages([rng.integers(0, 256, (2 * crop, 2 * crop, 3), dtype=np.uint8) for _ in range(batch)], device)
    index = torch.arange(batch, device=device)
    epoch = iter(range(1 << 30))  # fresh draws every call, as every step has

    def make() -> None:
        e = next(epoch)
        draws = [draw_views(11, e, f"{k:016x}", 2 * crop, 2 * crop, cfg, paired=True) for k in range(batch)]
        render_views(store, index, draws, cfg)

    return batch / _timed(make, device, iters, warmup=1)


def run_bench(pipeline: Any = None, encoder: str | None = None, members: int | None = None, iters: int | None = None,
              warmup: int | None = None, inference_batch: int | None = None, compile: bool | None = None,
              device: torch.device | None = None, depth: int | None = None, view_samples: int = 16,
              micro: int | None = None, accum: int | None = None) -> dict:
    """The figures above as a dict (see the module docstring), for the pipeline's configuration ``pipeline``
    (a Config; default: the study's settings) as ``bench_settings`` reads it; ``encoder``, ``members``,
    ``compile``, ``micro`` and ``accum`` override it (toy sizes on a CPU, a larger stack)."""
    pipeline = pipeline if pipeline is not None else load_config({})
    settings = bench_settings(pipeline, encoder, members)
    encoder, members = settings["encoder"], settings["members"]
    micro, accum = micro or settings["micro_batch"], accum or settings["accumulation_steps"]
    compile = settings["compile"] if compile is None else compile
    # whole optimiser steps: the first ones build AdamW's state and the autograd/allocator caches
    warmup = accum if warmup is None else warmup
    iters = 2 * accum if iters is None else iters
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    set_determinism()  # the kernels the pipeline's runs get (model.build.pick_device)
    crop = settings["crop"] if encoder == pipeline.model.encoder.name else encoder_entry(encoder).input_size
    cfg = load_config({"model": {"encoder": {"name": encoder, "require_pretrained": False},
                                 "adapter_hidden": settings["adapter_hidden"], "film_hidden": settings["film_hidden"]},
                       "views": {"crop_size": crop}, "evaluate": {"eval_batch": settings["eval_batch"]},
                       "train": {"paired_micro_batch": micro, "accumulation_steps": accum,
                                 "precision": settings["precision"]}})
    strategy = build_method(METHOD, cfg)
    method = strategy.objective  # the client half: what the benchmark trains
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder(encoder, depth), cfg.model, film=strategy.film).to(device)
    model.train()
    autocast = training_autocast(device, settings["precision"])
    mean = torch.tensor(cfg.views.mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(cfg.views.std, device=device).view(1, 3, 1, 1)
    gen = torch.Generator(device=device).manual_seed(0)
    # data decoded once, kept on the device as uint8: (members, views, micro, 3, H, W)
    u8 = torch.randint(0, 256, (members, 2, micro, 3, crop, crop), generator=gen, device=device, dtype=torch.uint8)
    y = torch.arange(micro, device=device) % 3
    dummy = Split([f"{k:016x}" for k in range(micro)], y.tolist(), [])
    desc = torch.zeros(1, 14, device=device)
    state = model.trainable_state()
    plan = method.local_schedule(0)
    runs = [local_run(model, MemberJob(state, dummy, desc[0], {}, 11, 0, m), cfg, plan, device, {})
            for m in range(members)]
    batch = Batch(np.arange(micro), y, 0, 0, 0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    # ---- sequential: one participant after the other
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)
    counter = {"micro": 0}

    def sequential_step() -> None:
        for m in range(members):
            with autocast:
                outs = [model(_pixels(u8[m, k], mean, std), desc) for k in range(2)]
            terms = method.terms_from_outputs(runs[m], batch, [o[0].float() for o in outs], [o[1].float() for o in outs])
            (sum(terms.values()) / accum).backward()
            if (counter["micro"] + 1) % accum == 0:
                torch.nn.utils.clip_grad_norm_(params, 5.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        counter["micro"] += 1

    seq_s = _timed(sequential_step, device, iters, warmup)
    opt.zero_grad(set_to_none=True)

    # ---- batched: every member in one pass
    stacked = stack_states([state] * members, device)
    sopt = StackedAdamW(stacked, 1e-4, 1e-4)
    layout = Layout(members=[m for _ in range(2) for m in range(members)], sizes=[micro] * (2 * members),
                    specs=[None] * (2 * members))
    layout.index = torch.tensor(layout.members, device=device)
    descs = desc[None].expand(members, 1, 14)
    everyone = torch.ones(members, dtype=torch.bool, device=device)
    flat = u8.transpose(0, 1).reshape(-1, 3, crop, crop)  # view-major rows, as the engine lays them out
    embed = {"call": None}  # the eager encoder pass, or the compiled one (train.compile)
    bcount = {"micro": 0}

    def batched_step() -> None:
        with autocast:
            logits, zs = stacked_forward(model, method, stacked, layout, _pixels(flat, mean, std), descs, patched=True,
                                         embed=embed["call"])
        logits, zs = logits.float(), zs.float()
        total = 0
        for m in range(members):
            rows = [slice((k * members + m) * micro, (k * members + m + 1) * micro) for k in range(2)]
            terms = method.terms_from_outputs(runs[m], batch, [logits[r] for r in rows], [zs[r] for r in rows])
            total = total + sum(terms.values()) / accum
        total.backward()
        if (bcount["micro"] + 1) % accum == 0:
            clip_per_member(stacked, 5.0, everyone)
            sopt.step(everyone)
            sopt.zero_grad(everyone)
        bcount["micro"] += 1

    compile_s = None
    with member_pathway(model, method, stacked, layout):
        step_flops = _flops(batched_step)  # eager: FlopCounterMode does not see inside compiled graphs
        if compile:
            embed["call"] = compiled_embedding(model)
            start = time.perf_counter()
            batched_step()  # the first call compiles (forward and backward)
            _sync(device)
            compile_s = time.perf_counter() - start
        bat_s = _timed(batched_step, device, iters, warmup)

    # ---- inference at a large batch
    inference_batch = inference_batch or (256 if device.type == "cuda" else 32)
    eval_u8 = torch.randint(0, 256, (inference_batch, 3, crop, crop), generator=gen, device=device, dtype=torch.uint8)
    model.eval()

    @torch.no_grad()
    def infer() -> None:
        with autocast:
            model(_pixels(eval_u8, mean, std), desc)

    inf_s = _timed(infer, device, iters, warmup)
    inf_flops = _flops(infer)
    eval_batch = cfg.evaluate.eval_batch
    eval_f32 = eval_u8[:eval_batch] if inference_batch >= eval_batch else eval_u8

    @torch.no_grad()
    def infer_as_pipeline() -> None:  # train.inference.predict: float32, eval_batch images per call
        model(_pixels(eval_f32, mean, std), desc)

    pipe_s = _timed(infer_as_pipeline, device, iters, warmup)
    peak, dtype = matmul_peak(device)
    if device.type == "cuda":
        mem = torch.cuda.max_memory_allocated() / 2**30
        name = torch.cuda.get_device_name()
    else:
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        name = f"CPU ({torch.get_num_threads()} threads)"
    pairs = members * micro
    workers = view_workers(settings["view_workers"], device, settings["engine"], settings["view_pipeline"])
    out = {
        **settings, "crop": crop,
        "device": name, "encoder": encoder, "members": members, "micro_batch": micro, "accumulation_steps": accum,
        "pairs_per_member_step": micro * accum, "compile": compile, "iters": iters,
        "depth": depth or encoder_entry(encoder).depth, "full_depth": depth is None,
        "autocast": "bf16" if isinstance(autocast, torch.autocast) else "none",
        "matmul_tflops": _sig(peak), "matmul_dtype": dtype,
        "sequential_pairs_s": _sig(pairs / seq_s), "batched_pairs_s": _sig(pairs / bat_s),
        "speedup": _sig(seq_s / bat_s),
        "inference_batch": inference_batch, "inference_images_s": _sig(inference_batch / inf_s),
        "pipeline_inference_batch": eval_f32.shape[0], "pipeline_inference_images_s": _sig(eval_f32.shape[0] / pipe_s),
        "peak_memory_gib": _sig(mem), "peak_memory_kind": "device" if device.type == "cuda" else "process RSS",
        "host_view_pairs_s": _sig(host_view_rate(crop, view_samples)),
        "host_view_workers": workers, "host_pool_pairs_s": _sig(host_view_rate(crop, view_samples, workers))
        if workers else None,
        "device_view_pairs_s": _sig(device_view_rate(crop, device, pairs, iters=min(3, iters))), "device_view_batch": pairs,
    }
    out["batched_tflops"] = _sig(step_flops / bat_s / 1e12)
    out["batched_ratio"] = _sig(step_flops / bat_s / 1e12 / peak)
    if compile_s is not None:
        out["compile_warmup_s"] = _sig(compile_s)
    out["inference_tflops"] = _sig(inf_flops / inf_s / 1e12)
    out["inference_ratio"] = _sig(inf_flops / inf_s / 1e12 / peak)
    return out


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def format_table(r: dict) -> str:
    depth = "" if r.get("full_depth", True) else f", {r['depth']} blocks only"
    rows = [("device", r["device"]), ("encoder", f"{r['encoder']} ({r['members']} members, micro-batch "
                                                  f"{r['micro_batch']} x {r['accumulation_steps']}{depth})"),
            (f"matmul peak ({r['matmul_dtype']})", f"{r['matmul_tflops']:.3f} TFLOP/s"),
            ("sequential engine", f"{r['sequential_pairs_s']:.4g} pairs/s"),
            ("batched engine", f"{r['batched_pairs_s']:.4g} pairs/s ({r['speedup']:.2f}x)"
                               + (f", compiled (first step {r['compile_warmup_s']:.1f} s)" if r.get("compile") else ""))]
    if "batched_tflops" in r:
        rows.append(("batched model FLOP/s", f"{r['batched_tflops']:.4f} TFLOP/s ({100 * r['batched_ratio']:.1f} % of peak)"))
    rows += [("inference", f"{r['inference_images_s']:.4g} images/s at batch {r['inference_batch']} "
                           f"({100 * r['inference_ratio']:.1f} % of peak)"),
             ("inference as the pipeline", f"{r['pipeline_inference_images_s']:.4g} images/s (float32, batch "
                                           f"{r['pipeline_inference_batch']})") if "pipeline_inference_images_s" in r
             else ("inference as the pipeline", "not measured"),
             (f"peak memory ({r['peak_memory_kind']})", f"{r['peak_memory_gib']:.2f} GiB"),
             ("host views (1 thread)", f"{r['host_view_pairs_s']:.4g} pairs/s")]
    if r.get("host_pool_pairs_s"):
        rows.append(("host views (view workers)", f"{r['host_pool_pairs_s']:.4g} pairs/s ({r['host_view_workers']} "
                                                  "threads)"))
    if "device_view_pairs_s" in r:  # results written before the device views existed lack it
        rows.append(("device views", f"{r['device_view_pairs_s']:.4g} pairs/s at batch {r['device_view_batch']}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(args) -> int:
    """One run per ``--members`` value; ``--json`` gets the figures (a list when there are several),
    rewritten after each run so a run stopped part-way keeps what it measured."""
    from fedhisto.entry import study_config_file

    pipeline = study_config_file(args.config) if getattr(args, "config", None) else load_config({})
    members = args.members if isinstance(args.members, list) else [args.members]
    results = []
    for n in members:
        results.append(run_bench(pipeline, args.encoder, n, args.iters, args.warmup, args.inference_batch,
                                 args.compile or None, depth=getattr(args, "depth", None),
                                 view_samples=getattr(args, "view_samples", 16), micro=args.micro_batch,
                                 accum=args.accumulation_steps))
        print(format_table(results[-1]), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            write_json(args.json, results if len(members) > 1 else results[0])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0
