"""Patients and slides: read from real layouts, kept inside one partition, audited at the boundary.

Sources: WSSS4LUAD names carry the slide, LungHist700's metadata table the patient, a CSV source
an optional ``patient`` column; every inconsistency is an error naming the file or key, and the
cohort stage writes nothing. Partitions: slides holding tumour and normal tiles and patients with
several images never span two partitions while Table 2's counts hold exactly; the boundary audit
says so, and reports a patient moved across a boundary.
"""

from __future__ import annotations

import csv
import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from conftest import write_image

from fedhisto.clearance.stage import FAMILY_COLUMNS
from fedhisto.cohort.stage import run_cohort
from fedhisto.config.study import CohortConfig, SourceSpec, load_config
from fedhisto.manifest.stage import boundary, boundary_audit, build_manifest, run_manifest
from fedhisto.realdata.listing import sources_inventory
from fedhisto.realdata.sources import (
    SourceError,
    collect_sources,
    read_lunghist700,
    read_sources_csv,
    read_wsss4luad,
)

LH_NAMES = ("aca_bd_20x_1.jpg", "aca_md_40x_2.jpg", "nor_20x_3.jpg", "scc_pd_40x_7.jpg")


def lunghist700(root: Path, table: str | None) -> Path:
    for k, name in enumerate(LH_NAMES):
        write_image(root / "images" / name, seed=k, fmt="JPEG")
    if table is not None:
        (root / "data.csv").write_text(table)
    return root


GOOD_TABLE = ("superclass,subclass,resolution,image_id,patient_id\n"
              "aca,bd,20x,aca_bd_20x_1,3\naca,md,40x,aca_md_40x_2,3\nnor,,20x,nor_20x_3.jpg,5\nscc,pd,40x,scc_pd_40x_7,8\n")


def test_lunghist700_patients_from_the_metadata_table(tmp_path: Path):
    root = lunghist700(tmp_path / "LungHist700", GOOD_TABLE)
    rows, excluded = read_lunghist700(SourceSpec(kind="lunghist700", root=str(root), metadata="data.csv",
                                                 cohort="external"))
    assert {Path(r.path).name: r.patient for r in rows} == {
        "aca_bd_20x_1.jpg": "patient:3", "aca_md_40x_2.jpg": "patient:3", "nor_20x_3.jpg": "patient:5",
        "scc_pd_40x_7.jpg": "patient:8"}
    # the table is a file of the source but not an image: listed with its reason, never read as one
    assert [(Path(e.path).name, e.reason) for e in excluded] == [("data.csv", "the source's patient metadata table")]


def test_wsss4luad_slide_from_the_name(tmp_path: Path):
    root = tmp_path / "1.training"
    for k, name in enumerate(("436219-7159-48057-[1, 0, 0].png", "436219-9328-56427-[1, 1, 0].png",
                              "1003370-5631-18822-[0, 0, 1].png")):
        write_image(root / name, k)
    rows, _ = read_wsss4luad(SourceSpec(kind="wsss4luad", root=str(root)))
    assert [r.patient for r in rows] == ["slide:1003370", "slide:436219", "slide:436219"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("table names an image not on disk", r"data\.csv:6: names image 'aca_bd_20x_99', which is not on disk"),
        ("image without a patient row", r"scc_pd_40x_7\.jpg: no patient row in .*data\.csv"),
        ("two patients claim one image", r"nor_20x_3\.jpg: two patients claim this image: '5' \(.*data\.csv:4\) "
                                         r"and '6' \(.*data\.csv:6\)"),
        ("table without patient_id", r"data\.csv: needs a 'patient_id' column"),
        ("empty patient id", r"data\.csv:3: image 'aca_md_40x_2' has an empty patient_id"),
        ("table missing", r"patient metadata table not found: .*data\.csv"),
        ("wsss4luad name without slide", r"WSSS4LUAD: file name carries no slide id: .*tile-\[1, 0, 0\]\.png"),
        ("csv patient column with an empty cell", r"list\.csv:3: image .*b\.png has an empty 'patient'"),
    ],
)
def test_bad_patient_metadata_stops_the_cohort_stage_and_writes_nothing(tmp_path: Path, case: str, message: str):
    lines = GOOD_TABLE.splitlines(keepends=True)
    tables = {"table names an image not on disk": GOOD_TABLE + "aca,bd,20x,aca_bd_20x_99,4\n",
              "image without a patient row": "".join(lines[:4]),
              "two patients claim one image": GOOD_TABLE + "nor,,20x,nor_20x_3,6\n",
              "table without patient_id": GOOD_TABLE.replace("patient_id", "case"),
              "empty patient id": GOOD_TABLE.replace("aca_md_40x_2,3", "aca_md_40x_2,"),
              "table missing": None}
    if case.startswith("wsss4luad"):
        write_image(tmp_path / "w" / "436219-7159-48057-[1, 0, 0].png")
        write_image(tmp_path / "w" / "tile-[1, 0, 0].png", 1)
        spec = {"kind": "wsss4luad", "root": str(tmp_path / "w")}
    elif case.startswith("csv"):
        write_image(tmp_path / "img" / "a.png")
        write_image(tmp_path / "img" / "b.png", 1)
        (tmp_path / "list.csv").write_text("path,label,patient\nimg/a.png,ACA,p1\nimg/b.png,ACA,\n")
        spec = {"kind": "csv", "root": str(tmp_path / "list.csv")}
    else:
        root = lunghist700(tmp_path / "LungHist700", tables[case])
        spec = {"kind": "lunghist700", "root": str(root), "metadata": "data.csv", "cohort": "external"}
    out = tmp_path / "results" / "cohort"
    with pytest.raises(SourceError, match=message):
        run_cohort(CohortConfig(mode="real", real={"sources": [spec]}), out)
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


def test_metadata_only_for_lunghist700():
    with pytest.raises(ValueError, match="metadata applies only to kind lunghist700"):
        SourceSpec(kind="lc25000", root="/x", metadata="data.csv")


def test_non_image_files_are_listed_and_counted_never_dropped(tmp_path: Path, caplog):
    lc = tmp_path / "lung_image_sets"
    for k, folder in enumerate(("lung_aca", "lung_n", "lung_scc")):
        write_image(lc / folder / f"{folder}1.jpeg", k, fmt="JPEG")
    (lc / "lung_n" / ".DS_Store").write_bytes(b"\0\0")
    (lc / "lung_aca" / "Thumbs.db").write_bytes(b"\0")
    (lc / "README.txt").write_text("LC25000")
    (lc / "lung_scc" / "._lung_scc1.jpeg").write_bytes(b"\0\5\26\7")  # macOS AppleDouble: image name, no pixels
    write_image(lc / ".ipynb_checkpoints" / "lung_aca1.jpeg", fmt="JPEG")  # a hidden folder beside the classes
    cohort = CohortConfig(mode="real", real={"sources": [{"kind": "lc25000", "root": str(lc)}]})
    with caplog.at_level("WARNING"):
        summary = run_cohort(cohort, tmp_path / "out")
    with (tmp_path / "out" / "excluded.csv").open() as fh:
        listed = {Path(r["path"]).name: r["reason"] for r in csv.DictReader(fh)}
    assert set(listed) == {".DS_Store", "Thumbs.db", "README.txt", "._lung_scc1.jpeg", "lung_aca1.jpeg"}
    assert listed["Thumbs.db"].startswith("not an image file (extension '.db'")
    assert listed[".DS_Store"].startswith("hidden file") and listed["README.txt"] == "not in a class folder"
    assert summary["excluded"] == 5 and summary["images"] == 3
    assert "5 file(s) below the sources are not read" in caplog.text
    # an image extension that does not decode still stops the stage by name
    (lc / "lung_n" / "broken.jpeg").write_bytes(b"not a jpeg")
    with pytest.raises(SourceError, match=r"unreadable image: .*broken\.jpeg"):
        collect_sources(cohort.real.sources)


@pytest.mark.parametrize(
    ("change", "reruns"),
    [("nothing", False), ("add", True), ("remove", True), ("edit", True), ("touch", True),
     ("add a README", True), ("edit the metadata table", True)],
)
def test_inventory_changes_with_every_file(tmp_path: Path, change: str, reruns: bool):
    import os

    root = lunghist700(tmp_path / "LungHist700", GOOD_TABLE)
    specs = [SourceSpec(kind="lunghist700", root=str(root), metadata="data.csv")]
    before = sources_inventory(specs)
    image = root / "images" / LH_NAMES[0]
    if change == "add":
        write_image(root / "images" / "nor_20x_9.jpg", 9, fmt="JPEG")
    elif change == "remove":
        image.unlink()
    elif change == "edit":
        write_image(image, 99, fmt="JPEG")
    elif change == "touch":
        st = image.stat()
        os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    elif change == "add a README":
        (root / "README.md").write_text("x")
    elif change == "edit the metadata table":
        (root / "data.csv").write_text(GOOD_TABLE.replace(",8\n", ",9\n"))
    assert (sources_inventory(specs) != before) is reruns


# ----------------------------------------------------------------------------------------- partitions
TARGETS = {"clients": {"C1": [8, 8, 8], "C2": [10, 10, 0]}, "validation": [10, 10, 4], "test": [10, 10, 4]}


def patient_corpus(tmp_path: Path, policy: str = "whole_families") -> tuple[Path, Path, Path]:
    """LC25000-like (families of 2, a patient column as a CSV source would give) and WSSS4LUAD-like
    slides of 6 tiles each, tumour and normal tiles on one slide (as real slides have)."""
    src, fam = [], []

    def add(site: str, label: str, rel: str, patient: str, family: str, representative: bool = True) -> None:
        src.append({"path": f"/x/{rel}", "relpath": rel, "label": label, "source": site, "site": site,
                    "cohort": "internal", "differentiation": "", "magnification": "", "patient": patient})
        fam.append({"relpath": rel, "path": f"/x/{rel}", "label": label, "site": site, "cohort": "internal",
                    "sha256": f"sha-{rel}", "family": family, "family_size": 2 if site == "lc" else 1,
                    "representative": representative, "keep": representative or policy == "whole_families"})

    for label in ("ACA", "Normal", "SCC"):
        for k in range(40):  # patients of 4 images, 2 families of 2 copies each
            add("lc", label, f"lc/{label}/{k:03d}.jpeg", f"patient:{label}{k // 4}", f"fam-lc-{label}-{k // 2}",
                k % 2 == 0)
    for s in range(24):
        for t in range(6):  # slide s: tiles 0-2 tumour (ACA), 3-5 normal: one slide, two classes
            label = "ACA" if t < 3 else "Normal"
            add("ws", label, f"ws/{s}-{t}-{t}-[x].png", f"slide:{s}", f"fam-ws-{s}-{t}")
    with (tmp_path / "sources.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(src[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(src)
    with (tmp_path / "families.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FAMILY_COLUMNS)
        w.writeheader()
        w.writerows(fam)
    (tmp_path / "edges.csv").write_text("a,b,decision,stage\n")
    return tmp_path / "sources.csv", tmp_path / "families.csv", tmp_path / "edges.csv"


def corpus_config(policy: str = "whole_families"):
    return load_config({"cohort": {"mode": "real", "real": {"sources": [
        {"kind": "csv", "root": "/x.csv", "site": "lc"}, {"kind": "wsss4luad", "root": "/y", "site": "ws"}]}},
        "clearance": {"family_policy": policy},
        "manifest": {"client_sites": {"C1": ["lc"], "C2": ["ws"]}, "targets": TARGETS}})


def spans(rows: list[dict]) -> dict[str, set[str]]:
    where: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        if r["split"] != "unused" and r.get("patient"):
            where[f"{r['site']}/{r['patient']}"].add(boundary(r))
    return where


@pytest.mark.parametrize("policy", ["whole_families", "representatives"])
def test_no_patient_or_slide_spans_two_partitions_and_counts_hold(tmp_path: Path, policy: str):
    paths = patient_corpus(tmp_path, policy)
    summary = run_manifest(*paths, corpus_config(policy), tmp_path / "out")
    with (tmp_path / "out" / "manifest.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    placed = spans(rows)
    assert placed and all(len(b) == 1 for b in placed.values()), {k: b for k, b in placed.items() if len(b) > 1}
    # several images of a patient / tiles of a slide share a partition (the test is about groups, not singletons)
    sizes = Counter(f"{r['site']}/{r['patient']}" for r in rows if r["split"] != "unused")
    assert max(sizes[k] for k in placed if k.startswith("ws/")) >= 4 and max(sizes[k] for k in placed
                                                                            if k.startswith("lc/")) >= 2
    # Table 2 as configured, exactly
    count = Counter((r["client"] or r["partition"], r["label"]) for r in rows if r["split"] != "unused")
    for client, pool in TARGETS["clients"].items():
        assert [count[(client, c)] for c in ("ACA", "Normal", "SCC")] == pool
    for split in ("validation", "test"):
        assert [count[(split, c)] for c in ("ACA", "Normal", "SCC")] == TARGETS[split]
    audit = json.loads((tmp_path / "out" / "manifest.json").read_text())["boundary_audit"]
    assert audit == summary["boundary_audit"]
    assert audit["patients_spanning_partitions"] == [] and audit["cross_boundary_metadata_edges"] == []
    assert audit["patients_or_slides"] == 30 + 24
    # a star per group: 4 images per patient (2 under representatives, which keeps one of each family)
    per_patient = 3 if policy == "whole_families" else 1
    assert audit["metadata_edges_by_origin"] == {"patient": 30 * per_patient, "slide": 24 * 5}
    assert audit["result"].endswith("; 0 of 54 patients/slides span two partitions")
    with (tmp_path / "out" / "metadata_edges.csv").open() as fh:
        edges = list(csv.DictReader(fh))
    assert {e["origin"] for e in edges} == {"patient", "slide"} and len(edges) == 30 * per_patient + 120


def test_without_patients_the_same_draw_splits_slides(tmp_path: Path):
    """The control: the seeded draw of this corpus, blind to patients, puts slides in two partitions;
    so the test above passes because of the patient units, not by luck."""
    from dataclasses import replace

    from fedhisto.realdata.sources import write_sources_csv

    sources, families, _ = patient_corpus(tmp_path)
    write_sources_csv(tmp_path / "blind.csv", [replace(r, patient="") for r in read_sources_csv(sources)])
    rows, _ = build_manifest(tmp_path / "blind.csv", families, corpus_config())
    patient = {r.relpath: f"{r.site}/{r.patient}" for r in read_sources_csv(sources)}
    where: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        if r["split"] != "unused":
            where[patient[r["relpath"]]].add(boundary(r))
    assert sum(len(b) > 1 for b in where.values()) >= 5


def test_boundary_audit_reports_a_patient_moved_across(tmp_path: Path):
    paths = patient_corpus(tmp_path)
    rows, _ = build_manifest(paths[0], paths[1], corpus_config())
    slide = next(r for r in rows if r["site"] == "ws" and r["split"] == "validation")
    mate = next(r for r in rows if r.get("patient") == slide["patient"] and r["site"] == "ws" and r is not slide
                and r["split"] == "validation")
    mate.update(partition="test", split="test")
    audit = boundary_audit(rows, paths[2])
    assert audit["patients_spanning_partitions"] == [f"ws/{slide['patient']}"]
    assert len(audit["cross_boundary_metadata_edges"]) >= 1


def test_patient_column_only_when_a_source_names_patients(tmp_path: Path):
    """A cohort without patients keeps its sources.csv and manifest.csv bytes (the embedded default)."""
    from fedhisto.realdata.sources import SOURCES_COLUMNS, SourceRow, write_sources_csv

    rows = [SourceRow(path="/a", relpath="s/a", label="ACA", source="csv", site="s", cohort="internal")]
    write_sources_csv(tmp_path / "a.csv", rows)
    assert (tmp_path / "a.csv").read_text().splitlines()[0] == ",".join(SOURCES_COLUMNS)
    assert read_sources_csv(tmp_path / "a.csv") == rows
