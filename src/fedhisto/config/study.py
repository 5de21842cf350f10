"""Typed configuration: one strict model per pipeline stage.

Every block rejects unknown keys (``extra="forbid"``) and every error names the dotted key,
the offending value and what is allowed. Defaults are the study's numbers;
``config/config.yaml`` overrides them for the small embedded default.

The JSON schema in ``workflow/schemas/config.schema.json`` is generated from these models
(``fedhisto schema``) and a test keeps the two identical.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    create_model,
    model_validator,
)

from fedhisto import CLASSES
from fedhisto.config.classify_settings import ClassifyConfig
from fedhisto.config.data_settings import (  # noqa: F401 (re-exported: every stage imports its block from here)
    ClassName,
    ClearanceConfig,
    ClientName,
    CohortConfig,
    Counts,
    ManifestConfig,
    PartitionTargets,
    PlantedFamilies,
    RealCohort,
    SourceSpec,
    StainConfig,
    SyntheticCohort,
    ViewsConfig,
)
from fedhisto.config.model_settings import EncoderConfig, ModelConfig, PretrainConfig  # noqa: F401 (re-exported)
from fedhisto.config.privacy_settings import PrivacyConfig, SecureAggregationConfig
from fedhisto.config.readings import ReadingsConfig
from fedhisto.infra.settings_base import IF_CHANGED, ConfigError, Seeds, Strict, unless
from fedhisto.registries.encoder_registry import ENCODERS
from fedhisto.registries.method_registry import Method

# ---------------------------------------------------------------------- train
#: The study's principal methods: they always train on train.seeds. Any other entry of train.methods
#: (fedstain, fedstain_code, local_only, pooled, a method of your own) is an extra comparator, which
#: train.comparator_seeds may give fewer seeds.
STUDY_METHODS = ("fedavg_peft", "fedprox_peft", "film_zero", "past_v1", "past_v2")


class TrainBase(Strict):
    """Engine settings shared by every method; each method family's own block (``train.past``,
    ``train.fedstain``, ...) is added from the method registry (``TrainConfig`` below)."""

    methods: list[Method] = Field(default_factory=lambda: ["fedavg_peft", "fedprox_peft", "film_zero", "past_v1", "past_v2"])
    ablations: list[Method] = Field(default_factory=lambda: ["v2_no_js", "v2_no_feat", "v2_no_proto"])
    seeds: Seeds = Field(default_factory=lambda: [11, 22, 33, 44, 55], min_length=1)
    ablation_seeds: Seeds = Field(default_factory=lambda: [11, 33, 55])
    comparator_seeds: Seeds | None = Field(
        None, description="[ours] seeds of the train.methods that are not the study's principal five (fedstain, "
                          "fedstain_code, local_only, pooled, ...); a non-empty subset of train.seeds; null: train.seeds. "
                          "A comparison with such a method ensembles both arms on these seeds only (matched)")
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
        "batched", json_schema_extra=unless("sequential"),
        description="[ours] every client of a round in one encoder pass (train.batched: same math, dropout masks "
                    "drawn once for the stack; about 3x faster on CPU), or one client after the other (sequential: "
                    "the engine DP-SGD needs; the identity of runs made before batched became the default)")
    readings: ReadingsConfig = Field(
        default_factory=ReadingsConfig, json_schema_extra=IF_CHANGED,
        description="[ours] readings of the study's unstated training choices (sensitivity experiment; "
                    "fedhisto.config.readings); the defaults leave every run as it was")
    view_pipeline: Literal["host", "device"] = Field(
        "host", json_schema_extra=IF_CHANGED, description="[ours] training views made on the host, or on the device from uint8 images kept there "
                            "(fedhisto.data.device_views: same draws, pixels within interpolation rounding)")
    precision: Literal["auto", "float32", "bf16"] = Field(
        "auto", json_schema_extra=IF_CHANGED, description="[ours] local training's mixed precision: auto = bf16 autocast on "
                         "CUDA (the study's AMP on GPU) and float32 elsewhere; bf16 = bf16 autocast on any device; float32 = none")
    compile: bool = Field(
        False, json_schema_extra=IF_CHANGED, description="[ours] torch.compile the encoder pass of the batched engine "
                       "(train.engine: batched only; the same math up to kernel fusion rounding)")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="[ours] where every torch stage (training, prediction, experiments, classify) computes: "
                            "auto = the GPU the environment exposes, else the CPU, except that a job declaring a GPU "
                            "(Snakemake resource gpu) stops, naming why no GPU is usable; cuda = a GPU or stop; "
                            "cpu = the CPU, also in a job that declares a GPU. Where a run computes, not what: "
                            "not part of any run's identity")
    view_workers: int | None = Field(
        None, ge=0, description="[ours] threads that make the next steps' host views while the device runs the step "
                                "(fedhisto.train.view_workers; batched engine, default host views): null = on CUDA one "
                                "per CPU the job may use less one, none on a CPU; 0 = off. The same pixels either "
                                "way: not part of any run's identity")

    @model_validator(mode="after")
    def _compile_needs_the_batched_engine(self) -> TrainBase:
        if self.compile and self.engine != "batched":  # never silently ignored under the sequential engine
            raise ValueError(f"train.compile compiles the batched engine's encoder pass, but train.engine is "
                             f"{self.engine!r}; set train.engine: batched (or train.compile: false)")
        if self.view_workers and (self.engine != "batched" or self.view_pipeline != "host"):  # nor are these
            raise ValueError(f"train.view_workers: {self.view_workers} makes the batched engine's host views ahead, "
                             f"but train.engine is {self.engine!r} and train.view_pipeline {self.view_pipeline!r}; "
                             "set train.view_workers: null (or 0)")
        return self


def _train_config() -> type[TrainBase]:
    """``TrainBase`` plus one field per registered method family, typed by its settings class (read
    from the package's settings schema, so no method module is imported: ``methods.settings``)."""
    from fedhisto.registries.method_registry import block_models, settings_blocks

    blocks = {key: (model, model()) for key, model in block_models(settings_blocks()).items()}
    return create_model("TrainConfig", __base__=TrainBase, __doc__=TrainBase.__doc__, **blocks)


TrainConfig = _train_config()


# ------------------------------------------------------------------- evaluate
class EvaluateConfig(Strict):
    eval_batch: int = Field(32, ge=1)
    ece_bins: int = Field(15, ge=2)
    temperature_scaling: bool = Field(
        False, json_schema_extra=IF_CHANGED, description="[ours] divide logits by a temperature fitted on each run's validation predictions "
                           "before writing test/holdout/external probabilities; off in the study")


class Comparison(Strict):
    method: Method
    reference: Method
    ablation: bool = False


def _paper_comparisons() -> dict[str, Comparison]:
    pairs = {"v2_vs_fedavg": "fedavg_peft", "v2_vs_fedprox": "fedprox_peft", "v2_vs_filmzero": "film_zero",
             "v2_vs_v1": "past_v1"}
    from fedhisto.registries.method_registry import default_comparisons

    # the study's four, then ours: each method registered with a comparison (FedStain, local_only, pooled, ...)
    pairs.update(default_comparisons())
    out = {name: Comparison(method="past_v2", reference=ref) for name, ref in pairs.items()}
    for abl in ("v2_no_js", "v2_no_feat", "v2_no_proto"):
        out[f"v2_vs_{abl.removeprefix('v2_')}"] = Comparison(method="past_v2", reference=abl, ablation=True)
    return out


class BootstrapConfig(Strict):
    seed: int = 20260730
    resamples: int = Field(10_000, ge=100)
    ablation_resamples: int = Field(5_000, ge=100)
    confidence: float = Field(0.95, gt=0, lt=1)
    comparisons: dict[str, Comparison] = Field(default_factory=_paper_comparisons)


# ---------------------------------------------------------------- experiments
def _experiments(value: Any) -> Any:
    """``experiments:`` validated by the experiment registry's model (shared settings plus one block per
    registered experiment, :mod:`fedhisto.registries.experiment_registry`). Built on first use, not at import: the
    experiment modules import this module."""
    from fedhisto.registries.experiment_registry import experiments_settings

    return experiments_settings(value)


def _default_experiments() -> Any:
    return _experiments({})


#: The type of ``Config.experiments``. The JSON schema leaves the block open (an object): adding an experiment
#: changes no file but its own module and registration line; the typed model checks every key.
Experiments = Annotated[Any, PlainValidator(_experiments), WithJsonSchema({
    "type": "object", "description": "controlled experiments: shared settings and one block per registered "
                                     "experiment (fedhisto.registries.experiment_registry), checked by its settings class"})]


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
    experiments: Experiments = Field(default_factory=_default_experiments)
    privacy: PrivacyConfig = PrivacyConfig()
    secure_aggregation: SecureAggregationConfig = SecureAggregationConfig()
    classify: ClassifyConfig = ClassifyConfig()

    @model_validator(mode="before")
    @classmethod
    def _encoder_normalisation(cls, data: Any) -> Any:
        """views.normalisation: encoder fills views.mean / views.std with the encoder entry's statistics."""
        if not isinstance(data, dict):
            return data
        views = data.get("views")
        if not isinstance(views, dict) or views.get("normalisation") != "encoder":
            return data
        set_too = [k for k in ("mean", "std") if k in views]
        if set_too:
            raise ValueError(f"views.normalisation is 'encoder' but views.{set_too[0]} is set too; "
                             "remove it (the encoder's statistics are used) or use normalisation: imagenet")
        encoder = ((data.get("model") or {}).get("encoder") or {}).get("name", "hibou-b")
        if encoder not in ENCODERS:
            return data  # EncoderConfig reports the unknown name with the known ones
        entry = ENCODERS[encoder]
        return {**data, "views": {**views, "mean": entry.mean, "std": entry.std}}

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.model.pretrain.enabled and not ENCODERS[self.model.encoder.name].pretrainable:
            raise ValueError(f"model.pretrain.enabled only applies to the tiny encoder; "
                             f"{self.model.encoder.name} is loaded pretrained")
        if tuple(self.classes) != CLASSES:
            raise ValueError(f"classes must be exactly {list(CLASSES)} in that order (got {list(self.classes)})")
        if self.cohort.mode == "real" and self.manifest.targets is None:
            raise ValueError("manifest.targets is required when cohort.mode is 'real'")
        if self.cohort.mode == "synthetic" and self.manifest.targets is not None \
                and self.manifest.targets != self.profile_targets():
            raise ValueError(f"manifest.targets disagree with synthetic profile '{self.cohort.synthetic.profile}'; "
                             "omit manifest.targets to use the profile's counts")
        comparator = self.train.comparator_seeds
        if comparator is not None and (not comparator or not set(comparator) <= set(self.train.seeds)):
            raise ValueError(f"train.comparator_seeds {comparator} must be a non-empty subset of train.seeds "
                             f"{self.train.seeds} (or null: the comparators train on train.seeds)")
        self._ablation_seeds_trained()
        self._comparisons_share_seeds()
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
                    key = self.seeds_key(method)
                    raise ValueError(
                        f"bootstrap.comparisons.{name} (ablation: true) ensembles both methods on train.ablation_seeds "
                        f"{abl}; its {role} {method!r} trains on {key} {self.trained_seeds(method)}"
                        f"{f', which lacks {missing}' if missing else ''}. Make train.ablation_seeds a non-empty "
                        "subset of train.seeds")

    def _comparisons_share_seeds(self) -> None:
        """A comparison ensembles both methods on the seeds they share: there must be one."""
        for name in self.trained_comparisons():
            comp = self.bootstrap.comparisons[name]
            if not comp.ablation and not self.matched_seeds(name):
                raise ValueError(
                    f"bootstrap.comparisons.{name} ensembles both methods on the seeds they share; its method "
                    f"{comp.method!r} trains on {self.seeds_key(comp.method)} {self.trained_seeds(comp.method)} and its "
                    f"reference {comp.reference!r} on {self.seeds_key(comp.reference)} "
                    f"{self.trained_seeds(comp.reference)}: no seed in common")

    def seeds_key(self, method: str) -> str:
        """The config key holding the seeds ``method`` trains on."""
        if method not in self.train.methods:
            return "train.ablation_seeds"
        if method not in STUDY_METHODS and self.train.comparator_seeds is not None:
            return "train.comparator_seeds"
        return "train.seeds"

    def trained_seeds(self, method: str) -> list[int]:
        """Seeds a method trains on: train.seeds for a principal method (and for an extra comparator unless
        train.comparator_seeds is set), train.comparator_seeds for an extra comparator, else train.ablation_seeds."""
        key = self.seeds_key(method)
        t = self.train
        return list({"train.seeds": t.seeds, "train.comparator_seeds": t.comparator_seeds or t.seeds,
                     "train.ablation_seeds": t.ablation_seeds}[key])

    def train_runs(self) -> list[tuple[str, int]]:
        """(method, seed) of every configured run, methods then ablations, each on its own seeds."""
        return [(m, s) for m in [*self.train.methods, *self.train.ablations] for s in self.trained_seeds(m)]

    def trained_comparisons(self) -> list[str]:
        """Configured comparisons whose two methods are both configured to train."""
        trained = set(self.train.methods) | set(self.train.ablations)
        return [n for n, c in self.bootstrap.comparisons.items() if c.method in trained and c.reference in trained]

    def comparison_seeds(self, name: str) -> tuple[list[int], list[int]]:
        """Seeds of the method's and the reference's ensembles in comparison ``name``: always the same
        list for both (matched ensembles: ensemble size alone moves macro-F1).

        An ablation comparison uses train.ablation_seeds for both (full v2 enters as its 11/33/55
        subset, as in study Table 7); any other uses the seeds both methods train on (the method's
        seeds that the reference also has, in the method's order), so v2 enters a comparison with an
        extra comparator trained on train.comparator_seeds on those seeds only."""
        seeds = self.matched_seeds(name)
        return list(seeds), list(seeds)

    def matched_seeds(self, name: str) -> list[int]:
        """The one seed list both ensembles of comparison ``name`` use (see ``comparison_seeds``)."""
        comp = self.bootstrap.comparisons[name]
        if comp.ablation:
            return list(self.train.ablation_seeds)
        reference = set(self.trained_seeds(comp.reference))
        return [s for s in self.trained_seeds(comp.method) if s in reference]

    def profile_targets(self) -> PartitionTargets:
        from fedhisto.config.profiles import PROFILES

        p = PROFILES[self.cohort.synthetic.profile]
        return PartitionTargets(clients=p.clients, validation=p.validation, test=p.test, holdouts=p.holdouts)

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


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def layer(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` as Snakemake lays config files (``snakemake.utils.update_config``): mappings
    merge key by key, anything else (a list, a value) replaces; neither argument changes."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = layer(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def command_line_config(files: list[str | Path], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The raw config of a run given config files on the command line: the files laid on one another in
    order, then ``--config key=value`` overrides, over nothing else. The Snakefile's own
    ``config/config.yaml`` (the embedded default) is not underneath: a file on the command line is a whole
    study setup (``config/paper.yaml``), and the default's blocks for its tiny encoder (``model.pretrain``,
    its learning rate and widths) would otherwise pass into a HIBOU-B run. Keys a file leaves out take
    the typed models' defaults, which are the study's numbers. The workflow (workflow/rules/common.smk)
    and ``fedhisto check-config`` both build a run's config here."""
    raw: dict[str, Any] = {}
    for path in files:
        raw = layer(raw, read_config_file(path))
    return layer(raw, overrides or {})


def load_config_file(path: str | Path, *more: str | Path) -> Config:
    """One config file (or several, laid in order as on Snakemake's command line), validated."""
    paths = [path, *more]
    return load_config(command_line_config(paths), source=" + ".join(map(str, paths)))


def json_schema() -> dict[str, Any]:
    schema = Config.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["description"] = "fedhisto configuration (generated from fedhisto.config.study; edit the models, not this file)"
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def settings_schema_text() -> str:
    """The JSON schema of every registered method settings class (``method_settings.schema.json``);
    imports the method modules (and so torch)."""
    from fedhisto.registries.method_registry import registration, settings_blocks
    from fedhisto.registries.method_registry import settings_schema_text as text

    owners = {r.config_key: r for r in map(registration, _method_names()) if r.config_key}
    return text({key: owners[key].settings_class() for key in settings_blocks()})


def _method_names() -> list[str]:
    from fedhisto.registries.method_registry import method_names

    return method_names()
