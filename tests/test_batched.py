"""The batched engine (every member of a round in one encoder pass) against the sequential one.

Tolerance: both engines run the same float32 math on the same micro-batches in the same order; they
differ only in summation order (one concatenated encoder pass and batched matmuls instead of one
pass per participant and view, gathered/accumulated gradients). Those are rounding differences of a
few float32 ulps per operation (~1e-7 relative); through two local epochs of AdamW they stay far
below 1e-4 absolute on tensors of order 1e-2..1 (measured on 2 CPU threads: 1.3e-7 (fedstain) to
2.5e-5 (v2_no_proto), most methods about 1e-6). AdamW
normalises the update by sqrt(v), so a gradient that is exactly zero in one engine and 1e-12 in the
other could differ by a whole learning-rate step (1e-3): the tolerance 1e-4 would catch that.
Dropout is set to 0: the sequential engine draws dropout masks per participant in turn from the
global generator, the batched one once for the stack, so masks (not the math) differ.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhisto.config.study import load_config
from fedhisto.data.splits import Split
from fedhisto.methods import build_method, method_names
from fedhisto.methods.base import named_rng
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.batched import StackedAdamW, batched_local_train, clip_per_member
from fedhisto.train.local import local_train
from fedhisto.train.plan import MemberJob

CFG = {"model": {"encoder": {"name": "tiny", "require_pretrained": False}, "adapter_hidden": 16, "film_hidden": 16,
                 "lora_dropout": 0.0, "adapter_dropout": 0.0},
       "views": {"crop_size": 48}, "train": {"lr": 1e-3, "local_epochs": 2}}
ATOL = 1e-4
ROUND = 1


def split(n: int, seed: int) -> Split:
    rng = np.random.default_rng(seed)
    labels = [k % 3 for k in range(n)]
    images = [rng.integers(0, 256, (56 + 4 * (k % 3), 60, 3), dtype=np.uint8) for k in range(n)]
    return Split([f"{seed:04x}{k:011x}" for k in range(n)], labels, images)


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A start state with non-zero LoRA B and FiLM output, so every pathway carries signal."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def round_inputs(name: str, train: dict | None = None):
    """One round's jobs for ``name``; ``train`` overrides keys of CFG's train block."""
    cfg = load_config({**CFG, "train": {**CFG["train"], **(train or {})}})
    method = build_method(name, cfg)
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny"), cfg.model, film=method.film)
    device = torch.device("cpu")
    # C3 has fewer images, so fewer micro-batches and optimiser steps per epoch than the others
    clients = method.participants({"C1": split(10, 1), "C2": split(10, 2), "C3": split(5, 3)})
    names = sorted(clients)
    rng = np.random.default_rng(5)
    doc = {"clients": {c: {"standardised": rng.normal(size=14).tolist()} for c in names},
           "centroid": {"standardised": rng.normal(size=14).tolist()}}
    descriptors = method.descriptors(doc, names)
    start = perturbed(model.trainable_state(), 7)
    members = {m: start for m in method.members(names)}
    server_state = None
    if getattr(method, "prototypes", "none") != "none":  # a prototype payload, so L_proto is exercised
        after = {}
        for n in names:
            model.load_trainable_state(method.start_state(members, n))
            after[n] = method.objective.upload_after_aggregation(model, clients[n], descriptors[n], device)
        server_state = method.aggregate_uploads(after, None)
    uploads = {n: method.objective.upload_before_training(model, method.start_state(members, n), clients[n],
                                                          named_rng("style_sample", 11, ROUND, k), device)
               for k, n in enumerate(names)}
    payloads = method.configure_train(ROUND, server_state, uploads)
    jobs = [MemberJob(method.start_state(members, n), clients[n], descriptors[n], payloads[n], 11, ROUND, k)
            for k, n in enumerate(names)]
    return cfg, method, model, device, jobs


@pytest.mark.parametrize(("name", "train"), [(n, None) for n in method_names()] + [
    # FedStain's paper protocol trains with Adam (no weight decay), the same update as AdamW without it
    ("fedstain", {"fedstain": {"protocol": "paper", "paper_batch": 4}})], ids=[*method_names(), "fedstain-paper"])
def test_batched_round_ends_in_the_sequential_state(name: str, train: dict | None):
    cfg, method, model, device, jobs = round_inputs(name, train)
    # each method's own local optimiser: SCAFFOLD's plain SGD (its paper's), FedStain-paper's Adam, else AdamW
    objective = method.objective
    assert objective.local_schedule(ROUND).optimizer == ("adam" if train else "sgd" if name == "scaffold" else "adamw")
    sequential = [local_train(objective, model, j.start_state, j.data, j.descriptor, j.payload, cfg, j.seed,
                              j.round_idx, j.client_idx, device) for j in jobs]
    batched = batched_local_train(objective, model, jobs, cfg, device)
    assert len(batched) == len(sequential)
    worst = 0.0
    for s, b, j in zip(sequential, batched, jobs, strict=True):
        assert set(s.state) == set(b.state) and b.n_samples == s.n_samples
        for k in s.state:
            worst = max(worst, float((s.state[k] - b.state[k]).abs().max()))
            # every tensor moved: equality is not the trivial "nothing trained"
            assert not torch.equal(s.state[k], j.start_state[k]) or "lora_A" in k or "film.hidden" in k
        assert s.losses.keys() == b.losses.keys()
        for k in s.losses:
            assert b.losses[k] == pytest.approx(s.losses[k], rel=1e-4, abs=1e-6)
    print(f"{name}: largest state difference {worst:.3g}")
    assert worst < ATOL, f"{name}: largest state difference {worst:.3g}"


def test_stacked_adamw_is_torch_adamw_per_member_with_its_own_step_count():
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 4), "b": (5,)}
    members = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(3)]
    refs = [{n: torch.nn.Parameter(v.clone()) for n, v in m.items()} for m in members]
    opts = [torch.optim.AdamW(r.values(), lr=1e-2, weight_decay=0.1) for r in refs]
    stacked = {n: torch.stack([m[n] for m in members]).requires_grad_(True) for n in shapes}
    opt = StackedAdamW(stacked, lr=1e-2, weight_decay=0.1)
    for it in range(6):
        step = [True, it % 2 == 0, it < 2]  # member 1 every other step, member 2 only twice
        grads = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(3)]
        for n in shapes:
            stacked[n].grad = torch.stack([gr[n] for gr in grads])
        for m in range(3):
            if step[m]:
                for n in shapes:
                    refs[m][n].grad = grads[m][n].clone()
                torch.nn.utils.clip_grad_norm_(refs[m].values(), 1.5)
                opts[m].step()
        mask = torch.tensor(step)
        clip_per_member(stacked, 1.5, mask)
        opt.step(mask)
        for m in range(3):
            for n in shapes:
                torch.testing.assert_close(stacked[n][m].detach(), refs[m][n].detach(), rtol=1e-6, atol=1e-7)
    assert opt.steps.tolist() == [6.0, 3.0, 2.0]


def test_clipping_leaves_members_that_do_not_step_alone():
    p = {"w": torch.zeros(2, 3, requires_grad=True)}
    p["w"].grad = torch.full((2, 3), 10.0)
    norms = clip_per_member(p, 1.0, torch.tensor([True, False]))
    assert norms.tolist() == pytest.approx([10 * 3**0.5] * 2)
    assert float(p["w"].grad[0].norm()) == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(p["w"].grad[1], torch.full((3,), 10.0))


@pytest.mark.parametrize("name", ["past_v2", "fedstain"])
def test_a_round_of_the_loop_with_train_engine_batched_matches_sequential(name: str, tmp_path):
    from fedhisto.train.loop import run_rounds
    from fedhisto.train.participants import InProcess

    _, method, _, device, jobs = round_inputs(name)
    clients = {n: j.data for n, j in zip(["C1", "C2", "C3"], jobs, strict=False)}
    desc = {n: j.descriptor for n, j in zip(clients, jobs, strict=False)}
    desc["global"] = jobs[0].descriptor
    ends = {}
    for engine in ("sequential", "batched"):
        c = load_config({**CFG, "train": {**CFG["train"], "max_rounds": 1, "engine": engine}})
        torch.manual_seed(0)
        m = FedHistoModel(random_encoder("tiny"), c.model, film=method.film)
        meth = build_method(name, c)
        parts = InProcess(model=m, method=meth, clients=clients, validation=split(6, 9), descriptors=desc, cfg=c,
                          seed=11, device=device, batched=engine == "batched")
        identity = {"method": name, "seed": 11, "config_hash": engine, "dataset_identity": "t",
                    "descriptor_digest": "t", "encoder_digest": "t"}
        ends[engine] = run_rounds(meth, parts, m, c, identity, tmp_path / f"{engine}.pt")
    seq, bat = ends["sequential"]["members"]["global"], ends["batched"]["members"]["global"]
    worst = max(float((seq[k] - bat[k]).abs().max()) for k in seq)
    assert worst < ATOL, worst
    assert ends["sequential"]["history"][0]["weights"] == pytest.approx(ends["batched"]["history"][0]["weights"],
                                                                       rel=1e-4)


def test_sequential_keeps_the_identity_it_had_before_batched_became_the_default():
    from fedhisto.config.stage_blocks import training_settings

    # runs made before the default moved were sequential and carry no engine key: they stay valid
    sequential = load_config({**CFG, "train": {**CFG["train"], "engine": "sequential"}})
    assert "engine" not in training_settings(sequential, "past_v2")
    # the batched default trains to other float32 sums and dropout masks: its runs are other runs
    assert load_config(CFG).train.engine == "batched"
    assert training_settings(load_config(CFG), "past_v2")["engine"] == "batched"


@pytest.mark.parametrize("name", ["fedavg_peft", "past_v2"])
def test_device_view_pipeline_trains_a_round_like_the_host_pipeline(name: str):
    """train.view_pipeline device: the same draws rendered on the device (pixels within interpolation
    rounding, tests/test_views_device.py), so a round moves the state the same way. The bound is on the
    difference relative to the update itself: a view differing by ~0.1-0.4 % of the pixel range may
    bend an update by a few per cent, never redirect it."""
    cfg, method, model, device, jobs = round_inputs(name)
    host = batched_local_train(method.objective, model, jobs, cfg, device)
    on_device = load_config({**CFG, "train": {**CFG["train"], "view_pipeline": "device"}})
    dev = batched_local_train(build_method(name, on_device).objective, model, jobs, on_device, device)
    for h, d, j in zip(host, dev, jobs, strict=True):
        update = sum(float((h.state[k] - j.start_state[k]).norm() ** 2) for k in h.state) ** 0.5
        gap = sum(float((h.state[k] - d.state[k]).norm() ** 2) for k in h.state) ** 0.5
        assert update > 0 and gap < 0.1 * update, (gap, update)
        assert gap > 0  # the device path really ran (its pixels are not bit-identical)


def test_view_pipeline_default_leaves_identity_and_fedstain_refuses_device_views():
    from fedhisto.config.stage_blocks import training_settings

    assert "view_pipeline" not in training_settings(load_config(CFG), "past_v2")
    on_device = load_config({**CFG, "train": {**CFG["train"], "view_pipeline": "device"}})
    assert training_settings(on_device, "past_v2")["view_pipeline"] == "device"
    _, _, model, device, jobs = round_inputs("fedstain")
    with pytest.raises(ValueError, match=r"train\.view_pipeline"):
        batched_local_train(build_method("fedstain", on_device).objective, model, jobs, on_device, device)
