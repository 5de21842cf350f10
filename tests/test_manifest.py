from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fedhisto.clearance.stage import FAMILY_COLUMNS
from fedhisto.config.study import load_config
from fedhisto.manifest.stage import (
    ManifestError,
    boundary,
    boundary_audit,
    build_manifest,
    composition,
    dataset_identity,
    sample_id,
)
from fedhisto.manifest.targets import holdout_count
from fedhisto.realdata.sources import SourceRow, write_sources_csv
from fedhisto.synth.embedded_cohort import plan_cohort


@pytest.mark.parametrize(
    ("n", "frac", "expected"),
    [(229, 0.1, 23), (485, 0.1, 48), (65, 0.1, 6), (1181, 0.15, 177), (1831, 0.15, 275), (58, 0.1, 6),
     (5, 0.1, 0), (2, 0.9, 1), (1, 0.5, 0), (15, 0.1, 2), (25, 0.1, 2), (0, 0.1, 0), (3, 0.15, 0)],
)
def test_holdout_rounding_is_half_to_even_and_keeps_one(n, frac, expected):
    assert holdout_count(n, frac) == expected


def write_corpus(tmp_path: Path, profile: str, copies_as_separate_families: bool = False) -> tuple[Path, Path, Path]:
    """sources.csv / families.csv / edges.csv for a synthetic plan, without rendering a pixel."""
    from fedhisto.config.study import SyntheticCohort

    members = plan_cohort(SyntheticCohort(profile=profile))
    rows = [SourceRow(path=f"/x/{m.relpath}", relpath=m.relpath, label=m.label, source="synthetic", site=m.site,
                      cohort=m.cohort, differentiation=m.differentiation, magnification=m.magnification)
            for m in members]
    write_sources_csv(tmp_path / "sources.csv", rows)
    by_key = {m.key: m for m in members}
    fam_rows, edges = [], []
    for m in members:
        root = by_key[m.source_key] if m.transform else m
        fam = f"fam-{root.key}"
        keep = not m.transform or (copies_as_separate_families and m.cohort == root.cohort)
        fam_rows.append({"relpath": m.relpath, "path": f"/x/{m.relpath}", "label": m.label, "site": m.site,
                         "cohort": m.cohort, "sha256": f"sha-{m.key}", "family": fam, "family_size": 1,
                         "representative": not m.transform, "keep": keep})
        if m.transform:
            edges.append({"a": root.relpath, "b": m.relpath, "decision": "confirmed", "stage": "descriptor"})
    with (tmp_path / "families.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FAMILY_COLUMNS)
        w.writeheader()
        w.writerows(fam_rows)
    with (tmp_path / "edges.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["a", "b", "decision", "stage"])
        w.writeheader()
        w.writerows(edges)
    return tmp_path / "sources.csv", tmp_path / "families.csv", tmp_path / "edges.csv"


TABLE2 = {  # (pool, optimisation, holdout) per client, ACA/Normal/SCC
    "C1": ((229, 208, 293), (206, 187, 264), (23, 21, 29)),
    "C2": ((485, 439, 65), (437, 395, 59), (48, 44, 6)),
    "C3": ((187, 172, 318), (168, 155, 286), (19, 17, 32)),
    "C4": ((64, 58, 553), (58, 52, 498), (6, 6, 55)),
    "C5": ((1181, 1831, 0), (1004, 1556, 0), (177, 275, 0)),
}


def test_paper_profile_reproduces_table2(tmp_path: Path):
    cfg = load_config({"cohort": {"synthetic": {"profile": "paper"}}})
    sources, families, edges = write_corpus(tmp_path, "paper")
    rows, info = build_manifest(sources, families, cfg)
    assert info["scale_factor"] == 1.0
    comp = {(r["partition"], r["subset"]): (r["ACA"], r["Normal"], r["SCC"]) for r in composition(rows)}
    for client, (pool, opt, hold) in TABLE2.items():
        assert comp[(client, "pool")] == pool
        assert comp[(client, "optimisation")] == opt
        assert comp[(client, "holdout")] == hold
    assert sum(comp[("all_clients", "optimisation")]) == 5325
    assert sum(comp[("all_clients", "holdout")]) == 758
    assert comp[("validation", "all")] == (472, 474, 473)
    assert comp[("test", "all")] == (473, 475, 472)
    assert comp[("external", "all")] == (280, 151, 260)
    assert ("unused", "all") not in comp
    assert sum(1 for r in rows if r["cohort"] == "internal") == 8922
    audit = boundary_audit(rows, edges)
    assert audit["cross_boundary_family_edges"] == [] and audit["cross_boundary_exact_matches"] == []


def test_partitions_are_deterministic_and_clients_use_their_sites(tmp_path: Path):
    cfg = load_config({})
    sources, families, _ = write_corpus(tmp_path, "small")
    a, _ = build_manifest(sources, families, cfg)
    b, _ = build_manifest(sources, families, cfg)
    assert a == b and dataset_identity(a) == dataset_identity(b)
    for r in a:
        if r["client"]:
            assert r["site"] == f"site{r['client'][1]}"
    assert all(r["label"] != "SCC" for r in a if r["client"] == "C5")
    assert a[0]["sample_id"] == sample_id(a[0]["relpath"])


def test_other_split_seed_other_assignment(tmp_path: Path):
    sources, families, _ = write_corpus(tmp_path, "small")
    a, _ = build_manifest(sources, families, load_config({}))
    b, _ = build_manifest(sources, families, load_config({"manifest": {"split_seed": 7}}))
    assert dataset_identity(a) != dataset_identity(b)


def test_boundary_audit_catches_family_and_exact_leaks(tmp_path: Path):
    rows = [
        {"relpath": "a", "client": "C1", "split": "optimisation", "partition": "C1", "sha256": "s1"},
        {"relpath": "b", "client": "C1", "split": "holdout", "partition": "C1", "sha256": "s2"},
        {"relpath": "c", "client": "", "split": "test", "partition": "test", "sha256": "s1"},
        {"relpath": "d", "client": "C1", "split": "optimisation", "partition": "C1", "sha256": "s4"},
    ]
    edges = tmp_path / "edges.csv"
    edges.write_text("a,b,decision,stage\na,b,confirmed,descriptor\na,d,confirmed,phash\nb,d,rejected,phash\n")
    audit = boundary_audit(rows, edges)
    assert [(e["a"], e["b"], tuple(e["boundaries"])) for e in audit["cross_boundary_family_edges"]] == [
        ("a", "b", ("C1:optimisation", "C1:holdout"))]
    assert audit["cross_boundary_exact_matches"] == ["s1"]


def _drop_site1_aca(families: Path, n: int = 10) -> None:
    with families.open() as fh:
        fams = list(csv.DictReader(fh))
    dropped = 0
    for r in fams:  # remove half of site1's ACA images
        if r["site"] == "site1" and r["label"] == "ACA" and r["keep"] == "True" and dropped < n:
            r["keep"] = "False"
            dropped += 1
    with families.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FAMILY_COLUMNS)
        w.writeheader()
        w.writerows(fams)


def test_too_small_corpus_stops_with_demand_against_available(tmp_path: Path):
    sources, families, _ = write_corpus(tmp_path, "small")
    _drop_site1_aca(families)
    with pytest.raises(ManifestError) as err:
        build_manifest(sources, families, load_config({}))
    msg = str(err.value)
    assert "sites ['site1'] for C1: need" in msg and "<-- short" in msg
    assert "ACA" in msg and "clearance.family_policy: whole_families" in msg and "manifest.allow_scaling: true" in msg


def test_scaling_only_when_allowed_and_recorded(tmp_path: Path, caplog):
    sources, families, _ = write_corpus(tmp_path, "small")
    _drop_site1_aca(families)
    with caplog.at_level("WARNING", logger="fedhisto.manifest.stage"):
        _, info = build_manifest(sources, families, load_config({"manifest": {"allow_scaling": True}}))
    assert 0 < info["scale_factor"] < 1 and info["scaled"] and info["allow_scaling"]
    assert info["targets"]["clients"]["C1"][0] <= 7
    assert info["requested_targets"]["clients"]["C1"] == list(load_config({}).partition_targets().clients["C1"])
    assert any(r["demand"] > r["available"] for r in info["shortfalls"])
    assert "EVERY target is scaled" in caplog.text


def write_family_corpus(tmp_path: Path, sizes: dict[str, list[int]], site: str = "lc25000") -> tuple[Path, Path]:
    """sources.csv / families.csv of LC25000-like augmentation families (every member kept)."""
    src, fam = [], []
    for label, family_sizes in sizes.items():
        for f, size in enumerate(family_sizes):
            for m in range(size):
                rel = f"{site}/{label}/f{f}_m{m}.jpeg"
                src.append(SourceRow(path=f"/x/{rel}", relpath=rel, label=label, source="lc25000", site=site,
                                     cohort="internal"))
                fam.append({"relpath": rel, "path": f"/x/{rel}", "label": label, "site": site, "cohort": "internal",
                            "sha256": f"sha-{rel}", "family": f"fam-{label}-{f}", "family_size": size,
                            "representative": m == 0, "keep": True})
    write_sources_csv(tmp_path / "sources.csv", src)
    with (tmp_path / "families.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FAMILY_COLUMNS)
        w.writeheader()
        w.writerows(fam)
    return tmp_path / "sources.csv", tmp_path / "families.csv"


def test_whole_families_hit_exact_counts_by_leaving_family_rests_unused(tmp_path: Path):
    # 40 families of 19-21 per class; counts that no combination of whole families can meet
    sizes = {c: [19 + (f % 3) for f in range(40)] for c in ("ACA", "Normal", "SCC")}
    sources, families = write_family_corpus(tmp_path, sizes)
    targets = {"clients": {"C1": [95, 37, 61], "C2": [23, 95, 0], "C3": [41, 13, 77]},
               "validation": [33, 31, 29], "test": [27, 35, 47]}
    cfg = load_config({"cohort": {"mode": "real", "real": {"sources": [{"kind": "lc25000", "root": "/x"}]}},
                       "clearance": {"family_policy": "whole_families"},
                       "manifest": {"client_sites": {"C1": ["lc25000"], "C2": ["lc25000"], "C3": ["lc25000"]},
                                    "targets": targets}})
    rows, info = build_manifest(sources, families, cfg)
    assert info["scale_factor"] == 1.0
    comp = {(r["partition"], r["subset"]): [r["ACA"], r["Normal"], r["SCC"]] for r in composition(rows)}
    for client, pool in targets["clients"].items():
        assert comp[(client, "pool")] == pool
        hold = [holdout_count(n, 0.1) for n in pool]
        assert comp[(client, "holdout")] == hold
    assert comp[("validation", "all")] == targets["validation"] and comp[("test", "all")] == targets["test"]
    where: dict[str, set] = {}
    for r in rows:
        if r["split"] != "unused":
            where.setdefault(r["family"], set()).add(boundary(r))
    assert where and all(len(b) == 1 for b in where.values())  # no family spans two partitions


def test_representatives_on_augmentation_families_name_the_ways_out(tmp_path: Path):
    sources, families = write_family_corpus(tmp_path, {c: [20] * 6 for c in ("ACA", "Normal", "SCC")})
    with families.open() as fh:
        fams = list(csv.DictReader(fh))
    for r in fams:
        r["keep"] = r["representative"]  # what clearance keeps under family_policy: representatives
    with families.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FAMILY_COLUMNS)
        w.writeheader()
        w.writerows(fams)
    cfg = load_config({"cohort": {"mode": "real", "real": {"sources": [{"kind": "lc25000", "root": "/x"}]}},
                       "manifest": {"client_sites": {"C1": ["lc25000"]},
                                    "targets": {"clients": {"C1": [10, 10, 10]}, "validation": [5, 5, 5],
                                                "test": [5, 5, 5]}}})
    with pytest.raises(ManifestError) as err:
        build_manifest(sources, families, cfg)
    msg = str(err.value)
    assert "ACA    sites ['lc25000'] for C1: need 10, available 6  <-- short" in msg
    assert "sites ['all internal sites'] for clients, validation, test: need 20, available 6" in msg
    assert "whole_families" in msg and "allow_scaling" in msg


def test_whole_families_stay_in_one_partition(tmp_path: Path):
    cfg = load_config({"clearance": {"family_policy": "whole_families"}})
    sources, families, edges = write_corpus(tmp_path, "small", copies_as_separate_families=True)
    with families.open() as fh:
        fams = list(csv.DictReader(fh))
    rows, _ = build_manifest(sources, families, cfg)
    assert len(rows) == sum(r["keep"] == "True" for r in fams) > 400  # every kept image is placed
    where: dict[str, set] = {}
    for r in rows:
        where.setdefault(r["family"], set()).add((r["partition"], r["split"]))
    multi = [f for f in where if sum(1 for r in rows if r["family"] == f) > 1]
    assert multi and all(len(where[f]) == 1 for f in multi)
    audit = boundary_audit(rows, edges)
    assert audit["cross_boundary_family_edges"] == [] and audit["cross_boundary_exact_matches"] == []


def test_a_stage_error_lands_in_the_rule_log(tmp_path: Path):
    import subprocess
    import sys

    code = ("from fedhisto.infra.job_logging import setup_logging; from fedhisto.manifest.stage import ManifestError; "
            f"setup_logging({str(tmp_path / 'x.log')!r}); raise ManifestError('need 15, available 6')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "ManifestError: need 15, available 6" in (tmp_path / "x.log").read_text()
