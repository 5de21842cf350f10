"""The package's model card (JSON for programs, Markdown for people), from the pipeline's own predictions
and manifest.

The card names its data (:func:`data_card`): every source with its kind (synthetic or real) and image count,
each training site's images per class, the evaluation cohorts, how the frozen encoder's weights came to be,
and the training sites' stain-descriptor range. A package trained on synthetic images or on the
pipeline-pretrained tiny encoder (pretrained on synthetic tissue) is a pipeline demonstration: its card's
first line says so (``DEMONSTRATION``).

Metrics are the method-level ensemble's (image-wise mean over the exported seeds, as
``fedhisto.stats.prediction_files.ensemble``) on the global test set (internal) and the external cohort, with
percentile bootstrap intervals from ``fedhisto.stats.resampling.bootstrap_interval`` (image-level resamples,
the study's seed and confidence). Probabilities are uncalibrated here, as the study reports them.
"""

from __future__ import annotations

import csv
from collections import Counter, defaultdict
from pathlib import Path

from fedhisto import CLASSES
from fedhisto.stats.prediction_files import ensemble
from fedhisto.stats.resampling import bootstrap_interval
from fedhisto.stats.scores import classification_metrics

SCALARS = ("macro_f1", "balanced_accuracy", "accuracy", "macro_auroc", "ece")
DEMONSTRATION = "Demonstration model, not for real tissue"
COHORTS = {"validation": "global validation (temperature, checkpoint selection)", "test": "internal global test",
           "external": "external cohort"}


def _per_class(rows: list[dict]) -> dict[str, int]:
    n = Counter(r["label"] for r in rows)
    return {c: n.get(c, 0) for c in CLASSES}


def encoder_training(cfg, enc: dict) -> str:
    """How the frozen encoder's weights came to be, in one sentence."""
    from fedhisto.registries.encoder_registry import encoder_entry

    entry = encoder_entry(enc["name"])
    pre = cfg.model.pretrain
    if entry.pretrainable and pre.enabled:
        if pre.objective == "synthetic_supervised":
            return (f"pretrained by this pipeline (stage pretrain, {pre.epochs} epoch(s)) on a disjoint pool of "
                    f"{pre.images_per_class} synthetic images per class rendered with the training sites' stains: "
                    "it has never seen real tissue")
        return (f"pretrained by this pipeline (stage pretrain, SimCLR, {pre.epochs} epoch(s)) on the training sites' "
                "optimisation images")
    if entry.hub_id is None or enc.get("random_initialisation"):
        return "randomly initialised (not pretrained): its features carry no learned tissue knowledge"
    where = "a local snapshot folder" if cfg.model.encoder.local_dir else f"the hub ({entry.hub_id})"
    return (f"the published pretrained weights of {entry.hub_id} at revision {enc.get('revision') or 'unpinned'}, "
            f"read from {where} ({entry.published}); the pipeline checks their architecture, not their origin")


def data_card(manifest_csv: str | Path, cfg, enc: dict, descriptors_doc: dict | None) -> dict:
    """The data the package was trained and evaluated on, from the manifest the runs were built from."""
    with Path(manifest_csv).open() as fh:
        rows = list(csv.DictReader(fh))
    sources = defaultdict(list)
    for r in rows:
        sources[r["source"]].append(r)
    clients = defaultdict(list)
    for r in rows:
        if r["client"]:
            clients[r["client"]].append(r)
    training_kinds = {("synthetic" if r["source"] == "synthetic" else "real") for r in rows if r["client"]}
    card = {
        "sources": [{"source": s, "kind": "synthetic" if s == "synthetic" else "real", "images": len(v),
                     "cohorts": sorted({r["cohort"] for r in v})} for s, v in sorted(sources.items())],
        "training_sites": {c: {"sites": sorted({r["site"] for r in v}), "sources": sorted({r["source"] for r in v}),
                               "optimisation": _per_class([r for r in v if r["split"] == "optimisation"]),
                               "holdout": _per_class([r for r in v if r["split"] == "holdout"])}
                           for c, v in sorted(clients.items())},
        "evaluation": {label: {"images": len(v), "per_class": _per_class(v), "sites": sorted({r["site"] for r in v}),
                               "sources": sorted({r["source"] for r in v})}
                       for split, label in COHORTS.items() if (v := [r for r in rows if r["split"] == split])},
        "encoder": {"name": enc["name"], "weights": encoder_training(cfg, enc)},
    }
    if descriptors_doc is not None:
        std = [v["standardised"] for v in descriptors_doc["clients"].values()]
        raw = [v["raw"] for v in descriptors_doc["clients"].values()]
        card["descriptor_range"] = {
            "names": descriptors_doc["names"], "training_sites": sorted(descriptors_doc["clients"]),
            "raw_min": [min(x) for x in zip(*raw, strict=True)], "raw_max": [max(x) for x in zip(*raw, strict=True)],
            "standardised_min": [min(x) for x in zip(*std, strict=True)],
            "standardised_max": [max(x) for x in zip(*std, strict=True)]}
    pretrained_on_synthetic = "synthetic images" in card["encoder"]["weights"]
    card["demonstration"] = "synthetic" in training_kinds or pretrained_on_synthetic
    card["kind"] = " and ".join(sorted(training_kinds)) or "none"
    return card


def cohort_metrics(files: list[Path], resamples: int, seed: int, confidence: float, bins: int) -> dict:
    _, y, probs = ensemble(files)
    point = classification_metrics(probs, y, bins)
    intervals = bootstrap_interval(y, probs.argmax(1), resamples, seed, confidence)
    return {"n": point["n"], **{k: point[k] for k in SCALARS},
            "per_class_recall": {c: v["recall"] for c, v in point["per_class"].items()},
            "intervals": {k: v for k, v in intervals.items() if v["estimate"] is not None},
            "confidence": confidence, "resamples": resamples}


def card_json(meta: dict, metrics: dict[str, dict], data: dict | None = None) -> dict:
    limitations = [
        "image-level bootstrap intervals ignore patient-level dependence",
        "the temperature is fitted on the global validation set (pooled sites), not on a new site",
        "fedhisto classify flags images and folders outside the training domain (domain statistics in the "
        "package); an unflagged image is not thereby correct",
    ]
    if data is not None and data["demonstration"]:
        limitations.insert(0, f"{DEMONSTRATION}: trained on {data['kind']} images with an encoder "
                              f"{data['encoder']['weights']}; it demonstrates the pipeline, not a model for tissue")
    elif data is None:
        limitations.insert(0, "trained on the cohort named by the run identities; metrics on other sites may differ")
    return {
        "method": meta["method"]["name"], "classes": meta["classes"], "encoder": meta["encoder"],
        "demonstration": bool(data and data["demonstration"]), "data": data,
        "members": [{k: m[k] for k in ("name", "seed", "status", "identity")} for m in meta["members"]],
        "temperature": meta["temperature"], "metrics": metrics,
        "descriptor_default": meta["descriptor"]["default"], "code": meta["code"],
        "domain_check": domain_check_card(meta.get("domain")),
        "intended_use": ("pipeline demonstration only: not for classifying real tissue"
                         if data is not None and data["demonstration"] else
                         "research: classifying H&E lung tiles into ACA / Normal / SCC; not a diagnostic device"),
        "limitations": limitations,
    }


def domain_check_card(domain: dict | None) -> dict | None:
    """The false-flag rates the package states: the conformal bound at the default rate on the pooled holdouts,
    and the rate seen when each training site's holdout is judged by the other sites' threshold."""
    if not domain or not domain["embedding"].get("default_threshold"):
        return None
    emb = domain["embedding"]
    thr = emb["default_threshold"]
    out = {"rate": emb["default_rate"], "calibration_images": thr["n"], "threshold": thr["threshold"],
           "bound": thr["bound"]}
    if "leave_one_site_out" in emb:
        loso = emb["leave_one_site_out"]
        out["leave_one_site_out"] = {"pooled_rate": loso["pooled_rate"], "images": loso["images"],
                                     "sites": {s: v["rate"] for s, v in loso["sites"].items()}}
    return out


def domain_markdown(d: dict) -> list[str]:
    lines = ["## Domain check", "",
             f"`fedhisto classify` flags an image whose out-of-domain score exceeds {d['threshold']:.4f}, the "
             f"conformal threshold at a {d['rate']:.0%} false-flag rate on {d['calibration_images']} holdout images "
             f"of the training sites: an image exchangeable with them is flagged with probability at most "
             f"{d['bound']:.1%}."]
    loso = d.get("leave_one_site_out")
    if loso and loso["pooled_rate"] is not None:
        sites = ", ".join(f"{s} {r:.1%}" for s, r in loso["sites"].items())
        lines[-1] += (f" Each training site's holdout judged by the other sites' threshold: {loso['pooled_rate']:.1%} "
                      f"of {loso['images']} images flagged ({sites}): how far the stated rate carries to a site the "
                      "threshold never saw.")
    return [*lines, ""]


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _counts(per_class: dict[str, int]) -> str:
    return " / ".join(str(per_class[c]) for c in CLASSES)


def data_markdown(data: dict) -> list[str]:
    lines = ["## Data", "", f"Training images: {data['kind']}.", "",
             "| source | kind | images | cohorts |", "|---|---|---|---|"]
    lines += [f"| {s['source']} | {s['kind']} | {s['images']} | {', '.join(s['cohorts'])} |" for s in data["sources"]]
    lines += ["", f"Training sites (images per class, {' / '.join(CLASSES)}):", "",
              "| site | from | optimisation | holdout |", "|---|---|---|---|"]
    lines += [f"| {c} | {', '.join(v['sites'])} ({', '.join(v['sources'])}) | {_counts(v['optimisation'])} | "
              f"{_counts(v['holdout'])} |" for c, v in data["training_sites"].items()]
    lines += ["", "Evaluation cohorts:", ""]
    lines += [f"- {label}: {v['images']} images ({_counts(v['per_class'])}) from {', '.join(v['sites'])} "
              f"({', '.join(v['sources'])})" for label, v in data["evaluation"].items()]
    lines += ["", f"Frozen encoder `{data['encoder']['name']}`: {data['encoder']['weights']}.", ""]
    if "descriptor_range" in data:
        d = data["descriptor_range"]
        lines += [f"Stain descriptor range of the training sites ({', '.join(d['training_sites'])}; raw values, "
                  "min to max):", "", "| dimension | min | max |", "|---|---|---|"]
        lines += [f"| {n} | {lo:.4f} | {hi:.4f} |" for n, lo, hi in zip(d["names"], d["raw_min"], d["raw_max"],
                                                                          strict=True)]
        lines.append("")
    return lines


def card_markdown(card: dict) -> str:
    data = card.get("data")
    first = ([f"**{DEMONSTRATION}.** Trained on {data['kind']} images; its encoder is "
              f"{data['encoder']['weights']}.", ""] if data and data["demonstration"] else [])
    lines = [*first, f"# Model card: {card['method']} ensemble ({len(card['members'])} member(s))", "",
             f"- Classes (output order): {', '.join(card['classes'])}",
             f"- Frozen encoder: `{card['encoder']['name']}` (hub: {card['encoder'].get('hub_id') or 'none'}, "
             f"revision: {card['encoder'].get('revision') or 'n/a'})",
             "- Members: " + ", ".join(f"{m['name']} ({m['status']})" for m in card["members"]),
             f"- Calibration: temperature T = {card['temperature']['value']:.4f}, "
             f"{card['temperature']['fitted_on']}",
             f"- Default stain descriptor: {card['descriptor_default']}",
             f"- Code: fedhisto {card['code'].get('package_version')} "
             f"(commit {card['code'].get('git_commit') or 'n/a'})", "",
             "## Metrics (ensemble, uncalibrated probabilities)", "",
             "| cohort | n | macro-F1 | balanced accuracy | accuracy | macro AUROC | ECE |",
             "|---|---|---|---|---|---|---|"]
    for cohort, m in card["metrics"].items():
        def cell(k: str, m: dict = m) -> str:
            ci = m["intervals"].get(k)
            return _fmt(m[k]) + (f" [{_fmt(ci['ci_low'])}, {_fmt(ci['ci_high'])}]" if ci else "")
        lines.append(f"| {cohort} | {m['n']} | {cell('macro_f1')} | {cell('balanced_accuracy')} | "
                     f"{cell('accuracy')} | {_fmt(m['macro_auroc'])} | {_fmt(m['ece'])} |")
    conf = next(iter(card["metrics"].values()), {}).get("confidence", 0.95)
    lines += ["", f"Brackets: {conf:.0%} percentile bootstrap intervals over images.", ""]
    lines += data_markdown(data) if data else []
    lines += domain_markdown(card["domain_check"]) if card.get("domain_check") else []
    lines += ["## Intended use", "", card["intended_use"], "", "## Limitations", ""]
    lines += [f"- {x}" for x in card["limitations"]]
    return "\n".join(lines) + "\n"
