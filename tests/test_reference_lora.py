"""The LoRA aggregators and the methods built on them, against code the project did not write: peft's
``add_weighted_adapter(combination_type="svd")`` and a direct numpy SVD (delta-SVD, FlexLoRA), Flower's
FedAvg on the raw factors (the factor mean is FedAvg of A and B), and each paper's equations in numpy:

- factor mean (FedIT, Zhang et al. 2024):          A' = sum_k a_k A_k,  B' = sum_k a_k B_k
- FedEx-LoRA (Singhal et al. 2025):                 the factor mean, and W0 += s sum_k a_k B_k A_k - s B' A'
- FFA-LoRA (Sun et al. 2024):                       A' = A_0 (never trained),  B' = sum_k a_k B_k
- FedSA-LoRA (Guo et al. 2025):                     A' = sum_k a_k A_k,  B_k' = B_k at each site
- FlexLoRA (Bai et al. 2024), delta-SVD (eq. 5):    the best rank-r approximation of sum_k a_k s B_k A_k
                                                    (FlexLoRA: site k receives its rank-r_k truncation)

Weights are binary fractions (1/8, 3/8, 1/2) because peft casts merge weights to float32; the rest is
float64, so the tolerances are float64 rounding of 64 x 64 (and 30 x 20) products and SVDs.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from reference_peers import best_rank, flower_round
from reference_support import (
    Reference,
    aggregate_pair,
    build,
    check,
    config,
    drive_round,
    folded,
    lora_keys,
    members_of,
    model_for,
    perturbed,
    registered_aggregators,
    returning,
    trainable_state,
)

pytestmark = pytest.mark.reference

PAPER = {
    "factor_mean": "the factor mean (FedIT) in numpy",
    "fedex_lora": "FedEx-LoRA's mean and residual fold (Singhal et al. 2025) in numpy",
    "ffa_lora": "FFA-LoRA's A' = A_0, B' = mean B (Sun et al. 2024) in numpy",
    "fedsa_lora": "FedSA-LoRA's shared A, site-kept B (Guo et al. 2025) in numpy",
}
PEFT = "peft add_weighted_adapter(svd) and a direct numpy SVD"
PAST_OPTION = ("factor_mean", "flexlora", "fedex_lora", "ffa_lora")  # train.past.lora_aggregator (fedsa_lora: refused)

REFERENCES = [
    *(Reference("aggregator", a, PEFT, "test_delta_svd_and_flexlora_are_pefts_svd_merge") for a in ("delta_svd", "flexlora")),
    Reference("aggregator", "flexlora", "peft add_weighted_adapter(svd) of adapters at ranks r_k",
              "test_flexlora_merges_sites_of_different_ranks_as_peft_does"),
    *(Reference("aggregator", a, text, "test_aggregator_is_its_papers_equations") for a, text in PAPER.items()),
    *(Reference("aggregator", a, "the same reference through fedavg_peft's train.past.lora_aggregator",
                "test_fedavg_peft_under_each_lora_aggregator_option") for a in PAST_OPTION),
    Reference("method", "factor_mean", "Flower FedAvg on the raw factors and the other tensors",
              "test_factor_mean_method_is_flowers_fedavg_of_the_factors"),
    Reference("method", "fedex_lora", "Flower FedAvg on the factors and FedEx-LoRA's fold in numpy, two rounds",
              "test_fedex_lora_method_is_exact_over_two_rounds"),
    Reference("method", "ffa_lora", "FFA-LoRA in numpy and Flower FedAvg on the rest",
              "test_ffa_lora_method_keeps_a_0_and_averages_the_rest"),
    Reference("method", "fedsa_lora", "FedSA-LoRA in numpy and Flower FedAvg on the shared tensors",
              "test_fedsa_lora_method_shares_all_but_b"),
    Reference("method", "flexlora", "peft add_weighted_adapter(svd) at the sites' ranks, two rounds",
              "test_flexlora_method_starts_each_site_at_its_rank_and_merges_as_peft"),
]

WEIGHTS = [0.125, 0.375, 0.5]          # exact in float32 (peft's merge weights are float32)
CLIENTS = ("C1", "C2", "C3")
COUNTS = {"C1": 8, "C2": 24, "C3": 32}  # sample mass: exactly WEIGHTS
F64 = 1e-12                             # float64 products and SVDs of O(1) matrices: a few hundred ulps
S, R = 2.0, 8                           # the tiny model's LoRA scaling (alpha 16 / r 8) and rank


def peft_merge(factors: list[tuple[torch.Tensor, torch.Tensor]], weights: list[float], scaling: float,
               ranks: list[int], new_rank: int) -> np.ndarray:
    """peft's SVD merge of one adapter per client (rank r_k: A_k[:r_k], B_k[:, :r_k], scaling s) into a
    rank-``new_rank`` adapter: its delta weight (peft's merged adapter has alpha = r, scaling 1)."""
    from peft import LoraConfig, get_peft_model

    out_dim, in_dim = factors[0][1].shape[0], factors[0][0].shape[1]
    base = torch.nn.Sequential(OrderedDict(lin=torch.nn.Linear(in_dim, out_dim, bias=False))).double()
    names = [f"client{k}" for k in range(len(factors))]
    model = None
    for name, (a, b), r in zip(names, factors, ranks, strict=True):
        lora = LoraConfig(r=r, lora_alpha=scaling * r, target_modules=["lin"], lora_dropout=0.0)
        if model is None:
            model = get_peft_model(base, lora, adapter_name=name)
        else:
            model.add_adapter(name, lora)
        layer = model.base_model.model.lin
        layer.lora_A[name].weight.data = a[:r].detach().double().clone()
        layer.lora_B[name].weight.data = b[:, :r].detach().double().clone()
        assert layer.scaling[name] == scaling
    model.base_model.add_weighted_adapter(names, list(weights), "merged", combination_type="svd", svd_rank=new_rank)
    return layer.get_delta_weight("merged").detach().numpy()


def _factors(seed: int, k: int = 3, rank: int = R, out_dim: int = 30, in_dim: int = 20, shared_a: bool = False):
    g = torch.Generator().manual_seed(seed)
    a0 = torch.randn(rank, in_dim, generator=g, dtype=torch.float64)
    return [(a0.clone() if shared_a else torch.randn(rank, in_dim, generator=g, dtype=torch.float64),
             torch.randn(out_dim, rank, generator=g, dtype=torch.float64)) for _ in range(k)]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def paper_pair(name: str, factors, weights, scaling: float) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(A', B', folded residual or None) of one module by the aggregator's paper, in numpy."""
    a = [_np(f[0]) for f in factors]
    b = [_np(f[1]) for f in factors]
    mean_a = sum(w * x for w, x in zip(weights, a, strict=True))
    mean_b = sum(w * x for w, x in zip(weights, b, strict=True))
    if name == "factor_mean":
        return mean_a, mean_b, None
    if name == "fedex_lora":
        clients = sum(w * scaling * (bk @ ak) for w, ak, bk in zip(weights, a, b, strict=True))
        return mean_a, mean_b, clients - scaling * (mean_b @ mean_a)
    if name == "ffa_lora":
        return a[0], mean_b, None     # every site returns the broadcast A_0 (input), untrained
    if name == "fedsa_lora":
        return mean_a, None, None     # B never leaves its site: no shared B
    raise KeyError(name)


@pytest.mark.parametrize("name", ["delta_svd", "flexlora"])
def test_delta_svd_and_flexlora_are_pefts_svd_merge(name: str, request):
    factors = _factors(1, k=4)
    weights = [0.125, 0.125, 0.25, 0.5]
    a, b, residual = aggregate_pair(name, factors, weights, S, R)
    ours = S * _np(b) @ _np(a)
    merged = peft_merge(factors, weights, S, [R] * 4, R)
    direct = best_rank(sum(w * S * _np(bk) @ _np(ak) for w, (ak, bk) in zip(weights, factors, strict=True)), R)
    # the symmetric split of delta-SVD: B^T B = A A^T = S_r / s (diagonal)
    gram_b, gram_a = _np(b).T @ _np(b), _np(a) @ _np(a).T
    split = max(float(np.abs(gram_b - gram_a).max()), float(np.abs(gram_b - np.diag(np.diag(gram_b))).max()))
    assert residual is None
    check(request, "aggregator", name, max(float(np.abs(ours - merged).max()), float(np.abs(ours - direct).max()),
                                           split), F64)


def test_flexlora_merges_sites_of_different_ranks_as_peft_does(request):
    """Sites of ranks 2, 8 and 4 (zero-padded to the model's 8, as they train): the aggregate is peft's
    merge of rank-r_k adapters at rank 8, and each site's truncation is peft's merge at rank r_k."""
    from fedhisto.fedmath.lora_aggregators.flexlora import truncate

    ranks = [2, 8, 4]
    factors = [(a.clone(), b.clone()) for a, b in _factors(2)]
    for (a, b), r in zip(factors, ranks, strict=True):
        a[r:], b[:, r:] = 0.0, 0.0
    a, b, _ = aggregate_pair("flexlora", factors, WEIGHTS, S, R)
    worst = float(np.abs(S * _np(b) @ _np(a) - peft_merge(factors, WEIGHTS, S, ranks, R)).max())
    for r in ranks:
        ta, tb = truncate(a, b, r)
        worst = max(worst, float(np.abs(S * _np(tb) @ _np(ta) - peft_merge(factors, WEIGHTS, S, ranks, r)).max()))
    check(request, "aggregator", "flexlora", worst, F64)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_aggregator_is_its_papers_equations(name: str, request):
    factors = _factors(3, shared_a=(name == "ffa_lora"))
    a, b, residual = aggregate_pair(name, factors, WEIGHTS, S, R)
    ref_a, ref_b, ref_residual = paper_pair(name, factors, WEIGHTS, S)
    pairs = [(a, ref_a)] + ([(b, ref_b)] if ref_b is not None else [])
    worst = max(float(np.abs(_np(x) - y).max()) for x, y in pairs)
    assert (residual is None) == (ref_residual is None)
    if ref_residual is not None:
        worst = max(worst, float(np.abs(_np(residual) - ref_residual).max()))
        # exact: W0 + R + s B' A' is the mean of the clients' models W0 + s B_k A_k (W0 cancels)
        clients = sum(w * S * _np(bk) @ _np(ak) for w, (ak, bk) in zip(WEIGHTS, factors, strict=True))
        worst = max(worst, float(np.abs(_np(residual) + S * _np(b) @ _np(a) - clients).max()))
    check(request, "aggregator", name, worst, F64)


@pytest.mark.parametrize("name", PAST_OPTION)
def test_fedavg_peft_under_each_lora_aggregator_option(name: str, request):
    """fedavg_peft with ``train.past.lora_aggregator``: every pair as the aggregator's reference (numpy, or
    peft's merge for FlexLoRA), every other tensor as Flower's FedAvg."""
    from flwr.serverapp.strategy import FedAvg

    method = build("fedavg_peft", config(train={"past": {"lora_aggregator": name}}))
    model = model_for(method)
    x = trainable_state(model)
    frozen = (lambda k: ".lora_A." in k) if name == "ffa_lora" else (lambda k: False)
    trained = {c: perturbed(x, seed=k + 1, skip=frozen) for k, c in enumerate(CLIENTS)}
    got = drive_round(method, model, members_of(method, list(CLIENTS), x), list(CLIENTS),
                      returning(trained, COUNTS, 3))
    new = got.members["global"]
    worst = _pairs_against_reference(name, new, [trained[c] for c in CLIENTS], x)
    paired = {k for p in lora_keys(x) for k in p}
    rest = {k: v for k, v in x.items() if k not in paired}
    flower, _ = flower_round(FedAvg(min_train_nodes=3, min_available_nodes=3), 1, _arrays(rest),
                             [(_arrays({k: trained[c][k] for k in rest}), COUNTS[c]) for c in CLIENTS])
    worst = max(worst, *(float(np.abs(_np(new[k]) - v).max()) for k, v in flower.items()))
    check(request, "aggregator", name, worst, F64)


def _arrays(state) -> dict[str, np.ndarray]:
    return {k: _np(v) for k, v in state.items()}


def _pairs_against_reference(name: str, new, states, start) -> float:
    """Largest difference of every LoRA pair (and FedEx-LoRA's fold) of the new global state from the
    aggregator's reference over the clients' returned states."""
    worst = 0.0
    folds = folded(new)
    for a_key, b_key in lora_keys(start):
        factors = [(s[a_key], s[b_key]) for s in states]
        if name == "flexlora":
            ref = peft_merge(factors, WEIGHTS, S, [R] * len(factors), R)
            worst = max(worst, float(np.abs(S * _np(new[b_key]) @ _np(new[a_key]) - ref).max()))
            continue
        ref_a, ref_b, ref_residual = paper_pair(name, factors, WEIGHTS, S)
        worst = max(worst, float(np.abs(_np(new[a_key]) - ref_a).max()), float(np.abs(_np(new[b_key]) - ref_b).max()))
        if ref_residual is not None:
            before = folded(start).get(a_key)
            expected = ref_residual + (_np(before) if before is not None else 0.0)
            worst = max(worst, float(np.abs(_np(folds[a_key]) - expected).max()))
    return worst


def test_factor_mean_method_is_flowers_fedavg_of_the_factors(request):
    from flwr.serverapp.strategy import FedAvg

    method = build("factor_mean")
    model = model_for(method)
    x = trainable_state(model)
    trained = {c: perturbed(x, seed=k + 4) for k, c in enumerate(CLIENTS)}
    got = drive_round(method, model, members_of(method, list(CLIENTS), x), list(CLIENTS),
                      returning(trained, COUNTS, 3))
    flower, _ = flower_round(FedAvg(min_train_nodes=3, min_available_nodes=3), 1, _arrays(x),
                             [(_arrays(trained[c]), COUNTS[c]) for c in CLIENTS])
    new = got.members["global"]
    assert set(new) == set(flower)
    check(request, "method", "factor_mean", max(float(np.abs(_np(new[k]) - v).max()) for k, v in flower.items()), F64)


def test_fedex_lora_method_is_exact_over_two_rounds(request):
    """Round t: the factors are Flower's FedAvg of the returned factors, the folded offset D_t = D_{t-1} +
    s sum_k a_k B_k A_k - s B' A' (numpy), so the global model D_t + s B' A' equals the mean of the
    clients' models D_{t-1} + s B_k A_k exactly (the frozen W0 cancels)."""
    from flwr.serverapp.strategy import FedAvg

    method = build("fedex_lora")
    model = model_for(method)
    members = members_of(method, list(CLIENTS), trainable_state(model))
    worst = 0.0
    for t in (1, 2):
        start = members["global"]
        mine = {k: v for k, v in start.items() if not k.startswith("folded_base.")}
        trained = {c: perturbed(mine, seed=10 * t + k) for k, c in enumerate(CLIENTS)}
        got = drive_round(method, model, members, list(CLIENTS), returning(trained, COUNTS, 3),
                          round_idx=t - 1)
        new = got.members["global"]
        flower, _ = flower_round(FedAvg(min_train_nodes=3, min_available_nodes=3), t, _arrays(mine),
                                 [(_arrays(trained[c]), COUNTS[c]) for c in CLIENTS])
        worst = max(worst, *(float(np.abs(_np(new[k]) - v).max()) for k, v in flower.items()))
        worst = max(worst, _pairs_against_reference("fedex_lora", new, [trained[c] for c in CLIENTS], start))
        before, after = folded(start), folded(new)
        for a_key, b_key in lora_keys(mine):
            previous = _np(before[a_key]) if a_key in before else 0.0
            clients = sum(w * (previous + S * _np(trained[c][b_key]) @ _np(trained[c][a_key]))
                          for w, c in zip(WEIGHTS, CLIENTS, strict=True))
            worst = max(worst, float(np.abs(_np(after[a_key]) + S * _np(new[b_key]) @ _np(new[a_key]) - clients).max()))
        assert len(after) == len(lora_keys(mine))
        members = got.members
    check(request, "method", "fedex_lora", worst, F64)


def test_ffa_lora_method_keeps_a_0_and_averages_the_rest(request):
    from flwr.serverapp.strategy import FedAvg

    method = build("ffa_lora")
    model = model_for(method)
    x = trainable_state(model)
    trained = {c: perturbed(x, seed=k + 7, skip=lambda key: ".lora_A." in key) for k, c in enumerate(CLIENTS)}
    got = drive_round(method, model, members_of(method, list(CLIENTS), x), list(CLIENTS),
                      returning(trained, COUNTS, 3))
    new = got.members["global"]
    rest = {k: v for k, v in x.items() if ".lora_A." not in k}
    flower, _ = flower_round(FedAvg(min_train_nodes=3, min_available_nodes=3), 1, _arrays(rest),
                             [(_arrays({k: trained[c][k] for k in rest}), COUNTS[c]) for c in CLIENTS])
    worst = max(float(np.abs(_np(new[k]) - v).max()) for k, v in flower.items())
    worst = max(worst, *(float(np.abs(_np(new[a]) - _np(x[a])).max()) for a, _ in lora_keys(x)))  # A' = A_0
    check(request, "method", "ffa_lora", worst, F64)


def test_fedsa_lora_method_shares_all_but_b(request):
    """One member per site: A and every non-B tensor are Flower's FedAvg of the returned ones, shared by
    every site; each site keeps its own B; each site starts the next round from its own member."""
    from flwr.serverapp.strategy import FedAvg

    method = build("fedsa_lora")
    model = model_for(method)
    x = trainable_state(model)
    trained = {c: perturbed(x, seed=k + 11) for k, c in enumerate(CLIENTS)}
    got = drive_round(method, model, members_of(method, list(CLIENTS), x), list(CLIENTS),
                      returning(trained, COUNTS, 3))
    assert sorted(got.members) == sorted(CLIENTS)
    shared = {k: v for k, v in x.items() if ".lora_B." not in k}
    flower, _ = flower_round(FedAvg(min_train_nodes=3, min_available_nodes=3), 1, _arrays(shared),
                             [(_arrays({k: trained[c][k] for k in shared}), COUNTS[c]) for c in CLIENTS])
    worst = 0.0
    for c in CLIENTS:
        worst = max(worst, *(float(np.abs(_np(got.members[c][k]) - v).max()) for k, v in flower.items()))
        worst = max(worst, *(float(np.abs(_np(got.members[c][b]) - _np(trained[c][b])).max()) for _, b in lora_keys(x)))
    again = drive_round(method, model, got.members, list(CLIENTS), lambda n, s, p: (s, COUNTS[n], 3), round_idx=1)
    worst = max(worst, *(float(np.abs(_np(again.starts[c][k]) - _np(got.members[c][k])).max())
                         for c in CLIENTS for k in x))
    check(request, "method", "fedsa_lora", worst, F64)


def _balanced(state, seed: int):
    """``state`` with every LoRA pair replaced by the symmetric SVD split of a random rank-8 product
    (B = U sqrt(S / s), A = sqrt(S / s) V^T, numpy), the form FlexLoRA's aggregate has."""
    g = np.random.default_rng(seed)
    out = dict(state)
    for a_key, b_key in lora_keys(state):
        out_dim, in_dim = state[b_key].shape[0], state[a_key].shape[1]
        u, sv, vh = np.linalg.svd(g.normal(size=(out_dim, R)) @ g.normal(size=(R, in_dim)) * 0.1, full_matrices=False)
        root = np.sqrt(sv[:R] / S)
        out[a_key] = torch.from_numpy(root[:, None] * vh[:R])
        out[b_key] = torch.from_numpy(u[:, :R] * root)
    return out


def test_flexlora_method_starts_each_site_at_its_rank_and_merges_as_peft(request):
    """Sites C1 at rank 2 and C3 at rank 4 (C2 at the model's 8). Each site starts from the rank-r_k SVD
    truncation of the global s B A (numpy), trains its r_k directions, and the aggregate is peft's SVD
    merge of the sites' rank-r_k adapters at rank 8; in round 2 each site starts from peft's merge of
    round 1's adapters at its own rank."""
    ranks = {"C1": 2, "C2": R, "C3": 4}
    method = build("flexlora", config(train={"lora_aggregation": {"site_ranks": [["C1", 2], ["C3", 4]]}}))
    model = model_for(method)
    x = _balanced(trainable_state(model), seed=3)

    def local(name, start, payload):
        r = ranks[name]
        grow = perturbed(start, seed=len(name) + r)
        for a_key, b_key in lora_keys(start):  # a rank-r_k site's padded rows and columns stay 0 (zero gradients)
            grow[a_key][r:], grow[b_key][:, r:] = 0.0, 0.0
        return grow, COUNTS[name], 3

    first = drive_round(method, model, members_of(method, list(CLIENTS), x), list(CLIENTS), local)
    worst = 0.0
    for c in CLIENTS:
        for a_key, b_key in lora_keys(x):
            start = S * _np(first.starts[c][b_key]) @ _np(first.starts[c][a_key])
            worst = max(worst, float(np.abs(start - best_rank(S * _np(x[b_key]) @ _np(x[a_key]), ranks[c])).max()))
    trained = {c: local(c, first.starts[c], {})[0] for c in CLIENTS}
    new = first.members["global"]
    second = drive_round(method, model, first.members, list(CLIENTS), lambda n, s, p: (s, COUNTS[n], 3), round_idx=1)
    for a_key, b_key in lora_keys(x):
        factors = [(trained[c][a_key], trained[c][b_key]) for c in CLIENTS]
        merged = peft_merge(factors, WEIGHTS, S, [ranks[c] for c in CLIENTS], R)
        worst = max(worst, float(np.abs(S * _np(new[b_key]) @ _np(new[a_key]) - merged).max()))
        for c in CLIENTS:
            at_rank = peft_merge(factors, WEIGHTS, S, [ranks[k] for k in CLIENTS], ranks[c])
            start = S * _np(second.starts[c][b_key]) @ _np(second.starts[c][a_key])
            worst = max(worst, float(np.abs(start - at_rank).max()))
    check(request, "method", "flexlora", worst, F64)


def test_every_registered_aggregator_has_a_reference_here():
    assert {r.name for r in REFERENCES if r.kind == "aggregator"} == set(registered_aggregators())
