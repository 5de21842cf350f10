"""benchmarks/pipeline_timeline.py reads what Snakemake itself writes: a real run of a small workflow, whose log
format is Snakemake's, gives back its jobs, their order through the files and their walls; the warm server's
lines give each warm job's CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("pipeline_timeline", REPO / "benchmarks/pipeline_timeline.py")
timeline = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = timeline  # its dataclasses look their module up
SPEC.loader.exec_module(timeline)

# a -> b -> d is the long chain (1 + 3 + 1 s); c (1 s) runs beside b; d needs b and c
SNAKEFILE = """
rule all:
    input: "d.txt"
rule a:
    output: "a.txt"
    log: "logs/a.log"
    shell: "sleep 1; date '+%Y-%m-%d %H:%M:%S,000 x INFO start' > {log}; touch {output}"
rule b:
    input: "a.txt"
    output: "b.txt"
    shell: "sleep 3; touch {output}"
rule c:
    input: "a.txt"
    output: "c.txt"
    shell: "sleep 1; touch {output}"
rule d:
    input: "b.txt", "c.txt"
    output: "d.txt"
    shell: "sleep 1; touch {output}"
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory, snakemake_bin: str) -> Path:
    wd = tmp_path_factory.mktemp("timeline")
    (wd / "Snakefile").write_text(SNAKEFILE)
    proc = subprocess.run([snakemake_bin, "--cores", "2", "all"], cwd=wd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wd


def test_jobs_walls_and_the_critical_path_come_from_snakemakes_own_log(run: Path):
    doc = timeline.build(run, None, 2, None)
    rules = {r["rule"]: r for r in doc["rules"]}
    assert doc["jobs"] == 4 and set(rules) == {"a", "b", "c", "d"}  # `all` is a target, not work
    for rule, seconds in (("a", 1), ("b", 3), ("c", 1), ("d", 1)):
        assert abs(rules[rule]["wall_s"] - seconds) <= 1.5, (rule, rules[rule])  # Snakemake stamps to the second
    assert [p["rule"] for p in doc["critical_path"]] == ["a", "b", "d"]
    assert rules["b"]["first_start_s"] == rules["c"]["first_start_s"]  # side by side on two cores
    use = doc["cores_use"]
    assert 5 <= use["span_s"] <= 15  # the chain's 5 s and Snakemake's own time between jobs
    # a and d run alone (one core idle, ~2 s), and c's core idles while b finishes (~2 s)
    assert 2 <= use["idle_core_s"] <= 2 * use["span_s"] - 6, use
    assert "logs/a.log" in {j["log"] for j in doc["timeline"]}


def test_warm_lines_give_each_jobs_cpu(tmp_path: Path):
    jobs = [timeline.Job(1, "train_federated", 0.0, 10.0, log="logs/train/x/seed11.log"),
            timeline.Job(2, "make_report", 10.0, 12.0, log="logs/report/make_report.log")]
    (tmp_path / "warm.log").write_text(
        "2026-12-05 23:51:31,095 __main__ INFO warm server: fedhisto.train.stage:run_train for pid 10 in child 11 "
        "(log logs/train/x/seed11.log, job process 0.35 s CPU before the call)\n"
        "2026-12-05 23:51:41,000 __main__ INFO warm server: child 11 ended (exit 0), peak resident memory 0.40 GiB, "
        "CPU 8.50 s user 0.25 s system\n")
    timeline.add_warm_cpu(jobs, tmp_path / "warm.log")
    assert jobs[0].cpu_s == pytest.approx(0.35 + 8.50 + 0.25) and jobs[0].peak_gib == 0.40
    assert jobs[1].cpu_s is None  # no warm line: its CPU is not known


def test_the_warm_servers_log_lines_are_the_ones_the_timeline_reads(tmp_path: Path):
    """The server's own two lines, as it logs them (its format strings and its reaping of a real child)."""
    import logging
    import os
    import time

    from fedhisto.infra import warm_server

    path = tmp_path / "warm.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    warm_server.log.addHandler(handler)
    level = warm_server.log.level
    warm_server.log.setLevel(logging.INFO)
    try:
        pid = os.fork()
        if pid == 0:  # a child that spends a little CPU, as a job would
            sum(i * i for i in range(200_000))
            os._exit(0)
        warm_server.log.info(warm_server.STARTED_LINE, "m:f", 10, pid, "logs/x.log", 0.5)
        deadline = time.monotonic() + 30
        while "ended" not in path.read_text() and time.monotonic() < deadline:
            warm_server._reap()
            time.sleep(0.05)
    finally:
        warm_server.log.removeHandler(handler)
        warm_server.log.setLevel(level)
        handler.close()
    job = timeline.Job(1, "x", 0.0, 1.0, log="logs/x.log")
    timeline.add_warm_cpu([job], path)
    assert job.process_cpu_s == 0.5 and job.child_cpu_s is not None and 0 < job.child_cpu_s < 10
