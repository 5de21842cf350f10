"""The GPU path checked on a CPU: bf16 autocast for every registered method, and torch.compile of the
batched engine's encoder pass (inductor compiles for the CPU too).

bf16 tolerance: autocast runs the matmuls (encoder, LoRA, heads) with bf16 inputs, 8 significant
bits (relative rounding about 2^-9 = 0.2 %). Through two local epochs of AdamW, whose update is
normalised by sqrt(v) so that the sign of a small gradient component decides its step, a round's end
state under bf16 differs from the float32 one by 4 to 8 % of the round's update (measured on 2 CPU
threads for every method, both engines: 0.037 (pooled) to 0.077 (past_v1)); the bound is 15 %. A
broken bf16 path (a NaN, a loss term dropped, a view cast wrongly) moves the state by the order of
the update itself. The gap must also exceed 1 % of the update, or bf16 never ran (float32 against
itself gives about 1e-6). Loss means differ by at most 1.1 % (bound 3 %).

compile tolerance: inductor fuses and reorders float32 reductions (layer norm, softmax, matmul
epilogues), a few float32 ulps per operation, as the batched engine's own reordering
(tests/test_batched.py: below 1e-4 absolute after a round); one step's loss and gradients agree to
rtol 1e-4 / atol 1e-6. The compile test uses a one-block tiny encoder and one row layout, so it
compiles one graph (forward and backward), about 20-40 s of CPU here.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_batched import CFG, perturbed, round_inputs, split

from fedhisto.config.study import load_config
from fedhisto.methods import build_method, method_names
from fedhisto.methods.base import Batch, training_autocast
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.batched import (
    Layout,
    batched_local_train,
    compiled_embedding,
    stack_states,
    stacked_forward,
)
from fedhisto.train.local import local_train
from fedhisto.train.plan import MemberJob, local_run

BF16_BOUND = 0.15
BF16_FLOOR = 0.01
# Plain SGD (SCAFFOLD's local steps) moves by lr * g, linear in the gradient, so bf16's rounding stays at its
# own relative size in the update (measured 0.8 % on this round) where Adam's normalisation amplifies it
# in the small-gradient coordinates; a floor of 0.2 % still tells bf16 from float32 (which gives 0 exactly).
BF16_FLOOR_SGD = 0.002


def _norm(state: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    return sum(float((state[k] - other[k]).double().norm() ** 2) for k in state) ** 0.5


def _round(name: str, precision: str, engine: str):
    cfg, method, model, device, jobs = round_inputs(name, {"precision": precision})
    if engine == "batched":
        return jobs, batched_local_train(method.objective, model, jobs, cfg, device)
    return jobs, [local_train(method.objective, model, j.start_state, j.data, j.descriptor, j.payload, cfg, j.seed,
                              j.round_idx, j.client_idx, device) for j in jobs]


@pytest.mark.parametrize("engine", ["sequential", "batched"])
@pytest.mark.parametrize("name", method_names())
def test_a_bf16_round_stays_finite_and_close_to_float32(name: str, engine: str):
    """train.precision: bf16 runs on the CPU the autocast a GPU run gets by default (auto), for every
    registered method's local training (its pre-round upload, e.g. SCAFFOLD's start gradient, too)."""
    jobs, f32 = _round(name, "float32", engine)
    _, bf16 = _round(name, "bf16", engine)
    for f, b, j in zip(f32, bf16, jobs, strict=True):
        assert all(bool(torch.isfinite(v).all()) for v in b.state.values()), name
        assert all(np.isfinite(v) for v in b.losses.values()), (name, b.losses)
        update, gap = _norm(f.state, j.start_state), _norm(f.state, b.state)
        assert update > 0
        floor = (BF16_FLOOR_SGD if build_method(name, load_config({})).objective.local_schedule(0).optimizer == "sgd"
                 else BF16_FLOOR)
        assert floor * update < gap < BF16_BOUND * update, (name, gap / update)
        assert b.losses.keys() == f.losses.keys()
        for k in f.losses:
            assert b.losses[k] == pytest.approx(f.losses[k], rel=0.03, abs=1e-3), (name, k)


def test_precision_default_is_the_studys_amp_and_leaves_identities_unchanged():
    from fedhisto.config.stage_blocks import training_settings

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not isinstance(training_autocast(cpu), torch.autocast)            # auto on a CPU: float32
    with warnings.catch_warnings():  # "CUDA is not available ... disabling autocast": the object is what counts
        warnings.simplefilter("ignore")
        cuda_amp = training_autocast(cuda)                                     # auto on CUDA: bf16 (the study)
    assert isinstance(cuda_amp, torch.autocast) and cuda_amp.fast_dtype == torch.bfloat16
    assert not isinstance(training_autocast(cuda, "float32"), torch.autocast)
    forced = training_autocast(cpu, "bf16")
    assert isinstance(forced, torch.autocast) and forced.device == "cpu" and forced.fast_dtype == torch.bfloat16
    assert "precision" not in training_settings(load_config(CFG), "past_v2")
    assert "compile" not in training_settings(load_config(CFG), "past_v2")
    set_ = load_config({**CFG, "train": {**CFG["train"], "precision": "bf16", "engine": "batched", "compile": True}})
    assert training_settings(set_, "past_v2")["precision"] == "bf16"
    assert training_settings(set_, "past_v2")["compile"] is True


def test_compile_is_refused_under_the_sequential_engine():
    from fedhisto.infra.settings_base import ConfigError

    with pytest.raises((ConfigError, ValueError), match=r"train\.compile.*train\.engine: batched"):
        load_config({**CFG, "train": {**CFG["train"], "compile": True, "engine": "sequential"}})


# ------------------------------------------------------------------ torch.compile
def _one_block_round(compile_: bool):
    """Two members of eight images each: every micro-batch has the same row layout (one graph)."""
    cfg = load_config({**CFG, "train": {**CFG["train"], "engine": "batched", "compile": compile_,
                                        "local_epochs": 1}})
    method = build_method("past_v2", cfg)
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny", depth=1), cfg.model, film=method.film)
    start = perturbed(model.trainable_state(), 7)
    desc = torch.linspace(-1, 1, 14)
    jobs = [MemberJob(start, split(8, 20 + k), desc, {}, 11, 1, k) for k in range(2)]
    return cfg, method, model, jobs


@pytest.fixture
def one_compile_thread(monkeypatch):
    """Inductor compiles in-process (no worker pool on the two shared cores)."""
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor, "compile_threads", 1)


def test_compiled_batched_step_and_round_equal_the_eager_ones(one_compile_thread):
    cfg, method, model, jobs = _one_block_round(True)
    device = torch.device("cpu")
    params = stack_states([j.start_state for j in jobs], device)
    objective = method.objective
    plan = objective.local_schedule(1)
    runs = [local_run(model, j, cfg, plan, device, {}) for j in jobs]
    rng = np.random.default_rng(0)
    micro = plan.micro_batch
    pixels = torch.tensor(rng.normal(size=(2 * 2 * micro, 3, 48, 48)), dtype=torch.float32)
    layout = Layout(members=[0, 1, 0, 1], sizes=[micro] * 4, specs=[None] * 4)  # view-major, as the engine
    layout.index = torch.tensor(layout.members)
    descriptors = torch.stack([j.descriptor[None] for j in jobs])
    batch = Batch(np.arange(micro), torch.arange(micro) % 3, 0, 0, 0)

    def step(embed):
        for p in params.values():
            p.grad = None
        logits, zs = stacked_forward(model, objective, params, layout, pixels, descriptors, embed=embed)
        total = 0
        for m in range(2):
            rows = [slice((k * 2 + m) * micro, (k * 2 + m + 1) * micro) for k in range(2)]
            terms = objective.terms_from_outputs(runs[m], batch, [logits[r] for r in rows], [zs[r] for r in rows])
            total = total + sum(terms.values())
        total.backward()
        return float(total.detach()), {n: p.grad.clone() for n, p in params.items()}

    from torch._dynamo.utils import counters

    model.train()
    eager_loss, eager_grads = step(None)
    graphs = counters["stats"]["unique_graphs"]
    compiled_loss, compiled_grads = step(compiled_embedding(model))
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo captured the pass (errors would have raised)
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    assert eager_grads.keys() == compiled_grads.keys()
    for n in eager_grads:
        assert float(eager_grads[n].abs().max()) > 0 or "lora_A" in n, n  # the gradient is not trivially zero
        torch.testing.assert_close(compiled_grads[n], eager_grads[n], rtol=1e-4, atol=1e-6, msg=n)

    # the engine under train.compile: a round of the same two members ends where the eager one does
    compiled_round = batched_local_train(method.objective, model, jobs, cfg, device)
    eager_cfg, eager_method, _, _ = _one_block_round(False)
    eager_round = batched_local_train(eager_method.objective, model, jobs, eager_cfg, device)
    for c, e, j in zip(compiled_round, eager_round, jobs, strict=True):
        assert _norm(e.state, j.start_state) > 0
        assert max(float((c.state[k] - e.state[k]).abs().max()) for k in e.state) < 1e-4
        for k in e.losses:
            assert c.losses[k] == pytest.approx(e.losses[k], rel=1e-4, abs=1e-6)


# ------------------------------------------------------------------ the GPU check's report
def test_the_full_grid_is_the_studys_39_runs_and_its_work_follows_table_2():
    """39 runs: five principal methods and FedStain on five seeds, three ablations on three. Per round:
    2 epochs x 5,325 optimisation images (Table 2), paired for v2 and its ablations (14 runs), half a
    pair per image for the 25 single-view runs; 1,419 validation images; 2,677 prototype images (at most
    256 per client and present class) for v1, v2, no-JS, no-feat (16 runs); 2,869 final images per run."""
    from fedhisto.bench.gpu_summary import study_work

    work = study_work()
    assert work.runs == 39 and work.rounds == 50
    assert work.training_pairs == 50 * (14 * 2 * 5325 + 25 * 5325)  # 14,111,250
    assert work.inference_images == 50 * (39 * 1419 + 16 * 2677) + 39 * 2869  # 5,020,541


def _bench_row(members: int, **figures) -> dict:
    row = {"device": "GPU", "encoder": "hibou-b", "members": members, "pipeline_members": 5, "micro_batch": 4,
           "accumulation_steps": 2, "compile": False, "depth": 12, "full_depth": True, "sequential_pairs_s": 100.0,
           "batched_pairs_s": 2500.0, "speedup": 25.0, "inference_images_s": 10000.0, "inference_batch": 512,
           "pipeline_inference_images_s": 4000.0, "peak_memory_gib": 20.0, "host_view_pairs_s": 50.0,
           "host_view_workers": 15, "host_pool_pairs_s": 600.0, "device_view_pairs_s": 20000.0,
           "view_pipeline": "host"}
    return {**row, **figures}


def test_the_grid_estimate_is_the_pipelines_configuration_with_views_overlapped_by_the_workers(tmp_path):
    import json

    from fedhisto.bench.gpu_summary import estimates, markdown, study_work

    work = study_work()
    bench = [_bench_row(5, batched_pairs_s=1000.0), _bench_row(25)]
    est = estimates(work, bench)
    # one job per method and seed: the 5-member row; host views by 15 workers at 600 pairs/s overlap a
    # 1 ms step: a pair costs max(1 ms, 1.667 ms), the views hold up 40 % of it
    assert est["members"] == 5 and est["pair_s"] == pytest.approx(1 / 600)
    assert est["views_waited"] == pytest.approx(1 - 600 / 1000)
    assert est["pipeline_hours"] == pytest.approx((work.training_pairs / 600 + work.inference_images / 4000) / 3600)
    # seeds stacked (not what the pipeline runs): the 25-member row, views on the device after the step
    assert est["stacked_hours"] == pytest.approx(
        (work.training_pairs / 2500 + work.training_pairs / 20000 + work.inference_images / 4000) / 3600)
    assert est["sequential_hours"] == pytest.approx(
        (work.training_pairs / 100 + work.training_pairs / 50 + work.inference_images / 4000) / 3600)
    no_workers = estimates(work, [_bench_row(5, host_pool_pairs_s=None, host_view_workers=0)])
    assert no_workers["pair_s"] == pytest.approx(1 / 2500 + 1 / 50)  # the engine's thread makes them first
    on_device = estimates(work, [_bench_row(5, view_pipeline="device")])
    assert on_device["pair_s"] == pytest.approx(1 / 2500 + 1 / 20000)
    (tmp_path / "env.json").write_text(json.dumps({"device": "NVIDIA H200", "dry_run": False, "torch": "2.11"}))
    (tmp_path / "bench_hibou.json").write_text(json.dumps(bench))
    (tmp_path / "bench_uni.json").write_text(json.dumps(_bench_row(5, encoder="phikon-v2")))
    block = markdown(tmp_path)
    assert "### GPU check (NVIDIA H200" in block
    assert (f"as the pipeline runs it (batched engine, 5 members per job, host views, 15 view workers): "
            f"**{est['pipeline_hours']:.2f} h**") in block
    assert "the views hold up 40 % of the pair's time" in block
    assert "UNI-size: phikon-v2 (transformers ViT-L/16" in block
    assert "bench_compile.json: not produced" in block and "Dry run" not in block
    (tmp_path / "bench_compile.json").write_text(json.dumps(_bench_row(25, compile=True, batched_pairs_s=3000.0,
                                                                       compile_warmup_s=80.0)))
    assert "- torch.compile at 25 members: 3000 pairs/s against 2500 eager (1.20x; first step 80 s)" in markdown(tmp_path)


def test_the_bench_measures_the_pipelines_own_configuration():
    """``fedhisto bench`` reads the pipeline's config: for the study's (config/paper.yaml) it trains what one
    training job trains (encoder, heads, crop, the method's micro-batch and accumulation, the round's five
    participants, engine, views, precision); a toy run on the CPU reports those settings."""
    from pathlib import Path

    import yaml

    from fedhisto.bench.throughput import METHOD, bench_settings, run_bench
    from fedhisto.config.stage_blocks import training_settings
    from fedhisto.entry import study_config

    paper = study_config(yaml.safe_load((Path(__file__).resolve().parents[1] / "config/paper.yaml").read_text()))
    got = bench_settings(paper)
    plan = build_method(METHOD, paper).objective.local_schedule(0)
    train = {**paper.train.model_dump(), **training_settings(paper, METHOD)}
    assert got["encoder"] == paper.model.encoder.name == "hibou-b"
    assert (got["adapter_hidden"], got["film_hidden"], got["crop"]) == (paper.model.adapter_hidden,
                                                                      paper.model.film_hidden, paper.views.crop_size)
    assert (got["micro_batch"], got["accumulation_steps"]) == (plan.micro_batch, plan.accumulation) == (4, 2)
    assert got["members"] == got["pipeline_members"] == len(paper.partition_targets().clients) == 5
    for key in ("engine", "view_pipeline", "view_workers", "precision", "compile"):
        assert got[key] == train[key], key
    assert got["eval_batch"] == paper.evaluate.eval_batch
    tiny = load_config({"model": {"encoder": {"name": "tiny", "require_pretrained": False}}, "views": {"crop_size": 32}})
    r = run_bench(tiny, iters=1, warmup=1, inference_batch=2, view_samples=2, micro=1, accum=1)
    assert (r["encoder"], r["members"], r["crop"], r["engine"], r["view_pipeline"]) == ("tiny", 5, 32, "batched", "host")
    assert r["host_view_workers"] == 0 and r["host_pool_pairs_s"] is None  # a CPU: no view workers


#: the package's dependencies (and extras) the GPU machine's image lacks; pydantic travels as a wheel
NOT_ON_THE_DEVICE = ("snakemake", "jsonschema", "imagehash", "flwr", "opacus")


def test_the_gpu_checks_modules_import_without_what_the_device_image_lacks():
    """gpu_check.sh runs fedhisto from src/ on an image with torch, transformers, peft, timm, opencv,
    numpy, pandas, scikit-learn, pillow and pyyaml but no registry: its steps must not import any of
    NOT_ON_THE_DEVICE (refused here by an import hook), whatever else the pipeline needs them for."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    code = f"""
import importlib.abc, importlib.util, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_ON_THE_DEVICE!r}:
            raise ImportError(f"{{name}} is not on the GPU machine")
sys.meta_path.insert(0, Refuse())
import fedhisto.bench.throughput, fedhisto.bench.gpu_summary, fedhisto.cli, fedhisto.train.loop, fedhisto.train.participants
sys.path.insert(0, "{repo}/benchmarks")
for script in ("gpu_round", "gpu_report", "gpu_path", "host_view_share"):
    spec = importlib.util.spec_from_file_location(script, "{repo}/benchmarks/" + script + ".py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
fedhisto.bench.gpu_summary.study_work()
fedhisto.cli.build_parser().parse_args(["bench", "--members", "5", "25", "--compile", "--depth", "1",
                                         "--config", "config/paper.yaml"])
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.skipif(not __import__("os").environ.get("FEDHISTO_GPU_DRY_RUN"),
                    reason="minutes of CPU: set FEDHISTO_GPU_DRY_RUN=1 to run benchmarks/gpu_check.sh --dry-run")
def test_gpu_check_dry_run_passes_end_to_end(tmp_path):
    import json
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(repo / "benchmarks/gpu_check.sh"), "--dry-run"], cwd=repo,
                          env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = {"env.json", "path.json", "bench_hibou.json", "bench_uni.json", "round.json", "bench_compile.json",
             "performance_block.md", "check.log"}
    assert {p.name for p in tmp_path.iterdir()} == names  # the device tool returns at most 8 files
    path = json.loads((tmp_path / "path.json").read_text())
    assert path["device"]["ok"] and path["resume"]["ok"] and path["views"]["ok"]
    assert path["resume"]["resumed_at_rounds"] == [1] and path["resume"]["bitwise"]  # one CPU, one build
    assert [r["members"] for r in json.loads((tmp_path / "bench_hibou.json").read_text())] == [1, 2]
    rounds = json.loads((tmp_path / "round.json").read_text())
    assert {(r["engine"], r["view_pipeline"]) for r in rounds} == {(e, v) for e in ("sequential", "batched")
                                                                   for v in ("host", "device")}
    assert json.loads((tmp_path / "bench_compile.json").read_text())["compile"] is True
    block = (tmp_path / "performance_block.md").read_text()
    assert "Dry run on a CPU" in block and "The GPU path:" in block and "resume: killed (SIGKILL)" in block


@pytest.mark.zoo
def test_the_uni_bench_runs_the_timm_vit_l_at_toy_size():
    """The GPU check's bench_uni step on timm's fused-qkv ViT-L/16 (one block, batches of one): the
    member LoRA patch, both engines' steps and the inference passes run and give positive rates."""
    pytest.importorskip("timm")
    from fedhisto.bench.throughput import run_bench

    r = run_bench(encoder="uni", members=2, micro=1, accum=1, iters=1, warmup=1, inference_batch=2, depth=1, view_samples=2)
    assert (r["encoder"], r["depth"], r["full_depth"], r["members"]) == ("uni", 1, False, 2)
    for key in ("sequential_pairs_s", "batched_pairs_s", "inference_images_s", "pipeline_inference_images_s",
                "host_view_pairs_s", "device_view_pairs_s", "batched_tflops"):
        assert np.isfinite(r[key]) and r[key] > 0, key


# ------------------------------------------------------------------ torch.compile: no recompile per step
def _compile_jobs(name: str, images: int):
    """One round of ``name`` under train.compile on a one-block encoder, every client with ``images`` images,
    so every micro-batch step of the round has the same row layout."""
    cfg = load_config({**CFG, "train": {**CFG["train"], "engine": "batched", "compile": True, "local_epochs": 1,
                                        "paired_micro_batch": 2, "accumulation_steps": 1, "single_view_batch": 2}})
    method = build_method(name, cfg)
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny", depth=1), cfg.model, film=method.film)
    device = torch.device("cpu")
    clients = {c: split(images, 30 + k) for k, c in enumerate(("C1", "C2"))}
    rng = np.random.default_rng(5)
    doc = {"clients": {c: {"standardised": rng.normal(size=14).tolist()} for c in clients},
           "centroid": {"standardised": rng.normal(size=14).tolist()}}
    descriptors = method.descriptors(doc, sorted(clients))
    start = perturbed(model.trainable_state(), 7)
    from fedhisto.methods.base import named_rng

    uploads = {n: method.objective.upload_before_training(model, start, clients[n], named_rng("style_sample", 11, 1, k), device)
               for k, n in enumerate(sorted(clients))} if method.pre_uploads else dict.fromkeys(clients)
    payloads = method.configure_train(1, None, uploads)
    jobs = [MemberJob(start, clients[n], descriptors[n], payloads[n], 11, 1, k) for k, n in enumerate(sorted(clients))]
    return cfg, method.objective, model, device, jobs


@pytest.mark.parametrize("name", ["past_v2", "fedstain"])
def test_compiled_steps_of_one_layout_add_no_graph_after_the_second(name: str, monkeypatch):
    """train.compile: dynamo compiles the encoder pass once per row layout; steps that repeat a layout
    (and later rounds) reuse it. Counted by torch._dynamo's own ``unique_graphs`` before each step's pass
    (the backend is "eager": recompiles are decided by dynamo's guards, whatever compiles the graph).
    Three rounds of three steps each, every step with the same layout: the graph count after the first
    step's pass is the last new one (forward and backward of one layout)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import fedhisto.train.batched as batched

    torch._dynamo.reset()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager"))
    batched._compiled_pass.cache_clear()
    seen: list[tuple] = []
    real = batched.stacked_forward

    def recording(model, method, params, layout, pixels, descriptors, **kw):
        out = real(model, method, params, layout, pixels, descriptors, **kw)
        seen.append((tuple(layout.members), tuple(layout.sizes), tuple(s is None for s in layout.specs),
                     counters["stats"]["unique_graphs"]))
        return out

    monkeypatch.setattr(batched, "stacked_forward", recording)
    try:
        cfg, method, model, device, jobs = _compile_jobs(name, 6)
        compiled = [batched_local_train(method, model, jobs, cfg, device) for _ in range(3)]
    finally:
        batched._compiled_pass.cache_clear()
        torch._dynamo.reset()
    assert len(seen) == 9 and len({s[:3] for s in seen}) == 1, seen  # nine steps, one layout
    graphs = [s[3] for s in seen]
    assert graphs[0] >= 1 and graphs[1:] == [graphs[0]] * 8, graphs  # nothing compiled after the first step
    # and the graphs do what the eager pass does (FedStain's restyling included: dynamo runs its numpy
    # draws eagerly at a graph break); the eager backend replays the same ops in the same order
    eager_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})})
    eager = batched_local_train(method, model, jobs, eager_cfg, device)
    for rnd in compiled:
        for c, e in zip(rnd, eager, strict=True):
            assert max(float((c.state[k] - e.state[k]).abs().max()) for k in e.state) < 1e-6


def test_gpu_check_parses_and_its_device_part_refuses_a_hidden_gpu_on_a_cpu(tmp_path):
    """The script parses (bash -n); its first step runs here: on a CPU ``auto`` picks the CPU, and a job
    declaring a GPU with every GPU hidden stops naming why (the full --dry-run: FEDHISTO_GPU_DRY_RUN=1)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    assert subprocess.run(["bash", "-n", str(repo / "benchmarks/gpu_check.sh")]).returncode == 0
    out = tmp_path / "path.json"
    env = {**os.environ, "PYTHONPATH": f"{repo / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(repo / "benchmarks/gpu_path.py"), "device", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    device = json.loads(out.read_text())["device"]
    assert device["auto"] == "cpu" and device["ok"]
    assert device["hidden_gpu_job"].startswith("DeviceUnavailable: this job declares 1 GPU(s)")


def test_the_host_view_share_benchmark_reports_a_share_per_round(tmp_path):
    """benchmarks/host_view_share.py at toy size: one row per (engine, workers), the share in [0, 1] (a
    figure, not a timing assertion)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("host_view_share", bench / "host_view_share.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--images-per-client", "2", "--workers", "0", "1", "--out", str(tmp_path)])
    assert [(r["engine"], r["view_workers"]) for r in rows] == [("batched", 0), ("batched", 1)]
    assert all(0 < r["host_view_s"] < r["round_s"] and 0 < r["host_view_share"] < 1 for r in rows)
