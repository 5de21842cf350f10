"""The run's device, checked on a CPU: a full run, a kill and resume from its checkpoint, the server state of
FedAdam and SCAFFOLD, prediction and a package's classification, with every tensor the run puts on its device
kept apart from the CPU (tests/fake_device.py: torch's own device checks decide what may mix).

The fake device computes on the CPU. A resumed run on it is compared bitwise with the uninterrupted run on it
(same machine, same operations). Against the same run on the plain CPU the values agree to float32 rounding
only: for a tensor subclass torch runs attention (``scaled_dot_product_attention``) by its reference
decomposition instead of the fused CPU kernel, 3e-7 apart per call (measured; layer norm, GELU and linear are
bitwise equal). Through two rounds of AdamW that is 9e-7 on the trained state (bound ``STATE_ATOL`` 1e-5, as
the batched engine's reordering in tests/test_batched.py stays far below 1e-4) and 1.5e-7 on a probability
(bound ``PROB_ATOL`` 1e-6; the prediction files round to 8 decimals). A wrong device path (a state not
loaded, a stale tensor) moves them by the order of the update itself.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, train
from fake_device import DEVICE, OnDevice, fake_device, on_device

import fedhisto.model.build
import fedhisto.predict.stage
import fedhisto.train.stage
from fedhisto.config.study import load_config

ROUNDS = 2
STATE_ATOL, PROB_ATOL = 1e-5, 1e-6
#: FedAdam keeps server moments, SCAFFOLD server and client variates, past_v2 prototypes and FiLM
METHODS = ("fedadam", "scaffold", "past_v2")


def _cfg(**train):
    tiny = copy.deepcopy(TINY)
    tiny["train"].update(max_rounds=ROUNDS, **train)
    return load_config(tiny)


@pytest.fixture
def on_the_device(monkeypatch):
    """Every stage's device is DEVICE; no operation may mix it with the CPU."""
    for module in (fedhisto.model.build, fedhisto.train.stage, fedhisto.predict.stage):
        monkeypatch.setattr(module, "pick_device", lambda *args, **kwargs: DEVICE)
    with fake_device() as mode:
        yield mode
    assert mode.mixed == [], mode.mixed[:3]


def best_state(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["best"]


def test_the_fake_device_refuses_what_torch_refuses_and_computes_the_rest():
    """The harness against torch's own rules: every mix torch refuses on its meta device is refused, the
    mixes a GPU takes (a 0-dim scalar, CPU indices, a copy from the CPU, a value brought back) compute the
    CPU values, and a matmul with a CPU operand is refused although torch's meta kernel checks shapes only."""
    from fake_device import DeviceMixed

    cpu, idx, scalar = torch.arange(6.0).reshape(2, 3), torch.tensor([1, 0]), torch.tensor(2.0)
    cases = {"add": lambda d: d + cpu, "scalar": lambda d: d * scalar, "matmul": lambda d: d @ cpu.T,
             "cat": lambda d: torch.cat([d, cpu]), "index": lambda d: d[idx], "copy_": lambda d: d.clone().copy_(cpu),
             "where": lambda d: torch.where(d > 1, d, cpu), "index_select": lambda d: d.index_select(0, idx),
             "to_cpu": lambda d: d.cpu() + cpu, "stack_own": lambda d: torch.stack([d, d * 2])}
    refused = set()
    for name, op in cases.items():
        try:
            op(torch.empty(2, 3, device="meta"))
            torch_refuses = False
        except (RuntimeError, NotImplementedError) as exc:  # a meta tensor has no values to copy out: allowed
            torch_refuses = "device" in str(exc)
        with fake_device() as mode:
            on = (cpu + 1).to(DEVICE)
            assert isinstance(on, OnDevice) and on.device == DEVICE
            if torch_refuses or name in ("matmul", "index_select"):
                refused.add(name)
                with pytest.raises(DeviceMixed, match="run's device"):
                    op(on)
                assert len(mode.mixed) == 1, name
            else:
                got = op(on)
                want = op(cpu + 1)
                assert torch.equal(got.cpu() if isinstance(got, OnDevice) else got, want), name
                assert mode.mixed == [], name
    assert refused == {"add", "matmul", "cat", "where", "index_select"}  # the rest mixes as on a GPU


@pytest.mark.parametrize("method", METHODS)
def test_a_killed_run_resumes_on_its_device_and_ends_where_the_uninterrupted_one_does(prepared, tmp_path, method,
                                                                                      on_the_device):
    cfg = _cfg()
    seen: list[dict] = []

    def record(ckpt: dict) -> None:  # after every round's checkpoint: where the driver's states live
        seen.append({"round": ckpt["round"], "members": on_device(ckpt["members"]),
                     "server": None if ckpt["server_state"] is None else on_device(ckpt["server_state"])})

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    train(prepared, method, reference, cfg=cfg, after_round=record)
    with pytest.raises(KeyboardInterrupt):
        train(prepared, method, killed, cfg=cfg, stop_after_round=1)
    train(prepared, method, killed, cfg=cfg, after_round=record)
    assert json.loads((killed / "report.json").read_text())["resumed_at_rounds"] == [1]
    assert [s["round"] for s in seen] == [1, 2, 2]
    assert all(s["members"] for s in seen), seen  # member states stay on the run's device, resumed too
    if method in ("fedadam", "scaffold"):  # server moments / variates are computed on the device
        assert all(s["server"] for s in seen), seen
    ref, res = best_state(reference), best_state(killed)
    assert ref["round"] == res["round"]
    for member in ref["members"]:
        a, b = ref["members"][member], res["members"][member]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), member
    assert (reference / "validation_predictions.csv").read_bytes() == (killed / "validation_predictions.csv").read_bytes()


def test_a_run_on_the_device_equals_the_run_on_the_cpu_and_predicts_alike(prepared, tmp_path, monkeypatch):
    """The same run and its predictions on the CPU and on the fake device agree (module docstring: float32
    rounding of attention), so the device run is the real computation, not a shortcut."""
    from fedhisto.predict.stage import run_predict

    cfg = _cfg()
    runs = {}
    for where in ("cpu", "device"):
        out, preds = tmp_path / where / "train", tmp_path / where / "predictions"
        if where == "device":
            for module in (fedhisto.model.build, fedhisto.train.stage, fedhisto.predict.stage):
                monkeypatch.setattr(module, "pick_device", lambda *args, **kwargs: DEVICE)
            with fake_device() as mode:
                train(prepared, "past_v2", out, cfg=cfg)
                run_predict("past_v2", 11, out, prepared["manifest"], prepared["identity"], prepared["descriptors"],
                            cfg, preds)
            assert mode.mixed == []
        else:
            train(prepared, "past_v2", out, cfg=cfg)
            run_predict("past_v2", 11, out, prepared["manifest"], prepared["identity"], prepared["descriptors"],
                        cfg, preds)
        runs[where] = (out, preds)
    (cpu_train, cpu_preds), (dev_train, dev_preds) = runs["cpu"], runs["device"]
    a, b = best_state(cpu_train)["members"]["global"], best_state(dev_train)["members"]["global"]
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < STATE_ATOL
    for cohort in ("test", "holdout", "external"):
        pa, pb = (np.loadtxt(d / f"{cohort}.csv", delimiter=",", skiprows=1, usecols=(2, 3, 4), dtype=float)
                  for d in (cpu_preds, dev_preds))
        assert pa.shape == pb.shape and np.abs(pa - pb).max() < PROB_ATOL, cohort


def test_an_exported_package_classifies_on_the_device(prepared, tmp_path, monkeypatch):
    """Export reads the run's checkpoint (CPU tensors in the file); ``fedhisto classify`` puts the package's
    model on the device and predicts there: the same probabilities as on the CPU."""
    from fedhisto.classify.runner import member_probabilities
    from fedhisto.export.package import load_package
    from fedhisto.export.stage import run_export
    from fedhisto.predict.stage import run_predict

    cfg = _cfg()
    results = tmp_path / "results"
    train(prepared, "past_v2", results / "train/past_v2/seed11", cfg=cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"seeds": [11], "ablation_seeds": [11]})}))
    run_predict("past_v2", 11, results / "train/past_v2/seed11", prepared["manifest"], prepared["identity"],
                prepared["descriptors"], cfg, results / "predictions/past_v2/seed11")
    one_seed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"seeds": [11], "ablation_seeds": [11]})})
    pkg = tmp_path / "pkg"
    monkeypatch.setattr(fedhisto.model.build, "pick_device", lambda *args, **kwargs: DEVICE)
    with fake_device() as mode:
        run_export("past_v2", one_seed, pkg, results / "train", results / "predictions", prepared["descriptors"],
                   prepared["identity"])
        package = load_package(pkg)
        rng = np.random.default_rng(0)
        images = [rng.integers(0, 256, (40, 44, 3), dtype=np.uint8) for _ in range(5)]
        on_dev = member_probabilities(package, images, np.asarray(package.meta["descriptor"]["centroid"]))
    assert mode.mixed == []
    monkeypatch.undo()
    on_cpu = member_probabilities(load_package(pkg), images, np.asarray(package.meta["descriptor"]["centroid"]))
    assert on_dev.keys() == on_cpu.keys() == {"seed11"}
    assert all(np.abs(on_dev[k] - on_cpu[k]).max() < PROB_ATOL for k in on_cpu)


# ------------------------------------------------------------------ train.device: never a silent CPU fallback
@pytest.fixture
def no_job_gpus(monkeypatch):
    from fedhisto.model.build import JOB_GPUS

    for name in (JOB_GPUS, "SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return monkeypatch


def _device_cfg(device: str):
    return _cfg(device=device)


def test_a_job_that_declares_a_gpu_and_finds_none_stops_naming_the_torch_build(no_job_gpus):
    from fedhisto.model.build import DeviceUnavailable, pick_device

    no_job_gpus.setattr(torch.version, "cuda", None)  # a CPU-only wheel (as this machine's)
    assert pick_device(_device_cfg("auto")) == torch.device("cpu")  # nothing declared: the CPU is the device
    no_job_gpus.setenv("FEDHISTO_JOB_GPUS", "1")
    with pytest.raises(DeviceUnavailable, match=r"declares 1 GPU.*built without CUDA.*train\.device: cpu"):
        pick_device(_device_cfg("auto"))
    assert pick_device(_device_cfg("cpu")) == torch.device("cpu")  # the user's explicit choice
    no_job_gpus.delenv("FEDHISTO_JOB_GPUS")
    no_job_gpus.setenv("SLURM_GPUS_ON_NODE", "2")  # a job submitted to SLURM by hand, with --gpus=2
    with pytest.raises(DeviceUnavailable, match="declares 2 GPU"):
        pick_device(None)
    no_job_gpus.setenv("FEDHISTO_JOB_GPUS", "0")  # a Snakemake rule declaring none, inside that allocation
    assert pick_device(None) == torch.device("cpu")
    no_job_gpus.delenv("SLURM_GPUS_ON_NODE")
    with pytest.raises(DeviceUnavailable, match=r"train\.device is cuda, but torch .* is built without CUDA"):
        pick_device(_device_cfg("cuda"))


def test_the_cause_names_hidden_devices_and_the_driver(no_job_gpus):
    from fedhisto.model.build import DeviceUnavailable, cuda_unavailable_cause, pick_device

    no_job_gpus.setattr(torch.version, "cuda", "12.6")  # a CUDA build of torch...
    no_job_gpus.setenv("CUDA_VISIBLE_DEVICES", "")  # ...in a job the scheduler gave no GPU
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU" in cuda_unavailable_cause()
    no_job_gpus.delenv("CUDA_VISIBLE_DEVICES")

    def no_driver():
        raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU "
                           "and installed a driver from http://www.nvidia.com/Download/index.aspx")

    no_job_gpus.setattr(torch.cuda, "init", no_driver)
    no_job_gpus.setenv("FEDHISTO_JOB_GPUS", "1")
    with pytest.raises(DeviceUnavailable, match=r"CUDA does not initialise .*CUDA 12\.6.*Found no NVIDIA driver"):
        pick_device(_device_cfg("auto"))
    no_job_gpus.setattr(torch.cuda, "is_available", lambda: True)  # a usable GPU: always taken, never cuda:0 by hand
    assert cuda_unavailable_cause() is None and pick_device(_device_cfg("auto")) == torch.device("cuda")


def test_a_snakemake_job_declares_its_rules_gpus_and_the_device_is_no_part_of_a_runs_identity(no_job_gpus, tmp_path):
    from types import SimpleNamespace

    from snakemake.iocontainers import Namedlist

    from fedhisto.config.stage_blocks import stage_block
    from fedhisto.entry import from_snakemake

    no_job_gpus.setenv("FEDHISTO_JOB_GPUS", "unset")  # from_snakemake writes os.environ: restored after the test
    for gpus in (1, 0):
        smk = SimpleNamespace(config=copy.deepcopy(TINY), resources=Namedlist(fromdict={"gpu": gpus, "mem_mb": 1000}),
                              log=[str(tmp_path / "job.log")])
        from_snakemake(smk)
        assert __import__("os").environ["FEDHISTO_JOB_GPUS"] == str(gpus)
    blocks = {d: stage_block(_device_cfg(d), "train", method="past_v2", seed=11) for d in ("auto", "cuda", "cpu")}
    assert blocks["auto"] == blocks["cuda"] == blocks["cpu"]


# ------------------------------------------------------------------ the probe holds a GPU: it computes there
def test_the_probe_embeds_on_the_device_its_job_holds(tmp_path, monkeypatch):
    """``fedhisto probe-encoder`` (and the probe experiment's step) picks the stage's device and embeds
    there: the encoder's weights move to it once, every batch of views follows; the measures are the CPU
    run's (attention's float32 rounding, module docstring)."""
    from PIL import Image

    import fedhisto.model.stain_probe as stain_probe
    from fedhisto.model.encoder import random_encoder

    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for k in range(6):
        Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(folder / f"img{k}.png")
    torch.manual_seed(0)
    random_encoder("tiny").save(tmp_path / "enc")
    cfg = load_config({"model": {"encoder": {"name": "tiny"}}, "views": {"crop_size": 32}})
    on_cpu = stain_probe.run_probe(cfg, folder, tmp_path / "cpu", encoder_dir=str(tmp_path / "enc"), resamples=50)
    seen = []
    real_embed = stain_probe.frozen_embedding
    monkeypatch.setattr(stain_probe, "frozen_embedding",
                        lambda enc, px: seen.append(on_device([px, *enc.module.parameters()])) or real_embed(enc, px))
    monkeypatch.setattr(fedhisto.model.build, "pick_device", lambda *args, **kwargs: DEVICE)
    with fake_device() as mode:
        on_dev = stain_probe.run_probe(cfg, folder, tmp_path / "dev", encoder_dir=str(tmp_path / "enc"), resamples=50)
    assert mode.mixed == [] and seen and all(seen)
    assert on_dev["images"] == on_cpu["images"] == 6
    measured = [k for k, v in on_cpu.items() if isinstance(v, dict) and "estimate" in v]
    assert len(measured) >= 3
    for key in measured:
        assert on_dev[key]["estimate"] == pytest.approx(on_cpu[key]["estimate"], rel=1e-5, abs=1e-7), key
