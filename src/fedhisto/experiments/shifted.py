"""One run's validation-selected checkpoint on the stain-shifted external cohorts (dose-response).

The checkpoint is loaded exactly as the predict stage loads it (refused when its dataset identity
differs from its training manifest's) and sees every severity with the external cohort's
descriptor (the centroid of its clients' descriptors), as the predict stage's external cohort does.
Output: one CSV per run, one row per image and severity.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import torch

from fedhisto import CLASSES
from fedhisto.config.study import Config
from fedhisto.data.splits import load_split
from fedhisto.infra.atomic import write_csv
from fedhisto.infra.provenance import provenance_block, runtime_block, write_sidecar
from fedhisto.infra.settings_base import identity_dump
from fedhisto.predict.stage import load_run
from fedhisto.stats.prediction_files import PROB_COLUMNS
from fedhisto.train.inference import predict
from fedhisto.train.stage import descriptors_for

STAGE = "experiments"
COLUMNS = ("sample_id", "tissue_id", "severity", "label", *PROB_COLUMNS, "pred")


class ShiftedPredictionError(RuntimeError):
    pass


def clients_of(manifest_csv: str | Path) -> list[str]:
    with Path(manifest_csv).open() as fh:
        return sorted({r["client"] for r in csv.DictReader(fh) if r["client"]})


def predict_shifted(method: str, seed: int, train_dir: str | Path, manifest_csv: str | Path,
                    manifest_json: str | Path, descriptors_json: str | Path, cohort_csv: str | Path, cfg: Config,
                    out_csv: str | Path, encoder_dir: str | None = None, threads: int = 1) -> dict:
    torch.set_num_threads(max(threads, 1))
    m, model, members, status, device = load_run(method, seed, Path(train_dir), manifest_json, cfg, encoder_dir)
    if len(members) != 1:
        raise ShiftedPredictionError(f"{train_dir}: {method} keeps {len(members)} models; the dose-response "
                                     "experiment scores single-model methods (experiments.methods)")
    model.load_trainable_state(next(iter(members.values())))
    desc = descriptors_for(m, descriptors_json, clients_of(manifest_csv))
    with Path(cohort_csv).open() as fh:
        by_severity: dict[str, list[dict]] = defaultdict(list)
        for r in csv.DictReader(fh):
            by_severity[r["severity"]].append(r)
    rows = []
    for severity, cohort_rows in sorted(by_severity.items(), key=lambda kv: float(kv[0])):
        split = load_split(cohort_rows, cfg.views.crop_size)
        tissue = {r["sample_id"]: r["tissue_id"] for r in cohort_rows}
        probs = predict(model, split, desc["global"], cfg, device).numpy()
        rows += [{"sample_id": sid, "tissue_id": tissue[sid], "severity": severity, "label": CLASSES[y],
                  **{c: f"{v:.8f}" for c, v in zip(PROB_COLUMNS, p, strict=True)}, "pred": CLASSES[int(p.argmax())]}
                 for sid, y, p in zip(split.ids, split.labels, probs, strict=True)]
    prov = provenance_block(STAGE, {"method": method, "seed": seed, "views": identity_dump(cfg.views),
                                    "eval_batch": cfg.evaluate.eval_batch},
                            {"checkpoint": Path(train_dir) / "checkpoint.pt", "cohort": cohort_csv,
                             "descriptors": descriptors_json})
    prov["runtime"] = runtime_block(device)
    write_csv(out_csv, rows, COLUMNS)
    write_sidecar(out_csv, prov)
    return {"status": status, "images": len(rows), "severities": len(by_severity)}
