"""The real Snakefile reruns the cohort stage, and what follows it, when an image is added, and
nothing when the folder is unchanged (``params.inventory`` of ``collect_sources``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, write_image

pytestmark = pytest.mark.e2e

TARGETS = {"clients": {"C1": [3, 3, 3]}, "validation": [1, 1, 1], "test": [1, 1, 1]}


def setup(workdir: Path) -> Path:
    data = workdir / "lung_image_sets"
    for c, folder in enumerate(("lung_aca", "lung_n", "lung_scc")):
        for k in range(5):
            write_image(data / folder / f"{folder}{k}.jpeg", seed=10 * c + k, size=64, fmt="JPEG")
    (data / "lung_n" / ".DS_Store").write_bytes(b"\0")
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["cohort"] = {"mode": "real", "real": {"sources": [{"kind": "lc25000", "root": str(data)}]}}
    cfg["manifest"]["client_sites"] = {"C1": ["lc25000"]}
    cfg["manifest"]["targets"] = TARGETS
    cfg["manifest"]["holdout_fraction"] = {"C1": 0.2}
    cfg["model"]["pretrain"]["enabled"] = False
    cfg["model"]["encoder"]["require_pretrained"] = False
    (workdir / "config").mkdir()
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    return data


def snakemake(bin_: str, workdir: Path, *args: str) -> str:
    proc = subprocess.run([bin_, "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "1", *args,
                           "results/manifest/manifest.csv"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def planned(bin_: str, workdir: Path) -> set[str]:
    out = snakemake(bin_, workdir, "-n")
    return {rule for rule in ("collect_sources", "audit_duplicates", "build_manifest") if f"rule {rule}:" in out}


def test_adding_an_image_reruns_cohort_and_after(tmp_path: Path, snakemake_bin: str):
    """Adding an image in e2e; editing, touching and removing change the same digest
    (test_patients.py::test_inventory_changes_with_every_file)."""
    data = setup(tmp_path)
    snakemake(snakemake_bin, tmp_path)
    assert planned(snakemake_bin, tmp_path) == set()  # unchanged folder: nothing reruns
    write_image(data / "lung_aca" / "lung_aca9.jpeg", seed=99, size=64, fmt="JPEG")
    assert planned(snakemake_bin, tmp_path) == {"collect_sources", "audit_duplicates", "build_manifest"}
    excluded = (tmp_path / "results/cohort/excluded.csv").read_text()
    assert ".DS_Store" in excluded and "hidden file" in excluded
