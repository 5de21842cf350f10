"""FedAdam / FedYogi / FedAdagrad (methods.fedadam): moments and steps by hand, the dense LoRA-pair
update refactorised to rank r, resume after a kill, and its Table 8 row (no extra traffic)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import train

from fedhisto.config.study import load_config
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL, RoundUpdate
from fedhisto.methods.fedadam import pair_key

F64 = 1e-12  # float64 arithmetic on O(1) numbers: a few ulps
# round numbers so the hand computation below stays exact: eta 0.5, b1 0.5, b2 0.75, tau 0.25 (v0 = 1/16)
HAND = {"server_lr": 0.5, "beta1": 0.5, "beta2": 0.75, "tau": 0.25}


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def fedadam(lora_r: int = 8, **settings):
    return build_method("fedadam", load_config({"model": {"lora_r": lora_r}, "train": {"fedadam": settings}}))


def round_update(r: int, x: dict, ys: dict, weights: dict, server_state) -> RoundUpdate:
    return RoundUpdate(r, ys, dict.fromkeys(ys, x), dict.fromkeys(ys, 10), dict.fromkeys(ys, 3), weights, server_state)


@pytest.mark.parametrize("variant", ["adam", "yogi", "adagrad"])
def test_moments_and_step_of_two_clients_and_two_parameters_by_hand(variant: str):
    """x = (1, -1); A returns (2, -1), B returns (1, 0), weights 1/4, 3/4:
        Delta = (1.25, -0.25) - x = (0.25, 0.75);  m = 0.5 * 0 + 0.5 Delta = (0.125, 0.375)
        v0 = tau^2 = 0.0625, Delta^2 = (0.0625, 0.5625)
        adam:    v = 0.75 v0 + 0.25 Delta^2                      = (0.0625, 0.1875)
        yogi:    v = v0 - 0.25 Delta^2 sign(v0 - Delta^2)        = (0.0625, 0.203125)   (sign = (0, -1))
        adagrad: v = v0 + Delta^2                                = (0.125, 0.625)
        x+ = x + 0.5 m / (sqrt(v) + 0.25)
    Round 2 (adam): both return x+ + (-0.5, 0.25): Delta = (-0.5, 0.25),
        m = 0.5 m + 0.5 Delta = (-0.1875, 0.3125), v = 0.75 v + 0.25 Delta^2 = (0.109375, 0.15625).
    """
    method = fedadam(variant=variant, **HAND)
    model = SimpleNamespace(lora_scaling=2.0)
    x = {"p": t(1.0, -1.0)}
    members, state = method.aggregate_train(
        round_update(0, x, {"C1": {"p": t(2.0, -1.0)}, "C2": {"p": t(1.0, 0.0)}}, {"C1": 0.25, "C2": 0.75}, None), model)
    m = t(0.125, 0.375)
    v = {"adam": t(0.0625, 0.1875), "yogi": t(0.0625, 0.203125), "adagrad": t(0.125, 0.625)}[variant]
    torch.testing.assert_close(state["m"]["p"], m, rtol=0, atol=F64)
    torch.testing.assert_close(state["v"]["p"], v, rtol=0, atol=F64)
    expected = t(*(xi + 0.5 * mi / (math.sqrt(vi) + 0.25) for xi, mi, vi in zip([1.0, -1.0], m.tolist(), v.tolist(),
                                                                                     strict=True)))
    torch.testing.assert_close(members[GLOBAL]["p"], expected, rtol=0, atol=F64)
    assert state["t"] == 1
    if variant != "adam":
        return
    x1 = members[GLOBAL]
    y = {"p": x1["p"] + t(-0.5, 0.25)}
    members, state = method.aggregate_train(round_update(1, x1, {"C1": y, "C2": y}, {"C1": 0.5, "C2": 0.5}, state),
                                            model)
    m2, v2 = t(-0.1875, 0.3125), t(0.109375, 0.15625)
    torch.testing.assert_close(state["m"]["p"], m2, rtol=0, atol=F64)
    torch.testing.assert_close(state["v"]["p"], v2, rtol=0, atol=F64)
    torch.testing.assert_close(members[GLOBAL]["p"], x1["p"] + 0.5 * m2 / (v2.sqrt() + 0.25), rtol=0, atol=F64)
    assert state["t"] == 2


def test_a_lora_pair_steps_in_the_dense_update_and_comes_back_as_its_best_rank_r_factors():
    """Rank 1, s = 2, a 2 x 2 layer: moments of s B A (not of A and B), and the new factors are the
    truncated SVD of s B A + step, split symmetrically (numpy's SVD as the independent reference)."""
    method = fedadam(lora_r=1, **HAND)
    s = 2.0
    a_key, b_key = "enc.q.lora_A.default.weight", "enc.q.lora_B.default.weight"
    x = {a_key: t(0.5, -1.0)[None], b_key: t(1.0, 0.5)[:, None], "head": t(0.1)}
    ys = {"C1": {a_key: t(1.0, 0.0)[None], b_key: t(1.0, 1.0)[:, None], "head": t(0.3)},
          "C2": {a_key: t(0.0, 1.0)[None], b_key: t(0.5, -1.0)[:, None], "head": t(0.2)}}
    members, state = method.aggregate_train(round_update(0, x, ys, {"C1": 0.5, "C2": 0.5}, None),
                                            SimpleNamespace(lora_scaling=s))
    assert set(state["m"]) == {pair_key(a_key), "head"} and state["m"][pair_key(a_key)].shape == (2, 2)
    current = s * np.outer([1.0, 0.5], [0.5, -1.0])
    target = 0.5 * s * np.outer([1.0, 1.0], [1.0, 0.0]) + 0.5 * s * np.outer([0.5, -1.0], [0.0, 1.0])
    delta = target - current
    m = 0.5 * delta
    v = 0.75 * 0.0625 + 0.25 * delta**2
    dense = current + 0.5 * m / (np.sqrt(v) + 0.25)
    np.testing.assert_allclose(state["m"][pair_key(a_key)].numpy(), m, rtol=0, atol=F64)
    np.testing.assert_allclose(state["v"][pair_key(a_key)].numpy(), v, rtol=0, atol=F64)
    u, sv, vh = np.linalg.svd(dense)
    best = sv[0] * np.outer(u[:, 0], vh[0])  # Eckart-Young: the best rank-1 approximation
    a, b = members[GLOBAL][a_key], members[GLOBAL][b_key]
    np.testing.assert_allclose((s * b @ a).numpy(), best, rtol=0, atol=F64)
    # symmetric split: both factors carry sqrt(S / s)
    assert float(a.norm()) == pytest.approx(math.sqrt(sv[0] / s), rel=1e-12)
    assert float(b.norm()) == pytest.approx(math.sqrt(sv[0] / s), rel=1e-12)
    head_delta = 0.25 - 0.1
    hm, hv = 0.5 * head_delta, 0.75 * 0.0625 + 0.25 * head_delta**2
    assert float(members[GLOBAL]["head"]) == pytest.approx(0.1 + 0.5 * hm / (math.sqrt(hv) + 0.25), abs=F64)


def test_weights_that_do_not_sum_to_one_are_refused():
    x = {"p": t(1.0, 2.0)}
    with pytest.raises(ValueError, match=r"fedadam: aggregation weights must sum to 1, got 0\.9"):
        fedadam().aggregate_train(round_update(0, x, {"C1": x}, {"C1": 0.9}, None), SimpleNamespace(lora_scaling=1.0))


def test_a_killed_fedadam_run_resumes_to_the_identical_state_and_moments(prepared: dict, tmp_path: Path):
    cfg = prepared["cfg"].model_copy(update={"train": prepared["cfg"].train.model_copy(update={"max_rounds": 3})})
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert train(prepared, "fedadam", reference, cfg=cfg)["rounds"] == 3
    with pytest.raises(KeyboardInterrupt):
        train(prepared, "fedadam", stopped, cfg=cfg, stop_after_round=2)
    assert train(prepared, "fedadam", stopped, cfg=cfg)["resumed_at_rounds"] == [2]
    a, b = (torch.load(p / "checkpoint.pt", map_location="cpu", weights_only=False) for p in (reference, stopped))
    assert all(torch.equal(a["members"][GLOBAL][k], b["members"][GLOBAL][k]) for k in a["members"][GLOBAL])
    assert a["server_state"]["t"] == b["server_state"]["t"] == 3
    for part in ("m", "v"):
        assert all(torch.equal(a["server_state"][part][k], b["server_state"][part][k]) for k in a["server_state"][part])
    dense = [k for k in a["server_state"]["m"] if "lora_BA" in k]
    assert dense and all(a["server_state"]["m"][k].dim() == 2 for k in dense)


def test_table8_row_is_fedavg_peft_traffic():
    from fedhisto.accounting.stage import communication_table

    rows = {r["method"]: r for r in communication_table(load_config({"train": {"methods": ["fedavg_peft", "fedadam"]}}))}
    same = ("payload_mib", "model_per_round_mib", "per_round_mib", "other_extra_per_round_mib")
    assert [rows["fedadam"][k] for k in same] == [rows["fedavg_peft"][k] for k in same]
    assert rows["fedadam"]["overhead_vs_fedavg_pct"] == "0.000000"
