"""Configuration blocks of the data-side stages (cohort, clearance, manifest, stain, views), re-exported
by ``fedhisto.config.study``, which composes them with the model, training and evaluation blocks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fedhisto.infra.settings_base import IF_CHANGED, Strict, unless

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
    profile: Literal["small", "small_eval", "paper", "tiny"] = "small"
    seed: int = 20261130
    image_size: int = Field(128, ge=64, le=1024, description="internal tile edge in pixels")
    external_image_size: int = Field(160, ge=64, le=2048, description="external tile edge (scanner differs)")
    external_severity: float = Field(
        1.0, ge=0, le=3, json_schema_extra=unless(1.0),
        description="the external site's stain chemistry and scanner on the dose-response line from site1 (0) "
                    "through the external site (1), extrapolated beyond it (fedhisto.synth.stain_styles.style_at)")
    external_grades: list[Literal["well", "moderately", "poorly"]] = Field(
        default_factory=lambda: ["well", "moderately", "poorly"], min_length=1,
        json_schema_extra=unless(["well", "moderately", "poorly"]),
        description="differentiation grades the external ACA and SCC images cycle through (then shuffled); "
                    "poorly differentiated ACA loses its glands and looks like SCC's solid nests")
    external_magnifications: list[Literal["20x", "40x"]] = Field(
        default_factory=lambda: ["20x", "40x"], min_length=1, json_schema_extra=unless(["20x", "40x"]),
        description="magnifications the external images cycle through (then shuffled); 40x shows fewer, "
                    "larger structures per tile than any internal image")
    external_per_class: tuple[int, int, int] | None = Field(
        None, json_schema_extra=IF_CHANGED,
        description="external images per class (ACA, Normal, SCC); null: the profile's. The planted copies are "
                    "drawn after the external plan from one stream, so another size also re-draws them")
    planted: PlantedFamilies = PlantedFamilies()

    @field_validator("external_per_class")
    @classmethod
    def _positive(cls, v: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if v is not None and min(v) < 1:
            raise ValueError(f"external_per_class needs at least one image per class (got {list(v)})")
        return v


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

    metadata: str | None = Field(
        None, description="kind lunghist700 only: the dataset's metadata table (CSV with patient_id and image_id "
                          "columns); a relative path is taken from root. Given, a patient's images stay in one "
                          "partition and the bootstrap also resamples patients")

    @model_validator(mode="after")
    def _relpath_root_only_for_csv(self) -> SourceSpec:
        if self.relpath_root is not None and self.kind != "csv":
            raise ValueError(f"relpath_root applies only to kind csv (this source is kind {self.kind!r})")
        if self.metadata is not None and self.kind != "lunghist700":
            raise ValueError(f"metadata applies only to kind lunghist700 (this source is kind {self.kind!r}); a csv "
                             "source gives patients in a 'patient' column, WSSS4LUAD names carry their slide")
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
    # on by default (a behaviour change, so both keys always enter clearance's identity)
    link_min_inliers: int | None = Field(
        5, ge=4, description="second pass (null: off): link two detected families when their closest members "
                             "nearly verify, i.e. reach this many inliers at a plausible scale "
                             "(5 x 3 chosen by measurement: docs/data.md)")
    link_min_pairs: int = Field(3, ge=1, description="second pass: near-miss cross pairs, between distinct pictures, "
                                                     "that link two families (a cross pair verifying outright always "
                                                     "links)")
    family_policy: Literal["representatives", "whole_families", "ignore_families"] = "representatives"
    zoom_views: list[float] = Field(
        default_factory=list,
        description="candidate source for relatives at another zoom: visual words of each image's central crop "
                    "zoomed by these factors (each in (1, 2.5]) are compared with the other images' words; "
                    "[] (default): off. The study config uses [1.6] for LC25000's crop-and-zoom, whose "
                    "relatives are up to ~1.9x apart (docs/data.md)")

    @model_validator(mode="after")
    def _zoom_views_in_range(self) -> ClearanceConfig:
        for z in self.zoom_views:
            if not (1.0 < z <= 2.5):
                raise ValueError(f"clearance.zoom_views: {z} is not a zoom factor in (1, 2.5] (the scale range a "
                                 "confirmation accepts is 0.4-2.5)")
        if len(set(self.zoom_views)) != len(self.zoom_views):
            raise ValueError(f"clearance.zoom_views: {self.zoom_views} lists a factor twice")
        return self

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
    holdouts: dict[ClientName, Counts] | None = Field(
        None, json_schema_extra=IF_CHANGED,
        description="holdout images per client and class, drawn from its pool (the rest is its optimisation set); "
                    "null: manifest.holdout_fraction of each pool, as the study draws them")

    @model_validator(mode="after")
    def _holdouts_fit_their_pools(self) -> PartitionTargets:
        if self.holdouts is None:
            return self
        if set(self.holdouts) != set(self.clients):
            raise ValueError(f"targets.holdouts names clients {sorted(self.holdouts)}, targets.clients "
                             f"{sorted(self.clients)}: give every client's holdout, or none (holdout_fraction)")
        for client, hold in self.holdouts.items():
            for cls, h, n in zip(("ACA", "Normal", "SCC"), hold, self.clients[client], strict=True):
                if h < 0 or h > max(n - 1, 0):
                    raise ValueError(f"targets.holdouts.{client} {cls}: {h} of a pool of {n} (a holdout leaves at "
                                     "least one optimisation image of a class the pool has)")
        return self


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
        False, json_schema_extra=IF_CHANGED,
        description="draw global validation and test per class in proportion to the sources (site tags) of that "
                    "class's leftover images, rather than from all leftovers in one seeded order")

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
    eval_resize: Literal["squash", "keep_aspect"] = Field(
        "squash", json_schema_extra=IF_CHANGED, description="evaluation input: squash (the study's 'whole-image resize' "
        "read literally: both sides to crop_size, aspect ratio changed) | keep_aspect ([ours] shorter side to crop_size, "
        "then the centre crop_size square: tissue keeps its shape, the longer side's edges are dropped)")
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    normalisation: Literal["imagenet", "encoder"] = Field(
        "imagenet", json_schema_extra=IF_CHANGED, description="[ours] imagenet: normalise with views.mean / views.std (ImageNet's statistics "
                                "unless set; the study, section 3.4); encoder: with the encoder's own statistics "
                                "from its registry entry (e.g. HIBOU's processor), which then fill mean and std")
