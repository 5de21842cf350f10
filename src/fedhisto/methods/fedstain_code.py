"""FedStain as its authors' public code runs it (``fedstain_code``), beside the literal Algorithm 1 (``fedstain``).

Shared with the literal variant (inherited): the statistics exchange, the pool each client
receives without its own rows, FedAvg of the adapters, the PEFT architecture without FiLM.
Different (docs/methods.md has the full table): the statistics are the skewness and excess
kurtosis of the *input pixels* of floor(r n_i) images, the only upload; the generated views are
the pixels with a small per-channel shift (``pixel_style_shift``) and then AugMix; three views
(original + two generated); CE on all three, JS across them, SupCon of each generated view
against the original with the anchor among its own positives; lambda1 = lambda2 = 0.1; no RandStain.

[ours] on this architecture: the original view is the plain geometric training view every
single-view method sees; CE is class-balanced like every method here; AugMix is the morphology
AugMix the literal variant uses by default (``augmix_ops: morphology``; torchvision is not a
dependency); ``augmix_ops: torchvision`` is torchvision's ``AugMix()`` as the code calls it, where
torchvision is importable (refused with a clear error elsewhere); statistics are taken on the
evaluation view of the sampled images.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedhisto.config.study import Config
from fedhisto.data.splits import Split
from fedhisto.data.views import eval_view
from fedhisto.fedmath.fedstain_code_ops import (
    PixelMoments,
    code_upload_count,
    pixel_moments,
    pixel_style_shift,
    quantise_unit,
    torchvision_augmix,
)
from fedhisto.fedmath.fedstain_ops import augmix, js_multi, representation_alignment, style_traffic
from fedhisto.infra.settings_base import IF_CHANGED, Strict
from fedhisto.methods.base import Batch, BatchInputs, LocalRun, balanced_cross_entropy
from fedhisto.methods.fedstain import FedStain, FedStainObjective, from_unit, to_unit
from fedhisto.methods.objective import Objective
from fedhisto.methods.secure_capability import SecureAggregation
from fedhisto.model.peft_model import FedHistoModel

#: the code's JS clamps the mixture distribution at 1e-7
JS_EPS = 1e-7


@torch.no_grad()
def client_pixel_moments(data: Split, cfg: Config, rng: np.random.Generator) -> PixelMoments:
    """The upload: pixel skewness and kurtosis (per RGB channel) of floor(r n_i) images drawn without
    replacement (the code: the first r of its shuffled training loader), on normalised pixels."""
    n = code_upload_count(len(data), cfg.train.fedstain_code.upload_ratio)
    idx = sorted(rng.choice(len(data), size=n, replace=False).tolist())
    pixels = torch.stack([eval_view(data.images[i], cfg.views) for i in idx])
    s = cfg.train.fedstain_code
    _, _, skew, kurt = pixel_moments(pixels, clamp=s.moment_clamp)
    return PixelMoments(skew, kurt)


class FedStainCodeConfig(Strict):
    """FedStain as its authors' public code runs it (docs/methods.md): pixel skewness/kurtosis, a 0.1 x
    per-channel pixel shift, AugMix; three views; CE + lambda2 JS + lambda1 SupCon, both 0.1 in the code."""

    upload_ratio: float = Field(0.1, gt=0, le=1, description="r: statistics of floor(r n_i) local images per round")
    shift_scale: float = Field(0.1, ge=0, description="the code's style_factor: pixel shift per unit moment change")
    mixstyle_alpha: float = Field(0.1, gt=0, description="lambda ~ Beta(alpha, alpha) mixing own and pooled moments")
    moment_clamp: float = Field(10.0, gt=0, description="skewness, kurtosis and shifted pixels clamped to +-this")
    weight_supcon: float = Field(0.10, ge=0, description="lambda1: SupCon of each generated view against the original")
    weight_js: float = Field(0.10, ge=0, description="lambda2: JS across the three views' predictions")
    supcon_tau: float = Field(0.1, gt=0)
    augmix_width: int = Field(3, ge=1)
    augmix_depth: int = Field(3, ge=1)
    augmix: bool = Field(True, description="ablation switch: off leaves the generated views as shifted pixels")
    augmix_ops: Literal["morphology", "torchvision"] = Field(
        "morphology", json_schema_extra=IF_CHANGED,
        description="morphology: the literal variant's flips/rotations/zoom AugMix; torchvision: torchvision's "
                    "AugMix() as the authors' code calls it (all ops, colour included; needs torchvision)")


def generated_views(x: torch.Tensor, pool: PixelMoments, settings: FedStainCodeConfig, cfg: Config,
                    rng: np.random.Generator) -> list[torch.Tensor]:
    """The two generated views of a batch of normalised pixels: each its own draw of sampled pooled
    moments -> pixel shift -> AugMix (on the uint8-quantised RGB image, re-normalised)."""
    out = []
    for _ in range(2):
        shifted = pixel_style_shift(x, pool, rng, settings.mixstyle_alpha, settings.shift_scale,
                                    clamp=settings.moment_clamp)
        if settings.augmix:
            unit = quantise_unit(to_unit(shifted, cfg.views))
            if settings.augmix_ops == "torchvision":
                shifted = from_unit(torchvision_augmix(unit, rng), cfg.views)
            else:
                shifted = from_unit(torch.stack([augmix(img, rng, settings.augmix_width, settings.augmix_depth)
                                                 for img in unit]), cfg.views)
        out.append(shifted)
    return out


def fedstain_code_loss(logits: list[torch.Tensor], zs: list[torch.Tensor], y: torch.Tensor,
                       ce_weights: torch.Tensor, cfg: Config, nominal_batch: int | None = None) -> dict[str, torch.Tensor]:
    """CE summed over (original, generated, generated) + lambda2 JS + lambda1 SupCon of each generated
    view against the original."""
    s = cfg.train.fedstain_code
    return {
        "ce": sum(balanced_cross_entropy(lg, y, ce_weights, nominal_batch, cfg.train.readings.ce_reduction)
                  for lg in logits),
        "supcon": s.weight_supcon * representation_alignment(zs[0], zs[1:], y, s.supcon_tau, include_self=True),
        "js": s.weight_js * js_multi(logits, eps=JS_EPS),
    }


def fedstain_code_terms(model: FedHistoModel, x: torch.Tensor, y: torch.Tensor, pool: PixelMoments,
                        ce_weights: torch.Tensor, cfg: Config, rng: np.random.Generator,
                        device: torch.device, nominal_batch: int | None = None) -> dict[str, torch.Tensor]:
    """One batch: the three views forwarded one at a time, then ``fedstain_code_loss``."""
    logits, zs = [], []
    for view in [x, *generated_views(x, pool, cfg.train.fedstain_code, cfg, rng)]:
        lg, z = model(view.to(device))
        logits.append(lg.float())
        zs.append(z.float())
    return fedstain_code_loss(logits, zs, y, ce_weights, cfg, nominal_batch)


class FedStainCodeObjective(FedStainObjective):
    """Client: pixel moments up before training, three views per batch, the code's objective. No hook
    inside the encoder."""

    def dp_refusal(self) -> str | None:
        return ("its loss does not decompose per sample: the SupCon alignment of each generated view against the "
                "batch's originals couples the images of a batch; it also uploads single images' pixel skewness and "
                "kurtosis rows un-noised")

    def upload_before_training(self, model, start_state, data, rng, device) -> PixelMoments:
        return client_pixel_moments(data, self.cfg, rng)

    def local_schedule(self, round_idx: int):
        return Objective.local_schedule(self, round_idx)  # the study's protocol (no paper switch here)

    # three views and the code's loss; nothing restyles features
    def batch_inputs(self, run: LocalRun, batch: Batch) -> BatchInputs:
        x, rng = self.plain_views(run, batch)
        return BatchInputs([x, *generated_views(x, run.payload["style_pool"], self.settings, run.cfg, rng)])

    def terms_from_outputs(self, run: LocalRun, batch: Batch, logits, zs) -> dict[str, torch.Tensor]:
        return fedstain_code_loss(logits, zs, batch.y, run.ce_weights, run.cfg, run.nominal_batch)

    def restyle_layer(self) -> int | None:
        return None


class FedStainCode(FedStain):
    """Server as ``FedStain`` (pool without the client's own rows, FedAvg); its clients:
    ``FedStainCodeObjective``."""

    objective_class = FedStainCodeObjective

    def secure_aggregation(self) -> SecureAggregation:
        return SecureAggregation.refused(
            "each site uploads its pixel statistics before training (channel skewness and kurtosis of a sample "
            "of its images) and the server sends every site the other sites' rows: the rows are the payload "
            "itself, not a sum")

    def extra_traffic_bytes(self, dim, availability, optimisation_sizes, payload_bytes):
        """Up: floor(r n_i) rows of 3 pixel skewness + 3 pixel kurtosis floats; down: the others' rows."""
        return {"style_statistics": style_traffic(dim, optimisation_sizes, self.settings.upload_ratio,
                                                  pixel_floats=6, feature_floats_per_channel=0,
                                                  count=code_upload_count)}
