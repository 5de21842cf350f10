"""The training engine on a real (small) synthetic cohort: resume equivalence, identity refusal, failures."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, train

from fedhisto.config.profiles import PROFILES
from fedhisto.config.study import load_config
from fedhisto.train.loop import ResumeRefused, load_checkpoint


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["best"]["members"]["global"]


def test_killed_run_resumes_to_the_identical_result(prepared: dict, tmp_path: Path, repo: Path):
    reference = tmp_path / "reference"
    train(prepared, "past_v2", reference)
    killed = tmp_path / "killed"
    cmd = [sys.executable, str(repo / "scripts/train.py"), "--config", str(prepared["root"] / "config.yaml"),
           "--method", "past_v2", "--seed", "11", "--out", str(killed), "--manifest", str(prepared["manifest"]),
           "--identity", str(prepared["identity"]), "--descriptors", str(prepared["descriptors"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            ckpt = killed / "checkpoint.pt"
            if ckpt.exists() and torch.load(ckpt, map_location="cpu", weights_only=False)["round"] >= 2:
                os.kill(proc.pid, signal.SIGKILL)
                break
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "status.json").exists()
    resumed_from = torch.load(killed / "checkpoint.pt", map_location="cpu", weights_only=False)["round"]
    assert 2 <= resumed_from < 4
    train(prepared, "past_v2", killed)  # resume in-process
    ref, res = final_state(reference), final_state(killed)
    assert ref.keys() == res.keys() and all(torch.equal(ref[k], res[k]) for k in ref)
    assert (reference / "validation_predictions.csv").read_bytes() == (killed / "validation_predictions.csv").read_bytes()
    assert (reference / "history.csv").read_text().count("\n") == (killed / "history.csv").read_text().count("\n")
    assert json.loads((killed / "report.json").read_text())["resumed_at_rounds"] == [resumed_from]
    assert json.loads((reference / "report.json").read_text())["resumed_at_rounds"] == []


def test_resume_refuses_other_identity_and_pipeline_starts_over(prepared: dict, tmp_path: Path):
    out = tmp_path / "run"
    train(prepared, "fedavg_peft", out, cfg=load_config({**TINY, "train": {**TINY["train"], "max_rounds": 1}}))
    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    other = {**ckpt["identity"], "seed": 22}
    with pytest.raises(ResumeRefused, match="seed: checkpoint 11 vs run 22"):
        load_checkpoint(out / "checkpoint.pt", other)
    with pytest.raises(ResumeRefused, match="dataset_identity"):
        load_checkpoint(out / "checkpoint.pt", {**ckpt["identity"], "dataset_identity": "x"})
    changed = load_config({**TINY, "train": {**TINY["train"], "max_rounds": 1, "lr": 5e-4}})
    train(prepared, "fedavg_peft", out, cfg=changed)
    assert list(out.glob("checkpoint.refused-*.pt")), "the foreign checkpoint must be kept aside, not overwritten"
    new = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert new["identity"]["config_hash"] != ckpt["identity"]["config_hash"]


def test_an_unavailable_client_is_recorded_not_fabricated(prepared: dict, tmp_path: Path):
    out = tmp_path / "fault"
    cfg = load_config({**TINY, "train": {**TINY["train"], "max_rounds": 2}})
    train(prepared, "past_v1", out, cfg=cfg, client_fault={0: "C3"})
    history = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["history"]
    first, second = history
    assert "C3" in first["unavailable_clients"] and "C3" not in first["weights"]
    assert sum(first["weights"].values()) == pytest.approx(1.0) and len(first["weights"]) == 4
    assert len(second["weights"]) == 5 and second["unavailable_clients"] == {}
    report = json.loads((out / "report.json").read_text())
    assert report["rounds"] == 2 and 0 <= report["validation_macro_f1"] <= 1
    assert report["unavailable_client_rounds"] == 1 and list(report["unavailable"]) == ["1"]  # JSON keys
    assert json.loads((out / "status.json").read_text())["status"] == "finalised"


def test_any_other_client_error_fails_the_run_and_names_client_and_round(prepared: dict, tmp_path: Path):
    from fedhisto.train.loop import ClientFailure

    out = tmp_path / "error"
    cfg = load_config({**TINY, "train": {**TINY["train"], "max_rounds": 2}})
    with pytest.raises(ClientFailure, match="client C2 failed in round 2"):
        train(prepared, "fedavg_peft", out, cfg=cfg, client_error={1: "C2"})
    failure = json.loads((out / "failure.json").read_text())
    assert (failure["client"], failure["round"], failure["failed"]) == ("C2", 2, "ClientFailure")
    assert "injected error" in failure["error"]
    assert not (out / "status.json").exists() and not (out / "report.json").exists()


def test_more_unavailable_client_rounds_than_allowed_fail_the_run(prepared: dict, tmp_path: Path):
    out = tmp_path / "budget"
    cfg = load_config({**TINY, "train": {**TINY["train"], "max_rounds": 3, "max_unavailable_client_rounds": 1}})
    summary = train(prepared, "fedavg_peft", out, cfg=cfg, client_fault={0: "C1", 1: "C2"})
    assert summary["failed"] == "TooManyUnavailable" and "max_unavailable_client_rounds=1" in summary["error"]
    assert json.loads((out / "status.json").read_text())["status"] == "failed"
    assert not (out / "report.json").exists()


def test_checkpoint_holds_adapters_only(prepared: dict, tmp_path: Path):
    out = tmp_path / "small"
    train(prepared, "film_zero", out, cfg=load_config({**TINY, "train": {**TINY["train"], "max_rounds": 1}}))
    state = final_state(out)
    assert all(("lora_" in k) or k.startswith(("adapter.", "film.", "classifier.")) for k in state)
    assert not any(k.startswith("encoder.") and "lora_" not in k for k in state)


def test_failed_validation_writes_failure_not_report_and_checkpoint_still_predicts(prepared: dict, tmp_path: Path,
                                                                                   monkeypatch):
    import fedhisto.train.stage as stage
    from fedhisto.predict.stage import PredictionRefused, run_predict

    monkeypatch.setattr(stage, "validate_outcome", lambda ckpt, metric: ["report failed validation (injected)"])
    out = tmp_path / "failing"
    cfg = load_config({**TINY, "train": {**TINY["train"], "max_rounds": 1}})
    train(prepared, "fedprox_peft", out, cfg=cfg)
    assert not (out / "report.json").exists()
    failure = json.loads((out / "failure.json").read_text())
    assert failure["problems"] == ["report failed validation (injected)"] and failure["checkpoint_usable"]
    assert json.loads((out / "status.json").read_text())["status"] == "failed"
    summary = run_predict("fedprox_peft", 11, out, prepared["manifest"], prepared["identity"], prepared["descriptors"],
                          cfg, tmp_path / "pred")
    external = sum(PROFILES[prepared["cfg"].cohort.synthetic.profile].external)
    assert summary["status"] == "failed" and summary["images"]["external"] == external
    assert "failed" in (tmp_path / "pred/test.csv").read_text()
    other = tmp_path / "other_identity.json"
    other.write_text(json.dumps({"dataset_identity": "0" * 64}))
    with pytest.raises(PredictionRefused, match="dataset identity"):
        run_predict("fedprox_peft", 11, out, prepared["manifest"], other, prepared["descriptors"], cfg, tmp_path / "p2")


def test_temperature_scaling_option_rescales_written_probabilities_by_the_validation_fit(prepared: dict,
                                                                                      tmp_path: Path):
    import numpy as np

    from fedhisto.infra.provenance import read_sidecar
    from fedhisto.predict.stage import run_predict
    from fedhisto.stats.prediction_files import read_predictions
    from fedhisto.stats.temperature import apply_temperature, fit_temperature

    out = tmp_path / "run"
    plain = load_config({**TINY, "train": {**TINY["train"], "max_rounds": 1}})
    scaled = load_config({**TINY, "train": {**TINY["train"], "max_rounds": 1}, "evaluate": {"temperature_scaling": True}})
    train(prepared, "fedavg_peft", out, cfg=plain)
    args = ("fedavg_peft", 11, out, prepared["manifest"], prepared["identity"], prepared["descriptors"])
    run_predict(*args, plain, tmp_path / "raw")
    run_predict(*args, scaled, tmp_path / "scaled")
    _, vy, vp = read_predictions(out / "validation_predictions.csv")["global"]
    t = fit_temperature(vp, vy)
    assert read_sidecar(tmp_path / "scaled/external.csv")["temperatures"] == {"global": t}
    assert abs(t - 1.0) > 1e-3  # a one-round model is not calibrated: the option must change something
    _, _, raw = read_predictions(tmp_path / "raw/external.csv")["global"]
    _, _, got = read_predictions(tmp_path / "scaled/external.csv")["global"]
    # the written probabilities are the raw ones rescaled (up to the CSVs' 8-decimal rounding)
    assert np.abs(got - apply_temperature(raw, t)).max() < 1e-6
    assert "temperatures" not in read_sidecar(tmp_path / "raw/external.csv")


@pytest.mark.parametrize("method", ["fedstain", "fedstain_code"])
def test_fedstain_variants_train_log_their_terms_and_resume_bitwise(prepared: dict, tmp_path: Path, method: str):
    """Both comparator variants run on the same engine: their losses are logged (four or three different
    views never agree exactly), a run stopped after round 1 resumes to the identical state (pools are
    recomputed from the checkpointed global state), and the exchanged and checkpointed state is the
    fedavg_peft one (no FiLM, no prototypes)."""
    cfg = prepared["cfg"].model_copy(update={"train": prepared["cfg"].train.model_copy(update={"max_rounds": 2})})
    reference = tmp_path / "reference"
    assert train(prepared, method, reference, cfg=cfg)["rounds"] == 2
    with (reference / "history.csv").open() as fh:
        losses = [json.loads(r["losses"]) for r in csv.DictReader(fh)]
    for per_client in losses:
        for terms in per_client.values():
            assert set(terms) == {"ce", "supcon", "js"}
            assert terms["supcon"] > 0 and terms["js"] > 0
    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        train(prepared, method, stopped, cfg=cfg, stop_after_round=1)
    assert train(prepared, method, stopped, cfg=cfg)["resumed_at_rounds"] == [1]
    a, b = final_state(reference), final_state(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if method == "fedstain":
        fedavg = tmp_path / "fedavg"
        train(prepared, "fedavg_peft", fedavg, cfg=cfg)
        assert set(final_state(fedavg)) == set(a)


def test_fedstain_switches_turn_its_views_back_into_the_plain_view(prepared: dict, tmp_path: Path):
    """With RandStain, AugMix and MixStyle off the four views are one image, so the JS term only sees
    dropout noise: it falls by more than an order of magnitude against the full method."""
    def first_round_js(out: Path, **switches) -> list[float]:
        fs = prepared["cfg"].train.fedstain.model_copy(update=switches)
        cfg = prepared["cfg"].model_copy(update={"train": prepared["cfg"].train.model_copy(
            update={"max_rounds": 1, "fedstain": fs})})
        train(prepared, "fedstain", out, cfg=cfg)
        with (out / "history.csv").open() as fh:
            return [terms["js"] for terms in json.loads(next(csv.DictReader(fh))["losses"]).values()]

    full = first_round_js(tmp_path / "full")
    plain = first_round_js(tmp_path / "plain", randstain=False, augmix=False, mixstyle=False)
    assert all(p < f / 10 for p, f in zip(plain, full, strict=True)), (plain, full)


def test_one_process_predicting_every_seed_writes_the_files_of_one_process_per_seed(prepared: dict, tmp_path: Path):
    """The predict_cohorts job of a method predicts all its seeds; its CSVs must be those of a job per seed,
    byte for byte (the evaluation images are decoded once and reused; each seed builds its own model)."""
    from fedhisto.predict.stage import run_predict, run_predict_seeds
    from fedhisto.train.stage import run_train

    cfg = load_config({**TINY, "train": {**TINY["train"], "max_rounds": 1}})
    inputs = (prepared["manifest"], prepared["identity"], prepared["descriptors"])
    runs = {seed: tmp_path / f"train/seed{seed}" for seed in (11, 22)}
    for seed, out in runs.items():
        run_train("past_v2", seed, *inputs, cfg, out)
    grouped = run_predict_seeds("past_v2", [(s, d, tmp_path / f"grouped/seed{s}") for s, d in runs.items()], *inputs, cfg)
    for seed, out in runs.items():
        alone = run_predict("past_v2", seed, out, *inputs, cfg, tmp_path / f"alone/seed{seed}")
        assert grouped[seed] == alone
        for cohort in ("test", "holdout", "external"):
            assert (tmp_path / f"grouped/seed{seed}/{cohort}.csv").read_bytes() == \
                (tmp_path / f"alone/seed{seed}/{cohort}.csv").read_bytes()
    # two seeds' models do differ, so equal files are not an accident of identical checkpoints
    assert (tmp_path / "grouped/seed11/external.csv").read_bytes() != (tmp_path / "grouped/seed22/external.csv").read_bytes()
