"""The dose-response experiment's encoder conditions: the built-in tiny ones leave every run as it was; an
encoder entry is its own condition with its encoder, input size, normalisation and resources."""

from __future__ import annotations

import pytest

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import load_config
from fedhisto.experiments import dose_response as X
from fedhisto.experiments import layout
from fedhisto.registries.encoder_registry import HIBOU_MEAN, HIBOU_STD, IMAGENET_MEAN, encoder_entry

ENTRY = {"label": "hibou", "name": "hibou-b", "local_dir": "/data/hibou-b", "normalisation": "encoder"}


def test_default_dose_response_encoders_leave_every_condition_as_it_was():
    cfg = load_config({})
    assert cfg.experiments.dose_response.model_dump(mode="json")["encoders"] == ["stain_invariant", "plain"]
    for condition in X.encoder_conditions(cfg):
        assert X.condition_config(cfg, condition) is cfg  # the main config: run identities unchanged
    assert X.encoder_pattern(cfg) == "stain_invariant|plain"
    assert X.entry_pattern(cfg) == "(?!)"  # matches nothing: the entry rule never applies
    assert X.shifted_block(cfg, "past_v2", 11, "plain") == X.shifted_block(cfg, "past_v2", 11)


def test_an_encoder_entry_is_its_own_condition_with_its_encoder_and_views():
    cfg = load_config({"model": {"encoder": {"name": "tiny"}, "pretrain": {"enabled": True}}, "views": {"crop_size": 48},
                       "experiments": {"dose_response": {"encoders": ["stain_invariant", ENTRY]}}})
    assert cfg.experiments.dose_response.labels() == ["stain_invariant", "hibou"]
    c = X.condition_config(cfg, "dose_response/hibou")
    assert (c.model.encoder.name, c.model.encoder.local_dir) == ("hibou-b", "/data/hibou-b")
    # the registry entry's input size and (normalisation: encoder) its own statistics
    assert c.model.pretrain.enabled is False and c.views.crop_size == 224 and c.views.mean == HIBOU_MEAN
    assert c.views.std == HIBOU_STD and c.views.normalisation == "encoder"
    assert c.model.encoder.revision == encoder_entry("hibou-b").revision  # the registry's pin
    uni = X.condition_config(load_config({"experiments": {"dose_response": {"encoders": [
        {"label": "uni", "name": "uni", "local_dir": "/d", "crop_size": 112}]}}}), "dose_response/uni")
    assert (uni.model.encoder.name, uni.views.crop_size, uni.views.mean) == ("uni", 112, IMAGENET_MEAN)
    assert (cfg.model.encoder.name, cfg.views.crop_size, cfg.model.pretrain.enabled) == ("tiny", 48, True)  # main as given
    assert X.condition_inputs(cfg, "dose_response/hibou")["encoder"] == []  # its weights: the entry's folder
    assert X.condition_inputs(cfg, "dose_response/stain_invariant")["encoder"] == ["results/pretrain/encoder"]
    assert layout.run_dir(cfg, "dose_response/hibou", "train", "past_v2", 11) == \
        "results/experiments/dose_response/hibou/train/past_v2/seed11"
    main_block = stage_block(cfg, "train", method="past_v2", seed=11)
    entry_block = stage_block(c, "train", method="past_v2", seed=11)
    assert entry_block["model"]["encoder"]["name"] == "hibou-b" and main_block != entry_block
    assert X.entry_resources(cfg, "hibou") == {"mem_mb": encoder_entry("hibou-b").resources.train_mem_mb,
                                               "runtime": encoder_entry("hibou-b").resources.train_runtime, "gpu": 1}
    assert X.entry_pattern(cfg) == "hibou"
    assert len(X.shifted_predictions(cfg)) == 2 * len(X.dose_methods(cfg)) * len(cfg.experiments.seeds)  # + the stain arm


@pytest.mark.parametrize("entries, message", [
    ([{**ENTRY, "label": "plain"}], "built-in condition"),
    ([ENTRY, ENTRY], "labels must be distinct"),
    ([{**ENTRY, "name": "uni-nope"}], "hibou-b"),  # the unknown name is refused with the allowed ones
    ([{**ENTRY, "label": "Bad Label"}], "pattern"),
])
def test_bad_encoder_entries_are_refused(entries, message):
    with pytest.raises(Exception, match=message):
        load_config({"experiments": {"dose_response": {"encoders": ["stain_invariant", *entries]}}})
