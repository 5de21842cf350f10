"""The study's delta-SVD (equation 5) as a registered aggregator; the math is ``fedmath.delta_svd``:

    dW = sum_k a_k s B_k A_k,  (A', B') = rank-r truncated SVD of dW, split as
    B' = U_r sqrt(S_r / s), A' = sqrt(S_r / s) V_r^T   (so s B' A' = U_r S_r V_r^T),

computed without forming dW (QR of the stacked factors, SVD of the small core). Exact whenever the
rank of dW is at most r (never guaranteed with K > 1 clients); the best rank-r approximation otherwise.
"""

from __future__ import annotations

from fedhisto.fedmath.delta_svd import delta_svd
from fedhisto.fedmath.lora_aggregators import Aggregator, Pair


class DeltaSVD(Aggregator):
    name = "delta_svd"

    def pair(self, factors, weights, scaling, rank):
        a, b = delta_svd(factors, weights, scaling, rank)
        return Pair(a, b)
