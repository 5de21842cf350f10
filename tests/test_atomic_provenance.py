from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedhisto.infra.atomic import atomic_path, write_json, write_text
from fedhisto.infra.provenance import (
    config_hash,
    cpu_caches,
    digest_path,
    provenance_block,
    read_sidecar,
    sha256_bytes,
    verify_sidecar,
    write_sidecar,
)


def test_failed_write_leaves_nothing_and_keeps_old(tmp_path: Path):
    target = tmp_path / "a.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert json.loads(target.read_text()) == {"v": 1}
    assert list(tmp_path.iterdir()) == [target]


def test_artifacts_get_the_mode_of_a_new_file_not_mkstemps_0600(tmp_path: Path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644  # group and others may read results


def test_config_hash_ignores_key_order_but_not_values():
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_sidecar_records_everything_and_detects_tampering(tmp_path: Path):
    inp = tmp_path / "in.txt"
    inp.write_text("input")
    art = tmp_path / "out.csv"
    art.write_text("x\n1\n")
    write_sidecar(art, provenance_block("demo", {"k": 1}, {"in": inp}))
    meta = read_sidecar(art)
    assert meta["schema_version"] == 1
    assert meta["stage"] == "demo"
    assert meta["inputs"] == {"in": sha256_bytes(b"input")}
    assert meta["config_hash"] == config_hash({"k": 1})
    assert meta["artifact"]["sha256"] == sha256_bytes(b"x\n1\n")
    assert {"package_version", "git_commit", "created_utc"} <= meta.keys()
    verify_sidecar(art)
    art.write_text("x\n2\n")
    with pytest.raises(ValueError, match="differs from its sidecar"):
        verify_sidecar(art)


def test_directory_digest_covers_names_and_bytes(tmp_path: Path):
    d = tmp_path / "d"
    (d / "s").mkdir(parents=True)
    (d / "s" / "a").write_bytes(b"1")
    first = digest_path(d)
    (d / "s" / "a").rename(d / "s" / "b")
    assert digest_path(d) != first


def _cache_index(root: Path, name: str, level: str, kind: str, size: str) -> None:
    index = root / name
    index.mkdir(parents=True)
    for field, value in (("level", level), ("type", kind), ("size", size)):
        (index / field).write_text(value + "\n")


def test_cpu_caches_lists_every_level_in_sysfs_order_and_none_where_sysfs_is_silent(tmp_path: Path):
    _cache_index(tmp_path, "index0", "1", "Data", "48K")
    _cache_index(tmp_path, "index1", "1", "Instruction", "32K")
    _cache_index(tmp_path, "index2", "2", "Unified", "1024K")
    _cache_index(tmp_path, "index3", "3", "Unified", "32768K")
    assert cpu_caches(tmp_path) == "L1d 48K, L1i 32K, L2 1024K, L3 32768K"
    assert cpu_caches(tmp_path / "absent") is None
    (tmp_path / "index3" / "size").unlink()  # a half-listed cache says nothing rather than a partial answer
    assert cpu_caches(tmp_path) is None
