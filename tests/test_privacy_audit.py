"""Membership-inference audit statistics and the loss-difference attack (fedhisto.privacy.audit, .attack)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn.metrics import roc_auc_score

from fedhisto.config.study import ModelConfig
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.privacy.attack import loss_difference_scores, per_image_losses, select_canaries
from fedhisto.privacy.audit import (
    audit_summary,
    bootstrap_interval,
    clopper_pearson_upper,
    empirical_epsilon,
    roc_auc,
    tpr_at_fpr,
)


def test_auc_by_hand_and_against_sklearn():
    assert roc_auc([3, 2], [1, 2]) == pytest.approx(3.5 / 4)  # 3>1, 3>2, 2>1, 2=2 counts half
    rng = np.random.default_rng(0)
    m, n = rng.normal(0.5, 1, 300).round(1), rng.normal(0, 1, 200).round(1)  # rounding makes ties
    labels = np.r_[np.ones(300), np.zeros(200)]
    assert roc_auc(m, n) == pytest.approx(roc_auc_score(labels, np.r_[m, n]), abs=1e-12)


def test_tpr_at_fpr_by_hand():
    m, n = [0.9, 0.8, 0.7, 0.2], [0.85, 0.1, 0.05, 0.0]
    assert tpr_at_fpr(m, n, 0.0) == 0.25          # only 0.9 lies above every non-member
    assert tpr_at_fpr(m, n, 0.24) == 0.25         # below one false positive in four
    assert tpr_at_fpr(m, n, 0.25) == 1.0          # one false positive (0.85) allowed: t = 0.2 takes every member
    assert tpr_at_fpr(m, n, 1.0) == 1.0
    assert tpr_at_fpr([0.1], [0.2, 0.3], 0.01) == 0.0


def test_clopper_pearson_matches_closed_forms():
    # k = 0: the upper bound solves (1 - p)^n = alpha
    assert float(clopper_pearson_upper(0, 50, 0.05)) == pytest.approx(1 - 0.05 ** (1 / 50), rel=1e-10)
    assert float(clopper_pearson_upper(50, 50, 0.05)) == 1.0
    # k = 7 of 40: P(Binomial(40, p_u) <= 7) = alpha
    pu = float(clopper_pearson_upper(7, 40, 0.05))
    assert stats.binom.cdf(7, 40, pu) == pytest.approx(0.05, rel=1e-8)


def test_empirical_epsilon_of_a_perfect_attack_by_hand():
    m, n = np.arange(1000, 2000, dtype=float), np.arange(0, 1000, dtype=float)
    bound = empirical_epsilon(m, n, delta=0.0, confidence=0.95)
    k = 2001  # 2000 distinct scores and +inf
    assert bound.thresholds_tested == k
    u = 1 - (0.05 / (2 * k)) ** (1 / 1000)  # both error counts 0 at t = 1000
    assert bound.epsilon == pytest.approx(math.log((1 - u) / u), rel=1e-9)
    assert bound.threshold == 1000.0


def test_empirical_epsilon_is_zero_without_signal_and_grows_with_it():
    rng = np.random.default_rng(1)
    same = empirical_epsilon(rng.normal(0, 1, 500), rng.normal(0, 1, 500))
    assert same.epsilon < 0.2  # Bonferroni keeps a chance fluctuation from posing as leakage
    weak = empirical_epsilon(rng.normal(1, 1, 500), rng.normal(0, 1, 500)).epsilon
    strong = empirical_epsilon(rng.normal(4, 1, 500), rng.normal(0, 1, 500)).epsilon
    assert 0 < weak < strong
    # an (eps, delta)-DP mechanism cannot yield a larger bound: randomized response at eps = 1 with many trials
    p = math.e / (1 + math.e)
    m = (rng.random(20000) < p).astype(float)
    n = (rng.random(20000) < 1 - p).astype(float)
    assert empirical_epsilon(m, n).epsilon <= 1.0


def test_bootstrap_interval_and_summary():
    rng = np.random.default_rng(2)
    m, n = rng.normal(1, 1, 400), rng.normal(0, 1, 400)
    lo, hi = bootstrap_interval(roc_auc, m, n, resamples=300, seed=3)
    point = roc_auc(m, n)
    assert lo < point < hi and hi - lo < 0.1  # AUC ~ 0.76 with 400 + 400: sd ~ 0.017
    s = audit_summary(m, n, delta=1e-5, resamples=200, seed=4)
    assert s["auc"]["value"] == point and s["members"] == 400
    assert s["tpr_at_fpr_1pct"]["low"] <= s["tpr_at_fpr_1pct"]["value"] <= s["tpr_at_fpr_1pct"]["high"]
    assert s["epsilon_lower_bound"]["value"] > 0
    with pytest.raises(ValueError, match="member: no scores"):
        roc_auc([], [1.0])


def test_canaries_are_family_aware():
    ids = [f"i{k}" for k in range(40)]
    family_of = {f"i{k}": f"F{k // 4}" for k in range(32)}  # eight families of 4; i32..i39 have none (16 in all)
    split = select_canaries(ids, family_of, per_side=5, rng=np.random.default_rng(0))
    assert len(split.members) == len(split.nonmembers) == 5
    fam = lambda i: family_of.get(i, f"image:{i}")  # noqa: E731
    assert {fam(i) for i in split.members}.isdisjoint({fam(i) for i in split.nonmembers})
    training = set(ids) - set(split.withheld)
    assert set(split.members) <= training and not set(split.nonmembers) & training
    for i in split.nonmembers:  # no relative of a non-member canary trains
        assert not {j for j in training if fam(j) == fam(i)}
    again = select_canaries(ids, family_of, per_side=5, rng=np.random.default_rng(0))
    assert again == split
    with pytest.raises(ValueError, match="20 canary families requested but the site has 16 families"):
        select_canaries(ids, family_of, per_side=10, rng=np.random.default_rng(0))


def test_loss_difference_scores_separate_trained_images():
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny"), ModelConfig(adapter_hidden=16), film=False).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(12, 3, 48, 48, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    start = model.trainable_state()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.eval()
    for _ in range(30):  # the "site" fits the first six images
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:6])[0], y[:6]).backward()
        opt.step()
    returned = model.trainable_state()
    model.load_trainable_state(start)
    model.train()
    scores = loss_difference_scores(model, start, returned, x, y, batch=5)
    # noise images through a random tiny encoder generalise to each other, so the separation is not perfect
    assert roc_auc(scores[:6], scores[6:]) > 0.85 and scores[:6].mean() > scores[6:].mean() + 1.0
    assert model.training and all(torch.equal(v, model.trainable_state()[k]) for k, v in start.items())
    ref = per_image_losses(model, start, x, y) - per_image_losses(model, returned, x, y)
    np.testing.assert_allclose(scores, ref.numpy(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="12 candidate images for 11 labels"):
        loss_difference_scores(model, start, returned, x, y[:11])


def test_lira_scores_by_hand():
    from fedhisto.privacy.audit import lira_scores

    out = np.array([[0.0, 1.0], [2.0, 3.0]])        # per candidate: mean 1 / 2, sd sqrt(2) each
    z = lira_scores([3.0, 2.0], out)
    np.testing.assert_allclose(z, [2 / np.sqrt(2), 0.0], rtol=1e-12)
    ins = np.array([[4.0, 2.0], [6.0, 4.0]])          # mean 5 / 3, sd sqrt(2)
    online = lira_scores([3.0, 2.0], out, ins)
    # equal variances: the log ratio is ((s - mu_out)^2 - (s - mu_in)^2) / (2 sd^2)
    np.testing.assert_allclose(online, [((3 - 1) ** 2 - (3 - 5) ** 2) / 4, ((2 - 2) ** 2 - (2 - 3) ** 2) / 4],
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="references >= 2"):
        lira_scores([1.0, 2.0], out[:1])
    rng = np.random.default_rng(5)  # members shifted by one reference sd are found better than by raw score
    ref = rng.normal(0, 1, (16, 400)) + rng.normal(0, 3, 400)  # candidate-specific offsets hide the signal
    member = np.r_[np.ones(200), np.zeros(200)].astype(bool)
    observed = ref[0] + rng.normal(0, 0.1, 400) + member * 1.0
    raw_auc = roc_auc(observed[member], observed[~member])
    z = lira_scores(observed, ref[1:])
    assert roc_auc(z[member], z[~member]) > raw_auc + 0.1
