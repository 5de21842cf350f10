"""The site's node-local cache of decoded images (issue 24, cold start): keyed by the manifest's digest,
used only when the key matches, rebuilt when the manifest changes or the file is damaged."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fedhisto.federation.site as site_mod
from fedhisto.federation.site import load_site_split
from fedhisto.train.loop import ClientUnavailable


def _manifest(tmp: Path, n: int = 4) -> Path:
    rows = []
    for i in range(n):
        path = tmp / f"img{i}.png"
        Image.fromarray(np.full((20, 30, 3), 40 * i, dtype=np.uint8)).save(path)
        rows.append({"sample_id": f"{i:016x}", "path": str(path), "label": ("ACA", "Normal", "SCC")[i % 3],
                     "client": "C1", "split": "optimisation"})
    out = tmp / "manifest.csv"
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out


def test_decoded_images_come_from_the_cache_until_the_manifest_changes(tmp_path, monkeypatch):
    manifest, cache = _manifest(tmp_path), tmp_path / "cache"
    monkeypatch.setattr(site_mod, "_DATA", {})
    first = load_site_split(str(manifest), "C1", "optimisation", 16, str(cache))
    files = list(cache.glob("decoded-C1-optimisation-*.safetensors"))
    assert len(files) == 1 and len(first) == 4

    decoded = []
    real = site_mod._load
    monkeypatch.setattr(site_mod, "_load", lambda p, e: decoded.append(p) or real(p, e))
    monkeypatch.setattr(site_mod, "_DATA", {})  # a fresh process: nothing in memory
    again = load_site_split(str(manifest), "C1", "optimisation", 16, str(cache))
    assert decoded == [] and again.ids == first.ids and again.labels == first.labels
    assert all(np.array_equal(a, b) for a, b in zip(again.images, first.images, strict=True))

    text = manifest.read_text().replace("SCC", "ACA")  # any change to the manifest is a new key
    manifest.write_text(text)
    monkeypatch.setattr(site_mod, "_DATA", {})
    changed = load_site_split(str(manifest), "C1", "optimisation", 16, str(cache))
    assert len(decoded) == 4 and changed.labels != first.labels
    assert len(list(cache.glob("decoded-C1-optimisation-*.safetensors"))) == 2

    newest = max(cache.glob("decoded-*.safetensors"), key=lambda p: p.stat().st_mtime)
    newest.write_bytes(b"truncated")  # a damaged file is decoded again and replaced
    monkeypatch.setattr(site_mod, "_DATA", {})
    load_site_split(str(manifest), "C1", "optimisation", 16, str(cache))
    assert len(decoded) == 8 and newest.stat().st_size > 100


def test_an_undecodable_image_names_its_sample_id_not_its_path(tmp_path, monkeypatch):
    manifest = _manifest(tmp_path)
    (tmp_path / "img2.png").write_bytes(b"\x89PNG broken")
    monkeypatch.setattr(site_mod, "_DATA", {})
    with pytest.raises(ClientUnavailable) as err:
        load_site_split(str(manifest), "C1", "optimisation", 16, str(tmp_path / "cache"))
    assert "site C1: image 0000000000000002 cannot be decoded" in str(err.value)
    assert str(tmp_path) not in str(err.value)
    assert not list((tmp_path / "cache").glob("decoded-*"))  # nothing half-decoded is cached
