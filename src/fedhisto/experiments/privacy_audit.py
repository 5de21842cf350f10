"""Experiment ``privacy_audit``: what an honest-but-curious coordinator learns about one site's images from
the adapters that site returns, without DP and at several DP-SGD noise levels, beside the utility lost.

Design (written before running; docs/experiments.md): for each condition (non-private, and each
``noise_multipliers`` value with the privacy block's other settings) and each audited method, the
federation trains ``rounds`` rounds on the main manifest, except that the audited site's images are
split into canaries by clearance family (``privacy.attack.select_canaries``): ``canaries_per_side``
member canaries stay in the site's training (with their relatives), as many non-member canaries are
withheld together with their whole families. Which side a family falls on is random (the
experiment's seed), so membership is the only systematic difference between the two groups.

The coordinator sees, every round, the global state it sent the audited site and the state the site
returned. Its score of a canary is the loss decrease from the one to the other, summed over the
rounds (``attack.loss_difference_scores``): training lowers the loss of what it used. The
statistics (``privacy.audit.audit_summary``): ROC AUC and TPR at FPR 1 % and 0.1 % with bootstrap
intervals (members and non-members resampled apart), and the empirical epsilon lower bound with
Clopper-Pearson bounds at 95 % (Bonferroni over thresholds). Utility: macro-F1 of the
validation-selected global model on the internal global test split and on the external cohort.
A LiRA-style score needs shadow federations trained with and without each canary (dozens of
trainings per condition); it is not run here (``audit.lira_scores`` is there for whoever can).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.experiments.framework import (
    ROOT,
    Experiment,
    Step,
    alternatives,
    encoder_dir,
    summary_dir,
    summary_files,
    warm,
)
from fedhisto.experiments.layout import main_inputs
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.infra.settings_base import Strict
from fedhisto.registries.method_registry import Method

NAME = "privacy_audit"
STAGE = "experiments"  # the Snakemake stage (rule file, script, results/experiments/) every experiment belongs to
ClientName = Literal["C1", "C2", "C3", "C4", "C5"]


class PrivacyAuditConfig(Strict):
    """Membership-inference audit of one site's returned adapters, without DP and at several DP noise levels
    (docs/experiments.md, docs/privacy.md). The other DP settings of the audited runs are these, not
    ``privacy:`` (which configures the main runs)."""

    methods: list[Method] = Field(default_factory=lambda: ["fedavg_peft", "past_v2", "ffa_lora"], min_length=1,
                                  description="audited methods (v2 under DP releases noised prototypes; ffa_lora "
                                              "trains and noises B only, A frozen at its shared initialisation)")
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


def privacy_audit_conditions(cfg: Config) -> list[str]:
    """The audit's conditions: ``nonprivate`` and ``sigma<noise multiplier>`` (``experiments.privacy_audit``)."""
    return ["nonprivate", *(f"sigma{s:g}" for s in cfg.experiments.privacy_audit.noise_multipliers)]


def privacy_audit_files(cfg: Config) -> list[str]:
    return [f"{ROOT}/privacy_audit/{c}/audit.json" for c in privacy_audit_conditions(cfg)]


def privacy_audit_config(cfg: Config, condition: str, method: str) -> Config:
    """The config of one audited federation: the main one with the audit's rounds and seed, the sequential
    engine, one method, and (a ``sigma<v>`` condition) DP-SGD at noise multiplier v with the audit's q, C,
    delta, noised prototypes and a secret noise seed."""
    from fedhisto.entry import study_config  # a run's config: the DP capability checks included

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
    return study_config(raw, source=f"privacy_audit condition {condition}, method {method}")


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


def _audit(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.privacy_audit_runs:run_condition", cfg, smk.wildcards.audit, smk.input.manifest,
         smk.input.identity, smk.input.descriptors, smk.output.json, encoder_dir=encoder_dir(smk), threads=smk.threads)


def _summarise(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.privacy_audit:summarise_privacy_audit", list(smk.input.audits), cfg,
         summary_dir(smk))


class PrivacyAudit(Experiment):
    name = NAME
    settings = PrivacyAuditConfig

    def steps(self, cfg: Config) -> list[Step]:
        # one condition of the membership audit: the audited federations with canaries, their attack scores;
        # they retrain on the main manifest, descriptors and encoder
        return [Step("audit_privacy_condition", {"json": f"{ROOT}/privacy_audit/{{audit}}/audit.json"}, _audit,
                     inputs=main_inputs(cfg), log="logs/experiments/privacy_audit/{audit}.log",
                     params={"block": lambda w: privacy_audit_block(cfg, w.audit)}, resources="train",
                     wildcard_constraints={"audit": alternatives(privacy_audit_conditions(cfg))}),
                Step("summarize_privacy_audit", summary_files(NAME), _summarise,
                     inputs={"audits": privacy_audit_files(cfg)}, params={"block": lambda w: privacy_audit_block(cfg)})]


def summarise_privacy_audit(condition_jsons: list[str | Path], cfg: Config, out_dir: str | Path) -> dict:
    """``privacy_audit.csv`` (one row per condition and method), ``.json`` and the privacy-utility figure."""
    out = Path(out_dir)
    results = [r for p in condition_jsons for r in json.loads(Path(p).read_text())["results"]]
    rows = []
    for r in results:
        s = r["attack"]
        rows.append({"condition": r["condition"], "method": r["method"], "noise_multiplier": r["noise_multiplier"],
                     "epsilon": "" if r["epsilon"] is None else round(r["epsilon"], 4), "delta": r["delta"],
                     "rounds": r["rounds"], "internal_macro_f1": round(r["internal_macro_f1"], 4),
                     "external_macro_f1": round(r["external_macro_f1"], 4),
                     "members": s["members"], "nonmembers": s["nonmembers"],
                     **{f"{k}{part}": round(s[k][v], 4) for k in ("auc", "tpr_at_fpr_1pct", "tpr_at_fpr_0.1pct")
                        for part, v in (("", "value"), ("_low", "low"), ("_high", "high"))},
                     "empirical_epsilon_lower_bound": round(s["epsilon_lower_bound"]["value"], 4)})
    write_csv(out / f"{NAME}.csv", rows)
    prov = provenance_block(STAGE, privacy_audit_block(cfg), {Path(p).parent.name: p for p in condition_jsons})
    write_json(out / f"{NAME}.json", {"results": results, "provenance": prov})
    from fedhisto.experiments.privacy_figure import privacy_utility_figure

    privacy_utility_figure(rows, out / f"{NAME}.png")
    for name in (f"{NAME}.csv", f"{NAME}.png"):
        write_sidecar(out / name, prov)
    return {"rows": rows}
