"""``pooled``: centralised training on the union of the clients' optimisation sets.

The reference a federated method is measured against (FLamby reports it for every benchmark): the
images that the federation spreads over five sites, in one place, trained with the same frozen
encoder, adapters, objective (class-balanced CE on one plain view, as ``fedavg_peft``) and budget
(the same rounds of ``local_epochs`` epochs, the same early stopping). Nothing is aggregated.
"""

from __future__ import annotations

from fedhisto.data.splits import Split
from fedhisto.methods.base import GLOBAL
from fedhisto.methods.secure_capability import SecureAggregation
from fedhisto.methods.strategy import Strategy

POOLED = "pooled"


class Pooled(Strategy):
    """Server only: the default objective, the union of the clients as one participant (one site under DP)."""

    exchanges_model = False  # nothing travels between sites and server

    def participants(self, clients: dict[str, Split]) -> dict[str, Split]:
        names = sorted(clients)
        return {POOLED: Split([i for n in names for i in clients[n].ids], [y for n in names for y in clients[n].labels],
                              [im for n in names for im in clients[n].images])}

    def client_weights(self, counts, updates) -> list[float]:
        return [1.0]

    def aggregate_train(self, update, model):
        return {GLOBAL: update.states[POOLED]}, update.server_state

    def secure_aggregation(self) -> SecureAggregation:
        return SecureAggregation.not_applicable("the centralised reference: the images are in one place and nothing is aggregated")
