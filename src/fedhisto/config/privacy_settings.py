"""Settings of differentially private local training (``privacy:``; default off, see docs/privacy.md).

Off (the default) changes nothing: no stage block, run identity or result depends on this block.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedhisto.infra.settings_base import IF_CHANGED, Strict


class PrivacyConfig(Strict):
    enabled: bool = Field(False, description="[ours] DP-SGD for the trainable state, accounted per site")
    unit: Literal["image", "family"] = Field(
        "image", description="privacy unit: one image with all its views, or one clearance family (all its images)")
    noise_multiplier: float = Field(1.0, gt=0, description="sigma: Gaussian noise std over the clip norm")
    prototype_noise_multiplier: float | None = Field(
        None, gt=0, json_schema_extra=IF_CHANGED, description="sigma of the prototype release (privacy.prototypes: noised), accounted as its own "
                                "Gaussian mechanism; none: privacy.noise_multiplier")
    class_counts: Literal["public"] = Field(
        "public", json_schema_extra=IF_CHANGED, description="a site's per-class image counts, from which its class-balanced CE weights come: "
                              "public (not protected; the guarantee is stated given them, docs/privacy.md)")
    clip_norm: float = Field(1.0, gt=0, description="C: each unit's gradient is clipped to this L2 norm")
    sample_rate: float = Field(0.05, gt=0, le=1, description="q: Poisson probability of each unit per logical step")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) reported; below 1/units per site")
    target_epsilon: float | None = Field(None, gt=0, description="per-site budget; none: report epsilon only")
    on_budget: Literal["refuse", "stop"] = Field(
        "stop", description="refuse: refuse a plan whose rounds would exceed the budget; stop: stop before the "
                            "first round that would (a single round over it is refused either way)")
    dropout: Literal["per_sample", "off"] = Field(
        "per_sample", description="dropout under DP: independent masks per image and view, or off")
    micro_batch: int = Field(8, ge=1, description="images per micro-batch (memory only; the logical batch is Poisson)")
    noise_seed: Literal["secret", "run"] = Field(
        "secret", description="secret: OS entropy, kept in the site's checkpoint; run: from the run seed (research "
                              "only: a coordinator who knows it can regenerate and subtract the noise)")
    prototypes: Literal["refuse", "noised"] = Field(
        "refuse", description="v1/v2 prototype uploads under DP: refuse the method, or release them through the "
                              "Gaussian mechanism at privacy.prototype_noise_multiplier (accounted)")

    @model_validator(mode="after")
    def _budget_only_when_enabled(self) -> PrivacyConfig:
        if not self.enabled and self.target_epsilon is not None:
            raise ValueError("privacy.target_epsilon is set but privacy.enabled is false: nothing would enforce it")
        if not self.enabled and self.prototype_noise_multiplier is not None:
            raise ValueError("privacy.prototype_noise_multiplier is set but privacy.enabled is false: nothing would "
                             "use it")
        return self


class SecureAggregationConfig(Strict):
    """Secure aggregation (``secure_aggregation:``; default off, docs/federation.md): the server receives only
    weighted sums of the sites' contributions, masked by Flower's SecAgg+ on a real federation and computed
    without masks, with the same quantisation, in process. Off changes nothing (no stage block or identity)."""

    enabled: bool = Field(False, description="[ours] the server step receives only masked sums (methods that "
                                             "cannot are refused by name)")
    clipping_range: float = Field(8.0, gt=0, description="c: each weighted value must lie in [-c, c] (a site "
                                                         "refuses otherwise); Flower's default")
    quantization_levels: int = Field(2 ** 28, ge=2, description="integer steps over [-c, c] (precision 2c / levels "
                                                                 "per value and site); sites x levels must stay "
                                                                 "below the field size 2^32")
    num_shares: float = Field(1.0, gt=0, le=1, description="Flower SecAgg+: the fraction of the round's sites each "
                                                          "site shares its keys with (1: every site)")
    reconstruction_threshold: float = Field(0.6, gt=0, le=1, description="Flower SecAgg+: the fraction of a site's "
                                                                         "shares that rebuild its keys; a masked "
                                                                         "sum survives shares - threshold dropouts")
