"""What each stage depends on, stated once.

``stage_block(cfg, stage, ...)`` is the configuration a stage's outputs are a function of. The rule
passes it as ``params`` (so Snakemake reruns the stage when it changes), the stage hashes it into
its provenance ``config_hash``, and the training stage's run identity contains it. Nothing here
imports torch: the Snakefile calls it at parse time.

One rule keeps old identities when options are added: a field declared with
``json_schema_extra=IF_CHANGED`` (``config_base``) enters a block only when set away from its
default (``identity_dump``); every other field always enters.
"""

from __future__ import annotations

from typing import Any

from fedhisto.config.study import Config
from fedhisto.infra.settings_base import identity_dump
from fedhisto.registries.method_registry import registration, settings_blocks

#: TrainConfig keys that choose which runs exist rather than how a run trains.
RUN_LISTS = ("methods", "ablations", "seeds", "ablation_seeds", "comparator_seeds")
#: TrainConfig keys that choose where and how fast a run computes, not what: a run resumed on another device,
#: or with its views made by other threads, is the same run
EXECUTION = ("device", "view_workers")


def training_settings(cfg: Config, method: str) -> dict[str, Any]:
    """Engine settings plus the method family's own block; other families' blocks do not matter."""
    train = identity_dump(cfg.train)
    for key in (*RUN_LISTS, *EXECUTION, *(set(settings_blocks()) - {registration(method).config_key})):
        train.pop(key, None)
    return train


def _model(cfg: Config) -> dict[str, Any]:
    return identity_dump(cfg.model)


def stage_block(cfg: Config, stage: str, **wildcards: Any) -> dict[str, Any]:
    dump = identity_dump
    if stage == "cohort":
        return dump(cfg.cohort)
    if stage == "clearance":
        return dump(cfg.clearance)
    if stage == "manifest":
        return {"manifest": dump(cfg.manifest), "targets": dump(cfg.partition_targets()),
                "family_policy": cfg.clearance.family_policy}
    if stage == "stain":
        # the per-client image sample is drawn with the manifest's split seed
        return {"stain": dump(cfg.stain), "views": dump(cfg.views), "split_seed": cfg.manifest.split_seed}
    if stage == "pretrain":
        return {"pretrain": dump(cfg.model.pretrain), "encoder": cfg.model.encoder.name, "views": dump(cfg.views),
                "image_size": cfg.cohort.synthetic.image_size}
    if stage == "train":
        method, seed = wildcards["method"], int(wildcards["seed"])
        block = {"method": method, "seed": seed, "train": training_settings(cfg, method),
                 "model": _model(cfg), "views": dump(cfg.views), "eval_batch": cfg.evaluate.eval_batch}
        if cfg.privacy.enabled:  # DP runs are other runs; privacy off leaves every identity as it was
            block["privacy"] = dump(cfg.privacy)
        if cfg.secure_aggregation.enabled:  # quantised sums: other runs; off leaves every identity as it was
            block["secure_aggregation"] = dump(cfg.secure_aggregation)
        return block
    if stage == "predict":
        scaled = {k: v for k, v in dump(cfg.evaluate).items() if k == "temperature_scaling"}
        return {"method": wildcards["method"], "seed": int(wildcards["seed"]), "views": dump(cfg.views),
                "eval_batch": cfg.evaluate.eval_batch, **scaled}
    if stage == "metrics":  # temperature scaling acts in predict; its default leaves this block as it was
        return cfg.evaluate.model_dump(mode="json", exclude={"temperature_scaling"})
    if stage == "bootstrap":
        name = wildcards["comparison"]
        return {"comparison": dump(cfg.bootstrap.comparisons[name]),
                "bootstrap": cfg.bootstrap.model_dump(mode="json", exclude={"comparisons"})}
    if stage == "accounting":
        return {"model": _model(cfg), "methods": [*cfg.train.methods, *cfg.train.ablations],
                "targets": dump(cfg.partition_targets())}
    if stage == "shift_cohort":  # the dose-response cohort; the encoders crossed with it do not change its images
        shift = cfg.experiments.dose_response.model_dump(mode="json", exclude={"encoders", "extra_methods"})
        return {"dose_response": shift,
                "external_image_size": cfg.cohort.synthetic.external_image_size}
    raise ValueError(f"unknown stage {stage!r}")
