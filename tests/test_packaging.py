"""The project's own hygiene: README / CI agreement, no conda route, ruff, snakemake --lint."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import assert_lint_clean


def readme_commands(repo: Path) -> list[str]:
    text = (repo / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    return [b.strip() for b in blocks[:2]]


def ci_lanes(repo: Path) -> list[tuple[str, str]]:
    """(name, command) of every ``lane`` / ``start`` line of .ci/run, in order."""
    lanes = re.findall(r"^(?:lane|start) ([\w-]+) '(.*)'$", (repo / ".ci/run").read_text(), flags=re.M)
    assert lanes, ".ci/run declares no lanes"
    return lanes


def _steps(command: str) -> list[str]:
    """A lane's steps: its ``&&`` parts without venv activation and the per-lane pytest basetemp."""
    parts = [re.sub(r"^PYTEST_ADDOPTS=\S+ ", "", p.strip()) for p in command.split(" && ")]
    return [p for p in parts if not p.startswith(". .venv")]


def test_readme_opens_with_run_and_test_commands_and_ci_runs_the_test_one(repo: Path):
    run_cmd, test_cmd = readme_commands(repo)
    assert "pip install -r envs/cpu.txt && pip install -e . &&" in run_cmd
    assert "snakemake --cores" in run_cmd and " all" in run_cmd
    assert "pip install -r envs/cpu-test.txt && pip install -e \".[test]\" &&" in test_cmd and "pytest" in test_cmd
    lanes = ci_lanes(repo)
    # the README's test command runs verbatim (the proofs run beside it, each in its own lane)
    assert ("test", test_cmd) in lanes
    text = (repo / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    ci_steps = [step for _, command in lanes for step in _steps(command)]
    for marker in ("pytest -m slurm", "pytest -m flower", "pytest -m zoo", "pytest -m study"):
        proof = next(b.strip() for b in blocks if marker in b)
        if marker in ("pytest -m flower", "pytest -m zoo"):  # a venv of its own: a lock first, as the test command
            assert re.search(r"python3 -m venv \S+ && \. \S+ && pip install -r envs/\S+\.txt && ", proof), proof
        # every step of the README's proof runs in CI, in the README's order (pip may be called by path)
        steps = _steps(proof)
        positions = [next((k for k, c in enumerate(ci_steps) if step in c), None) for step in steps]
        assert None not in positions, f"{marker}: a step of the README's proof is not in .ci/run: {steps} vs {ci_steps}"
        assert positions == sorted(positions), f"{marker}: .ci/run runs the README's steps out of order"


def test_every_venv_ci_makes_is_installed_from_a_lock_first(repo: Path):
    """CI installs what the README installs: each lane that makes a venv installs one of envs/'s locks into
    it before anything else (the README's test command does so verbatim; a proof's own install steps then
    find everything in place), and tests/test_envs.py compares each venv's pip freeze with its lock."""
    locks = {}
    for name, command in ci_lanes(repo):
        made = re.search(r"python3 -m venv (\S+)", command)
        if made:
            pips = re.findall(r"(?:^| )(?:\S*/)?pip install (.*?)(?: && |$)", command)
            assert pips and pips[0].startswith("-r envs/"), f"lane {name}: installs {pips[:1]} before a lock"
            lock = pips[0].removeprefix("-r ").split()[0]
            assert (repo / lock).is_file(), f"lane {name}: no {lock}"
            locks[name] = lock
    assert locks == {"test": "envs/cpu-test.txt", "flower": "envs/cpu-all.txt", "zoo": "envs/zoo.txt"}


def test_readme_cluster_command_is_the_one_the_slurm_test_runs(repo: Path):
    sys.path.insert(0, str(repo / "tests"))
    from test_slurm import README_COMMAND

    assert f"```bash\n{README_COMMAND}\n```" in (repo / "README.md").read_text()


# Rule files whose `conda:` lines are still to go (with common.smk's ENV): none once experiments.smk is done.
CONDA_PENDING: set[str] = set()


def test_no_conda_route_is_declared_or_offered(repo: Path):
    """The workflow runs in the environment it is installed in: no rule declares a conda env (an env that
    installs the package from this checkout cannot work from the copy Snakemake makes of it, and conda
    channels are out of CI's reach), and no guide offers `--sdm conda`. envs/conda.yaml is for a user's
    own environment (tests/test_envs.py), never a rule's."""
    # the rules' old env file stays only while a rule file still names it (Snakemake records it for every
    # finished job)
    assert (repo / "envs/fedhisto.yaml").exists() == bool(CONDA_PENDING)
    for smk in [*(repo / "workflow").rglob("*.smk"), repo / "workflow/site/Snakefile", repo / "Snakefile"]:
        if smk.name not in CONDA_PENDING:
            assert not re.search(r"^\s*conda:", smk.read_text(), flags=re.M), f"{smk}: declares a conda env"
    for doc in [repo / "README.md", *(repo / "docs").glob("*.md")]:
        if doc.name != "changelog.md":
            text = doc.read_text()
            assert not re.search(r"(--sdm|--sw-deployment-method|--use-conda)\b", text), f"{doc.name} offers conda"


def test_license_file_is_the_one_pyproject_declares(repo: Path):
    declared = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["license"]
    assert declared == {"text": "MIT"}
    assert (repo / "LICENSE").read_text().startswith("MIT License\n")


def test_ruff_clean(repo: Path):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff not installed: pip install -e '.[test]'")
    proc = subprocess.run([ruff, "check", "src", "tests", "scripts", "benchmarks"], cwd=repo, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_snakemake_lint_clean(repo: Path, snakemake_bin: str):
    proc = subprocess.run([snakemake_bin, "--lint"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert_lint_clean(proc)


def test_every_rule_declares_log_and_resources(repo: Path):
    for smk in (repo / "workflow/rules").glob("*.smk"):
        text = smk.read_text()
        for rule in re.split(r"\n\s*rule ", text)[1:]:
            name = rule.split(":")[0]
            for directive in ("log:", "resources:", "mem_mb=", "runtime=", "gpu="):
                assert directive in rule, f"{smk.name}: rule {name} lacks {directive}"


def test_console_script_runs():
    proc = subprocess.run([sys.executable, "-m", "fedhisto.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("fedhisto ")


def test_slurm_profile_maps_declared_resources(repo: Path, snakemake_bin: str):
    profile = yaml.safe_load((repo / "workflow/profiles/slurm/config.yaml").read_text())
    assert profile["executor"] == "slurm" and profile["retries"] >= 1 and profile["latency-wait"] >= 30
    assert "slurm_account" not in profile["default-resources"]  # left to the user, documented in README
    # sacct's "CANCELLED by <uid>" is not recognised by the plugin: a scancel'd job would be waited on forever
    assert profile["slurm-status-command"] == "squeue"
    proc = subprocess.run([snakemake_bin, "--workflow-profile", "workflow/profiles/slurm", "-n", "all"], cwd=repo,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
