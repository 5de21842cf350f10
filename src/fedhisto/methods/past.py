"""The study's family (Table 3): FedAvg-PEFT, FedProx-PEFT, FiLM-Zero, FedHisto-PAST v1 and v2, and
v2's component ablations, as one class with keyword-named switches (one row per registered name).

Local objective of v2 (study eq. 2):
    L = CE_cb(view 1, view 2) + 0.25 JS(p1, p2) + 0.10 (1 - cos(z1, z2)) + 0.05 L_proto,v2
with v1's unweighted prototype attraction in place of L_proto,v2, and FedProx's
(mu / 2) ||theta - theta_global||^2 for ``proximal``. Client weights: sample mass, or the
adaptive heuristic of eq. 4 (``fedmath.weights.Adaptive``). Aggregation: delta-SVD (eq. 5), or
[ours] another LoRA aggregator of ``fedmath.lora_aggregators`` (``train.past.lora_aggregator``: the
family's model and objective under factor averaging, FlexLoRA at equal ranks, FedEx-LoRA's fold or
FFA-LoRA's frozen A; FedSA-LoRA is refused, it keeps one model per site).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field

from fedhisto.data.splits import Split, eval_batches
from fedhisto.fedmath.aggregate import lora_pairs
from fedhisto.fedmath.lora_aggregators import aggregator, secure_state_terms
from fedhisto.fedmath.losses import (
    feature_consistency,
    js_divergence,
    prototype_v1,
    prototype_v1_image,
    prototype_v2,
    prototype_v2_image,
    proximal,
)
from fedhisto.fedmath.prototypes import (
    ClientPrototypes,
    ServerPrototypes,
    aggregate_prototypes,
    aggregate_prototypes_from_sums,
    client_prototypes,
    prototype_terms,
    prototype_traffic,
)
from fedhisto.fedmath.secure_sums import lora_products
from fedhisto.fedmath.weights import Adaptive, SampleMass, induced_update
from fedhisto.infra.settings_base import IF_CHANGED, Strict
from fedhisto.methods.base import (
    GLOBAL,
    Batch,
    LocalRun,
    RoundUpdate,
    client_descriptors,
    zero_descriptors,
)
from fedhisto.methods.dp_objective import ImageCE, PrivateObjective
from fedhisto.methods.objective import Objective
from fedhisto.methods.secure_capability import SecureAggregation
from fedhisto.methods.strategy import Strategy
from fedhisto.model.peft_model import N_CLASSES, FedHistoModel


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
    lora_aggregator: Literal["delta_svd", "factor_mean", "flexlora", "fedex_lora", "ffa_lora", "fedsa_lora"] = Field(
        "delta_svd", json_schema_extra=IF_CHANGED,
        description="[ours] the server's LoRA aggregator (fedmath.lora_aggregators): delta_svd is the study's (eq. 5); "
                    "factor_mean, flexlora, fedex_lora, ffa_lora as their methods aggregate; fedsa_lora is refused "
                    "(it keeps B at each site, one model per site)")

@dataclass(frozen=True)
class PastUnitLoss(ImageCE):
    """The family's local objective for ONE image (under DP-SGD), for image i with label y and views
    v = 1..V (logits l_v, adapted embeddings z_v):

        l_i = (1/V) sum_v w_y CE(l_v, y)                                  class-balanced CE (or summed: ce_views)
            + lambda_JS JS(p_1, p_2) + lambda_feat (1 - cos(z_1, z_2))    pair terms (paired views)
            + lambda_proto (1/V) sum_v L_proto(z_v, y; P, mask, r)         against the GLOBAL prototypes

    ``extra_terms`` on a batch of that one image; the batch form averages the prototype terms over the
    images whose class has a global prototype, here an image without one contributes 0. The global
    prototypes are fixed during the round (server state), so no term couples two images. FedProx's
    proximal term has no data: its gradient joins after the noise (``private_objective``)."""

    weight_js: float = 0.0                         # 0 switches the term off
    weight_feat: float = 0.0
    weight_proto: float = 0.0
    prototypes: Literal["none", "v1", "v2"] = "none"
    centroids: torch.Tensor | None = None          # (C, D) global prototypes of the round
    mask: torch.Tensor | None = None               # (C,) bool: class has a valid prototype
    reliability: torch.Tensor | None = None        # (C,) v2's per-class reliability
    margin: float = 0.20

    def __call__(self, logits: torch.Tensor, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.ce(logits, y)
        if logits.shape[0] >= 2 and self.weight_js:
            loss = loss + self.weight_js * js_divergence(logits[0:1], logits[1:2])
        if z.shape[0] >= 2 and self.weight_feat:
            loss = loss + self.weight_feat * feature_consistency(z[0:1], z[1:2])
        if self.prototypes != "none" and self.weight_proto and self.centroids is not None:
            if self.prototypes == "v2":
                proto = prototype_v2_image(z, y, self.centroids, self.mask, self.reliability, self.margin)
            else:
                proto = prototype_v1_image(z, y, self.centroids, self.mask)
            loss = loss + self.weight_proto * proto
        return loss


class PastObjective(Objective):
    """The family's clients: class-balanced CE on one or two stain views, JS and feature consistency between
    the views, the prototype term against the round's global prototypes, FedProx's proximal term, and the
    prototype upload after aggregation (study eq. 2, section 3.7)."""

    def __init__(self, name, cfg, config_key=None, *, prototypes: Literal["none", "v1", "v2"] = "none",
                 paired_views: bool = False, js: bool = False, feat: bool = False, proximal: bool = False,
                 stain_views: bool = False) -> None:
        super().__init__(name, cfg, config_key)
        if stain_views and paired_views:
            raise ValueError(f"method {name!r}: stain_views is the single-view arm's switch (paired views are "
                             "stain-perturbed already)")
        # issue 23: a stain-augmented single-view arm draws v2's first-view perturbation for its one view
        # (views.training_views with stain_single=True); the others follow views.single_view_stain
        self.stain_single = True if stain_views else None
        self.prototypes = prototypes
        self.paired_views, self.js, self.feat = paired_views, js, feat
        self.proximal = proximal
        chosen = self.settings.lora_aggregator if self.settings is not None else "delta_svd"
        self.frozen_factor = aggregator(chosen).frozen_factor  # FFA-LoRA's A under train.past.lora_aggregator
        # under secure aggregation a site masks the terms the server's aggregator sums (None: delta-SVD's)
        self.lora_aggregator = None if chosen == "delta_svd" else aggregator(chosen)

    def trained(self, start_state, payload):
        """Under ``lora_aggregator: ffa_lora`` the sites keep A at its shared initialisation (FFA-LoRA)."""
        frozen = self.frozen_factor
        return {n: m for n, m in super().trained(start_state, payload).items() if not (frozen and f".{frozen}." in n)}

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

    # ---------------------------------------------------------- under DP-SGD
    def unit_loss(self, payload: dict, ce_weights: torch.Tensor, device: torch.device | str = "cpu") -> PastUnitLoss:
        """The objective of one image for one round's payload (with the round's global prototypes, if any)."""
        s = self.settings
        protos = payload.get("prototypes")
        use_protos = self.prototypes != "none" and protos is not None and bool(protos.mask.any())
        return PastUnitLoss(
            ce_weights=ce_weights.to(device), ce_views=self.cfg.train.readings.ce_views,
            weight_js=s.weight_js if (self.paired_views and self.js) else 0.0,
            weight_feat=s.weight_feat if (self.paired_views and self.feat) else 0.0,
            weight_proto=s.weight_proto if use_protos else 0.0,
            prototypes=self.prototypes if use_protos else "none",
            centroids=protos.centroids.to(device) if use_protos else None,
            mask=protos.mask.to(device) if use_protos else None,
            reliability=protos.reliability.to(device) if use_protos else None,
            margin=s.proto_margin)

    def private_objective(self, run: LocalRun) -> PrivateObjective:
        def proximal_term() -> torch.Tensor:  # FedProx's (mu/2)||theta - theta_global||^2: no data
            return proximal(run.params, run.start_state, self.settings.fedprox_mu)

        return PrivateObjective(self.unit_loss(run.payload, run.ce_weights, run.device),
                                proximal_term if self.proximal else None)

    # ------------------------------------------------ under secure aggregation
    # What a site masks (the server's half, ``PastFamily.secure_aggregation``, says why): delta-SVD's
    # dense products or the chosen aggregator's terms, its update D_k for adaptive weights, its prototypes.
    def secure_terms(self, state, start, scaling):
        if self.lora_aggregator is None:
            return super().secure_terms(state, start, scaling)
        return secure_state_terms(self.lora_aggregator, state, scaling)

    def secure_statistic(self, state, start, scaling):
        """D_k as ``client_weights`` sees it: the raw deltas, or (``adaptive_on: delta_w``) each pair's s (B A - B0 A0)."""
        keys = [k for k in sorted(start) if not k.startswith("folded_base.")]
        pairs = lora_pairs(keys) if self.cfg.train.readings.adaptive_on == "delta_w" else []
        paired = {k for p in pairs for k in p}
        return {**lora_products(state, scaling, pairs, start),
                **{k: state[k].double() - start[k].double() for k in keys if k not in paired}}

    def secure_post_terms(self, upload: ClientPrototypes):
        dim = next(v.numel() for v in upload.centroids.values())
        return prototype_terms(upload, N_CLASSES, dim, self.settings.proto_max_images)

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


class PastFamily(Strategy):
    """The family's server: descriptors (FiLM), the global prototypes sent each round, sample-mass or adaptive
    weights, delta-SVD or another LoRA aggregator, and the prototype exchange after aggregation."""

    objective_class = PastObjective

    def __init__(self, name, cfg, config_key=None, *, film: bool = False, zero_descriptor: bool = False,
                 prototypes: Literal["none", "v1", "v2"] = "none",
                 aggregation: Literal["sample_mass", "adaptive"] = "sample_mass") -> None:
        super().__init__(name, cfg, config_key)
        self.film, self.zero_descriptor, self.prototypes = film, zero_descriptor, prototypes
        self.aggregation = aggregation
        self.lora_aggregator = self._lora_aggregator()

    def _lora_aggregator(self):
        """The server's LoRA aggregator (``train.past.lora_aggregator``), or None for the study's delta-SVD
        (the default's code path, unchanged)."""
        name = self.settings.lora_aggregator if self.settings is not None else "delta_svd"
        if name == "delta_svd":
            return None
        if name == "fedsa_lora":
            raise ValueError(f"train.past.lora_aggregator: fedsa_lora cannot aggregate method {self.name!r}: it keeps "
                             "B at each site, so a run has one model per site, and the PAST family keeps one global "
                             "model (its prototypes and adaptive weights are the global model's); train the "
                             "fedsa_lora method instead")
        return aggregator(name)

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
        if self.lora_aggregator is None:
            return super().aggregate_train(update, model)
        from fedhisto.fedmath.lora_aggregators import check_frozen
        from fedhisto.fedmath.lora_aggregators.fold import aggregate_with_fold
        from fedhisto.methods.lora_aggregated import base_dtype

        check_frozen(self.lora_aggregator, update.states, update.starts)
        names = sorted(update.states)
        merged = aggregate_with_fold(self.lora_aggregator, [update.states[n] for n in names],
                                     [update.weights[n] for n in names], model.lora_scaling, self.cfg.model.lora_r,
                                     update.starts[names[0]], base_dtype(model))
        return {GLOBAL: merged}, update.server_state

    def model_bytes(self, state: dict[str, torch.Tensor], clients: Sequence[str]) -> int:
        """Table 8: the study's exchange, or what the chosen LoRA aggregator sends (``message_bytes``)."""
        if self.lora_aggregator is None:
            return super().model_bytes(state, clients)
        return len(clients) * sum(self.lora_aggregator.message_bytes(state))

    # ------------------------------------------------ under secure aggregation
    # Delta-SVD needs sum_k a_k s B_k A_k: each site masks its dense products (or the chosen aggregator's
    # terms). Adaptive weights (eq. 4) need each site's update against the others': a first masked round
    # sums the updates D_k, each site states ||D_k||^2 and D_k . S (Adaptive.from_statistics), a second
    # sums the weighted contributions. Prototypes: a third masked sum (fedmath.prototypes).
    def secure_aggregation(self) -> SecureAggregation:
        agg = self.lora_aggregator
        summed = agg.secure_form if agg is not None else "s B_k A_k per LoRA module (dense, out x in)"
        summed += "; adapter, FiLM and classifier" if self.film else "; adapter and classifier"
        learns = ["each site's sample count n_k (public since site preparation)"]
        rounds, least = 1, 2
        if self.aggregation == "adaptive":
            update = ("s (B_k A_k - B A) per LoRA module" if self.cfg.train.readings.adaptive_on == "delta_w"
                      else "LoRA factor deltas")
            learns += [f"S = sum_k D_k, the sites' summed updates ({update}, adapter, FiLM, classifier), sent to "
                       "every site", "per site ||D_k||^2 and D_k . S"]
            rounds, least = rounds + 1, 4  # with 3 sites, S and the weighted sum let a site solve for each other site
        if self.prototypes != "none":
            learns.append("per class the sqrt(n_kc)-weighted sums of centroids, weights and squared norms, its image "
                          "count and how many sites hold it")
            rounds += 1
        return SecureAggregation(True, "statistics" if self.aggregation == "adaptive" else "public_counts", summed,
                                 tuple(learns), masked_sums=rounds, min_sites=least)

    def aggregate_sums(self, sums, model):
        if self.lora_aggregator is None:
            return super().aggregate_sums(sums, model)
        from fedhisto.fedmath.lora_aggregators.fold import aggregate_means_with_fold
        from fedhisto.methods.lora_aggregated import base_dtype

        return {GLOBAL: aggregate_means_with_fold(self.lora_aggregator, sums.mean, model.lora_scaling,
                                                  self.cfg.model.lora_r, sums.start, base_dtype(model))
                }, sums.server_state

    def secure_weights(self, stats):
        names = sorted(stats.counts)
        weights = Adaptive(floor=self.settings.adaptive_floor).from_statistics(
            [stats.counts[n] for n in names], [stats.squared_norms[n] for n in names], [stats.dots[n] for n in names],
            stats.sum_squared_norm, stats.summed_sites)
        return dict(zip(names, weights, strict=True))

    def aggregate_post_sums(self, sums, server_state):
        dim = sums.sums["proto:0:wu"].numel()
        return aggregate_prototypes_from_sums(sums.sums, N_CLASSES, dim, self.settings.proto_max_images,
                                              variant=self.settings.reliability).state()

    # ------------------------------------------------- prototypes (study 3.7)
    def aggregate_uploads(self, uploads: dict[str, Any], server_state: Any) -> dict:
        got = [uploads[n] for n in sorted(uploads)]
        dim = next(v.numel() for u in got for v in u.centroids.values())
        return aggregate_prototypes(got, N_CLASSES, dim, variant=self.settings.reliability).state()

    def extra_traffic_bytes(self, dim, availability, optimisation_sizes, payload_bytes):
        if self.prototypes == "none":
            return {}
        return {"prototype": prototype_traffic(dim, availability).total_bytes}
