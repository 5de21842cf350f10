"""What `snakemake all` plans on the embedded default, and in which order: Snakemake's own dry run of the real
Snakefile (its job list, threads and priorities), read against the config."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from fedhisto.config.study import STUDY_METHODS, load_config_file


def dry_run(snakemake_bin: str, repo: Path, workdir: Path, *targets: str) -> list[dict]:
    """Every planned job: its rule, wildcards, threads and priority, as Snakemake prints them."""
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(workdir), "-n", "--cores", "2", *targets],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:\n)", proc.stdout + proc.stderr):
        head = re.match(r"(?:local)?rule (\w+):\n", block)
        if not head:
            continue
        fields = dict(re.findall(r"^    (\w+): (.*)$", block, re.M))
        wildcards = dict(re.findall(r"(\w+)=([^,]+)", fields.get("wildcards", "")))
        jobs.append({"rule": head.group(1), "wildcards": wildcards, "threads": int(fields.get("threads", 1)),
                     "priority": int(fields.get("priority", 0))})
    return jobs


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory, repo: Path) -> Path:
    wd = tmp_path_factory.mktemp("schedule")
    shutil.copytree(repo / "config", wd / "config")
    return wd


@pytest.fixture(scope="module")
def all_jobs(default_dir: Path, repo: Path, snakemake_bin: str) -> list[dict]:
    return dry_run(snakemake_bin, repo, default_dir, "all")


def test_all_trains_the_studys_methods_and_ablations_and_the_comparators_have_their_own_target(
        all_jobs: list[dict], default_dir: Path, repo: Path, snakemake_bin: str):
    cfg = load_config_file(repo / "config/config.yaml")
    study = [(m, s) for m, s in cfg.train_runs() if m in STUDY_METHODS or m in cfg.train.ablations]
    trained = sorted((j["wildcards"]["method"], int(j["wildcards"]["seed"])) for j in all_jobs
                     if j["rule"] == "train_federated")
    assert trained == sorted(study) and len(trained) == 5 * 5 + 3 * 3
    comparisons = sorted(j["wildcards"]["comparison"] for j in all_jobs if j["rule"] == "bootstrap_comparison")
    assert comparisons == sorted(["v2_vs_fedavg", "v2_vs_fedprox", "v2_vs_filmzero", "v2_vs_v1", "v2_vs_no_js",
                                  "v2_vs_no_feat", "v2_vs_no_proto"])
    assert {"make_report", "summarize_metrics"} <= {j["rule"] for j in all_jobs}
    both = dry_run(snakemake_bin, repo, default_dir, "all", "comparators")
    runs = sorted((j["wildcards"]["method"], int(j["wildcards"]["seed"])) for j in both if j["rule"] == "train_federated")
    assert runs == sorted(cfg.train_runs())
    assert sorted(j["wildcards"]["comparison"] for j in both if j["rule"] == "bootstrap_comparison") == sorted(
        cfg.trained_comparisons())


def test_priorities_put_the_chains_first_what_follows_training_next_and_train_one_method_after_another(
        all_jobs: list[dict]):
    by_rule: dict[str, set[int]] = {}
    for j in all_jobs:
        by_rule.setdefault(j["rule"], set()).add(j["priority"])
    chains = {"synthesize_cohort", "audit_duplicates", "build_manifest", "compute_stain_descriptors", "pretrain_encoder"}
    after = {"predict_cohorts", "predict_cohorts_seeds_11_33_55", "bootstrap_comparison", "summarize_metrics",
             "make_report"}
    training = by_rule["train_federated"]
    assert min(p for r in chains for p in by_rule[r]) > max(p for r in after for p in by_rule[r]) > max(training)
    assert by_rule["account_communication"] == {0}  # whenever a core is free
    per_method = {j["wildcards"]["method"]: j["priority"] for j in all_jobs if j["rule"] == "train_federated"}
    assert len(set(per_method.values())) == len(per_method)  # every method its own rank: seeds train together
    assert max(per_method, key=per_method.get) == "past_v2"  # on one side of every comparison: trained first
    assert min(training) > 0


def test_cohort_on_both_cores_then_clearance_beside_pretraining(all_jobs: list[dict]):
    threads = {j["rule"]: j["threads"] for j in all_jobs}
    priority = {j["rule"]: j["priority"] for j in all_jobs}
    assert threads["synthesize_cohort"] == 2 and threads["audit_duplicates"] == threads["pretrain_encoder"] == 1
    # equal priorities let the scheduler start pretraining first, and the 2-thread cohort then waits for it
    assert priority["synthesize_cohort"] == priority["audit_duplicates"] > priority["pretrain_encoder"]
    assert Counter(j["threads"] for j in all_jobs if j["rule"] == "train_federated") == {1: 34}


def test_a_named_comparison_still_plans_only_its_two_methods(default_dir: Path, repo: Path, snakemake_bin: str):
    jobs = dry_run(snakemake_bin, repo, default_dir, "results/bootstrap/v2_vs_fedavg.json")
    assert {j["wildcards"]["method"] for j in jobs if j["rule"] == "train_federated"} == {"past_v2", "fedavg_peft"}
    assert not {"summarize_metrics", "make_report"} & {j["rule"] for j in jobs}
