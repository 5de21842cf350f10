"""``fedhisto classify``: a model package on a folder of new images; no labels needed.

One row per image (``image``: path relative to ``--images``): the ensemble's probabilities
``p_ACA, p_Normal, p_SCC`` (temperature-scaled with the package's temperature unless
``--no-calibration``), ``label``, ``confidence`` (the top probability), each member's label, an
``uncertain`` flag, the stain ``descriptor`` used and any colour ``converted`` on reading. Files that
were not classified are listed in ``<out>.exclusions.csv`` with the reason; ``<out>.json`` holds the
run summary (descriptor values, temperature, threshold, counts, metrics with ``--labels``). Every file
is written only after every image was scored, each atomically: nothing is half-written.

Domain (:mod:`fedhisto.classify.domain_check`): ``ood_score`` per image (the Mahalanobis distance of its
adapted embedding to the nearest training class, mean over members) and ``in_domain`` (``no`` above the
threshold calibrated on the training sites' holdouts at ``--false-flag-rate``); the folder's verdict, from
the flagged count and from its stain descriptor against the training sites' range, is one line in the log
and ``domain.line`` in the JSON. A package exported before domain statistics existed leaves both columns
empty and says so.

Uncertain: the members disagree on the label, or the top probability is below ``--uncertain-below``
(default 0.6: a triage convention, not a validated operating point; with three classes a top probability
under 0.6 means a second class holds a sizeable share, a near-tie a person should look at).

Descriptor (FiLM methods): ``centroid`` (default) conditions on the training clients' centroid, the
study's choice for unseen data and the setting under which the package's external metrics were
measured; ``site`` estimates the new site's own 14-d descriptor from its images (the stain stage's
estimator, on up to ``stain.max_images_per_client`` images) and standardises it with the package's
statistics. FiLM saw five sites' descriptors in training, so ``site`` extrapolates; it is offered for a
site to try, not the default. Too little tissue for the estimator (fewer than ``min_tissue_pixels``):
falls back to the centroid and says so in the log, the rows and the summary.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import numpy as np

from fedhisto import CLASSES
from fedhisto.classify.domain_check import check_domain
from fedhisto.classify.images import decode_folder
from fedhisto.export.domain_stats import FALSE_FLAG_RATE
from fedhisto.export.package import load_package
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.stats.temperature import apply_temperature

log = logging.getLogger(__name__)
STAGE = "classify"
UNCERTAIN_BELOW = 0.6
SITE_SAMPLE_SEED = 0


class ClassifyError(RuntimeError):
    pass


def estimator_block(meta: dict) -> dict | None:
    """The stain estimator and standardisation a folder's descriptor is computed with: the domain block's
    (every package since it exists), else a FiLM package's descriptor block; None when neither has them."""
    for block in (meta.get("domain", {}).get("descriptor"), meta["descriptor"]):
        if block and "estimator" in block and "standardisation" in block:
            return block
    return None


def site_descriptor(paths: list[Path], block: dict) -> tuple[np.ndarray | None, dict]:
    """The folder's standardised descriptor, or None (with the reason) when the estimator falls back."""
    from fedhisto.config.data_settings import StainConfig
    from fedhisto.stain.stage import client_descriptor

    stain = StainConfig.model_validate(block["estimator"])
    chosen = list(paths)
    if len(chosen) > stain.max_images_per_client:  # a seeded sample, as the stain stage samples a client
        rng = np.random.default_rng(SITE_SAMPLE_SEED)
        chosen = [chosen[i] for i in sorted(rng.choice(len(chosen), stain.max_images_per_client, replace=False))]
    est = client_descriptor([str(p) for p in chosen], stain)
    info = {"images": len(chosen), "tissue_pixels": int(est["tissue_pixels"]), "he_check": est["he_check"],
            "raw": [float(x) for x in est["raw"]]}
    if est["fallback"]:
        info["fallback"] = est["fallback"]
        return None, info
    std = block["standardisation"]
    value = (np.asarray(est["raw"]) - np.asarray(std["mean"])) / np.asarray(std["sd"])
    if est["he_check"] and not est["he_check"]["he_like"]:
        log.warning("classify: the folder's stain directions are far from H&E (%s); the model was trained on H&E",
                    est["he_check"])
    return value.astype(np.float32), info


def choose_descriptor(kind: str, meta: dict, folder: tuple[np.ndarray | None, dict]) -> tuple[np.ndarray | None, str, dict]:
    """FiLM's descriptor: ``folder`` is the folder's own estimate (:func:`site_descriptor`)."""
    desc = meta["descriptor"]
    if desc["kind"] == "none":
        return None, "none (method without FiLM)", {}
    centroid = np.asarray(desc["centroid"], dtype=np.float32)
    if desc["kind"] == "zero":
        if kind == "site":
            raise ClassifyError(f"--descriptor site: method {meta['method']['name']} conditions on a zero "
                                "descriptor (FiLM-Zero); a site descriptor does not apply")
        return centroid, "zero (FiLM-Zero)", {}
    if kind == "centroid":
        return centroid, "centroid", {}
    value, info = folder
    if value is None:
        log.warning("classify: --descriptor site: %s; falling back to the training centroid", info["fallback"])
        return centroid, "centroid (site fallback: too little tissue)", info
    log.info("classify: site descriptor from %d image(s), %d tissue pixels", info["images"], info["tissue_pixels"])
    return value, "site", info


def read_labels(path: str | Path, images: list[str]) -> dict[str, int]:
    with Path(path).open() as fh:
        reader = csv.DictReader(fh)
        if not reader.fieldnames or not {"image", "label"} <= set(reader.fieldnames):
            raise ClassifyError(f"--labels {path}: needs columns image,label (has {reader.fieldnames})")
        rows = list(reader)
    bad = [r["label"] for r in rows if r["label"] not in CLASSES]
    if bad:
        raise ClassifyError(f"--labels {path}: label {bad[0]!r} is not one of {list(CLASSES)}")
    unknown = sorted({r["image"] for r in rows} - set(images))
    if unknown:
        raise ClassifyError(f"--labels {path}: {len(unknown)} image(s) not classified (not in --images, or "
                            f"excluded): {unknown[:5]}")
    return {r["image"]: CLASSES.index(r["label"]) for r in rows}


def label_metrics(labels: dict[str, int], rows: list[dict], probs: np.ndarray, resamples: int, seed: int,
                  confidence: float) -> dict:
    from fedhisto.stats.resampling import bootstrap_interval
    from fedhisto.stats.scores import classification_metrics

    idx = [k for k, r in enumerate(rows) if r["image"] in labels]
    y = np.array([labels[rows[k]["image"]] for k in idx], dtype=int)
    p = probs[idx]
    point = classification_metrics(p, y)
    intervals = bootstrap_interval(y, p.argmax(1), resamples, seed, confidence)
    return {"labelled": len(idx), "unlabelled": len(rows) - len(idx), "point": point, "intervals": intervals,
            "confidence": confidence, "resamples": resamples}


def run_classify(model: str | Path, images: str | Path, out: str | Path, descriptor: str | None = None,
                 calibrate: bool = True, labels: str | Path | None = None, encoder_dir: str | Path | None = None,
                 uncertain_below: float = UNCERTAIN_BELOW, max_megapixels: float = 100.0,
                 contact_sheet: str | Path | None = None, resamples: int = 2000, threads: int = 1,
                 false_flag_rate: float = FALSE_FLAG_RATE, device: str = "auto") -> dict:
    from fedhisto.classify.runner import member_outputs
    from fedhisto.classify.sheet import contact_sheet as write_sheet

    out = Path(out)
    pkg = load_package(model)
    meta = pkg.meta
    log.info("classify: package %s (%s, %d member(s), encoder %s) verified", model, meta["method"]["name"],
             len(pkg.members), pkg.encoder_name)
    kind = descriptor or meta["descriptor"]["default"]
    if kind not in ("site", "centroid", "none", "zero"):
        raise ClassifyError(f"--descriptor {kind!r}: site or centroid")
    decoded = decode_folder(images, meta["normalisation"]["decode_max_edge"], max_megapixels)
    log.info("classify: %d image(s) to classify, %d file(s) excluded", len(decoded.images), len(decoded.exclusions))
    for e in decoded.exclusions:
        log.info("classify: excluded %s: %s", e["image"], e["reason"])
    if decoded.converted.count("") < len(decoded.converted):
        log.info("classify: %d image(s) converted to 8-bit RGB on reading", len(decoded.converted)
                 - decoded.converted.count(""))
    if not 0 < false_flag_rate < 1:
        raise ClassifyError(f"--false-flag-rate {false_flag_rate}: must lie in (0, 1)")
    estimator = estimator_block(meta)
    folder = site_descriptor(decoded.paths, estimator) if estimator else (None, {"fallback": "no stain statistics"})
    desc, desc_label, desc_info = choose_descriptor(kind, meta, folder)
    default = meta["descriptor"]["centroid"]
    per_member, feats = member_outputs(pkg, decoded.images, desc, encoder_dir, threads,
                                       None if default is None else np.asarray(default, dtype=np.float32),
                                       device=device)
    scores, in_domain, domain = check_domain(pkg, feats, *folder, false_flag_rate)
    raw = np.mean(list(per_member.values()), axis=0)
    temperature = meta["temperature"]["value"] if calibrate else None
    probs = apply_temperature(raw, temperature) if calibrate else raw
    rows = []
    for k, rel in enumerate(decoded.relpaths):
        member_labels = {f"label_{m}": CLASSES[int(p[k].argmax())] for m, p in per_member.items()}
        top = float(probs[k].max())
        disagree = len(set(member_labels.values())) > 1
        rows.append({"image": rel, **{f"p_{c}": f"{v:.8f}" for c, v in zip(CLASSES, probs[k], strict=True)},
                     "label": CLASSES[int(probs[k].argmax())], "confidence": f"{top:.6f}",
                     "uncertain": "yes" if disagree or top < uncertain_below else "no",
                     "ood_score": "" if scores is None else f"{scores[k]:.6f}",
                     "in_domain": "" if in_domain is None else ("yes" if in_domain[k] else "no"),
                     **member_labels, "descriptor": desc_label, "converted": decoded.converted[k]})
    summary = {"model": str(model), "method": meta["method"]["name"], "images": str(images),
               "classified": len(rows), "excluded": len(decoded.exclusions),
               "converted": sum(1 for c in decoded.converted if c),
               "calibration": ({"temperature": temperature, "fitted_on": meta["temperature"]["fitted_on"]}
                               if calibrate else "off (--no-calibration)"),
               "uncertain": {"rule": f"members disagree or top probability < {uncertain_below}",
                             "count": sum(r["uncertain"] == "yes" for r in rows)},
               "descriptor": {"used": desc_label, "requested": kind,
                              "value": None if desc is None else [float(x) for x in desc], **desc_info},
               "label_counts": {c: sum(r["label"] == c for r in rows) for c in CLASSES},
               "domain": domain}
    (log.warning if domain["verdict"] != "within" else log.info)("classify: domain: %s", domain["line"])
    if labels is not None:
        truth = read_labels(labels, decoded.relpaths)
        summary["metrics"] = label_metrics(truth, rows, probs, resamples, 20260730, 0.95)
        log.info("classify: macro-F1 %.4f on %d labelled image(s)", summary["metrics"]["point"]["macro_f1"],
                 summary["metrics"]["labelled"])
    sheet = Path(contact_sheet) if contact_sheet else out.with_name(out.stem + ".contact_sheet.png")
    # everything is computed: now write, each file atomically, the table last
    summary["contact_sheet"] = {"path": str(sheet), "shown": write_sheet(rows, Path(images), sheet)}
    write_csv(out.with_name(out.stem + ".exclusions.csv"), decoded.exclusions, ["image", "reason"])
    write_json(out.with_name(out.stem + ".json"), summary)
    write_csv(out, rows)
    write_sidecar(out, provenance_block(STAGE, {"descriptor": kind, "calibrate": calibrate,
                                                "uncertain_below": uncertain_below, "false_flag_rate": false_flag_rate},
                                        {"package": Path(model) / "SHA256SUMS"}))
    log.info("classify: wrote %s (%d rows; %s)", out, len(rows),
             ", ".join(f"{c} {n}" for c, n in summary["label_counts"].items()))
    return summary
