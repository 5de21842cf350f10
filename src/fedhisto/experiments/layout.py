"""Where each experiment's conditions, runs and outputs live; what each rule needs.

A *condition* is a folder ``results/experiments/<experiment>/<name>/`` holding its own manifest,
training runs and predictions, made by the main pipeline's stage scripts. Whatever the main
pipeline already made is reused: the stain-invariant encoder condition is the main runs, and the
leakage policy the main config uses is the main manifest and runs. Torch-free: the Snakefile
calls it at parse time.
"""

from __future__ import annotations

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.infra.settings_base import identity_dump

ROOT = "results/experiments"
EXPERIMENTS = ("dose_response", "leakage", "leave_one_site_out", "calibration", "probe", "privacy_audit",
               "sensitivity")
PLAIN = "dose_response/plain"  # the dose-response condition trained on the plain encoder
PLAIN_ENCODER = f"{ROOT}/dose_response/encoder_plain"


def condition_pattern() -> str:
    """Wildcard constraint of ``{condition}``: the retrained conditions only."""
    return r"dose_response/plain|leakage/(ignore_families|representatives|whole_families)|leave_one_site_out/C[1-5]"


def is_main(cfg: Config, condition: str) -> bool:
    """A condition the main pipeline already is (reused, never retrained)."""
    return condition in ("dose_response/stain_invariant", f"leakage/{cfg.clearance.family_policy}")


def run_dir(cfg: Config, condition: str, kind: str, method: str, seed: int) -> str:
    """``kind`` train or predictions: the folder of one run of a condition (main folders when reused)."""
    base = "results" if is_main(cfg, condition) else f"{ROOT}/{condition}"
    return f"{base}/{kind}/{method}/seed{seed}"


def condition_inputs(cfg: Config, condition: str) -> dict[str, str | list[str]]:
    """Manifest, its identity, descriptors and encoder a condition's runs train and predict on."""
    main_encoder = ["results/pretrain/encoder"] if cfg.model.pretrain.enabled else []
    if condition.startswith("dose_response/"):  # the main manifest; the plain condition its own encoder
        entry = cfg.experiments.dose_response.entry(condition.split("/", 1)[1])
        encoder = [PLAIN_ENCODER] if condition == PLAIN else [] if entry else main_encoder  # an entry: its config
        return {"manifest": "results/manifest/manifest.csv", "identity": "results/manifest/manifest.json",
                "descriptors": "results/stain/descriptors.json", "encoder": encoder}
    if condition.startswith(("leave_one_site_out/", "leakage/")):
        # own stain descriptors: other pools (leakage), or four clients whose standardisation and
        # centroid must not see the left-out site (leave-one-site-out)
        folder = f"{ROOT}/{condition}"
        return {"manifest": f"{folder}/manifest/manifest.csv", "identity": f"{folder}/manifest/manifest.json",
                "descriptors": f"{folder}/stain/descriptors.json", "encoder": main_encoder}
    raise ValueError(f"unknown experiment condition {condition!r}")


def encoder_conditions(cfg: Config) -> list[str]:
    return [f"dose_response/{label}" for label in cfg.experiments.dose_response.labels()]


def encoder_pattern(cfg: Config) -> str:
    """Wildcard constraint of ``{encoder}``: the built-in tiny conditions and the configured entries."""
    from fedhisto.config.experiment_settings import TINY_ENCODERS

    return "|".join(dict.fromkeys([*TINY_ENCODERS, *cfg.experiments.dose_response.labels()]))


def entry_pattern(cfg: Config) -> str:
    """Wildcard constraint of ``{label}``: the configured encoder entries only (never matches when none)."""
    labels = [e for e in cfg.experiments.dose_response.labels() if cfg.experiments.dose_response.entry(e)]
    return "|".join(labels) if labels else "(?!)"


def condition_config(cfg: Config, condition: str) -> Config:
    """The config a condition's runs train and predict with: ``cfg`` itself except for a dose-response
    encoder entry, whose encoder (no pipeline pretraining: its weights come from its folder or the
    hub), input size (the registry entry's unless the entry sets ``crop_size``) and normalisation
    replace the main ones."""
    from fedhisto.registries.encoder_registry import encoder_entry

    entry = cfg.experiments.dose_response.entry(condition.split("/", 1)[1]) \
        if condition.startswith("dose_response/") else None
    if entry is None:
        return cfg
    registry = encoder_entry(entry.name)
    views = {"crop_size": entry.crop_size or registry.input_size, "normalisation": entry.normalisation}
    if entry.normalisation == "encoder":
        views.update(mean=registry.mean, std=registry.std)
    model = cfg.model.model_copy(update={"encoder": entry.encoder_config(),
                                         "pretrain": cfg.model.pretrain.model_copy(update={"enabled": False})})
    return cfg.model_copy(update={"model": model, "views": cfg.views.model_copy(update=views)})


def dose_methods(cfg: Config) -> list[str]:
    """The dose-response experiment's methods: the principal ones and its extra arms."""
    x = cfg.experiments
    return list(dict.fromkeys([*x.methods, *x.dose_response.extra_methods]))


def dose_runs(cfg: Config) -> list[tuple[str, str, int]]:
    """(condition, method, seed) whose external predictions the dose-response experiment re-scores."""
    x = cfg.experiments
    return [(c, m, s) for c in encoder_conditions(cfg) for m in dose_methods(cfg) for s in x.seeds]


def leakage_runs(cfg: Config) -> list[tuple[str, str, int]]:
    x = cfg.experiments
    return [(f"leakage/{p}", m, s) for p in x.leakage.policies for m in x.leakage.methods for s in x.seeds]


def leave_one_site_out_methods(cfg: Config) -> list[str]:
    x = cfg.experiments
    return list(dict.fromkeys([*x.methods, *x.leave_one_site_out.extra_methods]))


def leave_one_site_out_runs(cfg: Config) -> list[tuple[str, str, int]]:
    x = cfg.experiments.leave_one_site_out
    return [(f"leave_one_site_out/{c}", m, s) for c in x.left_out for m in leave_one_site_out_methods(cfg)
            for s in x.seeds]


def calibration_runs(cfg: Config) -> list[tuple[str, int]]:
    x = cfg.experiments
    return [(m, s) for m in x.methods for s in x.seeds]


def summary_files(name: str) -> dict[str, str]:
    """The CSV, JSON and figure of one experiment."""
    return {kind: f"{ROOT}/{name}/{name}.{kind}" for kind in ("csv", "json", "png")}


def all_outputs() -> list[str]:
    return [f for name in EXPERIMENTS for f in summary_files(name).values()]


def plain_encoder_config(cfg: Config) -> Config:
    """The config that pretrains the dose-response experiment's plain encoder (no stain-perturbed views)."""
    pretrain = cfg.model.pretrain.model_copy(update={"stain_views": False})
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"pretrain": pretrain})})


def shifted_predictions(cfg: Config) -> list[tuple[str, str, int, str]]:
    """(encoder condition, method, seed, CSV) of the dose-response experiment."""
    return [(c, m, s, f"{ROOT}/{c}/predictions/{m}/seed{s}.csv") for c, m, s in dose_runs(cfg)]


def leakage_manifest(cfg: Config, policy: str) -> str:
    return "results/manifest/manifest.csv" if is_main(cfg, f"leakage/{policy}") \
        else f"{ROOT}/leakage/{policy}/manifest/manifest.csv"


def condition_manifest_inputs(condition: str) -> dict[str, str]:
    """What a retrained condition's manifest is derived from."""
    if condition.startswith("leakage/"):
        return {"sources": "results/cohort/sources.csv", "families": "results/clearance/families.csv",
                "edges": "results/clearance/edges.csv"}
    return {"manifest": "results/manifest/manifest.csv", "identity": "results/manifest/manifest.json"}


def entry_resources(cfg: Config, label: str) -> dict[str, int]:
    """Training resources of an encoder entry's runs: its registry entry's hints."""
    from fedhisto.registries.encoder_registry import encoder_entry

    entry = cfg.experiments.dose_response.entry(label)
    if entry is None:
        raise ValueError(f"{label!r} is not an experiments.dose_response.encoders entry")
    r = encoder_entry(entry.name).resources
    return {"mem_mb": r.train_mem_mb, "runtime": r.train_runtime, "gpu": r.gpu}


def probe_encoder_inputs(cfg: Config, encoder: str) -> dict[str, str | list[str]]:
    """The shifted cohort and the folder of a dose-response condition's frozen encoder (none: from its config)."""
    return {"cohort": f"{ROOT}/dose_response/cohort/cohort.csv",
            "encoder": condition_inputs(cfg, f"dose_response/{encoder}")["encoder"]}


def probe_files(cfg: Config) -> dict[str, str]:
    """Per dose-response encoder condition: its probe's JSON."""
    return {label: f"{ROOT}/probe/{label}/probe.json" for label in cfg.experiments.dose_response.labels()}


def probe_block(cfg: Config, encoder: str) -> dict:
    """What one encoder's probe depends on beyond its input files."""
    c = condition_config(cfg, f"dose_response/{encoder}")
    x = cfg.experiments
    return {"probe": x.probe.model_dump(mode="json"), "severities": x.dose_response.severities,
            "encoder": identity_dump(c.model.encoder), "views": identity_dump(c.views),
            "resamples": x.resamples, "bootstrap_seed": x.bootstrap_seed, "eval_batch": c.evaluate.eval_batch}


def shifted_inputs(cfg: Config, encoder: str, method: str, seed: int) -> dict[str, str | list[str]]:
    """A dose-response run's checkpoint (main runs for the stain-invariant encoder) and what it predicts with."""
    condition = f"dose_response/{encoder}"
    if encoder == "stain_invariant" and not cfg.model.pretrain.stain_views:  # evaluated only when the job is needed
        raise ValueError("experiments.dose_response.encoders names 'stain_invariant' (the main runs) but "
                         "model.pretrain.stain_views is false: the main encoder is then the plain one")
    return {"status": f"{run_dir(cfg, condition, 'train', method, seed)}/status.json",
            "cohort": f"{ROOT}/dose_response/cohort/cohort.csv", **condition_inputs(cfg, condition)}


def experiment_block(cfg: Config, name: str) -> dict:
    """What an experiment's summary depends on beyond its input files."""
    x = cfg.experiments
    return {"experiment": name, "methods": x.methods, "seeds": x.seeds, "resamples": x.resamples,
            "bootstrap_seed": x.bootstrap_seed, "bins": x.calibration.bins,  # ECE bins of every experiment
            name: getattr(x, name).model_dump(mode="json")}


def shifted_block(cfg: Config, method: str, seed: int, encoder: str = "stain_invariant") -> dict:
    """Shifted-cohort predictions are never temperature-scaled: the predict block without that flag
    (of the encoder condition's config: the main one for the built-in tiny conditions)."""
    block = stage_block(condition_config(cfg, f"dose_response/{encoder}"), "predict", method=method, seed=seed)
    block.pop("temperature_scaling", None)
    return block


def leakage_predictions(cfg: Config) -> list[tuple[str, str, int, str]]:
    """(policy, method, seed, internal test predictions)."""
    return [(c.split("/")[1], m, s, f"{run_dir(cfg, c, 'predictions', m, s)}/test.csv")
            for c, m, s in leakage_runs(cfg)]


def leave_one_site_out_predictions(cfg: Config) -> list[tuple[str, str, int, str]]:
    """(left-out client, method, seed, predictions on the left-out site)."""
    return [(c.split("/")[1], m, s, f"{run_dir(cfg, c, 'predictions', m, s)}/external.csv")
            for c, m, s in leave_one_site_out_runs(cfg)]


def calibration_inputs(cfg: Config) -> list[tuple[str, int, str, str, str]]:
    """(method, seed, validation, test, external predictions); the training stage writes the
    validation predictions beside status.json."""
    return [(m, s, f"results/train/{m}/seed{s}/validation_predictions.csv", f"results/predictions/{m}/seed{s}/test.csv",
             f"results/predictions/{m}/seed{s}/external.csv") for m, s in calibration_runs(cfg)]


def calibration_files(cfg: Config) -> list[str]:
    """The rule's inputs: each run's status (its validation predictions are not a declared output) and predictions."""
    return [p for m, s, _val, test, ext in calibration_inputs(cfg) for p in (f"results/train/{m}/seed{s}/status.json",
                                                                          test, ext)]


def privacy_audit_conditions(cfg: Config) -> list[str]:
    """The audit's conditions: ``nonprivate`` and ``sigma<noise multiplier>`` (``experiments.privacy_audit``)."""
    return ["nonprivate", *(f"sigma{s:g}" for s in cfg.experiments.privacy_audit.noise_multipliers)]


def privacy_audit_pattern(cfg: Config) -> str:
    """Wildcard constraint of ``{audit}``."""
    return "|".join(c.replace(".", r"\.") for c in privacy_audit_conditions(cfg))


def privacy_audit_files(cfg: Config) -> list[str]:
    return [f"{ROOT}/privacy_audit/{c}/audit.json" for c in privacy_audit_conditions(cfg)]


def privacy_audit_inputs(cfg: Config) -> dict[str, str | list[str]]:
    """The main manifest, descriptors and encoder: the audited federations retrain on them."""
    return {"manifest": "results/manifest/manifest.csv", "identity": "results/manifest/manifest.json",
            "descriptors": "results/stain/descriptors.json",
            "encoder": ["results/pretrain/encoder"] if cfg.model.pretrain.enabled else []}


def privacy_audit_config(cfg: Config, condition: str, method: str) -> Config:
    """The config of one audited federation: the main one with the audit's rounds and seed, the sequential
    engine, one method, and (a ``sigma<v>`` condition) DP-SGD at noise multiplier v with the audit's q, C,
    delta, noised prototypes and a secret noise seed."""
    import json

    from fedhisto.config.study import load_config

    a = cfg.experiments.privacy_audit
    raw = json.loads(cfg.model_dump_json())
    raw["train"].update(methods=[method], ablations=[], ablation_seeds=[], comparator_seeds=None, seeds=[a.seed],
                        max_rounds=a.rounds, patience=a.rounds, engine="sequential")
    raw["bootstrap"]["comparisons"] = {}
    if condition == "nonprivate":
        raw["privacy"] = {"enabled": False}
    elif condition in privacy_audit_conditions(cfg):
        raw["privacy"] = {"enabled": True, "noise_multiplier": float(condition.removeprefix("sigma")),
                          "clip_norm": a.clip_norm, "sample_rate": a.sample_rate, "delta": a.delta,
                          "prototypes": "noised", "noise_seed": "secret"}
    else:
        raise ValueError(f"unknown privacy_audit condition {condition!r} (conditions: {privacy_audit_conditions(cfg)})")
    return load_config(raw)


def privacy_audit_block(cfg: Config, condition: str | None = None) -> dict:
    """What a condition's audit (or, condition None, the summary) depends on beyond its input files."""
    x = cfg.experiments
    block = {"experiment": "privacy_audit", "privacy_audit": x.privacy_audit.model_dump(mode="json"),
             "resamples": x.resamples, "bootstrap_seed": x.bootstrap_seed}
    if condition is not None:
        block.update(condition=condition, train={
            m: stage_block(privacy_audit_config(cfg, condition, m), "train", method=m, seed=x.privacy_audit.seed)
            for m in x.privacy_audit.methods})
    return block
