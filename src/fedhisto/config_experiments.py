"""Settings of the controlled experiments (``experiments:``, ``snakemake experiments``).

The study's configuration never reads this block: it only decides which extra runs and analyses
``results/experiments/<name>/`` holds. Designs and their reasons: ``docs/experiments.md``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedhisto.config_base import Strict
from fedhisto.registry import Method

ClientName = Literal["C1", "C2", "C3", "C4", "C5"]
FamilyPolicy = Literal["ignore_families", "representatives", "whole_families"]


class DoseResponseConfig(Strict):
    """External cohort rendered at several stain/scanner shift severities, crossed with the tiny
    encoder's stain invariance (pretrained with or without stain-perturbed views)."""

    severities: list[float] = Field(default_factory=lambda: [0.0, 0.5, 1.0, 1.5, 2.0], min_length=2,
                                    description="0: the anchor client site's stain and scanner; 1: the external site")
    anchor_site: Literal["site1", "site2", "site3", "site4", "site5"] = "site1"
    images_per_class: int = Field(60, ge=5, description="per severity; the same tissue at every severity")
    seed: int = Field(4242, description="tissue seed of the shifted cohort (never the cohort's or the pool's)")
    encoders: list[Literal["stain_invariant", "plain"]] = Field(
        default_factory=lambda: ["stain_invariant", "plain"], min_length=1,
        description="stain_invariant: the pipeline's encoder; plain: pretrained without stain-perturbed views")

    @model_validator(mode="after")
    def _ordered(self) -> DoseResponseConfig:
        if sorted(set(self.severities)) != list(self.severities) or min(self.severities) < 0:
            raise ValueError(f"severities must be distinct, ascending and >= 0 (got {self.severities})")
        return self


class LeakageConfig(Strict):
    """The same methods and seeds on splits that ignore, thin or keep augmentation families."""

    policies: list[FamilyPolicy] = Field(
        default_factory=lambda: ["ignore_families", "representatives", "whole_families"], min_length=2)
    methods: list[Method] = Field(default_factory=lambda: ["fedavg_peft", "past_v2"], min_length=1)

    @model_validator(mode="after")
    def _has_leaky_and_clean(self) -> LeakageConfig:
        if "ignore_families" not in self.policies or len(self.policies) < 2:
            raise ValueError("experiments.leakage.policies needs 'ignore_families' and at least one clean policy")
        return self


class LeaveOneSiteOutConfig(Strict):
    """FedStain's domain-generalisation protocol: train on four clients, test on the fifth's images."""

    left_out: list[ClientName] = Field(default_factory=lambda: ["C1", "C2", "C3", "C4", "C5"], min_length=1)
    extra_methods: list[Method] = Field(default_factory=lambda: ["fedstain_code"],
                                     description="trained beside experiments.methods (FedStain's own protocol)")
    seeds: list[int] = Field(default_factory=lambda: [11], min_length=1)


class CalibrationConfig(Strict):
    """Temperature scaling fitted per checkpoint on its validation predictions."""

    bins: int = Field(15, ge=2, description="reliability-diagram and ECE bins")


class ExperimentsConfig(Strict):
    methods: list[Method] = Field(
        default_factory=lambda: ["fedavg_peft", "fedprox_peft", "past_v1", "past_v2", "fedstain"], min_length=1,
        description="principal methods compared in every experiment (v2 and FedAvg-PEFT are required)")
    seeds: list[int] = Field(default_factory=lambda: [11, 22, 33], min_length=1,
                             description="seeds of the retrained conditions (dose-response plain encoder, leakage)")
    resamples: int = Field(1000, ge=100, description="bootstrap resamples of every experiment interval")
    bootstrap_seed: int = 20261201
    dose_response: DoseResponseConfig = DoseResponseConfig()
    leakage: LeakageConfig = LeakageConfig()
    leave_one_site_out: LeaveOneSiteOutConfig = LeaveOneSiteOutConfig()
    calibration: CalibrationConfig = CalibrationConfig()

    @model_validator(mode="after")
    def _principal(self) -> ExperimentsConfig:
        missing = {"fedavg_peft", "past_v2"} - set(self.methods)
        if missing:
            raise ValueError(f"experiments.methods must include {sorted(missing)}: every experiment reports "
                             "the v2-vs-FedAvg-PEFT difference")
        return self
