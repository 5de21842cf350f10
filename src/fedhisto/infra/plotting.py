"""Shared figure helpers: every estimate drawn with its interval, no legend over the data.

Rules the report's figures follow through these helpers: a bar or point that shows an estimate
carries its (asymmetric) confidence interval; a legend sits to the right of the axes, outside
the data area, and :func:`save_figure` lays the figure out so it is kept whole; figures are
written atomically (complete PNG or none).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedhisto.infra.atomic import write_with

DPI = 120


def save_figure(fig, path: str | Path) -> None:
    """Lay out, write as PNG atomically and close. ``bbox_inches="tight"`` grows the saved canvas
    to include artists outside the axes (the legend of :func:`legend_outside`), which
    ``tight_layout`` alone does not guarantee."""
    fig.tight_layout()
    write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI, bbox_inches="tight"))
    plt.close(fig)


def legend_outside(ax, **kwargs):
    """A legend to the right of the axes, anchored at its top: it can never cover data."""
    return ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left", borderaxespad=0.0, **kwargs)


def _errors(estimates, lows, highs) -> np.ndarray:
    """2 x n distances below and above the estimate, as ``yerr`` / ``xerr`` want them; a missing
    value (None, NaN) draws no bar rather than a misleading zero-width one."""
    est, lo, hi = (np.asarray(v, dtype=float) for v in (estimates, lows, highs))
    # a percentile interval can exclude its own point estimate (a metric that drops absent classes):
    # matplotlib refuses negative error lengths, so such a side is drawn as zero, not crashed on
    return np.clip(np.nan_to_num(np.vstack([est - lo, hi - est]), nan=0.0), 0.0, None)


def plot_bars_with_ci(ax, labels: Sequence[str], estimates, lows, highs, color=None, label: str | None = None,
                      offset: float = 0.0, width: float = 0.8):
    """Bars at ``arange(len(labels)) + offset`` with asymmetric error bars from ``lows`` to ``highs``.

    Grouped bars: call once per group with ``width`` = group width / groups and offsets that
    centre the group on the tick. A missing estimate (None) draws an empty slot. Returns the
    ``ErrorbarContainer`` so callers and tests can read the drawn intervals back."""
    x = np.arange(len(labels)) + offset
    est = np.asarray(estimates, dtype=float)
    ax.bar(x, np.nan_to_num(est, nan=0.0), width, color=color, label=label)
    bars = ax.errorbar(x, est, yerr=_errors(est, lows, highs), fmt="none", ecolor="black", elinewidth=1,
                       capsize=max(1.0, 10 * width))
    ax.set_xticks(np.arange(len(labels)), labels, rotation=30, ha="right")
    return bars


def plot_lines_with_bands(ax, x, series: dict[str, tuple]) -> None:
    """One line with markers per series and its CI as a shaded band; the legend goes outside.

    ``series``: name -> (estimates, lows, highs), each aligned with ``x``."""
    for name, (est, lo, hi) in series.items():
        (line,) = ax.plot(x, np.asarray(est, dtype=float), "o-", label=name)
        ax.fill_between(x, np.asarray(lo, dtype=float), np.asarray(hi, dtype=float), color=line.get_color(),
                        alpha=0.2, linewidth=0)
    legend_outside(ax)


def plot_reliability(ax, bins_rows: list[dict], label: str):
    """Reliability diagram from :func:`fedhisto.stats.temperature.reliability_bins` rows: accuracy
    against mean confidence of each non-empty bin, with the bin's accuracy CI as a vertical error
    bar when the rows carry one, and the diagonal of perfect calibration."""
    rows = [r for r in bins_rows if r["count"]]
    conf = np.array([r["confidence"] for r in rows], dtype=float)
    acc = np.array([r["accuracy"] for r in rows], dtype=float)
    yerr = None
    if rows and all(r.get("ci_low") is not None for r in rows):
        yerr = _errors(acc, [r["ci_low"] for r in rows], [r["ci_high"] for r in rows])
    drawn = ax.errorbar(conf, acc, yerr=yerr, fmt="o-", capsize=3, label=label)
    ax.plot([0, 1], [0, 1], "--", color="grey", linewidth=1)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("confidence (top-1)")
    ax.set_ylabel("accuracy")
    return drawn
