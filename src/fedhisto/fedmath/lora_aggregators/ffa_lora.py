"""FFA-LoRA (Sun et al., "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024): A is
frozen at its shared random initialisation A_0 and only B is trained and averaged,

    A' = A_0,   B' = sum_k a_k B_k,   so  s B' A_0 = sum_k a_k s B_k A_0   (exact by construction).

A never travels (every site builds A_0 from the run's seed, as the model's initialisation), so the
LoRA traffic is B's alone, half of it at out = in. Designed for DP-SGD: the noise is added to B's
gradient only, and the aggregate is the mean of what the sites computed (no cross terms amplify the
noise). The sites keep A out of what they train (``Objective.trained``: under DP-SGD A is never
differentiated, clipped or noised); the server checks every returned A is bitwise the A_0 it
broadcast (``check_frozen``). Equal ranks only (A_0 is shared); refused by name for a rank per site.
"""

from __future__ import annotations

from fedhisto.fedmath.lora_aggregators import Aggregator, Pair, weighted_mean


class FFALoRA(Aggregator):
    name = "ffa_lora"
    exact = True
    frozen_factor = "lora_A"

    def pair(self, factors, weights, scaling, rank):
        # every returned A is the broadcast A_0, checked against the round's start (``check_frozen``)
        return Pair(factors[0][0].clone(), weighted_mean([b for _, b in factors], weights))

    # Under secure aggregation A never leaves a site (it is A_0, the server's too), so the server cannot
    # check that a site kept it frozen, as ``check_frozen`` does in the clear.
    secure_form = "B_k (A stays A_0, never uploaded)"

    def secure_pair_terms(self, a, b, scaling, a_key, b_key):
        return {b_key: b}

    def pair_from_means(self, mean, a_key, b_key, scaling, rank, start):
        return Pair(start[a_key].clone(), mean(b_key))
