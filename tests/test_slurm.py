"""Issue 7: the SLURM workflow profile on a real single-node cluster, against a local run.

Deselected by default (it needs root and Debian's slurm-wlm, slurmdbd, munge and mariadb-server);
``.ci/run`` installs those and runs ``pytest -m slurm``. The cluster is started from scratch in a
temporary directory and stopped afterwards, also when a test fails (tests/slurm_cluster.py).

The scenario, on the tiny embedded config with six rounds:
1. the README's cluster command builds ``results/bootstrap/v2_vs_fedavg.json`` (cohort, pretraining,
   clearance, manifest, stain descriptors, two training jobs, two inference jobs, the bootstrap),
   with ``--retries 1`` instead of the profile's 2 so that two kills exhaust it;
2. once the past_v2 training job has written a round checkpoint it is cancelled with ``scancel``:
   the workflow resubmits it in the same invocation and it resumes from that checkpoint;
3. that second attempt is cancelled too after a later round: no retry is left, the invocation stops;
4. the same command again resubmits the job, which resumes from its last checkpoint;
5. the same target built locally with ``--cores 2`` must give identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_config
from slurm_cluster import ACCOUNT, GPU_PARTITION, PARTITION, LocalSlurmCluster

pytestmark = pytest.mark.slurm

TARGET = "results/bootstrap/v2_vs_fedavg.json"
CANCELLED = "results/train/past_v2/seed11"
GPU_METHOD = "local_only"  # in the tiny config's methods, outside the bootstrap target: trained by the GPU job only
GPU_RUN = f"results/train/{GPU_METHOD}/seed11"
ROUNDS = 6
# The README's cluster command with its placeholders filled for this cluster (test_packaging checks the README).
README_COMMAND = ("snakemake --workflow-profile workflow/profiles/slurm all "
                  "--default-resources slurm_account=<account> slurm_partition=<partition>")
# The plugin waits 40 s before its first status check and after every finished job, to spare a big
# cluster's slurmdbd; on this one-node cluster 5 s keeps the test's ten jobs within minutes.
FAST_POLL = ("--slurm-init-seconds-before-status-checks", "5")
EXPECTED_RULES = {"synthesize_cohort": 1, "pretrain_encoder": 1, "audit_duplicates": 1, "build_manifest": 1,
                  "compute_stain_descriptors": 1, "train_federated": 2, "predict_cohorts": 2,
                  "bootstrap_comparison": 1}


def cluster_command(repo: Path, snakemake_bin: str, *extra: str) -> list[str]:
    words = README_COMMAND.replace("workflow/profiles/slurm", str(repo / "workflow/profiles/slurm")).split()
    words[0] = snakemake_bin
    words[words.index("all")] = TARGET
    words = [w.replace("<account>", ACCOUNT).replace("<partition>", PARTITION) for w in words]
    # -s and extra options go before --default-resources, which takes every word after it
    return [*words[:4], "-s", str(repo / "Snakefile"), *FAST_POLL, *extra, *words[4:]]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkpoint_round(run_dir: Path) -> int:
    path = run_dir / "checkpoint.pt"  # replaced atomically after every round, so always complete
    return torch.load(path, weights_only=False)["round"] if path.exists() else 0


def cancel_after_round(cluster: LocalSlurmCluster, workflow: subprocess.Popen, run_dir: Path, after: int,
                       cancelled: list[str]) -> int:
    """scancel the running past_v2 training job once its checkpoint is past round `after`.

    The job id is appended to `cancelled`; returns the checkpoint round once the job is gone.
    """
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if workflow.poll() is not None:
            pytest.fail(f"workflow exited ({workflow.returncode}) before training job {len(cancelled) + 1} "
                        f"could be cancelled")
        running = [j for j in cluster.queue() if "train_federated" in j["comment"] and "past_v2" in j["comment"]
                   and j["state"] == "RUNNING" and j["id"] not in cancelled]
        if running and checkpoint_round(run_dir) > after:
            cluster.run("scancel", running[0]["id"])
            cancelled.append(running[0]["id"])
            while any(j["id"] == running[0]["id"] for j in cluster.queue()):
                time.sleep(0.2)
            return checkpoint_round(run_dir)
        time.sleep(0.2)
    pytest.fail(f"no past_v2 training job got past round {after}")


def recording_sbatch(folder: Path) -> Path:
    """A folder whose ``sbatch`` appends its arguments to ``folder/sbatch.calls`` and runs the real one."""
    folder.mkdir(parents=True, exist_ok=True)
    real = shutil.which("sbatch", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    wrapper = folder / "sbatch"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{folder}/sbatch.calls"\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return folder


def gpu_job(cluster: LocalSlurmCluster, repo: Path, snakemake_bin: str, workdir: Path) -> dict:
    """The workflow's training job declaring a GPU (``--set-resources train_federated:gpu=1``, as HIBOU-B's
    do), submitted with the README's command plus the GPU partition: first as is, on a node whose GPU is
    no CUDA device to torch (the job must stop and say why), then with ``train.device: cpu``."""
    target = GPU_RUN + "/status.json"
    words = cluster_command(repo, snakemake_bin, "--set-resources", "train_federated:gpu=1")
    words[words.index("all") if "all" in words else words.index(TARGET)] = target
    # the GPU partition, and one CPU per GPU: this node has as few as two (the profile's routing asks eight)
    words += [f"slurm_gpu_partition={GPU_PARTITION}", "cpus_per_gpu=1"]
    folder = recording_sbatch(workdir / "recording")
    env = {**cluster.env, "PATH": f"{folder}:{cluster.env['PATH']}"}
    out = {}
    for name, extra in (("refused", ["--retries", "0"]), ("on_cpu", ["--config", "train={'device': 'cpu'}"])):
        cmd = [*words[:4], *extra, *words[4:]]
        with (workdir / f"gpu_{name}.log").open("w") as log:
            out[f"{name}_rc"] = subprocess.run(cluster.command(*cmd, cwd=workdir), env=env, stdout=log,
                                               stderr=subprocess.STDOUT, timeout=1800).returncode
        out[f"{name}_log"] = (workdir / f"gpu_{name}.log").read_text()
    sacct = cluster.run("sacct", "-a", "-X", "-n", "-P", "-S", "2000-01-01",
                        "-o", "JobIDRaw,State,Partition,AllocTRES%120,Comment%200").stdout
    out["jobs"] = [dict(zip(("id", "state", "partition", "tres", "comment"), line.split("|", 4), strict=True))
                   for line in sacct.splitlines() if GPU_METHOD in line]
    out["sbatch"] = (folder / "sbatch.calls").read_text().splitlines()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, repo: Path, snakemake_bin: str) -> dict:
    on_slurm, local = tmp_path_factory.mktemp("on_slurm"), tmp_path_factory.mktemp("local")
    for wd in (on_slurm, local):
        write_tiny_config(wd, max_rounds=ROUNDS)
    out: dict = {"dirs": (on_slurm, local), "cancelled": [], "rounds_at_cancel": []}
    # the local reference runs meanwhile: the SLURM jobs spend most of their time waiting on the scheduler
    with (local / "local.log").open("w") as local_log:
        reference = subprocess.Popen([snakemake_bin, "-s", str(repo / "Snakefile"), "--cores", "2", TARGET],
                                     cwd=local, stdout=local_log, stderr=subprocess.STDOUT)
    try:
        with LocalSlurmCluster(tmp_path_factory.mktemp("cluster")) as cluster:
            with (on_slurm / "first.log").open("w") as log:
                first = subprocess.Popen(cluster.command(*cluster_command(repo, snakemake_bin, "--retries", "1"),
                                                         cwd=on_slurm), env=cluster.env, stdout=log,
                                         stderr=subprocess.STDOUT)
                try:
                    after = 0
                    for _ in range(2):  # the original job, then its in-invocation retry
                        after = cancel_after_round(cluster, first, on_slurm / CANCELLED, after, out["cancelled"])
                        out["rounds_at_cancel"].append(after)
                    out["first_rc"] = first.wait(timeout=900)
                finally:
                    if first.poll() is None:
                        first.kill()
            with (on_slurm / "second.log").open("w") as log:
                out["second_rc"] = subprocess.run(cluster.command(*cluster_command(repo, snakemake_bin), cwd=on_slurm),
                                                  env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                                                  timeout=1800).returncode
            out["jobs"] = cluster.jobs()
            out["gpu"] = gpu_job(cluster, repo, snakemake_bin, on_slurm)
        out["local_rc"] = reference.wait(timeout=1800)
    finally:
        if reference.poll() is None:
            reference.kill()
    for name, wd in (("first", on_slurm), ("second", on_slurm), ("local", local)):
        out[f"{name}_log"] = (wd / f"{name}.log").read_text()
    return out


def test_first_invocation_retried_once_then_stopped(runs: dict):
    assert runs["first_rc"] != 0, runs["first_log"][-3000:]
    k1, k2 = runs["rounds_at_cancel"]
    assert 1 <= k1 < k2 < ROUNDS  # both attempts killed mid-run, the retry after progressing past k1
    for job_id in runs["cancelled"]:
        assert f"SLURM-job '{job_id}' failed, SLURM status is: 'CANCELLED'" in runs["first_log"]


def test_every_job_ran_as_a_slurm_job(runs: dict):
    assert runs["second_rc"] == 0, runs["second_log"][-3000:]
    completed: dict[str, int] = {}
    for job in runs["jobs"]:
        rule = job["comment"].removeprefix("rule_").split("_wildcards_")[0]
        if job["state"] == "COMPLETED":
            completed[rule] = completed.get(rule, 0) + 1
    assert completed == EXPECTED_RULES, runs["jobs"]
    assert "localrule" not in runs["first_log"] + runs["second_log"]
    v2_training = [j for j in runs["jobs"] if "train_federated" in j["comment"] and "past_v2" in j["comment"]]
    assert [j["state"].split()[0] for j in v2_training] == ["CANCELLED", "CANCELLED", "COMPLETED"]
    assert [j["id"] for j in v2_training[:2]] == runs["cancelled"]


def test_cancelled_training_resumed_from_its_checkpoints(runs: dict):
    on_slurm, _ = runs["dirs"]
    k1, k2 = runs["rounds_at_cancel"]
    report = json.loads((on_slurm / CANCELLED / "report.json").read_text())
    assert report["resumed_at_rounds"] == [k1, k2] and report["rounds"] == ROUNDS
    rounds = range(1, ROUNDS + 1)
    # Snakemake clears a rule log before a job runs: the rule log holds the last attempt only...
    last = (on_slurm / "logs/train/past_v2/seed11.log").read_text()
    assert last.splitlines()[0].endswith(f"after round {k2}")
    assert [f"round {r}/{ROUNDS}:" in last for r in rounds] == [r > k2 for r in rounds]
    # ...and the killed attempts' stories are in their SLURM job logs, which the plugin keeps for failed jobs
    slurm_logs = on_slurm / ".snakemake/slurm_logs/rule_train_federated/past_v2_11"
    for job_id, start, end in zip(runs["cancelled"], (0, k1), (k1, k2), strict=True):
        killed = (slurm_logs / f"{job_id}.log").read_text()
        assert f"STEP {job_id}.0 ON" in killed and "CANCELLED" in killed
        assert (f"after round {start}" in killed) == (start > 0)
        assert not any(f"round {r}/{ROUNDS}:" in killed for r in rounds if r <= start or r > end)
        assert all(f"round {r}/{ROUNDS}:" in killed for r in rounds if start < r < end)  # `end` may die unlogged


def test_outputs_equal_a_local_run(runs: dict):
    assert runs["local_rc"] == 0, runs["local_log"][-3000:]
    on_slurm, here = runs["dirs"]
    identical = ["results/manifest/manifest.csv", "results/stain/descriptors.csv",
                 *(f"results/predictions/{m}/seed11/{c}.csv" for m in ("fedavg_peft", "past_v2")
                   for c in ("test", "external", "holdout"))]
    for rel in identical:
        assert sha256(on_slurm / rel) == sha256(here / rel), rel
    a, b = (json.loads((d / TARGET).read_text()) for d in (on_slurm, here))
    a.pop("provenance"), b.pop("provenance")
    assert a == b
    for method in ("fedavg_peft", "past_v2"):
        rows = [(d / f"results/train/{method}/seed11/history.csv").read_text().splitlines() for d in (on_slurm, here)]
        # everything but the wall-clock column
        assert [r.rsplit(",", 1)[0] for r in rows[0]] == [r.rsplit(",", 1)[0] for r in rows[1]]


def test_a_gpu_job_goes_to_the_gpu_partition_and_stops_on_a_gpu_torch_cannot_use(runs: dict):
    """Slurm allots the job the node's GPU (a device file torch cannot use: CUDA_VISIBLE_DEVICES=0, a CPU
    build of torch); the job stops naming the cause instead of training on the CPU. With train.device: cpu
    the same job runs through the GPU partition and completes."""
    gpu = runs["gpu"]
    assert gpu["refused_rc"] != 0, gpu["refused_log"][-3000:]
    refused, done = gpu["jobs"][0], gpu["jobs"][-1]
    assert [j["state"].split()[0] for j in gpu["jobs"]] == ["FAILED", "COMPLETED"], (gpu["jobs"], gpu["on_cpu_log"][-4000:])
    on_slurm, _ = runs["dirs"]
    job_log = (on_slurm / f".snakemake/slurm_logs/rule_train_federated/{GPU_METHOD}_11/{refused['id']}.log").read_text()
    assert "DeviceUnavailable: this job declares 1 GPU(s)" in job_log and "built without CUDA" in job_log
    assert gpu["on_cpu_rc"] == 0, gpu["on_cpu_log"][-3000:]
    for job in (refused, done):
        assert job["partition"] == GPU_PARTITION and "gres/gpu=1" in job["tres"], job
    submitted = [c for c in gpu["sbatch"] if "rule_train_federated" in c]
    assert len(submitted) == 2 and all(f"-p {GPU_PARTITION}" in c and "--gpus=1" in c for c in submitted), submitted
    assert not any("--ntasks-per-gpu" in c for c in submitted)
    assert all("--cpus-per-gpu" in c and "--cpus-per-task" not in c for c in submitted), submitted
    report = json.loads((on_slurm / GPU_RUN / "report.json").read_text())
    assert report["runtime"]["device"] == "cpu" and report["rounds"] == ROUNDS
