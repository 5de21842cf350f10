"""Factor averaging, the baseline every federated-LoRA paper starts from (FedIT, Zhang et al. 2024;
the inexactness is the starting point of FFA-LoRA, FedEx-LoRA and FedSA-LoRA):

    A' = sum_k a_k A_k,   B' = sum_k a_k B_k.

Inexact: s B' A' = s (sum_k a_k B_k)(sum_j a_j A_j) differs from the clients' mean update
sum_k a_k s B_k A_k by the cross terms sum_{k != j} a_k a_j B_k A_j - sum_k a_k (1 - a_k) B_k A_k.
It exchanges exactly the trainable state (Table 8 as FedAvg-PEFT). Equal ranks only: averaging
zero-padded factors of different ranks (HetLoRA's way) mixes a rank-4 site's directions into a
rank-16 site's, which is a different method; it is refused by name.
"""

from __future__ import annotations

from fedhisto.fedmath.lora_aggregators import Aggregator, Pair, weighted_mean


class FactorMean(Aggregator):
    name = "factor_mean"
    secure_form = "A_k and B_k"

    def pair(self, factors, weights, scaling, rank):
        return Pair(weighted_mean([a for a, _ in factors], weights), weighted_mean([b for _, b in factors], weights))

    def secure_pair_terms(self, a, b, scaling, a_key, b_key):
        return {a_key: a, b_key: b}

    def pair_from_means(self, mean, a_key, b_key, scaling, rank, start):
        return Pair(mean(a_key), mean(b_key))
