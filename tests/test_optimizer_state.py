"""``train.readings.optimizer_state`` (issue 23): AdamW created afresh every round (per_round, the
default) or kept by each client across rounds (kept).

On a fixed two-round setup: kept's second round differs from per_round's, and equals one torch AdamW
that lives on across the round boundary (the client's parameters overwritten by the new start state,
the moments left as AdamW left them). The batched engine agrees with the sequential one under kept
(tolerance 1e-4 as in tests/test_batched.py, which explains it); the state is checkpointed and a run
stopped after round 1 resumes to the uninterrupted run bitwise; an unavailable client's state waits;
the default changes no identity; the Flower engine refuses kept by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_batched import CFG, perturbed, split

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import load_config
from fedhisto.methods import build_method
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.batched import StackedAdamW, batched_local_train
from fedhisto.train.local import local_train
from fedhisto.train.loop import run_rounds
from fedhisto.train.participants import InProcess
from fedhisto.train.plan import MemberJob, batch_of, epoch_batches, local_run, seed_round, steps_now

ATOL = 1e-4  # tests/test_batched.py: float32 summation order through two epochs of AdamW
DEVICE = torch.device("cpu")


def config(reading: str, **train):
    return load_config({**CFG, "train": {**CFG["train"], "readings": {"optimizer_state": reading}, **train}})


def setup(name: str, reading: str, **train):
    cfg = config(reading, **train)
    method = build_method(name, cfg)
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny"), cfg.model, film=method.film)
    return cfg, method, model


CLIENTS = {"C1": split(10, 1), "C2": split(10, 2), "C3": split(5, 3)}  # C3: fewer steps per epoch
NAMES = sorted(CLIENTS)


def descriptors(method) -> dict:
    rng = np.random.default_rng(5)
    doc = {"clients": {c: {"standardised": rng.normal(size=14).tolist()} for c in NAMES},
           "centroid": {"standardised": rng.normal(size=14).tolist()}}
    return method.descriptors(doc, NAMES)


def payload(method, r: int, n: str) -> dict:
    return method.configure_train(r, None, dict.fromkeys(NAMES))[n]


def step_of(state: dict) -> float:
    return next(iter(state.values()))["step"]


def two_starts(model: FedHistoModel) -> tuple[dict, dict]:
    """Round 1's start, and round 2's (the server's new global state, not the client's own end state)."""
    s0 = perturbed(model.trainable_state(), 7)
    return s0, perturbed(s0, 8)


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_default_is_per_round_and_leaves_every_identity_as_it_was():
    cfg = load_config({})
    assert cfg.train.readings.optimizer_state == "per_round"
    assert "readings" not in stage_block(cfg, "train", method="past_v2", seed=11)["train"]
    kept = load_config({"train": {"readings": {"optimizer_state": "kept"}}})
    assert stage_block(kept, "train", method="past_v2", seed=11)["train"]["readings"] == {"optimizer_state": "kept"}
    with pytest.raises(Exception, match="optimizer_state"):
        load_config({"train": {"readings": {"optimizer_state": "sometimes"}}})


def hand_rolled_two_rounds(method, model, cfg, data, desc, s0, s1):
    """Two rounds of the engine's plan with ONE torch AdamW that is never re-created: between the rounds
    the parameters are overwritten by the new start state, the optimiser is left alone."""
    plan = method.objective.local_schedule(0)
    model.load_trainable_state(s0)
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=plan.lr, weight_decay=plan.weight_decay)
    after_first = None
    for r, start in enumerate((s0, s1)):
        job = MemberJob(start, data, desc, payload(method, r, "C1"), 11, r, 0)
        seed_round(job)
        model.load_trainable_state(start)  # in place: the optimiser still holds these parameters
        run = local_run(model, job, cfg, plan, DEVICE, params)
        with method.objective.local_session(run):
            for epoch in range(plan.epochs):
                opt.zero_grad(set_to_none=True)
                batches = epoch_batches(job, epoch, plan.micro_batch)
                for b, idx in enumerate(batches):
                    terms = method.objective.batch_terms(run, batch_of(job, plan, epoch, b, idx, DEVICE))
                    (sum(terms.values()) / plan.accumulation).backward()
                    if steps_now(b, len(batches), plan.accumulation):
                        torch.nn.utils.clip_grad_norm_(params.values(), cfg.train.grad_clip)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
        if r == 0:
            after_first = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}
    return model.trainable_state(), after_first


@pytest.mark.parametrize("name", ["fedavg_peft", "past_v2"])
def test_kept_continues_one_adamw_across_the_round_boundary_and_per_round_does_not(name: str):
    data = CLIENTS["C1"]
    runs = {}
    for reading in ("per_round", "kept"):
        cfg, method, model = setup(name, reading)
        s0, s1 = two_starts(model)
        desc = descriptors(method)["C1"]
        first = local_train(method.objective, model, s0, data, desc, payload(method, 0, "C1"), cfg, 11, 0, 0, DEVICE)
        second = local_train(method.objective, model, s1, data, desc, payload(method, 1, "C1"), cfg, 11, 1, 0, DEVICE,
                             optimizer_state=first.optimizer_state)
        runs[reading] = (first, second)
    (p_first, p_second), (k_first, k_second) = runs["per_round"], runs["kept"]
    assert p_first.optimizer_state is None and p_second.optimizer_state is None  # nothing kept by default
    # round 1: both start fresh, so both end in the same state
    assert all(torch.equal(p_first.state[k], k_first.state[k]) for k in p_first.state)
    # round 2: kept carries round 1's moments and step count, so AdamW's update differs (by far more
    # than rounding: its bias correction and sqrt(v) denominators are round 1's, not a fresh start's)
    assert max_gap(p_second.state, k_second.state) > 10 * ATOL
    # ... and equals one AdamW continued across the boundary
    cfg, method, model = setup(name, "kept")
    s0, s1 = two_starts(model)
    want, moments = hand_rolled_two_rounds(method, model, cfg, data, descriptors(method)["C1"], s0, s1)
    assert max_gap(want, k_second.state) < 1e-6
    steps = k_first.steps
    assert steps > 0 and k_second.steps == steps
    for n, s in k_first.optimizer_state.items():  # the moments after round 1 are those AdamW left
        assert s["step"] == float(moments[n]["step"]) == steps
        assert torch.allclose(s["exp_avg"], moments[n]["exp_avg"], atol=1e-7, rtol=0)
        assert torch.allclose(s["exp_avg_sq"], moments[n]["exp_avg_sq"], atol=1e-10, rtol=1e-5)
    assert {n: s["step"] for n, s in k_second.optimizer_state.items()} == dict.fromkeys(k_first.optimizer_state,
                                                                                        2.0 * steps)


@pytest.mark.parametrize("name", ["fedavg_peft", "past_v2"])
def test_batched_engine_keeps_the_state_the_sequential_engine_keeps(name: str):
    cfg, method, model = setup(name, "kept")
    s0, s1 = two_starts(model)
    desc = descriptors(method)
    seq_state, seq_end = {}, {}
    for k, n in enumerate(NAMES):
        first = local_train(method.objective, model, s0, CLIENTS[n], desc[n], payload(method, 0, n), cfg, 11, 0, k, DEVICE)
        second = local_train(method.objective, model, s1, CLIENTS[n], desc[n], payload(method, 1, n), cfg, 11, 1, k, DEVICE,
                             first.optimizer_state)
        seq_state[n], seq_end[n] = second.optimizer_state, second.state
    bat_state: dict = dict.fromkeys(NAMES)
    for r, start in enumerate((s0, s1)):
        jobs = [MemberJob(start, CLIENTS[n], desc[n], payload(method, r, n), 11, r, k, bat_state[n])
                for k, n in enumerate(NAMES)]
        out = batched_local_train(method.objective, model, jobs, cfg, DEVICE)
        bat_state = {n: res.optimizer_state for n, res in zip(NAMES, out, strict=True)}
        bat_end = {n: res.state for n, res in zip(NAMES, out, strict=True)}
    assert step_of(seq_state["C3"]) < step_of(seq_state["C1"])  # C3 steps fewer times: its own count
    for n in NAMES:
        assert max_gap(seq_end[n], bat_end[n]) < ATOL
        assert seq_state[n].keys() == bat_state[n].keys()
        for t in seq_state[n]:
            s, b = seq_state[n][t], bat_state[n][t]
            assert s["step"] == b["step"]
            assert float((s["exp_avg"] - b["exp_avg"]).abs().max()) < ATOL
            # squared gradients: compare relative to their size
            assert float((s["exp_avg_sq"] - b["exp_avg_sq"]).abs().max()) <= 1e-3 * float(s["exp_avg_sq"].abs().max()) + 1e-12


def test_stacked_adamw_loads_and_returns_each_members_torch_state():
    g = torch.Generator().manual_seed(3)
    shapes = {"a": (3, 4), "b": (5,)}
    ref = {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in shapes.items()}
    opt = torch.optim.AdamW(ref.values(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for p in ref.values():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    from fedhisto.train.optimizer_state import read_from

    state = read_from(opt, ref)
    stacked = {n: torch.stack([torch.zeros(s), p.detach().clone()]).requires_grad_(True)
               for (n, s), p in zip(shapes.items(), ref.values(), strict=True)}
    sopt = StackedAdamW(stacked, lr=1e-2, weight_decay=0.1)
    sopt.load_members([None, state], ["fresh", "kept"])
    assert sopt.member_state(0) == {} and sopt.steps.tolist() == [0.0, 3.0]
    grads = {n: torch.randn(p.shape, generator=g) for n, p in ref.items()}
    for n, p in ref.items():
        p.grad = grads[n].clone()
        stacked[n].grad = torch.stack([torch.zeros_like(grads[n]), grads[n]])
    opt.step()
    sopt.step(torch.tensor([False, True]))
    for n, p in ref.items():
        assert torch.allclose(stacked[n][1], p, atol=1e-6)
        assert torch.allclose(sopt.member_state(1)[n]["exp_avg"], opt.state[p]["exp_avg"], atol=1e-7)
    assert sopt.member_state(1)["a"]["step"] == 4.0
    with pytest.raises(ValueError, match="kept optimiser state names tensors"):
        sopt.load_members([{"zzz": state["a"]}, None], ["client 0", "client 1"])


def test_passing_a_kept_state_under_per_round_is_refused():
    cfg, method, model = setup("fedavg_peft", "kept")
    s0, _ = two_starts(model)
    first = local_train(method.objective, model, s0, CLIENTS["C1"], None, {}, cfg, 11, 0, 0, DEVICE)
    per_round, method, model = setup("fedavg_peft", "per_round")
    with pytest.raises(ValueError, match="optimizer_state is per_round"):
        local_train(method.objective, model, s0, CLIENTS["C1"], None, {}, per_round, 11, 1, 0, DEVICE, first.optimizer_state)
    job = MemberJob(s0, CLIENTS["C1"], None, {}, 11, 1, 0, first.optimizer_state)
    with pytest.raises(ValueError, match="optimizer_state is per_round"):
        batched_local_train(method.objective, model, [job], per_round, DEVICE)


def drive(tmp_path, name: str, reading: str, engine: str, tag: str, rounds: int = 3, **hooks):
    cfg, method, model = setup(name, reading, max_rounds=rounds, engine=engine, patience=10)
    desc = descriptors(method)
    parts = InProcess(model=model, method=method, clients=CLIENTS, validation=split(6, 9), descriptors=desc, cfg=cfg,
                      seed=11, device=DEVICE, batched=engine == "batched", client_fault=hooks.pop("fault", {}))
    identity = {"method": name, "seed": 11, "config_hash": f"{reading}-{engine}", "dataset_identity": "t",
                "descriptor_digest": "t", "encoder_digest": "t"}
    return run_rounds(method, parts, model, cfg, identity, tmp_path / f"{tag}.pt", **hooks), parts


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_kept_state_is_checkpointed_and_a_stopped_run_resumes_bitwise(tmp_path, engine: str):
    whole, _ = drive(tmp_path, "fedavg_peft", "kept", engine, "whole")
    with pytest.raises(KeyboardInterrupt):
        drive(tmp_path, "fedavg_peft", "kept", engine, "stopped", stop_after_round=1)
    saved = torch.load(tmp_path / "stopped.pt", map_location="cpu", weights_only=False)
    assert sorted(saved["participants"]["optimizer"]) == sorted(CLIENTS)  # every client's state, at round 1
    resumed, _ = drive(tmp_path, "fedavg_peft", "kept", engine, "stopped")
    assert resumed["resumed_at_rounds"] == [1] and resumed["round"] == whole["round"] == 3
    a, b = whole["members"]["global"], resumed["members"]["global"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    for n in CLIENTS:  # the resumed run's kept state is the uninterrupted one's
        wa, wb = whole["participants"]["optimizer"][n], resumed["participants"]["optimizer"][n]
        assert all(torch.equal(wa[t]["exp_avg_sq"], wb[t]["exp_avg_sq"]) for t in wa)
    # the reading is not ignored on the driver either: per_round ends elsewhere and keeps nothing
    per_round, _ = drive(tmp_path, "fedavg_peft", "per_round", engine, "per_round")
    assert "participants" not in per_round
    assert max_gap(per_round["members"]["global"], a) > 10 * ATOL


def test_an_unavailable_clients_state_waits_for_its_next_round(tmp_path):
    # C2 (index 1) is unavailable in round 2 (index 1): after round 2 its state is still round 1's
    seen = []
    ckpt, _ = drive(tmp_path, "fedavg_peft", "kept", "sequential", "fault", rounds=3, fault={1: "C2"},
                    after_round=lambda c: seen.append({n: {t: dict(s) for t, s in st.items()}
                                                       for n, st in c["participants"]["optimizer"].items()}))
    assert ckpt["history"][1]["unavailable_clients"] == {"C2": "injected unavailability of C2 in round 2"}
    step = {r: {n: step_of(st) for n, st in s.items()} for r, s in enumerate(seen)}
    assert step[1]["C2"] == step[0]["C2"] and step[1]["C1"] == 2 * step[0]["C1"]
    t = next(iter(seen[0]["C2"]))
    assert torch.equal(seen[1]["C2"][t]["exp_avg"], seen[0]["C2"][t]["exp_avg"])
    assert step[2]["C2"] == 2 * step[0]["C2"]  # and it continues from there in round 3


def test_flower_engine_refuses_kept_by_name():
    pytest.importorskip("flwr")
    from fedhisto.federation.server import check_federable

    check_federable(build_method("fedavg_peft", config("per_round")), ["C1", "C2"])
    with pytest.raises(ValueError, match=r"train\.readings\.optimizer_state: kept"):
        check_federable(build_method("fedavg_peft", config("kept")), ["C1", "C2"])



def test_dp_sgd_sites_keep_their_state_and_resume_it(tmp_path):
    """DP-SGD (sequential): the kept moments are functions of the noised gradients only (post-processing,
    no epsilon changes); a site keeps them beside its ledger and a stopped run resumes bitwise."""
    from fedhisto.train.private import PrivateSites

    privacy = {"enabled": True, "noise_multiplier": 1.1, "clip_norm": 0.5, "sample_rate": 0.5, "delta": 1e-3,
               "micro_batch": 4, "noise_seed": "run"}

    def dp_drive(reading: str, tag: str, **hooks):
        cfg = load_config({**CFG, "privacy": privacy, "train": {**CFG["train"], "max_rounds": 2, "local_epochs": 1,
                                                                "engine": "sequential", "methods": ["fedavg_peft"],
                                                                "ablations": [], "ablation_seeds": [],
                                                                "readings": {"optimizer_state": reading}},
                           "bootstrap": {"comparisons": {}}})
        method = build_method("fedavg_peft", cfg)
        torch.manual_seed(0)
        model = FedHistoModel(random_encoder("tiny"), cfg.model, film=False)
        parts = InProcess(model=model, method=method, clients=CLIENTS, validation=split(6, 9),
                          descriptors=method.descriptors(None, NAMES), cfg=cfg, seed=11, device=DEVICE,
                          private=PrivateSites.start(cfg, method.objective, CLIENTS, None, 11))
        identity = {"method": "fedavg_peft", "seed": 11, "config_hash": reading, "dataset_identity": "t",
                    "descriptor_digest": "t", "encoder_digest": "t"}
        return run_rounds(method, parts, model, cfg, identity, tmp_path / f"{tag}.pt", **hooks)

    whole = dp_drive("kept", "whole")
    assert sorted(whole["participants"]) == ["optimizer", "privacy"] and sorted(whole["participants"]["optimizer"]) == NAMES
    with pytest.raises(KeyboardInterrupt):
        dp_drive("kept", "stopped", stop_after_round=1)
    resumed = dp_drive("kept", "stopped")
    assert resumed["resumed_at_rounds"] == [1]
    a, b = whole["members"]["global"], resumed["members"]["global"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    per_round = dp_drive("per_round", "per_round")
    assert "optimizer" not in per_round["participants"]
    assert max_gap(per_round["members"]["global"], a) > 10 * ATOL
    # the same ledger either way: keeping the moments spends no privacy
    eps = [c["history"][-1]["privacy"]["epsilon"] for c in (whole, per_round)]
    assert eps[0] == eps[1]


def test_the_training_stage_resumes_a_kept_run_bitwise_and_names_the_reading(prepared, tmp_path):
    """Through ``run_train`` (the pipeline's stage, default batched engine): the reading is in the run
    identity, the checkpoint carries every client's state, and a run stopped after round 1 resumes to
    the uninterrupted one bitwise (predictions included)."""
    from conftest import train

    base = prepared["cfg"]
    cfg = base.model_copy(update={"train": base.train.model_copy(update={
        "max_rounds": 2, "readings": base.train.readings.model_copy(update={"optimizer_state": "kept"})})})
    whole = tmp_path / "whole"
    summary = train(prepared, "fedavg_peft", whole, cfg=cfg)
    from fedhisto.infra.provenance import config_hash

    def run_hash(c):
        return config_hash(stage_block(c, "train", method="fedavg_peft", seed=11))
    assert summary["identity"]["config_hash"] == run_hash(cfg) != run_hash(base)
    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        train(prepared, "fedavg_peft", stopped, cfg=cfg, stop_after_round=1)
    saved = torch.load(stopped / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert sorted(saved["participants"]["optimizer"]) == ["C1", "C2", "C3", "C4", "C5"]
    assert train(prepared, "fedavg_peft", stopped, cfg=cfg)["resumed_at_rounds"] == [1]
    a, b = (torch.load(d / "checkpoint.pt", map_location="cpu", weights_only=False)["members"]["global"]
            for d in (whole, stopped))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (whole / "validation_predictions.csv").read_bytes() == (stopped / "validation_predictions.csv").read_bytes()
