"""The server half of a federated method: its ``Strategy`` (see ``methods.base`` for how the halves fit).

A strategy says who trains in a round, which model each participant starts from and what it receives,
how the returned participants are weighted and aggregated (and what server state the method keeps),
what travels (Table 8), and what its paper assumes. Modelled on Flower's strategies
(``configure_train`` / ``aggregate_train``). It names its client half, ``objective_class``; a method
that changes only the server (FedAdam, local_only, pooled) keeps the default ``Objective``. Server-side
declarations (flags such as ``exchanges_model``, and ``secure_aggregation``) live here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedhisto.data.splits import Split
from fedhisto.fedmath.aggregate import aggregate, delta_svd_from_means
from fedhisto.fedmath.weights import SampleMass
from fedhisto.methods.base import GLOBAL, MethodPart, PaperAssumptions, RoundUpdate
from fedhisto.methods.objective import Objective
from fedhisto.methods.secure_capability import SecureAggregation, SecureSums, SiteStatistics
from fedhisto.model.peft_model import FedHistoModel


class Strategy(MethodPart):
    """Base: FedAvg over the PEFT adapters (delta-SVD for LoRA pairs), one global model, no extra exchange.

    Subclasses override the hooks that differ. ``objective`` (set by ``methods.build_method``) is the
    client half built from the same registration.
    """

    objective_class: type[Objective] = Objective  # the client half registered with this strategy
    film: bool = False              # the model carries stain-conditioned FiLM
    exchanges_model: bool = True    # the trainable state travels down and up every round (Table 8)
    # What the method's paper assumes (None: the method is the study's own, or a reference such as
    # local_only / pooled whose protocol is the study's by definition); see ``protocol_departures``.
    assumptions: PaperAssumptions | None = None
    own_holdout: bool = False       # each member is a site's model, scored on that site's holdout only
    objective: Objective

    # ------------------------------------------------------------------ setup
    def participants(self, clients: dict[str, Split]) -> dict[str, Split]:
        """What trains in a round (default: every client on its own optimisation set)."""
        return clients

    def members(self, participants: Sequence[str]) -> list[str]:
        """The models a run keeps, checkpoints and evaluates (default: one global model)."""
        return [GLOBAL]

    def descriptors(self, doc: dict | None, participants: Sequence[str]) -> dict[str, torch.Tensor | None]:
        """Stain descriptor per participant and ``global`` (validation/test/external); None without FiLM."""
        return dict.fromkeys([*participants, GLOBAL])

    def weighting(self) -> str:
        """The name of the server's weighting of returned participants (``client_weights``)."""
        return "sample_mass"

    def protocol_departures(self) -> list[str]:
        """Where this run departs from what the method's paper assumes (``assumptions``), one sentence
        each; empty when it runs under its own assumptions (or declares none)."""
        a = self.assumptions
        if a is None:
            return []
        plan, out = self.objective.local_schedule(0), []
        if a.local_optimizer not in ("any", plan.optimizer):
            out.append(f"local steps are {plan.optimizer} (lr {plan.lr:g}); {a.source} assumes {a.local_optimizer}")
        if a.weighting not in ("any", self.weighting()):
            out.append(f"participants weighted by {self.weighting()}; {a.source} assumes {a.weighting}")
        if a.participation not in ("any", "full"):  # the protocol asks every client every round
            out.append(f"every client takes part in every round; {a.source} assumes {a.participation} participation")
        if not a.clipping and plan.grad_clip is not None:
            out.append(f"local gradients clipped to norm {plan.grad_clip:g}; {a.source} does not clip")
        return [f"{self.name}: {d}" for d in out]

    @property
    def pre_uploads(self) -> bool:
        """Participants upload before training (the objective's ``upload_before_training``)."""
        return bool(self.objective.pre_uploads)

    @property
    def post_uploads(self) -> bool:
        """Participants upload after aggregation (the objective's ``upload_after_aggregation``)."""
        return bool(self.objective.post_uploads)

    # ----------------------------------------------------------- rounds
    def start_state(self, members: dict[str, dict[str, torch.Tensor]], participant: str) -> dict[str, torch.Tensor]:
        """The state a participant starts the round from (default: the global one)."""
        return members[GLOBAL]

    def configure_train(self, round_idx: int, server_state: Any, uploads: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The method payload of each participant (``uploads`` holds one entry per participant,
        None where it uploaded nothing). Default: nothing beyond the start state."""
        return {name: {} for name in uploads}

    def client_weights(self, counts: Sequence[int], updates: Sequence[torch.Tensor]) -> list[float]:
        """Aggregation weights a_k of the returned participants (default: sample mass)."""
        return SampleMass()(counts, updates)

    def aggregate_train(self, update: RoundUpdate, model: FedHistoModel
                        ) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
        """The new member states and server state from what came back. Default: delta-SVD for
        LoRA pairs and the weighted mean for the rest (``fedmath.aggregate``); server state unchanged."""
        names = list(update.states)
        merged = aggregate([update.states[n] for n in names], [update.weights[n] for n in names],
                           model.lora_scaling, self.cfg.model.lora_r)
        return {GLOBAL: merged}, update.server_state

    def aggregate_uploads(self, uploads: dict[str, Any], server_state: Any) -> Any:
        """(``post_uploads`` only) The server state for the next round from the
        post-aggregation uploads and the state ``aggregate_train`` left."""
        return server_state

    # ------------------------------------------------ under secure aggregation
    # A method declares in its own file whether its server step can be written over masked sums
    # (``methods.secure_capability``, docs/federation.md). These server hooks receive only sums (the
    # objective's ``secure_terms`` and friends say what a site masks); none ever sees one site's record.
    def secure_aggregation(self) -> SecureAggregation:
        """What this method's server step needs under secure aggregation. Default: refused until declared."""
        return SecureAggregation.refused(
            f"its class {type(self).__module__}:{type(self).__qualname__} declares nothing (override "
            "Strategy.secure_aggregation in the method's own file)")

    def aggregate_sums(self, sums: SecureSums, model: FedHistoModel) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
        """The new member states and server state from the weighted sums (default: delta-SVD's rank-r
        refactorisation of the weighted mean s B A, the weighted mean of the rest)."""
        return {GLOBAL: delta_svd_from_means(sums.mean, sums.start, model.lora_scaling, self.cfg.model.lora_r)
                }, sums.server_state

    def secure_weights(self, stats: SiteStatistics) -> dict[str, float]:
        """(``weights: statistics``) The aggregation weights from the scalars the sites stated."""
        raise NotImplementedError(f"method {self.name!r} declares no statistics round")

    def aggregate_post_sums(self, sums: SecureSums, server_state: Any) -> Any:
        """(``post_uploads``) The server state for the next round from the summed post-aggregation terms."""
        raise NotImplementedError(f"method {self.name!r} masks no upload after aggregation")

    # ----------------------------------------------------------- accounting
    def model_bytes(self, state: dict[str, torch.Tensor], clients: Sequence[str]) -> int:
        """Bytes of the model exchange per round (Table 8): the trainable ``state`` down and up for each
        of ``clients`` (a method that sends less, or more, says so here)."""
        return 2 * len(clients) * sum(t.numel() * t.element_size() for t in state.values())

    def extra_traffic_bytes(self, dim: int, availability: dict[str, list[bool]], optimisation_sizes: dict[str, int],
                            payload_bytes: int) -> dict[str, int]:
        """Bytes per round beyond the model exchange, by message kind (Table 8): ``dim`` is the embedding
        width, ``payload_bytes`` the trainable state's size (one copy) in float32."""
        return {}
