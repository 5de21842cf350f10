"""Partition targets against the corpus: do they fit, and Table 2 as built beside the study's.

The manifest stage never shrinks the study's Table 2 quietly. When the kept images cannot
fill the configured targets it stops with :func:`shortfall_message` (demand against what is
available, per class and site group, and the two ways out); only ``manifest.allow_scaling:
true`` lets it scale every target by one common factor, which is then logged as a warning,
recorded in ``manifest.json`` and stated above Table 2 as built (:func:`write_table2`).
"""

from __future__ import annotations

import csv
import json
import logging
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from fedhisto import CLASSES
from fedhisto.config.study import ManifestConfig, PartitionTargets

log = logging.getLogger(__name__)
ALL_INTERNAL = "all internal sites"


def demand_rows(targets: PartitionTargets, available: dict[str, Counter], client_sites: dict[str, list[str]],
                internal: Counter) -> list[dict]:
    """Demand against availability, per class and per group of sites clients draw from.

    One row per class and site group (the clients sharing those sites), plus one per class for
    everything drawn from the internal cohort (client pools, validation and test together).
    """
    rows = []
    for c, cls in enumerate(CLASSES):
        groups: dict[tuple[str, ...], list[str]] = defaultdict(list)
        for client in sorted(targets.clients):
            if targets.clients[client][c]:
                groups[tuple(sorted(client_sites.get(client, [])))].append(client)
        for sites, clients in sorted(groups.items()):
            demand = sum(targets.clients[k][c] for k in clients)
            have = sum(available[s][cls] for s in sites) if sites else internal[cls]
            rows.append({"class": cls, "sites": list(sites) or [ALL_INTERNAL], "for": clients,
                         "demand": demand, "available": have})
        total = sum(p[c] for p in targets.clients.values()) + targets.validation[c] + targets.test[c]
        if total:
            rows.append({"class": cls, "sites": [ALL_INTERNAL], "for": ["clients", "validation", "test"],
                         "demand": total, "available": internal[cls]})
    return rows


def fit_factor(rows: list[dict]) -> float:
    """Largest common factor <= 1 under which every demand fits what is available."""
    return min([1.0, *(r["available"] / r["demand"] for r in rows if r["demand"])])


def scale(targets: PartitionTargets, factor: float) -> PartitionTargets:
    def sc(counts) -> tuple[int, int, int]:
        return tuple(int(np.floor(n * factor)) for n in counts)  # type: ignore[return-value]

    clients = {k: sc(v) for k, v in targets.clients.items()}
    holdouts = None if targets.holdouts is None else {  # still one optimisation image per class left
        k: tuple(min(h, max(n - 1, 0)) for h, n in zip(sc(v), clients[k], strict=True))
        for k, v in targets.holdouts.items()}
    return PartitionTargets(clients=clients, validation=sc(targets.validation), test=sc(targets.test),
                            holdouts=holdouts)


def shortfall_lines(rows: list[dict]) -> list[str]:
    return [f"  {r['class']:<6} sites {r['sites']} for {', '.join(r['for'])}: need {r['demand']}, "
            f"available {r['available']}" + ("  <-- short" if r["demand"] > r["available"] else "")
            for r in rows]


def ways_out(family_policy: str, factor: float | None = None, scaling: bool = True) -> str:
    """How to get past a shortfall; ``scaling`` False once the targets fit in total but the draw fell short."""
    first = ("set clearance.family_policy: whole_families (every member of an augmentation family is kept; "
             "a family still never spans two partitions)" if family_policy == "representatives"
             else "add images, lower manifest.targets or give the clients more sites")
    if not scaling:
        return f"Ways out: {first}."
    shrink = f" (factor {factor:.4f} here)" if factor is not None else ""
    return (f"Ways out: {first}; or set manifest.allow_scaling: true to shrink every target by one common "
            f"factor{shrink}, recorded in manifest.json and printed beside the study's Table 2 in results/tables/.")


def scaling_warning(factor: float, rows: list[dict]) -> str:
    return (f"manifest.allow_scaling is true and the targets do not fit: EVERY target is scaled by {factor:.6f}, "
            "so Table 2 as built is not the study's (results/tables/table2_partitions.md)\n"
            + "\n".join(shortfall_lines(rows)))


def shortfall_message(rows: list[dict], family_policy: str) -> str:
    short = [r for r in rows if r["demand"] > r["available"]]
    return "\n".join([
        f"manifest.targets do not fit the images clearance keeps (clearance.family_policy: {family_policy}); "
        f"{len(short)} demand(s) exceed what is available (per class and site group):",
        *shortfall_lines(rows), ways_out(family_policy, fit_factor(rows))])


def holdout_count(n: int, fraction: float) -> int:
    """``round(frac * n)`` half-to-even, leaving at least one optimisation image when n >= 2."""
    h = round(fraction * n)
    return min(h, n - 1) if n >= 2 else h


def client_holdouts(targets: PartitionTargets, fractions: dict[str, float]) -> dict[str, tuple[int, ...]]:
    """Holdout images per client and class: the targets' own counts where they give them (the embedded
    default's profile), else ``holdout_fraction`` of each pool (the study's draw)."""
    if targets.holdouts is not None:
        return {client: tuple(hold) for client, hold in targets.holdouts.items()}
    return {client: tuple(holdout_count(n, fractions[client]) for n in pool) for client, pool in targets.clients.items()}


# ------------------------------------------------------------------ Table 2 as built
def study_table2() -> dict[tuple[str, str], tuple[int, ...]]:
    """The study's Table 2 (PartitionTargets and ManifestConfig defaults), holdouts derived as in the stage."""
    t, fractions = PartitionTargets(), ManifestConfig().holdout_fraction
    out: dict[tuple[str, str], tuple[int, ...]] = {}
    for client, pool in sorted(t.clients.items()):
        hold = tuple(holdout_count(n, fractions[client]) for n in pool)
        out[(client, "pool")] = pool
        out[(client, "optimisation")] = tuple(n - h for n, h in zip(pool, hold, strict=True))
        out[(client, "holdout")] = hold
    out[("validation", "all")], out[("test", "all")] = t.validation, t.test
    return out


def table2_rows(composition_csv: str | Path) -> list[dict]:
    with Path(composition_csv).open() as fh:
        built = {(r["partition"], r["subset"]): tuple(int(r[c]) for c in CLASSES) for r in csv.DictReader(fh)}
    rows = []
    for key, study in study_table2().items():
        have = built.get(key, (0, 0, 0))
        rows.append({"partition": key[0], "subset": key[1],
                     **{f"{c}_built": have[i] for i, c in enumerate(CLASSES)}, "total_built": sum(have),
                     **{f"{c}_study": study[i] for i, c in enumerate(CLASSES)}, "total_study": sum(study)})
    return rows


def scaling_line(summary: dict) -> str:
    factor = summary.get("scale_factor", 1.0)
    if factor < 1.0:
        return (f"WARNING: targets were SCALED by {factor:.6f} (manifest.allow_scaling: true): the partitions below "
                "are smaller than the configured targets and than the study's Table 2.")
    return "Targets built as configured (scale factor 1.0, no scaling)."


def write_table2(composition_csv: str | Path, manifest_json: str | Path, tables_dir: str | Path) -> str:
    """``table2_partitions.{csv,md}``: Table 2 as built beside the study's; returns the scaling line."""
    from fedhisto.infra.atomic import write_csv, write_text

    summary = json.loads(Path(manifest_json).read_text())
    rows = [{**r, "scale_factor": summary.get("scale_factor", 1.0)} for r in table2_rows(composition_csv)]
    line = scaling_line(summary)
    if summary.get("scale_factor", 1.0) < 1.0:
        log.warning(line)
    base = Path(tables_dir) / "table2_partitions"
    cols = list(rows[0])
    write_csv(base.with_suffix(".csv"), rows, cols)
    md = ["# Table 2: partitions as built beside the study's Table 2", "", line, "",
          f"family policy: {summary.get('family_policy', '?')}; dataset identity {summary.get('dataset_identity', '?')}",
          "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[k]) for k in cols) + " |" for r in rows]
    md += ["", *source_section(Path(composition_csv).with_name("source_composition.csv"), summary, tables_dir)]
    write_text(base.with_suffix(".md"), "\n".join(md) + "\n")
    return line


def source_section(source_csv: Path, summary: dict, tables_dir: str | Path) -> list[str]:
    """Validation and test by source x class (``table2_sources.csv``) and the single-source flags,
    as Markdown lines for Table 2 (the study's Table 2 gives class counts only)."""
    from fedhisto.infra.atomic import write_csv
    from fedhisto.manifest.source_audit import SOURCE_COLUMNS, flag_lines

    if not source_csv.exists() or "source_audit" not in summary:
        raise FileNotFoundError(f"{source_csv} or manifest.json's source_audit missing: the manifest was built before "
                                "the source audit existed; rerun the manifest stage")
    with source_csv.open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["partition"] in ("validation", "test")]
    write_csv(Path(tables_dir) / "table2_sources.csv", rows, SOURCE_COLUMNS)
    audit = summary["source_audit"]
    head = ["## Global validation and test by source (not in the study's Table 2)", "",
            f"manifest.stratify_by_source: {str(audit['stratify_by_source']).lower()}", "",
            *flag_lines(audit["single_source_classes"]), "",
            "| " + " | ".join(SOURCE_COLUMNS) + " |", "|" + "---|" * len(SOURCE_COLUMNS)]
    return head + ["| " + " | ".join(r[k] for k in SOURCE_COLUMNS) + " |" for r in rows]
