"""Server steps against Flower's own strategies (``flwr.serverapp.strategy``, Flower 1.42's Message API)
on the same arrays: FedAvg for every method whose server averages by sample mass, FedProx (and its
client term, Li et al. 2020), FedAdam, FedYogi and FedAdagrad (Reddi et al. 2021).

A LoRA pair's factors have a gauge (B M, M^-1 A give the same s B A), so Flower receives each pair
as its dense update s B_k A_k, as the study's delta-SVD defines the aggregate; fedhisto's refactorised
pair is compared through its product with numpy's truncated SVD of Flower's result (Eckart-Young).
Everything is float64: the tolerances are float64 rounding of 64 x 64 products and SVDs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference_peers import best_rank, dense, flower_round
from reference_support import (
    Reference,
    build,
    check,
    config,
    drive_round,
    lora_scaling,
    members_of,
    model_for,
    objective_terms,
    perturbed,
    returning,
    server_moments,
    trainable_state,
)

pytestmark = pytest.mark.reference

# Methods whose server step is FedAvg of the returned states by sample mass, LoRA pairs through the
# study's delta-SVD (study section 3.8, eq. 5); they differ from each other on the client only.
FEDAVG_SERVER = ("fedavg_peft", "fedprox_peft", "film_zero", "fedavg_peft_stain", "fedstain", "fedstain_code")
FLOWER_ADAPTIVE = {"adam": "FedAdam", "yogi": "FedYogi", "adagrad": "FedAdagrad"}

REFERENCES = [
    *(Reference("method", m, "Flower FedAvg on s B_k A_k and the other tensors, numpy rank-r SVD",
                "test_the_server_step_is_flowers_fedavg_truncated_to_rank_r") for m in FEDAVG_SERVER),
    Reference("method", "fedprox_peft", "Flower FedProx's proximal-mu and (mu/2) ||w - w^t||^2 (Li et al. 2020)",
              "test_fedprox_sends_flowers_mu_and_adds_the_proximal_term"),
    Reference("method", "fedadam", "Flower FedAdam, FedYogi, FedAdagrad: two rounds, moments and step",
              "test_fedadam_yogi_adagrad_are_flowers_over_two_rounds"),
]

CLIENTS = ("C1", "C2", "C3")
COUNTS = {"C1": 10, "C2": 25, "C3": 40}
F64 = 1e-12  # float64 products, means and SVDs of O(1) 64 x 64 matrices: a few hundred ulps


def _pre_upload(method):
    """A pre-training upload where the method asks for one (FedStain's statistics; any rows will do for
    the server step, which pools them but aggregates only the states)."""
    if not method.pre_uploads:
        return None
    from fedhisto.fedmath.fedstain_code_ops import PixelMoments
    from fedhisto.fedmath.fedstain_ops import StyleStats

    def upload(name, start):
        g = torch.Generator().manual_seed(len(name))
        if method.name == "fedstain_code":
            return PixelMoments(torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g))
        return StyleStats(*(torch.randn(2, k, generator=g) for k in (3, 3, 64, 64)))

    return upload


def _one_round(name: str):
    method = build(name)
    model = model_for(method)
    x = trainable_state(model)
    trained = {c: perturbed(x, seed=k + 1) for k, c in enumerate(CLIENTS)}
    got = drive_round(method, model, members_of(method, list(CLIENTS), x), list(CLIENTS),
                      returning(trained, COUNTS, 3), pre=_pre_upload(method))
    return method, model, x, trained, got


@pytest.mark.parametrize("name", FEDAVG_SERVER)
def test_the_server_step_is_flowers_fedavg_truncated_to_rank_r(name: str, request):
    from flwr.serverapp.strategy import FedAvg

    method, model, x, trained, got = _one_round(name)
    s, r = lora_scaling(model), method.cfg.model.lora_r
    flower, _ = flower_round(FedAvg(min_train_nodes=3, min_available_nodes=3), 1, dense(x, s),
                             [(dense(trained[c], s), COUNTS[c]) for c in CLIENTS])
    ours = dense(got.members["global"], s)
    assert set(ours) == set(flower)
    worst = 0.0
    for key, ref in flower.items():
        expected = best_rank(ref, r) if ".lora_BA." in key else ref  # delta-SVD: the best rank-r approximation
        worst = max(worst, float(np.abs(ours[key] - expected).max()))
    assert got.weights == pytest.approx({c: COUNTS[c] / 75 for c in CLIENTS}, abs=1e-15)
    check(request, "method", name, worst, F64)


def test_fedprox_sends_flowers_mu_and_adds_the_proximal_term(request):
    """Flower's FedProx sends ``proximal-mu`` (here the study's 0.001, section 3.8) and documents the client
    term (mu / 2)||w - w^t||^2 (Li et al. 2020, eq. 2; Flower's own code snippet sums unsquared
    per-tensor norms, the formula above it squares them, as the paper does). The method's objective
    term and its gradient mu (w - w^t) against numpy at that mu."""
    from flwr.serverapp.strategy import FedProx

    method = build("fedprox_peft")
    model = model_for(method)
    x = trainable_state(model)
    _, sent = flower_round(FedProx(proximal_mu=0.001, min_train_nodes=2, min_available_nodes=2), 1, dense(x, 2.0),
                           [(dense(x, 2.0), 1.0), (dense(x, 2.0), 1.0)])
    mu = sent["proximal-mu"]
    w = {k: torch.nn.Parameter(v.clone()) for k, v in perturbed(x, seed=9).items()}
    y = torch.tensor([0, 1, 2, 1])
    logits = [torch.randn(4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)]
    terms = objective_terms(method, logits, [torch.zeros(4, 64, dtype=torch.float64)], y,
                            torch.ones(3, dtype=torch.float64), params=w, start_state=x)
    expected = 0.5 * mu * sum(float(((w[k].detach() - x[k]) ** 2).sum()) for k in x)
    grads = torch.autograd.grad(terms["prox"], list(w.values()))
    worst = max(abs(float(terms["prox"]) - expected),
                *(float((g - mu * (w[k].detach() - x[k])).abs().max()) for k, g in zip(w, grads, strict=True)))
    assert mu == 0.001 and expected > 0
    check(request, "method", "fedprox_peft", worst, 1e-15)


@pytest.mark.parametrize("variant", sorted(FLOWER_ADAPTIVE))
def test_fedadam_yogi_adagrad_are_flowers_over_two_rounds(variant: str, request):
    """Reddi et al.'s Algorithm 2 starts v at tau^2 (v_{-1} >= tau^2) with no bias correction, and
    FedAdagrad keeps the momentum beta_1 there; Flower's strategies start v at 0, FedAdam corrects the
    bias (eta_t = eta sqrt(1 - b2^(t+1)) / (1 - b1^(t+1))) and FedAdagrad fixes beta_1 = 0. So Flower is
    given the paper's v_{-1} = tau^2, FedAdagrad fedhisto's beta_1, and FedAdam the eta whose corrected
    value is the paper's eta; the rest is Flower's code. Moments, and the new state (each LoRA pair's
    best rank-r approximation of Flower's dense result), over two rounds."""
    import flwr.serverapp.strategy as strategies

    settings = {"variant": variant, "server_lr": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    method = build("fedadam", config(train={"fedadam": settings}))
    model = model_for(method)
    s, r = lora_scaling(model), method.cfg.model.lora_r
    tau, b1, b2, eta = settings["tau"], settings["beta1"], settings["beta2"], settings["server_lr"]
    kwargs = {"eta": eta, "tau": tau} if variant == "adagrad" else {"eta": eta, "tau": tau, "beta_1": b1, "beta_2": b2}
    flower = getattr(strategies, FLOWER_ADAPTIVE[variant])(min_train_nodes=3, min_available_nodes=3, **kwargs)
    flower.beta_1 = b1  # FedAdagrad: the paper's momentum (its constructor fixes 0; FedAdam/FedYogi: as given)
    x = trainable_state(model)
    flower.v_t = {k: np.full_like(v, tau**2) for k, v in dense(x, s).items()}  # the paper's v_{-1} = tau^2
    members, server_state, worst = members_of(method, list(CLIENTS), x), None, 0.0
    for t in (1, 2):
        x = members["global"]
        trained = {c: perturbed(x, seed=10 * t + k) for k, c in enumerate(CLIENTS)}
        got = drive_round(method, model, members, list(CLIENTS), returning(trained, COUNTS, 3),
                          server_state=server_state, round_idx=t - 1)
        if variant == "adam":  # undo Flower's bias correction of this round
            flower.eta = eta * (1 - b1 ** (t + 1)) / math.sqrt(1 - b2 ** (t + 1))
        ref, _ = flower_round(flower, t, dense(x, s), [(dense(trained[c], s), COUNTS[c]) for c in CLIENTS])
        ours = dense(got.members["global"], s)
        m, v = server_moments(got.server_state)
        assert set(ours) == set(ref) == set(m) == set(v) == set(flower.m_t)
        for key, value in ref.items():
            expected = best_rank(value, r) if ".lora_BA." in key else value
            worst = max(worst, float(np.abs(ours[key] - expected).max()), float(np.abs(m[key] - flower.m_t[key]).max()),
                        float(np.abs(v[key] - flower.v_t[key]).max()))
        members, server_state = got.members, got.server_state
        assert float(np.abs(ours[key] - dense(x, s)[key]).max()) > 1e-3  # the step moved the state
    check(request, "method", "fedadam", worst, F64)
