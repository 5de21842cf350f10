"""Library code of the controlled experiments: condition manifests, layout and interval statistics."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from test_manifest import write_corpus

from fedhisto.clearance.stage import kept_by
from fedhisto.config.study import load_config
from fedhisto.experiments import dose_response, layout, leakage, leave_one_site_out
from fedhisto.experiments.conditions import ConditionError, leave_one_site_out_manifest, policy_manifest
from fedhisto.experiments.leakage import relatives_in_training
from fedhisto.manifest.stage import run_manifest
from fedhisto.stats.ensemble_intervals import difference, interval, metric_replicates
from fedhisto.stats.scores import macro_f1


def _rows(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize(
    ("policy", "representative", "cohort", "home", "kept"),
    [("representatives", True, "internal", "internal", True),
     ("representatives", False, "internal", "internal", False),
     ("whole_families", False, "internal", "internal", True),
     ("whole_families", False, "external", "internal", False),  # never across the cohort boundary
     ("ignore_families", False, "external", "internal", True)],  # the leaky split keeps everything
)
def test_which_family_members_each_policy_keeps(policy, representative, cohort, home, kept):
    assert kept_by(policy, representative, cohort, home) is kept


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, Path]:
    return write_corpus(tmp_path_factory.mktemp("corpus"), "small", copies_as_separate_families=True)


def test_leaky_split_places_copies_beside_their_originals_and_says_so(corpus, tmp_path: Path):
    sources, families, edges = corpus
    cfg = load_config({})
    leaky = policy_manifest(sources, families, edges, cfg, "ignore_families", tmp_path / "leaky")
    clean = policy_manifest(sources, families, edges, cfg, "representatives", tmp_path / "clean")
    n_families_rows = len(_rows(families))
    assert leaky["images"] == n_families_rows > clean["images"]  # every copy enters the leaky manifest
    assert leaky["boundary_audit"]["result"].startswith("LEAKY by design")
    assert leaky["boundary_audit"]["cross_boundary_family_edges"]  # the audit records what leaks
    assert clean["boundary_audit"]["cross_boundary_family_edges"] == []
    assert relatives_in_training(tmp_path / "clean/manifest.csv") == set()
    leaked = relatives_in_training(tmp_path / "leaky/manifest.csv")
    test_rows = [r for r in _rows(tmp_path / "leaky/manifest.csv") if r["split"] == "test"]
    assert leaked and leaked <= {r["sample_id"] for r in test_rows}
    refiled = _rows(tmp_path / "clean/families.csv")
    assert sum(r["keep"] == "True" for r in refiled) == clean["images"]
    assert json.loads((tmp_path / "leaky/families.csv.prov.json").read_text())["stage"] == "experiments"


def test_leave_one_site_out_moves_the_whole_site_to_the_test_cohort(corpus, tmp_path: Path):
    sources, families, edges = corpus
    cfg = load_config({})
    main = run_manifest(sources, families, edges, cfg, tmp_path / "main")
    summary = leave_one_site_out_manifest(tmp_path / "main/manifest.csv", tmp_path / "main/manifest.json", "C2", cfg,
                                          tmp_path / "loso")
    before, after = _rows(tmp_path / "main/manifest.csv"), _rows(tmp_path / "loso/manifest.csv")
    by_id = {r["sample_id"]: r for r in before}
    assert not any(r["client"] == "C2" for r in after)
    external = {r["sample_id"] for r in after if r["split"] == "external"}
    expected = {r["sample_id"] for r in before if r["client"] == "C2"
                or (r["split"] in ("validation", "test") and r["site"] == "site2")}
    assert external == expected and len(external) == summary["external_images"]
    assert summary["moved_to_external"]["C2:optimisation"] > 0 and summary["moved_to_external"]["validation"] > 0
    assert not any(r["site"] == "site2" for r in after if r["split"] in ("validation", "test"))
    for r in after:  # the other clients' data is untouched; the study's external cohort is set aside
        if r["sample_id"] not in external and r["cohort"] == "internal":
            unchanged = r["split"] == by_id[r["sample_id"]]["split"] and r["client"] == by_id[r["sample_id"]]["client"]
            set_aside = r["split"] == "unused" and r["family"] in {by_id[i]["family"] for i in external}
            assert unchanged or set_aside
        if r["cohort"] == "external":
            assert r["split"] == "unused"
    families_out = {by_id[i]["family"] for i in external}
    assert not any(r["family"] in families_out for r in after if r["client"])  # no relative left in training
    assert summary["dataset_identity"] != main["dataset_identity"]
    with pytest.raises(ConditionError, match="C6"):  # a client without images
        leave_one_site_out_manifest(tmp_path / "main/manifest.csv", tmp_path / "main/manifest.json", "C6", cfg,
                                    tmp_path / "none")


def test_layout_reuses_main_runs_and_names_every_input():
    cfg = load_config({})
    assert layout.run_dir(cfg, "leakage/representatives", "train", "past_v2", 11) == "results/train/past_v2/seed11"
    assert layout.run_dir(cfg, "dose_response/stain_invariant", "predictions", "past_v2", 11) == \
        "results/predictions/past_v2/seed11"
    assert layout.run_dir(cfg, "leakage/ignore_families", "train", "past_v2", 11) == \
        "results/experiments/leakage/ignore_families/train/past_v2/seed11"
    assert layout.condition_inputs(cfg, "dose_response/plain")["encoder"] == [dose_response.PLAIN_ENCODER]
    loso = layout.condition_inputs(cfg, "leave_one_site_out/C3")
    assert loso["manifest"] == "results/experiments/leave_one_site_out/C3/manifest/manifest.csv"
    assert loso["descriptors"] == "results/experiments/leave_one_site_out/C3/stain/descriptors.json"
    assert layout.condition_inputs(cfg, "leakage/whole_families")["descriptors"] == \
        "results/experiments/leakage/whole_families/stain/descriptors.json"
    assert leakage.leakage_manifest(cfg, "representatives") == "results/manifest/manifest.csv"
    with pytest.raises(ValueError, match="unknown experiment condition"):
        layout.condition_inputs(cfg, "nothing/here")
    plain = dose_response.plain_encoder_config(cfg)
    assert plain.model.pretrain.stain_views is False and cfg.model.pretrain.stain_views is True
    x = cfg.experiments
    assert len(leave_one_site_out.leave_one_site_out_runs(cfg)) == len(x.leave_one_site_out.left_out) * \
        len(leave_one_site_out.leave_one_site_out_methods(cfg)) * len(x.leave_one_site_out.seeds)


def test_experiments_config_rejects_designs_without_their_comparison():
    with pytest.raises(Exception, match="past_v2"):
        load_config({"experiments": {"methods": ["fedavg_peft"]}})
    with pytest.raises(Exception, match="ignore_families"):
        load_config({"experiments": {"leakage": {"policies": ["representatives", "whole_families"]}}})
    with pytest.raises(Exception, match="ascending"):
        load_config({"experiments": {"dose_response": {"severities": [1.0, 0.0]}}})
    plain_main = load_config({"model": {"pretrain": {"stain_views": False}}})  # a valid study config
    with pytest.raises(ValueError, match="stain_views"):
        dose_response.shifted_inputs(plain_main, "stain_invariant", "past_v2", 11)
    with pytest.raises(Exception, match="unknown method"):
        load_config({"experiments": {"leakage": {"methods": ["nope"]}}})


def test_replicates_start_with_the_point_estimate_and_bracket_it():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 200)
    probs = rng.dirichlet(np.ones(3), 200)
    probs[np.arange(150), y[:150]] += 2.0  # right on 150 of 200 images
    probs /= probs.sum(1, keepdims=True)
    reps = metric_replicates(y, probs, 500, seed=3)
    assert reps["macro_f1"][0] == pytest.approx(macro_f1(y, probs.argmax(1)), abs=1e-12)
    iv = interval(reps["macro_f1"])
    assert iv["ci_low"] < iv["estimate"] < iv["ci_high"]
    # binomial-scale width: sd of a proportion near 0.78 over 200 images is ~0.03, so the 95 % CI ~0.12 wide
    assert 0.06 < iv["ci_high"] - iv["ci_low"] < 0.2
    same = difference(reps["macro_f1"], reps["macro_f1"])
    assert same["estimate"] == 0.0 and same["ci_low"] == same["ci_high"] == 0.0 and same["p_two_sided"] == 1.0
    assert np.array_equal(metric_replicates(y, probs, 500, seed=3)["ece"], reps["ece"])  # seeded


def test_leave_one_site_out_under_whole_families_sets_cross_site_relatives_aside(corpus, tmp_path: Path):
    sources, families, edges = corpus
    cfg = load_config({"clearance": {"family_policy": "whole_families"}})
    run_manifest(sources, families, edges, cfg, tmp_path / "main")
    summary = leave_one_site_out_manifest(tmp_path / "main/manifest.csv", tmp_path / "main/manifest.json", "C2", cfg,
                                          tmp_path / "loso")
    after = _rows(tmp_path / "loso/manifest.csv")
    test_families = {r["family"] for r in after if r["split"] == "external"}
    kept = [r for r in after if r["split"] in ("optimisation", "holdout", "validation", "test")]
    assert kept and not any(r["family"] in test_families for r in kept)
    assert summary["relatives_set_aside"] > 0  # this corpus plants copies across sites: the rule did act
