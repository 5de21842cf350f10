"""The pieces of one DP-SGD step (Abadi et al. 2016) that an engine calls, in the privacy unit.

For a logical batch ``B`` drawn by Poisson sampling (each unit independently with probability q):

    g_u       = grad_theta l_u(theta)                         per-unit gradient (``per_sample``)
    g~_u      = g_u * min(1, C / ||g_u||_2)                   clipped to norm C over ALL declared tensors
    g^        = (sum_{u in B} g~_u + N(0, sigma^2 C^2 I)) / (q N)

over exactly the tensors the method declares it trains (``per_sample.Trained``), with the noise
projected onto a declared mask (a structurally zero block of a rank-r_k site stays exactly 0;
projecting a Gaussian onto a fixed subspace is post-processing, and the clipped per-unit gradients
are 0 there already, so the sensitivity C and the accounting are unchanged).

``q N`` is the EXPECTED logical batch size, a public constant, so the division is post-processing
and the step is exactly the sampled Gaussian mechanism ``privacy.rdp`` accounts for (dividing by
the realised |B| would leak |B|). A logical batch is assembled from micro-batches of whole units
(:func:`pack_micro_batches`), each clipped as it arrives and summed in :class:`NoisyGradientSum`;
an empty logical batch still releases noise and still counts as a step.

The privacy unit (``privacy.unit``): ``image``, one image with every one of its views (its views are
never separate samples), or ``family``, one clearance family (all images that clearance linked
as copies or near-copies of one another): sampling, clipping and accounting act on units.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrivacyUnits:
    """Which unit each image of a site belongs to (``unit_of[i]`` in 0..n_units-1, first-seen order)."""

    unit_of: np.ndarray          # (n_images,) int
    names: list[str]             # per unit: the image id (unit image) or the family id

    @property
    def n_units(self) -> int:
        return len(self.names)

    def images_of(self, unit: int) -> np.ndarray:
        return np.flatnonzero(self.unit_of == unit)

    def sizes(self) -> np.ndarray:
        return np.bincount(self.unit_of, minlength=self.n_units)


def privacy_units(image_ids: Sequence[str], unit: str, family_of: Mapping[str, str] | None = None) -> PrivacyUnits:
    """Units of a site's optimisation images. ``family`` needs every image's clearance family
    (the manifest's ``family`` column); an image without one is refused, never made its own unit."""
    if unit == "image":
        return PrivacyUnits(np.arange(len(image_ids)), list(image_ids))
    if unit != "family":
        raise ValueError(f"privacy.unit must be 'image' or 'family', got {unit!r}")
    if family_of is None:
        raise ValueError("privacy.unit 'family' needs each image's clearance family (manifest column 'family')")
    missing = [i for i in image_ids if not family_of.get(i)]
    if missing:
        raise ValueError(f"privacy.unit 'family': {len(missing)} images have no family, e.g. {missing[:3]}")
    index: dict[str, int] = {}
    unit_of = np.array([index.setdefault(family_of[i], len(index)) for i in image_ids], dtype=np.int64)
    return PrivacyUnits(unit_of, list(index))


def poisson_sample(n_units: int, sample_rate: float, rng: np.random.Generator) -> np.ndarray:
    """One logical batch: every unit independently with probability q (sorted unit indices, maybe empty)."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"privacy.sample_rate must lie in (0, 1], got {sample_rate}")
    return np.flatnonzero(rng.random(n_units) < sample_rate)


def steps_per_epoch(sample_rate: float) -> int:
    """Logical steps that make one expected pass over the units: round(1 / q), at least 1."""
    return max(1, round(1 / sample_rate))


def pack_micro_batches(units: Sequence[int], sizes: Sequence[int], max_images: int) -> list[list[int]]:
    """Group the sampled units, in order, into micro-batches of whole units with at most ``max_images``
    images; a unit larger than that forms its own micro-batch (its per-image gradients are then
    computed in chunks, ``per_sample.per_unit_gradients(chunk_size=...)``, and summed before clipping)."""
    if max_images < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {max_images}")
    out: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for u in units:
        size = int(sizes[u])
        if current and filled + size > max_images:
            out.append(current)
            current, filled = [], 0
        current.append(int(u))
        filled += size
    if current:
        out.append(current)
    return out


def flat_norms(per_unit: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """||g_u||_2 over every tensor of the trainable state, one per unit (dim 0 indexes units)."""
    squares = [g.reshape(g.shape[0], -1).double().pow(2).sum(1) for g in per_unit.values()]
    return torch.stack(squares).sum(0).sqrt()


def clip_and_sum(per_unit: Mapping[str, torch.Tensor], clip_norm: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """sum_u g_u min(1, C / ||g_u||): the clipped sum over the units of a micro-batch, and the norms."""
    if clip_norm <= 0:
        raise ValueError(f"privacy.clip_norm must be > 0, got {clip_norm}")
    norms = flat_norms(per_unit)
    scale = (clip_norm / norms.clamp_min(1e-12)).clamp(max=1.0)
    out = {}
    for name, g in per_unit.items():
        s = scale.to(g.dtype).reshape(-1, *([1] * (g.dim() - 1)))
        out[name] = (g * s).sum(0)
    return out, norms


def noise_generator(device: torch.device | str, seed: int | None = None) -> tuple[torch.Generator, int]:
    """The Gaussian noise's generator and its seed. ``seed=None`` draws a secret seed from the OS: the
    guarantee needs noise the coordinator cannot regenerate, so a seed derived from the run seed is
    for reproducible research runs only. Keep the seed (or ``generator.get_state()``) in the site's own
    checkpoint to resume exactly."""
    seed = secrets.randbits(63) if seed is None else int(seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen, seed


class NoisyGradientSum:
    """Accumulates the clipped per-unit gradients of one logical batch and releases the noisy mean."""

    def __init__(self, clip_norm: float, noise_multiplier: float, expected_units: float) -> None:
        if clip_norm <= 0 or noise_multiplier < 0 or expected_units <= 0:
            raise ValueError(f"need clip_norm > 0, noise_multiplier >= 0, expected_units > 0 "
                             f"(got {clip_norm}, {noise_multiplier}, {expected_units})")
        self.clip_norm, self.noise_multiplier, self.expected_units = clip_norm, noise_multiplier, expected_units
        self.total: dict[str, torch.Tensor] = {}
        self.units = 0
        self.clipped = 0

    def add(self, per_unit: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Clip a micro-batch's per-unit gradients and add them; returns their pre-clipping norms."""
        summed, norms = clip_and_sum(per_unit, self.clip_norm)
        for name, g in summed.items():
            self.total[name] = self.total[name] + g if name in self.total else g
        self.units += int(norms.numel())
        self.clipped += int((norms > self.clip_norm).sum())
        return norms

    def release(self, like: Mapping[str, torch.Tensor], generator: torch.Generator,
                masks: Mapping[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
        """(sum + N(0, sigma^2 C^2)) / (q N) for every tensor of ``like`` (the declared parameters; zeros
        where no unit was sampled), the noise projected onto ``masks[name]`` where one is declared; then
        resets for the next logical batch."""
        std = self.noise_multiplier * self.clip_norm
        out = {}
        for name, p in like.items():
            base = self.total.get(name, torch.zeros_like(p))
            noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) * std
            mask = masks.get(name) if masks is not None else None
            if mask is not None:  # drawn for the whole tensor first, so the stream of the others is unchanged
                noise = noise * mask.to(p.device, p.dtype)
            out[name] = (base.to(p.dtype) + noise) / self.expected_units
        self.total, self.units, self.clipped = {}, 0, 0
        return out
