"""FedStain comparator math (SPEC section 11): moments, pools, RandStain, MixStyle, SupCon, JS, AugMix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st
import torch

from fedhisto.federated.fedstain import (
    StyleStats,
    augmix,
    channel_moments,
    js_multi,
    mixstyle_higher_order,
    pool_excluding,
    randstain,
    representation_alignment,
    supcon,
    upload_count,
)
from fedhisto.federated.losses import js_divergence


def stats(n: int, value: float, channels: int = 4) -> StyleStats:
    return StyleStats(torch.full((n, 3), value), torch.full((n, 3), value / 10),
                      torch.full((n, channels), value), torch.full((n, channels), 2 * value))


def test_channel_moments_match_scipy():
    x = torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(0)) ** 3  # skewed
    mu, sd, skew, kurt = channel_moments(x)
    flat = x.flatten(2).double().numpy()
    np.testing.assert_allclose(mu, flat.mean(2), atol=1e-6)
    np.testing.assert_allclose(sd, flat.std(2), atol=1e-6)
    # eps 1e-6 added to variances near 0.08 biases by about 2 eps / var = 3e-5 relative (float32 adds less)
    np.testing.assert_allclose(skew, st.skew(flat, axis=2), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(kurt, st.kurtosis(flat, axis=2, fisher=False), rtol=1e-4)


@pytest.mark.parametrize(("n", "ratio", "expected"), [(0, 0.1, 0), (1, 0.1, 1), (10, 0.1, 1), (11, 0.1, 2),
                                                      (100, 0.1, 10), (101, 0.1, 11), (7, 1.0, 7)])
def test_upload_count_is_ceil_r_n(n: int, ratio: float, expected: int):
    assert upload_count(n, ratio) == expected


def test_pool_excludes_the_clients_own_rows():
    uploads = {"C1": stats(1, 1.0), "C2": stats(2, 2.0), "C3": stats(3, 3.0)}
    pool = pool_excluding(uploads, "C2")
    assert pool.feat_skew[:, 0].tolist() == [1.0, 3.0, 3.0, 3.0]
    assert pool.n_values() == 4 * (3 + 3 + 4 + 4)
    with pytest.raises(ValueError, match="no other client"):
        pool_excluding({"C1": stats(1, 1.0)}, "C1")


def test_randstain_takes_the_pooled_channel_statistics():
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    pool = StyleStats(torch.tensor([[0.6, 0.5, 0.4]]), torch.tensor([[0.05, 0.10, 0.08]]),
                      torch.zeros(1, 4), torch.zeros(1, 4))
    out = randstain(x, pool, np.random.default_rng(0))
    mu, sd, _, _ = channel_moments(out)
    # standardised uniform values stay within +-1.8 sd, so no clipping binds and the moments are exact
    np.testing.assert_allclose(mu, pool.pixel_mean.expand(2, 3), atol=1e-5)
    np.testing.assert_allclose(sd, pool.pixel_std.expand(2, 3), atol=1e-5)


def test_mixstyle_follows_algorithm_1():
    x = torch.rand(3, 4, 50, generator=torch.Generator().manual_seed(2)) ** 2
    pool = StyleStats(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([[0.5] * 4, [-1.0] * 4]),
                      torch.tensor([[2.0] * 4, [4.0] * 4]))
    out = mixstyle_higher_order(x, pool, np.random.default_rng(7), alpha=0.1)
    replay = np.random.default_rng(7)
    rows, lam = replay.integers(2, size=3), replay.beta(0.1, 0.1, size=(3, 1))
    _, _, skew, kurt = channel_moments(x)
    lam_t = torch.from_numpy(lam).float()
    beta_mix = lam_t * pool.feat_skew[rows] + (1 - lam_t) * skew
    gamma_mix = lam_t * pool.feat_kurt[rows] + (1 - lam_t) * kurt
    mu, sd, _, _ = channel_moments(out)
    # a standardised x has mean 0 and deviation 1, so x_hat = gamma * x~ + beta has exactly those moments
    np.testing.assert_allclose(mu, beta_mix, atol=1e-5)
    np.testing.assert_allclose(sd, gamma_mix.abs(), rtol=1e-4)


def test_supcon_hand_computed():
    z = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 0, 1])
    # anchors 1 and 2: one positive (similarity 1) against one negative (similarity 0), tau 1;
    # anchor 3 has no positive and is left out of the mean
    assert supcon(z, y, tau=1.0).item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    assert supcon(z, torch.tensor([0, 1, 2]), tau=0.1).item() == 0.0


def test_representation_alignment_averages_over_augmented_sets():
    g = torch.Generator().manual_seed(3)
    z, a, b = (torch.randn(4, 8, generator=g) for _ in range(3))
    y = torch.tensor([0, 1, 0, 2])
    expected = (supcon(torch.cat([z, a]), y.repeat(2)) + supcon(torch.cat([z, b]), y.repeat(2))) / 2
    assert representation_alignment(z, [a, b], y).item() == pytest.approx(expected.item(), rel=1e-6)


def test_js_multi_reduces_to_the_pairwise_js_and_vanishes_on_agreement():
    g = torch.Generator().manual_seed(4)
    p, q = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g)
    assert js_multi([p, q]).item() == pytest.approx(js_divergence(p, q).item(), rel=1e-5)
    assert js_multi([p, p, p, p]).item() == pytest.approx(0.0, abs=1e-7)


def test_augmix_is_reproducible_bounded_and_changes_the_image():
    img = torch.rand(3, 24, 24, generator=torch.Generator().manual_seed(5))
    a, b = augmix(img, np.random.default_rng(9)), augmix(img, np.random.default_rng(9))
    assert torch.equal(a, b) and a.shape == img.shape
    assert a.min() >= 0.0 and a.max() <= 1.0 and not torch.allclose(a, img)
