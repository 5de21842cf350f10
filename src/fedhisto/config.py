"""Typed configuration: one strict model per pipeline stage.

Every block rejects unknown keys (``extra="forbid"``) and every error names the dotted key,
the offending value and what is allowed. Defaults are the study's numbers (``SPEC.md``);
``config/config.yaml`` overrides them for the small embedded default.

The JSON schema in ``workflow/schemas/config.schema.json`` is generated from these models
(``fedhisto schema``) and a test keeps the two identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from fedhisto import CLASSES
from fedhisto.config_base import ConfigError, Method, Strict
from fedhisto.config_experiments import ExperimentsConfig
from fedhisto.config_methods import FedStainCodeConfig, FedStainConfig, PastConfig

ClassName = Literal["ACA", "Normal", "SCC"]
ClientName = Literal["C1", "C2", "C3", "C4", "C5"]
Counts = tuple[int, int, int]  # ordered ACA / Normal / SCC


# --------------------------------------------------------------------- cohort
class PlantedFamilies(Strict):
    """Surplus transformed copies planted so that clearance can be scored."""

    families_per_site: int = Field(6, ge=0, description="families planted per source site")
    copies_per_family: tuple[int, int] = Field((1, 3), description="inclusive range of copies per family")
    transforms: list[
        Literal["exact", "jpeg", "resize", "dihedral", "rotate_zoom", "crop", "stain_shift"]
    ] = Field(
        default_factory=lambda: ["exact", "jpeg", "resize", "dihedral", "rotate_zoom", "crop", "stain_shift"],
        min_length=1,
    )
    max_rotation_deg: float = Field(25.0, gt=0, le=45, description="LC25000 rotates by up to 25 degrees")
    cross_site_probability: float = Field(0.7, ge=0, le=1, description="chance a copy is filed under another site")


class SyntheticCohort(Strict):
    profile: Literal["small", "paper"] = "small"
    seed: int = 20261130
    image_size: int = Field(128, ge=64, le=1024, description="internal tile edge in pixels")
    external_image_size: int = Field(160, ge=64, le=2048, description="external tile edge (scanner differs)")
    planted: PlantedFamilies = PlantedFamilies()


class SourceSpec(Strict):
    kind: Literal["lc25000", "wsss4luad", "lunghist700", "csv"]
    root: str = Field(description="dataset folder (for kind csv: the CSV file)")
    cohort: Literal["internal", "external"] = "internal"
    site: str | None = Field(None, description="site tag; defaults to the dataset kind")
    unmapped: Literal["exclude", "error"] = Field(
        "exclude", description="WSSS4LUAD tiles whose label vector maps to no class: record and exclude, or stop"
    )
    relpath_root: str | None = Field(
        None, description="kind csv only: folder the portable relpath of every row is taken from (default: the "
                          "CSV's own folder); set it when rows give paths outside that folder, e.g. absolute ones")

    @model_validator(mode="after")
    def _relpath_root_only_for_csv(self) -> SourceSpec:
        if self.relpath_root is not None and self.kind != "csv":
            raise ValueError(f"relpath_root applies only to kind csv (this source is kind {self.kind!r})")
        return self


class RealCohort(Strict):
    sources: list[SourceSpec] = Field(default_factory=list)


class CohortConfig(Strict):
    mode: Literal["synthetic", "real"] = "synthetic"
    synthetic: SyntheticCohort = SyntheticCohort()
    real: RealCohort = RealCohort()

    @model_validator(mode="after")
    def _real_needs_sources(self) -> CohortConfig:
        if self.mode == "real" and not self.real.sources:
            raise ValueError("cohort.mode is 'real' but cohort.real.sources is empty; list at least one source")
        return self


# ------------------------------------------------------------------ clearance
class ClearanceConfig(Strict):
    phash_threshold: int = Field(10, ge=0, le=64, description="imagededup default: Hamming <= 10 of 64 bits")
    dihedral_invariant: bool = True
    neighbours_per_image: int = Field(12, ge=1, description="candidates proposed per image (scales with corpus)")
    detector: Literal["sift", "orb"] = "sift"
    n_features: int = Field(400, ge=50, description="keypoints per image for local-feature verification")
    ratio_test: float = Field(0.75, gt=0, lt=1)
    min_inliers: int = Field(10, ge=4, description="RANSAC inliers that confirm a pair (unrelated tissue: <= 5)")
    link_min_inliers: int | None = Field(
        5, ge=4, description="second pass (null: off): link two detected families when their closest members "
                             "nearly verify, i.e. reach this many inliers at a plausible scale "
                             "(5 x 3 chosen by measurement: docs/clearance_benchmark.md)")
    link_min_pairs: int = Field(3, ge=1, description="second pass: near-miss cross pairs, between distinct pictures, "
                                                     "that link two families (a cross pair verifying outright always "
                                                     "links)")
    family_policy: Literal["representatives", "whole_families", "ignore_families"] = "representatives"

    def identity_block(self) -> dict:
        """What clearance's outputs depend on; the second pass enters only when on, so clearance
        blocks and provenance written before it existed keep their hash."""
        off = {"link_min_inliers", "link_min_pairs"} if self.link_min_inliers is None else set()
        return self.model_dump(mode="json", exclude=off)

    @model_validator(mode="after")
    def _link_below_confirmation(self) -> ClearanceConfig:
        if self.link_min_inliers is not None and self.link_min_inliers > self.min_inliers:
            raise ValueError(f"clearance.link_min_inliers ({self.link_min_inliers}) must not exceed "
                             f"clearance.min_inliers ({self.min_inliers}): it relaxes the threshold between families")
        return self


# ------------------------------------------------------------------- manifest
class PartitionTargets(Strict):
    """Image counts per partition, ordered ACA / Normal / SCC (study Table 2 by default)."""

    clients: dict[ClientName, Counts] = Field(
        default_factory=lambda: {"C1": (229, 208, 293), "C2": (485, 439, 65), "C3": (187, 172, 318),
                                 "C4": (64, 58, 553), "C5": (1181, 1831, 0)},
        description="pre-holdout pools")
    validation: Counts = (472, 474, 473)
    test: Counts = (473, 475, 472)


class ManifestConfig(Strict):
    split_seed: int = 2026
    holdout_fraction: dict[ClientName, float] = Field(
        default_factory=lambda: {"C1": 0.10, "C2": 0.10, "C3": 0.10, "C4": 0.10, "C5": 0.15})
    client_sites: dict[ClientName, list[str]] = Field(
        default_factory=lambda: {f"C{k}": [f"site{k}"] for k in range(1, 6)},
        description="source sites each client's pool is drawn from (synthetic: site k feeds Ck)")
    targets: PartitionTargets | None = Field(
        None, description="partition counts; omit with the synthetic cohort to take its profile's")
    allow_scaling: bool = Field(
        False, description="when the kept images cannot fill the targets, scale every target by one common factor "
                           "(logged, recorded in manifest.json and beside the study's Table 2) instead of stopping")
    stratify_by_source: bool = Field(
        False, description="draw global validation and test per class in proportion to the sources (site tags) of "
                           "that class's leftover images, rather than from all leftovers in one seeded order")

    def identity_block(self) -> dict:
        """The manifest block; ``stratify_by_source`` enters only when on (old identities unchanged)."""
        return self.model_dump(mode="json", exclude=set() if self.stratify_by_source else {"stratify_by_source"})

    @model_validator(mode="after")
    def _fractions_valid(self) -> ManifestConfig:
        for client, frac in self.holdout_fraction.items():
            if not 0 < frac < 1:
                raise ValueError(f"manifest.holdout_fraction.{client} must lie in (0, 1), got {frac}")
        return self


# ---------------------------------------------------------------------- stain
class StainConfig(Strict):
    max_images_per_client: int = Field(128, ge=1)
    resize: int = Field(128, ge=16)
    od_background: float = Field(0.15, gt=0, description="a pixel is background when any OD channel is below this")
    min_tissue_pixels: int = Field(50, ge=1)
    od_reference_intensity: float = Field(240.0, gt=0, description="Macenko's Io: OD = -ln((I + 1) / Io)")
    percentile: float = Field(1.0, gt=0, lt=50, description="Macenko angle percentile (alpha)")
    he_min_cosine: float = Field(0.8, gt=0, le=1, description="below this cosine to reference H or E, flag as not H&E")


# ---------------------------------------------------------------------- views
class ViewsConfig(Strict):
    crop_size: int = 224
    crop_scale: tuple[float, float] = (0.85, 1.00)
    crop_ratio: tuple[float, float] = (0.90, 1.10)
    hflip_p: float = Field(0.5, ge=0, le=1)
    vflip_p: float = Field(0.2, ge=0, le=1)
    rotation_deg: float = Field(10.0, ge=0)
    od_noise_sd: float = Field(0.025, ge=0)
    od_diag_scale: tuple[float, float] = (0.78, 1.22)
    od_clip: float = Field(5.0, gt=0)
    brightness: tuple[float, float] = (0.92, 1.08)
    contrast: tuple[float, float] = (0.92, 1.08)
    single_view_stain: bool = Field(False, description="[ours] baselines and v1: shared geometry, no stain perturbation")
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)


# ---------------------------------------------------------------------- model
class EncoderConfig(Strict):
    name: Literal["hibou-b", "tiny"] = "hibou-b"
    repo_id: str = "histai/hibou-b"
    revision: str = "7fdc8cce365ebfd9e7e60e6e9a8d4d59388f3c"
    local_dir: str | None = Field(None, description="load from this folder instead of the hub")
    require_pretrained: bool = True


class PretrainConfig(Strict):
    """Pipeline pretraining of the tiny encoder (HIBOU-B arrives pretrained and is never retrained)."""

    enabled: bool = Field(False, description="pretrain the tiny encoder on a disjoint synthetic pool")
    images_per_class: int = Field(200, ge=10)
    epochs: int = Field(8, ge=1)
    lr: float = Field(1e-3, gt=0)
    batch: int = Field(32, ge=1)
    seed: int = Field(777, description="pool seed; the pool never overlaps the cohort (different seed stream)")
    stain_views: bool = Field(
        True, description="True: pretrain through stain-perturbed views (the pipeline's stain-invariant encoder); "
                          "False: geometry-only views (the 'plain' encoder of the stain-shift dose-response experiment)")


class ModelConfig(Strict):
    encoder: EncoderConfig = EncoderConfig()
    pretrain: PretrainConfig = PretrainConfig()
    lora_r: int = Field(8, ge=1)
    lora_alpha: float = Field(16, gt=0)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    lora_targets: list[Literal["query", "key", "value", "attention_output"]] = Field(
        default_factory=lambda: ["query", "key", "value", "attention_output"])
    adapter_hidden: int = Field(256, ge=1)
    adapter_dropout: float = Field(0.10, ge=0, lt=1)
    film_hidden: int = Field(64, ge=1)
    film_scale: float = Field(0.10, ge=0)


# ---------------------------------------------------------------------- train
# Each method family's settings block (train.past, train.fedstain, ...) lives in config_methods.



class TrainConfig(Strict):
    methods: list[Method] = Field(default_factory=lambda: ["fedavg_peft", "fedprox_peft", "film_zero", "past_v1", "past_v2"])
    ablations: list[Method] = Field(default_factory=lambda: ["v2_no_js", "v2_no_feat", "v2_no_proto"])
    seeds: list[int] = Field(default_factory=lambda: [11, 22, 33, 44, 55], min_length=1)
    ablation_seeds: list[int] = Field(default_factory=lambda: [11, 33, 55])
    max_rounds: int = Field(50, ge=1)
    local_epochs: int = Field(2, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    grad_clip: float = Field(5.0, gt=0)
    paired_micro_batch: int = Field(4, ge=1)
    accumulation_steps: int = Field(2, ge=1)
    single_view_batch: int = Field(8, ge=1)
    patience: int = Field(10, ge=1)
    min_delta: float = Field(1e-4, ge=0)
    cb_beta: float = Field(0.999, gt=0, lt=1)
    cb_cap: float = Field(4.0, gt=0)
    max_unavailable_client_rounds: int = Field(
        5, ge=0, description="declared client unavailabilities tolerated in a run before it counts as failed")
    engine: Literal["sequential", "batched"] = Field(
        "sequential", description="[ours] local training one client after the other, or every client of a round in "
                                  "one encoder pass (train.batched: same math, dropout masks drawn once for the stack)")
    view_pipeline: Literal["host", "device"] = Field(
        "host", description="[ours] training views made on the host, or on the device from uint8 images kept there "
                            "(fedhisto.views_device: same draws, pixels within interpolation rounding)")
    past: PastConfig = PastConfig()
    fedstain: FedStainConfig = FedStainConfig()
    fedstain_code: FedStainCodeConfig = FedStainCodeConfig()


# ------------------------------------------------------------------- evaluate
class EvaluateConfig(Strict):
    eval_batch: int = Field(32, ge=1)
    ece_bins: int = Field(15, ge=2)
    temperature_scaling: bool = Field(
        False, description="[ours] divide logits by a temperature fitted on each run's validation predictions "
                           "before writing test/holdout/external probabilities; off in the study")


class Comparison(Strict):
    method: Method
    reference: Method
    ablation: bool = False


def _paper_comparisons() -> dict[str, Comparison]:
    pairs = {"v2_vs_fedavg": "fedavg_peft", "v2_vs_fedprox": "fedprox_peft", "v2_vs_filmzero": "film_zero",
             "v2_vs_v1": "past_v1"}
    out = {name: Comparison(method="past_v2", reference=ref) for name, ref in pairs.items()}
    out["v2_vs_fedstain"] = Comparison(method="past_v2", reference="fedstain")  # ours: the added comparator
    out["v2_vs_fedstain_code"] = Comparison(method="past_v2", reference="fedstain_code")  # ours: as its code runs
    out["v2_vs_local"] = Comparison(method="past_v2", reference="local_only")  # ours: does federation help?
    out["v2_vs_pooled"] = Comparison(method="past_v2", reference="pooled")  # ours: centralised reference
    for abl in ("v2_no_js", "v2_no_feat", "v2_no_proto"):
        out[f"v2_vs_{abl.removeprefix('v2_')}"] = Comparison(method="past_v2", reference=abl, ablation=True)
    return out


class BootstrapConfig(Strict):
    seed: int = 20260730
    resamples: int = Field(10_000, ge=100)
    ablation_resamples: int = Field(5_000, ge=100)
    confidence: float = Field(0.95, gt=0, lt=1)
    comparisons: dict[str, Comparison] = Field(default_factory=_paper_comparisons)


# --------------------------------------------------------------------- root
class Config(Strict):
    classes: tuple[ClassName, ClassName, ClassName] = CLASSES  # type: ignore[assignment]
    cohort: CohortConfig = CohortConfig()
    clearance: ClearanceConfig = ClearanceConfig()
    manifest: ManifestConfig = ManifestConfig()
    stain: StainConfig = StainConfig()
    views: ViewsConfig = ViewsConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    experiments: ExperimentsConfig = ExperimentsConfig()

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.model.pretrain.enabled and self.model.encoder.name != "tiny":
            raise ValueError("model.pretrain.enabled only applies to the tiny encoder; HIBOU-B is loaded pretrained")
        if tuple(self.classes) != CLASSES:
            raise ValueError(f"classes must be exactly {list(CLASSES)} in that order (got {list(self.classes)})")
        if self.cohort.mode == "real" and self.manifest.targets is None:
            raise ValueError("manifest.targets is required when cohort.mode is 'real'")
        if self.cohort.mode == "synthetic" and self.manifest.targets is not None \
                and self.manifest.targets != self.profile_targets():
            raise ValueError(f"manifest.targets disagree with synthetic profile '{self.cohort.synthetic.profile}'; "
                             "omit manifest.targets to use the profile's counts")
        self._ablation_seeds_trained()
        return self

    def _ablation_seeds_trained(self) -> None:
        """An ablation comparison ensembles both methods on train.ablation_seeds (study Table 7:
        11/33/55), so each of its methods must be trained on every one of those seeds."""
        abl = list(self.train.ablation_seeds)
        for name in (n for n in self.trained_comparisons() if self.bootstrap.comparisons[n].ablation):
            comp = self.bootstrap.comparisons[name]
            for role, method in (("method", comp.method), ("reference", comp.reference)):
                missing = [s for s in abl if s not in self.trained_seeds(method)]
                if missing or not abl:
                    key = "train.seeds" if method in self.train.methods else "train.ablation_seeds"
                    raise ValueError(
                        f"bootstrap.comparisons.{name} (ablation: true) ensembles both methods on train.ablation_seeds "
                        f"{abl}; its {role} {method!r} trains on {key} {self.trained_seeds(method)}"
                        f"{f', which lacks {missing}' if missing else ''}. Make train.ablation_seeds a non-empty "
                        "subset of train.seeds")

    def trained_seeds(self, method: str) -> list[int]:
        """Seeds a method trains on: train.seeds for a principal method, else train.ablation_seeds."""
        return list(self.train.seeds if method in self.train.methods else self.train.ablation_seeds)

    def trained_comparisons(self) -> list[str]:
        """Configured comparisons whose two methods are both configured to train."""
        trained = set(self.train.methods) | set(self.train.ablations)
        return [n for n, c in self.bootstrap.comparisons.items() if c.method in trained and c.reference in trained]

    def comparison_seeds(self, name: str) -> tuple[list[int], list[int]]:
        """Seeds of the method's and the reference's ensembles in comparison ``name``.

        An ablation comparison uses train.ablation_seeds for both (matched seeds: full v2 enters
        as its 11/33/55 subset, as in study Table 7); any other uses each method's own seeds."""
        comp = self.bootstrap.comparisons[name]
        if comp.ablation:
            return list(self.train.ablation_seeds), list(self.train.ablation_seeds)
        return self.trained_seeds(comp.method), self.trained_seeds(comp.reference)

    def profile_targets(self) -> PartitionTargets:
        from fedhisto.synth.profiles import PROFILES

        p = PROFILES[self.cohort.synthetic.profile]
        return PartitionTargets(clients=p.clients, validation=p.validation, test=p.test)

    def partition_targets(self) -> PartitionTargets:
        """The counts the manifest stage builds to: configured, or the synthetic profile's."""
        return self.manifest.targets or self.profile_targets()


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names allowed at ``loc`` (walks nested models; empty when it cannot tell)."""
    current: Any = model
    for part in loc[:-1]:
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return []
        current = fields[part].annotation
    return sorted(getattr(current, "model_fields", {}))


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(Config, loc)
            hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
            lines.append(f"  unknown key '{key}'{hint}")
        else:
            got = err.get("input")
            got_txt = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  key '{key}': {err['msg']}{got_txt}")
    return "\n".join(lines)


def load_config(raw: dict[str, Any] | None, source: str = "config") -> Config:
    """Validate a raw mapping (e.g. Snakemake's ``config``) into a typed :class:`Config`."""
    try:
        return Config.model_validate(raw or {})
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def load_config_file(path: str | Path) -> Config:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(raw).__name__}")
    return load_config(raw, source=str(p))


def json_schema() -> dict[str, Any]:
    schema = Config.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["description"] = "fedhisto configuration (generated from fedhisto.config; edit the models, not this file)"
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
