"""What travels between the ServerApp and the ClientApps, as Flower records: one generic codec.

Every tensor travels in an ``ArrayRecord`` (dtype and shape round-trip exactly, bool masks included);
the structure around the tensors (dataclasses, dicts, lists, tuples, numbers, strings, None) travels
as JSON in a ``ConfigRecord``. A hook value of any of those shapes is stored under a record-name
prefix (``{prefix}`` for its tensors, ``{prefix}#meta`` for its structure), so a method's new upload
or payload type needs no edit here. Dataclasses are rebuilt by import path, and only classes of the
``fedhisto`` package (or its plugins' registered modules, ``ALLOWED_MODULES``) are: a message never
makes a site import code of the sender's choosing.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

#: Module prefixes whose dataclasses may be rebuilt from a message.
ALLOWED_MODULES = ["fedhisto."]


PACKED, LAYOUT = "packed", "packed#layout"


def state_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A trainable state dict as an ArrayRecord of two arrays: every tensor's bytes in one uint8 buffer
    and their layout (name, dtype, shape, offset) as JSON bytes.

    Why packed: Flower moves each array of a record as its own object, one HTTP request per object
    and hop (ServerApp -> SuperLink -> SuperNode -> ClientApp and back), so a state of ~50 LoRA,
    adapter and head tensors cost ~50 requests per hop, each with its own TLS round trip; packed it
    costs two. Bytes and dtypes round-trip exactly (``torch.Tensor.view(torch.uint8)``)."""
    layout, chunks, offset = [], [], 0
    for k, v in state.items():
        t = v.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        layout.append([k, str(t.dtype).removeprefix("torch."), list(t.shape), offset, raw.numel()])
        chunks.append(raw)
        offset += raw.numel()
    buf = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    meta = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8)
    return ArrayRecord({PACKED: buf, LAYOUT: meta})


def record_state(record: ArrayRecord) -> dict[str, torch.Tensor]:
    arrays = record.to_torch_state_dict()
    if set(arrays) != {PACKED, LAYOUT}:
        return dict(arrays)  # an unpacked record (one array per tensor)
    buf = arrays[PACKED]
    out = {}
    for name, dtype, shape, offset, n in json.loads(bytes(arrays[LAYOUT].numpy()).decode()):
        out[name] = buf[offset:offset + n].clone().view(getattr(torch, dtype)).reshape(shape)
    return out


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON structure of ``value``; its tensors go into ``tensors`` under running keys."""
    if value is None or isinstance(value, bool | str):
        return {"t": "plain", "v": value}
    if isinstance(value, int | float):
        return {"t": type(value).__name__, "v": value}
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value
        return {"t": "tensor", "k": key}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {"t": "dataclass", "cls": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: _encode(getattr(value, f.name), tensors) for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        return {"t": "dict", "items": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return {"t": type(value).__name__, "items": [_encode(v, tensors) for v in value]}
    raise TypeError(f"no record encoding for {type(value).__name__}: hook values are tensors, dataclasses, dicts, "
                    "lists, tuples, numbers, strings or None")


def _dataclass(path: str) -> type:
    module, _, qualname = path.partition(":")
    if not any(module == m.rstrip(".") or module.startswith(m) for m in ALLOWED_MODULES):
        raise ValueError(f"refusing to rebuild {path}: not a dataclass of {', '.join(ALLOWED_MODULES)}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"refusing to rebuild {path}: not a dataclass")
    return obj


def _decode(node: dict, tensors: dict[str, torch.Tensor]) -> Any:
    kind = node["t"]
    if kind == "plain":
        return node["v"]
    if kind == "int":
        return int(node["v"])
    if kind == "float":
        return float(node["v"])
    if kind == "tensor":
        return tensors[node["k"]]
    if kind == "dataclass":
        return _dataclass(node["cls"])(**{k: _decode(v, tensors) for k, v in node["fields"].items()})
    if kind == "dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in node["items"]}
    if kind in ("list", "tuple"):
        items = [_decode(v, tensors) for v in node["items"]]
        return items if kind == "list" else tuple(items)
    raise ValueError(f"unknown record node kind {kind!r}")


def put_value(rd: RecordDict, prefix: str, value: Any) -> None:
    """Store one hook value under ``prefix`` (its tensors, then its structure)."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        meta = _encode(value, tensors)
    except TypeError as exc:
        raise TypeError(f"{prefix}: {exc}") from None
    if tensors:
        rd[prefix] = state_record(tensors)
    rd[f"{prefix}#meta"] = ConfigRecord({"json": json.dumps(meta)})


def get_value(rd: RecordDict, prefix: str) -> Any:
    meta = json.loads(str(rd[f"{prefix}#meta"]["json"]))
    tensors = record_state(rd[prefix]) if prefix in rd else {}
    return _decode(meta, tensors)


def put_payload(rd: RecordDict, payload: dict[str, Any]) -> None:
    """``configure_train``'s payload of one participant (e.g. prototypes, a style pool)."""
    rd["payload#keys"] = ConfigRecord({"keys": sorted(payload)})
    for key in sorted(payload):
        put_value(rd, f"payload:{key}", payload[key])


def get_payload(rd: RecordDict) -> dict[str, Any]:
    return {key: get_value(rd, f"payload:{key}") for key in rd["payload#keys"]["keys"]}


def put_members(rd: RecordDict, members: dict[str, dict[str, torch.Tensor]]) -> None:
    rd["members#keys"] = ConfigRecord({"keys": sorted(members)})
    for name in sorted(members):
        rd[f"member:{name}"] = state_record(members[name])


def get_members(rd: RecordDict) -> dict[str, dict[str, torch.Tensor]]:
    return {name: record_state(rd[f"member:{name}"]) for name in rd["members#keys"]["keys"]}


def payload_bytes(rd: RecordDict) -> int:
    """Bytes of the tensors in a RecordDict (for the per-round traffic in the history)."""
    return sum(int(arr.numpy().nbytes) for rec in rd.array_records.values() for key, arr in rec.items()
               if key != LAYOUT)

