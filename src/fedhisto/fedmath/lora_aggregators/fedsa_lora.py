"""FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning",
ICLR 2025): A learns what the sites share and is aggregated, B learns what is site-specific and stays
at its site,

    A' = sum_k a_k A_k   (sent to every site),   B_k' = B_k   (never leaves site k),

so each site's model is W0 + s B_k A', a personalised model per site. Here every other trainable
tensor (residual adapter, FiLM, classifier) is shared and averaged with the same a_k, as FedSA-LoRA
averages every non-B parameter. ``pair`` returns the shared A (and the weighted mean of the B's,
which no site receives; ``methods.lora_aggregation`` keeps each site's own B). The run keeps one
model per site; the global test and the external cohort are scored by every site's model and
reported as the mean over the site models (the rule ``local_only`` follows). Traffic: the state
without B, both ways. Equal ranks only (B_k must fit the shared A'); refused by name otherwise.
"""

from __future__ import annotations

from fedhisto.fedmath.lora_aggregators import Aggregator, Pair, weighted_mean


class FedSALoRA(Aggregator):
    name = "fedsa_lora"
    local_factor = "lora_B"
    secure_form = None  # one model per site: the engines that run it keep each site's B apart (not on sums)

    def pair(self, factors, weights, scaling, rank):
        return Pair(weighted_mean([a for a, _ in factors], weights), weighted_mean([b for _, b in factors], weights))
