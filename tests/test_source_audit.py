"""Source audit of the manifest (validation / test by source x class, single-source flags) and
``manifest.stratify_by_source`` on a small two-source corpus (LC25000-like with SCC, WSSS4LUAD-like without)."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from fedhisto.clearance.stage import FAMILY_COLUMNS
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import load_config
from fedhisto.manifest.source_audit import allocate, single_source_classes, source_composition
from fedhisto.manifest.stage import build_manifest, run_manifest
from fedhisto.realdata.sources import SourceRow, write_sources_csv

# images per (source, class); families of `family_size` members
CORPUS = {("lc25000", "ACA"): 60, ("lc25000", "Normal"): 50, ("lc25000", "SCC"): 70,
          ("wsss4luad", "ACA"): 40, ("wsss4luad", "Normal"): 80}
TARGETS = {"clients": {"C1": [8, 8, 8], "C2": [6, 6, 0]}, "validation": [20, 20, 20], "test": [15, 15, 15]}


def two_source_corpus(tmp_path: Path, family_size: int = 1) -> tuple[Path, Path, Path]:
    src, fam = [], []
    for (site, label), n in CORPUS.items():
        for k in range(n):
            rel = f"{site}/{label}/img{k:03d}.png"
            src.append(SourceRow(path=f"/x/{rel}", relpath=rel, label=label, source=site, site=site,
                                 cohort="internal"))
            fam.append({"relpath": rel, "path": f"/x/{rel}", "label": label, "site": site, "cohort": "internal",
                        "sha256": f"sha-{rel}", "family": f"fam-{site}-{label}-{k // family_size}",
                        "family_size": family_size, "representative": k % family_size == 0, "keep": True})
    write_sources_csv(tmp_path / "sources.csv", src)
    with (tmp_path / "families.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FAMILY_COLUMNS)
        w.writeheader()
        w.writerows(fam)
    (tmp_path / "edges.csv").write_text("a,b,decision,stage\n")
    return tmp_path / "sources.csv", tmp_path / "families.csv", tmp_path / "edges.csv"


def config(stratify: bool | None = None, policy: str = "representatives"):
    manifest = {"client_sites": {"C1": ["lc25000"], "C2": ["wsss4luad"]}, "targets": TARGETS}
    if stratify is not None:
        manifest["stratify_by_source"] = stratify
    return load_config({"cohort": {"mode": "real", "real": {"sources": [
        {"kind": "lc25000", "root": "/x", "site": "lc25000"}, {"kind": "wsss4luad", "root": "/y", "site": "wsss4luad"}]}},
        "clearance": {"family_policy": policy}, "manifest": manifest})


def by_source(rows: list[dict], partition: str) -> dict[tuple[str, str], int]:
    return dict(Counter((r["site"], r["label"]) for r in rows if r["partition"] == partition))


def test_allocate_is_proportional_with_largest_remainder():
    assert allocate(20, {"lc25000": 52, "wsss4luad": 40}) == {"lc25000": 11, "wsss4luad": 9}  # 11.30 / 8.70
    assert allocate(3, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}
    assert allocate(2, {"b": 1, "a": 1, "c": 1}) == {"a": 1, "b": 1, "c": 0}  # equal remainders: by name
    assert allocate(5, {"a": 0, "b": 7}) == {"a": 0, "b": 5}
    assert allocate(0, {"a": 3}) == {"a": 0}


def test_source_composition_counts_and_the_single_source_flag(tmp_path: Path):
    rows, _ = build_manifest(*two_source_corpus(tmp_path)[:2], config())
    table = {(r["partition"], r["source"]): (r["ACA"], r["Normal"], r["SCC"], r["total"]) for r in source_composition(rows)}
    assert table[("C1", "lc25000")] == (8, 8, 8, 24) and ("C1", "wsss4luad") not in table
    assert table[("C2", "wsss4luad")] == (6, 6, 0, 12) and ("C2", "lc25000") not in table
    for partition, count in (("validation", 20), ("test", 15)):
        lc, ws = table[(partition, "lc25000")], table[(partition, "wsss4luad")]
        assert [a + b for a, b in zip(lc[:3], ws[:3], strict=True)] == [count] * 3
        assert ws[2] == 0 and lc[2] == count  # SCC: the LC25000-like source is the only one that has it
        assert by_source(rows, partition) == {k: v for k, v in {
            ("lc25000", "ACA"): lc[0], ("lc25000", "Normal"): lc[1], ("lc25000", "SCC"): lc[2],
            ("wsss4luad", "ACA"): ws[0], ("wsss4luad", "Normal"): ws[1]}.items() if v}
    flags = single_source_classes(rows)
    assert [(f["partition"], f["class"], f["source"], f["images"]) for f in flags] == [
        ("validation", "SCC", "lc25000", 20), ("test", "SCC", "lc25000", 15)]
    assert flags[0]["partition_sources"] == ["lc25000", "wsss4luad"]


def test_stratification_mirrors_each_class_leftovers_and_changes_the_draw(tmp_path: Path):
    paths = two_source_corpus(tmp_path)[:2]
    plain, _ = build_manifest(*paths, config())
    strat, _ = build_manifest(*paths, config(stratify=True))
    # clients draw before validation / test and do not depend on the option
    assert [(r["relpath"], r["split"]) for r in plain if r["client"]] == \
        [(r["relpath"], r["split"]) for r in strat if r["client"]]
    # leftovers per class after the clients: ACA lc 52 / wsss 34, Normal lc 42 / wsss 74, SCC lc 62
    expected = {"validation": {("lc25000", "ACA"): 12, ("wsss4luad", "ACA"): 8,      # 20 x 52/86 = 12.09
                               ("lc25000", "Normal"): 7, ("wsss4luad", "Normal"): 13,  # 20 x 42/116 = 7.24
                               ("lc25000", "SCC"): 20},
                "test": {("lc25000", "ACA"): 9, ("wsss4luad", "ACA"): 6,             # 15 x 52/86 = 9.07
                         ("lc25000", "Normal"): 5, ("wsss4luad", "Normal"): 10,        # 15 x 42/116 = 5.43
                         ("lc25000", "SCC"): 15}}
    for partition, want in expected.items():
        assert by_source(strat, partition) == want
    # the seeded unstratified draw lands elsewhere on this corpus (so the option cannot be silently ignored)
    assert any(by_source(plain, p) != want for p, want in expected.items())
    # off and unset are the same draw
    unset, _ = build_manifest(*paths, config(stratify=False))
    assert unset == plain


def test_stratified_whole_families_hit_exact_counts(tmp_path: Path):
    sources, families, _ = two_source_corpus(tmp_path, family_size=3)
    rows, _ = build_manifest(sources, families, config(stratify=True, policy="whole_families"))
    for partition, count in (("validation", 20), ("test", 15)):
        per_class = Counter(r["label"] for r in rows if r["partition"] == partition)
        assert per_class == {"ACA": count, "Normal": count, "SCC": count}
    where: dict[str, set] = {}
    for r in rows:
        if r["split"] != "unused":
            where.setdefault(r["family"], set()).add((r["partition"], r["split"]))
    assert all(len(b) == 1 for b in where.values())


def test_manifest_stage_writes_the_audit_and_default_identity_is_unchanged(tmp_path: Path):
    sources, families, edges = two_source_corpus(tmp_path)
    summary = run_manifest(sources, families, edges, config(), tmp_path / "out")
    with (tmp_path / "out" / "source_composition.csv").open() as fh:
        written = list(csv.DictReader(fh))
    assert {(r["partition"], r["source"]) for r in written} >= {("validation", "lc25000"), ("test", "wsss4luad")}
    assert (tmp_path / "out" / "source_composition.csv.prov.json").exists()
    audit = json.loads((tmp_path / "out" / "manifest.json").read_text())["source_audit"]
    assert audit == summary["source_audit"] and audit["stratify_by_source"] is False
    assert [f["class"] for f in audit["single_source_classes"]] == ["SCC", "SCC"]
    # the option enters the manifest's identity only when on
    assert "stratify_by_source" not in stage_block(config(), "manifest")["manifest"]
    assert stage_block(config(stratify=False), "manifest") == stage_block(config(), "manifest")
    assert stage_block(config(stratify=True), "manifest")["manifest"]["stratify_by_source"] is True


@pytest.mark.parametrize("partition_sources", [["lc25000"], ["lc25000", "wsss4luad"]])
def test_no_flag_when_the_partition_has_one_source_or_every_class_has_two(partition_sources):
    rows = [{"partition": "validation", "label": label, "site": site}
            for label in ("ACA", "Normal", "SCC") for site in partition_sources]
    assert single_source_classes(rows) == []
