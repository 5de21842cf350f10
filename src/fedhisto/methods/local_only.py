"""``local_only``: every client trains alone, with the same rounds, budget and early stopping.

Answers "does federation help at all?". Each client keeps its own model (a *member* of the run,
named by the client), starts every round from its own state and never exchanges anything; the
objective is ``fedavg_peft``'s (class-balanced CE on one plain view). Validation, prediction and
metrics score every client's model separately; the run's validation metric, and the method's
metrics in Tables 4-6, are the mean over the client models (``metrics``, ``bootstrap``).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedhisto.methods.secure_capability import SecureAggregation
from fedhisto.methods.strategy import Strategy


class LocalOnly(Strategy):
    """Server only: the default objective (under DP: its per-image form; nothing leaves a site)."""

    exchanges_model = False  # nothing travels between sites and server

    def members(self, participants: Sequence[str]) -> list[str]:
        return sorted(participants)

    def start_state(self, members, participant):
        return members[participant]

    def aggregate_train(self, update, model):  # no exchange: each returned client's state is its model
        return dict(update.states), update.server_state

    def secure_aggregation(self) -> SecureAggregation:
        return SecureAggregation.not_applicable("nothing is exchanged: each site trains and keeps its own model")
