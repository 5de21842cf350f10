"""FedStain comparator math (Yu et al.'s paper and public code): moments, pools, RandStain, MixStyle, SupCon, JS, AugMix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st
import torch

from fedhisto.fedmath.fedstain_ops import (
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
from fedhisto.fedmath.losses import js_divergence


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


# ------------------------------------------------ fedstain_code: the authors' code, pixel-level
from fedhisto.config.study import load_config  # noqa: E402
from fedhisto.fedmath.fedstain_code_ops import (  # noqa: E402
    PixelMoments,
    code_upload_count,
    pixel_moments,
    pixel_style_shift,
    sample_pool_rows,
)
from fedhisto.methods import build_method  # noqa: E402
from fedhisto.methods.fedstain_code import client_pixel_moments, fedstain_code_terms  # noqa: E402

# One 2 x 2 image, three channels whose moments are easy by hand (unbiased variance, as torch.var):
#   [0 0; 0 1]: mean 1/4, centred (-1/4, -1/4, -1/4, 3/4); var = (3/16 + 9/16) / 3 = 1/4, sigma = 1/2;
#               E[c^3] = (-3/64 + 27/64) / 4 = 3/32 -> skew = (3/32) / (1/8) = 3/4;
#               E[c^4] = (3/256 + 81/256) / 4 = 21/256 -> kurt = (21/256) / (1/16) - 3 = -27/16
#   [1 1; 1 0]: the mirror image: skew -3/4, kurt -27/16, sigma 1/2
#   [0 1; 0 1]: mean 1/2, centred +-1/2; var = 1/3; skew 0; E[c^4] = 1/16 -> kurt = (1/16) * 9 - 3 = -39/16
HAND = torch.tensor([[[[0.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]]])
HAND_SIGMA = [0.5, 0.5, math.sqrt(1 / 3)]
HAND_SKEW = [0.75, -0.75, 0.0]
HAND_KURT = [-27 / 16, -27 / 16, -39 / 16]


def test_pixel_moments_by_hand():
    mu, sigma, skew, kurt = pixel_moments(HAND)
    np.testing.assert_allclose(mu[0], [0.25, 0.75, 0.5], atol=1e-7)
    np.testing.assert_allclose(sigma[0], HAND_SIGMA, rtol=1e-5)
    # eps 1e-6 in sigma and in the denominators moves these by < 2e-5
    np.testing.assert_allclose(skew[0], HAND_SKEW, atol=1e-4)
    np.testing.assert_allclose(kurt[0], HAND_KURT, atol=1e-4)
    # scale and offset of a channel do not change skewness or kurtosis (normalised vs raw pixels)
    _, _, skew2, kurt2 = pixel_moments(HAND * 3.7 - 1.2)
    np.testing.assert_allclose(skew2, skew, atol=1e-4)
    np.testing.assert_allclose(kurt2, kurt, atol=1e-4)


def test_pixel_moments_are_clamped_to_ten():
    # one bright pixel among 144: skewness 142 / sqrt(143) * (143/144)^1.5 = 11.75, kurtosis ~ 137: both beyond 10
    spike = torch.zeros(1, 1, 12, 12)
    spike[0, 0, 5, 7] = 1.0
    _, _, skew, kurt = pixel_moments(torch.cat([spike, 1 - spike], dim=1))
    assert skew[0].tolist() == [10.0, -10.0] and kurt[0].tolist() == [10.0, 10.0]
    _, _, skew5, _ = pixel_moments(spike, clamp=5.0)
    assert skew5.item() == 5.0


def test_pixel_style_shift_is_the_codes_small_additive_shift():
    """Each channel moves by 0.1 x sigma x (1 - lam) x ((S' - S) + (K' - K)), nothing else changes."""
    pool = PixelMoments(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.0, 0.0, 0.0]]))
    out = pixel_style_shift(HAND, pool, np.random.default_rng(5), alpha=0.1, scale=0.1)
    replay = np.random.default_rng(5)
    replay.permutation(1)  # the sampled pool row
    lam = float(replay.beta(0.1, 0.1))
    for c in range(3):
        shift = 0.1 * HAND_SIGMA[c] * (1 - lam) * ((pool.skew[0, c] - HAND_SKEW[c]) + (0.0 - HAND_KURT[c]))
        np.testing.assert_allclose(out[0, c], HAND[0, c] + shift, atol=1e-4)
    # the clamp: pixels far out stay within +-10 after the shift
    far = HAND * 30 - 15
    assert pixel_style_shift(far, pool, np.random.default_rng(5)).abs().max() <= 10.0


def test_pool_rows_are_drawn_without_replacement_when_the_pool_suffices():
    assert sorted(sample_pool_rows(4, 4, np.random.default_rng(1)).tolist()) == [0, 1, 2, 3]
    assert len(set(sample_pool_rows(50, 8, np.random.default_rng(1)).tolist())) == 8
    small = sample_pool_rows(2, 5, np.random.default_rng(1))
    assert len(small) == 5 and set(small.tolist()) <= {0, 1}


def test_code_upload_count_truncates_like_the_code():
    assert [code_upload_count(n, 0.1) for n in (0, 5, 10, 19, 20, 657)] == [0, 1, 1, 1, 2, 65]


def _uploads() -> dict[str, PixelMoments]:
    return {c: PixelMoments(torch.full((k, 3), float(k)), torch.full((k, 3), -float(k)))
            for k, c in enumerate(["C1", "C2", "C3"], start=1)}


def test_fedstain_code_pool_excludes_the_clients_own_statistics():
    method = build_method("fedstain_code", load_config({}))
    payloads = method.configure_train(0, None, _uploads())
    for k, client in enumerate(["C1", "C2", "C3"], start=1):
        pool = payloads[client]["style_pool"]
        assert isinstance(pool, PixelMoments)
        assert float(k) not in pool.skew[:, 0].tolist()
        assert len(pool.skew) == 6 - k
    assert payloads["C2"]["style_pool"].skew[:, 0].tolist() == [1.0, 3.0, 3.0, 3.0]


def test_fedstain_code_uploads_pixel_moments_of_floor_r_n_images():
    from fedhisto.data.splits import Split
    from fedhisto.data.views import eval_view

    cfg = load_config({"views": {"crop_size": 16}})
    gen = np.random.default_rng(0)
    data = Split([f"i{k}" for k in range(19)], [0] * 19, [gen.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                                                         for _ in range(19)])
    up = client_pixel_moments(data, cfg, np.random.default_rng(3))
    idx = sorted(np.random.default_rng(3).choice(19, size=1, replace=False).tolist())
    _, _, skew, kurt = pixel_moments(torch.stack([eval_view(data.images[i], cfg.views) for i in idx]))
    assert up.skew.shape == (1, 3) and torch.equal(up.skew, skew) and torch.equal(up.kurt, kurt)


class _Recorder(torch.nn.Module):
    """Stands in for the model: records the pixels of every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, pixels: torch.Tensor):
        self.seen.append(pixels.detach().clone())
        z = pixels.flatten(1)[:, :8]
        return z[:, :3], z


def test_fedstain_code_shifts_the_pixels_the_model_sees():
    """The generated views reach the model as shifted *pixels* (AugMix off: exactly the shift), so
    moving the shift into the network would leave them equal to the original and fail here."""
    cfg = load_config({"train": {"fedstain_code": {"augmix": False}}})
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 0, 2])
    pool = PixelMoments(torch.tensor([[3.0, -2.0, 1.0], [2.0, 2.0, 2.0]]), torch.tensor([[5.0, 0.0, -1.0]] * 2))
    model = _Recorder()
    terms = fedstain_code_terms(model, x, y, pool, torch.ones(3), cfg, np.random.default_rng(4), torch.device("cpu"))
    assert set(terms) == {"ce", "supcon", "js"}
    replay = np.random.default_rng(4)
    expected = [pixel_style_shift(x, pool, replay) for _ in range(2)]
    assert len(model.seen) == 3 and torch.equal(model.seen[0], x)
    for seen, exp in zip(model.seen[1:], expected, strict=True):
        assert torch.equal(seen, exp) and not torch.allclose(seen, x)


def test_supcon_with_the_anchor_among_its_positives_by_hand():
    # anchors 1, 2 (same class, identical): positives {self, other} both at similarity 1/tau, one negative at 0;
    # anchor 3 alone in its class: positive {self} at 1/tau, two negatives at 0. tau = 1:
    # anchors 1, 2: -1 + log(e + 1); anchor 3: -1 + log(1 + 1)
    z = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    expected = (2 * (-1 + math.log(math.e + 1)) + (-1 + math.log(2))) / 3
    assert supcon(z, torch.tensor([0, 0, 1]), tau=1.0, include_self=True).item() == pytest.approx(expected, abs=1e-6)
