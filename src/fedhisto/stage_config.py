"""What each stage depends on, stated once.

``stage_block(cfg, stage, ...)`` is the configuration a stage's outputs are a function of. The rule
passes it as ``params`` (so Snakemake reruns the stage when it changes), the stage hashes it into
its provenance ``config_hash``, and the training stage's run identity contains it. Nothing here
imports torch: the Snakefile calls it at parse time.
"""

from __future__ import annotations

from typing import Any

from fedhisto.config import Config
from fedhisto.methods import method_names, registration

#: TrainConfig keys that choose which runs exist rather than how a run trains.
RUN_LISTS = ("methods", "ablations", "seeds", "ablation_seeds")


def training_settings(cfg: Config, method: str) -> dict[str, Any]:
    """Engine settings plus the method family's own block; other families' blocks do not matter."""
    train = cfg.train.model_dump(mode="json")
    families = {registration(name).config_key for name in method_names()} - {None}
    for key in (*RUN_LISTS, *(families - {registration(method).config_key})):
        train.pop(key, None)
    if train.get("engine") == "sequential":  # the default engine leaves existing run identities as they were
        train.pop("engine")
    if train.get("view_pipeline") == "host":  # likewise the default view pipeline
        train.pop("view_pipeline")
    return train


def _pretrain(cfg: Config) -> dict[str, Any]:
    block = cfg.model.pretrain.model_dump(mode="json")
    if block.get("stain_views") is True:  # the default leaves existing pretrain, train and accounting blocks as they were
        block.pop("stain_views")
    return block


def _model(cfg: Config) -> dict[str, Any]:
    return {**cfg.model.model_dump(mode="json"), "pretrain": _pretrain(cfg)}


def stage_block(cfg: Config, stage: str, **wildcards: Any) -> dict[str, Any]:
    dump = lambda model: model.model_dump(mode="json")  # noqa: E731
    if stage == "cohort":
        return dump(cfg.cohort)
    if stage == "clearance":  # new keys at their defaults leave existing blocks as they were
        return cfg.clearance.identity_block()
    if stage == "manifest":
        return {"manifest": cfg.manifest.identity_block(), "targets": dump(cfg.partition_targets()),
                "family_policy": cfg.clearance.family_policy}
    if stage == "stain":
        # the per-client image sample is drawn with the manifest's split seed
        return {"stain": dump(cfg.stain), "views": dump(cfg.views), "split_seed": cfg.manifest.split_seed}
    if stage == "pretrain":
        return {"pretrain": _pretrain(cfg), "encoder": cfg.model.encoder.name, "views": dump(cfg.views),
                "image_size": cfg.cohort.synthetic.image_size}
    if stage == "train":
        method, seed = wildcards["method"], int(wildcards["seed"])
        return {"method": method, "seed": seed, "train": training_settings(cfg, method),
                "model": _model(cfg), "views": dump(cfg.views), "eval_batch": cfg.evaluate.eval_batch}
    if stage == "predict":
        scaled = {"temperature_scaling": True} if cfg.evaluate.temperature_scaling else {}
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
        return {"dose_response": cfg.experiments.dose_response.model_dump(mode="json", exclude={"encoders"}),
                "external_image_size": cfg.cohort.synthetic.external_image_size}
    raise ValueError(f"unknown stage {stage!r}")
