"""Files a run reads back from a results folder or a node's cache are data, never code: a training checkpoint
(resume, prediction, export) and a site's decoded-image cache. A file swapped in with a pickled object whose
``__reduce__`` runs code is refused without running it; the run goes on as the file's absence would let it."""

from __future__ import annotations

import copy
import json
import pathlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, train
from test_site_cache import _manifest  # a one-site manifest of small images

from fedhisto.config.study import load_config


class Payload:
    """Unpickling this creates ``marker``: the proof that a load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def crafted(path: Path, marker: Path, **doc) -> None:
    """A torch.save file that looks like the real one and runs code when unpickled."""
    torch.save({**doc, "payload": Payload(marker)}, path)


def _cfg(rounds: int = 2):
    tiny = copy.deepcopy(TINY)
    tiny["train"]["max_rounds"] = rounds
    return load_config(tiny)


def test_a_crafted_checkpoint_is_refused_without_running_and_a_real_one_is_plain_data(prepared, tmp_path):
    from fedhisto.predict.stage import PredictionRefused, load_eligible_checkpoint

    out = tmp_path / "run"
    cfg = _cfg()
    train(prepared, "fedadam", out, cfg=cfg)
    identity = json.loads(Path(prepared["identity"]).read_text())["dataset_identity"]
    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)  # our own file
    marker = tmp_path / "ran"

    swapped = tmp_path / "swapped"
    swapped.mkdir()
    crafted(swapped / "checkpoint.pt", marker, **ckpt)  # the real contents plus a payload
    train(prepared, "fedadam", swapped, cfg=cfg)  # set aside, and a fresh run instead of a resume
    assert not marker.exists()
    assert len(list(swapped.glob("checkpoint.refused-*.pt"))) == 1
    assert json.loads((swapped / "report.json").read_text())["resumed_at_rounds"] == []

    crafted(out / "checkpoint.pt", marker, **ckpt)
    with pytest.raises(PredictionRefused, match="never unpickled"):
        load_eligible_checkpoint(out, identity)  # prediction and export read it so
    assert not marker.exists()

    killed = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        train(prepared, "fedadam", killed, cfg=cfg, stop_after_round=1)
    saved = torch.load(killed / "checkpoint.pt", map_location="cpu", weights_only=True)  # torch's safe reader
    assert saved["round"] == 1 and saved["server_state"]["t"] == 1
    train(prepared, "fedadam", killed, cfg=cfg)  # and it resumes
    assert json.loads((killed / "report.json").read_text())["resumed_at_rounds"] == [1]
    done = torch.load(killed / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(done["best"]["members"]["global"][k], ckpt["best"]["members"]["global"][k])
               for k in ckpt["best"]["members"]["global"])  # the uninterrupted run's end, bitwise


def test_a_checkpoint_write_refuses_what_a_safe_read_could_not_read_back(tmp_path):
    from fedhisto.train.checkpoint import host_copy, save_checkpoint

    doc = {"format": 3, "history": [{"val": np.float64(0.5), "n": np.int64(3)}], "t": torch.ones(2),
           "arr": np.arange(3)}
    plain = host_copy(doc)
    assert type(plain["history"][0]["val"]) is float and type(plain["history"][0]["n"]) is int
    assert torch.equal(plain["arr"], torch.arange(3))
    with pytest.raises(TypeError, match=r"checkpoint\['server_state'\]\['x'\]: a pathlib.*PosixPath is not plain"):
        save_checkpoint(tmp_path / "c.pt", {"server_state": {"x": Path("/")}})
    assert not (tmp_path / "c.pt").exists()


def test_a_crafted_file_in_a_sites_image_cache_is_never_unpickled(tmp_path, monkeypatch):
    import fedhisto.federation.site as site_mod
    from fedhisto.federation.site import load_site_split

    manifest, cache = _manifest(tmp_path, n=3), tmp_path / "cache"
    monkeypatch.setattr(site_mod, "_DATA", {})
    first = load_site_split(str(manifest), "C1", "optimisation", 16, str(cache))
    (written,) = list(cache.iterdir())
    assert not written.read_bytes().startswith(b"PK\x03\x04")  # not torch.save's zip container: no pickle
    marker = tmp_path / "ran"
    path, key = site_mod._cache_file(str(cache), manifest.read_bytes(), "C1", "optimisation", 16)
    assert path == written
    crafted(path, marker, key=key, ids=list(first.ids), labels=list(first.labels), images=list(first.images))
    monkeypatch.setattr(site_mod, "_DATA", {})
    again = load_site_split(str(manifest), "C1", "optimisation", 16, str(cache))
    assert not marker.exists()
    assert again.ids == first.ids and all(np.array_equal(a, b) for a, b in zip(again.images, first.images, strict=True))
