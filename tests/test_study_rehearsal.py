"""The rehearsal of the study (`pytest -m study`): the exact config/paper.yaml plus tests/study_rehearsal.yaml
(scale only, and three stated settings: crop 56, two methods, no zoom views) on folders made here in the three datasets'
real layouts, with the real HIBOU-B architecture randomly initialised and saved as a local snapshot folder
(model.encoder.local_dir; the strict loader takes it as the hub's snapshot, require_pretrained stays true),
run by `snakemake --cores 2` through every stage to the report, and through export and classify (two folders:
the external LungHist700 tiles and the internal LC25000 ones) so the domain check and the site-robustness
measures run at the study's encoder shape."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from study_layouts import build_study_folders, save_random_hibou_b, sources_overlay

pytestmark = pytest.mark.study
REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "tests/study_rehearsal.yaml"
WSSS4LUAD_TILES = {"ACA": 6, "ACA+stroma": 2, "Normal": 8, "stroma": 1, "mixed": 1}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, snakemake_bin: str) -> dict:
    base = tmp_path_factory.mktemp("study")
    folders = build_study_folders(base / "data", lc25000_per_class=18, wsss4luad_tiles=WSSS4LUAD_TILES,
                                  lunghist700_per_class=4)
    encoder = save_random_hibou_b(base / "hibou-b")
    paths = base / "paths.yaml"  # only the test-made paths
    paths.write_text(yaml.safe_dump({"cohort": {"real": {"sources": sources_overlay(folders)}},
                                     "model": {"encoder": {"local_dir": str(encoder)}},
                                     "classify": {"folders": {"external": str(folders.lunghist700),
                                                              "internal": str(folders.lc25000)}}}))
    workdir = base / "run"
    command = ["snakemake", "--cores", "2", "all", "--configfile", "config/paper.yaml", str(OVERLAY), str(paths)]
    t0 = time.monotonic()
    proc = subprocess.run([snakemake_bin, *command[1:], "-s", str(REPO / "Snakefile"), "-d", str(workdir)], cwd=REPO,
                          capture_output=True, text=True, timeout=3600)  # a hang guard, not a speed check
    console = proc.stdout + proc.stderr
    (base / "console.txt").write_text(console)
    assert proc.returncode == 0, console[-8000:]
    report = subprocess.run([snakemake_bin, "--report", "report.html", "--configfile", "config/paper.yaml",
                             str(OVERLAY), str(paths), "-s", str(REPO / "Snakefile"), "-d", str(workdir)], cwd=REPO,
                            capture_output=True, text=True, timeout=1800)
    assert report.returncode == 0, (report.stdout + report.stderr)[-8000:]
    return {"workdir": workdir, "folders": folders, "encoder": encoder, "console": console,
            "wall_s": time.monotonic() - t0}


def _csv(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_the_cohort_reads_the_three_real_layouts(rehearsal: dict):
    out = rehearsal["workdir"] / "results/cohort"
    rows = _csv(out / "sources.csv")
    by_source = {s: sum(r["source"] == s for r in rows) for s in ("lc25000", "wsss4luad", "lunghist700")}
    # LC25000 18 per class; WSSS4LUAD's 16 single-class tiles (the stroma and mixed tiles map to no class);
    # LungHist700 4 per class, the external cohort
    assert by_source == {"lc25000": 54, "wsss4luad": 16, "lunghist700": 12}
    assert {r["cohort"] for r in rows if r["source"] == "lunghist700"} == {"external"}
    excluded = _csv(out / "excluded.csv")
    assert len(excluded) == 2 and all("maps to no study class" in r["reason"] for r in excluded)


def test_table2_is_built_exactly_as_the_overlay_asks(rehearsal: dict):
    targets = yaml.safe_load(OVERLAY.read_text())["manifest"]["targets"]
    comp = {(r["partition"], r["subset"]): [int(r[c]) for c in ("ACA", "Normal", "SCC")]
            for r in _csv(rehearsal["workdir"] / "results/manifest/composition.csv")}
    for client, counts in targets["clients"].items():
        assert comp[(client, "pool")] == counts
    assert comp[("validation", "all")] == targets["validation"] and comp[("test", "all")] == targets["test"]
    assert comp[("external", "all")] == [4, 4, 4]
    table2 = _csv(rehearsal["workdir"] / "results/tables/table2_partitions.csv")
    assert table2, "Table 2 as built is empty"
    summary = json.loads((rehearsal["workdir"] / "results/manifest/manifest.json").read_text())
    audit = summary["boundary_audit"]
    assert audit["cross_boundary_family_edges"] == [] and audit["cross_boundary_metadata_edges"] == []
    # WSSS4LUAD's slides (three tiles each, from the names) and LungHist700's patients (data.csv): every one
    # of them in one partition, said so by the audit
    assert audit["patients_spanning_partitions"] == []
    assert audit["patients_or_slides"] > 0 and set(audit["metadata_edges_by_origin"]) == {"slide", "patient"}
    assert "0 of " in audit["result"] and "patients/slides span two partitions" in audit["result"]


def test_every_run_trained_hibou_b_from_the_local_snapshot_and_predicted(rehearsal: dict):
    from fedhisto.infra.provenance import digest_path

    wd = rehearsal["workdir"]
    weights = digest_path(rehearsal["encoder"])  # the test-made snapshot's files, as the run identity records them
    for method in ("fedavg_peft", "past_v2"):
        for seed in (11, 22):
            run = wd / f"results/train/{method}/seed{seed}"
            assert json.loads((run / "status.json").read_text())["status"] == "finalised"
            report = json.loads((run / "report.json").read_text())
            assert report["rounds"] == 1 and 0.0 <= report["validation_macro_f1"] <= 1.0
            assert report["identity"]["encoder_digest"] == weights
            external = _csv(wd / f"results/predictions/{method}/seed{seed}/external.csv")
            assert len(external) == 12
    assert not (wd / "results/pretrain").exists()  # HIBOU-B is loaded, never pretrained here


def test_the_bootstrap_and_the_report_are_there(rehearsal: dict):
    wd = rehearsal["workdir"]
    assert sorted(p.name for p in (wd / "results/bootstrap").glob("*.json")) == ["v2_vs_fedavg.json"]
    doc = json.loads((wd / "results/bootstrap/v2_vs_fedavg.json").read_text())
    assert doc["n_resamples"] == 200 and doc["method"] == "past_v2" and doc["reference"] == "fedavg_peft"
    assert set(doc["metrics"]) >= {"macro_f1"}
    # the external cohort's patients are known (LungHist700's table): a patient-level interval beside the image one
    assert doc["interval_unit"] == "image" and doc["patient_level"]["n_patients"] == 6
    units = {r["unit"] for r in _csv(wd / "results/tables/table6_bootstrap.csv")}
    assert units == {"image", "patient"}
    for name in ("table4_internal.csv", "table5_external.csv", "table6_bootstrap.csv"):
        assert _csv(wd / "results/tables" / name), name
    html = (wd / "report.html").read_text(errors="replace")
    assert "table2_partitions.csv" in html


def test_no_job_was_killed_and_the_cost_is_recorded(rehearsal: dict):
    """Each job's peak resident memory, as the warm server saw its children end (logs/warm_server.log),
    written beside the run for docs/data.md's cost line; none ended by a signal."""
    server_log = (rehearsal["workdir"] / "logs/warm_server.log").read_text()
    peaks = [float(m) for m in re.findall(r"peak resident memory ([0-9.]+) GiB", server_log)]
    assert peaks and "killed for memory" not in rehearsal["console"]
    assert not re.search(r"ended \(signal", server_log)
    (rehearsal["workdir"] / "cost.json").write_text(json.dumps({"wall_s": round(rehearsal["wall_s"], 1),
                                                                  "peak_job_rss_gib": max(peaks)}))


def test_the_domain_check_and_site_robustness_run_at_the_studys_encoder_shape(rehearsal: dict):
    from safetensors.numpy import load_file

    wd = rehearsal["workdir"]
    rows = _csv(wd / "results/metrics/robustness.csv")
    adapted = {(r["method"], r["seed"]) for r in rows if r["encoder_state"] == "adapted"}
    assert adapted == {(m, s) for m in ("fedavg_peft", "past_v2") for s in ("11", "22")}
    assert [r["method"] for r in rows if r["encoder_state"] == "frozen"] == ["frozen_encoder"]
    for r in rows:  # nine test images: RI where croma can score them, a stated reason otherwise; APD needs more
        assert r["n_images"] == "9" and (0.0 <= float(r["ri"]) <= 1.0 if r["ri"] else "RI needs" in r["apd_note"])
        assert r["apd"] == "" and r["apd_note"]
    emb = load_file(str(wd / "results/predictions/past_v2/seed11/embeddings.safetensors"))
    assert emb["frozen"].shape == (9, 768) and emb["adapted/global"].shape == (9, 768)  # HIBOU-B's width
    assert (wd / "results/figures/robustness.png").exists() and _csv(wd / "results/tables/robustness.csv")
    pkg = wd / "results/export/past_v2"
    for s in (11, 22):
        assert load_file(str(pkg / f"members/seed{s}/domain.safetensors"))["covariance"].shape == (768, 768)
    card = json.loads((pkg / "model_card.json").read_text())
    assert card["data"]["kind"] == "real" and not card["demonstration"]  # real layouts, a hub encoder's snapshot
    assert {s["source"] for s in card["data"]["sources"]} == {"lc25000", "wsss4luad", "lunghist700"}
    for name in ("external", "internal"):
        preds = _csv(wd / f"results/classify/{name}/predictions.csv")
        assert preds and all(r["ood_score"] and r["in_domain"] in ("yes", "no") for r in preds)
        domain = json.loads((wd / f"results/classify/{name}/predictions.json").read_text())["domain"]
        assert domain["verdict"] in ("within", "outside") and domain["line"].startswith("the folder is")
