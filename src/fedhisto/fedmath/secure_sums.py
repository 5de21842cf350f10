"""The arithmetic of secure aggregation: what a site adds to a masked sum, and what the sum is worth.

Flower's SecAgg+ (Bell et al. 2020) sums integer vectors: each site clips its values to
``[-c, c]``, maps them to ``levels`` integer steps with unbiased stochastic rounding, adds pairwise
masks that cancel in the sum and a private mask the server removes after the round, all modulo
2^32; the server learns only the sum of the quantised vectors. This module is that arithmetic
without the masks (they cancel exactly in integer arithmetic, so the unmasked sum is the same
number): the in-process engine uses it to compute what the coordinator would get, and the tests
check it against Flower's own quantiser.

A site's contribution is a dict of named **terms**: a tensor, or a :class:`Product`, the dense
``s (B A - B0 A0)`` of a LoRA pair computed where the factors are (so the site keeps the factors
and expands the product only when it masks it: the server step of delta-SVD, FlexLoRA, FedEx-LoRA
and FedAdam needs the sum of products, not of factors).

Precision: each value's rounding error is below one step ``2c / levels``; a sum over K sites is off
by less than ``K 2c / levels``, and a weighted mean ``sum_k a_k t_k / sum_k a_k`` (the server
divides by the survivors' public weights) by less than ``K 2c / (levels sum_k a_k)``
(:func:`mean_bound`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

#: Flower's field: masks and sums live modulo 2^32 (``SecAggPlusWorkflow(modulus_range=...)`` must be < 2^32 + 1).
MODULUS = 2 ** 32


@dataclass(frozen=True)
class Product:
    """``scale (b @ a - b0 @ a0)`` (``b0``/``a0`` optional), expanded in float64 only when masked."""

    b: torch.Tensor
    a: torch.Tensor
    scale: float
    b0: torch.Tensor | None = None
    a0: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.b.shape[0]), int(self.a.shape[1]))

    def dense(self) -> torch.Tensor:
        out = self.b.double() @ self.a.double()
        if self.b0 is not None:
            out = out - self.b0.double() @ self.a0.double()
        return self.scale * out


Term = torch.Tensor | Product
Terms = dict[str, Term]


def dense(term: Term) -> torch.Tensor:
    """A term's values in float64 on the host."""
    return term.dense().cpu() if isinstance(term, Product) else term.detach().double().cpu()


def layout(terms: Mapping[str, Term]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every term in sorted name order: the order the masked vector follows, which
    every site and the server must agree on (Flower sums the arrays by position)."""
    return [(k, tuple(terms[k].shape)) for k in sorted(terms)]


def values(terms: Mapping[str, Term]) -> int:
    """How many numbers a masked vector of ``terms`` carries."""
    return sum(int(np.prod(shape)) for _, shape in layout(terms))


def lora_products(state: Mapping[str, torch.Tensor], scaling: float, pairs: list[tuple[str, str]],
                  start: Mapping[str, torch.Tensor] | None = None) -> Terms:
    """Each pair's ``s B A`` (``s (B A - B0 A0)`` with a ``start``) under the pair's A key."""
    out: Terms = {}
    for a_key, b_key in pairs:
        out[a_key] = Product(state[b_key], state[a_key], scaling,
                             start[b_key] if start is not None else None, start[a_key] if start is not None else None)
    return out


class OutOfRange(ValueError):
    """A weighted term leaves the clipping range: SecAgg+ would clip it silently, so the site refuses."""


@dataclass(frozen=True)
class Quantiser:
    """SecAgg+'s quantisation (``flwr.common.secure_aggregation.quantization``): clip to [-c, c],
    shift to [0, 2c], scale to ``levels`` steps, round up or down at random with the probability
    that makes the rounding unbiased."""

    clip: float = 8.0
    levels: int = 2 ** 28

    def check(self, sites: int) -> None:
        """K quantised vectors each below ``levels`` (plus Flower's weight factor) must not wrap the field."""
        if sites * self.levels >= MODULUS:
            raise ValueError(f"secure_aggregation.quantization_levels {self.levels}: {sites} sites x levels reach "
                             f"the field size 2^32 and the sum would wrap; lower it below {MODULUS // sites}")

    @property
    def step(self) -> float:
        return 2 * self.clip / self.levels

    def quantise(self, x: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        """Integers in [0, levels] of ``x`` (float64); ``uniform``: one draw in [0, 1) per value (Flower
        draws them from NumPy's global generator; the in-process engine from the run's stream)."""
        pre = (np.clip(x, -self.clip, self.clip) + self.clip) * (self.levels / (2 * self.clip))
        up = np.ceil(pre).astype(np.int64)
        return up - (uniform < up - pre)

    def sum_value(self, total: np.ndarray, sites: int) -> np.ndarray:
        """The float sum of ``sites`` quantised vectors from the sum of their integers (every site's
        shift by ``c`` removed)."""
        return np.asarray(np.asarray(total).astype(np.float64) * self.step - sites * self.clip)

    def sum_bound(self, sites: int) -> float:
        return sites * self.step


def mean_bound(quantiser: Quantiser, sites: int, total_weight: float) -> float:
    """Largest error of a weighted mean ``sum_k a_k t_k / sum_k a_k`` over ``sites`` survivors from
    quantised sums (per value; the weights themselves are public and exact)."""
    return quantiser.sum_bound(sites) / total_weight


def weighted_arrays(terms: Mapping[str, Term], weight: float, quantiser: Quantiser, where: str) -> list[np.ndarray]:
    """``weight * term`` of every term in layout order as float64 arrays, refused by name when a value
    leaves the clipping range (SecAgg+ would clip it and the sum would be wrong without a word)."""
    out = []
    for name, _ in layout(terms):
        arr = (weight * dense(terms[name])).numpy()
        worst = float(np.abs(arr).max()) if arr.size else 0.0
        if not np.isfinite(arr).all() or worst > quantiser.clip:
            raise OutOfRange(f"{where}: term {name} weighted by {weight:.6g} reaches {worst:.6g}, outside the "
                             f"clipping range +/-{quantiser.clip:g} (secure_aggregation.clipping_range)")
        out.append(arr)
    return out


def field_sum(contributions: list[list[np.ndarray]], quantiser: Quantiser, uniforms: list[list[np.ndarray]]
              ) -> list[np.ndarray]:
    """The float sum SecAgg+ reveals of sites' weighted arrays, computed without masks (they cancel in
    the field): quantise each, add the integers modulo 2^32, map back."""
    k = len(contributions)
    quantiser.check(k)
    out = []
    for j in range(len(contributions[0])):
        total = np.zeros(contributions[0][j].shape, dtype=np.int64)
        for arrays, draws in zip(contributions, uniforms, strict=True):
            total = (total + quantiser.quantise(arrays[j], draws[j])) % MODULUS
        out.append(quantiser.sum_value(total, k))
    return out


def refactorise(dense_update: torch.Tensor, scaling: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors ``(A, B)`` whose ``s B A`` is the truncated SVD of ``dense_update``, split
    symmetrically as delta-SVD splits them (``B = U sqrt(S / s)``, ``A = sqrt(S / s) V^T``); zero
    directions pad a module narrower than the rank. The product equals delta-SVD's of the same sum
    (Eckart-Young); the factors agree up to the sign of each singular direction."""
    u, s, vh = torch.linalg.svd(dense_update.double(), full_matrices=False)
    keep = min(rank, s.numel())
    root = torch.sqrt(s[:keep].clamp_min(0) / scaling)
    b, a = u[:, :keep] * root, root[:, None] * vh[:keep]
    if keep < rank:
        b = torch.cat([b, b.new_zeros(b.shape[0], rank - keep)], dim=1)
        a = torch.cat([a, a.new_zeros(rank - keep, a.shape[1])], dim=0)
    return a, b

