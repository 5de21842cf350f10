"""The real Snakefile on an LC25000-layout folder of augmentation families too small for its targets.

``representatives`` keeps one image per family, so the targets cannot be met: ``snakemake all``
must stop at the manifest stage with the demand/available error and run no training job.
``whole_families`` must build the exact counts with no family across two partitions.
"""

from __future__ import annotations

import csv
import json
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO
from PIL import Image

from fedhisto.manifest.stage import boundary

pytestmark = pytest.mark.e2e

FOLDERS = {"ACA": "lung_aca", "Normal": "lung_n", "SCC": "lung_scc"}
TARGETS = {"clients": {"C1": [6, 3, 0], "C2": [0, 6, 6], "C3": [3, 0, 3]},
           "validation": [3, 3, 3], "test": [3, 3, 3]}
DIHEDRAL = (None, Image.Transpose.FLIP_LEFT_RIGHT, Image.Transpose.ROTATE_90, Image.Transpose.ROTATE_180,
            Image.Transpose.FLIP_TOP_BOTTOM, Image.Transpose.ROTATE_270, Image.Transpose.TRANSPOSE,
            Image.Transpose.TRANSVERSE)


def lc25000_families(root: Path, families: int = 6) -> dict[str, str]:
    """``lung_aca/ lung_n/ lung_scc/`` of rendered originals and their flipped / rotated relatives
    (3 or 5 per family, scattered numbering like LC25000); returns relpath -> true family."""
    from fedhisto.synth.stain_styles import SITE_STYLES, render_rgb
    from fedhisto.synth.tissue import tissue

    truth = {}
    for c, (label, folder) in enumerate(FOLDERS.items()):
        sizes = [3 + (f * 2) % 4 for f in range(families)]
        numbers = np.random.default_rng(c).permutation(sum(sizes)) + 1
        n = 0
        for f, size in enumerate(sizes):
            rng = np.random.default_rng([c, f])
            original = Image.fromarray(render_rgb(*tissue(label, rng, 112, 1.0), SITE_STYLES["site1"], rng))
            for t in DIHEDRAL[:size]:
                name = f"{folder}/{folder.replace('_', '')}{numbers[n]}.jpeg"
                (root / folder).mkdir(parents=True, exist_ok=True)
                (original if t is None else original.transpose(t)).save(root / name, quality=95)
                truth[f"lc25000/{name}"] = f"{label}-{f}"
                n += 1
    return truth


def real_config(workdir: Path, data: Path, policy: str) -> None:
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["cohort"] = {"mode": "real", "real": {"sources": [{"kind": "lc25000", "root": str(data), "site": "lc25000"}]}}
    cfg["clearance"].update(family_policy=policy, n_features=150, neighbours_per_image=6)  # 72 images: keep it quick
    cfg["manifest"]["client_sites"] = {k: ["lc25000"] for k in TARGETS["clients"]}
    cfg["manifest"]["targets"] = TARGETS
    cfg["model"]["pretrain"]["enabled"] = False  # nothing past the manifest is wanted here
    cfg["model"]["encoder"]["require_pretrained"] = False
    cfg["train"].update(methods=["fedavg_peft"], seeds=[11], ablations=[], comparator_seeds=None,
                        max_rounds=1)
    (workdir / "config").mkdir(parents=True)
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(cfg))


def run(snakemake_bin: str, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([snakemake_bin, "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "2", *args],
                          capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("lc25000") / "lung_image_sets"
    return root, lc25000_families(root)


def test_representatives_stop_at_the_manifest_and_train_nothing(tmp_path: Path, data, snakemake_bin: str):
    real_config(tmp_path, data[0], "representatives")
    proc = run(snakemake_bin, tmp_path, "all")
    log = proc.stdout + proc.stderr + (tmp_path / "logs/manifest/build_manifest.log").read_text()
    assert proc.returncode != 0
    assert "Error in rule build_manifest" in log
    assert "manifest.targets do not fit" in log and "need 15, available 6  <-- short" in log
    assert "clearance.family_policy: whole_families" in log and "manifest.allow_scaling: true" in log
    assert not (tmp_path / "results/manifest/manifest.csv").exists()
    assert not (tmp_path / "results/train").exists() and "rule train_federated:" not in log


def test_whole_families_build_exact_counts_without_family_edges_across(tmp_path: Path, data, snakemake_bin: str):
    real_config(tmp_path, data[0], "whole_families")
    proc = run(snakemake_bin, tmp_path, "results/manifest/composition.csv")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "results/manifest"
    with (out / "composition.csv").open() as fh:
        comp = {(r["partition"], r["subset"]): [int(r["ACA"]), int(r["Normal"]), int(r["SCC"])]
                for r in csv.DictReader(fh)}
    for client, pool in TARGETS["clients"].items():
        assert comp[(client, "pool")] == pool
    assert comp[("validation", "all")] == TARGETS["validation"] and comp[("test", "all")] == TARGETS["test"]
    summary = json.loads((out / "manifest.json").read_text())
    assert summary["scale_factor"] == 1.0 and not summary["scaled"]
    with (out / "source_composition.csv").open() as fh:  # one source: every validation / test image is lc25000's
        by_source = {(r["partition"], r["source"]): [int(r["ACA"]), int(r["Normal"]), int(r["SCC"])]
                     for r in csv.DictReader(fh)}
    assert by_source[("validation", "lc25000")] == TARGETS["validation"]
    assert by_source[("test", "lc25000")] == TARGETS["test"]
    assert summary["source_audit"] == {"stratify_by_source": False, "single_source_classes": []}
    assert summary["boundary_audit"]["cross_boundary_family_edges"] == []
    with (out / "manifest.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    where: dict[str, set[str]] = defaultdict(set)
    for r in rows:  # by the families clearance found and by the true ones
        if r["split"] != "unused":
            where[r["family"]].add(boundary(r))
            where[data[1][r["relpath"]]].add(boundary(r))
    assert len(where) > 12 and all(len(b) == 1 for b in where.values())
    with (tmp_path / "results/clearance/edges.csv").open() as fh:
        confirmed = [e for e in csv.DictReader(fh) if e["decision"] == "confirmed"]
    placed = {r["relpath"]: boundary(r) for r in rows if r["split"] != "unused"}
    assert confirmed and not [e for e in confirmed if e["a"] in placed and e["b"] in placed
                              and placed[e["a"]] != placed[e["b"]]]
