"""The federated-LoRA aggregators on a hand-sized float64 example: three clients, d = 4, r = 2
(A: 2 x 4, B: 4 x 2), scaling s = 2, unequal weights. Tolerances are float64 rounding (1e-12) where a
claim is an identity, and the tests say where one is not."""

from __future__ import annotations

import pytest
import torch

from fedhisto.fedmath.lora_aggregators import AGGREGATORS, aggregate_states, aggregator, check_frozen
from fedhisto.fedmath.lora_aggregators.flexlora import truncate

S, R, D = 2.0, 2, 4
W = [0.5, 0.3, 0.2]


def clients(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(R, D, generator=g, dtype=torch.float64), torch.randn(D, R, generator=g, dtype=torch.float64))
            for _ in W]


def mean_update(factors) -> torch.Tensor:
    return sum(w * S * (b @ a) for (a, b), w in zip(factors, W, strict=True))


def best_rank(m: torch.Tensor, r: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(m)
    return u[:, :r] @ torch.diag(s[:r]) @ vh[:r]


def test_every_registered_aggregator_builds_and_an_unknown_name_is_refused():
    assert set(AGGREGATORS) == {"delta_svd", "factor_mean", "flexlora", "fedex_lora", "ffa_lora", "fedsa_lora"}
    for name in AGGREGATORS:
        assert aggregator(name).name == name
    with pytest.raises(ValueError, match="unknown LoRA aggregator 'fedavg'"):
        aggregator("fedavg")


def test_factor_mean_averages_each_factor_and_misses_the_mean_update_by_its_cross_terms():
    f = clients()
    got = aggregator("factor_mean").pair(f, W, S, R)
    a = 0.5 * f[0][0] + 0.3 * f[1][0] + 0.2 * f[2][0]
    b = 0.5 * f[0][1] + 0.3 * f[1][1] + 0.2 * f[2][1]
    assert torch.allclose(got.a, a, atol=1e-15, rtol=0) and torch.allclose(got.b, b, atol=1e-15, rtol=0)
    cross = sum(W[k] * W[j] * S * f[k][1] @ f[j][0] for k in range(3) for j in range(3) if j != k) \
        - sum(W[k] * (1 - W[k]) * S * f[k][1] @ f[k][0] for k in range(3))
    assert torch.allclose(S * got.b @ got.a - mean_update(f), cross, atol=1e-12, rtol=0)
    assert (S * got.b @ got.a - mean_update(f)).abs().max() > 0.1  # inexact on this example, by far


def test_delta_svd_is_the_best_rank_r_approximation_of_the_mean_update():
    f = clients()
    got = aggregator("delta_svd").pair(f, W, S, R)
    assert torch.allclose(S * got.b @ got.a, best_rank(mean_update(f), R), atol=1e-12, rtol=0)


def test_flexlora_at_equal_ranks_is_the_best_rank_r_approximation():
    f = clients()
    got = aggregator("flexlora").pair(f, W, S, R)
    assert torch.allclose(S * got.b @ got.a, best_rank(mean_update(f), R), atol=1e-12, rtol=0)


def test_delta_svd_and_flexlora_agree_at_equal_ranks_up_to_each_directions_sign():
    """The claim: at equal ranks FlexLoRA is delta-SVD. The products agree to float64 rounding; the
    factors agree column by column up to a sign (each an SVD, one of the dense matrix, one of the core),
    and exactly once those signs are matched."""
    for seed in range(5):
        f = clients(seed)
        d = aggregator("delta_svd").pair(f, W, S, R)
        x = aggregator("flexlora").pair(f, W, S, R)
        assert torch.allclose(S * d.b @ d.a, S * x.b @ x.a, atol=1e-12, rtol=0)
        sign = torch.sign((d.b * x.b).sum(0))
        assert torch.allclose(d.b, x.b * sign, atol=1e-12, rtol=0)
        assert torch.allclose(d.a, x.a * sign[:, None], atol=1e-12, rtol=0)


def test_flexlora_at_unequal_ranks_gives_each_site_the_best_approximation_at_its_rank():
    """Ranks 1, 2, 2 in a rank-2 model: the rank-1 site trains zero-padded factors; the server's SVD of
    the full sum, truncated to each site's rank, is that site's best approximation."""
    f = clients()
    f[0] = truncate(*f[0], 1)
    assert torch.linalg.matrix_rank(f[0][1] @ f[0][0]) == 1
    got = aggregator("flexlora").pair(f, W, S, R)
    full = mean_update(f)
    assert torch.linalg.matrix_rank(full) == 4  # the sum of three low-rank updates is full rank here
    for rank in (1, 2):
        a, b = truncate(got.a, got.b, rank)
        assert torch.allclose(S * b @ a, best_rank(full, rank), atol=1e-12, rtol=0)
    # delta-SVD computes the same rank-2 aggregate from the zero-padded factors
    d = aggregator("delta_svd").pair(f, W, S, R)
    assert torch.allclose(S * d.b @ d.a, S * got.b @ got.a, atol=1e-12, rtol=0)


def test_fedex_lora_is_exact_with_its_folded_residual():
    """W0' + s B' A' equals the weighted mean of W0 + s B_k A_k to 1e-12."""
    f = clients()
    w0 = torch.randn(D, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = aggregator("fedex_lora").pair(f, W, S, R)
    target = sum(w * (w0 + S * b @ a) for (a, b), w in zip(f, W, strict=True))
    assert torch.allclose(w0 + got.residual + S * got.b @ got.a, target, atol=1e-12, rtol=0)
    fm = aggregator("factor_mean").pair(f, W, S, R)
    assert torch.equal(got.a, fm.a) and torch.equal(got.b, fm.b)  # the factors are factor averaging's
    assert torch.linalg.matrix_rank(got.residual) > R  # the residual is not a rank-r update: it travels dense


def test_ffa_lora_is_exact_and_refuses_a_trained_a():
    f = clients()
    a0 = f[0][0]
    shared = [(a0.clone(), b) for _, b in f]
    got = aggregator("ffa_lora").pair(shared, W, S, R)
    assert torch.equal(got.a, a0)
    assert torch.allclose(S * got.b @ got.a, mean_update(shared), atol=1e-12, rtol=0)
    key = "m.lora_A.default.weight"
    starts = {f"C{k}": {key: a0} for k in range(len(f))}
    check_frozen(aggregator("ffa_lora"), {n: {key: a0.clone()} for n in starts}, starts)
    with pytest.raises(ValueError, match=r"ffa_lora: client C1's m\.lora_A\.default\.weight differs from the broadcast A_0"):
        check_frozen(aggregator("ffa_lora"), {n: {key: a} for n, (a, _) in zip(starts, f, strict=True)}, starts)


def test_fedsa_lora_shares_the_mean_a():
    f = clients()
    got = aggregator("fedsa_lora").pair(f, W, S, R)
    assert torch.allclose(got.a, sum(w * a for (a, _), w in zip(f, W, strict=True)), atol=1e-15, rtol=0)


def test_aggregate_states_averages_the_rest_and_counts_bytes_from_the_tensors():
    f = clients()
    key = "encoder.layer.0.attention.query"
    states = [{f"{key}.lora_A.default.weight": a.float(), f"{key}.lora_B.default.weight": b.float(),
               "classifier.weight": torch.full((3, D), float(k))} for k, (a, b) in enumerate(f)]
    out, residuals = aggregate_states(aggregator("fedex_lora"), states, W, S, R)
    assert torch.allclose(out["classifier.weight"], torch.full((3, D), 0.3 + 0.4))
    assert set(residuals) == {f"{key}.lora_A.default.weight"} and residuals[f"{key}.lora_A.default.weight"].shape == (D, D)
    state = states[0]
    full = (R * D + D * R + 3 * D) * 4
    assert aggregator("delta_svd").message_bytes(state) == (full, full)
    assert aggregator("factor_mean").message_bytes(state) == (full, full)
    assert aggregator("fedex_lora").message_bytes(state) == (full + D * D * 4, full)
    assert aggregator("ffa_lora").message_bytes(state) == (full - R * D * 4, full - R * D * 4)
    assert aggregator("fedsa_lora").message_bytes(state) == (full - D * R * 4, full - D * R * 4)
    assert aggregator("flexlora").message_bytes(state, site_rank=1, model_rank=R) == (full - 2 * D * 4,) * 2
