"""FedAvg-PEFT's model and objective under an aggregator of the federated-LoRA literature
(``fedmath.lora_aggregators``): ``factor_mean``, ``flexlora``, ``fedex_lora``, ``ffa_lora`` and ``fedsa_lora``.

Why methods and not an aggregation option of every method: two of the aggregators change the
*client* as well as the server (FFA-LoRA trains B alone; FedSA-LoRA keeps B at the site, so a run has
one model per site), and FlexLoRA changes what each site starts from (its own rank). Those are the
hooks a method owns (the objective's ``trained``; the strategy's ``members``, ``start_state``,
``aggregate_train``), so each is a thin registration of this strategy with the aggregator's name,
beside ``fedavg_peft`` (the same model with the study's delta-SVD), and the aggregators themselves
stay pure functions any method can call.
The PAST family takes the ones that keep one global model as an option of its own
(``train.past.lora_aggregator``, ``methods.past``): v2 and FedAvg-PEFT under each aggregator.

Heterogeneous ranks (``train.lora_aggregation.site_ranks``, e.g. ``[[C1, 4], [C4, 2]]``; sites not
named train at ``model.lora_r``): the model keeps rank ``model.lora_r`` everywhere and a rank-r_k
site starts every round from the aggregate's leading r_k directions, the others zero; the server
tells it r_k (its payload's ``rank``) and the site declares the padded rows of A and columns of B
structurally zero (``trained``: masks). Zero factor rows/columns get zero gradients anyway, and the
declared masks keep them exactly zero where something else would reach them (DP-SGD's noise), so the
site trains exactly a rank-r_k LoRA (scaling alpha / ``model.lora_r``) and sends what Table 8 counts.
Only an aggregator that admits it (FlexLoRA) takes a rank per site; the others refuse it by name when
the method is built.

FedEx-LoRA (``fedex_lora``) folds the residual of the factor mean into the frozen weights: the global
member state carries the cumulative offsets as dense ``folded_base.*`` tensors
(``fedmath.lora_aggregators.fold``), which every engine sends down as part of the start state, the
model applies on load, the checkpoint keeps and the export package stores beside the adapters.

Personalisation (``fedsa_lora``): the run keeps one model per site (shared A, adapter and classifier;
the site's own B). Each site's model is scored on its own holdout (``own_holdout``); the global test
and the external cohort are scored by every site's model and reported as the mean over the site
models, as ``local_only``'s are. Early stopping uses the mean validation macro-F1 of the site models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import Field

from fedhisto.fedmath.lora_aggregators import (
    aggregate_states,
    aggregator,
    check_frozen,
    lora_pairs,
    secure_state_terms,
)
from fedhisto.fedmath.lora_aggregators.flexlora import truncate
from fedhisto.fedmath.lora_aggregators.fold import aggregate_means_with_fold, aggregate_with_fold
from fedhisto.infra.settings_base import Strict
from fedhisto.methods.base import GLOBAL, RoundUpdate
from fedhisto.methods.objective import Objective
from fedhisto.methods.secure_capability import SecureAggregation
from fedhisto.methods.strategy import Strategy
from fedhisto.model.peft_model import FedHistoModel


def base_dtype(model: FedHistoModel) -> torch.dtype:
    """The dtype of the frozen weights a folding aggregator offsets (the encoder's)."""
    return next((p.dtype for n, p in model.named_parameters() if n.endswith(".base_layer.weight")), torch.float32)


class LoraAggregationConfig(Strict):
    """[ours] Settings of the federated-LoRA aggregator methods (factor_mean, flexlora, fedex_lora, ffa_lora, fedsa_lora)."""

    site_ranks: list[tuple[str, int]] = Field(
        [], description="[ours] a LoRA rank per site, [[client, rank], ...] (each 1..model.lora_r; "
                                          "sites not named: model.lora_r); only flexlora admits it, the others refuse")


class LoraObjective(Objective):
    """fedavg_peft's objective over what the aggregator lets a site train (``trained``).

    Under DP-SGD the clients train fedavg_peft's objective per image (the base class's), and DP-SGD clips and
    noises only the tensors declared here: for FFA-LoRA that is B alone, its paper's design for DP; for a
    FlexLoRA site below the model's rank, its rank-r_k block (the padded block is masked); FedSA-LoRA's
    site-kept B is noised like the rest and never released. Aggregation, rank truncation and the
    redistributed factors are post-processing of noised states, and so is FedEx-LoRA's folded residual
    sum_k a_k s B_k A_k - s B' A': the server computes it from the released (noised) factors, never from
    anything a site did not release."""

    def __init__(self, name, cfg, config_key=None, *, aggregator_name: str) -> None:
        super().__init__(name, cfg, config_key)
        self.aggregator = aggregator(aggregator_name)

    def trained(self, start_state, payload):
        """FFA-LoRA: every trainable tensor but the frozen A. A rank-r_k site (payload ``rank``): A's rows and
        B's columns beyond r_k are declared structurally zero (masked)."""
        frozen = self.aggregator.frozen_factor
        out = {n: m for n, m in super().trained(start_state, payload).items() if not (frozen and f".{frozen}." in n)}
        rank = payload.get("rank")
        if rank is not None:
            for a_key, b_key in lora_pairs(list(out)):
                out[a_key], out[b_key] = truncate(torch.ones_like(start_state[a_key]),
                                                  torch.ones_like(start_state[b_key]), rank)
        return out

    def secure_terms(self, state, start, scaling):
        """Under secure aggregation: what the aggregator's server step sums (``Aggregator.secure_form``)."""
        return secure_state_terms(self.aggregator, state, scaling)


class LoraAggregated(Strategy):
    """fedavg_peft's clients and model; the server aggregates LoRA factors with ``aggregator``."""

    objective_class = LoraObjective

    def __init__(self, name, cfg, config_key=None, *, aggregator_name: str) -> None:
        super().__init__(name, cfg, config_key)
        self.aggregator = aggregator(aggregator_name)
        self.own_holdout = self.aggregator.local_factor is not None
        self.site_ranks = self._site_ranks()

    def _site_ranks(self) -> dict[str, int]:
        pairs = self.settings.site_ranks if self.settings is not None else []
        if not pairs:
            return {}
        if not self.aggregator.heterogeneous_ranks:
            raise ValueError(f"train.lora_aggregation.site_ranks is set, but method {self.name!r} "
                             f"({self.aggregator.name}) cannot aggregate a LoRA rank per site (flexlora can); "
                             f"remove {self.name} from train.methods or clear site_ranks")
        known = sorted(self.cfg.manifest.client_sites)
        out: dict[str, int] = {}
        for site, rank in pairs:
            if site not in known:
                raise ValueError(f"train.lora_aggregation.site_ranks: unknown client {site!r}; clients: {known}")
            if site in out:
                raise ValueError(f"train.lora_aggregation.site_ranks: client {site!r} is named twice")
            if not 1 <= rank <= self.cfg.model.lora_r:
                raise ValueError(f"train.lora_aggregation.site_ranks: {site} rank {rank} is outside "
                                 f"1..model.lora_r={self.cfg.model.lora_r}")
            out[site] = rank
        return out

    # ------------------------------------------------------------------ hooks
    def members(self, participants: Sequence[str]) -> list[str]:
        return sorted(participants) if self.own_holdout else [GLOBAL]

    def configure_train(self, round_idx, server_state, uploads):
        """A site below the model's rank is told its rank r_k (its start is truncated to it, ``start_state``)."""
        r = self.cfg.model.lora_r
        return {n: ({"rank": self.site_ranks[n]} if self.site_ranks.get(n, r) != r else {}) for n in uploads}

    def start_state(self, members, participant):
        if self.own_holdout:
            return members[participant]
        state = members[GLOBAL]
        rank = self.site_ranks.get(participant)
        if rank is None or rank == self.cfg.model.lora_r:
            return state
        state = dict(state)
        for a_key, b_key in lora_pairs(list(state)):
            state[a_key], state[b_key] = truncate(state[a_key], state[b_key], rank)
        return state

    def aggregate_train(self, update: RoundUpdate, model: FedHistoModel):
        names = sorted(update.states)
        check_frozen(self.aggregator, update.states, update.starts)
        states, weights = [update.states[n] for n in names], [update.weights[n] for n in names]
        if not self.own_holdout:  # one global model: FedEx-LoRA's fold goes into it (fedmath...fold)
            return {GLOBAL: aggregate_with_fold(self.aggregator, states, weights, model.lora_scaling,
                                                self.cfg.model.lora_r, update.starts[names[0]], base_dtype(model))
                    }, update.server_state
        merged, _ = aggregate_states(self.aggregator, states, weights, model.lora_scaling, self.cfg.model.lora_r)
        local = self.aggregator.local_factor
        return {n: {k: (update.states[n][k] if f".{local}." in k else v) for k, v in merged.items()}
                for n in names}, update.server_state

    # ------------------------------------------------ under secure aggregation
    def secure_aggregation(self) -> SecureAggregation:
        """Each aggregator masks what its server step sums (``Aggregator.secure_form``) with sample-mass weights."""
        form = self.aggregator.secure_form
        if form is None or self.own_holdout:
            return SecureAggregation.refused(
                f"{self.aggregator.name} keeps B at each site and one model per site; the Flower engine runs one "
                "global model, and the in-process engine's server holds each site's B to rebuild its model")
        return SecureAggregation(True, "public_counts", f"{form}; adapter and classifier",
                                 ("each site's sample count n_k (public since site preparation)",))

    def aggregate_sums(self, sums, model):
        return {GLOBAL: aggregate_means_with_fold(self.aggregator, sums.mean, model.lora_scaling, self.cfg.model.lora_r,
                                                  sums.start, base_dtype(model))}, sums.server_state

    # ------------------------------------------------------------ accounting
    def model_bytes(self, state: dict[str, torch.Tensor], clients: Sequence[str]) -> int:
        """Down + up bytes of the model exchange per round over ``clients`` (Table 8), from the real tensors."""
        r = self.cfg.model.lora_r
        return sum(sum(self.aggregator.message_bytes(state, self.site_ranks.get(c, r), r)) for c in clients)
