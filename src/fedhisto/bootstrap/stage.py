"""Stage ``bootstrap``: paired image-level bootstrap of a named comparison (study section 3.11); the
resampling itself (same image indices for both ensembles, percentile intervals, the bootstrap p and
the patient-level cluster resampling) is :mod:`fedhisto.stats.resampling`, where its design is written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedhisto.config.study import BootstrapConfig, Config
from fedhisto.infra.atomic import write_json
from fedhisto.infra.provenance import provenance_block
from fedhisto.stats.prediction_files import AlignmentError, ensemble_members
from fedhisto.stats.resampling import cluster_index, paired_bootstrap

STAGE = "bootstrap"


def comparison_files(cfg: Config, name: str) -> dict[str, tuple[list[int], list[str]]]:
    """``{"method": (seeds, files), "reference": (seeds, files)}``: the external predictions of
    each ensemble of a named comparison, on the seeds of :meth:`Config.comparison_seeds`."""
    if name not in cfg.bootstrap.comparisons:
        raise ValueError(f"unknown comparison {name!r}; configured: {', '.join(cfg.bootstrap.comparisons)}")
    comp = cfg.bootstrap.comparisons[name]
    out = {}
    for role, seeds in zip(("method", "reference"), cfg.comparison_seeds(name), strict=True):
        method = getattr(comp, role)
        out[role] = (seeds, [f"results/predictions/{method}/seed{s}/external.csv" for s in seeds])
    return out


def manifest_patients(manifest_csv: str | Path | None) -> dict[str, str]:
    """``{sample_id: patient key}`` from the manifest (empty when it names none, or is not given)."""
    if manifest_csv is None:
        return {}
    import csv

    with Path(manifest_csv).open(newline="") as fh:
        return {r["sample_id"]: f"{r['site']}/{r['patient']}" for r in csv.DictReader(fh) if r.get("patient")}


def run_bootstrap(name: str, method_files: list[str], reference_files: list[str],
                  seeds: tuple[list[int], list[int]], cfg: BootstrapConfig, out_json: str | Path,
                  manifest_csv: str | Path | None = None) -> dict:
    """``seeds``: the method's and the reference's ensemble seeds, one per prediction file, in order.
    ``manifest_csv``: where it names patients of the compared images, a patient-level bootstrap too."""
    comp = cfg.comparisons[name]
    method_seeds, reference_seeds = (list(s) for s in seeds)
    if method_seeds != reference_seeds:
        raise ValueError(f"{name}: the method's ensemble seeds {method_seeds} and the reference's {reference_seeds} "
                         "differ; a paired comparison ensembles both on the same seeds (Config.comparison_seeds)")
    for role, files, sds in (("method", method_files, method_seeds), ("reference", reference_files, reference_seeds)):
        if len(files) != len(sds):
            raise ValueError(f"{name}: {len(files)} {role} prediction files for {len(sds)} seeds {sds}")
    ens_a, ens_b = ensemble_members(method_files), ensemble_members(reference_files)
    ids_a, y_a, _ = next(iter(ens_a.values()))
    for ids, y, _ in [*ens_a.values(), *ens_b.values()]:
        if ids != ids_a or not np.array_equal(y, y_a):
            raise AlignmentError(f"{name}: the two methods' ensembles cover different images")
    resamples = cfg.ablation_resamples if comp.ablation else cfg.resamples
    preds_a, preds_b = [p.argmax(1) for _, _, p in ens_a.values()], [p.argmax(1) for _, _, p in ens_b.values()]
    metrics = paired_bootstrap(y_a, preds_a, preds_b, resamples, cfg.seed, cfg.confidence)
    patients = manifest_patients(manifest_csv)
    keys = [patients.get(i, "") for i in ids_a]
    patient_level = None
    if any(keys):
        clusters = cluster_index(keys)
        patient_level = {"n_patients": len({k for k in keys if k}), "n_clusters": int(clusters.max()) + 1,
                         "images_without_patient": sum(1 for k in keys if not k),
                         "metrics": paired_bootstrap(y_a, preds_a, preds_b, resamples, cfg.seed, cfg.confidence,
                                                     clusters=clusters)}
    doc = {"comparison": name, "method": comp.method, "reference": comp.reference, "ablation": comp.ablation,
           "cohort": "external",
           "ensemble": {"seeds": method_seeds, "method_seeds": method_seeds, "reference_seeds": reference_seeds,
                        "method_models": sorted(ens_a), "reference_models": sorted(ens_b),
                        "method_checkpoints": len(method_files), "reference_checkpoints": len(reference_files)},
           "n_images": len(y_a), "n_resamples": resamples, "seed": cfg.seed, "confidence": cfg.confidence,
           "interval_unit": "image", "metrics": metrics, "patient_level": patient_level,
           "provenance": provenance_block(STAGE, {"comparison": comp.model_dump(mode="json"), "seed": cfg.seed,
                                                  "resamples": resamples, "method_seeds": method_seeds,
                                                  "reference_seeds": reference_seeds},
                                          {**{p: p for p in [*method_files, *reference_files]},
                                           **({"manifest": manifest_csv} if manifest_csv else {})})}
    write_json(out_json, doc)
    return doc
