from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from fedhisto.config.study import Config, ConfigError, json_schema_text, load_config, load_config_file


def test_defaults_are_the_studys_numbers():
    cfg = Config()
    t = cfg.manifest
    assert t.split_seed == 2026
    assert t.holdout_fraction == {"C1": 0.1, "C2": 0.1, "C3": 0.1, "C4": 0.1, "C5": 0.15}
    assert (cfg.model.lora_r, cfg.model.lora_alpha, cfg.model.lora_dropout) == (8, 16, 0.05)
    assert (cfg.model.adapter_hidden, cfg.model.film_hidden, cfg.model.film_scale) == (256, 64, 0.10)
    assert cfg.model.encoder.revision == "7fdc8cce365ebfd9e7e60e6e9a8d4d59388f3c"
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.grad_clip) == (1e-4, 1e-4, 5.0)
    assert (cfg.train.max_rounds, cfg.train.patience, cfg.train.min_delta) == (50, 10, 1e-4)
    assert (cfg.train.past.weight_js, cfg.train.past.weight_feat, cfg.train.past.weight_proto) == (0.25, 0.10, 0.05)
    assert (cfg.bootstrap.seed, cfg.bootstrap.resamples, cfg.bootstrap.ablation_resamples) == (20260730, 10_000, 5_000)
    assert cfg.clearance.phash_threshold == 10
    assert cfg.evaluate.ece_bins == 15


def test_paper_yaml_holds_table2(repo: Path):
    cfg = load_config_file(repo / "config/paper.yaml")
    targets = cfg.partition_targets()
    total = sum(map(sum, targets.clients.values())) + sum(targets.validation) + sum(targets.test)
    assert total == 8922
    assert targets.clients["C5"] == (1181, 1831, 0)
    assert cfg.model.encoder.name == "hibou-b" and cfg.model.encoder.require_pretrained
    # representatives leave ~250 LC25000 images per class: Table 2 needs whole families, never scaling
    assert cfg.clearance.family_policy == "whole_families" and not cfg.manifest.allow_scaling


def test_default_yaml_takes_targets_from_profile(repo: Path):
    cfg = load_config_file(repo / "config/config.yaml")
    assert cfg.cohort.mode == "synthetic"
    assert cfg.partition_targets() == cfg.profile_targets()


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        ({"cohort": {"synthetic": {"profile": "huge"}}}, ["cohort.synthetic.profile", "'small', 'small_eval', 'paper' or 'tiny'", "'huge'"]),
        ({"cohort": {"colour": 1}}, ["unknown key 'cohort.colour'", "allowed keys here: mode, real, synthetic"]),
        ({"bogus": 1}, ["unknown key 'bogus'", "cohort"]),
        ({"train": {"lr": -1}}, ["train.lr", "greater than 0"]),
        ({"train": {"methods": ["fedsgd"]}}, ["train.methods.0", "fedavg_peft"]),
        ({"classes": ["Normal", "ACA", "SCC"]}, ["classes must be exactly"]),
        ({"cohort": {"mode": "real"}}, ["cohort.real.sources is empty"]),
        ({"manifest": {"holdout_fraction": {"C1": 1.5}}}, ["holdout_fraction.C1", "(0, 1)"]),
        ({"cohort": {"real": {"sources": [{"kind": "tcga", "root": "/x"}]}}},
         ["cohort.real.sources.0.kind", "'lc25000'"]),
    ],
)
def test_bad_config_names_key_and_allowed_values(raw, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_synthetic_targets_must_agree_with_profile():
    raw = {"manifest": {"targets": {"validation": [1, 2, 3]}}}
    with pytest.raises(ConfigError, match="disagree with synthetic profile 'small'"):
        load_config(raw)


def test_committed_schema_is_generated_from_models(repo: Path):
    committed = (repo / "workflow/schemas/config.schema.json").read_text()
    assert committed == json_schema_text(), "run: fedhisto schema --write workflow/schemas/config.schema.json"


def test_schema_accepts_shipped_configs_and_rejects_unknown_keys(repo: Path):
    import jsonschema

    schema = json.loads((repo / "workflow/schemas/config.schema.json").read_text())
    for name in ("config.yaml", "paper.yaml"):
        jsonschema.validate(yaml.safe_load((repo / "config" / name).read_text()), schema)
    with pytest.raises(jsonschema.ValidationError, match="colour"):
        jsonschema.validate({"cohort": {"colour": 1}}, schema)


def test_snakemake_stops_before_any_job_on_bad_config(repo: Path, tmp_path: Path, snakemake_bin: str):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cohort:\n  synthetic:\n    profile: huge\n")
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(tmp_path), "--cores", "1",
                           "all", "--configfile", str(bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "profile" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("key", ["seeds", "ablation_seeds"])
@pytest.mark.parametrize(("seeds", "message"), [
    ([-1, 11, 33, 55], r"train\.\w*seeds': Value error, seeds are non-negative integers \(got \[-1\]\)"),
    ([11, 11, 33, 55], r"train\.\w*seeds': Value error, seeds must be distinct \(\[11\] listed more than once\)"),
])
def test_run_seeds_are_distinct_non_negative_integers_named_by_key(key: str, seeds: list[int], message: str):
    with pytest.raises(ConfigError, match=message):
        load_config({"train": {key: seeds, **({"seeds": [11, 33, 55]} if key == "ablation_seeds" else {})}})


def test_method_settings_blocks_come_from_the_registry_and_the_stored_schema_is_current():
    from fedhisto.config.study import settings_schema_text
    from fedhisto.methods import settings_blocks
    from fedhisto.registries.method_registry import SCHEMA_FILE

    assert SCHEMA_FILE.read_text() == settings_schema_text(), "run: fedhisto schema --write workflow/schemas/config.schema.json"
    cfg = load_config({"train": {"past": {"weight_js": 0.5}}})
    assert set(settings_blocks()) <= set(type(cfg.train).model_fields)
    assert cfg.train.past.weight_js == 0.5 and cfg.train.fedstain.upload_ratio == 0.1
    with pytest.raises(ConfigError, match=r"unknown key 'train\.past\.weight_jss'"):
        load_config({"train": {"past": {"weight_jss": 0.5}}})
    with pytest.raises(ConfigError, match=r"train\.fedstain\.upload_ratio"):
        load_config({"train": {"fedstain": {"upload_ratio": 2.0}}})


def test_if_changed_fields_enter_identities_only_when_set():
    from fedhisto.config.stage_blocks import stage_block

    default = stage_block(load_config({}), "train", method="past_v2", seed=11)
    # train.engine is an unless("sequential") field: the batched default enters, sequential does not
    sequential = stage_block(load_config({"train": {"engine": "sequential"}}), "train", method="past_v2", seed=11)
    assert "engine" not in sequential["train"] and default["train"]["engine"] == "batched"
    assert {k: v for k, v in default["train"].items() if k != "engine"} == sequential["train"]
    assert "stain_views" not in default["model"]["pretrain"]
    assert stage_block(load_config({"model": {"pretrain": {"stain_views": False}}}), "train", method="past_v2",
                       seed=11)["model"]["pretrain"]["stain_views"] is False


def test_comparator_seeds_give_only_the_extra_comparators_fewer_seeds():
    base = {"train": {"methods": ["fedavg_peft", "past_v2", "fedstain", "local_only"], "ablations": ["v2_no_js"]}}
    today = load_config(base)
    assert today.trained_seeds("fedstain") == today.trained_seeds("past_v2") == [11, 22, 33, 44, 55]
    fewer = load_config({"train": {**base["train"], "comparator_seeds": [11, 33, 55]}})
    assert fewer.trained_seeds("fedstain") == fewer.trained_seeds("local_only") == [11, 33, 55]
    assert fewer.trained_seeds("past_v2") == fewer.trained_seeds("fedavg_peft") == [11, 22, 33, 44, 55]
    assert fewer.trained_seeds("v2_no_js") == [11, 33, 55]
    assert ("fedstain", 22) not in fewer.train_runs() and ("past_v2", 22) in fewer.train_runs()
    assert today.train_runs()[:5] == [("fedavg_peft", s) for s in (11, 22, 33, 44, 55)]
    # the default leaves every run identity as it was: the key never enters a training block
    from fedhisto.config.stage_blocks import stage_block

    assert stage_block(fewer, "train", method="fedstain", seed=11) == stage_block(today, "train", method="fedstain",
                                                                                  seed=11)
    with pytest.raises(ConfigError, match=r"train.comparator_seeds \[11, 77\] must be a non-empty subset"):
        load_config({"train": {**base["train"], "comparator_seeds": [11, 77]}})
