"""FedStain as its authors' public code runs it (onism-dev/Fedstain, commit cc6056e), pure math.

What differs from Algorithm 1 (``fedmath.fedstain``): the statistics are skewness and excess
kurtosis of the *input pixels*, the only thing uploaded; "MixStyle" adds a small per-channel
shift of 0.1 x (change in skewness + change in kurtosis) to the pixels (in units of the
channel's deviation) instead of replacing mean and deviation; no RandStain. Facts from
FedStain's public code (onism-dev/Fedstain, commit cc6056e); the formulas below paraphrase the code's
``compute_statistic`` and ``MixStyle.forward`` in our words.

The server side (pool without the client's own rows, FedAvg) is shared with the literal variant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

CLAMP = 10.0


@dataclass(frozen=True)
class PixelMoments:
    """One client's upload in the code variant: rows = sampled images, columns = RGB channels."""

    skew: torch.Tensor   # (n, 3) pixel skewness (the code's wire key "mean")
    kurt: torch.Tensor   # (n, 3) pixel excess kurtosis (the code's wire key "std")

    def n_values(self) -> int:
        return self.skew.numel() + self.kurt.numel()


def code_upload_count(n_samples: int, ratio: float) -> int:
    """``int(len(train set) * r)``: the code truncates where Algorithm 2 takes the ceiling.

    [ours] at least one row for a client with images, so that no client's pool can come out
    empty on a small cohort (the code would fail there)."""
    return 0 if n_samples == 0 else max(1, math.floor(ratio * n_samples))


def pixel_moments(x: torch.Tensor, eps: float = 1e-6, clamp: float = CLAMP) -> tuple[torch.Tensor, ...]:
    """Per image and channel over H x W, as the code computes them: mean, deviation, skewness, kurtosis.

    x: (B, C, H, W) normalised pixels. With mu the mean and var the *unbiased* variance (torch.var):
    sigma = max(sqrt(var + eps), eps); skewness = E[(x - mu)^3] / (sigma^3 + eps);
    kurtosis = E[(x - mu)^4] / (sigma^4 + eps) - 3 (excess); both clamped to [-clamp, clamp].
    Returns (mu, sigma, skew, kurt), each (B, C).
    """
    flat = x.float().flatten(2)
    mu = flat.mean(2)
    sigma = (flat.var(2) + eps).sqrt().clamp_min(eps)
    centred = flat - mu[..., None]
    skew = (centred**3).mean(2) / (sigma**3 + eps)
    kurt = (centred**4).mean(2) / (sigma**4 + eps) - 3
    return mu, sigma, skew.clamp(-clamp, clamp), kurt.clamp(-clamp, clamp)


def sample_pool_rows(n_pool: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """One pooled row per image: without replacement when the pool holds enough rows, else with
    (the code's ``randperm(num)[:B]`` / ``randint(0, num, (B,))``)."""
    if n_pool >= n:
        return rng.permutation(n_pool)[:n]
    return rng.integers(n_pool, size=n)


def pixel_style_shift(x: torch.Tensor, pool: PixelMoments, rng: np.random.Generator, alpha: float = 0.1,
                      scale: float = 0.1, eps: float = 1e-6, clamp: float = CLAMP) -> torch.Tensor:
    """The code's "MixStyle" on input pixels (probability 1), per image and channel:

    lam ~ Beta(alpha, alpha) per image; S_mix = lam S + (1 - lam) S', K_mix = lam K + (1 - lam) K'
    with (S, K) the image's own clamped moments and (S', K') a sampled pooled row (clamped);
    x_hat = clamp(((x - mu) / sigma + scale (S_mix - S) + scale (K_mix - K)) sigma + mu, -clamp, clamp).

    So each channel moves by scale * sigma * (1 - lam) * ((S' - S) + (K' - K)): a small additive
    shift; mean and deviation are not replaced. x: (B, 3, H, W) normalised pixels.
    """
    mu, sigma, skew, kurt = (t.to(x)[..., None, None] for t in pixel_moments(x, eps, clamp))
    rows = torch.from_numpy(sample_pool_rows(len(pool.skew), x.shape[0], rng))
    lam = torch.from_numpy(rng.beta(alpha, alpha, size=(x.shape[0], 1, 1, 1))).to(x)
    s_new = pool.skew[rows].clamp(-clamp, clamp).to(x)[..., None, None]
    k_new = pool.kurt[rows].clamp(-clamp, clamp).to(x)[..., None, None]
    s_mix = skew * lam + s_new * (1 - lam)
    k_mix = kurt * lam + k_new * (1 - lam)
    normed = (x - mu) / sigma
    shifted = normed + scale * (s_mix - skew) + scale * (k_mix - kurt)
    return (shifted * sigma + mu).clamp(-clamp, clamp)


def quantise_unit(x: torch.Tensor) -> torch.Tensor:
    """RGB on [0, 1] through the code's ``(x * 255).to(uint8) / 255`` (truncation) before AugMix;
    [ours] values are clamped to [0, 1] first, where the code's cast of out-of-range values wraps."""
    return torch.floor(x.clamp(0, 1) * 255) / 255


def torchvision_augmix(unit: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """torchvision's ``AugMix()`` as the authors' code calls it (its defaults: severity 3, width 3,
    depth 1-3, all operations including the colour and intensity ones) on each image of a batch of
    RGB on [0, 1], as uint8; each image's torch draws come from a seed drawn from ``rng``, so a view
    is reproducible like every other view here. Needs torchvision (the zoo lane)."""
    try:
        from torchvision.transforms import AugMix
    except ImportError as err:  # never silently the morphology AugMix
        raise RuntimeError("train.fedstain_code.augmix_ops: torchvision needs torchvision importable beside a "
                           "matching torch (the README's zoo lane); without it use augmix_ops: morphology") from err
    op = AugMix()
    out = []
    for img in unit:
        seed = int(rng.integers(2**62))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            mixed = op(torch.round(img.clamp(0, 1) * 255).to(torch.uint8))
        out.append(mixed.to(unit.dtype) / 255)
    return torch.stack(out)
