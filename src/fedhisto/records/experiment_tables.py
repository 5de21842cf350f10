"""Renderers of the controlled experiments' result blocks, from each experiment's own CSV files
(``results/experiments/<name>/``; their designs and columns: docs/experiments.md and each experiment's
module). Every interval is the experiment's 95 % bootstrap interval as written there."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from fedhisto.records.tables import md_table, num, read_rows, with_ci


def signed(row: dict, key: str) -> str:
    """A paired difference ``+d [+low, +high]`` of a row with ``key``, ``ci_low`` and ``ci_high``."""
    return f"{num(row[key], 3, True)} [{num(row['ci_low'], 3, True)}, {num(row['ci_high'], 3, True)}]"


def _severity(value: str) -> str:
    return f"s = {float(value):g}"


def dose_response(results: Path) -> str:
    """Per encoder: each method's ensemble macro-F1 per severity, then the paired differences."""
    cells = read_rows(results, "experiments/dose_response/dose_response.csv")
    diffs = read_rows(results, "experiments/dose_response/paired_differences.csv")
    severities = list(dict.fromkeys(r["severity"] for r in cells))
    parts = []
    for encoder in dict.fromkeys(r["encoder"] for r in cells):
        by = {(r["method"], r["severity"]): r for r in cells if r["encoder"] == encoder}
        body = [[m, *(with_ci(by[(m, s)], "macro_f1") for s in severities)]
                for m in dict.fromkeys(m for m, _ in by)]
        pairs = {(d["method"], d["reference"]): {} for d in diffs if d["encoder"] == encoder}
        for d in diffs:
            if d["encoder"] == encoder:
                pairs[(d["method"], d["reference"])][d["severity"]] = d
        body += [[f"**{a} - {b}** (paired)", *(signed(p[s], "difference") for s in severities)]
                 for (a, b), p in pairs.items()]
        images = next(iter(by.values()))["images"]
        parts.append(f"Encoder `{encoder}`, macro-F1 [95 % CI], {images} images per severity:\n\n"
                     + md_table(["method", *map(_severity, severities)], body))
    return "\n\n".join(parts)


def leakage(results: Path) -> str:
    """Each policy's test macro-F1 and the inflation, leaky minus clean."""
    rows = read_rows(results, "experiments/leakage/leakage.csv")
    body = [[r["policy"], r["method"], f"{r['test_images_with_relative_in_training']} / {r['test_images']}",
             with_ci(r, "macro_f1")] for r in rows]
    inflation = read_rows(results, "experiments/leakage/inflation.csv")
    body2 = [[r["method"], f"{r['leaky']} - {r['clean']}",
              signed(r, "estimate"),
              num(r["p_two_sided"])] for r in inflation]
    return (md_table(["policy", "method", "test images with a relative in training", "macro-F1 [95 % CI]"], body)
            + "\n\n" + md_table(["method", "leaky - clean", "inflation [95 % CI]", "p"], body2))


def leave_one_site_out(results: Path) -> str:
    """Macro-F1 on each left-out site, and the mean over sites."""
    rows = read_rows(results, "experiments/leave_one_site_out/leave_one_site_out.csv")
    sites = list(dict.fromkeys(r["left_out"] for r in rows if r["left_out"] != "mean"))
    images = {r["left_out"]: r["images"] for r in rows if r["left_out"] != "mean"}
    by = {(r["method"], r["left_out"]): r for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    body = [[m, *(with_ci(by[(m, s)], "macro_f1") for s in [*sites, "mean"])] for m in methods]
    return md_table(["method", *(f"{s} ({images[s]} img)" for s in sites), "mean over sites"], body)


def calibration(results: Path) -> str:
    """Each score of the seed ensemble before -> after temperature scaling, with the paired change's CI."""
    rows = read_rows(results, "experiments/calibration/calibration.csv")
    cells: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for r in rows:
        cells[(r["method"], r["cohort"])][r["score"]] = (
            f"{num(r['before'])} -> {num(r['after'])} [{num(r['change_ci_low'], 3, True)}, "
            f"{num(r['change_ci_high'], 3, True)}]")
    scores = list(dict.fromkeys(r["score"] for r in rows))
    body = [[m, c, *(v.get(s, "-") for s in scores)] for (m, c), v in cells.items()]
    return md_table(["method", "cohort", *(f"{s} (change CI)" for s in scores)], body)


def probe(results: Path) -> str:
    """Stain sensitivity of each frozen encoder beside its dose-response gap."""
    rows = read_rows(results, "experiments/probe/probe.csv")
    body = [[r["encoder"], "paired stain" if r["measure"] == "paired_stain" else f"shift {_severity(r['severity'])}",
             with_ci(r, "ratio"), with_ci(r, "ratio_same_class", 2) if r.get("ratio_same_class") else "-",
             with_ci(r, "retrieval_top1"),
             f"{num(r['gap'], 3, True)} ({_severity(r['gap_severity'])})"] for r in rows]
    return md_table(["encoder", "measure", "ratio [95 % CI]", "same-class ratio", "retrieval top-1",
                     "v2 - FedAvg-PEFT"], body)


def privacy_audit(results: Path) -> str:
    """Epsilon, utility and the membership attack per condition and method."""
    rows = read_rows(results, "experiments/privacy_audit/privacy_audit.csv")
    body = [[r["condition"], r["method"], num(r["epsilon"], 2) if r["epsilon"] else "unbounded",
             num(r["internal_macro_f1"]), num(r["external_macro_f1"]),
             f"{num(r['auc'], 2)} [{num(r['auc_low'], 2)}, {num(r['auc_high'], 2)}]",
             num(r["tpr_at_fpr_1pct"], 2), num(r["empirical_epsilon_lower_bound"], 2)] for r in rows]
    first = rows[0]
    return (f"delta {first['delta']}, {first['rounds']} rounds, {first['members']} members and "
            f"{first['nonmembers']} non-members.\n\n"
            + md_table(["condition", "method", "epsilon per site", "internal macro-F1", "external macro-F1",
                        "attack AUC [95 % CI]", "TPR at FPR 1 %", "empirical epsilon lower bound"], body))


def sensitivity(results: Path) -> str:
    """Each conclusion's paired difference under every reading; bold where the reading breaks it."""
    rows = read_rows(results, "experiments/sensitivity/sensitivity.csv")
    conclusions = list(dict.fromkeys(f"{r['method']} - {r['reference']}" for r in rows))
    cells: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for r in rows:
        text = signed(r, "difference")
        cells[(r["encoder"], r["reading"])][f"{r['method']} - {r['reference']}"] = (
            text if r["survives"] == "True" else f"**{text}**")
    body = [[e, reading, *(v.get(c, "-") for c in conclusions)] for (e, reading), v in cells.items()]
    verdicts = read_rows(results, "experiments/sensitivity/verdicts.csv")
    lines = [f"- {v['encoder']}, {v['conclusion']}: " + ("survives every reading" if v["survives_every_reading"] == "True"
                                                        else f"broken by {v['broken_by'].replace(',', ', ')}")
             for v in verdicts]
    return md_table(["encoder", "reading", *conclusions], body) + "\n\n" + "\n".join(lines)


def lora_aggregation(results: Path) -> str:
    """Each aggregator's external macro-F1, traffic and the update's spectrum, per encoder and method."""
    rows = read_rows(results, "experiments/lora_aggregation/lora_aggregation.csv")
    body = [[r["encoder"], r["method"], r["aggregator"], r["seeds"], with_ci(r, "macro_f1"),
             num(r["traffic_mib_per_round"], 2), num(r["final_energy_share_top1"], 2), num(r["final_effective_rank"], 2)]
            for r in rows]
    return md_table(["encoder", "method", "aggregator", "seeds", "external macro-F1 [95 % CI]", "MiB per round",
                     "leading direction's energy share", "effective rank"], body)
