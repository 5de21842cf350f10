"""The package's model card (JSON for programs, Markdown for people), from the pipeline's own predictions.

Metrics are the method-level ensemble's (image-wise mean over the exported seeds, as
``fedhisto.stats.prediction_files.ensemble``) on the global test set (internal) and the external cohort, with
percentile bootstrap intervals from ``fedhisto.stats.resampling.bootstrap_interval`` (image-level resamples,
the study's seed and confidence). Probabilities are uncalibrated here, as the study reports them.
"""

from __future__ import annotations

from pathlib import Path

from fedhisto.stats.prediction_files import ensemble
from fedhisto.stats.resampling import bootstrap_interval
from fedhisto.stats.scores import classification_metrics

SCALARS = ("macro_f1", "balanced_accuracy", "accuracy", "macro_auroc", "ece")


def cohort_metrics(files: list[Path], resamples: int, seed: int, confidence: float, bins: int) -> dict:
    _, y, probs = ensemble(files)
    point = classification_metrics(probs, y, bins)
    intervals = bootstrap_interval(y, probs.argmax(1), resamples, seed, confidence)
    return {"n": point["n"], **{k: point[k] for k in SCALARS},
            "per_class_recall": {c: v["recall"] for c, v in point["per_class"].items()},
            "intervals": {k: v for k, v in intervals.items() if v["estimate"] is not None},
            "confidence": confidence, "resamples": resamples}


def card_json(meta: dict, metrics: dict[str, dict]) -> dict:
    return {
        "method": meta["method"]["name"], "classes": meta["classes"], "encoder": meta["encoder"],
        "members": [{k: m[k] for k in ("name", "seed", "status", "identity")} for m in meta["members"]],
        "temperature": meta["temperature"], "metrics": metrics,
        "descriptor_default": meta["descriptor"]["default"], "code": meta["code"],
        "intended_use": "research: classifying H&E lung tiles into ACA / Normal / SCC; not a diagnostic device",
        "limitations": [
            "trained on the cohort named by the run identities; metrics on other sites may differ",
            "image-level bootstrap intervals ignore patient-level dependence",
            "the temperature is fitted on the global validation set (pooled sites), not on a new site",
        ],
    }


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def card_markdown(card: dict) -> str:
    lines = [f"# Model card: {card['method']} ensemble ({len(card['members'])} member(s))", "",
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
    lines += ["", f"Brackets: {conf:.0%} percentile bootstrap intervals over images.", "",
              "## Intended use", "", card["intended_use"], "", "## Limitations", ""]
    lines += [f"- {x}" for x in card["limitations"]]
    return "\n".join(lines) + "\n"
