"""FedEx-LoRA (Singhal et al., "FedEx-LoRA: Exact Aggregation for Federated and Efficient Fine-Tuning
of Foundation Models", ACL 2025): average the factors and fold the residual into the frozen weight,

    A' = sum_k a_k A_k,   B' = sum_k a_k B_k,
    R  = s (sum_k a_k B_k A_k) - s B' A'          (dense, out x in),
    W0' = W0 + R,

so that W0' + s B' A' = sum_k a_k (W0 + s B_k A_k) exactly: the aggregate of the clients' models.
The frozen weight then changes every round; the member state carries the cumulative offset
W0' - W0_pretrained as a dense tensor per module (``fold``), which travels down to every site each
round: out x in floats per module beside the factors (Table 8 counts it; nothing dense goes up).
Equal ranks only (the paper's setting); refused by name for a rank per site.
"""

from __future__ import annotations

from fedhisto.fedmath.lora_aggregators import Aggregator, Pair, State, lora_pairs, weighted_mean


class FedExLoRA(Aggregator):
    name = "fedex_lora"
    exact = True

    def pair(self, factors, weights, scaling, rank):
        a = weighted_mean([a.double() for a, _ in factors], weights)
        b = weighted_mean([b.double() for _, b in factors], weights)
        full = sum(w * scaling * (bk.double() @ ak.double()) for (ak, bk), w in zip(factors, weights, strict=True))
        dtype = factors[0][0].dtype
        a, b = a.to(dtype), b.to(dtype)  # the residual is taken against the factors as sent, so rounding is folded too
        return Pair(a, b, full - scaling * (b.double() @ a.double()))

    secure_form = "A_k, B_k and s B_k A_k (dense)"

    def secure_pair_terms(self, a, b, scaling, a_key, b_key):
        from fedhisto.fedmath.secure_sums import Product

        return {a_key: a, b_key: b, f"{a_key}#product": Product(b, a, scaling)}

    def pair_from_means(self, mean, a_key, b_key, scaling, rank, start):
        dtype = start[a_key].dtype
        a, b = mean(a_key).to(dtype), mean(b_key).to(dtype)  # the residual against the factors as sent, as pair()
        return Pair(a, b, mean(f"{a_key}#product") - scaling * (b.double() @ a.double()))

    def extra_down_bytes(self, state: State) -> int:
        """The dense offset of every module's frozen weight, out x in each: the real ``folded_base.*``
        tensors of a member state that carries them (``fold``), else (a state before the first fold, as
        Table 8 builds it) their size from the factors' shapes in the factors' dtype (the encoder's)."""
        from fedhisto.fedmath.lora_aggregators.fold import is_folded

        folded = [t for k, t in state.items() if is_folded(k)]
        if folded:
            return sum(t.numel() * t.element_size() for t in folded)
        return sum(state[bk].shape[0] * state[ak].shape[1] * state[ak].element_size()
                   for ak, bk in lora_pairs(list(state)))
