"""FlexLoRA (Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and
Client Resources", NeurIPS 2024): the server forms the full weighted update and redistributes its
truncated SVD, each client at its own rank r_k:

    W_g = sum_k p_k s B_k A_k                 (p_k: sample mass; B_k A_k at the client's rank r_k)
    W_g = U S V^T                             (SVD of the dense out x in matrix)
    client k receives  B_k = U[:, :r_k] sqrt(S[:r_k] / s),  A_k = sqrt(S[:r_k] / s) V^T[:r_k]

so that s B_k A_k is the best rank-r_k approximation of W_g (Eckart-Young). Splitting S between the
factors is a gauge choice the product does not see; the symmetric split here is delta-SVD's.

Here every site's factors live in the model's rank r = max_k r_k, a rank-r_k site's beyond r_k
being zero: with B's and A's extra columns/rows zero their gradients are zero and AdamW leaves them
zero, so the site trains exactly a rank-r_k LoRA (with the model's scaling s = alpha / r). The
aggregate returned here is the rank-r truncation (the server's global model); each site's start is
its rank-r_k truncation of it (``truncate``).

At equal ranks FlexLoRA computes the same matrix as delta-SVD, by a dense SVD instead of QR of the
stacked factors and an SVD of the small core: the products s B A agree to float64 rounding, and the
factors agree up to the sign of each singular direction (and any rotation within a repeated
singular value), which the tests state. Traffic: a rank-r_k site sends and receives its rank-r_k
factors, (in + out) r_k floats per module.
"""

from __future__ import annotations

import torch

from fedhisto.fedmath.lora_aggregators import Aggregator, Pair


def truncate(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with the directions beyond ``rank`` zeroed (the model keeps its full shape)."""
    a, b = a.clone(), b.clone()
    a[rank:] = 0
    b[:, rank:] = 0
    return a, b


class FlexLoRA(Aggregator):
    name = "flexlora"
    heterogeneous_ranks = True

    def pair(self, factors, weights, scaling, rank):
        dtype = factors[0][0].dtype
        dense = sum(w * scaling * (b.double() @ a.double()) for (a, b), w in zip(factors, weights, strict=True))
        u, s, vh = torch.linalg.svd(dense, full_matrices=False)
        keep = min(rank, s.numel())
        root = torch.sqrt(s[:keep] / scaling)
        b_new, a_new = u[:, :keep] * root, root[:, None] * vh[:keep]
        if keep < rank:  # a module narrower than the rank: zero directions, as delta-SVD pads
            b_new = torch.cat([b_new, b_new.new_zeros(b_new.shape[0], rank - keep)], dim=1)
            a_new = torch.cat([a_new, a_new.new_zeros(rank - keep, a_new.shape[1])], dim=0)
        return Pair(a_new.to(dtype), b_new.to(dtype))
