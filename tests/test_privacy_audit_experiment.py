"""The privacy_audit experiment on a small cohort: canaries split by family with the non-members withheld,
the attack scored from the audited site's returned states, epsilon only under DP, table and figure."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from fedhisto.config.study import load_config


@pytest.fixture()
def audit_cfg(prepared: dict):
    raw = json.loads(prepared["cfg"].model_dump_json())
    raw["experiments"].update(resamples=200, privacy_audit={
        "methods": ["past_v2", "ffa_lora"], "noise_multipliers": [1.0], "canaries_per_side": 3, "sites": ["C1", "C2"], "rounds": 1,
        "sample_rate": 0.25, "delta": 1e-3})
    return load_config(raw)


def test_audit_conditions_train_score_and_summarise(prepared: dict, audit_cfg, tmp_path: Path):
    from fedhisto.experiments.privacy_audit import (
        privacy_audit_block,
        privacy_audit_conditions,
        privacy_audit_config,
        summarise_privacy_audit,
    )
    from fedhisto.experiments.privacy_audit_runs import run_condition
    from fedhisto.experiments.privacy_figure import privacy_utility_figure
    from fedhisto.privacy import rdp
    from fedhisto.privacy.accountant import Release, SiteAccountant
    from fedhisto.privacy.dpsgd import steps_per_epoch
    from fedhisto.privacy.releases import prototype_release

    opacus_rdp = pytest.importorskip("opacus.accountants.analysis.rdp")

    assert privacy_audit_conditions(audit_cfg) == ["nonprivate", "sigma1"]
    assert privacy_audit_config(audit_cfg, "sigma1", "past_v2").privacy.prototypes == "noised"
    assert "privacy" not in privacy_audit_block(audit_cfg, "nonprivate")["train"]["past_v2"]
    assert privacy_audit_block(audit_cfg, "sigma1")["train"]["past_v2"]["privacy"]["noise_multiplier"] == 1.0
    with pytest.raises(ValueError, match="unknown privacy_audit condition 'sigma3'"):
        privacy_audit_config(audit_cfg, "sigma3", "fedavg_peft")
    paths = []
    for condition in ("nonprivate", "sigma1"):
        path = tmp_path / "privacy_audit" / condition / "audit.json"
        doc = run_condition(audit_cfg, condition, prepared["manifest"], prepared["identity"], prepared["descriptors"],
                            path, threads=2)
        paths.append(path)
        for r in doc["results"]:
            assert r["attack"]["members"] == 6 and r["attack"]["nonmembers"] == 6  # 3 a side at each of 2 sites
            for site in ("C1", "C2"):
                assert not set(r["canaries"][site]["members"]) & set(r["canaries"][site]["nonmembers"])
            assert 0 <= r["attack"]["auc"]["value"] <= 1 and 0 <= r["internal_macro_f1"] <= 1
            with (tmp_path / "privacy_audit" / condition / r["method"] / "scores.csv").open() as fh:
                scores = list(csv.DictReader(fh))
            assert len(scores) == 12 and len({s["score"] for s in scores}) > 1  # the update moved the losses
            assert {s["site"] for s in scores} == {"C1", "C2"}
            steps = steps_per_epoch(0.25) * audit_cfg.train.local_epochs
            if condition == "nonprivate":
                assert r["epsilon"] is None
            elif r["method"] == "past_v2":  # the DP-SGD steps and one noised prototype upload per round, one ledger
                ledger = SiteAccountant("C1", 1e-3)  # every site the same plan: the largest is any
                ledger.record_round(0, [Release(1.0, 0.25, steps), prototype_release(1.0)])
                assert r["epsilon"] == pytest.approx(ledger.epsilon(), rel=1e-12)
                assert r["epsilon"] > rdp.epsilon(1.0, 0.25, steps, 1e-3)
            else:  # FFA-LoRA releases its DP-SGD steps only (B noised, A never moves): Opacus's accountant agrees
                orders = list(rdp.DEFAULT_ORDERS)
                opacus_eps, _ = opacus_rdp.get_privacy_spent(
                    orders=orders, delta=1e-3,
                    rdp=opacus_rdp.compute_rdp(q=0.25, noise_multiplier=1.0, steps=steps, orders=orders))
                assert r["epsilon"] == pytest.approx(rdp.epsilon(1.0, 0.25, steps, 1e-3), rel=1e-12)
                assert r["epsilon"] == pytest.approx(float(opacus_eps), rel=1e-9)
    summary = summarise_privacy_audit(paths, audit_cfg, tmp_path / "privacy_audit")
    assert {(r["condition"], r["method"]) for r in summary["rows"]} == {
        (c, m) for c in ("nonprivate", "sigma1") for m in ("past_v2", "ffa_lora")}
    for name in ("privacy_audit.csv", "privacy_audit.json", "privacy_audit.png"):
        assert (tmp_path / "privacy_audit" / name).stat().st_size > 0
    with (tmp_path / "privacy_audit" / "privacy_audit.csv").open() as fh:
        table = {(r["condition"], r["method"]): r for r in csv.DictReader(fh)}
    assert table[("sigma1", "ffa_lora")]["epsilon"] != "" and table[("nonprivate", "ffa_lora")]["epsilon"] == ""
    drawn = privacy_utility_figure(summary["rows"], tmp_path / "figure.png")  # the figure: a line set per method
    for method in ("past_v2", "ffa_lora"):
        assert {f"{method} internal", f"{method} external", f"{method} attack AUC",
                f"{method} empirical eps lower bound"} <= set(drawn)


def test_ffa_lora_is_audited_by_default_beside_v2_and_fedavg_peft():
    assert load_config({}).experiments.privacy_audit.methods == ["fedavg_peft", "past_v2", "ffa_lora"]


def test_an_audited_federation_refuses_a_method_dp_sgd_cannot_train_by_name():
    # the audit's derived config is a run's config: the DP capability checks apply to it as to the main one
    from fedhisto.config.study import ConfigError, load_config
    from fedhisto.experiments.privacy_audit import privacy_audit_conditions, privacy_audit_config

    cfg = load_config({})
    private = privacy_audit_conditions(cfg)[1]
    assert privacy_audit_config(cfg, private, "fedavg_peft").privacy.enabled
    with pytest.raises(ConfigError, match=rf"(?s)privacy_audit condition {re.escape(private)}, method fedstain: .*"
                                          r"method 'fedstain' cannot train under DP-SGD: its loss does not decompose"):
        privacy_audit_config(cfg, private, "fedstain")
