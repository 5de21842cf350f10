"""The privacy-utility figure of ``privacy_audit``: macro-F1 against epsilon beside the attack's success.

The conditions are placed in order of epsilon (the largest noise first, non-private last at "no DP":
its epsilon is unbounded), so both panels share one axis. Left: internal test and external macro-F1
per method. Right: the membership attack's ROC AUC with its bootstrap 95 % interval per method, and
the empirical epsilon lower bound the audit implies (right axis). Tick labels give each method's epsilon in legend order (v2 also releases noised
prototypes, so its epsilon is larger at the same sigma).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedhisto.infra.plotting import legend_outside, save_figure


def _order(rows: list[dict]) -> list[str]:
    sigma = {r["condition"]: float(r["noise_multiplier"]) for r in rows}
    dp = sorted((c for c in sigma if sigma[c] > 0), key=lambda c: -sigma[c])
    return [*dp, *(c for c in sigma if sigma[c] == 0)]


def _label(rows: list[dict], condition: str) -> str:
    r = next(r for r in rows if r["condition"] == condition)
    if r["epsilon"] == "":
        return "no DP"
    eps = " / ".join(f"{float(x['epsilon']):.3g}" for x in rows if x["condition"] == condition)
    return f"sigma {float(r['noise_multiplier']):g}\neps {eps}"


def privacy_utility_figure(rows: list[dict], path: str | Path) -> list[str]:
    """Draw the figure; returns the legend labels of both panels (one set per method in the rows)."""
    conditions = _order(rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    x = np.arange(len(conditions))
    labels = [_label(rows, c) for c in conditions]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12.5, 4.5))
    for k, method in enumerate(methods):
        sel = [next(r for r in rows if r["condition"] == c and r["method"] == method) for c in conditions]
        color = f"C{k}"
        ax.plot(x, [r["internal_macro_f1"] for r in sel], "o-", color=color, label=f"{method} internal")
        ax.plot(x, [r["external_macro_f1"] for r in sel], "s--", color=color, label=f"{method} external")
        auc = np.array([r["auc"] for r in sel], dtype=float)
        err = np.clip(np.vstack([auc - [r["auc_low"] for r in sel], [r["auc_high"] for r in sel] - auc]), 0, None)
        bx.errorbar(x + (k - (len(methods) - 1) / 2) * 0.08, auc, yerr=err, fmt="o-", color=color, capsize=3,
                    label=f"{method} attack AUC")
    ax.set_xticks(x, labels)
    ax.set_ylabel("macro-F1 of the global model")
    ax.set_title("utility against the per-site epsilon")
    legend_outside(ax, fontsize=8)
    bx.axhline(0.5, color="grey", lw=0.8, ls=":")
    bx.set_xticks(x, labels)
    bx.set_ylim(0, 1)
    bx.set_ylabel("membership attack ROC AUC (95 % CI)")
    bx.set_title("honest-but-curious coordinator: loss-difference attack")
    cx = bx.twinx()
    for k, method in enumerate(methods):
        sel = [next(r for r in rows if r["condition"] == c and r["method"] == method) for c in conditions]
        cx.plot(x, [r["empirical_epsilon_lower_bound"] for r in sel], "x:", color=f"C{k}",
                label=f"{method} empirical eps lower bound")
    cx.set_ylabel("empirical epsilon lower bound (95 %)")
    cx.set_ylim(bottom=0)
    handles = bx.get_legend_handles_labels()[0] + cx.get_legend_handles_labels()[0]
    bx.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper left")
    drawn = ax.get_legend_handles_labels()[1] + [h.get_label() for h in handles]
    save_figure(fig, path)
    return drawn
