"""A site's DP-SGD over rounds (fedhisto.privacy.site_dpsgd): epsilon equals an independent accountant call,
a resumed site replays the rounds exactly, and the budget stops it by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from fedhisto.config.privacy_settings import PrivacyConfig
from fedhisto.config.study import ModelConfig
from fedhisto.methods.past import PastUnitLoss
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.privacy import rdp
from fedhisto.privacy.accountant import PrivacyBudgetExceeded
from fedhisto.privacy.dpsgd import privacy_units
from fedhisto.privacy.site_dpsgd import DPSite

PRIV = PrivacyConfig(enabled=True, noise_multiplier=1.0, clip_norm=1.0, sample_rate=0.5, delta=1e-2 / 2,
                     micro_batch=3, dropout="off")


def _setup():
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny"), ModelConfig(adapter_hidden=16), film=False).double().train()
    g = torch.Generator().manual_seed(1)
    views = torch.rand(8, 2, 3, 48, 48, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    loss = PastUnitLoss(ce_weights=torch.ones(3, dtype=torch.float64), weight_js=0.25)
    return model, (lambda idx: (views[idx], labels[idx])), loss


def _round(site: DPSite, model, fetch, loss, r: int) -> float:
    trained = {n: None for n, p in model.named_parameters() if p.requires_grad}  # every trainable tensor
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)  # a fresh optimiser per round
    return site.train_round(r, model, opt, loss, fetch, trained)


def test_epsilon_per_round_is_the_independent_accountant_value_and_resume_is_exact():
    units = privacy_units([f"i{k}" for k in range(8)], "image")
    model, fetch, loss = _setup()
    site = DPSite.start("C1", units, PRIV, rounds=3, local_epochs=1, uploads_prototypes=False, seed=123)
    assert site.steps_per_round() == 2
    start = model.trainable_state()
    eps = [_round(site, model, fetch, loss, r) for r in range(3)]
    for r, e in enumerate(eps):
        assert e == rdp.epsilon(1.0, 0.5, 2 * (r + 1), PRIV.delta)
    assert [row["epsilon"] for row in site.ledger.history()] == eps
    full = model.trainable_state()
    assert any(not torch.equal(full[k], start[k]) for k in start)

    # killed after round 1: the checkpoint holds the model state and the site's privacy state
    model2, fetch2, loss2 = _setup()
    first = DPSite.start("C1", units, PRIV, rounds=3, local_epochs=1, uploads_prototypes=False, seed=123)
    for r in range(2):
        _round(first, model2, fetch2, loss2, r)
    saved_model, saved_site = model2.trainable_state(), json.loads(json.dumps(first.state()))
    model3, fetch3, loss3 = _setup()
    model3.load_trainable_state(saved_model)
    resumed = DPSite.resume(saved_site, units, PRIV, local_epochs=1, uploads_prototypes=False)
    assert _round(resumed, model3, fetch3, loss3, 2) == eps[2]
    for k, v in model3.trainable_state().items():
        assert torch.equal(v, full[k]), k  # bit-identical to the run that never stopped
    with pytest.raises(ValueError, match="checkpoint ledger has delta"):
        DPSite.resume(saved_site, units, PRIV.model_copy(update={"delta": 1e-3}), 1, False)


def test_a_secret_seed_gives_other_noise():
    units = privacy_units([f"i{k}" for k in range(8)], "image")
    a = DPSite.start("C1", units, PRIV, 1, 1, False)
    b = DPSite.start("C1", units, PRIV, 1, 1, False)
    assert a.seed != b.seed


def test_budget_refuses_the_plan_or_stops_the_site_by_name():
    units = privacy_units([f"i{k}" for k in range(8)], "image")
    after = [rdp.epsilon(1.0, 0.5, 2 * (r + 1), PRIV.delta) for r in range(3)]
    budget = (after[0] + after[1]) / 2
    with pytest.raises(PrivacyBudgetExceeded, match=r"site C5: the plan reaches epsilon .* after round 1"):
        DPSite.start("C5", units, SimpleNamespace(**{**PRIV.model_dump(), "target_epsilon": budget,
                                                      "on_budget": "refuse"}), 3, 1, False, seed=1)
    stop = SimpleNamespace(**{**PRIV.model_dump(), "target_epsilon": budget, "on_budget": "stop"})
    site = DPSite.start("C5", units, stop, 3, 1, False, seed=1)
    model, fetch, loss = _setup()
    assert _round(site, model, fetch, loss, 0) == after[0]
    before = model.trainable_state()
    with pytest.raises(PrivacyBudgetExceeded, match=r"site C5: round 1 would raise epsilon from .* above the budget"):
        _round(site, model, fetch, loss, 1)
    assert all(torch.equal(v, model.trainable_state()[k]) for k, v in before.items())  # refused before any step
