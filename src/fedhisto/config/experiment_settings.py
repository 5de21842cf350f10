"""Settings of the controlled experiments (``experiments:``, ``snakemake experiments``).

The study's configuration never reads this block: it only decides which extra runs and analyses
``results/experiments/<name>/`` holds. Designs and their reasons: ``docs/experiments.md``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fedhisto.config.model_settings import EncoderConfig
from fedhisto.infra.settings_base import Strict
from fedhisto.registries.method_registry import Method

ClientName = Literal["C1", "C2", "C3", "C4", "C5"]
FamilyPolicy = Literal["ignore_families", "representatives", "whole_families"]


TINY_ENCODERS = ("stain_invariant", "plain")


class DoseEncoder(Strict):
    """Another frozen encoder crossed with the shift severities: its condition retrains every principal
    method with ``model.encoder`` set to this entry of the encoder registry (its local folder or
    pinned hub revision), at its registry input size unless ``crop_size`` says otherwise, normalised
    as ``normalisation`` says. ``label`` names the condition's folder
    (``results/experiments/dose_response/<label>/``)."""

    label: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", description="condition folder name")
    name: str = Field(description="an encoder registry entry (model.encoder.name accepts it)")
    local_dir: str | None = Field(None, description="load from this folder instead of the hub")
    repo_id: str | None = Field(None, description="hub repository (default: the registry entry's)")
    revision: str | None = Field(None, description="pinned hub revision (default: the registry entry's)")
    crop_size: int | None = Field(None, ge=8, description="input size (default: the registry entry's)")
    normalisation: Literal["imagenet", "encoder"] = Field(
        "imagenet", description="imagenet: views.mean / views.std; encoder: the registry entry's statistics")

    def encoder_config(self):
        """This entry as ``model.encoder`` (validated there: an unknown name lists the known ones)."""
        given = {"repo_id": self.repo_id, "revision": self.revision}
        return EncoderConfig(name=self.name, local_dir=self.local_dir, **{k: v for k, v in given.items() if v})

    @model_validator(mode="after")
    def _known(self) -> DoseEncoder:
        if self.label in TINY_ENCODERS:
            raise ValueError(f"label {self.label!r} is the name of a built-in condition; pick another")
        self.encoder_config()
        return self


class DoseResponseConfig(Strict):
    """External cohort rendered at several stain/scanner shift severities, crossed with the tiny
    encoder's stain invariance (pretrained with or without stain-perturbed views)."""

    severities: list[float] = Field(default_factory=lambda: [0.0, 0.5, 1.0, 1.5, 2.0], min_length=2,
                                    description="0: the anchor client site's stain and scanner; 1: the external site")
    anchor_site: Literal["site1", "site2", "site3", "site4", "site5"] = "site1"
    images_per_class: int = Field(60, ge=5, description="per severity; the same tissue at every severity")
    seed: int = Field(4242, description="tissue seed of the shifted cohort (never the cohort's or the pool's)")
    encoders: list[Literal["stain_invariant", "plain"] | DoseEncoder] = Field(
        default_factory=lambda: ["stain_invariant", "plain"], min_length=1,
        description="stain_invariant: the pipeline's encoder; plain: pretrained without stain-perturbed views; "
                    "{label, name, local_dir, ...}: any registry encoder (all methods retrained on it)")

    extra_methods: list[Method] = Field(
        default_factory=lambda: ["fedavg_peft_stain"],
        description="trained beside experiments.methods in this experiment only (issue 23: fedavg_peft_stain, the "
                    "stain-augmented FedAvg arm, answers 'paired consistency, or just augmentation?')")

    @model_validator(mode="after")
    def _ordered(self) -> DoseResponseConfig:
        if sorted(set(self.severities)) != list(self.severities) or min(self.severities) < 0:
            raise ValueError(f"severities must be distinct, ascending and >= 0 (got {self.severities})")
        labels = self.labels()
        if len(set(labels)) != len(labels):
            raise ValueError(f"experiments.dose_response.encoders: labels must be distinct (got {labels})")
        return self

    def labels(self) -> list[str]:
        """Condition names in order: the built-in ones as given, an entry by its label."""
        return [e if isinstance(e, str) else e.label for e in self.encoders]

    def entry(self, label: str) -> DoseEncoder | None:
        """The entry of a condition (None for the built-in tiny conditions)."""
        return next((e for e in self.encoders if not isinstance(e, str) and e.label == label), None)


class ProbeConfig(Strict):
    """Stain-sensitivity probe of each dose-response encoder on the shifted cohort's tissues."""

    seed: int = Field(5151, description="seed of the two stain draws per image")


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


class PrivacyAuditConfig(Strict):
    """Membership-inference audit of one site's returned adapters, without DP and at several DP noise levels
    (docs/experiments.md, docs/privacy.md). The other DP settings of the audited runs are these, not
    ``privacy:`` (which configures the main runs)."""

    methods: list[Method] = Field(default_factory=lambda: ["fedavg_peft", "past_v2"], min_length=1,
                                  description="audited methods (v2 under DP releases noised prototypes)")
    noise_multipliers: list[float] = Field(default_factory=lambda: [0.6, 1.0, 2.0], min_length=1,
                                           description="DP conditions, beside the non-private one")
    sites: list[ClientName] = Field(default_factory=lambda: ["C1", "C2", "C3", "C4", "C5"], min_length=1,
                                    description="audited sites: each has its canaries, scored on its returned states")
    canaries_per_side: int = Field(8, ge=2, description="per audited site: members and as many non-members, "
                                                        "one per family")
    rounds: int = Field(2, ge=1, description="rounds of each audited federation")
    seed: int = Field(11, description="run seed of the audited federations and of the canary draw")
    sample_rate: float = Field(0.1, gt=0, le=1, description="q of the DP conditions")
    clip_norm: float = Field(1.0, gt=0, description="C of the DP conditions")
    delta: float = Field(1e-4, gt=0, lt=1, description="delta of the reported epsilons (below 1 / the site's units)")

    @model_validator(mode="after")
    def _distinct(self) -> PrivacyAuditConfig:
        if sorted(set(self.noise_multipliers)) != sorted(self.noise_multipliers) or min(self.noise_multipliers) <= 0:
            raise ValueError(f"noise_multipliers must be distinct and > 0 (got {self.noise_multipliers})")
        return self


#: The readings the sensitivity experiment retrains under by default, one open choice each (issue 23);
#: each maps dotted config keys to the reading's values (the pipeline's own reading is the baseline).
DEFAULT_READINGS: dict[str, dict[str, Any]] = {
    "ce_class_mean": {"train.readings.ce_weight_normalisation": "class_mean"},
    "ce_weighted_mean": {"train.readings.ce_reduction": "weighted_mean"},
    "ce_views_sum": {"train.readings.ce_views": "sum"},
    "adaptive_delta_w": {"train.readings.adaptive_on": "delta_w"},
    "film_tanh": {"model.film_bound": "tanh"},
    # HIBOU-B's own input statistics in place of ImageNet's (the tiny encoder was pretrained under ImageNet's)
    "hibou_statistics": {"views.mean": [0.7068, 0.5755, 0.722], "views.std": [0.195, 0.2316, 0.1816]},
    # FedStain's MixStyle on the tokens after the tiny encoder's last block (2 of 0-2) instead of block 0
    "mixstyle_last_block": {"train.fedstain.mixstyle_after_layer": 2},
    # each client's AdamW moments and step count kept from one round's local training to the next
    "adamw_kept": {"train.readings.optimizer_state": "kept"},
}
READING_ROOTS = ("train.readings.", "model.film_bound", "views.normalisation", "views.mean", "views.std",
                 "train.fedstain.", "train.fedstain_code.")


class SensitivityConfig(Strict):
    """Which headline conclusions survive every reading of the study's unstated choices: each reading
    retrained one at a time against one shared baseline (the pipeline's own readings), on the
    embedded default (external cohort) and on the dose-response plain-encoder cohort at ``severity``."""

    conclusions: list[tuple[Method, Method]] = Field(
        default_factory=lambda: [("past_v2", "fedavg_peft"), ("past_v2", "v2_no_js"), ("past_v2", "fedstain")],
        min_length=1, description="(method, reference) paired macro-F1 differences whose sign and CI are checked")
    readings: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {k: dict(v) for k, v in DEFAULT_READINGS.items()}, min_length=1,
        description="name -> {dotted config key: value}, each key under " + ", ".join(READING_ROOTS))
    encoders: list[Literal["stain_invariant", "plain"]] = Field(
        default_factory=lambda: ["stain_invariant", "plain"], min_length=1,
        description="stain_invariant: the embedded default (main runs, external cohort); plain: the dose-response "
                    "plain-encoder runs on the shifted cohort at `severity`")
    severity: float | None = Field(None, ge=0, description="shifted-cohort severity of the plain-encoder condition, "
                                   "one of experiments.dose_response.severities; unset: the largest")
    seeds: list[int] = Field(default_factory=lambda: [11], min_length=1,
                             description="seeds of every reading's runs (few: the readings are many)")

    @model_validator(mode="after")
    def _named(self) -> SensitivityConfig:
        for name, keys in self.readings.items():
            if not name.replace("_", "").isalnum() or not name.islower() or name == "baseline":
                raise ValueError(f"experiments.sensitivity.readings: name {name!r} must be lower-case letters, "
                                 "digits and underscores, and not 'baseline' (the shared reference)")
            bad = [k for k in keys if not k.startswith(READING_ROOTS)] or ([] if keys else ["(none)"])
            if bad:
                raise ValueError(f"experiments.sensitivity.readings.{name}: key {bad[0]!r} is not a reading; "
                                 f"readings set keys under {', '.join(READING_ROOTS)}")
        return self

    def methods(self) -> list[str]:
        return list(dict.fromkeys(m for pair in self.conclusions for m in pair))


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
    probe: ProbeConfig = ProbeConfig()
    sensitivity: SensitivityConfig = SensitivityConfig()
    privacy_audit: PrivacyAuditConfig = PrivacyAuditConfig()

    @model_validator(mode="after")
    def _principal(self) -> ExperimentsConfig:
        missing = {"fedavg_peft", "past_v2"} - set(self.methods)
        if missing:
            raise ValueError(f"experiments.methods must include {sorted(missing)}: every experiment reports "
                             "the v2-vs-FedAvg-PEFT difference")
        sens, severities = self.sensitivity, self.dose_response.severities
        if sens.severity is None:  # resolved here so every reader (summary, figure, provenance) sees one number
            sens = sens.model_copy(update={"severity": float(max(severities))})  # a copy: defaults are shared
            object.__setattr__(self, "sensitivity", sens)
        if "plain" in sens.encoders and sens.severity not in severities:  # caught here, not after the training
            raise ValueError(f"experiments.sensitivity.severity {sens.severity} is not one of "
                             f"experiments.dose_response.severities {severities}: its plain-encoder condition "
                             "is scored on the dose-response cohort at that severity")
        return self
