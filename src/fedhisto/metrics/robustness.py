"""Site robustness of every run's representation, measured with ``croma`` (PathoROB's RI and APD).

Question: does a method's representation group the internal test images by biology (their class) or by
the site they came from? Both measures are croma's own code, never re-derived here; this module only
assembles their inputs from the ``predict`` stage's embeddings (``embeddings.safetensors``) and the
manifest, and lays their outputs out as rows:

- **RI** (PathoROB's robustness index, ``croma.RI``): over the global test images, with the manifest's
  ``site`` as the confounder and the clearance ``family`` as croma's independence group (relatives are
  never each other's neighbours). Among each image's k nearest neighbours (cosine), same-class-other-site
  neighbours against other-class-same-site ones; pooled over images. 1 is biology only, 0 site only, 0.5
  neutral. ``k`` is croma's choice among ``K_CANDIDATES`` (biological kNN balanced accuracy);
  ``support`` is the share of images with an informative neighbourhood.
  Interval: croma's cluster bootstrap (``croma.metrics.bootstrap.bootstrap_pooled_median``, families
  resampled with replacement) of the median per-image RI (``ri_median``, croma's ``median_value``); croma
  offers no resampling of the pooled ratio, so the interval belongs to the median, and the CSV says so by
  its column names.
- **APD** (PathoROB's average performance drop, ``croma.apd`` on ``croma.probe_sweep``): a logistic probe
  for the class is trained on splits that tie class to site ever more strongly (sites x classes, from
  balanced to one site per class) and scored on the same held-out images every time; APD is the mean
  relative balanced-accuracy change against the balanced split: 0 none, -1 total collapse. The sweep and
  the probe are PathoROB's own (vendored by croma); the schedule is ours (:func:`apd_schedule`; PathoROB's
  three are for its own cohorts), on the ``len(CLASSES)`` sites carrying every class with the most images.
  ``apd_replicate_min`` / ``_max``: the range over the sweep's replicates (each replicate redraws which
  images train the probe), not a bootstrap.

Cost: one probe sweep per representation dominates (``APD_ITERATIONS`` x ``len(APD_FRACTIONS)`` grid searches
of 16 logistic fits); the representations are measured in ``threads`` worker processes.

``encoder_state``: ``adapted`` (the z each run's classifier reads, one row per model: ``local_only`` keeps
one per site) and ``frozen`` (the frozen encoder every method starts from: one row, method
``frozen_encoder``; every run's file must hold the same frozen embeddings).
"""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from fedhisto import CLASSES
from fedhisto.stats.embedding_files import EMBEDDINGS_FILE, read_embeddings

log = logging.getLogger(__name__)
K_CANDIDATES = (5, 11, 21)        # [ours] croma's quick-start candidates; croma picks k by class kNN accuracy
APD_FRACTIONS = (0.0, 0.5, 1.0)   # [ours] class-site coupling of the sweep's splits: balanced, half, total
APD_ITERATIONS = 2                # [ours] replicates of the sweep (PathoROB: 20; each costs 16 probe fits a split,
                                  # about a second a representation on one core: the stage's largest cost)
RESAMPLES = 500                   # [ours] cluster-bootstrap resamples of the median RI (croma loops in Python)
APD_VALIDATION_FRACTION = 0.25    # per-cell validation share; PathoROB's own rule needs several rows per slide
APD_SEED = 1000                   # croma's default seed of the replicate seeds
FROZEN_METHOD = "frozen_encoder"
#: the question the methods guide answers: does stain-aware federation lower site identifiability against FedAvg-PEFT?
READING = {"reference": "fedavg_peft", "methods": ("past_v2", "past_v1", "fedstain")}
COLUMNS = ("method", "seed", "model", "encoder_state", "n_images", "sites", "k", "support", "ri", "ri_median",
           "ri_median_ci_low", "ri_median_ci_high", "apd", "apd_replicate_min", "apd_replicate_max", "apd_sites",
           "apd_note")


class RobustnessError(RuntimeError):
    pass


def cohort_frame(manifest_csv: str | Path, ids: list[str]) -> pd.DataFrame:
    """croma's manifest for the embedded images, in their order: sample_id, image_path, label, group_id, site."""
    with Path(manifest_csv).open() as fh:
        rows = {r["sample_id"]: r for r in csv.DictReader(fh)}
    missing = [i for i in ids if i not in rows]
    if missing:
        raise RobustnessError(f"{manifest_csv}: {len(missing)} embedded sample id(s) not in the manifest "
                              f"(e.g. {missing[0]}); embeddings and manifest come from different runs")
    return pd.DataFrame({"sample_id": ids, "image_path": [rows[i]["relpath"] for i in ids],
                         "label": [rows[i]["label"] for i in ids],
                         "group_id": [rows[i].get("family") or i for i in ids],
                         "site": [rows[i]["site"] for i in ids]})


def robustness_index(features: np.ndarray, frame: pd.DataFrame, resamples: int, seed: int,
                     confidence: float) -> dict:
    """croma's RI at its selected k, and croma's cluster-bootstrap interval of the median per-image RI."""
    from croma import RI
    from croma.metrics.bootstrap import bootstrap_pooled_median

    candidates = [k for k in K_CANDIDATES if k < len(frame)]
    if not candidates or frame["site"].nunique() < 2:
        return {"note": f"RI needs >= 2 sites and more than {K_CANDIDATES[0]} images "
                        f"({frame['site'].nunique()} site(s), {len(frame)} image(s))"}
    with warnings.catch_warnings(record=True) as caught:  # croma warns on support < 1; the row reports it
        warnings.simplefilter("always")
        res = RI.compute(features, frame, confounder_column="site", k_candidates=candidates)
    for w in caught:
        log.debug("croma: %s", w.message)
    ci = bootstrap_pooled_median(res.sample_values_aligned, frame["group_id"].to_numpy(), n_boot=resamples,
                                 level=confidence, seed=seed)
    return {"k": res.k, "support": res.support, "ri": res.value, "ri_median": res.median_value,
            "ri_median_ci_low": ci.lo, "ri_median_ci_high": ci.hi}


def apd_design(frame: pd.DataFrame) -> tuple[list[str], int, str]:
    """(sites, b, note): the ``len(CLASSES)`` sites carrying every class with the most images (ties by
    name), and the balanced split's rows per cell ``b`` (the full split trains ``len(CLASSES) * b`` rows of
    a cell: at most half its images, the rest validation and held-out test)."""
    n_cls = len(CLASSES)
    counts = frame.groupby(["site", "label"]).size().unstack(fill_value=0).reindex(columns=list(CLASSES),
                                                                                   fill_value=0)
    full = counts[(counts > 0).all(axis=1)]
    if len(full) < n_cls:
        return [], 0, (f"APD needs {n_cls} sites with every class; the test cohort has {len(full)} "
                       f"({', '.join(full.index) or 'none'})")
    ranked = sorted(full.index, key=lambda s: (-int(full.loc[s].min()), s))[:n_cls]
    n_min = int(full.loc[ranked].to_numpy().min())
    b = n_min // (2 * n_cls)
    if b < 1:
        return ranked, 0, f"APD needs >= {2 * n_cls} images per site and class; the smallest cell holds {n_min}"
    return sorted(ranked), b, ""


def apd_schedule(n_cls: int, b: int, fractions: tuple[float, ...] = APD_FRACTIONS) -> list[tuple[list, int]]:
    """croma's split plans: site i and class j are cell (i, j); at coupling f the off-diagonal cells give
    ``round(b (1 - f))`` training rows and the diagonal the rest of the class's ``n_cls * b``, so every
    split trains the same number of rows per class and only the class-site coupling moves."""
    plans = []
    for f in fractions:
        off = round(b * (1 - f))
        plans.append(([(i, j, n_cls * b - (n_cls - 1) * off if i == j else off)
                       for i in range(n_cls) for j in range(n_cls)], n_cls * b))
    return plans


def average_performance_drop(features: np.ndarray, frame: pd.DataFrame) -> dict:
    from croma import apd, probe_sweep

    sites, b, note = apd_design(frame)
    if note:
        return {"apd_note": note, "apd_sites": " ".join(sites)}
    keep = frame["site"].isin(sites).to_numpy()
    site_index = frame.loc[keep, "site"].map({s: i for i, s in enumerate(sites)}).to_numpy(dtype=int)
    labels = frame.loc[keep, "label"].map({c: j for j, c in enumerate(CLASSES)}).to_numpy(dtype=int)
    with warnings.catch_warnings():  # the probe's grid search reaches C values lbfgs does not converge at
        warnings.simplefilter("ignore")
        acc = probe_sweep(features[keep], site_index, labels, schedule=apd_schedule(len(CLASSES), b),
                          iterations=APD_ITERATIONS, seed=APD_SEED, validation_fraction=APD_VALIDATION_FRACTION)
    per_replicate = [apd(acc[:, [r]]) for r in range(acc.shape[1])]
    return {"apd": apd(acc), "apd_replicate_min": min(per_replicate), "apd_replicate_max": max(per_replicate),
            "apd_sites": " ".join(sites), "apd_note": ""}


def representation_row(features: np.ndarray, frame: pd.DataFrame, resamples: int, seed: int,
                       confidence: float) -> dict:
    ri = robustness_index(features, frame, resamples, seed, confidence)
    note = ri.pop("note", "")
    out = {"n_images": len(frame), "sites": frame["site"].nunique(), **ri, **average_performance_drop(features, frame)}
    if note:
        out["apd_note"] = "; ".join(x for x in (note, out.get("apd_note", "")) if x)
    return out


def run_status(predictions_dir: Path) -> str:
    with (predictions_dir / "test.csv").open() as fh:
        first = next(csv.DictReader(fh), None)
    return first["run_status"] if first else "failed"


def _measure(task: tuple[np.ndarray, pd.DataFrame, int, int, float]) -> dict:
    """One representation, on one BLAS thread: Snakemake sets OMP_NUM_THREADS to the job's threads, and two
    workers with two spinning BLAS threads each burnt 10x the CPU of one thread each on a loaded host."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        return representation_row(*task)


def robustness_rows(runs: list[tuple], manifest_csv: str | Path, resamples: int, seed: int,
                    confidence: float, threads: int = 1) -> tuple[list[dict], list[str]]:
    """``runs``: (method, seed, predictions folder, ...). Finalised runs only (internal scores of a failed run
    are never reported, as in the metrics tables); returns the rows and the skipped runs."""
    heads, tasks, skipped, frozen, frozen_from, frozen_ids = [], [], [], None, None, None
    for method, run_seed, folder, *_ in runs:
        folder = Path(folder)
        if run_status(folder) != "finalised":
            skipped.append(f"{method}/seed{run_seed}")
            continue
        emb = read_embeddings(folder / EMBEDDINGS_FILE)
        frame = cohort_frame(manifest_csv, emb.ids)
        if frozen is None:
            frozen, frozen_from, frozen_ids = emb.frozen, folder, emb.ids
            heads.append({"method": FROZEN_METHOD, "seed": "", "model": "", "encoder_state": "frozen"})
            tasks.append((frozen, frame, resamples, seed, confidence))
        elif emb.ids != frozen_ids or not np.allclose(emb.frozen, frozen, atol=1e-5):
            raise RobustnessError(f"{folder / EMBEDDINGS_FILE}: its frozen-encoder embeddings differ from "
                                  f"{frozen_from / EMBEDDINGS_FILE}'s; the runs do not share one encoder and cohort")
        for model, feats in emb.adapted.items():
            heads.append({"method": method, "seed": run_seed, "model": model, "encoder_state": "adapted"})
            tasks.append((feats, frame, resamples, seed, confidence))
    if threads > 1 and len(tasks) > 1:
        from multiprocessing import get_context

        with get_context("fork").Pool(min(threads, len(tasks))) as pool:
            measured = pool.map(_measure, tasks, chunksize=1)
    else:
        measured = [_measure(t) for t in tasks]
    rows = [{**h, **m} for h, m in zip(heads, measured, strict=True)]
    for r in rows:
        log.info("robustness %s %s %s (%s): RI %s, APD %s", r["method"], r["seed"], r["model"], r["encoder_state"],
                 f"{r['ri']:.3f}" if "ri" in r else "n/a", f"{r['apd']:.3f}" if "apd" in r else "n/a")
    return rows, skipped


def number(v) -> float | None:
    return None if v in ("", None) else float(v)


def _seed_means(rows: list[dict], key: str) -> dict[str, dict[int, float]]:
    """method -> seed -> the mean over the run's models of ``key`` (adapted rows with a value)."""
    out: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        if r["encoder_state"] == "adapted" and number(r.get(key)) is not None:
            out.setdefault(r["method"], {}).setdefault(int(r["seed"]), []).append(number(r[key]))
    return {m: {s: float(np.mean(v)) for s, v in seeds.items()} for m, seeds in out.items()}


def summarize(rows: list[dict]) -> list[dict]:
    """Per method (adapted), the mean and sample SD over seeds of RI and APD; the frozen encoder first."""
    ri, apd_ = _seed_means(rows, "ri"), _seed_means(rows, "apd")
    out = [{"method": r["method"], "encoder_state": "frozen", "seeds": "", "ri_mean": number(r.get("ri")), "ri_sd": None,
            "apd_mean": number(r.get("apd")), "apd_sd": None} for r in rows if r["encoder_state"] == "frozen"]
    for method in dict.fromkeys(r["method"] for r in rows if r["encoder_state"] == "adapted"):
        entry = {"method": method, "encoder_state": "adapted",
                 "seeds": " ".join(map(str, sorted(ri.get(method, {}))))}
        for key, by in (("ri", ri), ("apd", apd_)):
            vals = list(by.get(method, {}).values())
            entry[f"{key}_mean"] = float(np.mean(vals)) if vals else None
            entry[f"{key}_sd"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
        out.append(entry)
    return out


def compare(rows: list[dict], method: str, reference: str) -> dict | None:
    """Seed-matched RI and APD differences (method - reference): higher is less site-driven for both."""
    out = {"method": method, "reference": reference}
    for key in ("ri", "apd"):
        by = _seed_means(rows, key)
        a, b = by.get(method, {}), by.get(reference, {})
        seeds = sorted(set(a) & set(b))
        if not seeds:
            return None if key == "ri" else out
        diffs = [a[s] - b[s] for s in seeds]
        out[key] = {"seeds": seeds, "method_mean": float(np.mean([a[s] for s in seeds])),
                    "reference_mean": float(np.mean([b[s] for s in seeds])), "difference_mean": float(np.mean(diffs)),
                    "difference_se": float(np.std(diffs, ddof=1) / np.sqrt(len(diffs))) if len(diffs) > 1 else None,
                    "higher_in": sum(d > 0 for d in diffs)}
    return out


def run_robustness(runs: list[tuple], manifest_csv: str | Path, cfg, out_dir: str | Path, threads: int = 1) -> dict:
    """``results/metrics/robustness.csv`` (one row per representation) and ``robustness.json`` (settings,
    per-method summary, the seed-matched comparisons of the reading, skipped runs, provenance)."""
    from fedhisto.config.stage_blocks import stage_block
    from fedhisto.infra.atomic import write_csv, write_json
    from fedhisto.infra.provenance import provenance_block, write_sidecar

    out = Path(out_dir)
    b = cfg.bootstrap
    rows, skipped = robustness_rows(runs, manifest_csv, RESAMPLES, b.seed, b.confidence, threads)
    table = [{k: (round(r[k], 6) if isinstance(r.get(k), float) else r.get(k, "")) for k in COLUMNS} for r in rows]
    write_csv(out / "robustness.csv", table, COLUMNS)
    settings = {"cohort": "global test", "confounder": "manifest site", "group": "clearance family",
                "k_candidates": list(K_CANDIDATES), "apd_fractions": list(APD_FRACTIONS),
                "apd_iterations": APD_ITERATIONS, "apd_validation_fraction": APD_VALIDATION_FRACTION,
                "apd_seed": APD_SEED, "resamples": RESAMPLES, "bootstrap_seed": b.seed, "confidence": b.confidence}
    comparisons = [c for m in READING["methods"] if (c := compare(table, m, READING["reference"]))]
    prov = provenance_block("metrics", {**stage_block(cfg, "metrics"), "robustness": settings},
                            {"manifest": manifest_csv, **{f"{m}/seed{s}": Path(f) / EMBEDDINGS_FILE
                                                          for m, s, f, *_ in runs}})
    doc = {"settings": settings, "summary": summarize(table), "comparisons": comparisons, "skipped_runs": skipped,
           "provenance": prov}
    write_json(out / "robustness.json", doc)
    write_sidecar(out / "robustness.csv", prov)
    if skipped:
        log.info("robustness: %d run(s) not finalised, left out: %s", len(skipped), ", ".join(skipped))
    return doc
