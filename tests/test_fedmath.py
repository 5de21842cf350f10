from __future__ import annotations

import math

import pytest
import torch

from fedhisto.fedmath.aggregate import aggregate, flat_update, lora_pairs
from fedhisto.fedmath.delta_svd import delta_svd, lora_delta
from fedhisto.fedmath.losses import (
    class_balanced_weights,
    feature_consistency,
    js_divergence,
    prototype_v1,
    prototype_v2,
    proximal,
)
from fedhisto.fedmath.prototypes import ClientPrototypes, aggregate_prototypes, client_prototypes
from fedhisto.fedmath.weights import Adaptive, SampleMass

torch.manual_seed(0)


def factors(out_dim=12, in_dim=7, r=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, in_dim, generator=g, dtype=torch.float64), torch.randn(out_dim, r, generator=g,
                                                                               dtype=torch.float64)


def test_delta_svd_one_client_reproduces_its_update():
    a, b = factors()
    a2, b2 = delta_svd([(a, b)], [1.0], scaling=2.0, rank=3)
    assert a2.shape == a.shape and b2.shape == b.shape  # orientation kept: A is r x in, B is out x r
    assert torch.allclose(lora_delta(a2, b2, 2.0), lora_delta(a, b, 2.0), atol=1e-10)


def test_delta_svd_is_the_best_rank_r_approximation():
    clients = [factors(seed=s) for s in range(4)]
    w = [0.1, 0.2, 0.3, 0.4]
    dw = sum(wk * lora_delta(a, b, 2.0) for (a, b), wk in zip(clients, w, strict=True))
    u, s, vh = torch.linalg.svd(dw)
    best = (u[:, :3] * s[:3]) @ vh[:3]
    a, b = delta_svd(clients, w, scaling=2.0, rank=3)
    assert torch.allclose(lora_delta(a, b, 2.0), best, atol=1e-9)
    assert torch.linalg.matrix_rank(lora_delta(a, b, 2.0)) == 3


def test_delta_svd_rejects_transposed_factors():
    a, b = factors()
    with pytest.raises(ValueError, match="do not match"):
        delta_svd([(a, b), (a.T.contiguous(), b)], [0.5, 0.5], 2.0, 3)


def test_aggregate_averages_non_lora_with_the_same_weights():
    a1, b1 = factors(seed=1)
    a2, b2 = factors(seed=2)
    s1 = {"m.lora_A.default.weight": a1, "m.lora_B.default.weight": b1, "head.weight": torch.ones(2, 2)}
    s2 = {"m.lora_A.default.weight": a2, "m.lora_B.default.weight": b2, "head.weight": torch.zeros(2, 2)}
    out = aggregate([s1, s2], [0.25, 0.75], scaling=2.0, rank=3)
    assert torch.allclose(out["head.weight"], torch.full((2, 2), 0.25))
    want = 0.25 * lora_delta(a1, b1, 2.0) + 0.75 * lora_delta(a2, b2, 2.0)
    got = lora_delta(out["m.lora_A.default.weight"], out["m.lora_B.default.weight"], 2.0)
    u, s, vh = torch.linalg.svd(want)
    assert torch.allclose(got, (u[:, :3] * s[:3]) @ vh[:3], atol=1e-9)
    assert lora_pairs(list(s1)) == [("m.lora_A.default.weight", "m.lora_B.default.weight")]
    with pytest.raises(ValueError, match="sum to 1"):
        aggregate([s1, s2], [0.5, 0.6], 2.0, 3)


def test_sample_mass_weights():
    assert SampleMass()([10, 30, 60], []) == [0.1, 0.3, 0.6]


def test_adaptive_weights_by_hand():
    """Two clients with identical-direction updates of norms 1 and 4: cos = 1, median = 2.5."""
    d = [torch.tensor([1.0, 0.0]), torch.tensor([4.0, 0.0])]
    w = Adaptive(floor=0.03)([4, 9], d)
    raw = [2 * math.exp(-0.5 * abs(math.log(1 / 2.5))), 3 * math.exp(-0.5 * abs(math.log(4 / 2.5)))]
    assert w == pytest.approx([raw[0] / sum(raw), raw[1] / sum(raw)])


def test_adaptive_floor_then_renormalise():
    d = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.1]), torch.tensor([-50.0, 0.0])]
    w = Adaptive(floor=0.03)([100, 100, 1], d)
    assert sum(w) == pytest.approx(1.0)
    # the opposing, tiny client is lifted to the 0.03 floor, then everything is renormalised:
    # w_2 = 0.03 / (1 - raw_2 + 0.03) with raw_2 ~ 0, so just under 0.03
    assert 0.029 < w[2] < 0.03
    assert w[0] > w[2] and w[1] > w[2]


def test_flat_update_order():
    ref = {"b": torch.zeros(2), "a": torch.zeros(1)}
    st = {"b": torch.tensor([1.0, 2.0]), "a": torch.tensor([3.0])}
    assert flat_update(st, ref).tolist() == [3.0, 1.0, 2.0]


def test_class_balanced_weights():
    w = class_balanced_weights([100, 10, 0], beta=0.999, cap=4.0)
    inv = [(1 - 0.999) / (1 - 0.999**n) for n in (100, 10)]
    scale = 110 / (100 * inv[0] + 10 * inv[1])  # mean per-sample weight 1
    assert w[2] == 0
    assert w[0].item() == pytest.approx(inv[0] * scale, rel=1e-5)
    assert inv[1] * scale > 4 and w[1].item() == pytest.approx(4.0)  # capped
    # C2-like skew (437 / 395 / 59): the SCC minority would exceed 4 and is capped
    capped = class_balanced_weights([437, 395, 59])
    assert capped[2].item() == pytest.approx(4.0) and capped[0] < 1


def test_js_divergence_properties():
    a = torch.tensor([[2.0, 0.0, -1.0]])
    assert js_divergence(a, a).item() == pytest.approx(0.0, abs=1e-7)
    b = torch.tensor([[-1.0, 0.0, 2.0]])
    assert js_divergence(a, b).item() == pytest.approx(js_divergence(b, a).item())
    assert 0 < js_divergence(a, b).item() <= math.log(2)


def test_feature_consistency():
    z = torch.randn(4, 8)
    assert feature_consistency(z, 3 * z).item() == pytest.approx(0.0, abs=1e-6)
    assert feature_consistency(z, -z).item() == pytest.approx(2.0)


def test_prototypes_absent_class_sends_nothing_and_masks():
    z = torch.randn(6, 4)
    up = client_prototypes(z, torch.tensor([0, 0, 1, 1, 1, 0]), 3)
    assert set(up.centroids) == {0, 1} and up.counts == {0: 3, 1: 3}
    other = ClientPrototypes({0: torch.tensor([1.0, 0, 0, 0])}, {0: 16})
    server = aggregate_prototypes([up, other], 3, 4)
    assert server.mask.tolist() == [True, True, False]
    assert server.reliability[2] == 0 and server.centroids[2].abs().sum() == 0
    assert server.reliability[server.mask].mean().item() == pytest.approx(1.0)


def test_prototype_count_weighting_and_fallback_by_hand():
    u1 = ClientPrototypes({0: torch.tensor([1.0, 0.0])}, {0: 4})
    u2 = ClientPrototypes({0: torch.tensor([0.0, 1.0]), 1: torch.tensor([0.0, 1.0])}, {0: 16, 1: 25})
    s = aggregate_prototypes([u1, u2], 2, 2)
    p = torch.tensor([2.0, 4.0]) / math.sqrt(20)
    assert torch.allclose(s.centroids[0], p.float())
    w = torch.tensor([2 / 6, 4 / 6], dtype=torch.float64)
    var = (w[0] * (torch.tensor([1.0, 0.0]) - p) ** 2 + w[1] * (torch.tensor([0.0, 1.0]) - p) ** 2).mean()
    rel0, rel1 = 1 / var.item(), 5 / (5 + 5)  # class 1: one contributor -> sqrt(25) / (sqrt(25) + 5)
    mean = (rel0 + rel1) / 2
    assert s.reliability.tolist() == pytest.approx([min(rel0 / mean, 3), rel1 / mean], rel=1e-5)


def test_prototype_v2_by_hand():
    cents = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([True, True, False])
    rel = torch.tensor([2.0, 0.5, 0.0])
    z = torch.tensor([[1.0, 1.0], [0.0, 3.0], [5.0, 5.0]])
    y = torch.tensor([0, 1, 2])  # the third sample's class has no prototype: skipped
    s = 1 / math.sqrt(2)
    attraction = (2.0 * (1 - s) + 0.5 * 0.0) / 2
    margin = (max(0, 0.2 + s - s) + max(0, 0.2 + 0 - 1)) / 2
    assert prototype_v2(z, y, cents, mask, rel, 0.2).item() == pytest.approx(attraction + margin, rel=1e-6)
    assert prototype_v1(z, y, cents, mask).item() == pytest.approx(((1 - s) + 0) / 2, rel=1e-6)


def test_proximal_term():
    p = {"w": torch.tensor([1.0, 2.0])}
    g = {"w": torch.tensor([0.0, 0.0])}
    assert proximal(p, g, 0.001).item() == pytest.approx(0.0005 * 5)
