"""A run's ``checkpoint.pt``: written atomically after every round, read back without running code, and its
states put back on the device the run computes on.

**Safe to read.** The file is a ``torch.save`` of plain data only: tensors (on the host), numbers, strings,
booleans, None, lists, tuples and dicts. It is read with ``torch.load(weights_only=True)``, torch's
restricted unpickler, which builds those types and nothing else: a file swapped into a shared results
folder that carries a pickled object with code (``__reduce__``), or anything but plain data, is refused
(``ResumeRefused``) before any of it runs. Writing checks the same rule first (``host_copy``), so a run
never writes a checkpoint it could not read back: a NumPy number becomes a Python one, a NumPy array a
tensor, anything else stops the write naming its place in the checkpoint. The random generators' states
are stored in the same plain form (NumPy's as a dict with its key as a tensor).

**Back on the device.** Tensors are stored on the host (a checkpoint written on a GPU reads on a CPU
machine). On resume the member states (the latest and the best) go to the device the run's model is on,
where a fresh run keeps them; a method's server state goes back where it was when it was written: each
tensor that was on a device, to the run's device, each that was on the host (a method that keeps its
server state there), to the host. So a resumed round computes with its tensors where the uninterrupted
round had them (``tests/test_device_path.py`` runs a resume on a device that is not the CPU).
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhisto.infra.atomic import atomic_path

#: 3: plain data only (weights_only), the server state's placement recorded; 2 held NumPy objects
CHECKPOINT_FORMAT = 3
IDENTITY_KEYS = ("method", "seed", "config_hash", "dataset_identity", "descriptor_digest", "encoder_digest")
#: the parts of a checkpoint that hold a method's server state (placement recorded at write)
SERVER_STATES = (("server_state",), ("best", "server_state"))
PLAIN = (str, int, float, bool, type(None))


class ResumeRefused(RuntimeError):
    """A checkpoint belongs to another method, seed, configuration, dataset, descriptor set or encoder, or
    is not a checkpoint this release reads (not plain data: never unpickled with code)."""


def host_copy(obj: Any, where: str = "checkpoint") -> Any:
    """``obj`` as plain data on the host (module docstring); ``where`` names the place in errors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, PLAIN)]
        if bad:
            raise TypeError(f"{where}: key {bad[0]!r} of type {type(bad[0]).__name__} is not plain data")
        return {k: host_copy(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, PLAIN):
        return obj
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} is not plain data (tensors, "
                    "numbers, strings, lists, tuples, dicts); a checkpoint holds nothing that needs code to read")


def _tensors(obj: Any, path: tuple = ()):
    """(path, tensor) of every tensor in ``obj``."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, (*path, i))


def _part(ckpt: dict, keys: tuple) -> Any:
    for k in keys:
        ckpt = ckpt.get(k) if isinstance(ckpt, dict) else None
    return ckpt


def placement(ckpt: dict) -> dict[str, list]:
    """Per server-state part: the paths of its tensors that are on a device (not the host)."""
    return {"/".join(keys): [list(p) for p, t in _tensors(_part(ckpt, keys)) if t.device.type != "cpu"]
            for keys in SERVER_STATES}


def _moved(obj: Any, device: torch.device, paths: set[tuple] | None, path: tuple = ()) -> Any:
    """``obj`` with its tensors (those at ``paths``; None: all) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device) if paths is None or path in paths else obj
    if isinstance(obj, dict):
        return {k: _moved(v, device, paths, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_moved(v, device, paths, (*path, i)) for i, v in enumerate(obj))
    return obj


def to_device(ckpt: dict, device: torch.device) -> dict:
    """The checkpoint's member states on ``device``, its server states where they were written from."""
    ckpt["members"] = _moved(ckpt["members"], device, None)
    ckpt["best"]["members"] = _moved(ckpt["best"]["members"], device, None)
    where = ckpt.get("placement", {})
    for keys in SERVER_STATES:
        parent = _part(ckpt, keys[:-1]) if len(keys) > 1 else ckpt
        paths = {tuple(p) for p in where.get("/".join(keys), [])}
        if paths and parent.get(keys[-1]) is not None:
            parent[keys[-1]] = _moved(parent[keys[-1]], device, paths)
    return ckpt


def rng_states() -> dict:
    """Python's, NumPy's (legacy global) and torch's CPU generator states, as plain data."""
    np_state = np.random.get_state(legacy=False)
    return {"python": random.getstate(),
            "numpy": {**np_state, "state": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                                            "pos": int(np_state["state"]["pos"])}},
            "torch": torch.get_rng_state()}


def set_rng_states(rng: dict) -> None:
    random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
    np_state = rng["numpy"]
    np.random.set_state({**np_state, "state": {"key": np_state["state"]["key"].numpy().astype(np.uint32),
                                               "pos": np_state["state"]["pos"]}})
    torch.set_rng_state(rng["torch"])


def save_checkpoint(path: Path, ckpt: dict) -> None:
    """Atomically: the checkpoint as plain host data, with the generators' states and where its server
    states live."""
    doc = host_copy({**ckpt, "placement": placement(ckpt), "rng": rng_states()})
    with atomic_path(path) as tmp:
        torch.save(doc, tmp)


def read_checkpoint(path: Path) -> dict:
    """The file's contents, on the host, read by torch's restricted unpickler: anything that is not plain
    data (code, an object of any class) is refused, never run."""
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ResumeRefused(f"{path}: not a checkpoint this release reads (it holds more than tensors, numbers, "
                            f"strings, lists and dicts, and is never unpickled with code: {first}). Delete it "
                            "to start over.") from None
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ResumeRefused(f"{path}: checkpoint format {found} is not {CHECKPOINT_FORMAT}; delete it to start over")
    return doc


def load_checkpoint(path: Path, identity: dict, device: torch.device | None = None) -> dict | None:
    """The checkpoint at ``path`` if its identity is the run's (None: no file), the generators reset to its
    states and, with ``device``, its states put back on the run's device (module docstring)."""
    if not path.exists():
        return None
    ckpt = read_checkpoint(path)
    differ = [k for k in IDENTITY_KEYS if ckpt["identity"].get(k) != identity[k]]
    if differ:
        detail = "; ".join(f"{k}: checkpoint {ckpt['identity'].get(k)!r} vs run {identity[k]!r}" for k in differ)
        raise ResumeRefused(f"{path}: refusing to resume, {detail}. Delete it to start over.")
    set_rng_states(ckpt.pop("rng"))
    return to_device(ckpt, device) if device is not None else ckpt
