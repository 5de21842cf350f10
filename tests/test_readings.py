"""Issue 23 item 2: each reading of an unstated choice is an option, the default is the old
behaviour (identities unchanged), and every other reading changes what it names."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import load_config
from fedhisto.fedmath.losses import class_balanced_weights
from fedhisto.fedmath.weights import Adaptive, induced_update
from fedhisto.methods import build_method
from fedhisto.methods.base import Batch, RoundUpdate, balanced_cross_entropy
from fedhisto.model.peft_model import FiLM

COUNTS = [300, 100, 12]  # a C2-like client: few SCC, the cap binds under sample_mean


def readings(**kw):
    return load_config({"train": {"readings": kw}})


def test_defaults_leave_every_identity_as_it_was():
    cfg = load_config({})
    block = stage_block(cfg, "train", method="past_v2", seed=11)
    assert "readings" not in block["train"] and "film_bound" not in block["model"]
    changed = stage_block(readings(ce_views="sum"), "train", method="past_v2", seed=11)
    assert changed["train"]["readings"]["ce_views"] == "sum"
    bounded = stage_block(load_config({"model": {"film_bound": "tanh"}}), "train", method="past_v2", seed=11)
    assert bounded["model"]["film_bound"] == "tanh"
    with pytest.raises(Exception, match="ce_views"):
        readings(ce_views="median")


def test_weight_normalisation_readings():
    sample = class_balanced_weights(COUNTS, 0.999, 4.0)
    klass = class_balanced_weights(COUNTS, 0.999, 4.0, "class_mean")
    n = torch.tensor(COUNTS, dtype=torch.float64)
    # sample_mean: the cap binds on the rare class; the per-sample mean is 1 before the cap
    assert sample[2] == pytest.approx(4.0)
    raw = (1 - 0.999) / (1 - 0.999 ** n)
    assert float((raw * n.sum() / (raw * n).sum())[2]) > 4.0
    # class_mean: the mean over present classes is 1 and the cap does not bind
    assert float(klass.double().mean()) == pytest.approx(1.0, abs=1e-6)
    assert float(klass[2]) < 4.0 and not torch.allclose(sample, klass)
    # absent classes stay 0 under both readings
    assert class_balanced_weights([50, 0, 5], normalisation="class_mean")[1] == 0
    # the engine hands the reading to every method's LocalRun
    from fedhisto.train.plan import MemberJob, local_run

    cfg = readings(ce_weight_normalisation="class_mean")
    data = SimpleNamespace(class_counts=lambda: COUNTS)
    job = MemberJob({}, data, None, {}, 11, 0, 0)
    plan = build_method("fedavg_peft", cfg).objective.local_schedule(0)
    run = local_run(None, job, cfg, plan, torch.device("cpu"), {})
    assert torch.allclose(run.ce_weights, klass)


def _run(cfg, weights):
    return SimpleNamespace(cfg=cfg, ce_weights=weights, nominal_batch=8, payload={}, device=torch.device("cpu"),
                           params={}, start_state={})


def test_reduction_reading_is_pytorchs_weighted_mean():
    torch.manual_seed(0)
    logits, y = torch.randn(8, 3), torch.tensor([0, 0, 0, 0, 0, 1, 1, 2])
    w = class_balanced_weights(COUNTS)
    ours = balanced_cross_entropy(logits, y, w, 8)
    torch_mean = balanced_cross_entropy(logits, y, w, 8, "weighted_mean")
    assert torch.allclose(torch_mean, F.cross_entropy(logits, y, weight=w))
    assert torch.allclose(ours, (F.cross_entropy(logits, y, reduction="none") * w[y]).sum() / 8)
    assert not torch.allclose(ours, torch_mean)
    batch = Batch(np.arange(8), y, 0, 0, 0)
    for method in ("fedavg_peft", "past_v2"):
        got = build_method(method, readings(ce_reduction="weighted_mean")).objective.terms_from_outputs(
            _run(readings(ce_reduction="weighted_mean"), w), batch, [logits, logits], [torch.randn(8, 4)] * 2)["ce"]
        assert torch.allclose(got, torch_mean)


def test_summed_view_ce_gives_twice_the_gradient_on_a_fixed_batch():
    torch.manual_seed(1)
    y = torch.tensor([0, 1, 2, 0])
    w = class_balanced_weights([40, 30, 10])
    base = [torch.randn(4, 3), torch.randn(4, 3)]
    grads = {}
    for reading in ("mean", "sum"):
        cfg = readings(ce_views=reading)
        logits = [b.clone().requires_grad_(True) for b in base]
        ce = build_method("past_v2", cfg).objective.terms_from_outputs(_run(cfg, w), Batch(np.arange(4), y, 0, 0, 0),
                                                                       logits, [torch.randn(4, 4)] * 2)["ce"]
        ce.backward()
        grads[reading] = torch.cat([lg.grad.flatten() for lg in logits])
    assert torch.allclose(grads["sum"], 2 * grads["mean"])
    assert grads["mean"].abs().sum() > 0


def _lora_state(rng, scale=1.0):
    a = torch.tensor(rng.normal(0, 1, (2, 5)) * scale, dtype=torch.float32)
    b = torch.tensor(rng.normal(0, 1, (6, 2)) * scale, dtype=torch.float32)
    return {"enc.q.lora_A.default.weight": a, "enc.q.lora_B.default.weight": b,
            "head.weight": torch.tensor(rng.normal(0, 1, (3, 4)), dtype=torch.float32)}


def test_induced_update_ignores_the_factor_split_and_raw_deltas_do_not():
    from fedhisto.fedmath.aggregate import flat_update

    rng = np.random.default_rng(3)
    ref, state = _lora_state(rng), _lora_state(rng)
    r = torch.tensor([[2.0, 0.5], [0.0, 0.25]])
    resplit = dict(state, **{"enc.q.lora_A.default.weight": torch.linalg.inv(r) @ state["enc.q.lora_A.default.weight"],
                             "enc.q.lora_B.default.weight": state["enc.q.lora_B.default.weight"] @ r})
    assert torch.allclose(induced_update(state, ref, 2.0), induced_update(resplit, ref, 2.0), atol=1e-5)
    assert not torch.allclose(flat_update(state, ref), flat_update(resplit, ref), atol=1e-3)
    want = 2.0 * (state["enc.q.lora_B.default.weight"].double() @ state["enc.q.lora_A.default.weight"].double()
                  - ref["enc.q.lora_B.default.weight"].double() @ ref["enc.q.lora_A.default.weight"].double())
    assert torch.allclose(induced_update(state, ref, 2.0)[:30], want.flatten())


def test_adaptive_weights_follow_the_reading_in_aggregation():
    from fedhisto.fedmath.aggregate import flat_update

    rng = np.random.default_rng(4)
    start = _lora_state(rng)
    states = {f"C{k}": _lora_state(rng, scale=0.5 + k) for k in range(1, 4)}
    counts = {"C1": 100, "C2": 60, "C3": 30}
    model = SimpleNamespace(lora_scaling=2.0)
    got = {}
    for reading in ("factors", "delta_w"):
        cfg = load_config({"train": {"readings": {"adaptive_on": reading}}, "model": {"lora_r": 2}})
        method = build_method("past_v2", cfg)
        names = sorted(states)
        w = method.client_weights([counts[n] for n in names], [flat_update(states[n], start) for n in names])
        update = RoundUpdate(0, dict(states), dict.fromkeys(states, start), counts, dict.fromkeys(states, 1),
                             dict(zip(names, w, strict=True)), None)
        with torch.no_grad():
            merged, _ = method.aggregate_train(update, model)
        got[reading] = [update.weights[n] for n in names]
        assert set(merged["global"]) == set(start)
    want = Adaptive(floor=0.03)([counts[n] for n in sorted(states)],
                                [induced_update(states[n], start, 2.0) for n in sorted(states)])
    assert got["delta_w"] == pytest.approx(want)
    assert got["factors"] != pytest.approx(got["delta_w"], abs=1e-3)


def test_film_bound_limits_the_modulation_to_its_scale():
    torch.manual_seed(2)
    z, d = torch.randn(5, 8), torch.randn(5, 14)
    films = {b: FiLM(8, 16, 0.10, bound=b) for b in ("unbounded", "tanh")}
    for f in films.values():
        torch.manual_seed(5)
        torch.nn.init.normal_(f.out.weight, std=3.0)
        torch.nn.init.normal_(f.out.bias, std=3.0)
        f.hidden.load_state_dict(films["unbounded"].hidden.state_dict())
    free, tanh = films["unbounded"](z, d), films["tanh"](z, d)
    gain = (tanh - 0.10 * torch.tanh(films["tanh"].out(films["tanh"].act(films["tanh"].hidden(d))).chunk(2, -1)[1])) / z
    assert gain.sub(1).abs().max() <= 0.10 + 1e-5
    assert ((free - z).abs() > 0.5).any()  # unbounded: well beyond the 0.10 scale
    # at initialisation (zero output layer) both readings are the identity
    zero = FiLM(8, 16, 0.10, bound="tanh")
    assert torch.equal(zero(z, d), z)
