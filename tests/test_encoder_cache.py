"""The frozen encoder as a file in the node's cache (issue 24 item 4): a second process reads the file
instead of building the encoder, the result is the built encoder bit for bit, and a file of another
key (other encoder, other code) or a damaged one is rebuilt and overwritten."""

from __future__ import annotations

import pytest
import torch

import fedhisto.federation.site as site_mod
from fedhisto.config.study import load_config
from fedhisto.federation.encoder_cache import encoder_cache_file

TINY = {"model": {"encoder": {"name": "tiny", "require_pretrained": False}, "adapter_hidden": 16, "film_hidden": 16}}


@pytest.fixture
def fresh_process(monkeypatch):
    """Empty per-process caches and a count of real encoder builds (``load_encoder`` calls)."""
    import fedhisto.model.encoder as encoder_mod

    builds = []
    real = encoder_mod.load_encoder

    def counted(cfg, folder=None):
        builds.append(folder)
        return real(cfg, folder)

    monkeypatch.setattr(encoder_mod, "load_encoder", counted)

    def reset():
        monkeypatch.setattr(site_mod, "_ENCODERS", {})
        monkeypatch.setattr(site_mod, "_MODELS", {})

    reset()
    return builds, reset


def assert_same_encoder(a, b) -> None:
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert sa.keys() == sb.keys() and len(sa) > 10
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert not b.module.training and not any(p.requires_grad for p in b.parameters())
    pixels = torch.rand(3, 3, 48, 48, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.embed(pixels), b.embed(pixels))


@pytest.mark.parametrize("pretrained", [False, True], ids=["random-recipe", "pretrain-folder"])
def test_a_second_process_reads_the_encoder_file_bitwise(tmp_path, fresh_process, pretrained):
    builds, reset = fresh_process
    cfg = load_config(TINY)
    folder = ""
    if pretrained:  # the pipeline-pretrained tiny encoder: a folder of weights unlike the seed-0 recipe
        from fedhisto.model.encoder import random_encoder

        torch.manual_seed(123)
        random_encoder("tiny").save(tmp_path / "pretrained")
        folder = str(tmp_path / "pretrained")
    cache = tmp_path / "cache"
    first = site_mod.frozen_encoder(cfg, folder, str(cache))
    path, key = encoder_cache_file(cache, cfg, folder)
    assert builds == [folder or None] and path.exists()
    assert torch.load(path, weights_only=True)["key"] == key

    reset()  # a restarted worker: nothing in memory, the file on disk
    second = site_mod.frozen_encoder(cfg, folder, str(cache))
    assert builds == [folder or None]  # not built again
    assert_same_encoder(first, second)
    reset()
    assert_same_encoder(first, site_mod.frozen_encoder(cfg, folder, ""))  # and the rebuilt one, without a cache
    assert len(builds) == 2

    # the model a site builds on it is the same model, bit for bit
    from fedhisto.methods import build_method
    from fedhisto.model.build import build_model

    method = build_method("past_v2", cfg)
    a = build_model(cfg, method, 11, folder or None)
    b = build_model(cfg, method, 11, folder or None, encoder=second)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_file_of_another_key_or_a_damaged_file_is_rebuilt_and_overwritten(tmp_path, fresh_process, monkeypatch):
    builds, reset = fresh_process
    cfg = load_config(TINY)
    cache = tmp_path / "cache"
    built = site_mod.frozen_encoder(cfg, "", str(cache))
    path, key = encoder_cache_file(cache, cfg, "")

    # another key under this file name (as if the file were copied from another node's cache)
    doc = torch.load(path, weights_only=True)
    torch.save({**doc, "key": "0" * 64, "state": {k: v + 1 for k, v in doc["state"].items()}}, path)
    reset()
    again = site_mod.frozen_encoder(cfg, "", str(cache))
    assert len(builds) == 2 and torch.load(path, weights_only=True)["key"] == key
    assert_same_encoder(built, again)

    path.write_bytes(path.read_bytes()[:1000])  # truncated
    reset()
    assert_same_encoder(built, site_mod.frozen_encoder(cfg, "", str(cache)))
    assert len(builds) == 3 and torch.load(path, weights_only=True)["key"] == key

    # other code, or another encoder config, is another key: another file, never this one
    import fedhisto.infra.code_identity as ci

    monkeypatch.setattr(ci, "code_identity", lambda: {"source_digest": "other code"})
    assert encoder_cache_file(cache, cfg, "")[0] != path
    monkeypatch.undo()
    other = load_config({**TINY, "model": {**TINY["model"], "encoder": {"name": "tiny", "require_pretrained": True}}})
    assert encoder_cache_file(cache, other, "")[1] != key

def test_an_architecture_with_state_outside_its_state_dict_is_built_on_the_cpu_from_the_file(monkeypatch):
    """A module whose construction keeps a non-persistent buffer cannot come back from ``meta`` by
    assigning the state_dict alone: it is constructed on the CPU and loaded strictly."""
    import fedhisto.model.encoder as encoder_mod
    from fedhisto.federation.encoder_cache import encoder_from_state
    from fedhisto.model.encoder import FrozenEncoder, encoder_entry

    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.arange(4.0), persistent=False)

    monkeypatch.setattr(encoder_mod, "random_encoder", lambda name: FrozenEncoder(WithBuffer(), encoder_entry(name)))
    state = {"proj.weight": torch.full((4, 4), 0.5), "proj.bias": torch.ones(4)}
    enc = encoder_from_state("tiny", state)
    assert not any(t.is_meta for t in (*enc.module.parameters(), *enc.module.buffers()))
    assert torch.equal(enc.module.proj.weight, state["proj.weight"]) and torch.equal(enc.module.scale, torch.arange(4.0))
    with pytest.raises(RuntimeError, match="Missing key"):  # a state that does not fit is refused, not padded
        encoder_from_state("tiny", {"proj.weight": state["proj.weight"]})
