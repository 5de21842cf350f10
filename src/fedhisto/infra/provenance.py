"""Artifact versioning: every stage output carries a provenance sidecar.

Sidecar scheme (``<artifact>.prov.json``, documented in the README):

- ``schema_version``: version of this sidecar layout (bumped on incompatible change);
- ``artifact``: file name and SHA-256 of the artifact itself;
- ``stage``: pipeline stage that wrote it;
- ``package_version`` and ``git_commit`` (``+dirty`` when the tree had local changes);
- ``config_hash``: SHA-256 of the canonical JSON of the stage's config block, so a changed
  parameter is visible without diffing YAML;
- ``inputs``: SHA-256 digest of every input file (directories are digested as a sorted
  list of member digests).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from fedhisto import __version__
from fedhisto.infra.atomic import write_json

SIDECAR_SCHEMA_VERSION = 1
SIDECAR_SUFFIX = ".prov.json"


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> str:
    """Key-sorted, whitespace-free JSON: equal configs hash equally whatever their YAML order."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(block: Any) -> str:
    return sha256_bytes(canonical_json(block).encode("utf-8"))


def digest_path(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    if p.is_dir():
        members = sorted(q for q in p.rglob("*") if q.is_file())
        lines = [f"{q.relative_to(p).as_posix()}:{sha256_file(q)}" for q in members]
        return sha256_bytes("\n".join(lines).encode("utf-8"))
    return sha256_file(p)


@lru_cache(maxsize=1)
def git_commit() -> str:
    """Commit of the source tree this package runs from, ``+dirty`` if modified, else ``unknown``."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


def provenance_block(
    stage: str,
    config_block: Any,
    inputs: Mapping[str, str | os.PathLike[str]] | Iterable[str | os.PathLike[str]] = (),
) -> dict[str, Any]:
    """The provenance fields shared by sidecars and embedded blocks (JSON reports)."""
    if isinstance(inputs, Mapping):
        named = {str(k): v for k, v in inputs.items()}
    else:
        named = {str(v): v for v in inputs}
    return {
        "schema_version": SIDECAR_SCHEMA_VERSION,
        "stage": stage,
        "package_version": __version__,
        "git_commit": git_commit(),
        "config_hash": config_hash(config_block),
        "inputs": {name: digest_path(p) for name, p in sorted(named.items())},
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def sidecar_path(artifact: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(artifact)}{SIDECAR_SUFFIX}")


def write_sidecar(artifact: str | os.PathLike[str], block: Mapping[str, Any]) -> Path:
    """Write ``<artifact>.prov.json`` for an artifact that already exists."""
    art = Path(artifact)
    payload = dict(block)
    payload["artifact"] = {"name": art.name, "sha256": digest_path(art)}
    out = sidecar_path(art)
    write_json(out, payload)
    return out


def read_sidecar(artifact: str | os.PathLike[str]) -> dict[str, Any]:
    path = sidecar_path(artifact)
    if not path.exists():
        raise FileNotFoundError(f"provenance sidecar missing for {artifact}: expected {path}")
    return json.loads(path.read_text())


def verify_sidecar(artifact: str | os.PathLike[str]) -> None:
    """Raise if the artifact's bytes no longer match what its sidecar recorded."""
    meta = read_sidecar(artifact)
    actual = digest_path(artifact)
    if meta.get("artifact", {}).get("sha256") != actual:
        raise ValueError(f"{artifact}: content digest {actual} differs from its sidecar {sidecar_path(artifact)}")


def cpu_caches(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> str | None:
    """CPU 0's caches as the kernel lists them, e.g. "L1d 48K, L1i 32K, L2 1024K, L3 32768K"; None where
    sysfs does not say. Two virtual machines both named "AMD EPYC" gave different float results for the
    same code and build (docs/methods.md); CPU kernels may block their loops by cache
    size, so this is what tells such hosts apart in a result's runtime block."""
    short = {"Data": "d", "Instruction": "i", "Unified": ""}
    entries = []
    for index in sorted(sysfs.glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            return None
        entries.append(f"L{level}{short.get(kind, kind)} {size}")
    return ", ".join(entries) or None


def runtime_block(device: object | None = None) -> dict[str, Any]:
    """What a numerical result depends on beyond code and config: library versions, device and CPU/GPU
    model, thread count and determinism flags (README: bitwise only on the same machine and build)."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    # str(): torch.__version__ is a TorchVersion, and a warm job's process would import torch (1-2 s of CPU)
    # just to unpickle it from its child's reply (fedhisto.infra.warm_server)
    return {"torch": str(torch.__version__), "python": platform.python_version(), "device": str(device),
            "cpu": cpu, "cpu_caches": cpu_caches(), "gpu": gpu, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark}
