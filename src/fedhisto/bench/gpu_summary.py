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

Seconds = training pairs / training pairs/s + training pairs / view pairs/s (views are made, then
trained on, one after the other in the engines) + inference images / pipeline inference images/s
(float32 at ``evaluate.eval_batch``, as ``train.inference.predict`` runs). The batched figure takes
the 25-member bench (five clients of five seeds at once) with device views; the sequential figure
the 5-member bench (one participant after the other) with one process of host views, today's
default engine. What the estimate leaves out: aggregation (a few small SVDs per round), checkpoints,
process start-up, and any overlap of host work with the GPU (none today).
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
    return (work.training_pairs / train_pairs_s + work.training_pairs / view_pairs_s
            + work.inference_images / inference_images_s)


def estimates(work: GridWork, bench: Any) -> dict[str, float]:
    """Hours for the grid: batched (25 members, device views) and sequential (5 members, host views);
    without those rows (a dry run), the largest and the smallest member count measured."""
    big = by_members(bench, 25) or max(_rows(bench), key=lambda r: r["members"])
    small = by_members(bench, 5) or min(_rows(bench), key=lambda r: r["members"])
    out = {"batched_members": big["members"], "sequential_members": small["members"]}
    inference = big["pipeline_inference_images_s"]
    out["batched_hours"] = grid_seconds(work, big["batched_pairs_s"], big["device_view_pairs_s"], inference) / 3600
    out["model_only_hours"] = (work.training_pairs / big["batched_pairs_s"] + work.inference_images
                               / big["inference_images_s"]) / 3600
    out["sequential_hours"] = grid_seconds(work, small["sequential_pairs_s"], small["host_view_pairs_s"],
                                           small["pipeline_inference_images_s"]) / 3600
    return out


def _bench_table(bench: Any) -> list[str]:
    lines = ["| members | sequential pairs/s | batched pairs/s | speed-up | inference images/s (batch) | "
             "inference as the pipeline (float32) | peak memory (GiB) | host views pairs/s | device views pairs/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in _rows(bench):
        compiled = f", compiled (first step {r['compile_warmup_s']:.0f} s)" if r.get("compile") else ""
        lines.append(f"| {r['members']} | {r['sequential_pairs_s']:.4g} | {r['batched_pairs_s']:.4g}{compiled} | "
                     f"{r['speedup']:.2f}x | {r['inference_images_s']:.4g} ({r['inference_batch']}) | "
                     f"{r.get('pipeline_inference_images_s', float('nan')):.4g} | {r['peak_memory_gib']:.2f} | "
                     f"{r['host_view_pairs_s']:.4g} | {r.get('device_view_pairs_s', float('nan')):.4g} |")
    return lines


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
        verdict = "under" if est["batched_hours"] < TARGET_HOURS else "over"
        lines += [f"- batched engine, {est['batched_members']} members, device views: **{est['batched_hours']:.2f} h** "
                  f"({verdict} the {TARGET_HOURS:g} h target)",
                  f"- model compute alone at the bench's batched and large-batch inference rates: "
                  f"{est['model_only_hours']:.2f} h",
                  f"- sequential engine, {est['sequential_members']} members, host views in one process (today's "
                  f"default): {est['sequential_hours']:.2f} h"]
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
