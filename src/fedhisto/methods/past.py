"""The study's family (Table 3): FedAvg-PEFT, FedProx-PEFT, FiLM-Zero, FedHisto-PAST v1 and v2, and
v2's component ablations, as one class with keyword-named switches (one row per registered name).

Local objective of v2 (study eq. 2):
    L = CE_cb(view 1, view 2) + 0.25 JS(p1, p2) + 0.10 (1 - cos(z1, z2)) + 0.05 L_proto,v2
with v1's unweighted prototype attraction in place of L_proto,v2, and FedProx's
(mu / 2) ||theta - theta_global||^2 for ``proximal``. Client weights: sample mass, or the
adaptive heuristic of eq. 4 (``fedmath.weights.Adaptive``). Aggregation: delta-SVD (eq. 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field

from fedhisto.config_base import Strict
from fedhisto.fedmath.losses import feature_consistency, js_divergence, prototype_v1, prototype_v2, proximal
from fedhisto.fedmath.prototypes import (
    ClientPrototypes,
    ServerPrototypes,
    aggregate_prototypes,
    client_prototypes,
    prototype_traffic,
)
from fedhisto.fedmath.weights import Adaptive, SampleMass, induced_update
from fedhisto.methods.base import Batch, LocalRun, Method, RoundUpdate, client_descriptors, zero_descriptors
from fedhisto.model.peft_model import N_CLASSES, FedHistoModel
from fedhisto.splits import Split, eval_batches


class PastConfig(Strict):
    """The study's method family (FedAvg-PEFT .. PAST v2 and ablations): its loss weights and server rules."""

    weight_js: float = Field(0.25, ge=0, description="JS consistency between the two stain views")
    weight_feat: float = Field(0.10, ge=0, description="feature consistency (cosine distance)")
    weight_proto: float = Field(0.05, ge=0, description="prototype term (v1 attraction, v2 reliability+margin)")
    proto_margin: float = 0.20
    proto_max_images: int = Field(256, ge=1)
    adaptive_floor: float = Field(0.03, ge=0, lt=0.2)
    fedprox_mu: float = Field(0.001, ge=0)
    reliability: Literal["study", "bounded"] = Field(
        "study", description="prototype reliability: the study's formula, or [ours] one scale for 1 and 2+ contributors")

class PastFamily(Method):
    def __init__(self, name, cfg, config_key=None, *, film: bool = False, zero_descriptor: bool = False,
                 prototypes: Literal["none", "v1", "v2"] = "none", paired_views: bool = False, js: bool = False,
                 feat: bool = False, aggregation: Literal["sample_mass", "adaptive"] = "sample_mass",
                 proximal: bool = False, stain_views: bool = False) -> None:
        super().__init__(name, cfg, config_key)
        if stain_views and paired_views:
            raise ValueError(f"method {name!r}: stain_views is the single-view arm's switch (paired views are "
                             "stain-perturbed already)")
        # issue 23: a stain-augmented single-view arm draws v2's first-view perturbation for its one view
        # (views.training_views with stain_single=True); the others follow views.single_view_stain
        self.stain_single = True if stain_views else None
        self.film, self.zero_descriptor, self.prototypes = film, zero_descriptor, prototypes
        self.paired_views, self.js, self.feat = paired_views, js, feat
        self.aggregation, self.proximal = aggregation, proximal

    def descriptors(self, doc, participants):
        if not self.film:
            return super().descriptors(doc, participants)
        return zero_descriptors(participants) if self.zero_descriptor else client_descriptors(doc, participants)

    def configure_train(self, round_idx, server_state, uploads):
        protos = ServerPrototypes.from_state(server_state) if server_state else None
        return {name: {"prototypes": protos} for name in uploads}

    def client_weights(self, counts: Sequence[int], updates: Sequence[torch.Tensor]) -> list[float]:
        if self.aggregation == "adaptive":
            return Adaptive(floor=self.settings.adaptive_floor)(counts, updates)
        return SampleMass()(counts, updates)

    def aggregate_train(self, update: RoundUpdate, model: FedHistoModel):
        """``train.readings.adaptive_on: delta_w``: the adaptive weights recomputed on the induced LoRA
        updates s (B A - B0 A0) (the engine hands ``client_weights`` the raw factor deltas); the round's
        recorded weights are these. Otherwise the default aggregation."""
        if self.aggregation == "adaptive" and self.cfg.train.readings.adaptive_on == "delta_w":
            names = sorted(update.states)
            weights = Adaptive(floor=self.settings.adaptive_floor)(
                [update.counts[n] for n in names],
                [induced_update(update.states[n], update.starts[n], model.lora_scaling) for n in names])
            update.weights.update(zip(names, weights, strict=True))
        return super().aggregate_train(update, model)

    def extra_terms(self, run: LocalRun, batch: Batch, logits, zs) -> dict[str, torch.Tensor]:
        p = self.settings
        terms: dict[str, torch.Tensor] = {}
        if self.paired_views and self.js:
            terms["js"] = p.weight_js * js_divergence(logits[0], logits[1])
        if self.paired_views and self.feat:
            terms["feat"] = p.weight_feat * feature_consistency(zs[0], zs[1])
        protos: ServerPrototypes | None = run.payload.get("prototypes")
        if protos is not None and self.prototypes != "none" and protos.mask.any():
            c, m, r = (protos.centroids.to(run.device), protos.mask.to(run.device), protos.reliability.to(run.device))
            if self.prototypes == "v2":
                loss = sum(prototype_v2(z, batch.y, c, m, r, p.proto_margin) for z in zs) / len(zs)
            else:
                loss = sum(prototype_v1(z, batch.y, c, m) for z in zs) / len(zs)
            terms["proto"] = p.weight_proto * loss
        if self.proximal:
            terms["prox"] = proximal(run.params, run.start_state, p.fedprox_mu)
        return terms

    # ------------------------------------------------- prototypes (study 3.7)
    @torch.no_grad()
    def upload_after_aggregation(self, model: FedHistoModel, data: Split, descriptor: torch.Tensor | None,
                                 device: torch.device) -> ClientPrototypes | None:
        """Centroids of at most ``proto_max_images`` optimisation images per present class (sample-id order)."""
        if self.prototypes == "none":
            return None
        model.eval()
        keep, seen = [], [0] * N_CLASSES
        for i, y in enumerate(data.labels):
            if seen[y] < self.settings.proto_max_images:
                keep.append(i)
                seen[y] += 1
        subset = Split([data.ids[i] for i in keep], [data.labels[i] for i in keep], [data.images[i] for i in keep])
        zs, ys = [], []
        desc = descriptor.to(device)[None] if descriptor is not None else None
        for x, y in eval_batches(subset, self.cfg.views, self.cfg.evaluate.eval_batch):
            zs.append(model.embed(x.to(device), desc).float().cpu())
            ys.append(y)
        return client_prototypes(torch.cat(zs), torch.cat(ys), N_CLASSES)

    @property
    def post_uploads(self) -> bool:  # prototype rows upload centroids under the new model
        return self.prototypes != "none"

    def aggregate_uploads(self, uploads: dict[str, Any], server_state: Any) -> dict:
        got = [uploads[n] for n in sorted(uploads)]
        dim = next(v.numel() for u in got for v in u.centroids.values())
        return aggregate_prototypes(got, N_CLASSES, dim, variant=self.settings.reliability).state()

    def extra_traffic_bytes(self, dim, availability, optimisation_sizes, payload_bytes):
        if self.prototypes == "none":
            return {}
        return {"prototype": prototype_traffic(dim, availability).total_bytes}
