"""What the GPU check (``benchmarks/gpu_check.sh``) measured, as a Markdown block for docs/changelog.md,
and the full-grid estimate: the study's 39 runs on one GPU.

The grid (study sections 2 and 7): the five principal methods and FedStain on seeds 11-55 (30 runs),
the three v2 ablations on 11/33/55 (9 runs), at most 50 rounds each (no early stop assumed: an upper
bound). Per round and run: two local epochs over the five clients' optimisation sets (Table 2:
5,325 images), two stain views per image for the paired methods (v2 and its ablations) and one
for the others (counted as half a pair: one view's forward and backward); a validation pass over
the 1,419 global-validation images; for the prototype methods (v1, v2, no-JS, no-feat) one forward
over at most ``proto_max_images`` optimisation images per client and present class (2,677). Once
per run: the test set, the client holdouts and the external cohort (2,869 images).

Seconds = training pairs x seconds per pair + inference images / pipeline inference images/s (float32 at
``evaluate.eval_batch``, as ``train.inference.predict`` runs). Seconds per pair are the pipeline's: the
bench row of one job's members (``fedhisto bench`` measures the pipeline's configuration,
``bench.throughput.bench_settings``: the pipeline runs one job per method and seed), the batched step plus
its views: made on the host by the view workers while the step runs (only what exceeds the step waits),
by the engine's thread before the step without workers, or on the device after it (``pair_split``, which
also gives the host/device split). Beside it: seeds stacked in one job (25 members, device views; not what
the pipeline runs) and the sequential engine with host views in one thread. What the estimate leaves out:
aggregation (a few small SVDs per round), checkpoints and process start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the study's grid: (method, number of seeds)
STUDY_GRID = (("fedavg_peft", 5), ("fedprox_peft", 5), ("film_zero", 5), ("past_v1", 5), ("past_v2", 5),
              ("fedstain", 5), ("v2_no_js", 3), ("v2_no_feat", 3), ("v2_no_proto", 3))
MAX_ROUNDS = 50
TARGET_HOURS = 2.0


@dataclass(frozen=True)
class GridWork:
    runs: int
    rounds: int
    training_pairs: float      # pair-equivalents trained over the whole grid
    inference_images: int      # validation, prototype and final-evaluation forwards


def study_work(rounds: int = MAX_ROUNDS) -> GridWork:
    """The grid's work from the study's Table 2 and the methods' registrations (no data needed)."""
    from fedhisto.config.profiles import PROFILES
    from fedhisto.config.study import load_config
    from fedhisto.manifest.targets import study_table2
    from fedhisto.methods import build_method

    table = study_table2()
    clients = sorted({c for c, _ in table if c.startswith("C")})
    cfg = load_config({})
    epochs = cfg.train.local_epochs
    optimisation = sum(sum(table[(c, "optimisation")]) for c in clients)
    validation = sum(table[("validation", "all")])
    final = (sum(table[("test", "all")]) + sum(sum(table[(c, "holdout")]) for c in clients)
             + sum(PROFILES["paper"].external))
    pairs, images, runs = 0.0, 0, 0
    for name, seeds in STUDY_GRID:
        method = build_method(name, cfg)
        per_round_pairs = epochs * optimisation * (1.0 if method.objective.paired_views else 0.5)
        per_round_images = validation
        if getattr(method, "prototypes", "none") != "none":
            cap = method.settings.proto_max_images
            per_round_images += sum(min(n, cap) for c in clients for n in table[(c, "optimisation")])
        pairs += seeds * rounds * per_round_pairs
        images += seeds * (rounds * per_round_images + final)
        runs += seeds
    return GridWork(runs, rounds, pairs, images)


def _rows(data: Any) -> list[dict]:
    return data if isinstance(data, list) else [data]


def by_members(bench: Any, members: int) -> dict | None:
    return next((r for r in _rows(bench) if r.get("members") == members), None)


def grid_seconds(work: GridWork, train_pairs_s: float, view_pairs_s: float, inference_images_s: float) -> float:
    """Views made, then trained on, one after the other (views on the critical path in full)."""
    return (work.training_pairs / train_pairs_s + work.training_pairs / view_pairs_s
            + work.inference_images / inference_images_s)


def pair_split(row: dict, view_pipeline: str = "host") -> dict[str, float]:
    """Seconds per training pair of a bench row as the pipeline runs it: the batched step on the device,
    and the views: on the device after the step (``device``), or made on the host, by the view workers
    while the step runs (overlapped: only what exceeds the step waits) or, without workers, by the
    engine's thread before it. ``views_waited``: the views' share of the critical path."""
    step = 1 / row["batched_pairs_s"]
    if view_pipeline == "device":
        views = 1 / row["device_view_pairs_s"]
        total = step + views
    elif row.get("host_pool_pairs_s"):
        views = 1 / row["host_pool_pairs_s"]
        total = max(step, views)
    else:
        views = 1 / row["host_view_pairs_s"]
        total = step + views
    return {"step_s": step, "views_s": views, "pair_s": total, "views_waited": (total - step) / total}


def estimates(work: GridWork, bench: Any) -> dict[str, float]:
    """Hours for the grid as the pipeline runs it: one job per method and seed (the bench row of the
    pipeline's members per job), its view pipeline, views overlapped by the view workers where they run;
    and, where measured, seeds stacked in one job (25 members, device views), which the pipeline does
    not run, and the sequential engine (DP-SGD, Flower sites) with host views in one thread."""
    rows = _rows(bench)
    members = rows[0].get("pipeline_members", 5)
    row = by_members(bench, members) or min(rows, key=lambda r: r["members"])
    view_pipeline = row.get("view_pipeline", "host")
    split = pair_split(row, view_pipeline)
    inference = row["pipeline_inference_images_s"]
    out = {"members": row["members"], "view_pipeline": view_pipeline, "view_workers": row.get("host_view_workers", 0),
           **split, "pipeline_hours": (work.training_pairs * split["pair_s"] + work.inference_images / inference) / 3600,
           "model_only_hours": (work.training_pairs / row["batched_pairs_s"] + work.inference_images
                                / row["inference_images_s"]) / 3600,
           "sequential_hours": grid_seconds(work, row["sequential_pairs_s"], row["host_view_pairs_s"], inference) / 3600}
    stacked = by_members(bench, 25)
    if stacked is not None and stacked is not row:
        out["stacked_hours"] = grid_seconds(work, stacked["batched_pairs_s"], stacked["device_view_pairs_s"],
                                            stacked["pipeline_inference_images_s"]) / 3600
    return out


def _pool(r: dict) -> str:
    return f"{r['host_pool_pairs_s']:.4g} ({r['host_view_workers']})" if r.get("host_pool_pairs_s") else "none"


def _bench_table(bench: Any) -> list[str]:
    lines = ["| members | sequential pairs/s | batched pairs/s | speed-up | inference images/s (batch) | "
             "inference as the pipeline (float32) | peak memory (GiB) | host views pairs/s | host views, view workers "
             "| device views pairs/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in _rows(bench):
        compiled = f", compiled (first step {r['compile_warmup_s']:.0f} s)" if r.get("compile") else ""
        lines.append(f"| {r['members']} | {r['sequential_pairs_s']:.4g} | {r['batched_pairs_s']:.4g}{compiled} | "
                     f"{r['speedup']:.2f}x | {r['inference_images_s']:.4g} ({r['inference_batch']}) | "
                     f"{r.get('pipeline_inference_images_s', float('nan')):.4g} | {r['peak_memory_gib']:.2f} | "
                     f"{r['host_view_pairs_s']:.4g} | {_pool(r)} | {r.get('device_view_pairs_s', float('nan')):.4g} |")
    return lines


def _path_lines(path: dict | None) -> list[str]:
    """The GPU path (benchmarks/gpu_path.py): the device picked, the resume after a kill, the host-view share."""
    if not path:
        return ["path.json: not produced (see its log)", ""]
    lines = ["The GPU path:", ""]
    d = path.get("device")
    if d:
        lines.append(f"- device: `train.device: auto` picks {d['auto']}; a job declaring a GPU with every GPU hidden "
                     f"stops: `{d['hidden_gpu_job'][:160]}` ({'as it should' if d['ok'] else 'NOT as it should'})")
    r = path.get("resume")
    if r:
        same = "bitwise" if r["bitwise"] else f"largest difference {r['max_abs_difference']:.3g}"
        lines.append(f"- resume: killed (SIGKILL) after round 1's checkpoint, resumed in a fresh process at rounds "
                     f"{r['resumed_at_rounds']}, ended at round {r['rounds'][1]} of {r['rounds'][0]}; against the "
                     f"uninterrupted run: {same} ({'passed' if r['ok'] else 'FAILED'}, {r['seconds']} s)")
    v = path.get("views")
    if v:
        lines += ["", "| engine | view workers | round (s) | host views on the engine's path (s) | share |",
                  "|---|---|---|---|---|"]
        lines += [f"| {x['engine']} | {x['view_workers']} | {x['round_s']:.2f} | {x['host_view_s']:.2f} | "
                  f"{100 * x['host_view_share']:.0f} % |" for x in v["rows"]]
    return [*lines, ""]


def markdown(out: Path) -> str:
    """The block for docs/changelog.md from the JSON files gpu_check.sh left in ``out``."""
    def load(name: str) -> Any:
        path = out / name
        return json.loads(path.read_text()) if path.exists() else None

    env = load("env.json") or {}
    lines = [f"### GPU check ({env.get('device', 'unknown device')}, {env.get('date', 'date not recorded')})", "",
             f"`bash benchmarks/gpu_check.sh{' --dry-run' if env.get('dry_run') else ''}`: Python "
             f"{env.get('python')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
             f"peft {env.get('peft')}, timm {env.get('timm') or 'absent'}; random weights of each encoder's exact "
             "shape; bf16 autocast on the GPU as the engines use it; micro-batch 4 pairs x 2 accumulation steps.",
             ""]
    if env.get("dry_run"):
        lines += ["**Dry run on a CPU at toy sizes (reduced depth, tiny batches): these figures say the script "
                  "works, nothing about a GPU.**", ""]
    lines += _path_lines(load("path.json"))
    for name, title in (("bench_hibou.json", "HIBOU-B (ViT-B/14, 85.7M)"), ("bench_uni.json", None),
                        ("bench_compile.json", "")):
        bench = load(name)
        if bench is None:
            lines += [f"{name}: not produced (see its log)", ""]
            continue
        first = _rows(bench)[0]
        if title == "":
            title = f"{first['encoder']}, batched step under torch.compile (train.compile)"
        if title is None:
            title = ("UNI (timm ViT-L/16, 303M)" if first["encoder"] == "uni" else
                     f"UNI-size: {first['encoder']} (transformers ViT-L/16, 303M; timm was absent)")
        depth = "" if first.get("full_depth", True) else f", depth {first['depth']} only (toy)"
        lines += [f"{title}{depth}:", "", *_bench_table(bench), ""]
    rounds = load("round.json")
    if rounds:
        lines += ["One study-shape round (five clients, validation, prototypes, aggregation), "
                  f"{rounds[0]['encoder']}, {rounds[0]['images_per_client']} images per client:", "",
                  "| method | engine | views | seconds per round | pairs/s end to end | peak memory (GiB) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['engine']} | {r.get('view_pipeline', 'host')} | {r['seconds_per_round']:.1f} | "
                  f"{r['pairs_per_s']:.1f} | {r['peak_gib'] if r['peak_gib'] is not None else 'n/a'} |" for r in rounds]
        lines.append("")
    hibou = load("bench_hibou.json")
    work = study_work()
    lines.append(f"Full-grid estimate ({work.runs} study runs x {work.rounds} rounds, no early stop; "
                 f"{work.training_pairs:,.0f} training pairs and {work.inference_images:,} inference images; "
                 "formula in `fedhisto.bench.gpu_summary`):")
    lines.append("")
    if hibou is None:
        lines.append("- not computed: bench_hibou.json missing")
    else:
        est = estimates(work, hibou)
        verdict = "under" if est["pipeline_hours"] < TARGET_HOURS else "over"
        workers = f", {est['view_workers']} view workers" if est["view_workers"] else ""
        per_job = f"{est['members']} member{'s' if est['members'] != 1 else ''} per job"
        lines += [f"- as the pipeline runs it (batched engine, {per_job}, "
                  f"{est['view_pipeline']} views{workers}): **{est['pipeline_hours']:.2f} h** ({verdict} the "
                  f"{TARGET_HOURS:g} h target)",
                  f"- host/device split per training pair: the step {1000 * est['step_s']:.2f} ms on the device, the "
                  f"views {1000 * est['views_s']:.2f} ms; the views hold up {100 * est['views_waited']:.0f} % of "
                  "the pair's time",
                  f"- model compute alone at the bench's batched and large-batch inference rates: "
                  f"{est['model_only_hours']:.2f} h"]
        if "stacked_hours" in est:
            lines.append(f"- five seeds stacked in one job (25 members, device views; not what the pipeline runs): "
                         f"{est['stacked_hours']:.2f} h")
        lines.append(f"- sequential engine (DP-SGD, Flower sites), host views in one thread: "
                     f"{est['sequential_hours']:.2f} h")
        compiled = load("bench_compile.json")
        if compiled is not None:
            c = _rows(compiled)[0]
            eager = by_members(hibou, c["members"])
            if eager is not None and eager["encoder"] == c["encoder"]:
                lines.append(f"- torch.compile at {c['members']} members: {c['batched_pairs_s']:.4g} pairs/s against "
                             f"{eager['batched_pairs_s']:.4g} eager ({c['batched_pairs_s'] / eager['batched_pairs_s']:.2f}x; "
                             f"first step {c['compile_warmup_s']:.0f} s)")
        if rounds:
            best = max(rounds, key=lambda r: r["pairs_per_s"])
            lines.append(f"- from the round's end-to-end rate ({best['engine']}, {best.get('view_pipeline', 'host')} "
                         f"views, {best['pairs_per_s']:.1f} pairs/s, validation and prototypes included; one run at "
                         f"a time): {work.training_pairs / best['pairs_per_s'] / 3600:.2f} h")
    if env.get("dry_run"):
        lines.append("- (dry run: the hours above are CPU toy-size figures, not an estimate of anything)")
    return "\n".join(lines) + "\n"
