"""The report's figures (fedhisto.report.figures): each estimate drawn with the 95 % bootstrap CI
of its ensemble's external predictions, and no legend over the data."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from fedhisto.infra.plotting import save_figure
from fedhisto.report import figures as report_figures
from fedhisto.stats.prediction_files import MEMBER_COLUMN, PROB_COLUMNS, ensemble_members, write_predictions
from fedhisto.stats.resampling import bootstrap_interval
from fedhisto.stats.scores import classification_metrics, mean_over_models
from fedhisto.stats.temperature import reliability_bins

CLASSES = ("ACA", "Normal", "SCC")
RIGHT = {"fedavg_peft": 0.6, "past_v2": 0.85, "v2_no_js": 0.75, "local_only": 0.5}
RESAMPLES, SEED = 300, 20260730


def _write(path, y, probs_by_model: dict[str, np.ndarray]) -> None:
    rows = []
    for model, probs in probs_by_model.items():
        for i, (label, p) in enumerate(zip(y, probs, strict=True)):
            rows.append({"sample_id": f"img{i:04d}", "label": CLASSES[label], **dict(zip(PROB_COLUMNS, p, strict=True)),
                         "pred": CLASSES[int(p.argmax())], "cohort": "external", "client": "", "differentiation": "",
                         "magnification": "", "run_status": "finalised", MEMBER_COLUMN: model})
    write_predictions(path, rows)


def _probs(y: np.ndarray, right: float, rng: np.random.Generator) -> np.ndarray:
    pred = np.where(rng.random(len(y)) < right, y, rng.integers(0, 3, len(y)))
    top = rng.uniform(0.4, 0.95, len(y))
    p = np.repeat(((1 - top) / 2)[:, None], 3, axis=1)
    p[np.arange(len(y)), pred] = top
    return np.round(p, 8)


@pytest.fixture
def report_inputs(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 240)
    external = {}
    for method, right in RIGHT.items():
        models = ("client_a", "client_b") if method == "local_only" else ("global",)
        files = []
        for seed in (11, 22):
            path = tmp_path / f"predictions/{method}/seed{seed}/external.csv"
            _write(path, y, {m: _probs(y, right, rng) for m in models})
            files.append(str(path))
        external[method] = files
    ensembles = {}
    for method, files in external.items():
        members = ensemble_members(files)
        ensembles[method] = mean_over_models([classification_metrics(p, yy) for _, yy, p in members.values()])
    boots = [{"comparison": "v2_vs_no_js", "ablation": True,
              "metrics": {"macro_f1": {"difference": 0.05, "ci_low": 0.01, "ci_high": 0.09}}}]
    return {"ensembles": ensembles}, boots, external, tmp_path / "figures"


@pytest.fixture
def drawn(report_inputs, monkeypatch):
    """Run write_figures, keeping each saved figure by file name for inspection."""
    figs = {}

    def keep(fig, path):
        figs[path.name] = fig
        save_figure(fig, path)

    monkeypatch.setattr(report_figures, "save_figure", keep)
    m, boots, external, figures = report_inputs
    report_figures.write_figures(m, boots, external, figures, RESAMPLES, SEED, 0.95)
    return figs, report_inputs


def _segments(container) -> np.ndarray:
    return np.array([[s[0][0], s[0][1], s[1][1]] for s in container.lines[2][0].get_segments() if len(s)])


def _interval(external, method, metric):
    members = ensemble_members(external[method])
    _, y, _ = next(iter(members.values()))
    return bootstrap_interval(y, [p.argmax(1) for _, _, p in members.values()], RESAMPLES, SEED)[metric]


def test_all_five_figures_are_written(drawn):
    figs, (_, _, _, figures) = drawn
    assert sorted(p.name for p in figures.glob("*.png")) == sorted(
        ["ensemble_macro_f1.png", "class_recall.png", "confusion_v2.png", "ablation_forest.png", "reliability.png"])
    assert set(figs) == {p.name for p in figures.glob("*.png")}


@pytest.mark.parametrize(("name", "metrics"), [("ensemble_macro_f1.png", ["macro_f1", "balanced_accuracy"]),
                                               ("class_recall.png", [f"recall_{c}" for c in CLASSES])])
def test_bars_carry_the_ensembles_bootstrap_intervals(drawn, name, metrics):
    figs, (m, _, external, _) = drawn
    ax = figs[name].axes[0]
    containers = [c for c in ax.containers if hasattr(c, "has_yerr")]
    assert len(containers) == len(metrics)
    methods = list(m["ensembles"])
    for container, metric in zip(containers, metrics, strict=True):
        want = [_interval(external, k, metric) for k in methods]
        got = _segments(container)
        np.testing.assert_allclose(got[:, 1], [w["ci_low"] for w in want], atol=1e-12)
        np.testing.assert_allclose(got[:, 2], [w["ci_high"] for w in want], atol=1e-12)
        # the estimate is Table 5's value (local_only: the mean over its client models)
        table = [m["ensembles"][k][metric] if "recall" not in metric
                 else m["ensembles"][k]["per_class"][metric.removeprefix("recall_")]["recall"] for k in methods]
        np.testing.assert_allclose([w["estimate"] for w in want], table, atol=1e-12)
    heights = [patch.get_height() for patch in ax.patches]
    np.testing.assert_allclose(heights, [_interval(external, k, metric)["estimate"]
                                         for metric in metrics for k in methods], atol=1e-12)
    assert any(w > 0.05 for w in got[:, 2] - got[:, 1])  # real intervals, not zero-width bars


@pytest.mark.parametrize("name", ["ensemble_macro_f1.png", "class_recall.png", "reliability.png"])
def test_no_legend_covers_the_data(drawn, name):
    fig = drawn[0][name]
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)  # save_figure closed it: a fresh canvas draws it with the saved layout
    canvas.draw()
    renderer = canvas.get_renderer()
    legend = ax.get_legend()
    assert legend is not None
    assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


def test_reliability_points_carry_per_bin_intervals(drawn):
    figs, (_, _, external, _) = drawn
    ax = figs["reliability.png"].axes[0]
    containers = [c for c in ax.containers if hasattr(c, "has_yerr")]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fedavg_peft", "past_v2"]
    for container, method in zip(containers, ("fedavg_peft", "past_v2"), strict=True):
        _, y, p = next(iter(ensemble_members(external[method]).values()))
        rows = [r for r in reliability_bins(p, y, 15, RESAMPLES, SEED) if r["count"]]
        np.testing.assert_allclose(_segments(container), [[r["confidence"], r["ci_low"], r["ci_high"]] for r in rows],
                                   atol=1e-12)


def test_missing_predictions_for_a_method_are_refused(report_inputs):
    m, boots, external, figures = report_inputs
    del external["v2_no_js"]
    with pytest.raises(ValueError, match="no external predictions for v2_no_js"):
        report_figures.write_figures(m, boots, external, figures, RESAMPLES, SEED, 0.95)
