"""Settings blocks of the method families (``train.<family>``): each enters the run identity of its
own methods only (``fedhisto.stage_config.training_settings``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedhisto.config_base import Strict


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


class FedStainConfig(Strict):
    """The FedStain comparator (SPEC section 11). The paper sets alpha and beta by grid search and
    prints no values: the defaults weigh its two alignment terms like the study's v2 weighs its own
    (feature 0.10, JS 0.25), so neither method gets more auxiliary pull."""

    upload_ratio: float = Field(0.1, gt=0, le=1, description="r: fraction of local samples whose statistics are uploaded")
    weight_supcon: float = Field(0.10, ge=0, description="alpha: representation alignment (SupCon) weight")
    weight_js: float = Field(0.25, ge=0, description="beta: prediction alignment (JS over four views) weight")
    supcon_tau: float = Field(0.1, gt=0)
    mixstyle_alpha: float = Field(0.1, gt=0, description="lambda ~ Beta(alpha, alpha) in MixStyle")
    mixstyle_after_layer: int = Field(0, ge=0, description="encoder block whose output tokens MixStyle restyles")
    augmix_width: int = Field(3, ge=1)
    augmix_depth: int = Field(3, ge=1)
    # ablation switches: a switched-off augmentation leaves its view(s) as the plain view X
    randstain: bool = True
    augmix: bool = True
    mixstyle: bool = True
    protocol: Literal["study", "paper"] = Field(
        "study", description="study: the study's optimiser/lr/epochs/batch; paper: FedStain's own (paper_* keys)")
    paper_lr: float = Field(1e-4, gt=0)
    paper_lr_end: float = Field(2.5e-6, gt=0)
    paper_local_epochs: int = Field(3, ge=1)
    paper_batch: int = Field(32, ge=2)


class FedStainCodeConfig(Strict):
    """FedStain as its authors' public code runs it (docs/fedstain.md): pixel skewness/kurtosis, a 0.1 x
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
