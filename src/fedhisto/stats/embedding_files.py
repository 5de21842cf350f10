"""The embeddings file the ``predict`` stage writes beside its predictions (``embeddings.safetensors``).

One file per run: the global test cohort's embeddings in sample-id order, as safetensors (no pickle):

- ``adapted/<member>``: the adapted embedding z each model's classifier read (one tensor per model: one for a
  global model, one per client for ``local_only``), with the run's evaluation descriptor;
- ``frozen``: the frozen encoder's pooled embedding of the same images (LoRA off), the baseline every method
  started from; equal in every run of a config.

The sample ids, the cohort and the member order are in the safetensors metadata (strings only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedhisto.infra.atomic import write_with

EMBEDDINGS_FILE = "embeddings.safetensors"
ADAPTED = "adapted/"
FROZEN = "frozen"


class EmbeddingsFileError(RuntimeError):
    pass


@dataclass
class RunEmbeddings:
    ids: list[str]
    cohort: str
    adapted: dict[str, np.ndarray]  # member -> (N x dim)
    frozen: np.ndarray              # (N x dim)


def write_embeddings(path: str | Path, ids: list[str], cohort: str, adapted: dict[str, np.ndarray],
                     frozen: np.ndarray) -> None:
    from safetensors.numpy import save_file

    tensors = {f"{ADAPTED}{m}": np.ascontiguousarray(a, dtype=np.float32) for m, a in adapted.items()}
    tensors[FROZEN] = np.ascontiguousarray(frozen, dtype=np.float32)
    bad = [k for k, t in tensors.items() if t.shape[0] != len(ids)]
    if bad:
        raise EmbeddingsFileError(f"{path}: tensors {bad} do not have one row per sample id ({len(ids)})")
    meta = {"sample_ids": json.dumps(ids), "cohort": cohort, "members": json.dumps(list(adapted))}
    write_with(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_embeddings(path: str | Path) -> RunEmbeddings:
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise EmbeddingsFileError(f"{path}: missing; the predict stage writes it (rerun predict for this run)")
    with safe_open(str(path), "np") as f:
        meta = f.metadata() or {}
        if not {"sample_ids", "cohort", "members"} <= set(meta):
            raise EmbeddingsFileError(f"{path}: metadata lacks sample_ids/cohort/members; not a predict embeddings file")
        members = json.loads(meta["members"])
        adapted = {m: f.get_tensor(f"{ADAPTED}{m}").astype(np.float64) for m in members}
        frozen = f.get_tensor(FROZEN).astype(np.float64)
    ids = json.loads(meta["sample_ids"])
    for name, arr in [*adapted.items(), (FROZEN, frozen)]:
        if arr.shape[0] != len(ids) or not np.isfinite(arr).all():
            raise EmbeddingsFileError(f"{path}: tensor {name!r} {arr.shape} is not one finite row per sample id "
                                      f"({len(ids)})")
    return RunEmbeddings(ids, meta["cohort"], adapted, frozen)
