"""SCAFFOLD (methods.scaffold): option II's variates and the model step by hand, the paper's client-drift
toy (SCAFFOLD reaches the global optimum, FedAvg's drift does not), plain SGD local steps in both engines,
the local correction's gradient under accumulation, the LoRA variates' transport through the
refactorisation as gradients (against autograd in the new basis), both engines with non-zero variates,
resume after a kill, its declared assumptions and the report's caveat for a departure, its Table 8 row."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import train
from test_batched import ATOL, round_inputs, split

from fedhisto.config.study import load_config
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL, Batch, RoundUpdate
from fedhisto.methods.scaffold import rebalance, transport
from fedhisto.train.batched import MemberJob, batched_local_train
from fedhisto.train.local import local_train

F64 = 1e-12  # float64 arithmetic on O(1) numbers: a few ulps


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def scaffold(local_lr: float = 0.1, name: str = "scaffold", **settings):
    return build_method(name, load_config({"train": {"scaffold": {"local_lr": local_lr, **settings}}}))


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


def test_a_diverged_participant_is_refused_by_name_and_learning_rate():
    method = scaffold(local_lr=0.3)
    x = {"p": t(1.0, 2.0)}
    update = RoundUpdate(2, {"C1": x, "C2": {"p": t(1.0, float("nan"))}}, {"C1": x, "C2": x}, {"C1": 1, "C2": 1},
                         {"C1": 1, "C2": 1}, {"C1": 0.5, "C2": 0.5}, None)
    with pytest.raises(ValueError, match=r"participant C2's state after round 3 is not finite \(p, 1 tensor\(s\)\): "
                                         r"its SGD local steps diverged; lower train.scaffold.local_lr \(0.3\)"):
        method.aggregate_train(update, SimpleNamespace(lora_scaling=1.0))


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
    method = scaffold(correction_scale=1.0).objective
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
    method = scaffold(correction_scale=0.0).objective
    run = SimpleNamespace(payload={}, device=torch.device("cpu"), scratch={}, params={}, start_state={})
    with method.local_session(run):
        assert float(method.extra_terms(run, Batch(None, None, 0, 0, 0), [], [])["scaffold"]) == 0.0
    assert method.settings.correction_scale == 0.0


A_KEY, B_KEY = "m.lora_A.default.weight", "m.lora_B.default.weight"


def test_rebalance_is_an_exact_change_of_basis():
    """Unbalanced factors (B 6 x 3, A 3 x 5, s = 2) of a mean: the balanced split keeps s B A, is delta-SVD's
    (B'^T B' = A' A'^T = diag(S / s)), and B' = B M, A' = M^-1 A (float64: a few ulps of O(10) numbers)."""
    g = torch.Generator().manual_seed(5)
    s = 2.0
    b = torch.randn(6, 3, generator=g, dtype=torch.float64) * torch.tensor([5.0, 0.2, 1.0], dtype=torch.float64)
    a = torch.randn(3, 5, generator=g, dtype=torch.float64) * torch.tensor([[0.1], [3.0], [1.0]], dtype=torch.float64)
    a2, b2, m, m_inv = rebalance(a, b, s)
    torch.testing.assert_close(s * b2 @ a2, s * b @ a, rtol=0, atol=1e-12)
    torch.testing.assert_close(b2, b @ m, rtol=0, atol=1e-12)
    torch.testing.assert_close(a2, m_inv @ a, rtol=0, atol=1e-12)
    torch.testing.assert_close(m @ m_inv, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-12)
    gram = b2.T @ b2
    torch.testing.assert_close(gram, a2 @ a2.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(gram, torch.diag(torch.diagonal(gram)), rtol=0, atol=1e-12)  # diag(S / s)
    assert float((b.T @ b - a @ a.T).abs().max()) > 1.0  # the input was far from balanced: M is no rotation


def test_the_model_step_is_the_factor_mean_rebalanced_with_every_variate_transported():
    """Two clients' factors from a common start: the new global s B A is s B_mean A_mean (Algorithm 1's
    mean in the trained parameters, not delta-SVD's mean of products), and c and every c_i are in the new
    basis: transporting back as gradients (c_B M^T, M^-T c_A) recovers the variates computed in the start basis."""
    g = torch.Generator().manual_seed(9)
    method = scaffold(local_lr=0.5)
    start = {A_KEY: torch.randn(2, 4, generator=g, dtype=torch.float64),
             B_KEY: torch.randn(3, 2, generator=g, dtype=torch.float64), "head": t(0.0)}
    ys = {n: {k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in start.items()}
          for n in ("C1", "C2")}
    method.configure_train(0, None, dict.fromkeys(ys))
    update = RoundUpdate(0, ys, dict.fromkeys(ys, start), {"C1": 10, "C2": 30}, {"C1": 2, "C2": 4},
                         dict(zip(ys, method.client_weights([10, 30], [None, None]), strict=True)), None)
    assert update.weights == {"C1": 0.5, "C2": 0.5}  # uniform: the paper's 1/|S|
    members, state = method.aggregate_train(update, SimpleNamespace(lora_scaling=1.5))
    mean = {k: (ys["C1"][k] + ys["C2"][k]) / 2 for k in start}
    new = members[GLOBAL]
    torch.testing.assert_close(1.5 * new[B_KEY] @ new[A_KEY], 1.5 * mean[B_KEY] @ mean[A_KEY], rtol=0, atol=1e-12)
    torch.testing.assert_close(new["head"], mean["head"], rtol=0, atol=F64)
    _, _, m, m_inv = rebalance(mean[A_KEY], mean[B_KEY], 1.5)
    for n, k_steps in (("C1", 2), ("C2", 4)):
        in_start_basis = {k: (start[k] - ys[n][k]) / (k_steps * 0.5) for k in start}  # option II, c = c_i = 0
        back = state["clients"][n]
        torch.testing.assert_close(m_inv.T @ back[A_KEY], in_start_basis[A_KEY], rtol=0, atol=1e-11)
        torch.testing.assert_close(back[B_KEY] @ m.T, in_start_basis[B_KEY], rtol=0, atol=1e-11)
        torch.testing.assert_close(back["head"], in_start_basis["head"], rtol=0, atol=F64)


def _drift_toy(correction_scale: float, rounds: int) -> float:
    """Karimireddy et al.'s client drift on two quadratics, f_i(x) = h_i (x - o_i)^2 / 2 with
    (h, o) = (1, 0) and (3, 4): the global optimum of (f_1 + f_2) / 2 is (1 * 0 + 3 * 4) / (1 + 3) = 3.
    Each round every client takes K = 10 local steps of the method's own schedule (plain SGD,
    eta_l = 0.1) on f_i plus the method's correction term (``extra_terms``), and the server runs the
    method's ``client_weights`` and ``aggregate_train``. Returns the final global x."""
    method = scaffold(local_lr=0.1, correction_scale=correction_scale)
    objective = method.objective  # the client half: local schedule and correction term
    plan = objective.local_schedule(0)
    assert (plan.optimizer, plan.lr, plan.weight_decay, plan.grad_clip) == ("sgd", 0.1, 0.0, None)
    from fedhisto.train.local import OPTIMIZERS

    sites, steps = {"C1": (1.0, 0.0), "C2": (3.0, 4.0)}, 10
    x, server_state = {"p": t(0.0)}, None
    for r in range(rounds):
        payloads = method.configure_train(r, server_state, dict.fromkeys(sites))
        trained = {}
        for name, (h, o) in sites.items():
            theta = torch.nn.Parameter(x["p"].clone())
            run = SimpleNamespace(payload=payloads[name], device=torch.device("cpu"), scratch={}, params={"p": theta},
                                  start_state={"p": x["p"].clone()}, data=[None] * steps, nominal_batch=1, round_idx=r)
            opt = OPTIMIZERS[plan.optimizer]([theta], lr=plan.lr, weight_decay=plan.weight_decay)
            with objective.local_session(run):
                for b in range(steps):
                    opt.zero_grad()
                    loss = 0.5 * h * ((theta - o) ** 2).sum()
                    (loss + objective.extra_terms(run, Batch(None, None, 0, 0, b), [], [])["scaffold"]).backward()
                    opt.step()
            trained[name] = {"p": theta.detach().clone()}
        names = sorted(trained)
        weights = dict(zip(names, method.client_weights([10, 10], [None, None]), strict=True))
        update = RoundUpdate(r, trained, dict.fromkeys(names, x), dict.fromkeys(names, 10), dict.fromkeys(names, steps),
                             weights, server_state)
        members, server_state = method.aggregate_train(update, SimpleNamespace(lora_scaling=1.0))
        x = members[GLOBAL]
    return float(x["p"])


def test_client_drift_toy_scaffold_reaches_the_global_optimum_and_fedavg_does_not():
    """FedAvg (the correction off) stops at its drifted fixed point x = 4 (1 - 0.7^10) / (2 - 0.9^10 - 0.7^10)
    = 2.39491...: each client's 10 steps shrink x - o_i by (1 - eta h_i)^10, 0.9^10 and 0.7^10, and the mean
    of the two is stationary there. SCAFFOLD's option II variates cancel the drift: x -> 3 (linearly; 200
    rounds put it within float64 rounding, far inside 1e-6)."""
    fedavg = _drift_toy(0.0, 200)
    drifted = 4 * (1 - 0.7 ** 10) / (2 - 0.9 ** 10 - 0.7 ** 10)
    assert fedavg == pytest.approx(drifted, abs=1e-9)
    assert abs(fedavg - 3.0) > 0.6
    assert abs(_drift_toy(1.0, 200) - 3.0) < 1e-6


def test_scaffold_declares_its_papers_protocol_and_the_adamw_reading_is_marked():
    """``scaffold``: plain SGD with its own eta_l, no clipping, uniform weights: no departure. The study's
    AdamW schedule is ``scaffold_adamw``, and sample-mass weights are marked too."""
    method = scaffold(local_lr=0.05)
    plan = method.objective.local_schedule(3)
    assert (plan.optimizer, plan.lr, plan.weight_decay, plan.grad_clip, plan.accumulation) == ("sgd", 0.05, 0.0, None, 1)
    assert method.protocol_departures() == []
    assert method.client_weights([10, 30, 60], [None] * 3) == [1 / 3] * 3
    adamw = scaffold(name="scaffold_adamw")
    assert adamw.objective.local_schedule(0).optimizer == "adamw" and adamw.objective.local_schedule(0).grad_clip == 5.0
    lines = adamw.protocol_departures()
    assert len(lines) == 2 and lines[0].startswith("scaffold_adamw: local steps are adamw (lr 0.0001); "
                                                   "Karimireddy et al. 2020 (SCAFFOLD, Algorithm 1) assumes sgd")
    assert "clipped to norm 5" in lines[1]
    weighted = scaffold(weighting="sample_mass")
    assert weighted.client_weights([10, 30], [None] * 2) == [0.25, 0.75]
    assert weighted.protocol_departures() == ["scaffold: participants weighted by sample_mass; Karimireddy et al. "
                                              "2020 (SCAFFOLD, Algorithm 1) assumes uniform"]
    assert build_method("fedavg_peft", load_config({})).protocol_departures() == []


def test_the_report_marks_every_row_of_a_departing_method_and_its_comparisons():
    from fedhisto.caveats import method_caveats
    from fedhisto.report.stage import marked, method_notes

    cfg = load_config({"train": {"methods": ["fedavg_peft", "past_v2", "scaffold", "scaffold_adamw"]}})
    marks = method_caveats(cfg)
    assert sorted(marks) == ["scaffold_adamw"]  # scaffold runs under its paper's assumptions
    row = marked({"comparison": "v2_vs_x", "difference": 0.28}, marks, "past_v2", "scaffold_adamw")
    assert row["caveat"].startswith("scaffold_adamw: local steps are adamw")
    assert "caveat" not in marked({"method": "scaffold"}, marks, "scaffold")
    assert method_notes(marks, ["past_v2"]) == []
    assert all(n.startswith("CAVEAT: scaffold_adamw: ") and n.endswith("(not a finding about the method as its "
                                                                          "paper runs it)")
               for n in method_notes(marks, ["scaffold_adamw", "past_v2"]))


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
    sequential = [local_train(method.objective, model, j.start_state, j.data, j.descriptor, j.payload, cfg, j.seed,
                              j.round_idx, j.client_idx, device) for j in jobs]
    batched = batched_local_train(method.objective, model, jobs, cfg, device)
    plain = local_train(method.objective, model, jobs[0].start_state, jobs[0].data, jobs[0].descriptor, {}, cfg, jobs[0].seed,
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
    from fedhisto.accounting.stage import communication_table

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
    from fedhisto.data.splits import eval_batches
    from fedhisto.fedmath.losses import class_balanced_weights
    from fedhisto.methods.base import balanced_cross_entropy
    from fedhisto.methods.scaffold import start_gradient

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


def test_transported_variates_correct_the_gradient_computed_in_the_new_basis():
    """Option II's variates are mean local gradients, so after the change of basis B' = B M, A' = M^-1 A the
    corrected direction g_i' - c_i' + c' must be the global gradient in the NEW coordinates. Two clients with
    f_i(B, A) = 0.5 ||s B A X_i - Y_i||^2 at an unbalanced pair (singular values of M far from 1), exact
    variates c_i = grad f_i(B, A), c = their mean; every gradient is written afresh here with torch.autograd
    (float64: agreement to rounding of O(100) numbers)."""
    g = torch.Generator().manual_seed(12)
    s = 2.0
    b = torch.randn(6, 3, generator=g, dtype=torch.float64) * torch.tensor([20.0, 0.1, 1.0], dtype=torch.float64)
    a = torch.randn(3, 5, generator=g, dtype=torch.float64) * torch.tensor([[0.05], [8.0], [1.0]], dtype=torch.float64)
    data = [(torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(6, 7, generator=g, dtype=torch.float64))
            for _ in range(2)]

    def grads(b_, a_, clients) -> tuple[torch.Tensor, torch.Tensor]:
        """d/d(B, A) of the mean over ``clients`` of 0.5 ||s B A X - Y||^2."""
        b_, a_ = b_.clone().requires_grad_(True), a_.clone().requires_grad_(True)
        loss = sum(0.5 * ((s * b_ @ a_ @ x - y) ** 2).sum() for x, y in clients) / len(clients)
        return torch.autograd.grad(loss, (b_, a_))

    a2, b2, m, m_inv = rebalance(a, b, s)
    sv = torch.linalg.svdvals(m)
    assert float(sv.max()) > 3 and float(sv.min()) < 1 / 3, sv  # a far from orthogonal change of basis
    variates = []
    for client in data:
        gb, ga = grads(b, a, [client])
        variates.append({A_KEY: ga, B_KEY: gb})
    c = {k: (variates[0][k] + variates[1][k]) / 2 for k in (A_KEY, B_KEY)}
    for v in [c, *variates]:
        transport(v, A_KEY, B_KEY, m, m_inv)
    want_b, want_a = grads(b2, a2, data)  # the global gradient, computed directly in the new basis
    for i, client in enumerate(data):
        gb, ga = grads(b2, a2, [client])  # client i's data gradient after the change of basis
        got_b, got_a = gb - variates[i][B_KEY] + c[B_KEY], ga - variates[i][A_KEY] + c[A_KEY]
        err_b = float((got_b - want_b).norm() / want_b.norm())
        err_a = float((got_a - want_a).norm() / want_a.norm())
        assert err_b < 1e-12 and err_a < 1e-12, f"client {i}: relative error {err_b:.3g} on B, {err_a:.3g} on A"
