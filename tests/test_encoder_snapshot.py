"""Jobs load a hub encoder from a local snapshot and never download; ``fedhisto fetch-encoder`` puts it there.

The network has no Hugging Face hub, so the hub is a stand-in: ``snapshot_download`` replaced by one that
writes HIBOU-B's exact architecture with random weights (``study_layouts.save_random_hibou_b``) into the
Hugging Face cache layout (``models--org--name/snapshots/<commit>``, ``refs/<revision>``). The job's side is
huggingface_hub's own ``snapshot_download(local_files_only=True)`` reading that cache, with every socket
connection refused, so a download attempt would fail the test.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
from study_layouts import save_random_hibou_b

from fedhisto.config.study import load_config
from fedhisto.model.encoder import load_encoder
from fedhisto.model.encoder_families import EncoderLoadError

CFG = {"model": {"encoder": {"name": "hibou-b"}, "pretrain": {"enabled": False}}}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache of this test, and no network."""
    import huggingface_hub.constants as hf

    cache = tmp_path / "hf"
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield cache
    assert attempts == [], "a job tried to reach the network"


def fake_hub(cache, calls):
    """``snapshot_download`` of a hub holding random HIBOU-B weights at any revision (fetch side)."""

    def download(repo_id, revision, allow_patterns=None, local_dir=None, local_files_only=False, **kwargs):
        calls.append({"repo_id": repo_id, "revision": revision, "local_dir": local_dir,
                      "local_files_only": local_files_only})
        assert not local_files_only
        if local_dir:
            return str(save_random_hibou_b(local_dir))
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(COMMIT)
        return str(save_random_hibou_b(repo / "snapshots" / COMMIT))

    return download


def test_a_job_without_the_snapshot_stops_with_the_command_to_run_and_never_downloads(offline_cache):
    cfg = load_config(CFG)
    with pytest.raises(EncoderLoadError, match=r"no local snapshot of histai/hibou-b@7fdc8cce.*Jobs never download: "
                                               r"run `fedhisto fetch-encoder --config"):
        load_encoder(cfg.model.encoder)


def test_fetch_encoder_fills_the_cache_and_every_job_then_loads_from_it(offline_cache, monkeypatch, capsys):
    import huggingface_hub

    from fedhisto.cli import main
    from fedhisto.infra.provenance import digest_path
    from fedhisto.model.build import encoder_digest

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub(offline_cache, calls))
    config = offline_cache.parent / "config.yaml"
    config.write_text(json.dumps(CFG))
    assert main(["fetch-encoder", "--config", str(config)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert calls == [{"repo_id": "histai/hibou-b", "revision": "7fdc8cce365ebfd9e7e60e6e9a8d4d59388f3c",
                      "local_dir": None, "local_files_only": False}]
    assert report["downloaded"] and report["folder"].endswith(f"snapshots/{COMMIT}")
    monkeypatch.undo()  # the job's side: huggingface_hub's own cache lookup, offline
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(offline_cache))
    cfg = load_config(CFG)
    encoder = load_encoder(cfg.model.encoder)
    from safetensors.torch import load_file

    from fedhisto.model.encoder_families import FAMILIES

    state = encoder.module.state_dict()
    fetched = FAMILIES["transformers"].translate(encoder.entry, load_file(f"{report['folder']}/model.safetensors"),
                                                 set(state))  # the hub layout's names mapped onto the module's
    assert len(fetched) > 200 and all(torch.equal(state[k], fetched[k]) for k in fetched)
    assert report["digest"] == digest_path(report["folder"])
    assert encoder_digest(cfg, None) != report["digest"]  # a hub run's identity is its pinned revision, not the folder


def test_fetch_encoder_into_a_folder_names_the_config_line(offline_cache, monkeypatch, tmp_path):
    import huggingface_hub

    from fedhisto.model.snapshot import fetch_encoder

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub(offline_cache, calls))
    out = fetch_encoder(load_config(CFG), tmp_path / "hibou-b")
    assert out["note"] == f"set model.encoder.local_dir: {tmp_path / 'hibou-b'}" and calls[0]["local_dir"]
    local = load_config({"model": {"encoder": {"name": "hibou-b", "local_dir": str(tmp_path / "hibou-b")},
                                   "pretrain": {"enabled": False}}})
    assert fetch_encoder(local)["downloaded"] is False  # a local folder: checked, nothing downloaded
    assert len(calls) == 1
