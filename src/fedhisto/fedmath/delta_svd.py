"""delta-SVD aggregation of LoRA factors (study equation 1).

Each client k induces a full low-rank update dW_k = (alpha / r) B_k A_k; the server forms
dW = sum_k a_k dW_k and refactorises it to rank r. dW never needs to be materialised:
with B_cat = [a_1 s B_1, ..., a_K s B_K] (out x Kr) and A_cat = [A_1; ...; A_K] (Kr x in),
dW = B_cat A_cat. QR of B_cat and of A_cat^T gives dW = Q_B (R_B R_A^T) Q_A^T; the SVD of the
small Kr x Kr core, truncated to r, is the best rank-r approximation of dW (Eckart-Young).
The factors are split symmetrically: B = Q_B U_r sqrt(S_r / s), A = sqrt(S_r / s) V_r^T Q_A^T,
so that s B A equals that approximation. Shapes follow peft: A is r x in, B is out x r.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def delta_svd(factors: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float], scaling: float,
              rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Aggregate ``[(A_k, B_k)]`` with weights ``a_k``; return rank-``rank`` factors ``(A, B)``."""
    if not factors:
        raise ValueError("delta_svd needs at least one client's factors")
    a0, b0 = factors[0]
    out_dim, in_dim = b0.shape[0], a0.shape[1]
    for a, b in factors:
        if a.shape != (rank, in_dim) or b.shape != (out_dim, rank):
            raise ValueError(f"LoRA factor shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not match "
                             f"A ({rank}, {in_dim}), B ({out_dim}, {rank})")
    dtype = a0.dtype
    b_cat = torch.cat([w * scaling * b.double() for (_, b), w in zip(factors, weights, strict=True)], dim=1)
    a_cat = torch.cat([a.double() for a, _ in factors], dim=0)
    q_b, r_b = torch.linalg.qr(b_cat)              # out x m, m x Kr
    q_a, r_a = torch.linalg.qr(a_cat.T)            # in x m', m' x Kr
    u, s, vh = torch.linalg.svd(r_b @ r_a.T)       # core m x m'
    keep = min(rank, s.numel())
    root = torch.sqrt(s[:keep] / scaling)
    b_new = (q_b @ u[:, :keep]) * root
    a_new = root[:, None] * (vh[:keep] @ q_a.T)
    if keep < rank:  # fewer directions than the rank: pad with zeros, the update is exact anyway
        b_new = torch.cat([b_new, b_new.new_zeros(out_dim, rank - keep)], dim=1)
        a_new = torch.cat([a_new, a_new.new_zeros(rank - keep, in_dim)], dim=0)
    return a_new.to(dtype), b_new.to(dtype)


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The induced full update s B A (out x in)."""
    return scaling * (b @ a)
