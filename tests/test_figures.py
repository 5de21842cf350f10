"""Shared figure helpers (fedhisto.infra.plotting): intervals drawn as given, legends off the data."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.collections import PolyCollection

from fedhisto.infra.plotting import (
    legend_outside,
    plot_bars_with_ci,
    plot_lines_with_bands,
    plot_reliability,
    save_figure,
)


@pytest.fixture
def ax():
    fig, ax = plt.subplots(figsize=(6, 3))
    yield ax
    plt.close(fig)


def _extents(ax, legend):
    fig = ax.figure
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return legend.get_window_extent(renderer), ax.get_window_extent(renderer)


def _interval_segments(container) -> np.ndarray:
    """(x, low, high) of each vertical error bar of an ``errorbar`` container."""
    segments = [s for s in container.lines[2][0].get_segments() if len(s)]
    return np.array([[s[0][0], s[0][1], s[1][1]] for s in segments])


def test_legend_outside_does_not_overlap_the_axes(ax):
    plot_bars_with_ci(ax, ["a", "b", "c"], [0.9, 0.95, 0.97], [0.8, 0.9, 0.93], [0.95, 0.99, 1.0], label="macro-F1")
    leg, axes = _extents(ax, legend_outside(ax))
    assert not leg.overlaps(axes) and leg.x0 >= axes.x1
    assert leg.y1 == pytest.approx(axes.y1, abs=1.0)  # anchored at the axes' top


def test_a_default_legend_would_overlap_the_axes(ax):
    # the check above can fail: matplotlib's own placement puts the legend inside the data area
    plot_bars_with_ci(ax, ["a", "b", "c"], [0.9, 0.95, 0.97], [0.8, 0.9, 0.93], [0.95, 0.99, 1.0], label="macro-F1")
    leg, axes = _extents(ax, ax.legend(loc="upper right"))
    assert leg.overlaps(axes)


def test_bar_error_bars_equal_the_interval_passed(ax):
    est, low, high = [0.6, 0.8, 0.5], [0.45, 0.79, 0.2], [0.7, 0.95, 0.52]
    bars = plot_bars_with_ci(ax, ["x", "y", "z"], est, low, high, offset=0.2, width=0.4)
    drawn = _interval_segments(bars)
    np.testing.assert_allclose(drawn[:, 0], np.arange(3) + 0.2)
    np.testing.assert_allclose(drawn[:, 1], low, atol=1e-12)
    np.testing.assert_allclose(drawn[:, 2], high, atol=1e-12)
    np.testing.assert_allclose([p.get_height() for p in ax.patches], est)


def test_a_missing_estimate_draws_no_interval(ax):
    bars = plot_bars_with_ci(ax, ["x", "y"], [0.5, None], [0.4, None], [0.6, None])
    drawn = _interval_segments(bars)
    np.testing.assert_allclose(drawn, [[0, 0.4, 0.6]])
    assert ax.patches[1].get_height() == 0


def test_lines_with_bands_shade_each_interval_and_keep_the_legend_outside(ax):
    x = np.array([1, 2, 4])
    series = {"v2": ([0.7, 0.8, 0.85], [0.6, 0.75, 0.8], [0.8, 0.85, 0.9]),
              "fedavg": ([0.5, 0.6, 0.7], [0.4, 0.5, 0.65], [0.6, 0.7, 0.75])}
    plot_lines_with_bands(ax, x, series)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2 and len(ax.lines) == 2
    for band, (_, lo, hi) in zip(bands, series.values(), strict=True):
        ys = band.get_paths()[0].vertices[:, 1]
        assert ys.min() == pytest.approx(min(lo)) and ys.max() == pytest.approx(max(hi))
        assert band.get_alpha() == pytest.approx(0.2)
    leg, axes = _extents(ax, ax.get_legend())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["v2", "fedavg"] and not leg.overlaps(axes)


def test_reliability_draws_each_bin_interval_and_the_diagonal(ax):
    rows = [{"bin_low": 0.0, "bin_high": 0.5, "count": 0, "confidence": None, "accuracy": None,
             "ci_low": None, "ci_high": None},
            {"bin_low": 0.5, "bin_high": 0.75, "count": 10, "confidence": 0.6, "accuracy": 0.5,
             "ci_low": 0.2, "ci_high": 0.8},
            {"bin_low": 0.75, "bin_high": 1.0, "count": 90, "confidence": 0.9, "accuracy": 0.85,
             "ci_low": 0.78, "ci_high": 0.92}]
    drawn = _interval_segments(plot_reliability(ax, rows, "v2"))
    np.testing.assert_allclose(drawn, [[0.6, 0.2, 0.8], [0.9, 0.78, 0.92]], atol=1e-12)  # empty bin skipped
    diagonal = [line for line in ax.lines if list(line.get_xdata()) == [0, 1] and list(line.get_ydata()) == [0, 1]]
    assert len(diagonal) == 1


def test_save_figure_writes_a_whole_png_atomically(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], label="a long legend entry that sits outside")
    legend = legend_outside(ax)
    save_figure(fig, tmp_path / "sub" / "f.png")
    data = (tmp_path / "sub" / "f.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["f.png"]  # no temporary file left
    assert not plt.fignum_exists(fig.number)
    # the layout made room for the outside legend: it ends inside the figure, not cut at its edge
    assert legend.get_window_extent().x1 <= fig.bbox.x1
    assert ax.get_window_extent().x1 < legend.get_window_extent().x0
