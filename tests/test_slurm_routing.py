"""The shipped SLURM profile's routing, without a cluster: every job of the workflow that declares a GPU goes to
the GPU partition and asks for no ``--ntasks-per-gpu``; every other job keeps its partition.

The jobs are walked in Snakemake's own dry run of the profile's command (``all`` and ``experiments`` with a
GPU encoder and a classify folder, so every rule that can declare a GPU has jobs), reading each job's
resources as Snakemake prints them; the ``sbatch`` line of a GPU job is built by the executor plugin's own
``get_submit_command``. ``tests/test_slurm.py`` (marker ``slurm``) submits a GPU job to a real cluster.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import write_tiny_config

PROFILE = "workflow/profiles/slurm"
#: every rule that declares the encoder's GPU (workflow/rules/*.smk; experiment steps under their own names)
GPU_RULES = {"train_federated", "predict_cohorts", "classify_folder", "train_condition", "predict_condition",
             "probe_encoder", "train_sensitivity", "predict_sensitivity", "predict_shifted_cohort",
             "predict_sensitivity_shifted", "audit_privacy_condition", "train_lora_aggregation_arm"}


def gpu_config(workdir: Path) -> Path:
    """The tiny workflow configuration with HIBOU-B (whose jobs declare a GPU) and one classify folder."""
    path = write_tiny_config(workdir)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["encoder"].update(name="hibou-b", local_dir=str(workdir / "hibou-b"))
    cfg["model"]["pretrain"]["enabled"] = False
    cfg["classify"] = {"folders": {"external": "results/cohort/images/external"}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def dry_run(repo: Path, snakemake_bin: str, workdir: Path, *words: str) -> dict[str, list[dict[str, str]]]:
    """rule -> the resources of each of its jobs, from ``snakemake -n`` with the shipped profile."""
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(workdir), "-n",
                           "--workflow-profile", str(repo / PROFILE), *words], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs: dict[str, list[dict[str, str]]] = {}
    rule = None
    for line in proc.stdout.splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):$", line):
            rule = m.group(1)
        elif rule and (m := re.match(r"^\s+resources: (.*)$", line)):
            jobs.setdefault(rule, []).append(dict(kv.split("=", 1) for kv in m.group(1).split(", ")))
            rule = None
    return jobs


def test_every_gpu_job_goes_to_the_gpu_partition_and_every_other_job_stays(repo, snakemake_bin, tmp_path):
    gpu_config(tmp_path)
    jobs = dry_run(repo, snakemake_bin, tmp_path, "all", "experiments", "--default-resources", "slurm_account=lab",
                   "slurm_partition=cpu", "slurm_gpu_partition=gpu")
    declaring = {rule for rule, runs in jobs.items() if any(int(r.get("gpu", 0)) > 0 for r in runs)}
    assert declaring == GPU_RULES, declaring ^ GPU_RULES  # the walk reaches every rule that can hold a GPU
    for rule, runs in jobs.items():
        for r in runs:
            want = "gpu" if int(r.get("gpu", 0)) > 0 else "cpu"
            assert r.get("slurm_partition") == want, (rule, r)
            if "gpu" in r:
                assert r["tasks_per_gpu"] == "0" and r["cpus_per_gpu"] == "8", (rule, r)
    assert sum(len(runs) for runs in jobs.values()) > 100


def test_a_named_partition_wins_and_without_a_gpu_partition_jobs_keep_theirs(repo, snakemake_bin, tmp_path):
    gpu_config(tmp_path)
    jobs = dry_run(repo, snakemake_bin, tmp_path, "all", "--default-resources", "slurm_partition=cpu",
                   "--set-resources", "predict_cohorts:slurm_partition=big")
    assert {r["slurm_partition"] for r in jobs["train_federated"]} == {"cpu"}  # one partition holds the GPUs
    assert {r["slurm_partition"] for r in jobs["predict_cohorts"]} == {"big"}
    assert {r["gpu"] for r in jobs["train_federated"]} == {"1"}


class _Resources(dict):
    def __getattr__(self, name):
        return self[name]


@pytest.mark.parametrize("routed", [True, False])
def test_the_plugins_sbatch_line_for_a_gpu_job_has_no_ntasks_per_gpu(routed):
    """The executor plugin's own submit string for a routed GPU job (tasks_per_gpu=0, cpus_per_gpu=8): no
    --ntasks-per-gpu (beside --cpus-per-task SLURM >= 23 refuses it: the plugin's issues 342 and 373), and
    eight CPUs for the view workers. Unrouted, the installed plugin adds no --ntasks-per-gpu either (versions
    before 2.0 added --ntasks-per-gpu=1, which the routing's 0 turns off from 1.6.1 on, the slurm extra's
    floor) but asks one CPU per task."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command

    resources = _Resources(gpu=1, mem_mb=24000, runtime=720, slurm_partition="gpu")
    if routed:
        resources.update(tasks_per_gpu=0, cpus_per_gpu=8)
    job = SimpleNamespace(resources=resources, threads=2, name="train_federated", is_group=lambda: False)
    params = {"run_uuid": "x", "slurm_logfile": "log", "comment_str": "rule_train_federated", "account": "-A lab",
              "partition": "-p gpu", "workdir": "/w"}
    call = get_submit_command(job, params).replace("--cpus-per-gpu ", "--cpus-per-gpu=")
    call = call.replace("--cpus-per-task ", "--cpus-per-task=")
    assert "--ntasks-per-gpu" not in call, call
    assert ("--cpus-per-gpu=8" in call and "--cpus-per-task" not in call) if routed else "--cpus-per-task=2" in call
