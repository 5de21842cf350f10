"""SCAFFOLD (methods.scaffold): option II's variates and the model step by hand, the local correction's
gradient under accumulation, the sign alignment of delta-SVD's factors, both engines with non-zero
variates, resume after a kill, and its Table 8 row."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import train
from test_batched import ATOL, round_inputs, split

from fedhisto.config import load_config
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL, Batch, RoundUpdate
from fedhisto.methods.scaffold import align_factor_signs
from fedhisto.train.batched import MemberJob, batched_local_train
from fedhisto.train.local import local_train

F64 = 1e-12  # float64 arithmetic on O(1) numbers: a few ulps


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def scaffold(lr: float = 0.1, **settings):
    return build_method("scaffold", load_config({"train": {"lr": lr, "scaffold": settings}}))


def test_option_ii_variates_and_model_step_by_hand():
    """Two clients, one two-parameter tensor, eta_l = 0.1, three participants (C3 never returns).

    Round 1 from x = (1, -2), c = c_i = 0: A returns y_A = (0.8, -1.9) after K = 2 steps, B returns
    y_B = (1.1, -2.3) after K = 4, weights 1/4 and 3/4.
        c_A+ = (x - y_A) / (2 * 0.1) = (0.2, -0.1) / 0.2 = (1, -0.5)
        c_B+ = (x - y_B) / (4 * 0.1) = (-0.1, 0.3) / 0.4 = (-0.25, 0.75)
        c+   = (1/3) (c_A+ + c_B+) = (0.25, 1/12)
        x+   = 1/4 y_A + 3/4 y_B = (1.025, -2.2)            (eta_g = 1: the weighted mean)
    Round 2 from x = (1.025, -2.2): only A returns, y = (1, -2.1) after K = 1 step.
        c_A++ = c_A+ - c+ + (x - y) / 0.1 = (1 - 0.25 + 0.25, -0.5 - 1/12 - 1) = (1, -19/12)
        c++   = c+ + (1/3)(c_A++ - c_A+) = (0.25, 1/12 - 13/36) = (0.25, -5/18); c_B stays.
    """
    method = scaffold()
    model = SimpleNamespace(lora_scaling=2.0)
    x = {"p": t(1.0, -2.0)}
    method.configure_train(0, None, dict.fromkeys(["C1", "C2", "C3"]))
    update = RoundUpdate(0, {"C1": {"p": t(0.8, -1.9)}, "C2": {"p": t(1.1, -2.3)}}, {"C1": x, "C2": x},
                         {"C1": 10, "C2": 30}, {"C1": 2, "C2": 4}, {"C1": 0.25, "C2": 0.75}, None)
    members, state = method.aggregate_train(update, model)
    torch.testing.assert_close(members[GLOBAL]["p"], t(1.025, -2.2), rtol=0, atol=F64)
    torch.testing.assert_close(state["clients"]["C1"]["p"], t(1.0, -0.5), rtol=0, atol=F64)
    torch.testing.assert_close(state["clients"]["C2"]["p"], t(-0.25, 0.75), rtol=0, atol=F64)
    torch.testing.assert_close(state["c"]["p"], t(0.25, 1 / 12), rtol=0, atol=F64)

    payloads = method.configure_train(1, state, dict.fromkeys(["C1", "C2", "C3"]))
    assert torch.equal(payloads["C1"]["control"]["p"], state["c"]["p"])
    assert torch.equal(payloads["C2"]["client_control"]["p"], state["clients"]["C2"]["p"])
    assert torch.equal(payloads["C3"]["client_control"]["p"], t(0.0, 0.0))  # never seen: c_i = 0
    x2 = members[GLOBAL]
    update = RoundUpdate(1, {"C1": {"p": t(1.0, -2.1)}}, {"C1": x2}, {"C1": 10}, {"C1": 1}, {"C1": 1.0}, state)
    members, state2 = method.aggregate_train(update, model)
    torch.testing.assert_close(members[GLOBAL]["p"], t(1.0, -2.1), rtol=0, atol=F64)
    torch.testing.assert_close(state2["clients"]["C1"]["p"], t(1.0, -19 / 12), rtol=0, atol=F64)
    torch.testing.assert_close(state2["c"]["p"], t(0.25, -5 / 18), rtol=0, atol=F64)
    assert torch.equal(state2["clients"]["C2"]["p"], state["clients"]["C2"]["p"])  # B did not return: kept


def test_a_participant_without_steps_is_refused_by_name():
    method = scaffold()
    x = {"p": t(1.0, 2.0)}
    update = RoundUpdate(0, {"C1": x}, {"C1": x}, {"C1": 0}, {"C1": 0}, {"C1": 1.0}, None)
    with pytest.raises(ValueError, match="participant C1 took 0 optimiser steps in round 1"):
        method.aggregate_train(update, SimpleNamespace(lora_scaling=1.0))


@pytest.mark.parametrize(("accumulation", "n_images"), [(1, 5), (2, 5), (3, 7)])
def test_every_optimiser_step_receives_c_minus_c_i_exactly_once(accumulation: int, n_images: int):
    """The engine backpropagates each micro-batch's terms divided by the accumulation steps and steps
    after each group (the last one shorter): the correction's gradient summed over a group is c - c_i."""
    method = scaffold(correction_scale=1.0)
    method.local_schedule = lambda r: SimpleNamespace(accumulation=accumulation, lr=0.1)
    theta = torch.nn.Parameter(t(0.3, -0.7))
    c, c_i = {"p": t(0.5, 2.0)}, {"p": t(-0.25, 1.5)}
    run = SimpleNamespace(payload={"control": c, "client_control": c_i}, device=torch.device("cpu"), scratch={},
                          params={"p": theta}, start_state={"p": t(0.3, -0.7)}, data=[None] * n_images,
                          nominal_batch=1, round_idx=0)
    with method.local_session(run):
        run.scratch["correction"] = {k: v.double() for k, v in run.scratch["correction"].items()}  # float64 check
        groups = [list(range(s, min(s + accumulation, n_images))) for s in range(0, n_images, accumulation)]
        for group in groups:
            theta.grad = None
            for b in group:
                term = method.extra_terms(run, Batch(None, None, 0, 0, b), [], [])["scaffold"]
                (term / accumulation).backward()
            torch.testing.assert_close(theta.grad, t(0.75, 0.5), rtol=0, atol=F64)


def test_round_one_has_no_correction_and_scale_zero_switches_it_off():
    method = scaffold(correction_scale=0.0)
    run = SimpleNamespace(payload={}, device=torch.device("cpu"), scratch={}, params={}, start_state={})
    with method.local_session(run):
        assert float(method.extra_terms(run, Batch(None, None, 0, 0, 0), [], [])["scaffold"]) == 0.0
    assert method.settings.correction_scale == 0.0


def test_factor_signs_follow_the_start_and_keep_the_model():
    g = torch.Generator().manual_seed(3)
    ref = {"m.lora_A.default.weight": torch.randn(3, 5, generator=g, dtype=torch.float64),
           "m.lora_B.default.weight": torch.randn(4, 3, generator=g, dtype=torch.float64), "head": t(1.0)}
    flip = t(-1.0, 1.0, -1.0)
    new = {"m.lora_A.default.weight": ref["m.lora_A.default.weight"] * flip[:, None] + 0.01,
           "m.lora_B.default.weight": ref["m.lora_B.default.weight"] * flip[None, :], "head": t(2.0)}
    out = align_factor_signs(new, ref)
    a, b = out["m.lora_A.default.weight"], out["m.lora_B.default.weight"]
    assert torch.equal(b @ a, new["m.lora_B.default.weight"] @ new["m.lora_A.default.weight"])  # model unchanged
    torch.testing.assert_close(a, ref["m.lora_A.default.weight"] + 0.01 * flip[:, None], rtol=0, atol=F64)
    assert torch.equal(out["head"], new["head"])


def test_both_engines_apply_the_same_correction():
    """With non-zero variates (test_batched's registry-wide check starts from none): the batched round
    ends in the sequential state, and the correction moved it away from the uncorrected round."""
    cfg, method, model, device, jobs = round_inputs("scaffold")
    g = torch.Generator().manual_seed(1)
    start = jobs[0].start_state
    c = {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in start.items()}
    jobs = [MemberJob(j.start_state, j.data, j.descriptor,
                      {"control": c, "client_control": {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in c.items()}},
                      j.seed, j.round_idx, j.client_idx) for j in jobs]
    sequential = [local_train(method, model, j.start_state, j.data, j.descriptor, j.payload, cfg, j.seed, j.round_idx,
                              j.client_idx, device) for j in jobs]
    batched = batched_local_train(method, model, jobs, cfg, device)
    plain = local_train(method, model, jobs[0].start_state, jobs[0].data, jobs[0].descriptor, {}, cfg, jobs[0].seed,
                        jobs[0].round_idx, jobs[0].client_idx, device)
    worst = max(float((s.state[k] - b.state[k]).abs().max()) for s, b in zip(sequential, batched, strict=True)
                for k in s.state)
    assert worst < ATOL, worst
    moved = max(float((sequential[0].state[k] - plain.state[k]).abs().max()) for k in plain.state)
    print(f"scaffold: batched vs sequential {worst:.3g}, corrected vs uncorrected {moved:.3g}")
    assert moved > 10 * ATOL  # the correction is not lost in either engine
    assert all(s.losses["scaffold"] != 0 for s in sequential)


def test_a_killed_scaffold_run_resumes_to_the_identical_state_and_variates(prepared: dict, tmp_path: Path):
    cfg = prepared["cfg"].model_copy(update={"train": prepared["cfg"].train.model_copy(update={"max_rounds": 3})})
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert train(prepared, "scaffold", reference, cfg=cfg)["rounds"] == 3
    with pytest.raises(KeyboardInterrupt):
        train(prepared, "scaffold", stopped, cfg=cfg, stop_after_round=2)
    assert train(prepared, "scaffold", stopped, cfg=cfg)["resumed_at_rounds"] == [2]
    a, b = (torch.load(p / "checkpoint.pt", map_location="cpu", weights_only=False) for p in (reference, stopped))
    assert all(torch.equal(a["members"][GLOBAL][k], b["members"][GLOBAL][k]) for k in a["members"][GLOBAL])
    assert sorted(a["server_state"]["clients"]) == ["C1", "C2", "C3", "C4", "C5"]
    for name in ("C1", "C5"):
        assert all(torch.equal(a["server_state"]["clients"][name][k], b["server_state"]["clients"][name][k])
                   for k in a["server_state"]["c"])
    assert any(float(v.abs().max()) > 0 for v in a["server_state"]["c"].values())


def test_table8_counts_two_state_copies_of_variates_per_client_and_round():
    from fedhisto.accounting import communication_table

    cfg = load_config({"train": {"methods": ["fedavg_peft", "past_v2", "scaffold"]}})
    rows = {r["method"]: r for r in communication_table(cfg)}
    fedavg, row = rows["fedavg_peft"], rows["scaffold"]
    assert row["payload_mib"] == fedavg["payload_mib"] and row["model_per_round_mib"] == fedavg["model_per_round_mib"]
    assert row["other_extra_kinds"] == "control_variates"
    # c and c_i (or c and delta c_i) for each of 5 clients: the model exchange's bytes again, exactly
    assert row["other_extra_per_round_mib"] == fedavg["model_per_round_mib"] == "37.685661"
    assert float(row["per_round_mib"]) == pytest.approx(2 * float(fedavg["per_round_mib"]), abs=2e-6)
    assert row["overhead_vs_fedavg_pct"] == "100.000000"
    assert rows["past_v2"]["other_extra_per_round_mib"] == "0.000000" and rows["past_v2"]["other_extra_kinds"] == ""


# ---------------------------------------------------------------- variates: start_gradient [ours]
def test_start_gradient_payload_is_the_mean_gradient_minus_the_own_by_hand():
    """g_1 = (1, -2), g_2 = (3, 0): c = (2, -1); C1 receives c - g_1 = (1, 1), C2 receives (-1, -1)."""
    method = scaffold(variates="start_gradient")
    assert method.pre_uploads
    payloads = method.configure_train(0, None, {"C1": {"p": t(1.0, -2.0)}, "C2": {"p": t(3.0, 0.0)}})
    torch.testing.assert_close(payloads["C1"]["correction"]["p"], t(1.0, 1.0), rtol=0, atol=F64)
    torch.testing.assert_close(payloads["C2"]["correction"]["p"], t(-1.0, -1.0), rtol=0, atol=F64)
    x = {"p": t(1.0, 2.0)}
    update = RoundUpdate(0, {"C1": x, "C2": x}, {"C1": x, "C2": x}, {"C1": 1, "C2": 1}, {"C1": 1, "C2": 1},
                         {"C1": 0.5, "C2": 0.5}, None)
    assert method.aggregate_train(update, SimpleNamespace(lora_scaling=1.0))[1] is None  # nothing kept


def test_start_gradient_is_the_full_data_gradient_of_the_balanced_ce():
    """Against one forward of every image at once (the hook goes through evaluation batches of 32)."""
    from fedhisto.fedmath.losses import class_balanced_weights
    from fedhisto.methods.base import balanced_cross_entropy
    from fedhisto.methods.scaffold import start_gradient
    from fedhisto.splits import eval_batches

    cfg, _, model, device, jobs = round_inputs("scaffold")
    data = split(70, 4)  # three evaluation batches of 32, 32, 6
    model.load_trainable_state(jobs[0].start_state)
    got = start_gradient(model, data, cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(
        update={"eval_batch": 32})}), device)
    x, y = next(eval_batches(data, cfg.views, 1000))
    model.eval()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    w = class_balanced_weights(data.class_counts(), cfg.train.cb_beta, cfg.train.cb_cap)
    grads = torch.autograd.grad(balanced_cross_entropy(model(x, None)[0].float(), y, w), list(params.values()))
    assert set(got) == set(params)
    for (name, _), g in zip(params.items(), grads, strict=True):
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-7)  # float32 sums in another order
    assert all(p.grad is None for p in params.values())
    assert any(float(g.abs().max()) > 0 for g in got.values())


def test_a_killed_start_gradient_run_resumes_to_the_identical_state(prepared: dict, tmp_path: Path):
    base = prepared["cfg"]
    train_cfg = base.train.model_copy(update={"max_rounds": 2, "scaffold": base.train.scaffold.model_copy(
        update={"variates": "start_gradient"})})
    cfg = base.model_copy(update={"train": train_cfg})
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert train(prepared, "scaffold", reference, cfg=cfg)["rounds"] == 2
    with pytest.raises(KeyboardInterrupt):
        train(prepared, "scaffold", stopped, cfg=cfg, stop_after_round=1)
    assert train(prepared, "scaffold", stopped, cfg=cfg)["resumed_at_rounds"] == [1]
    a, b = (torch.load(p / "checkpoint.pt", map_location="cpu", weights_only=False) for p in (reference, stopped))
    assert all(torch.equal(a["members"][GLOBAL][k], b["members"][GLOBAL][k]) for k in a["members"][GLOBAL])
    with (reference / "history.csv").open() as fh:
        losses = [json.loads(r["losses"]) for r in csv.DictReader(fh)]
    assert all(terms["scaffold"] != 0 for row in losses for terms in row.values())  # corrected from round 1
