"""Table 2 as built beside the study's, and the scaling line the report carries."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from test_manifest import TABLE2, write_corpus

from fedhisto import CLASSES
from fedhisto.config.study import load_config
from fedhisto.manifest.source_audit import SOURCE_COLUMNS, single_source_classes, source_composition
from fedhisto.manifest.stage import build_manifest, composition
from fedhisto.manifest.targets import study_table2, write_table2


def _write(tmp_path: Path, rows: list[dict], summary: dict) -> tuple[Path, Path]:
    comp = composition(rows)
    with (tmp_path / "composition.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["partition", "subset", *CLASSES, "total"])
        w.writeheader()
        w.writerows(comp)
    with (tmp_path / "source_composition.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=SOURCE_COLUMNS)
        w.writeheader()
        w.writerows(source_composition(rows))
    summary = {**summary, "source_audit": {"stratify_by_source": False,
                                           "single_source_classes": single_source_classes(rows)}}
    (tmp_path / "manifest.json").write_text(json.dumps(summary))
    return tmp_path / "composition.csv", tmp_path / "manifest.json"


def test_study_table2_is_the_papers():
    t = study_table2()
    for client, (pool, opt, hold) in TABLE2.items():
        assert (t[(client, "pool")], t[(client, "optimisation")], t[(client, "holdout")]) == (pool, opt, hold)
    assert t[("validation", "all")] == (472, 474, 473) and t[("test", "all")] == (473, 475, 472)


def test_table2_as_built_beside_the_study_and_scaling_is_stated(tmp_path: Path):
    sources, families, _ = write_corpus(tmp_path, "paper")
    rows, info = build_manifest(sources, families, load_config({"cohort": {"synthetic": {"profile": "paper"}}}))
    comp_csv, summary = _write(tmp_path, rows, {**info, "dataset_identity": "x"})
    line = write_table2(comp_csv, summary, tmp_path / "tables")
    assert line.startswith("Targets built as configured")
    with (tmp_path / "tables/table2_partitions.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 17
    assert all(r[f"{c}_built"] == r[f"{c}_study"] for r in table for c in CLASSES)
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "scale_factor": 0.11, "scaled": True}))
    line = write_table2(comp_csv, summary, tmp_path / "tables")
    md = (tmp_path / "tables/table2_partitions.md").read_text()
    assert "WARNING: targets were SCALED by 0.110000" in md and line in md
    assert "| C1 | pool | 229 | 208 | 293 | 730 | 229 | 208 | 293 | 730 | 0.11 |" in md
