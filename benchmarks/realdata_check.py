"""Run the real-data path end to end on the real images in ``../shared/realdata``.

Usage: ``python benchmarks/realdata_check.py [--shared ../shared] [--keep DIR]``. Builds a
temporary ``cohort.mode: real`` config and runs the real Snakefile (``snakemake all``) in a
scratch folder: clearance, manifest (whole families, explicit small targets), stain,
pretraining of the tiny encoder, training (two methods, one seed, two rounds), prediction,
metrics, bootstrap and report. Prints what each stage produced. Skips cleanly when the shared
folder is absent; nothing from it is copied anywhere.

- internal, site ``lc25000``: the LC25000 sample as an LC25000-layout folder (symlinks in the
  scratch folder) without the two families held out below: 7 augmentation families of 7-10;
- internal, site ``wsss4luad``: the WSSS4LUAD training tiles (tumour -> ACA, normal -> Normal,
  stroma-only excluded and listed): single images, so client C2 can have a holdout;
- external, site ``heldout``: a ``kind: csv`` source whose rows are absolute paths elsewhere,
  made portable with ``relpath_root``: LC25000 families ``lung_n:84`` and ``lung_scc:196`` and
  the two 768 px copies of ``lungaca1`` (the bootstrap needs every class in the external cohort).

A family never spans two partitions, so validation and test take one family per class each
and the clients get what is left: C1 part of one ACA family (a pool of 5: no holdout, which
would split the family and need another), C2 the WSSS4LUAD tiles (one ACA holdout). No client holds
SCC: this checks that every stage runs on real pixels, not how well anything classifies.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"clients": {"C1": [5, 0, 0], "C2": [2, 1, 0]}, "validation": [3, 3, 3], "test": [3, 3, 3]}
EXTERNAL_FAMILIES = ("lung_n:84", "lung_scc:196")


def config(real: Path, work: Path) -> dict:
    with (real / "MANIFEST.tsv").open() as fh:
        listed = [r for r in csv.DictReader(fh, delimiter="\t") if r["path"].startswith("lc25000-sample/")]
    held = [real / r["path"] for r in listed if r["family"] in EXTERNAL_FAMILIES]
    lc = work / "lc25000"
    for r in listed:
        if r["family"] not in EXTERNAL_FAMILIES:
            link = lc / r["path"].removeprefix("lc25000-sample/")
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(real / r["path"])
    ext = work / "external.csv"
    with ext.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label"])
        for p in held:
            w.writerow([str(p), {"lung_n": "Normal", "lung_scc": "SCC"}[p.parent.name]])
        for p in sorted((real / "lc25000-originals-768").glob("*.jpeg")):
            w.writerow([str(p), "ACA"])
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["cohort"] = {"mode": "real", "real": {"sources": [
        {"kind": "lc25000", "root": str(lc), "site": "lc25000"},
        {"kind": "wsss4luad", "root": str(real / "wsss4luad-sample/luad_training_examples"), "site": "wsss4luad",
         "unmapped": "exclude"},
        {"kind": "csv", "root": str(ext), "site": "heldout", "cohort": "external", "relpath_root": str(real)},
    ]}}
    cfg["clearance"]["family_policy"] = "whole_families"
    cfg["manifest"].update(client_sites={"C1": ["lc25000"], "C2": ["wsss4luad"]},
                           holdout_fraction={"C1": 0.1, "C2": 0.5}, targets=TARGETS)
    cfg["model"]["pretrain"].update(images_per_class=24, epochs=2)
    cfg["train"].update(methods=["fedavg_peft", "past_v2"], seeds=[11], ablations=[], max_rounds=2, patience=2)
    cfg["bootstrap"].update(resamples=200, ablation_resamples=200)
    return cfg


def family_truth(real: Path) -> dict[str, str]:
    with (real / "MANIFEST.tsv").open() as fh:
        return {f"lc25000/{r['path'].removeprefix('lc25000-sample/')}": r["family"]
                for r in csv.DictReader(fh, delimiter="\t") if r["path"].startswith("lc25000-sample/")}


def report(work: Path, real: Path) -> None:
    res = work / "results"
    cohort = json.loads((res / "cohort/summary.json").read_text())
    print("[cohort]", json.dumps({k: v for k, v in cohort.items() if k != "provenance"}))
    with (res / "cohort/excluded.csv").open() as fh:
        for r in csv.DictReader(fh):
            print("[cohort] excluded:", Path(r["path"]).name, "-", r["reason"])
    print("[clearance]", (res / "clearance/report.md").read_text().split("\n", 2)[2].strip().replace("\n", "\n[clearance] "))
    with (res / "clearance/families.csv").open() as fh:
        fams = list(csv.DictReader(fh))
    truth = family_truth(real)
    found: dict[str, set] = defaultdict(set)
    for r in fams:
        if r["relpath"] in truth:
            found[truth[r["relpath"]]].add(r["family"])
    print(f"[clearance] LC25000 sample: {len(found)} true families, each found as one family: "
          f"{sum(len(v) == 1 for v in found.values())} / {len(found)}; "
          f"found families {len({r['family'] for r in fams if r['relpath'] in truth})}")
    summary = json.loads((res / "manifest/manifest.json").read_text())
    print(f"[manifest] policy {summary['family_policy']}, scale factor {summary['scale_factor']}, "
          f"allow_scaling {summary['allow_scaling']}, images {summary['images']}, cross-boundary family edges "
          f"{len(summary['boundary_audit']['cross_boundary_family_edges'])}, exact matches "
          f"{len(summary['boundary_audit']['cross_boundary_exact_matches'])}")
    with (res / "manifest/composition.csv").open() as fh:
        for r in csv.DictReader(fh):
            if r["total"] != "0":
                print(f"[manifest] {r['partition']:>11} {r['subset']:<12} ACA {r['ACA']:>3} Normal {r['Normal']:>3} "
                      f"SCC {r['SCC']:>3}")
    with (res / "manifest/manifest.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    where: dict[str, set] = defaultdict(set)
    for r in rows:
        if r["split"] != "unused" and r["relpath"] in truth:
            where[truth[r["relpath"]]].add(f"{r['client']}:{r['split']}" if r["client"] else r["split"])
    print(f"[manifest] true LC25000 families placed: {len(where)}, spanning two partitions: "
          f"{sum(len(v) > 1 for v in where.values())}")
    stain = json.loads((res / "stain/descriptors.json").read_text())
    for client, v in stain["clients"].items():
        print(f"[stain] {client}: tissue pixels {v.get('tissue_pixels')}, raw descriptor "
              f"{[round(x, 3) for x in v['raw'][:4]]}...")
    print(f"[stain] fallback clients: {stain.get('fallback_clients')}")
    for status in sorted(res.glob("train/*/seed*/status.json")):
        rep = json.loads((status.parent / "report.json").read_text())
        print(f"[train] {status.parent.parent.name}/{status.parent.name}: {json.loads(status.read_text())['status']}, "
              f"rounds {rep['rounds']}, validation macro-F1 {rep['validation_macro_f1']:.4f}")
    for pred in sorted(res.glob("predictions/*/seed*/*.csv")):
        n = sum(1 for _ in pred.open()) - 1
        print(f"[predict] {pred.relative_to(res / 'predictions')}: {n} images")
    with (res / "metrics/summary.csv").open() as fh:
        for r in csv.DictReader(fh):
            print(f"[metrics] {r['method']}: test macro-F1 {float(r['test_macro_f1_mean']):.4f}")
    for b in sorted(res.glob("bootstrap/*.json")):
        m = json.loads(b.read_text())["metrics"]["macro_f1"]
        print(f"[bootstrap] {b.stem}: external macro-F1 difference {m['difference']:.4f} "
              f"[{m['ci_low']:.4f}, {m['ci_high']:.4f}], {m['n_resamples']} resamples")
    print("[report]", (res / "tables/table2_partitions.md").read_text().splitlines()[2])
    print("[report] tables:", ", ".join(sorted(p.name for p in (res / "tables").glob("*.md"))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", default=str(REPO.parent / "shared"))
    parser.add_argument("--keep", default=None, help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument("--cores", default="2")
    args = parser.parse_args()
    real = Path(args.shared) / "realdata"
    if not (real / "lc25000-sample").is_dir():
        print(f"skipped: {real} not found")
        return 0
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fedhisto-realdata-"))
    (work / "config").mkdir(parents=True, exist_ok=True)
    (work / "config/config.yaml").write_text(yaml.safe_dump(config(real, work)))
    snakemake = shutil.which("snakemake") or str(Path(sys.executable).parent / "snakemake")
    t0 = time.time()
    proc = subprocess.run([snakemake, "-s", str(REPO / "Snakefile"), "-d", str(work), "--cores", args.cores, "all"],
                          capture_output=True, text=True)
    print(f"snakemake all: exit {proc.returncode} in {time.time() - t0:.0f} s (workdir {work})")
    if proc.returncode:
        print(proc.stdout[-3000:] + proc.stderr[-3000:])
        return proc.returncode
    report(work, real)
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
