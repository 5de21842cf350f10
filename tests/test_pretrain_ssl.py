"""Self-supervised pretraining on the clients' optimisation images only, and the real-data caveats."""

from __future__ import annotations

import csv
import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedhisto.caveats import TINY_SELF_SUPERVISED, TINY_SYNTHETIC, log_caveats, run_caveats
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import load_config
from fedhisto.model.encoder import load_encoder_folder
from fedhisto.pretrain.ssl_objective import PretrainDataError, nt_xent, optimisation_rows
from fedhisto.pretrain.stage import run_pretrain

COLUMNS = ("sample_id", "path", "label", "split", "client")
TINY_SSL = {"model": {"encoder": {"name": "tiny"},
                      "pretrain": {"enabled": True, "objective": "self_supervised", "epochs": 2, "batch": 4}},
            "views": {"crop_size": 32}}
REAL = {"cohort": {"mode": "real", "real": {"sources": [{"kind": "lc25000", "root": "/x"}]}},
        "manifest": {"targets": {"clients": {"C1": [1, 1, 1]}, "validation": [1, 1, 1], "test": [1, 1, 1]}},
        "model": {"encoder": {"name": "tiny"}, "pretrain": {"enabled": True}}}


def _manifest(tmp_path: Path) -> Path:
    """Six optimisation images of two clients; every other split points at files that do not exist, so
    reading any of them would fail the run."""
    rows = []
    for k in range(6):
        rgb = np.random.default_rng(k).integers(0, 255, (40, 40, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(tmp_path / f"opt{k}.png")
        rows.append({"sample_id": f"{k:016x}", "path": str(tmp_path / f"opt{k}.png"), "label": "ACA",
                     "split": "optimisation", "client": f"C{1 + k % 2}"})
    for k, split in enumerate(("validation", "test", "external", "holdout", "unused")):
        rows.append({"sample_id": f"{100 + k:016x}", "path": str(tmp_path / f"absent_{split}.png"), "label": "SCC",
                     "split": split, "client": "C1" if split == "holdout" else ""})
    path = tmp_path / "manifest.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_self_supervised_pretraining_reads_only_optimisation_images_and_records_them(tmp_path: Path):
    manifest = _manifest(tmp_path)
    cfg = load_config(TINY_SSL)
    report = run_pretrain(cfg, tmp_path / "enc", manifest_csv=manifest)  # the absent files were never opened
    record = report["self_supervised"]
    assert record["splits_used"] == ["optimisation"] and record["images"] == 6
    assert record["per_client"] == {"C1": 3, "C2": 3}
    assert record["left_out"] == {"external": 1, "holdout": 1, "test": 1, "unused": 1, "validation": 1}
    ids = "\n".join(f"{k:016x}" for k in range(6))
    assert record["sample_ids_sha256"] == hashlib.sha256(ids.encode()).hexdigest()
    assert "manifest" in report["provenance"]["inputs"] and report["caveats"] == []
    assert len(report["history"]) == 2 and all(np.isfinite(h["loss"]) for h in report["history"])
    assert record["collapsed"] is (report["history"][-1]["loss"] >= 0.99 * report["history"][-1]["chance_loss"])
    saved = json.loads((tmp_path / "enc/pretrain_report.json").read_text())
    assert saved["objective"] == "self_supervised"
    load_encoder_folder(tmp_path / "enc", "tiny")  # strict round trip


def test_pretraining_refuses_a_manifest_it_cannot_restrict_to_optimisation_images(tmp_path: Path):
    bad = tmp_path / "no_split.csv"
    bad.write_text("sample_id,path,label,client\n0000000000000001,x.png,ACA,C1\n")
    with pytest.raises(PretrainDataError, match=r"no_split\.csv: no column \['split'\]"):
        optimisation_rows(bad)
    only_test = tmp_path / "only_test.csv"
    only_test.write_text("sample_id,path,label,split,client\n0000000000000001,x.png,ACA,test,\n")
    with pytest.raises(PretrainDataError, match="no row with split 'optimisation'"):
        optimisation_rows(only_test)
    with pytest.raises(PretrainDataError, match="needs the manifest"):
        run_pretrain(load_config(TINY_SSL), tmp_path / "enc")


def test_nt_xent_rewards_matching_views_and_is_chance_for_unrelated_ones():
    z = torch.eye(8) * 10  # orthogonal images: cosine 1 to the partner view, 0 to the 14 other views
    assert float(nt_xent(z, z.clone(), 0.2)) == pytest.approx(np.log(1 + 14 * np.exp(-1 / 0.2)), rel=1e-5)
    torch.manual_seed(0)
    unrelated = float(nt_xent(torch.randn(256, 32), torch.randn(256, 32), 1.0))
    assert unrelated == pytest.approx(np.log(2 * 256 - 1), rel=0.05)  # chance: one positive among 2n - 1


def test_the_default_objective_leaves_the_pretrain_and_train_blocks_as_they_were():
    base = load_config({"model": {"encoder": {"name": "tiny"}, "pretrain": {"enabled": True}}})
    block = stage_block(base, "pretrain")["pretrain"]
    assert set(block) == {"enabled", "images_per_class", "epochs", "lr", "batch", "seed"}
    assert stage_block(base, "train", method="past_v2", seed=11)["model"]["pretrain"] == block
    ssl = load_config(TINY_SSL)
    assert stage_block(ssl, "pretrain")["pretrain"]["objective"] == "self_supervised"
    # IF_CHANGED fields (config_base): the objective's settings enter once set away from their defaults
    assert "temperature" not in stage_block(ssl, "pretrain")["pretrain"]
    warmer = load_config({**TINY_SSL, "model": {**TINY_SSL["model"], "pretrain": {
        **TINY_SSL["model"]["pretrain"], "temperature": 0.5}}})
    assert stage_block(warmer, "train", method="past_v2", seed=11)["model"]["pretrain"]["temperature"] == 0.5


def test_a_real_cohort_with_the_tiny_encoder_or_a_short_schedule_is_said_loudly(caplog):
    assert run_caveats(load_config({"model": {"encoder": {"name": "tiny"}}, "train": {"max_rounds": 5}})) == []
    real = load_config({**REAL, "train": {"max_rounds": 15, "patience": 4}})
    caveats = run_caveats(real)
    assert caveats[0] == TINY_SYNTHETIC and "0.556" in caveats[0] and "self_supervised" in caveats[0]
    assert "train.max_rounds 15 / train.patience 4 are below the study's 50 / 10" in caveats[1]
    study_schedule = load_config({**REAL, "train": {"max_rounds": 50, "patience": 10}})
    assert run_caveats(study_schedule) == [TINY_SYNTHETIC]
    ssl = load_config({**REAL, "model": {"encoder": {"name": "tiny"},
                                         "pretrain": {"enabled": True, "objective": "self_supervised"}}})
    assert run_caveats(ssl)[0] == TINY_SELF_SUPERVISED
    hibou = load_config({**REAL, "model": {"encoder": {"name": "hibou-b"}}})
    assert run_caveats(hibou) == [c for c in run_caveats(hibou) if "schedule" in c or "max_rounds" in c]
    with caplog.at_level(logging.WARNING):
        log_caveats(real, logging.getLogger("fedhisto.pretrain.stage"))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "synthetic tissue only" in warnings[0].getMessage()
